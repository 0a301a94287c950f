"""Demonstrations in the formats of the field, read as the env adapters show observations to a
policy; and ManiSkill's trajectory format written (``python -m embodied.record`` records in it).

A policy fine-tuned on demonstrations must see at eval exactly what it saw in training, so the
reader applies the adapters' own functions to the files: the same images (orientation, cameras,
size), the same ``states`` vector, the same instruction and the same action convention. Its
options (``demo_view`` derives them from an env config) say how the env shows things; a file
that cannot look like that is one ``DataError`` naming the file, the episode and the key.

- **ManiSkill's trajectory format** (what ``mani_skill.utils.wrappers.RecordEpisode`` writes):
  ``<name>.h5`` with one group ``traj_<episode_id>`` per episode (``obs`` with T+1 rows,
  ``actions [T, A]``, ``success``, ``terminated``, ``truncated``, ``rewards`` with T) and
  ``<name>.json`` (``env_info``: ``env_id``, ``env_kwargs``, ``max_episode_steps``; ``episodes``:
  ``episode_id``, ``episode_seed``, ``reset_kwargs``, ``control_mode``, ``elapsed_steps``,
  ``success``). With cameras: ``main_images`` from ``obs/sensor_data/<main_camera>/rgb``,
  ``wrist_images`` from ``<wrist_camera>`` when the file has it (the adapter's "when the robot
  has it"), ``states`` from ``obs/agent`` then ``obs/extra`` (``envs.maniskill.proprio_states``)
  or ``obs/states`` where this module's writer put that vector; files of an obs mode holding
  privileged state (``rgb+state``: object poses) are refused, as a VLA must not see it. Without
  cameras (``obs_mode: state``): ``states`` is the full state vector, a state-mode file's ``obs``,
  an ``rgb+state`` file's ``obs/state`` or the writer's ``obs/privileged_states``. The
  instruction is the adapter's for ``env_id``. The observation after the last action is left out.
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

import abc
import functools
import json
import os
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from core.errors import DataError, EnvSetupError

MANISKILL, LIBERO = "maniskill", "libero"
# what an option left as None means, per format (the adapters' defaults)
DEFAULT_MAIN_CAMERA = {MANISKILL: "base_camera", LIBERO: "agentview"}


@dataclass
class Demo:
    """One episode, as the env protocol's observations would have shown it."""

    name: str  # "<file>:<episode group>", for messages
    obs: dict[str, Any]  # each step's observation before its action: main_images [T, H, W, 3]
    #                      uint8, wrist_images (when the view has a wrist camera), states [T, D]
    #                      float32, task_descriptions (T strings)
    actions: np.ndarray  # [T, A] float32, in the env's convention
    success: bool  # at the episode's last step
    seed: int | None  # the reset state it started from (ManiSkill's episode seed); None: LIBERO


@dataclass(frozen=True)
class DemoSet:
    """What ``check_demos`` finds in a file, from its metadata alone (no pixels read)."""

    path: Path
    format: str  # MANISKILL or LIBERO
    episodes: int  # those ``read_demos`` yields
    steps: int  # their actions in all
    action_dim: int
    image_size: tuple[int, int] | None  # (height, width); None without cameras
    task_description: str  # the instruction (one task per file in both formats)
    seeds: tuple[int, ...]  # the episodes' reset states (ManiSkill), to hold evaluation out of them


def demo_view(env_cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The ``read_demos`` options under which demos look as the env of ``env_cfg`` (an
    ``env.train`` / ``env.eval`` config) shows observations: its cameras and their size, and the
    control mode (ManiSkill) or gripper convention (LIBERO) of its actions."""
    p = env_cfg["init_params"]
    view = dict(main_camera=p["main_camera"], wrist_camera=p["wrist_camera"],
                image_size=(p["camera_heights"], p["camera_widths"]))
    if env_cfg["env_type"] == MANISKILL:
        return view | dict(obs_mode=p["obs_mode"], control_mode=p["control_mode"])
    if env_cfg["env_type"] == LIBERO:
        return view | dict(gripper_open_action=p["gripper_open_action"])
    raise EnvSetupError(f"env.env_type={env_cfg['env_type']!r}: demonstrations are read for "
                        f"{MANISKILL} and {LIBERO} envs")


def check_demos(path: str | Path, **view: Any) -> DemoSet:
    """Open ``path`` and check every episode against ``view`` (the options of ``read_demos``)
    from the file's metadata: cheap enough to run before any worker starts."""
    with _open(path, **view) as source:
        return source.summary()


def read_demos(path: str | Path, **view: Any) -> Iterator[Demo]:
    """The episodes of the demo file ``path`` (ManiSkill's trajectory ``.h5`` beside its
    ``.json``, or LIBERO's demo HDF5), checked as ``check_demos`` does before the first one.

    ``view`` (``demo_view`` of the env the policy will run in): ``main_camera`` and
    ``wrist_camera`` (None: the format's main camera, no wrist images), ``image_size`` (height,
    width) and ``action_dim`` that the episodes must have (None: not checked), ``obs_mode``
    (ManiSkill: ``rgb`` by default; ``state`` reads the full state vector and no images),
    ``control_mode`` (ManiSkill: the episodes' must be it), ``gripper_open_action`` (LIBERO: -1,
    its own, by default), ``success_only`` (leave out unsuccessful episodes)."""
    with _open(path, **view) as source:
        source.summary()
        for episode in source.episodes:
            yield source.read(episode)


def _open(path: str | Path, *, main_camera: str | None = None, wrist_camera: str | None = None,
          image_size: tuple[int, int] | None = None, action_dim: int | None = None,
          obs_mode: str = "rgb", control_mode: str | None = None, gripper_open_action: int = -1,
          success_only: bool = False) -> _File:
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: no such demo file")
    try:
        file = h5py.File(path, "r")
    except OSError as err:
        raise DataError(f"{path}: not an HDF5 file ({err})") from None
    try:
        if "data" in file and isinstance(file["data"], h5py.Group):
            if obs_mode != "rgb":
                raise DataError(f"{path}: LIBERO demos hold camera images; obs_mode={obs_mode!r} "
                                "is a ManiSkill option")
            return _LiberoFile(path, file, main_camera or DEFAULT_MAIN_CAMERA[LIBERO], wrist_camera,
                               image_size, action_dim, success_only, gripper_open_action)
        if any(re.fullmatch(r"traj_\d+", k) for k in file) or path.with_suffix(".json").is_file():
            return _ManiSkillFile(path, file, main_camera or DEFAULT_MAIN_CAMERA[MANISKILL],
                                  wrist_camera, image_size, action_dim, success_only, obs_mode, control_mode)
        raise DataError(f"{path}: neither ManiSkill's trajectory layout (traj_<i> groups beside "
                        f"{path.with_suffix('.json').name}) nor LIBERO's (data/demo_<i>); top-level "
                        f"keys: {sorted(file)[:10]}")
    except BaseException:
        file.close()
        raise


class _File(abc.ABC):
    """A demo file being read: its episodes in order and the checks every format shares; each
    format says where its episodes live (``container``) and how one is checked and read."""

    format: str
    container: str

    def __init__(self, path: Path, file: h5py.File, main_camera: str, wrist_camera: str | None,
                 image_size: tuple[int, int] | None, action_dim: int | None, success_only: bool):
        self.path, self.file = path, file
        self.main_camera, self.wrist_camera = main_camera, wrist_camera
        self.image_size, self.action_dim, self.success_only = image_size, action_dim, success_only
        self.episodes: list[str] = []  # group names, in the file's order

    def __enter__(self) -> _File:
        return self

    def __exit__(self, *exc: object) -> None:
        self.file.close()

    def error(self, episode: str | None, key: str, what: str) -> DataError:
        where = f"{episode}/{key}" if episode else key
        return DataError(f"{self.path}: {where}: {what}")

    def dataset(self, episode: str, key: str, rows: int | None = None) -> h5py.Dataset:
        """``<episode>/<key>``, present and with ``rows`` rows, or one error naming it."""
        node = self.file[episode].get(key)
        if not isinstance(node, h5py.Dataset):
            parent = key
            while "/" in parent and not isinstance(self.file[episode].get(parent), h5py.Group):
                parent = parent.rpartition("/")[0]
            parent = parent if parent != key else ""
            group = self.file[episode][parent] if parent else self.file[episode]
            raise self.error(episode, key, f"missing ({f'{episode}/{parent}' if parent else episode} "
                                           f"holds {sorted(group)})")
        if rows is not None and (node.ndim == 0 or node.shape[0] != rows):
            raise self.error(episode, key, f"has shape {list(node.shape)}, expected {rows} rows "
                                           "(one per step)")
        return node

    def check_actions(self, episode: str) -> tuple[int, int]:
        """(steps, action dims) of an episode's ``actions``."""
        actions = self.dataset(episode, "actions")
        if actions.ndim != 2 or actions.shape[0] == 0:
            raise self.error(episode, "actions", f"has shape {list(actions.shape)}, expected [steps >= 1, action_dim]")
        if self.action_dim is not None and actions.shape[1] != self.action_dim:
            raise self.error(episode, "actions", f"has {actions.shape[1]} dims per action; the model's "
                                                 f"action_dim is {self.action_dim}")
        return actions.shape

    def check_images(self, episode: str, key: str, rows: int) -> tuple[int, int]:
        images = self.dataset(episode, key, rows)
        if images.ndim != 4 or images.shape[-1] != 3 or images.dtype != np.uint8:
            raise self.error(episode, key, f"holds {images.dtype} {list(images.shape)}, expected "
                                           "uint8 [steps, height, width, 3] camera images")
        size = tuple(images.shape[1:3])
        if self.image_size is not None and size != tuple(self.image_size):
            raise self.error(episode, key, f"images are {size[0]}x{size[1]} (height x width); the "
                                           f"env renders {self.image_size[0]}x{self.image_size[1]}")
        return size

    def summary(self) -> DemoSet:
        """Every episode checked (``check``), and what they hold together."""
        if not self.episodes:
            raise self.error(None, self.container, "no episodes" + (" that succeeded (success_only)"
                                                                     if self.success_only else ""))
        shapes = [self.check(e) for e in self.episodes]
        dims, sizes = {s[1] for s in shapes}, {s[2] for s in shapes}
        for what, found in (("action dims", dims), ("image sizes", sizes)):
            if len(found) > 1:
                raise self.error(None, self.container, f"episodes differ in {what}: {sorted(found)}")
        return DemoSet(self.path, self.format, len(self.episodes), sum(s[0] for s in shapes),
                       dims.pop(), sizes.pop(), self.instruction,
                       tuple(s for e in self.episodes if (s := self.seed(e)) is not None))

    @abc.abstractmethod
    def check(self, episode: str) -> tuple[int, int, tuple[int, int] | None]:
        """(steps, action dims, image size) of an episode, every key it needs checked."""

    @abc.abstractmethod
    def read(self, episode: str) -> Demo:
        """An episode checked by ``check``."""

    @property
    @abc.abstractmethod
    def instruction(self) -> str:
        """The instruction of the file's task, as the env adapter gives it."""

    def seed(self, episode: str) -> int | None:
        """The reset state an episode started from, where the format keeps one."""
        return None


class _ManiSkillFile(_File):
    format = MANISKILL
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
        from envs.maniskill import proprio_states

        group = self.file[episode]
        keys = self._proprio_keys(episode)
        if keys == ["obs/states"]:
            return group["obs/states"][:steps].astype(np.float32)
        parts = [{k: group[k][:steps] for k in keys if k.startswith(f"obs/{name}/")}
                 for name in ("agent", "extra")]
        return proprio_states(parts, steps)


class _LiberoFile(_File):
    format = LIBERO
    container = "data/demo_<i>"
    STATE_KEYS = ("obs/ee_states", "obs/gripper_states")

    def __init__(self, path: Path, file: h5py.File, main_camera: str, wrist_camera: str | None,
                 image_size: tuple[int, int] | None, action_dim: int | None, success_only: bool,
                 gripper_open_action: int):
        super().__init__(path, file, main_camera, wrist_camera, image_size, action_dim, success_only)
        self.gripper_open_action = gripper_open_action
        data = file["data"]
        convention = _text(data.attrs.get("macros_image_convention", "opengl"))
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
        bddl = _text(attrs.get("bddl_file_name", ""))
        if bddl and (suite := suite_task_description(Path(bddl).stem)) is not None:
            return suite
        if "problem_info" in attrs:
            try:
                return str(json.loads(_text(attrs["problem_info"]))["language_instruction"]).strip()
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


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


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
    are the ``gym.make`` arguments that rebuild the env (``envs.maniskill.make_kwargs``), its
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


class LiberoDemoWriter:
    """Episodes written in LIBERO's demo HDF5 layout (``_LiberoFile`` reads it back, as it reads
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
