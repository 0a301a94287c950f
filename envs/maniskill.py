"""ManiSkill3 tasks behind the vector-env interface (``env_type: maniskill``).

``init_params`` (see config/env/maniskill_*.yaml) pick the task by ``id``, ``obs_mode``
(``state``: ``states`` only; ``rgb``: ``main_images``, ``wrist_images`` when the robot carries
``wrist_camera``, and the robot's proprioception plus task extras as ``states``; ``rgb+state``:
what ``rgb`` gives plus ``privileged_states``, the full state vector ``state`` gives, so that a
state policy can drive an env that records what a VLA sees, see embodied/record.py), the
``control_mode``, the camera size, ``sim_backend``, the simulation and control frequencies
(``sim_freq`` / ``control_freq``: null keeps the task's own) and the cameras' ``shader_pack``
(null: ManiSkill's ``minimal``; it shades every camera rendered, observations and video). With
``video_cfg.save_video`` on and ``obs_mode: state`` the scene is also rendered
(``render_mode="rgb_array"``, at the camera size) for the video recorder; otherwise nothing is
rendered.

Rendering is most of a step's cost on a CPU (lavapipe), so only what the policy reads is
rendered: the cameras named ``main_camera`` and ``wrist_camera`` (ManiSkill renders every
camera of the task and robot otherwise), and on the CPU simulation only the observation that is
read, once per chunk (ManiSkill computes one after every step otherwise). Only while a video
records is every step rendered, so that the video holds one frame per env step
(``STEP_FRAMES``). A frame's cost there is its triangles, not its pixels: ``render_mesh_triangles``
simplifies the visual meshes above it when a scene is built (envs/meshes.py).

ManiSkill warns at every env construction that ``panda_wristcam`` is not among a task's supported
robots; it is the Panda with a wrist camera, so for tasks that support ``panda`` the warning is
dropped, and any other ManiSkill warning is shown once per process (``maniskill_scene._QuietLog``).

- ``cpu``: ManiSkill's CPU simulation holds one scene per env instance, so the envs run in
  subprocesses (``SubprocVectorEnv``: blocks of envs, one process per core unless
  ``env.num_processes`` says otherwise) and the batch steps in parallel on a multi-core machine;
  a lone env steps in this process.
- ``gpu``: ManiSkill's batched GPU simulation, all ``num_envs`` scenes in this process. Written
  against ManiSkill's documented API and not run here (no GPU on the development machines).

What imports ManiSkill (SAPIEN, gymnasium, torch: seconds of CPU per process) is in
``envs/maniskill_scene.py``: the scenes are built there, in the env subprocesses (and in the
driver for ``describe``), so an env worker whose scenes live in subprocesses never imports it.

SAPIEN needs a Vulkan device even for state observations. On a machine without a GPU that is
Mesa 25's lavapipe, which ``scripts/setup_vulkan.sh`` unpacks into ``/opt/lavapipe`` (or
``$LAVAPIPE_DIR``): when that exists and the user has chosen no Vulkan driver
(``VK_ICD_FILENAMES`` / ``VK_DRIVER_FILES``), importing this module points the Vulkan loader at
it, before SAPIEN creates its Vulkan instance, in this process and in every env process.
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from core.description import EnvDescription
from core.errors import EnvSetupError
from envs import sapien_lut
from envs.subproc import single_env_batch
from envs.vector_env import VectorEnv, read_options

# the config keys read here (tests/test_schema.py: every schema key is read or refused)
CONFIG_KEYS = ("env.*.num_processes", "env.*.init_params")

LAVAPIPE_ICD = Path(os.environ.get("LAVAPIPE_DIR", "/opt/lavapipe")) / "lvp_icd.json"


def select_vulkan_driver() -> bool:
    """Use the lavapipe of scripts/setup_vulkan.sh unless a Vulkan driver was chosen; True when
    lavapipe (a CPU device) is the driver."""
    chosen = os.environ.get("VK_ICD_FILENAMES") or os.environ.get("VK_DRIVER_FILES")
    if not chosen and LAVAPIPE_ICD.is_file():
        os.environ["VK_ICD_FILENAMES"] = chosen = str(LAVAPIPE_ICD)
    return bool(chosen) and "lvp" in Path(chosen.split(os.pathsep)[0]).name


select_vulkan_driver()

OBS_MODES = ("state", "rgb", "rgb+state")
SIM_BACKENDS = ("cpu", "gpu")
MIN_MESH_TRIANGLES = 100  # below it the robot's links lose their shape
PARAMS = ("id", "obs_mode", "control_mode", "sim_backend", "reward_mode", "robot_uids", "sim_freq", "control_freq",
          "camera_heights", "camera_widths", "main_camera", "wrist_camera", "shader_pack", "render_mesh_triangles")
# robots that are another robot plus cameras: a task that supports the base runs them as it is
CAMERA_VARIANTS = {"panda_wristcam": "panda"}

# Instructions for VLA prompts, in the words of each task's success condition.
TASK_DESCRIPTIONS = {
    "PushCube-v1": "push the blue cube onto the red and white target",
    "PullCube-v1": "pull the cube back onto the red and white target",
    "PickCube-v1": "pick up the red cube and move it to the green goal",
    "StackCube-v1": "stack the red cube on top of the green cube",
    "StackPyramid-v1": "stack the three cubes into a pyramid",
    "PokeCube-v1": "use the peg to push the cube onto the goal",
    "PullCubeTool-v1": "use the tool to pull the cube closer",
    "LiftPegUpright-v1": "lift the peg lying on the table into an upright pose",
    "PegInsertionSide-v1": "insert the peg into the hole of the box",
    "PlugCharger-v1": "plug the charger into the receptacle",
    "PlaceSphere-v1": "place the sphere into the bin",
    "RollBall-v1": "push the ball so that it rolls into the goal region",
    "PushT-v1": "push the T-shaped block onto the T-shaped target",
}


def task_description(task_id: str) -> str:
    """The instruction for ``task_id``; tasks without one get their id in words."""
    if task_id in TASK_DESCRIPTIONS:
        return TASK_DESCRIPTIONS[task_id]
    words = re.sub(r"(?<=[a-z0-9])(?=[A-Z])", " ", task_id.rsplit("-", 1)[0])
    return words.lower()


def check_params(init_params: Any) -> dict[str, Any]:
    """``env.init_params`` as a plain dict, with one clear error for each thing a user can get
    wrong in it; what only ManiSkill's registry knows (the task id, its assets, the shader pack)
    ``envs.maniskill_scene.check_task`` checks, before a scene is built and in ``describe``."""
    missing = [k for k in PARAMS if k not in init_params]
    if missing:
        raise EnvSetupError(f"env.init_params lacks {missing} (see config/env/maniskill_push_cube.yaml)")
    p = {k: init_params[k] for k in PARAMS}
    if p["obs_mode"] not in OBS_MODES:
        raise EnvSetupError(f"env.init_params.obs_mode={p['obs_mode']!r}: expected one of {OBS_MODES}")
    if p["sim_backend"] not in SIM_BACKENDS:
        raise EnvSetupError(f"env.init_params.sim_backend={p['sim_backend']!r}: expected one of "
                            f"{SIM_BACKENDS}")
    for key in ("camera_heights", "camera_widths"):
        if not (isinstance(p[key], int) and p[key] > 0):
            raise EnvSetupError(f"env.init_params.{key}={p[key]!r}: expected a positive integer")
    for key in ("sim_freq", "control_freq"):
        if p[key] is not None and (isinstance(p[key], bool) or not isinstance(p[key], int) or p[key] < 1):
            raise EnvSetupError(f"env.init_params.{key}={p[key]!r}: expected null (the task's) or a positive integer")
    if p["sim_freq"] and p["control_freq"] and p["sim_freq"] % p["control_freq"]:
        raise EnvSetupError(f"env.init_params.sim_freq={p['sim_freq']}: expected a multiple of control_freq "
                            f"({p['control_freq']}), whole simulation steps per action")
    cap = p["render_mesh_triangles"]
    if cap is not None:
        if isinstance(cap, bool) or not isinstance(cap, int) or cap < MIN_MESH_TRIANGLES:
            raise EnvSetupError(f"env.init_params.render_mesh_triangles={cap!r}: expected null or an "
                                f"integer >= {MIN_MESH_TRIANGLES}")
        if p["sim_backend"] == "gpu":
            raise EnvSetupError("env.init_params.render_mesh_triangles is not supported with sim_backend "
                                "gpu, because the GPU renderer batches the scenes' meshes when they are "
                                "built and is not bound by their triangles; set it to null")
    return p


def has_cameras(p: Mapping[str, Any]) -> bool:
    """Whether these params' observations hold camera images (``rgb``, ``rgb+state``)."""
    return p["obs_mode"] != "state"


def _scene(p: dict[str, Any], max_episode_steps: int, render: bool) -> Any:
    """One CPU scene (``ManiSkillEnv``), importing ManiSkill only where the scene is built."""
    from envs.maniskill_scene import ManiSkillEnv

    return ManiSkillEnv(p, max_episode_steps, render)


class ManiSkillVectorEnv(VectorEnv):
    """``num_envs`` envs of ``env_cfg`` (the registry's ``maniskill`` entry); the first has the
    global index ``seed_offset``."""

    def __init__(self, env_cfg: Any, num_envs: int, seed_offset: int = 0):
        from omegaconf import DictConfig, OmegaConf

        init_params = env_cfg["init_params"]
        if isinstance(init_params, DictConfig):
            init_params = OmegaConf.to_container(init_params, resolve=True)
        p = check_params(init_params)
        if env_cfg.get("task_suite_name") is not None:
            raise EnvSetupError(f"env.task_suite_name={env_cfg['task_suite_name']!r} is not "
                                "supported for env_type maniskill, because it names LIBERO "
                                "suites; ManiSkill's task is init_params.id")
        options = read_options(env_cfg, num_envs, seed_offset)
        steps = options["max_episode_steps"]
        video = bool(env_cfg["video_cfg"]["save_video"])
        render = video and p["obs_mode"] == "state"
        if p["sim_backend"] == "gpu":
            if env_cfg.get("num_processes") is not None:
                raise EnvSetupError("env.num_processes is not supported with init_params.sim_backend gpu, "
                                    "because one GPU simulation steps every env in this process")
            from envs.maniskill_scene import ManiSkillGPUSim

            sim = ManiSkillGPUSim(p, num_envs, steps, render, step_frames=video)
        else:
            if (render or has_cameras(p)) and select_vulkan_driver():
                sapien_lut.ensure()  # once per machine: each scene process would compute it (10 CPU-s)
            sim = single_env_batch([functools.partial(_scene, p, steps, render)] * num_envs,
                                   preload=["envs.maniskill_scene"], num_processes=env_cfg.get("num_processes"),
                                   step_frames=video)
        super().__init__(sim, seed_offset=seed_offset, **options)


def describe(env_cfg: Mapping[str, Any]) -> EnvDescription:
    """``check_params``'s and ``check_task``'s checks, and what the envs observe and take
    (``probe``), for the checks of a model against the env before any worker starts."""
    init_params = env_cfg["init_params"]
    if not isinstance(init_params, dict):
        from omegaconf import OmegaConf

        init_params = OmegaConf.to_container(init_params, resolve=True)
    p = check_params(init_params)
    from envs.maniskill_scene import check_task, probe

    check_task(p)
    state_dim, cameras, action_dim = probe(p["id"], p["obs_mode"], p["control_mode"], p["reward_mode"],
                                           p["robot_uids"])
    images: tuple[str, ...] = ()
    if has_cameras(p):
        if p["main_camera"] not in cameras:
            raise EnvSetupError(f"env.init_params.main_camera={p['main_camera']!r} is not a camera of "
                                f"{p['id']}; it has {list(cameras)}")
        images = ("main_images", "wrist_images") if p["wrist_camera"] in cameras else ("main_images",)
    robot = f" with robot {p['robot_uids']}" if p["robot_uids"] else ""
    wrist_fix = ("init_params.robot_uids=panda_wristcam" if p["wrist_camera"] is not None
                 else "init_params.wrist_camera=hand_camera")
    return EnvDescription(label=f"ManiSkill {p['id']}{robot}, control_mode {p['control_mode']}",
                          state_dim=state_dim, image_keys=images, wrist_camera_fix=wrist_fix,
                          action_dim=action_dim, task_descriptions=(task_description(p["id"]),))
