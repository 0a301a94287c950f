"""Video recording for any vector env: every env's camera tiled into one mp4 frame per reset and
per chunk step, optionally with the step, chunk reward, success and task drawn on each tile.

Frames come from the observations' cameras (``main_images``, ``wrist_images``) or, for envs
without cameras, from scene renders the simulator adds for the recorder (``RENDER_IMAGES``),
which the recorder removes from what it passes on.

A file starts at ``reset()`` (or at the first step after ``flush()``) and ends at the next
``reset()``, ``flush()`` or ``close()``. It is finished before any exception leaves the wrapper,
and at interpreter exit, so a run that dies with an exception still leaves playable files.
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

from envs.vector_env import RENDER_IMAGES, EnvSetupError

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
                 fps: int = 10, name: str = "envs"):
        self.env = env
        self.video_dir = Path(video_dir)
        self.info_on_video = info_on_video
        self.fps = fps
        self.name = name
        self.paths: list[Path] = []
        self._writer: Any = None
        self._close_writer: weakref.finalize | None = None
        self._step = np.zeros(env.num_envs, np.int64)

    @classmethod
    def from_config(cls, env: Any, env_cfg: Any, name: str) -> VideoRecorder:
        video_cfg = env_cfg["video_cfg"]
        missing = [k for k in ("video_base_dir", "info_on_video", "fps") if k not in video_cfg]
        if missing:
            raise EnvSetupError(f"env.video_cfg lacks {missing} (see config/env/base.yaml)")
        return cls(env, video_cfg["video_base_dir"], info_on_video=video_cfg["info_on_video"],
                   fps=video_cfg["fps"], name=name)

    def __getattr__(self, attr: str) -> Any:
        if attr == "env":  # not set yet: no recursion through __getattr__
            raise AttributeError(attr)
        return getattr(self.env, attr)

    def reset(self, reset_state_ids: Any = None) -> dict[str, Any]:
        self.flush()
        obs = self._guarded(self.env.reset, reset_state_ids)
        self._step[:] = 0
        self._record(obs, rewards=None, success=None)
        return _without_renders(obs)

    def chunk_step(self, actions: np.ndarray) -> tuple:
        obs, rewards, terminations, truncations, infos = self._guarded(self.env.chunk_step, actions)
        shown = infos.get("final_obs", obs)
        self._step = np.asarray(infos.get("episode_length", self._step + rewards.shape[1]))
        self._record(shown, rewards=rewards.sum(axis=1), success=infos.get("success"))
        if "final_obs" in infos:
            infos["final_obs"] = _without_renders(infos["final_obs"])
        return _without_renders(obs), rewards, terminations, truncations, infos

    def flush(self) -> None:
        """Finish the current file (the next frame starts a new one)."""
        if self._close_writer is not None:
            self._close_writer()
        self._writer = self._close_writer = None

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

    def _record(self, obs: dict[str, Any], rewards: np.ndarray | None,
                success: np.ndarray | None) -> None:
        if RENDER_IMAGES in obs:
            obs = {"main_images": obs[RENDER_IMAGES], "task_descriptions": obs.get("task_descriptions")}
        if "main_images" not in obs:
            raise EnvSetupError("env.video_cfg.save_video needs camera observations (main_images) "
                                "or scene renders; this env gives neither")
        frame = tile_frames(obs)
        if self.info_on_video:
            frame = self._draw_info(frame, obs, rewards, success)
        if self._writer is None:
            self.video_dir.mkdir(parents=True, exist_ok=True)
            path = self.video_dir / f"{self.name}_{len(self.paths):04d}.mp4"
            self._writer = imageio.get_writer(path, fps=self.fps, codec="libx264",
                                              macro_block_size=MACRO_BLOCK, ffmpeg_log_level="error")
            self._close_writer = weakref.finalize(self, self._writer.close)
            self.paths.append(path)
        self._writer.append_data(frame)

    def _draw_info(self, frame: np.ndarray, obs: dict[str, Any], rewards: np.ndarray | None,
                   success: np.ndarray | None) -> np.ndarray:
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
            lines = [f"step {self._step[i]}"]
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
