"""Video recording for any vector env: every env's camera tiled into one mp4 frame per reset and
per env step, optionally with a thin strip on each tile: step, the step's reward, success, task.

Frames come from the observations' cameras (``main_images``, ``wrist_images``) or, for envs
without cameras, from scene renders the simulator adds for the recorder (``RENDER_IMAGES``).
Simulators that step a chunk without observing each step add every step's images while
recording (``STEP_FRAMES``); an env without them gets one frame per chunk. The recorder removes
both from what it passes on.

Files are written under a hidden temporary name in their folder (``.<name>.partial``) and
renamed when complete, so that an ``.mp4`` is always whole: a process killed mid-file leaves only
the partial file, which the next recorder of the same name removes. A file's number is the next
free one, so reruns and rebuilt envs never overwrite earlier videos.

A file starts at ``reset()`` (or at the first step after ``flush()``) and ends at the next
``reset()``, ``flush()`` or ``close()``. It is finished before any exception leaves the wrapper,
and at interpreter exit, so a run that dies with an exception still leaves playable files.

With ``per_episode`` each env's episode gets a file of its own instead, named
``<name>_<reset state>_<number>.mp4`` after the state it started from (the env's
``reset_state_names``, e.g. ``task003_init42_<task>`` for LIBERO), so that the episode of a
given task and init state is found by its name; it ends with the episode (also mid-chunk, at an
auto-reset) or at ``flush()``. Extra episodes that only fill a batch get no file.

Each finished file is also kept as a record (``pop_episodes``): its path and, per episode, the
reset state, task, length and whether the episode succeeded at any step, for the eval report
(embodied/report.py); a tiled file's record has None for those.
"""

from __future__ import annotations

import glob
import math
import os
import weakref
from pathlib import Path
from typing import Any

import imageio_ffmpeg
import numpy as np
from PIL import Image, ImageDraw, ImageFont

from core.errors import EnvSetupError
from envs.protocol import RENDER_IMAGES, STEP_FRAMES, video_keys

# the config keys read here (tests/test_schema.py: every schema key is read or refused)
CONFIG_KEYS = ("env.*.video_cfg.info_on_video", "env.*.video_cfg.per_episode", "env.*.video_cfg.fps",
               "env.*.video_cfg.video_base_dir")

MACRO_BLOCK = 16  # h264 wants frame sides divisible by this; frames are padded, never rescaled
PARTIAL = ".partial"


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


def strip_height(tile_height: int) -> int:
    """Rows of the info strip on a tile: a font of 1/20 of the tile (at least 8 px) and a pixel
    above and below, 13 of 224 rows (under 6 %)."""
    return max(8, tile_height // 20) + 2


def draw_info(frame: np.ndarray, tile: tuple[int, int], texts: list[str]) -> np.ndarray:
    """``texts[i]`` on a darkened strip across the top of tile ``i`` (tiles of ``tile`` = (height,
    width) in the grid of ``tile_frames``), cut to the tile's width."""
    h, w = tile
    cols = math.ceil(math.sqrt(len(texts)))
    strip = strip_height(h)
    font = ImageFont.load_default(size=strip - 2)
    for i in range(len(texts)):
        r, c = divmod(i, cols)
        frame[r * h:r * h + strip, c * w:(c + 1) * w] //= 3  # dark, the scene still visible
    image = Image.fromarray(frame)
    draw = ImageDraw.Draw(image)
    for i, text in enumerate(texts):
        r, c = divmod(i, cols)
        draw.text((c * w + 2, r * h + strip / 2), _fit(text, font, w - 4), fill=(255, 255, 0), font=font,
                  anchor="lm")
    return np.asarray(image)


def _fit(text: str, font: Any, width: float) -> str:
    if font.getlength(text) <= width:
        return text
    while text and font.getlength(text + "...") > width:
        text = text[:-1]
    return text + "..."


def _pad(n: int) -> int:
    return -(-n // MACRO_BLOCK) * MACRO_BLOCK


def _passed_on(obs: dict[str, Any]) -> dict[str, Any]:
    """The observation without what only the recorder reads."""
    if RENDER_IMAGES not in obs and STEP_FRAMES not in obs:
        return obs
    return {k: v for k, v in obs.items() if k not in (RENDER_IMAGES, STEP_FRAMES)}


def _views(obs: dict[str, Any]) -> dict[str, np.ndarray]:
    """The images a frame tiles, as ``tile_frames`` takes them."""
    keys = video_keys(obs)
    if not keys:
        raise EnvSetupError("env.video_cfg.save_video needs camera observations (main_images) "
                            "or scene renders; this env gives neither")
    if keys == (RENDER_IMAGES,):
        return {"main_images": obs[RENDER_IMAGES]}
    return {k: obs[k] for k in keys}


class _Mp4:
    """One mp4, written as ``.<name>.partial`` beside its final name and renamed when closed."""

    def __init__(self, path: Path, fps: int):
        self.path, self.fps = path, fps
        self.partial = path.with_name(f".{path.name}{PARTIAL}")
        self._frames: Any = None  # imageio-ffmpeg's writer, from the first frame on

    def append(self, frame: np.ndarray) -> None:
        if self._frames is None:
            self._frames = imageio_ffmpeg.write_frames(
                str(self.partial), (frame.shape[1], frame.shape[0]), fps=self.fps, codec="libx264",
                macro_block_size=MACRO_BLOCK, ffmpeg_log_level="error", output_params=["-f", "mp4"])
            self._frames.send(None)
        self._frames.send(np.ascontiguousarray(frame))

    def close(self) -> None:
        frames, self._frames = self._frames, None
        if frames is not None:
            frames.close()
            os.replace(self.partial, self.path)


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
        self._writers: list[_Mp4 | None] = [None] * (env.num_envs if per_episode else 1)
        self._closers: list[weakref.finalize | None] = [None] * len(self._writers)
        self._step = np.zeros(env.num_envs, np.int64)
        self._success = np.zeros(env.num_envs, bool)
        self._succeeded = np.zeros(env.num_envs, bool)  # at any step of the episode
        self._episode: list[dict[str, Any]] = [{} for _ in self._writers]  # of each open file
        self._finished: list[dict[str, Any]] = []

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
        self._success[:] = self._succeeded[:] = False
        if self.per_episode:
            self._start_episodes(np.arange(self.env.num_envs))
        self._record(obs, None, self._step)
        return _passed_on(obs)

    def chunk_step(self, actions: np.ndarray) -> tuple:
        obs, rewards, terminations, truncations, infos = self._guarded(self.env.chunk_step, actions)
        shown = infos.get("final_obs", obs)
        before = self._step
        self._step = np.asarray(infos.get("episode_length", before + rewards.shape[1]))
        success = infos.get("success")
        if STEP_FRAMES in shown:  # one frame per env step; success as it stood at the chunk's end
            chunk = rewards.shape[1]
            for t, images in enumerate(_each_step(shown[STEP_FRAMES], chunk)):
                if t == chunk - 1 and success is not None:
                    self._set_success(success)
                self._record({**images, "task_descriptions": shown.get("task_descriptions")}, rewards[:, t],
                             np.minimum(before + t + 1, self._step), live=before + t < self._step)
        else:
            if success is not None:
                self._set_success(success)
            self._record(shown, rewards.sum(axis=1), self._step)
        if "final_obs" in infos:
            infos["final_obs"] = _passed_on(infos["final_obs"])
        if self.per_episode and "done" in infos:
            done = np.flatnonzero(infos["done"])
            for i in done:  # the episode's file ends with it
                self._finish(int(i))
            if "final_obs" in infos and len(done):  # auto-reset: the next episodes begin
                self._step[done] = 0
                self._success[done] = self._succeeded[done] = False
                self._start_episodes(done)
                self._record(obs, None, self._step, envs=done)
        return _passed_on(obs), rewards, terminations, truncations, infos

    def flush(self) -> None:
        """Finish the current file(s) (the next frame starts new ones)."""
        for i in range(len(self._writers)):
            self._finish(i)

    def pop_episodes(self) -> list[dict[str, Any]]:
        """The files finished since the last call: ``{"video", "reset_state", "task", "length",
        "success"}`` each (module docstring)."""
        finished, self._finished = self._finished, []
        return finished

    def _set_success(self, success: Any) -> None:
        self._success = np.asarray(success, bool)
        self._succeeded |= self._success

    def _finish(self, i: int) -> None:
        if self._closers[i] is not None:
            self._closers[i]()
            record = {"video": str(self._writers[i].path), "reset_state": None, "task": None,
                      "length": None, "success": None}
            if self.per_episode:
                record.update(self._episode[i], length=int(self._step[i]), success=bool(self._succeeded[i]))
            self._finished.append(record)
        self._writers[i] = self._closers[i] = None

    def _start_episodes(self, envs: np.ndarray) -> None:
        names, extra = self.env.reset_state_names, self.env.extra_episodes
        for i in envs:
            self._finish(int(i))
            if not extra[i]:  # an episode that only fills the batch gets no file
                self._open(int(i), f"{self.name}_{names[i]}")
                self._episode[i] = {"reset_state": names[i]}

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
        if not self.paths:  # what a killed process of this name left unfinished
            for stale in self.video_dir.glob(f".{glob.escape(self.name)}_*{PARTIAL}"):
                stale.unlink(missing_ok=True)
        number = len(self.paths)
        while any(p.exists() for p in self._names(stem, number)):
            number += 1
        self._writers[i] = _Mp4(self._names(stem, number)[0], self.fps)
        self._closers[i] = weakref.finalize(self, self._writers[i].close)
        self.paths.append(self._writers[i].path)

    def _names(self, stem: str, number: int) -> tuple[Path, Path]:
        name = f"{stem}_{number:04d}.mp4"
        return self.video_dir / name, self.video_dir / f".{name}{PARTIAL}"

    def _record(self, obs: dict[str, Any], rewards: np.ndarray | None, steps: np.ndarray,
                envs: np.ndarray | None = None, live: np.ndarray | None = None) -> None:
        """One frame of ``obs``: of all envs tiled, or (``per_episode``) of each env of ``envs``
        whose episode ran this step (``live``)."""
        views = _views(obs)
        b = len(views["main_images"])
        tasks = list(obs.get("task_descriptions") or [""] * b)
        if not self.per_episode:
            if self._writers[0] is None:
                self._open(0, self.name)
            self._writers[0].append(self._frame(views, tasks, rewards, self._success, steps))
            return
        for i in range(b) if envs is None else envs:
            if self._writers[i] is None or (live is not None and not live[i]):
                continue  # an env idling after its episode ended, or past its end in this chunk
            rows = slice(i, i + 1)
            self._episode[i]["task"] = tasks[i] or None
            self._writers[i].append(self._frame(
                {k: v[rows] for k, v in views.items()}, tasks[rows], None if rewards is None else rewards[rows],
                self._success[rows], steps[rows]))

    def _frame(self, views: dict[str, np.ndarray], tasks: list[str], rewards: np.ndarray | None,
               success: np.ndarray, steps: np.ndarray) -> np.ndarray:
        frame = tile_frames(views)
        if not self.info_on_video:
            return frame
        _, h, w, _ = views["main_images"].shape
        texts = [" | ".join([f"step {steps[i]}", *([] if rewards is None else [f"{rewards[i]:+.3f}"]),
                             *(["success"] if success[i] else []), *([tasks[i]] if tasks[i] else [])])
                 for i in range(len(tasks))]
        return draw_info(frame, (h, w * len(views)), texts)


def _each_step(frames: dict[str, np.ndarray], chunk: int) -> list[dict[str, np.ndarray]]:
    """``STEP_FRAMES`` (``{key: [B, C, ...]}``) as one observation of images per step."""
    return [{k: v[:, t] for k, v in frames.items()} for t in range(chunk)]
