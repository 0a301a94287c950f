"""Demonstrations in the formats of the field, read as the env adapters show observations to a
policy, and written by ``python -m embodied.record`` in the format of the env it records.

A policy fine-tuned on demonstrations must see at eval exactly what it saw in training, so the
reader applies the adapters' own functions to the files: the same images (orientation, cameras,
size), the same ``states`` vector, the same instruction and the same action convention. Its
options (``demo_view`` derives them from an env config) say how the env shows things; a file
that cannot look like that is one ``DataError`` naming the file, the episode and the key.

Each env declares its format (``demos`` in its ``envs.ENVS`` entry: a ``DemoFormat``):
``envs/maniskill_demos.py`` (ManiSkill's trajectory format), ``envs/libero_demos.py`` (LIBERO's
demo HDF5). A file is read by the first format that recognizes its layout.
"""

from __future__ import annotations

import abc
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from core.errors import DataError, EnvSetupError
from core.registry import load
from envs import ENVS


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
    format: str  # the DemoFormat's name
    episodes: int  # those ``read_demos`` yields
    steps: int  # their actions in all
    action_dim: int
    image_size: tuple[int, int] | None  # (height, width); None without cameras
    task_description: str  # the instruction (one task per file in both formats)
    seeds: tuple[int, ...]  # the episodes' reset states (ManiSkill), to hold evaluation out of them


def demo_view(env_cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The ``read_demos`` options under which demos look as the env of ``env_cfg`` (an
    ``env.train`` / ``env.eval`` config) shows observations: its cameras and their size, and what
    its format adds (``DemoFormat.view``: e.g. the control mode or the gripper convention)."""
    p = env_cfg["init_params"]
    view = dict(main_camera=p["main_camera"], wrist_camera=p["wrist_camera"],
                image_size=(p["camera_heights"], p["camera_widths"]))
    return view | demo_format(env_cfg["env_type"]).view(p)


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
          success_only: bool = False, **options: Any) -> DemoFile:
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: no such demo file")
    try:
        file = h5py.File(path, "r")
    except OSError as err:
        raise DataError(f"{path}: not an HDF5 file ({err})") from None
    try:
        formats = [demo_format(name) for name in ENVS.names() if ENVS.declared(name)["demos"]]
        for fmt in formats:
            if fmt.recognizes(path, file):
                common = dict(main_camera=main_camera or fmt.main_camera, wrist_camera=wrist_camera,
                              image_size=image_size, action_dim=action_dim, success_only=success_only)
                return fmt.open(path, file, common, **options)
        raise DataError(f"{path}: neither {' nor '.join(f.layout(path) for f in reversed(formats))}; "
                        f"top-level keys: {sorted(file)[:10]}")
    except BaseException:
        file.close()
        raise


class DemoFile(abc.ABC):
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

    def __enter__(self) -> DemoFile:
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


class DemoFormat(abc.ABC):
    """What an env declares about demonstrations: how its files are recognized, opened and read
    (the options its view adds), how the env is set up to record and what writes the file."""

    name: str  # DemoSet.format
    main_camera: str  # the camera read when the view names none

    @abc.abstractmethod
    def layout(self, path: Path) -> str:
        """How its files are laid out, for the message when no format recognizes one."""

    @abc.abstractmethod
    def view(self, params: Mapping[str, Any]) -> dict[str, Any]:
        """The read options an env's ``init_params`` add to the cameras and their size."""

    @abc.abstractmethod
    def recognizes(self, path: Path, file: h5py.File) -> bool:
        """Whether ``file`` has this format's layout."""

    @abc.abstractmethod
    def open(self, path: Path, file: h5py.File, common: dict[str, Any], **options: Any) -> DemoFile:
        """The file opened for reading with the options every format takes (``common``) and its
        own; other formats' options are not its business."""

    @abc.abstractmethod
    def recording(self, params: dict[str, Any], expert: bool) -> bool:
        """Set up ``init_params`` (in place) to record; whether the policy (an ``expert``, or one
        that reads states) is given the privileged state."""

    @abc.abstractmethod
    def writer(self, out: str, env: Any, env_cfg: Any, source: str) -> Any:
        """What writes the episodes (``add(obs, actions, rewards, success, seed)``, ``close``)."""

    def expert_options(self, params: Mapping[str, Any]) -> dict[str, Any]:
        """Keyword arguments a scripted expert of this env takes from ``init_params``."""
        return {}


def demo_format(env_type: str) -> DemoFormat:
    """The demo format ``env_type`` declares, or one error naming the envs that have one."""
    target = ENVS.declared(env_type)["demos"] if env_type in ENVS.names() else None
    if target is None:
        having = [n for n in ENVS.names() if ENVS.declared(n)["demos"]]
        raise EnvSetupError(f"env.env_type={env_type!r}: demonstrations are read and recorded for {having} envs")
    return load(target)


def text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
