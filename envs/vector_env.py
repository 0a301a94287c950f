"""The vector env: the env protocol (``envs/protocol.py``) over any simulator, with the episode
bookkeeping every simulator shares.

A simulator adapter only has to step a batch of envs (a ``BatchedSim``: ManiSkill's GPU sim, or
``SubprocVectorEnv`` over one-scene processes); ``VectorEnv`` puts the reference options on top
(chunked steps, time limit, terminations, auto-reset, reset states and groups, relative rewards,
reward scaling, success tracking) so that they mean the same thing for every simulator.

Chunk semantics (``chunk_step(actions[B, C, A])``):

- All ``C`` actions are executed for every env. An env whose episode ends inside the chunk (success
  or failure unless ``ignore_terminations``, or ``max_episode_steps`` reached) gets reward 0 for
  the rest of the chunk, and its termination / truncation is reported in the chunk's last slot.
- ``infos`` describe each env's episode as it stood at the end of the chunk, before any reset:
  ``success`` (at the episode's last step so far), ``success_once`` (at any step),
  ``episode_return`` (sum of the rewards returned), ``episode_length`` (env steps), ``done``
  (the episode ended in this chunk), ``extra_episode`` (see reset states below) and
  ``task_descriptions`` (each env's task). For a finished
  env these are the final episode's figures.
- With ``auto_reset`` the finished envs are reset once, after the chunk; the returned
  observation is then the new episode's first one and ``infos["final_obs"]`` holds the whole
  batch's observation before that reset. Without it a finished env idles (still simulated,
  reward 0, never done again, figures frozen) until the next ``reset()``.

Reset states: a reset state id picks an episode's initial state (a seed for ManiSkill, a
(task, init state) pair for LIBERO). Without explicit ids each env's next id is a function of
``(seed, stream, episode number)`` (``envs.protocol.ResetStates``), where the stream is the env's
global index (``seed_offset + i``), or its group's index with ``use_fixed_reset_state_ids`` so
that every env of a group starts each episode from the same state, also after auto-resets. The
episode numbers are the only state that decides future reset states: ``next_episodes`` reads them
and ``set_next_episodes`` hands them to a rebuilt env (after offloading, or a restart from a
checkpoint), which then resets into exactly the episodes this one would have started.

- ``reset_state_order: shuffled`` (the default): an unbounded set of reset states
  (``num_reset_states`` None, e.g. seeds) is drawn at random; a finite set of ``N`` states is
  visited evenly: each block of ``N`` episodes of all ``total_num_envs`` streams starts every
  state once, in a fresh random order, whatever the number of envs (exactly even whenever all
  streams have started equally many episodes, as without auto-reset; within a cycle otherwise).
- ``ordered``: the same blocks in order (seeds 0, 1, 2, ... for an unbounded set); ``random``:
  each episode's state drawn at random, with replacement (RLinf's training default).
- ``each_reset_state_once`` (the eval protocol, also for "every held-out prompt once"): the
  envs' episodes ``0 .. rounds - 1`` together start every state exactly once (ordered, so that a
  LIBERO env stays on one task for consecutive episodes). Episodes past a stream's run repeat a
  state to keep the batch full and are flagged in ``infos["extra_episode"]``, which
  ``EpisodeStats`` leaves out. Needs ``auto_reset: false``: the caller runs ``rounds`` episodes
  per env, one per ``reset()``.

Relative rewards: ``r'_t = r_t - r_{t-1}`` within an episode with ``r'_0 = 0``, so an episode's
relative rewards sum to its last absolute reward minus its first; ``reward_coef`` multiplies after.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from core.errors import EnvSetupError
from envs.protocol import Obs, ResetStates

# the config keys read here (tests/test_schema.py: every schema key is read or refused)
CONFIG_KEYS = ("env.*.total_num_envs", "env.*.auto_reset", "env.*.ignore_terminations",
               "env.*.use_fixed_reset_state_ids", "env.*.group_size", "env.*.max_episode_steps",
               "env.*.use_rel_reward", "env.*.reward_coef", "env.*.seed", "env.*.each_reset_state_once",
               "env.*.reset_state_order")

class BatchedSim(Protocol):
    """What ``VectorEnv`` needs from a simulator: a fixed batch of envs stepped together."""

    num_envs: int
    action_dim: int
    num_reset_states: int | None  # reset state ids are in [0, num_reset_states); None: 2**31
    task_descriptions: list[str]  # each env's task in its current episode (read after resets)

    def reset(self, env_ids: np.ndarray, state_ids: np.ndarray) -> dict[str, np.ndarray]:
        """Reset ``env_ids`` to ``state_ids``; returns the observation arrays of all envs."""

    def step_chunk(
        self, actions: np.ndarray
    ) -> tuple[dict[str, np.ndarray], np.ndarray, np.ndarray, np.ndarray]:
        """Execute ``actions[B, C, A]``; returns the observation after the last step and, per
        step, ``rewards[B, C]`` (float), ``terminated[B, C]`` and ``success[B, C]`` (bool)."""

    def close(self) -> None: ...


_OPTIONS = ("auto_reset", "ignore_terminations", "use_fixed_reset_state_ids", "group_size",
            "max_episode_steps", "use_rel_reward", "reward_coef", "seed", "total_num_envs",
            "each_reset_state_once")


def read_options(env_cfg: Any, num_envs: int, seed_offset: int = 0) -> dict[str, Any]:
    """The reference options of an env config, checked against this vector env's size, with one
    clear error for a missing or bad value (before any simulator starts)."""
    missing = [k for k in _OPTIONS if k not in env_cfg]
    if missing:
        raise EnvSetupError(f"env config lacks {missing}; env group files start with "
                            "`defaults: [base, _self_]` to inherit config/env/base.yaml")
    options = {k: env_cfg[k] for k in _OPTIONS}
    if "reset_state_order" in env_cfg:  # a simulator's (the text envs take init_params.shuffle)
        options["reset_state_order"] = env_cfg["reset_state_order"]
    check_options(options, num_envs, seed_offset)
    return options


def check_options(options: dict[str, Any], num_envs: int, seed_offset: int) -> None:
    group_size, steps = options["group_size"], options["max_episode_steps"]
    total = options.get("total_num_envs")
    if total is not None and not (isinstance(total, int) and total >= seed_offset + num_envs):
        raise EnvSetupError(f"env.total_num_envs={total!r} is smaller than the {seed_offset} + "
                            f"{num_envs} envs built so far")
    if options.get("each_reset_state_once") and options.get("reset_state_order", "shuffled") != "shuffled":
        raise EnvSetupError(f"env.reset_state_order={options['reset_state_order']!r} has no effect with "
                            "env.each_reset_state_once (the eval protocol starts every state once, in its own "
                            "order): leave it shuffled")
    if options.get("each_reset_state_once") and options.get("auto_reset"):
        raise EnvSetupError("env.each_reset_state_once runs one episode per env and reset(); "
                            "it needs env.auto_reset: false")
    if not (isinstance(group_size, int) and group_size >= 1 and num_envs % group_size == 0):
        raise EnvSetupError(f"env.group_size={group_size!r} must be a positive divisor of the "
                            f"{num_envs} envs of this vector env")
    if options["use_fixed_reset_state_ids"] and seed_offset % group_size:
        raise EnvSetupError(f"seed_offset={seed_offset} splits a group of env.group_size="
                            f"{group_size}; groups must not span workers or stages")
    if not (isinstance(steps, int) and steps >= 1):
        raise EnvSetupError(f"env.max_episode_steps={steps!r}: expected a positive integer")


class VectorEnv:
    """Chunked stepping, episodes, reset states and rewards over a ``BatchedSim``."""

    def __init__(self, sim: BatchedSim, *, auto_reset: bool, ignore_terminations: bool,
                 use_fixed_reset_state_ids: bool, group_size: int, max_episode_steps: int,
                 use_rel_reward: bool, reward_coef: float, seed: int, seed_offset: int = 0,
                 total_num_envs: int | None = None, each_reset_state_once: bool = False,
                 reset_state_order: str = "shuffled"):
        n = sim.num_envs
        try:
            check_options(dict(group_size=group_size, max_episode_steps=max_episode_steps,
                               use_fixed_reset_state_ids=use_fixed_reset_state_ids,
                               total_num_envs=total_num_envs, auto_reset=auto_reset,
                               each_reset_state_once=each_reset_state_once,
                               reset_state_order=reset_state_order), n, seed_offset)
            if each_reset_state_once and not sim.num_reset_states:
                raise EnvSetupError("env.each_reset_state_once needs a finite set of reset "
                                    "states; this env's are unbounded (seeds)")
        except BaseException:
            sim.close()
            raise
        self.sim = sim
        self.num_envs = n
        self.action_dim = sim.action_dim
        self.auto_reset = bool(auto_reset)
        self.ignore_terminations = bool(ignore_terminations)
        self.use_fixed_reset_state_ids = bool(use_fixed_reset_state_ids)
        self.group_size = group_size
        self.max_episode_steps = max_episode_steps
        self.use_rel_reward = bool(use_rel_reward)
        self.reward_coef = float(reward_coef)
        self.seed = int(seed)
        self.seed_offset = int(seed_offset)
        total = total_num_envs or seed_offset + n
        self._states = ResetStates(sim.num_reset_states, total // group_size if self.use_fixed_reset_state_ids
                                   else total, self.seed, order=reset_state_order,
                                   each_once=bool(each_reset_state_once))
        self._state_ids = np.zeros(n, np.int64)
        self._extra = np.zeros(n, bool)
        self._episode_index = np.full(n, -1, np.int64)
        self._length = np.zeros(n, np.int32)
        self._return = np.zeros(n, np.float32)
        self._success = np.zeros(n, bool)
        self._success_once = np.zeros(n, bool)
        self._prev_reward = np.zeros(n, np.float32)
        self._idle = np.zeros(n, bool)
        self._started = False

    @property
    def task_descriptions(self) -> list[str]:
        return list(self.sim.task_descriptions)

    @property
    def rounds(self) -> int:
        """Episodes per env that start every reset state once (``each_reset_state_once``)."""
        return self._states.rounds

    def reset_state_name(self, state_id: int) -> str:
        """A reset state in words, for file names; adapters with named states override it."""
        return f"state{state_id}"

    @property
    def extra_episodes(self) -> np.ndarray:
        """Which envs run an extra episode (``each_reset_state_once``) since the last reset."""
        return self._extra.copy()

    @property
    def reset_state_names(self) -> list[str]:
        """The reset state each env's current episode started from."""
        return [self.reset_state_name(int(s)) for s in self._state_ids]

    def reset(self, reset_state_ids: np.ndarray | list[int] | None = None) -> Obs:
        """Start a new episode in every env, from ``reset_state_ids`` (one per env) if given."""
        env_ids = np.arange(self.num_envs)
        self._episode_index += 1
        self._extra[:] = False
        if reset_state_ids is None:
            state_ids = self._next_state_ids(env_ids)
        else:
            state_ids = np.asarray(reset_state_ids)
            if (state_ids.shape != (self.num_envs,) or state_ids.dtype.kind not in "iu"
                    or state_ids.min() < 0 or state_ids.max() >= self._states.num_states):
                raise ValueError(f"reset_state_ids: expected {self.num_envs} integers in "
                                 f"[0, {self._states.num_states}), got {reset_state_ids!r}")
        obs = self.sim.reset(env_ids, state_ids)
        self._state_ids[:] = state_ids
        self._start_episodes(env_ids)
        self._idle[:] = False
        self._started = True
        return self._with_tasks(obs)

    def chunk_step(self, actions: np.ndarray) -> tuple[Obs, np.ndarray, np.ndarray, np.ndarray,
                                                        dict[str, Any]]:
        """Execute ``actions[B, C, A]``; see the module docstring for what comes back."""
        if not self._started:
            raise RuntimeError("chunk_step before reset(): call reset() first")
        actions = np.asarray(actions, dtype=np.float32)
        if actions.ndim != 3 or actions.shape[0] != self.num_envs or actions.shape[2] != self.action_dim:
            raise ValueError(f"actions: expected shape [{self.num_envs}, chunk, {self.action_dim}], "
                             f"got {list(actions.shape)}")
        obs, raw_rewards, raw_terminated, raw_success = self.sim.step_chunk(actions)
        b, chunk = actions.shape[:2]
        rows, steps = np.arange(b), np.arange(chunk)
        # the step (index in the chunk) at which each env's episode ends, if it does
        term = raw_terminated.astype(bool) & (not self.ignore_terminations)
        trunc = (self._length[:, None] + steps + 1) >= self.max_episode_steps
        ends = (term | trunc) & ~self._idle[:, None]
        ended = ends.any(axis=1)
        last = np.where(ended, ends.argmax(axis=1), chunk - 1)
        live = (steps <= last[:, None]) & ~self._idle[:, None]
        terminated = ended & term[rows, last]
        truncated = ended & trunc[rows, last]

        raw = raw_rewards.astype(np.float32)
        if self.use_rel_reward:
            prev = np.concatenate([self._prev_reward[:, None], raw[:, :-1]], axis=1)
            first = self._length == 0
            prev[first, 0] = raw[first, 0]
            raw_out = raw - prev
        else:
            raw_out = raw
        rewards = np.where(live, raw_out * np.float32(self.reward_coef), np.float32(0))
        stepped = live.any(axis=1)
        self._prev_reward[stepped] = raw[stepped, last[stepped]]
        self._return += rewards.sum(axis=1)
        self._length += live.sum(axis=1, dtype=np.int32)
        self._success[stepped] = raw_success[stepped, last[stepped]]
        self._success_once |= (raw_success.astype(bool) & live).any(axis=1)
        done = terminated | truncated
        terminations = np.zeros((b, chunk), bool)
        truncations = np.zeros((b, chunk), bool)
        terminations[:, -1] = terminated
        truncations[:, -1] = truncated
        infos: dict[str, Any] = {
            "success": self._success.copy(),
            "success_once": self._success_once.copy(),
            "episode_return": self._return.copy(),
            "episode_length": self._length.copy(),
            "done": done,
            "extra_episode": self._extra.copy(),
            "task_descriptions": list(self.sim.task_descriptions),
        }
        if self.auto_reset and done.any():
            infos["final_obs"] = self._with_tasks({k: v.copy() for k, v in obs.items()})
            env_ids = np.flatnonzero(done)
            self._episode_index[env_ids] += 1
            state_ids = self._next_state_ids(env_ids)
            obs = self.sim.reset(env_ids, state_ids)
            self._state_ids[env_ids] = state_ids
            self._start_episodes(env_ids)
        else:
            self._idle |= done
        return self._with_tasks(obs), rewards, terminations, truncations, infos

    def next_episodes(self) -> np.ndarray:
        """The episode number each env starts at its next reset. An episode that has been reset
        into but not yet stepped counts as not started (a rebuilt env starts exactly it, e.g.
        the one an auto-reset began at the end of a rollout); one in flight is given up."""
        unstepped = (self._length == 0) & ~self._idle & self._started
        return self._episode_index + 1 - unstepped

    def set_next_episodes(self, numbers: np.ndarray | list[int]) -> None:
        """Continue another env's episode numbering (its ``next_episodes``); the next
        ``reset()`` starts episode ``numbers[i]`` in env ``i``."""
        numbers = np.asarray(numbers, np.int64)
        if numbers.shape != (self.num_envs,) or numbers.min() < 0:
            raise ValueError(f"next episodes: expected {self.num_envs} integers >= 0, got {numbers!r}")
        self._episode_index[:] = numbers - 1
        self._started = False

    def pop_metrics(self) -> dict[str, float]:
        return {}

    def pop_samples(self) -> list[dict[str, Any]]:
        return []

    def flush(self) -> None:
        """Nothing is being written (the video wrapper finishes its files here)."""

    def close(self) -> None:
        self.sim.close()

    def __enter__(self) -> VectorEnv:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _start_episodes(self, env_ids: np.ndarray) -> None:
        self._length[env_ids] = 0
        self._return[env_ids] = 0.0
        self._success[env_ids] = False
        self._success_once[env_ids] = False
        self._prev_reward[env_ids] = 0.0

    def _next_state_ids(self, env_ids: np.ndarray) -> np.ndarray:
        """The reset states of these envs' current episode numbers; flags the extra episodes of
        ``each_reset_state_once``."""
        streams = self.seed_offset + env_ids
        if self.use_fixed_reset_state_ids:
            streams = streams // self.group_size
        state_ids, self._extra[env_ids] = self._states.ids(streams, self._episode_index[env_ids])
        return state_ids

    def _with_tasks(self, obs: dict[str, np.ndarray]) -> Obs:
        return {**obs, "task_descriptions": list(self.sim.task_descriptions)}
