"""ManiSkill's demonstrations: its trajectory format read as ``envs/maniskill.py`` shows
observations (``envs/demos.py`` says why and how readers check), and written by
``python -m embodied.record``.

- **ManiSkill's trajectory format** (what ``mani_skill.utils.wrappers.RecordEpisode`` writes):
``<name>.h5`` with one group ``traj_<episode_id>`` per episode (``obs`` with T+1 rows,
``actions [T, A]``, ``success``, ``terminated``, ``truncated``, ``rewards`` with T) and
``<name>.json`` (``env_info``: ``env_id``, ``env_kwargs``, ``max_episode_steps``; ``episodes``:
``episode_id``, ``episode_seed``, ``reset_kwargs``, ``control_mode``, ``elapsed_steps``,
``success``). With cameras: ``main_images`` from ``obs/sensor_data/<main_camera>/rgb``,
``wrist_images`` from ``<wrist_camera>`` when the file has it (the adapter's "when the robot
has it"), ``states`` from ``obs/agent`` then ``obs/extra`` (``envs.maniskill_scene.proprio_states``)
or ``obs/states`` where this module's writer put that vector; files of an obs mode holding
privileged state (``rgb+state``: object poses) are refused, as a VLA must not see it. Without
cameras (``obs_mode: state``): ``states`` is the full state vector, a state-mode file's ``obs``,
an ``rgb+state`` file's ``obs/state`` or the writer's ``obs/privileged_states``. The
instruction is the adapter's for ``env_id``. The observation after the last action is left out.
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
from envs.demos import Demo, DemoFile, DemoFormat


class ManiSkillDemos(DemoFormat):
    name, main_camera = "maniskill", "base_camera"

    def layout(self, path: Path) -> str:
        return f"ManiSkill's trajectory layout (traj_<i> groups beside {path.with_suffix('.json').name})"

    def view(self, params: Mapping[str, Any]) -> dict[str, Any]:
        return {"obs_mode": params["obs_mode"], "control_mode": params["control_mode"]}

    def recognizes(self, path: Path, file: h5py.File) -> bool:
        return any(re.fullmatch(r"traj_\d+", k) for k in file) or path.with_suffix(".json").is_file()

    def open(self, path: Path, file: h5py.File, common: dict[str, Any], obs_mode: str = "rgb",
             control_mode: str | None = None, **_: Any) -> ManiSkillFile:
        return ManiSkillFile(path, file, **common, obs_mode=obs_mode, control_mode=control_mode)

    def recording(self, params: dict[str, Any], expert: bool) -> bool:
        reads_state = expert or params["obs_mode"] == "state"
        if reads_state:
            params["obs_mode"] = "rgb+state"
        return reads_state

    def writer(self, out: str, env: Any, env_cfg: Any, source: str) -> TrajectoryWriter:
        from envs.maniskill import check_params
        from envs.maniskill_scene import make_kwargs

        p = check_params(env_cfg.init_params)
        return TrajectoryWriter(out, env_id=p["id"], env_kwargs=make_kwargs(p, 1, env_cfg.max_episode_steps),
                                max_episode_steps=env_cfg.max_episode_steps, main_camera=p["main_camera"],
                                wrist_camera=p["wrist_camera"], source_type="policy", source_desc=source)


class ManiSkillFile(DemoFile):
    format = "maniskill"
    container = "traj_<i> groups"

    def __init__(self, path: Path, file: h5py.File, main_camera: str, wrist_camera: str | None,
                 image_size: tuple[int, int] | None, action_dim: int | None, success_only: bool,
                 obs_mode: str, control_mode: str | None):
        super().__init__(path, file, main_camera, wrist_camera, image_size, action_dim, success_only)
        self.cameras = obs_mode != "state"
        meta_path = path.with_suffix(".json")
        if not meta_path.is_file():
            raise DataError(f"{meta_path}: missing; ManiSkill's trajectory format keeps env_info and "
                            f"episodes there, beside {path.name}")
        try:
            meta = json.loads(meta_path.read_text())
            self.env_id = meta["env_info"]["env_id"]
            env_kwargs = dict(meta["env_info"]["env_kwargs"])
            listed = list(meta["episodes"])
        except (ValueError, KeyError, TypeError) as err:
            raise DataError(f"{meta_path}: not ManiSkill trajectory metadata (expected env_info.env_id, "
                            f"env_info.env_kwargs and episodes; {type(err).__name__}: {err})") from None
        stored_mode = env_kwargs.get("obs_mode", "state")  # ManiSkill's default
        textures = set(str(stored_mode).split("+"))
        if self.cameras and textures & {"state", "state_dict"}:
            raise DataError(f"{meta_path}: env_info.env_kwargs.obs_mode={stored_mode!r}: its observations "
                            "hold the privileged state (object poses) and not the proprioception the env "
                            "gives with cameras; replay it with obs mode rgb (python -m mani_skill."
                            "trajectory.replay_trajectory ... -o rgb)")
        self.by_name: dict[str, dict[str, Any]] = {}
        for i, entry in enumerate(listed):
            name = f"traj_{entry.get('episode_id')}"
            if name not in file:
                raise DataError(f"{meta_path}: episodes[{i}] is {name}, which {path.name} lacks")
            mode = entry.get("control_mode", env_kwargs.get("control_mode"))
            if control_mode is not None and mode != control_mode:
                raise DataError(f"{meta_path}: episodes[{i}].control_mode={mode!r}; the env acts "
                                f"with {control_mode!r}, so these actions mean something else there")
            self.by_name[name] = entry
            if not success_only or self.success(name):
                self.episodes.append(name)

    def success(self, episode: str) -> bool:
        flags = self.file[episode].get("success")
        if isinstance(flags, h5py.Dataset) and flags.shape[0]:
            return bool(flags[-1])
        return bool(self.by_name[episode].get("success", False))

    def seed(self, episode: str) -> int | None:
        seed = self.by_name[episode].get("episode_seed")
        return None if seed is None else int(seed)

    @functools.cached_property
    def instruction(self) -> str:
        from envs.maniskill import task_description

        return task_description(self.env_id)

    def check(self, episode: str) -> tuple[int, int, tuple[int, int] | None]:
        steps, dims = self.check_actions(episode)
        if "obs" not in self.file[episode]:
            raise self.error(episode, "obs", "missing: these demos hold no observations")
        if not self.cameras:
            self.dataset(episode, self._state_key(episode), steps + 1)
            return steps, dims, None
        size = self.check_images(episode, self._camera_key(self.main_camera), steps + 1)
        if self._has_wrist(episode):
            self.check_images(episode, self._camera_key(self.wrist_camera), steps + 1)
        for key in self._proprio_keys(episode):
            self.dataset(episode, key, steps + 1)
        return steps, dims, size

    def read(self, episode: str) -> Demo:
        group = self.file[episode]
        steps = group["actions"].shape[0]
        if self.cameras:
            obs = {"main_images": group[self._camera_key(self.main_camera)][:steps]}
            if self._has_wrist(episode):
                obs["wrist_images"] = group[self._camera_key(self.wrist_camera)][:steps]
            obs["states"] = self._proprio(episode, steps)
        else:
            obs = {"states": group[self._state_key(episode)][:steps].astype(np.float32)}
        obs["task_descriptions"] = [self.instruction] * steps
        return Demo(f"{self.path}:{episode}", obs, group["actions"][()].astype(np.float32),
                    self.success(episode), self.seed(episode))

    def _camera_key(self, camera: str) -> str:
        return f"obs/sensor_data/{camera}/rgb"

    def _has_wrist(self, episode: str) -> bool:
        return bool(self.wrist_camera) and self._camera_key(self.wrist_camera) in self.file[episode]

    def _state_key(self, episode: str) -> str:
        """Where the full state vector is: this module's writer, ``rgb+state``, or ``state`` files."""
        obs = self.file[episode]["obs"]
        if isinstance(obs, h5py.Dataset):
            return "obs"
        for key in ("privileged_states", "state"):
            if key in obs:
                return f"obs/{key}"
        raise self.error(episode, "obs", f"holds no full state vector (obs/privileged_states, obs/state, "
                                         f"or obs itself in a state-mode file; {episode}/obs holds {sorted(obs)})")

    def _proprio_keys(self, episode: str) -> list[str]:
        """The datasets ``states`` is made of, in order."""
        obs = self.file[episode]["obs"]
        if not isinstance(obs, h5py.Group):
            raise self.error(episode, "obs", "is one array (a state-mode file): it holds no camera images")
        if "states" in obs:
            return ["obs/states"]
        keys = []
        for name in ("agent", "extra"):
            group = obs.get(name)
            if not isinstance(group, h5py.Group):
                raise self.error(episode, f"obs/{name}", f"missing ({episode}/obs holds {sorted(obs)})")
            if len(group) > 1 and not group.id.get_create_plist().get_link_creation_order():
                raise self.error(episode, f"obs/{name}", "was written without its creation order, so "
                                                         "the order of the state's parts is unknown")
            for key, node in group.items():
                if not isinstance(node, h5py.Dataset):
                    raise self.error(episode, f"obs/{name}/{key}", "is a group; the env's states are "
                                                                   "made of arrays")
                keys.append(f"obs/{name}/{key}")
        return keys

    def _proprio(self, episode: str, steps: int) -> np.ndarray:
        from envs.maniskill_scene import proprio_states

        group = self.file[episode]
        keys = self._proprio_keys(episode)
        if keys == ["obs/states"]:
            return group["obs/states"][:steps].astype(np.float32)
        parts = [{k: group[k][:steps] for k in keys if k.startswith(f"obs/{name}/")}
                 for name in ("agent", "extra")]
        return proprio_states(parts, steps)


class TrajectoryWriter:
    """Episodes written in ManiSkill's trajectory format: ``<path>.h5`` (a group ``traj_<i>``
    per episode) and ``<path>.json`` (``env_info`` and ``episodes``, written by ``close``), as
    ``RecordEpisode`` lays them out, so ManiSkill's tools (``ManiSkillTrajectoryDataset``,
    ``replay_trajectory`` from the episode seeds) read them too.

    ``add`` takes the env protocol's observations, T+1 rows for T actions: ``main_images`` and
    ``wrist_images`` go where ManiSkill keeps its cameras' images
    (``obs/sensor_data/<camera>/rgb``, gzip as ManiSkill does), ``states`` and
    ``privileged_states`` (an ``rgb+state`` env's) to ``obs/states`` and
    ``obs/privileged_states``; the instruction goes to the episode's JSON entry. ``env_kwargs``
    are the ``gym.make`` arguments that rebuild the env (``envs.maniskill_scene.make_kwargs``), its
    ``obs_mode`` the ManiSkill one the images come from (``rgb``)."""

    def __init__(self, path: str | Path, *, env_id: str, env_kwargs: Mapping[str, Any],
                 max_episode_steps: int, main_camera: str, wrist_camera: str | None = None,
                 source_type: str | None = None, source_desc: str | None = None):
        self.h5_path = Path(path).with_suffix(".h5")
        self.json_path = self.h5_path.with_suffix(".json")
        self.h5_path.parent.mkdir(parents=True, exist_ok=True)
        self.cameras = {"main_images": main_camera, "wrist_images": wrist_camera}
        self.meta: dict[str, Any] = {
            "env_info": {"env_id": env_id, "env_kwargs": dict(env_kwargs), "max_episode_steps": max_episode_steps},
            "episodes": [],
        }
        if source_type is not None:
            self.meta["source_type"] = source_type
        if source_desc is not None:
            self.meta["source_desc"] = source_desc
        self.file = h5py.File(self.h5_path, "w")

    def __enter__(self) -> TrajectoryWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def num_episodes(self) -> int:
        return len(self.meta["episodes"])

    @property
    def paths(self) -> list[Path]:
        return [self.h5_path, self.json_path]

    def add(self, obs: Mapping[str, np.ndarray], actions: np.ndarray, rewards: np.ndarray,
            terminated: np.ndarray, truncated: np.ndarray, success: np.ndarray, *, seed: int,
            task_description: str) -> int:
        """Write one episode (observations [T+1], the rest [T]); returns its episode id."""
        steps = len(actions)
        unknown = set(obs) - {"main_images", "wrist_images", "states", "privileged_states"}
        if unknown or "main_images" not in obs or "states" not in obs:
            raise ValueError(f"observations: expected main_images, states and optionally wrist_images, "
                             f"privileged_states; got {sorted(obs)}")
        if "wrist_images" in obs and not self.cameras["wrist_images"]:
            raise ValueError("wrist_images given to a writer made without wrist_camera")
        for key, value in obs.items():
            if len(value) != steps + 1:
                raise ValueError(f"obs[{key!r}] has {len(value)} rows; {steps} actions need {steps + 1}")
        episode_id = self.num_episodes
        group = self.file.create_group(f"traj_{episode_id}", track_order=True)
        observations = group.create_group("obs", track_order=True)
        for key in ("main_images", "wrist_images"):
            if key in obs:
                observations.create_dataset(f"sensor_data/{self.cameras[key]}/rgb", data=np.asarray(obs[key], np.uint8),
                                            compression="gzip", compression_opts=5)
        for key in ("states", "privileged_states"):
            if key in obs:
                observations.create_dataset(key, data=np.asarray(obs[key], np.float32))
        group.create_dataset("actions", data=np.asarray(actions, np.float32))
        group.create_dataset("terminated", data=np.asarray(terminated, bool))
        group.create_dataset("truncated", data=np.asarray(truncated, bool))
        group.create_dataset("success", data=np.asarray(success, bool))
        group.create_dataset("rewards", data=np.asarray(rewards, np.float32))
        self.meta["episodes"].append({
            "episode_id": episode_id, "episode_seed": int(seed), "reset_kwargs": {"seed": int(seed)},
            "control_mode": self.meta["env_info"]["env_kwargs"].get("control_mode"),
            "elapsed_steps": steps, "success": bool(np.asarray(success)[-1]),
            "task_description": task_description,
        })
        return episode_id

    def close(self) -> None:
        """Finish the ``.h5`` and write the ``.json`` beside it."""
        if self.file:
            self.file.close()
            tmp = self.json_path.with_suffix(f".json.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(self.meta, indent=2))
            tmp.replace(self.json_path)


FORMAT = ManiSkillDemos()
