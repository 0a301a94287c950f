"""Video recording for any vector env: every env's camera tiled into one mp4 frame per reset and
per chunk step, optionally with the step, chunk reward, success and task drawn on each tile.

Frames come from the observations' cameras (``main_images``, ``wrist_images``) or, for envs
without cameras, from scene renders the simulator adds for the recorder (``RENDER_IMAGES``),
which the recorder removes from what it passes on.

A file starts at ``reset()`` (or at the first step after ``flush()``) and ends at the next
``reset()``, ``flush()`` or ``close()``. It is finished before any exception leaves the wrapper,
and at interpreter exit, so a run that dies with an exception still leaves playable files.

With ``per_episode`` each env's episode gets a file of its own instead, named
``<name>_<reset state>_<number>.mp4`` after the state it started from (the env's
``reset_state_names``, e.g. ``task003_init42_<task>`` for LIBERO), so that the episode of a
given task and init state is found by its name; it ends with the episode (also mid-chunk, at an
auto-reset) or at ``flush()``. Extra episodes that only fill a batch get no file.
"""

from __future__ import annotations

import math
import textwrap
import weakref
from pathlib import Path
from typing import Any

import imageio
import numpy as np
from PIL import Image, ImageDraw, ImageFont

from core.errors import EnvSetupError
from envs.protocol import RENDER_IMAGES

# the config keys read here (tests/test_schema.py: every schema key is read or refused)
CONFIG_KEYS = ("env.*.video_cfg.info_on_video", "env.*.video_cfg.per_episode", "env.*.video_cfg.fps",
               "env.*.video_cfg.video_base_dir")

MACRO_BLOCK = 16  # h264 wants frame sides divisible by this; frames are padded, never rescaled


def tile_frames(obs: dict[str, Any]) -> np.ndarray:
    """One frame [H, W, 3] uint8: each env's main (and wrist) image side by side, envs in a grid
    of ``ceil(sqrt(B))`` columns, padded with black to multiples of 16."""
    images = obs["main_images"]
    if "wrist_images" in obs:
        images = np.concatenate([images, obs["wrist_images"]], axis=2)
    b, h, w, _ = images.shape
    cols = math.ceil(math.sqrt(b))
    rows = math.ceil(b / cols)
    frame = np.zeros((_pad(rows * h), _pad(cols * w), 3), np.uint8)
    for i in range(b):
        r, c = divmod(i, cols)
        frame[r * h:(r + 1) * h, c * w:(c + 1) * w] = images[i]
    return frame


def _without_renders(obs: dict[str, Any]) -> dict[str, Any]:
    if RENDER_IMAGES not in obs:
        return obs
    return {k: v for k, v in obs.items() if k != RENDER_IMAGES}


def _pad(n: int) -> int:
    return -(-n // MACRO_BLOCK) * MACRO_BLOCK


class VideoRecorder:
    """Wraps a vector env (``reset``/``chunk_step``) and writes what its cameras see."""

    def __init__(self, env: Any, video_dir: str | Path, *, info_on_video: bool = True,
                 fps: int = 10, name: str = "envs", per_episode: bool = False):
        self.env = env
        self.video_dir = Path(video_dir)
        self.info_on_video = info_on_video
        self.fps = fps
        self.name = name
        self.per_episode = per_episode
        self.paths: list[Path] = []
        # one writer (tiled), or one per env (per_episode; None while an env idles)
        self._writers: list[Any] = [None] * (env.num_envs if per_episode else 1)
        self._closers: list[weakref.finalize | None] = [None] * len(self._writers)
        self._step = np.zeros(env.num_envs, np.int64)

    @classmethod
    def from_config(cls, env: Any, env_cfg: Any, name: str) -> VideoRecorder:
        video_cfg = env_cfg["video_cfg"]
        missing = [k for k in ("video_base_dir", "info_on_video", "fps", "per_episode")
                   if k not in video_cfg]
        if missing:
            raise EnvSetupError(f"env.video_cfg lacks {missing} (see config/env/base.yaml)")
        return cls(env, video_cfg["video_base_dir"], info_on_video=video_cfg["info_on_video"],
                   fps=video_cfg["fps"], name=name, per_episode=video_cfg["per_episode"])

    def __getattr__(self, attr: str) -> Any:
        if attr == "env":  # not set yet: no recursion through __getattr__
            raise AttributeError(attr)
        return getattr(self.env, attr)

    def reset(self, reset_state_ids: Any = None) -> dict[str, Any]:
        self.flush()
        obs = self._guarded(self.env.reset, reset_state_ids)
        self._step[:] = 0
        if self.per_episode:
            self._start_episodes(np.arange(self.env.num_envs))
        self._record(obs, rewards=None, success=None)
        return _without_renders(obs)

    def chunk_step(self, actions: np.ndarray) -> tuple:
        obs, rewards, terminations, truncations, infos = self._guarded(self.env.chunk_step, actions)
        shown = infos.get("final_obs", obs)
        self._step = np.asarray(infos.get("episode_length", self._step + rewards.shape[1]))
        self._record(shown, rewards=rewards.sum(axis=1), success=infos.get("success"))
        if "final_obs" in infos:
            infos["final_obs"] = _without_renders(infos["final_obs"])
        if self.per_episode and "done" in infos:
            done = np.flatnonzero(infos["done"])
            for i in done:  # the episode's file ends with it
                self._finish(int(i))
            if "final_obs" in infos and len(done):  # auto-reset: the next episodes begin
                self._step[done] = 0
                self._start_episodes(done)
                self._record(obs, rewards=None, success=None, envs=done)
        return _without_renders(obs), rewards, terminations, truncations, infos

    def flush(self) -> None:
        """Finish the current file(s) (the next frame starts new ones)."""
        for i in range(len(self._writers)):
            self._finish(i)

    def _finish(self, i: int) -> None:
        if self._closers[i] is not None:
            self._closers[i]()
        self._writers[i] = self._closers[i] = None

    def _start_episodes(self, envs: np.ndarray) -> None:
        names, extra = self.env.reset_state_names, self.env.extra_episodes
        for i in envs:
            self._finish(int(i))
            if not extra[i]:  # an episode that only fills the batch gets no file
                self._open(int(i), f"{self.name}_{names[i]}")

    def close(self) -> None:
        try:
            self.flush()
        finally:
            self.env.close()

    def __enter__(self) -> VideoRecorder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _guarded(self, fn: Any, arg: Any) -> Any:
        try:
            return fn(arg)
        except BaseException:
            self.flush()
            raise

    def _open(self, i: int, stem: str) -> None:
        self.video_dir.mkdir(parents=True, exist_ok=True)
        path = self.video_dir / f"{stem}_{len(self.paths):04d}.mp4"
        self._writers[i] = imageio.get_writer(path, fps=self.fps, codec="libx264",
                                              macro_block_size=MACRO_BLOCK, ffmpeg_log_level="error")
        self._closers[i] = weakref.finalize(self, self._writers[i].close)
        self.paths.append(path)

    def _record(self, obs: dict[str, Any], rewards: np.ndarray | None,
                success: np.ndarray | None, envs: np.ndarray | None = None) -> None:
        if RENDER_IMAGES in obs:
            obs = {"main_images": obs[RENDER_IMAGES], "task_descriptions": obs.get("task_descriptions")}
        if "main_images" not in obs:
            raise EnvSetupError("env.video_cfg.save_video needs camera observations (main_images) "
                                "or scene renders; this env gives neither")
        if not self.per_episode:
            if self._writers[0] is None:
                self._open(0, self.name)
            self._writers[0].append_data(self._frame(obs, rewards, success, self._step))
            return
        for i in range(self.env.num_envs) if envs is None else envs:
            if self._writers[i] is None:
                continue  # an env idling after its episode ended (no auto-reset)
            rows = slice(i, i + 1)
            one = {k: v[rows] for k, v in obs.items() if k in ("main_images", "wrist_images")}
            one["task_descriptions"] = (obs.get("task_descriptions") or [""] * len(obs["main_images"]))[rows]
            self._writers[i].append_data(self._frame(
                one, None if rewards is None else rewards[rows],
                None if success is None else success[rows], self._step[rows]))

    def _frame(self, obs: dict[str, Any], rewards: np.ndarray | None, success: np.ndarray | None,
               steps: np.ndarray) -> np.ndarray:
        frame = tile_frames(obs)
        if self.info_on_video:
            frame = self._draw_info(frame, obs, rewards, success, steps)
        return frame

    def _draw_info(self, frame: np.ndarray, obs: dict[str, Any], rewards: np.ndarray | None,
                   success: np.ndarray | None, steps: np.ndarray) -> np.ndarray:
        b, h, w, _ = obs["main_images"].shape
        tile_w = w * (2 if "wrist_images" in obs else 1)
        cols = math.ceil(math.sqrt(b))
        size = max(8, h // 12)
        font = ImageFont.load_default(size=size)
        chars = max(8, int(tile_w / (0.6 * size)))
        image = Image.fromarray(frame)
        draw = ImageDraw.Draw(image)
        tasks = obs.get("task_descriptions") or [""] * b
        for i in range(b):
            r, c = divmod(i, cols)
            x, y = c * tile_w + 2, r * h + 1
            lines = [f"step {steps[i]}"]
            if rewards is not None:
                lines.append(f"reward {rewards[i]:+.3f}")
            if success is not None:
                lines.append(f"success {bool(success[i])}")
            lines += textwrap.wrap(tasks[i], chars)[:2]
            for line in lines:
                box = draw.textbbox((x, y), line, font=font)
                draw.rectangle(box, fill=(0, 0, 0))
                draw.text((x, y), line, fill=(255, 255, 0), font=font)
                y += size + 1
        return np.asarray(image)
