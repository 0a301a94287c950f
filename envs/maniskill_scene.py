"""ManiSkill's scenes behind ``envs/maniskill.py``: everything that imports ManiSkill (SAPIEN,
gymnasium, torch). The env subprocesses import it (their forkserver's preload), and the driver for
``describe``; an env worker whose scenes live in subprocesses does not."""

from __future__ import annotations

import contextlib
import difflib
import functools
import logging
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from core.errors import EnvSetupError
from envs.maniskill import CAMERA_VARIANTS, has_cameras, select_vulkan_driver, task_description
from envs.protocol import PRIVILEGED_STATES, RENDER_IMAGES, STEP_FRAMES, video_keys

ON_LAVAPIPE = select_vulkan_driver()  # before SAPIEN makes its Vulkan instance (envs/maniskill.py)

import gymnasium as gym  # noqa: E402  (after the Vulkan driver is chosen)
import mani_skill.envs  # noqa: E402,F401  (registers the tasks)
import torch  # noqa: E402
from mani_skill.envs.utils.observations import parse_obs_mode_to_struct  # noqa: E402
from mani_skill.render.shaders import PREBUILT_SHADER_CONFIGS as SHADER_PACKS  # noqa: E402
from mani_skill.utils import assets  # noqa: E402
from mani_skill.utils.registration import REGISTERED_ENVS  # noqa: E402

from envs import sapien_lut  # noqa: E402
from envs.meshes import simplify_visual_meshes  # noqa: E402

if ON_LAVAPIPE:
    sapien_lut.install()  # cameras take the machine's stored BRDF table (ManiSkillVectorEnv makes it)


def unknown_task(task_id: Any) -> list[str] | None:
    """None for a task of ManiSkill's registry; otherwise its closest tasks (maybe none)."""
    if task_id in REGISTERED_ENVS:
        return None
    return difflib.get_close_matches(str(task_id), list(REGISTERED_ENVS), n=3)


def check_task(p: Mapping[str, Any]) -> None:
    """The checks of ``check_params``'d params that need ManiSkill's registry: the task exists,
    its assets are downloaded, the shader pack is one of ManiSkill's."""
    task_id = p["id"]
    if (close := unknown_task(task_id)) is not None:
        raise EnvSetupError(f"env.init_params.id={task_id!r} is not a ManiSkill task"
                            + (f"; did you mean {close}?" if close else "")
                            + " (python -c 'import mani_skill.envs; from mani_skill.utils."
                              "registration import REGISTERED_ENVS; print(sorted(REGISTERED_ENVS))'"
                              " lists them)")
    if p["shader_pack"] is not None and p["shader_pack"] not in SHADER_PACKS:
        raise EnvSetupError(f"env.init_params.shader_pack={p['shader_pack']!r}: expected null or one of "
                            f"{list(SHADER_PACKS)}")
    missing_assets = []
    for asset_id in REGISTERED_ENVS[task_id].asset_download_ids or []:
        ids = (assets.expand_data_group_into_individual_data_source_ids(asset_id)
               if asset_id in assets.DATA_GROUPS else [asset_id])
        missing_assets += [i for i in ids if not assets.is_data_source_downloaded(i)]
    if missing_assets:
        raise EnvSetupError(f"ManiSkill task {task_id} needs assets that are not downloaded "
                            f"({missing_assets[:5]}); on a machine with internet access run "
                            f"`python -m mani_skill.utils.download_asset {task_id}`")


def make_kwargs(p: Mapping[str, Any], num_envs: int, max_episode_steps: int, render: bool = False) -> dict[str, Any]:
    """The ``gym.make`` keyword arguments of these params (``render``: frames of the task's
    render camera at the camera size); with ManiSkill's trajectory files they are the
    ``env_kwargs`` that rebuild the env (envs/demos.py)."""
    lavapipe = select_vulkan_driver()
    kwargs: dict[str, Any] = dict(
        num_envs=num_envs, obs_mode="rgb" if has_cameras(p) else "state",
        control_mode=p["control_mode"], reward_mode=p["reward_mode"], sim_backend=p["sim_backend"],
        max_episode_steps=max_episode_steps,
    )
    if lavapipe or not torch.cuda.is_available():
        kwargs["render_backend"] = "cpu"
    if p["robot_uids"] is not None:
        kwargs["robot_uids"] = p["robot_uids"]
    frequencies = {k: p[k] for k in ("sim_freq", "control_freq") if p[k] is not None}
    if frequencies:  # merged into the task's own sim config
        kwargs["sim_config"] = frequencies
    if has_cameras(p):
        kwargs["sensor_configs"] = _camera(p)
    if render:
        kwargs["render_mode"] = "rgb_array"
        kwargs["human_render_camera_configs"] = _camera(p)
    return kwargs


def _camera(p: Mapping[str, Any]) -> dict[str, Any]:
    shader = {} if p["shader_pack"] is None else {"shader_pack": p["shader_pack"]}
    return dict(width=p["camera_widths"], height=p["camera_heights"], **shader)


class _QuietLog(logging.Filter):
    """ManiSkill's log (a handler of its own, not ``warnings``): each message once per process,
    and none of the messages known to be harmless here (``drop``)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: set[str] = set()
        self.drop: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if message in self.seen or message in self.drop:
            return False
        self.seen.add(message)
        return True


_QUIET = _QuietLog()
logging.getLogger("mani_skill ").addFilter(_QUIET)  # (sic: ManiSkill's logger name ends in a space)


def _known_harmless(p: Mapping[str, Any]) -> None:
    """A camera variant of a robot the task supports: ManiSkill's "not in the task's list of
    supported robots" warning, printed at every env construction, says nothing here."""
    robot, supported = p["robot_uids"], REGISTERED_ENVS[p["id"]].cls.SUPPORTED_ROBOTS
    if robot in CAMERA_VARIANTS and supported is not None and CAMERA_VARIANTS[robot] in supported:
        _QUIET.drop.add(f"{robot} is not in the task's list of supported robots. Code may not run as intended")


def _make(p: dict[str, Any], num_envs: int, max_episode_steps: int, render: bool,
          extra: dict[str, Any] | None = None) -> gym.Env:
    """``gym.make`` for these params (and ``extra`` keyword arguments), rendering only the cameras
    the policy reads, turning ManiSkill's failures into clear messages."""
    check_task(p)
    _known_harmless(p)
    try:
        env = gym.make(p["id"], **make_kwargs(p, num_envs, max_episode_steps, render) | (extra or {}))
    except AssertionError as e:
        if "not in supported modes" in str(e):
            supported = str(e).split(": ", 1)[-1]
            raise EnvSetupError(f"env.init_params.control_mode={p['control_mode']!r} is not "
                                f"supported by {p['id']}'s robot; expected one of {supported}") from None
        raise
    except EOFError:
        raise EnvSetupError(f"ManiSkill task {p['id']} (robot {p['robot_uids']}) asked to download "
                            "assets; on a machine with internet access run `python -m mani_skill."
                            f"utils.download_asset {p['id']}` (or the robot's id)") from None
    except RuntimeError as e:
        text = str(e)
        if any(m in text for m in ("vk::", "Vulkan", "physical device", "rendering device")):
            raise EnvSetupError(
                f"ManiSkill needs a Vulkan device and SAPIEN found none ({text}). Without a GPU: "
                "run `sudo bash scripts/setup_vulkan.sh` (Mesa 25 lavapipe into /opt/lavapipe, "
                "picked up automatically); with an NVIDIA GPU: install its driver's Vulkan ICD; "
                "or set VK_ICD_FILENAMES to a working driver's json") from None
        raise
    try:
        _prepare_scene(env, p)
    except EnvSetupError:
        env.close()
        raise
    return env


def _prepare_scene(env: gym.Env, p: dict[str, Any]) -> None:
    """What a built (or rebuilt) scene needs before it renders: only the cameras the policy
    reads, and visual meshes under ``render_mesh_triangles`` (envs/meshes.py)."""
    if has_cameras(p):
        _keep_cameras(env, p)
    if p["render_mesh_triangles"] is not None:
        simplify_visual_meshes(env.unwrapped.scene.sub_scenes, p["render_mesh_triangles"])


def _keep_cameras(env: gym.Env, p: dict[str, Any]) -> None:
    """Drop the cameras other than ``main_camera`` and ``wrist_camera`` from ManiSkill's sensors,
    which it renders at every observation: it has no option to leave a camera out, and each one
    costs about as much as the rest of a step. Called again after a reset that rebuilt them."""
    base = env.unwrapped
    if p["main_camera"] not in base._sensors:
        raise EnvSetupError(f"env.init_params.main_camera={p['main_camera']!r} is not a camera of "
                            f"{p['id']}; it has {sorted(base._sensors)}")
    kept = {k: v for k, v in base._sensors.items() if k in (p["main_camera"], p["wrist_camera"])}
    base._sensors = base.scene.sensors = kept


@contextlib.contextmanager
def _obs_mode(env: gym.Env, mode: str) -> Iterator[None]:
    """ManiSkill computes observations for the obs mode fixed at construction, with no public
    way to ask for another; this swaps it (and the parsed form its tasks read) meanwhile:
    ``none`` to step without an observation, ``state`` for the privileged state vector."""
    base = env.unwrapped
    saved = base._obs_mode, base.obs_mode_struct
    base._obs_mode, base.obs_mode_struct = mode, parse_obs_mode_to_struct(mode)
    try:
        yield
    finally:
        base._obs_mode, base.obs_mode_struct = saved


def _to_numpy(x: Any) -> np.ndarray:
    return x.cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)


def proprio_states(groups: Sequence[Mapping[str, Any]], batch: int) -> np.ndarray:
    """``states`` of an observation with cameras: every array of ManiSkill's ``agent`` then
    ``extra`` groups, in their order, flattened per env and concatenated (booleans as 0/1). The
    demonstration reader (envs/demos.py) applies it to ManiSkill's trajectory files."""
    return np.concatenate([_to_numpy(v).reshape(batch, -1).astype(np.float32)
                           for group in groups for v in group.values()], axis=1)


def extract_obs(raw: Any, p: dict[str, Any]) -> dict[str, np.ndarray]:
    """The observation arrays of the env protocol (envs/protocol.py) from a batched ManiSkill observation."""
    if not has_cameras(p):
        return {"states": _to_numpy(raw).astype(np.float32)}
    sensors = raw["sensor_data"]
    out = {"main_images": _to_numpy(sensors[p["main_camera"]]["rgb"])}
    if p["wrist_camera"] in sensors:
        out["wrist_images"] = _to_numpy(sensors[p["wrist_camera"]]["rgb"])
    out["states"] = proprio_states([raw.get("agent", {}), raw.get("extra", {})], out["main_images"].shape[0])
    return out


def _observe(env: gym.Env, raw: Any, p: dict[str, Any], render: bool) -> dict[str, np.ndarray]:
    """``extract_obs``, plus the privileged state (``rgb+state``) and the rendered scene under
    ``RENDER_IMAGES`` when videos want it."""
    obs = extract_obs(raw, p)
    if p["obs_mode"] == "rgb+state":
        with _obs_mode(env, "state"):
            obs[PRIVILEGED_STATES] = _to_numpy(env.unwrapped.get_obs()).astype(np.float32)
    if render:
        obs[RENDER_IMAGES] = _to_numpy(env.render())
    return obs


class ManiSkillEnv:
    """One ManiSkill scene on the CPU simulation: the ``SingleEnv`` of an env subprocess."""

    num_reset_states = None

    def __init__(self, p: dict[str, Any], max_episode_steps: int, render: bool = False):
        self.p = p
        self.render = render
        self.env = _make(p, num_envs=1, max_episode_steps=max_episode_steps, render=render)
        self.reset(0)
        self.obs_spec = {k: (v.shape, v.dtype) for k, v in self.observation().items()}
        self.action_dim = int(np.prod(self.env.action_space.shape))
        self.task_description = task_description(p["id"])

    def reset(self, state_id: int) -> None:
        self._raw_obs, info = self.env.reset(seed=state_id)
        self._obs = None
        if info["reconfigure"]:  # the task rebuilt its scene and cameras
            _prepare_scene(self.env, self.p)
            self._raw_obs = None

    def step(self, action: np.ndarray, observe: bool = True) -> tuple[float, bool, bool]:
        # the observation is made when read (observation(): once per chunk, after every step only
        # while a video records), so steps skip it whatever ``observe`` says: no task's reward
        # reads it, and rendering it would be most of the step's cost
        with _obs_mode(self.env, "none"):
            _, reward, terminated, _, info = self.env.step(action)
        self._raw_obs = self._obs = None
        return float(reward), bool(terminated), bool(info["success"])

    def observation(self) -> dict[str, np.ndarray]:
        if self._obs is None:  # once per state: a video reads the chunk's last step too
            if self._raw_obs is None:
                self._raw_obs = self.env.unwrapped.get_obs()
            self._obs = {k: v[0] for k, v in _observe(self.env, self._raw_obs, self.p, self.render).items()}
        return self._obs

    def close(self) -> None:
        self.env.close()


class ManiSkillGPUSim:
    """All envs in ManiSkill's batched GPU simulation (a ``BatchedSim``; ``step_frames`` as in
    ``envs.subproc.SubprocVectorEnv``). Unverified here."""

    num_reset_states = None

    def __init__(self, p: dict[str, Any], num_envs: int, max_episode_steps: int, render: bool = False,
                 step_frames: bool = False):
        if not torch.cuda.is_available():
            raise EnvSetupError("env.init_params.sim_backend=gpu needs a CUDA GPU and none is "
                                "visible; use sim_backend: cpu")
        self.p = p
        self.num_envs = num_envs
        self.render = render
        self.step_frames = step_frames
        self.env = _make(p, num_envs=num_envs, max_episode_steps=max_episode_steps, render=render)
        self.device = self.env.unwrapped.device
        self.action_dim = int(np.prod(self.env.unwrapped.single_action_space.shape))
        self.task_descriptions = [task_description(p["id"])] * num_envs

    def reset(self, env_ids: np.ndarray, state_ids: np.ndarray) -> dict[str, np.ndarray]:
        # GPU tasks draw a whole partial reset from one seed, so envs that were given the same
        # state id get their leader's state copied over afterwards.
        idx = torch.as_tensor(env_ids, device=self.device)
        obs, _ = self.env.reset(seed=int(state_ids[0]), options={"env_idx": idx})
        _, first = np.unique(state_ids, return_index=True)
        followers = np.setdiff1d(np.arange(len(env_ids)), first)
        if len(followers):
            leader_of = {s: env_ids[i] for i, s in zip(first, state_ids[first])}
            rows = torch.as_tensor([leader_of[s] for s in state_ids[followers]], device=self.device)
            states = _tree_index(self.env.unwrapped.get_state_dict(), rows)
            obs, _ = self.env.reset(options={
                "env_idx": torch.as_tensor(env_ids[followers], device=self.device),
                "reset_to_env_states": {"env_states": states},
            })
        return _observe(self.env, obs, self.p, self.render)

    def step_chunk(self, actions: np.ndarray) -> tuple[dict[str, np.ndarray], np.ndarray,
                                                        np.ndarray, np.ndarray]:
        rewards, terminated, success, frames = [], [], [], []
        for t in range(actions.shape[1]):
            obs, r, term, _, info = self.env.step(torch.as_tensor(actions[:, t], device=self.device))
            rewards.append(_to_numpy(r).astype(np.float32))
            terminated.append(_to_numpy(term).astype(bool))
            success.append(_to_numpy(info["success"]).astype(bool))
            if self.step_frames:
                frames.append(_observe(self.env, obs, self.p, self.render))
        out = frames[-1] if frames else _observe(self.env, obs, self.p, self.render)
        if frames:
            out = {**out, STEP_FRAMES: {k: np.stack([f[k] for f in frames], 1) for k in video_keys(out)}}
        return out, np.stack(rewards, 1), np.stack(terminated, 1), np.stack(success, 1)

    def close(self) -> None:
        self.env.close()


def _tree_index(tree: Any, rows: torch.Tensor) -> Any:
    if isinstance(tree, dict):
        return {k: _tree_index(v, rows) for k, v in tree.items()}
    return tree[rows]


@functools.lru_cache(maxsize=None)
def probe(task_id: str, obs_mode: str, control_mode: str, reward_mode: str,
          robot_uids: str | None) -> tuple[int, tuple[str, ...], int]:
    """``(length of obs["states"], cameras, action dims)`` of one env of these params: a CPU scene
    built and reset, not rendered (well under a second once ManiSkill is imported)."""
    p = {"id": task_id, "obs_mode": "state", "control_mode": control_mode, "reward_mode": reward_mode,
         "sim_backend": "cpu", "robot_uids": robot_uids, "render_mesh_triangles": None,
         "sim_freq": None, "control_freq": None, "shader_pack": None}
    env = _make(p, num_envs=1, max_episode_steps=1, render=False, extra={"render_backend": "none"})
    try:
        env.reset(seed=0)
        base = env.unwrapped
        if obs_mode == "state":
            with _obs_mode(env, "state"):
                state_dim = int(np.prod(base.get_obs().shape[1:]))
        else:  # what extract_obs gives: the agent and extra groups as rgb observes them
            with _obs_mode(env, "rgb"):
                state_dim = proprio_states([base._get_obs_agent(), base._get_obs_extra(base.get_info())], 1).shape[1]
        configs = [*_as_list(base.agent._sensor_configs), *_as_list(base._default_sensor_configs)]
        return state_dim, tuple(c.uid for c in configs), int(np.prod(env.action_space.shape))
    finally:
        env.close()


def _as_list(configs: Any) -> list[Any]:
    return list(configs) if isinstance(configs, (list, tuple)) else ([] if configs is None else [configs])
