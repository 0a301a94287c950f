"""``python -m embodied.record``: record demonstrations of any policy the framework runs, or of
a scripted expert (``--expert``, envs/experts.py), to fine-tune a VLA on them: ManiSkill envs in
ManiSkill's trajectory format, LIBERO envs in LIBERO's demo HDF5 layout (one file per task in the
folder ``--out``): the format each env declares (``envs/demos.py``), which writes and reads them.

    python -m embodied.record --config-name maniskill_ppo_mlp \\
        runner.ckpt_path=results/maniskill_ppo_mlp/checkpoints --out demos/push_cube \\
        --episodes 100 env.train.init_params.camera_heights=64 env.train.init_params.camera_widths=64
    python -m embodied.record --config-name libero_spatial_ppo_openvla_oft --expert libero_pick_place \\
        --out demos/libero_object env.train.task_suite_name=libero_object 'env.train.init_params.task_ids=[0]'

The config is composed as for ``embodied-train`` (Hydra overrides last); the policy is
``actor.model`` with the weights of ``runner.ckpt_path`` when that is set, acting greedily unless
``--sample``; the episodes run in ``--num-envs`` envs of the ``--split`` env config
(``envs.make_vector_env``, with this process driving them: no Ray). The file holds what a VLA
sees (camera images, proprioception, the instruction) whatever the policy reads: the policy of an
``obs_mode: state`` config drives the same task with its cameras rendered (``rgb+state``), acting
on the full state vector while images and proprioception are recorded. An expert reads the
privileged state too (ManiSkill: ``rgb+state``; LIBERO: ``init_params.privileged_states``), which
the file never holds for LIBERO.

Attempt ``i`` (failures count) starts from reset state ``--first-reset-state + i``, a ManiSkill
seed kept as the episode's ``episode_seed``, so that evaluation can be held out of them. Every
observation is recorded, so a policy's action chunks run one env step at a time. Episodes end at
success or at the env's ``max_episode_steps``; only successful ones are kept unless
``--keep-failures``, until ``--episodes`` are kept or ``--max-attempts`` have started. The count,
the success rate and the file are printed, and the last line is one JSON line; exit code 1 when
fewer episodes than asked were kept, 2 for a config error.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from core.errors import ConfigError, EnvSetupError
from embodied import checkpoint
from embodied.config import build_policy, compose
from envs.demos import demo_format
from envs.experts import EXPERTS
from envs.protocol import PRIVILEGED_STATES, Env, Obs
from policies.base import Policy

PROG = "embodied.record"
RECORDED = ("main_images", "wrist_images", "states", "privileged_states")  # what the file keeps


@dataclass
class Recording:
    """What a recording did: ``kept`` episodes written of ``attempts`` started."""

    kept: int
    attempts: int
    successes: int
    env_steps: int

    @property
    def success_rate(self) -> float:
        return self.successes / max(self.attempts, 1)


def recording_env(env_cfg: DictConfig, num_envs: int, expert: bool = False) -> tuple[DictConfig, bool]:
    """The env config to record in (``num_envs`` envs, one episode each per reset, ended by
    success or the time limit, no video), and whether the policy reads the privileged state
    (an ``expert``, or a config with ``obs_mode: state``, which records in ``rgb+state``)."""
    cfg = OmegaConf.to_container(env_cfg)  # composed configs come resolved
    try:
        reads_state = demo_format(cfg["env_type"]).recording(cfg["init_params"], expert)
    except EnvSetupError as err:
        raise ConfigError(f"{PROG}: {err}") from None
    cfg.update(total_num_envs=num_envs, auto_reset=False, ignore_terminations=False,
               use_fixed_reset_state_ids=False, group_size=1, each_reset_state_once=False)
    cfg["video_cfg"]["save_video"] = False
    return OmegaConf.create(cfg), reads_state


def load_policy(cfg: DictConfig) -> Policy:
    """``actor.model`` with the weights of ``runner.ckpt_path`` (as ``embodied-eval`` loads them)."""
    policy = build_policy(cfg.actor.model)
    if cfg.runner.ckpt_path is not None:
        source = checkpoint.resolve(cfg.runner.ckpt_path, "runner.ckpt_path")
        policy.load_trainable_state_dict(policy.read_checkpoint(Path(source) / "actor"))
    return policy.eval()


def policy_actions(policy: Policy, reads_state: bool, do_sample: bool) -> Callable[[Obs], np.ndarray]:
    """Observations -> actions ``[B, C, A]`` of ``policy``; one that reads the state is given
    the privileged state vector as its ``states``."""
    @torch.no_grad()
    def act(obs: Obs) -> np.ndarray:
        if reads_state:
            obs = {"states": obs[PRIVILEGED_STATES], "task_descriptions": obs["task_descriptions"]}
        return policy.act(obs, do_sample=do_sample).actions.cpu().numpy()

    return act


def expert_actions(name: str, env_cfg: DictConfig) -> Callable[[Obs], np.ndarray]:
    """Observations -> one-step chunks ``[B, 1, A]`` of the scripted expert ``name``."""
    env_type, expert = EXPERTS[name]
    if env_type != env_cfg.env_type:
        raise ConfigError(f"--expert {name} drives env_type {env_type}; this env is {env_cfg.env_type}")
    expert = functools.partial(expert, **demo_format(env_type).expert_options(env_cfg.init_params))
    return lambda obs: expert(obs[PRIVILEGED_STATES])[:, None]


def record(env: Env, act: Callable[[Obs], np.ndarray], writer: Any, *, episodes: int,
           max_attempts: int, first_reset_state: int = 0, keep_failures: bool = False,
           perturb: Callable[[np.ndarray], np.ndarray] | None = None) -> Recording:
    """Run rounds of one episode per env, from reset states ``first_reset_state + attempt``,
    writing the successful episodes (all with ``keep_failures``) until ``episodes`` are written
    or ``max_attempts`` have started. With ``perturb`` the env executes ``perturb(actions)`` while
    the actions as ``act`` chose them are recorded."""
    result = Recording(kept=0, attempts=0, successes=0, env_steps=0)
    while writer.num_episodes < episodes and result.attempts < max_attempts:
        counted = min(env.num_envs, max_attempts - result.attempts)  # envs past the last attempt replay it, uncounted
        ids = first_reset_state + result.attempts + np.minimum(np.arange(env.num_envs), counted - 1)
        obs = env.reset(ids)
        runs = [_Run(obs, i) for i in range(env.num_envs)]
        live = np.ones(env.num_envs, bool)
        while live.any():
            chunk = act(obs)
            executed = chunk if perturb is None else perturb(chunk)
            for c in range(chunk.shape[1]):
                obs, rewards, terminations, truncations, infos = env.chunk_step(executed[:, c:c + 1])
                for i in np.flatnonzero(live):
                    runs[i].step(chunk[i, c], obs, rewards[i, -1], terminations[i, -1],
                                 truncations[i, -1], infos["success"][i])
                result.env_steps += int(live.sum())
                live &= ~infos["done"]
                if not live.any():
                    break
        for seed, run in zip(ids[:counted], runs):
            result.attempts += 1
            result.successes += run.succeeded
            if (run.succeeded or keep_failures) and writer.num_episodes < episodes:
                run.write(writer, int(seed))
    result.kept = writer.num_episodes
    return result


class _Run:
    """One env's episode as it unfolds: observations (T+1) and per-step records (T)."""

    def __init__(self, obs: Obs, row: int):
        self.row = row
        self.task_description = obs["task_descriptions"][row]
        self.obs = defaultdict(list)
        self.steps = defaultdict(list)
        self._observe(obs)

    @property
    def succeeded(self) -> bool:
        return bool(self.steps["success"]) and bool(self.steps["success"][-1])

    def step(self, action: np.ndarray, obs: Obs, reward: float, terminated: bool, truncated: bool,
             success: bool) -> None:
        for key, value in (("actions", action), ("rewards", reward), ("terminated", terminated),
                           ("truncated", truncated), ("success", success)):
            self.steps[key].append(value)
        self._observe(obs)

    def write(self, writer: Any, seed: int) -> None:
        writer.add({k: np.stack(v) for k, v in self.obs.items()},
                   **{k: np.asarray(v) for k, v in self.steps.items()},
                   seed=seed, task_description=self.task_description)

    def _observe(self, obs: Obs) -> None:
        for key in RECORDED:
            if key in obs:
                self.obs[key].append(obs[key][self.row])


def translation_noise(std: float, seed: int) -> Callable[[np.ndarray], np.ndarray]:
    """DART's perturbation (Laskey et al., 2017): Gaussian noise on the first three action dims,
    the end effector's translation that the experts steer back (they hold the orientation, so
    noise there would drift for good), clipped to the action range [-1, 1]."""
    rng = np.random.default_rng(seed)

    def perturb(actions: np.ndarray) -> np.ndarray:
        noisy = actions.copy()
        noisy[..., :3] = np.clip(noisy[..., :3] + rng.normal(0.0, std, noisy[..., :3].shape), -1, 1)
        return noisy

    return perturb


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--config-name", "-cn", default="maniskill_ppo_mlp", help="experiment file in config/")
    parser.add_argument("--config-path", "-cp", default=None, help="folder holding the configs (default: config/)")
    parser.add_argument("--out", required=True, help="trajectory file to write: OUT.h5 and OUT.json")
    parser.add_argument("--episodes", type=int, default=50, help="episodes to keep")
    parser.add_argument("--split", choices=("train", "eval"), default="train", help="env config to record in")
    parser.add_argument("--num-envs", type=int, default=8, help="envs stepped together")
    parser.add_argument("--first-reset-state", type=int, default=0, help="reset state (seed) of the first attempt")
    parser.add_argument("--max-attempts", type=int, default=None,
                        help="episodes to start at most (default: 4 x --episodes)")
    parser.add_argument("--keep-failures", action="store_true", help="keep unsuccessful episodes too")
    parser.add_argument("--sample", action="store_true", help="sample actions instead of acting greedily")
    parser.add_argument("--expert", choices=sorted(EXPERTS), default=None,
                        help="a scripted expert (envs/experts.py) acts instead of actor.model")
    parser.add_argument("--action-noise", type=float, default=0.0,
                        help="with --expert: the env executes the expert's action plus Gaussian noise of this std "
                             "on the end effector's translation, and the expert's action is recorded (DART: the "
                             "demos show it steering back from states it alone never visits)")
    parser.add_argument("--seed", type=int, default=0,
                        help="torch seed (sampled actions, an untrained policy's weights) and --action-noise's")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides such as runner.ckpt_path=DIR")
    args = parser.parse_intermixed_args(argv)
    for name in ("episodes", "num_envs"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.action_noise < 0 or (args.action_noise and args.expert is None):
        parser.error("--action-noise must be a std >= 0, and is read with --expert only")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse(argv)
    tic = time.monotonic()
    torch.manual_seed(args.seed)
    max_attempts = args.max_attempts or 4 * args.episodes
    num_envs = min(args.num_envs, max_attempts)  # an env past the last attempt would only replay it
    try:
        cfg = compose(args.config_name, args.overrides, args.config_path)
        env_cfg, reads_state = recording_env(cfg.env[args.split], num_envs, expert=args.expert is not None)
        if args.expert:
            act, source = expert_actions(args.expert, env_cfg), f"expert {args.expert} (envs/experts.py, scripted, reads object poses)"
            if args.action_noise:
                source += f", executed with translation noise of std {args.action_noise} (DART)"
        else:
            act = policy_actions(load_policy(cfg), reads_state, args.sample)
            source = f"{args.config_name} ({cfg.actor.model.model_type}"
            source += f", checkpoint {cfg.runner.ckpt_path})" if cfg.runner.ckpt_path is not None else ", untrained)"
            source += ", sampled" if args.sample else ", greedy"
        from envs import make_vector_env

        env = make_vector_env(env_cfg, num_envs=num_envs)
        last = args.first_reset_state + max_attempts
        if env.sim.num_reset_states is not None and last > env.sim.num_reset_states:
            env.close()
            raise ConfigError(f"--first-reset-state {args.first_reset_state} + --max-attempts (default 4 x "
                              f"--episodes) reach reset state {last - 1}; the env has {env.sim.num_reset_states}")
        writer = demo_format(env_cfg.env_type).writer(args.out, env, env_cfg, f"{PROG}: {source}")
    except (ConfigError, FileNotFoundError) as err:
        print(f"{PROG}: config error: {err}", file=sys.stderr)
        return 2
    with env, writer:
        perturb = translation_noise(args.action_noise, args.seed) if args.action_noise else None
        result = record(env, act, writer, episodes=args.episodes, max_attempts=max_attempts,
                        first_reset_state=args.first_reset_state, keep_failures=args.keep_failures,
                        perturb=perturb)
    files = [str(p) for p in writer.paths]
    what = "episodes" if args.keep_failures else "successful episodes"
    print(f"{PROG}: {result.kept} {what} written to {', '.join(files)}; "
          f"{result.successes} of {result.attempts} attempts succeeded (success rate "
          f"{result.success_rate:.3f}), {result.env_steps} env steps")
    if result.kept < args.episodes:
        print(f"{PROG}: only {result.kept} of the {args.episodes} episodes asked for within "
              f"{result.attempts} attempts (raise --max-attempts)", file=sys.stderr)
    print(json.dumps({"files": files, "episodes": result.kept, "attempts": result.attempts,
                      "success_rate": round(result.success_rate, 4), "env_steps": result.env_steps,
                      "wall_s": round(time.monotonic() - tic, 1)}), flush=True)
    return 0 if result.kept >= args.episodes else 1


if __name__ == "__main__":
    sys.exit(main())
