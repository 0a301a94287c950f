"""LIBERO's demonstrations: its demo HDF5 read as ``envs/libero.py`` shows observations
(``envs/demos.py`` says why and how readers check), and written by ``python -m embodied.record``.

- **LIBERO's demo HDF5** (what LIBERO's ``scripts/create_dataset.py`` writes): ``data/demo_<i>``
with ``obs/agentview_rgb`` and ``obs/eye_in_hand_rgb`` (the env's cameras ``agentview`` and
``robot0_eye_in_hand``, named without ``robot0_``), ``obs/ee_states`` (position and
axis-angle), ``obs/gripper_states``, ``actions [T, 7]`` and ``dones``; attributes of ``data``:
``problem_info`` (JSON with ``language_instruction``), ``bddl_file_name`` and
``macros_image_convention``. Images are turned upright (``envs.libero.upright``) unless that
attribute says ``opencv``; ``states`` is ``envs.libero.proprio_state`` of ``ee_states`` and
``gripper_states``; the gripper action takes the env's convention (``libero_gripper``); the
instruction is the adapter's: a suite task's benchmark wording (found by the BDDL file's
name), else ``problem_info``'s, else the BDDL file's own. LIBERO's ``create_dataset.py`` pairs
each action with the observation rendered after it; the reader keeps the file's pairing.
"""

from __future__ import annotations

import functools
import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from core.errors import DataError
from envs.demos import Demo, DemoFile, DemoFormat, text


class LiberoDemos(DemoFormat):
    name, main_camera = "libero", "agentview"

    def layout(self, path: Path) -> str:
        return "LIBERO's (data/demo_<i>)"

    def view(self, params: Mapping[str, Any]) -> dict[str, Any]:
        return {"gripper_open_action": params["gripper_open_action"]}

    def recognizes(self, path: Path, file: h5py.File) -> bool:
        return "data" in file and isinstance(file["data"], h5py.Group)

    def open(self, path: Path, file: h5py.File, common: dict[str, Any], obs_mode: str = "rgb",
             gripper_open_action: int = -1, **_: Any) -> LiberoFile:
        if obs_mode != "rgb":
            raise DataError(f"{path}: LIBERO demos hold camera images; obs_mode={obs_mode!r} is a ManiSkill option")
        return LiberoFile(path, file, **common, gripper_open_action=gripper_open_action)

    def recording(self, params: dict[str, Any], expert: bool) -> bool:
        params["privileged_states"] = expert
        return expert

    def writer(self, out: str, env: Any, env_cfg: Any, source: str) -> LiberoDemoWriter:
        return LiberoDemoWriter(out, env.setup, source_desc=source)

    def expert_options(self, params: Mapping[str, Any]) -> dict[str, Any]:
        return {"gripper_open_action": params["gripper_open_action"]}


class LiberoFile(DemoFile):
    format = "libero"
    container = "data/demo_<i>"
    STATE_KEYS = ("obs/ee_states", "obs/gripper_states")

    def __init__(self, path: Path, file: h5py.File, main_camera: str, wrist_camera: str | None,
                 image_size: tuple[int, int] | None, action_dim: int | None, success_only: bool,
                 gripper_open_action: int):
        super().__init__(path, file, main_camera, wrist_camera, image_size, action_dim, success_only)
        self.gripper_open_action = gripper_open_action
        data = file["data"]
        convention = text(data.attrs.get("macros_image_convention", "opengl"))
        if convention not in ("opengl", "opencv"):
            raise self.error(None, "data.attrs['macros_image_convention']",
                             f"{convention!r}, expected opengl or opencv")
        self.upside_down = convention == "opengl"  # robosuite's default, and LIBERO's datasets'
        names = sorted((k for k in data if re.fullmatch(r"demo_\d+", k)), key=lambda k: int(k[5:]))
        self.episodes = [f"data/{k}" for k in names if not success_only or self.success(f"data/{k}")]

    def success(self, episode: str) -> bool:
        # LIBERO's datasets hold successful demonstrations; dones marks the last step
        dones = self.file[episode].get("dones")
        return bool(dones[-1]) if isinstance(dones, h5py.Dataset) and dones.shape[0] else True

    def check(self, episode: str) -> tuple[int, int, tuple[int, int] | None]:
        steps, dims = self.check_actions(episode)
        size = self.check_images(episode, self._camera_key(self.main_camera), steps)
        if self.wrist_camera:
            self.check_images(episode, self._camera_key(self.wrist_camera), steps)
        for key, width in zip(self.STATE_KEYS, (6, 2)):
            states = self.dataset(episode, key, steps)
            if states.shape[1:] != (width,):
                raise self.error(episode, key, f"has shape {list(states.shape)}, expected [{steps}, {width}]")
        return steps, dims, size

    def read(self, episode: str) -> Demo:
        from envs.libero import libero_gripper, proprio_state, upright

        group = self.file[episode]

        def images(camera: str) -> np.ndarray:
            frames = group[self._camera_key(camera)][()]
            return np.ascontiguousarray(upright(frames)) if self.upside_down else frames

        ee = group["obs/ee_states"][()]
        obs = {"main_images": images(self.main_camera)}
        if self.wrist_camera:
            obs["wrist_images"] = images(self.wrist_camera)
        obs["states"] = proprio_state(ee[:, :3], ee[:, 3:], group["obs/gripper_states"][()])
        actions = libero_gripper(group["actions"][()].astype(np.float32), self.gripper_open_action)
        obs["task_descriptions"] = [self.instruction] * len(actions)
        return Demo(f"{self.path}:{episode}", obs, actions, self.success(episode), None)

    def _camera_key(self, camera: str) -> str:
        """LIBERO's datasets name a camera's images without robosuite's ``robot0_`` prefix."""
        return f"obs/{camera.removeprefix('robot0_')}_rgb"

    @functools.cached_property
    def instruction(self) -> str:
        """The adapter's instruction for this file's task (module docstring)."""
        from envs.libero import suite_task_description

        attrs = self.file["data"].attrs
        bddl = text(attrs.get("bddl_file_name", ""))
        if bddl and (suite := suite_task_description(Path(bddl).stem)) is not None:
            return suite
        if "problem_info" in attrs:
            try:
                return str(json.loads(text(attrs["problem_info"]))["language_instruction"]).strip()
            except (ValueError, KeyError, TypeError) as err:
                raise self.error(None, "data.attrs['problem_info']", f"not LIBERO's problem info "
                                                                     f"({type(err).__name__}: {err})") from None
        if bddl and os.path.isfile(bddl):
            from envs.libero import ensure_libero_config

            ensure_libero_config()
            from libero.libero.envs.bddl_utils import get_problem_info

            return get_problem_info(bddl)["language_instruction"].strip()
        raise self.error(None, "data.attrs", "no instruction: neither problem_info nor a "
                                             f"bddl_file_name that exists ({bddl!r})")


class LiberoDemoWriter:
    """Episodes written in LIBERO's demo HDF5 layout (``LiberoFile`` reads it back, as it reads
    LIBERO's released datasets): one file per task, ``<folder>/<task name>_demo.hdf5``, as
    LIBERO's datasets are laid out, each ``data/demo_<i>`` holding ``obs/<camera>_rgb`` (in
    robosuite's OpenGL order, upside down, as LIBERO keeps them), ``obs/ee_states``,
    ``obs/gripper_states``, ``actions`` (LIBERO's gripper convention: -1 opens), ``rewards`` and
    ``dones``, with the init state it started from (``init_state``, an index into the task's init
    states, so that evaluation can hold them out). ``add`` takes what ``TrajectoryWriter.add``
    takes, ``seed`` being the env's reset id (``envs.libero.Setup.task_and_state``)."""

    def __init__(self, folder: str | Path, setup: Any, *, source_desc: str | None = None):
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.setup, self.source_desc = setup, source_desc
        self.files: dict[int, h5py.File] = {}  # by task index
        self.paths: list[Path] = []
        self.num_episodes = 0

    def __enter__(self) -> LiberoDemoWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def add(self, obs: Mapping[str, np.ndarray], actions: np.ndarray, rewards: np.ndarray,
            terminated: np.ndarray, truncated: np.ndarray, success: np.ndarray, *, seed: int,
            task_description: str) -> int:
        """Write one episode (observations [T+1]: each action with the observation it was taken
        on; the last is left out); returns its index in its task's file."""
        from envs.libero import libero_gripper, upright

        steps = len(actions)
        if "main_images" not in obs or "states" not in obs or any(len(v) != steps + 1 for v in obs.values()):
            raise ValueError(f"observations: expected main_images and states with {steps + 1} rows, "
                             f"got { {k: len(v) for k, v in obs.items()} }")
        task_index, init_state = self.setup.task_and_state(seed)
        data = self._file(task_index)["data"]
        demo = data.create_group(f"demo_{len(data)}")
        p = self.setup.params
        for key, camera in (("main_images", p["main_camera"]), ("wrist_images", p["wrist_camera"])):
            if key in obs:
                demo.create_dataset(f"obs/{camera.removeprefix('robot0_')}_rgb", compression="gzip",
                                    data=np.ascontiguousarray(upright(np.asarray(obs[key][:steps], np.uint8))))
        states = np.asarray(obs["states"][:steps], np.float64)
        demo.create_dataset("obs/ee_states", data=states[:, :6])
        demo.create_dataset("obs/gripper_states", data=states[:, 6:8])
        demo.create_dataset("actions", data=libero_gripper(np.asarray(actions, np.float64), p["gripper_open_action"]))
        demo.create_dataset("rewards", data=np.asarray(rewards, np.float64))
        dones = np.zeros(steps, np.uint8)
        dones[-1] = bool(np.asarray(success)[-1])
        demo.create_dataset("dones", data=dones)
        demo.attrs.update(num_samples=steps, init_state=init_state, task_description=task_description)
        data.attrs.update(num_demos=len(data), total=int(data.attrs.get("total", 0)) + steps)
        self.num_episodes += 1
        return len(data) - 1

    def _file(self, task_index: int) -> h5py.File:
        if task_index not in self.files:
            from envs.libero import ensure_libero_config

            ensure_libero_config()
            from libero.libero.envs.bddl_utils import get_problem_info

            task = self.setup.tasks[task_index]
            self.paths.append(self.folder / f"{task.name}_demo.hdf5")
            file = h5py.File(self.paths[-1], "w")
            data = file.create_group("data")
            info = get_problem_info(task.bddl_file)
            info["language_instruction"] = task.description
            p = self.setup.params
            data.attrs.update(
                problem_info=json.dumps(info), bddl_file_name=task.bddl_file, macros_image_convention="opengl",
                env_args=json.dumps({"type": 1, "env_name": info["problem_name"], "bddl_file": task.bddl_file,
                                     "env_kwargs": {"camera_names": [c for c in (p["main_camera"], p["wrist_camera"]) if c],
                                                    "camera_heights": p["camera_heights"],
                                                    "camera_widths": p["camera_widths"]}}),
                num_demos=0, total=0, **({"source_desc": self.source_desc} if self.source_desc else {}))
            self.files[task_index] = file
        return self.files[task_index]

    def close(self) -> None:
        for file in self.files.values():
            file.close()


FORMAT = LiberoDemos()
