"""Env worker: owns ``total_num_envs / world_size`` envs of each split, in
``rollout.pipeline_stage_num`` stages, and trades observations for actions with its rollout
worker through the channel, one stage at a time, so that one stage steps while another infers.
Env types that declare ``concurrent_stages`` (the agent env: a turn mostly waits on its tools)
step each stage in a thread of its own, as soon as its actions come: an episode waiting on a
slow tool holds only its own stage, and the rollout batches whichever stages are waiting
(``embodied/workers/rollout.py``).

The worker, not its simulators, owns each env's episode numbering (which decides its future reset
states): simulators rebuilt after ``offload``, or in a run resumed from a checkpoint
(``episode_state`` / ``load_episode_state``), start the episodes these would have started."""

from __future__ import annotations

import threading
import time
from collections import defaultdict, deque
from collections.abc import Iterator
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from typing import Any

import numpy as np
from omegaconf import DictConfig

from embodied.channel import Channel
from embodied.channel.keys import action_key, obs_key
from embodied.worker import Worker
from envs import ENVS, make_vector_env
from envs.episode_stats import EpisodeStats
from envs.protocol import Env
from envs.video import VideoRecorder

# the config keys read here (tests/test_schema.py: every schema key is read or refused)
CONFIG_KEYS = ("env.non_finite", "rollout.pipeline_stage_num")


class EnvWorker(Worker):
    def __init__(self, cfg: DictConfig, channel: Channel, first_split: str):
        """``first_split``: the split built now, so that a bad env config fails at launch, not at
        the first step (the runner's: ``eval`` for SFT and evaluations, which step no training
        env). Importing this module loads no torch (about 1.5 CPU-seconds of a process's start):
        env types that need it load it when built (LIBERO's init states, a lone in-process
        ManiSkill scene, the GPU simulation); scenes in processes of their own leave it there."""
        self.cfg, self.channel = cfg, channel
        self.stages = cfg.rollout.pipeline_stage_num
        self.envs: dict[str, list[Env]] = {}
        self.last_obs: dict[str, list[dict[str, Any]]] = {}
        # episode numbering of the splits whose simulators are not built (yet, or since offload)
        self.next_episodes: dict[str, np.ndarray] = {}
        self.stats: dict[str, EpisodeStats] = defaultdict(EpisodeStats)  # per split
        self.masked: dict[str, int] = {}  # non-finite values set to 0 per split (env.non_finite: mask)
        self._build(first_split)

    def _build(self, split: str) -> list[Env]:
        if split not in self.envs:
            env_cfg = self.cfg.env[split]
            per_worker = env_cfg.total_num_envs // self.world_size
            per_stage = per_worker // self.stages
            self.envs[split] = [
                make_vector_env(env_cfg, per_stage, seed_offset=self.rank * per_worker + stage * per_stage,
                                name=f"{split}_rank{self.rank}_stage{stage}")
                for stage in range(self.stages)
            ]
            if split in self.next_episodes:
                self._continue_episodes(split, self.next_episodes.pop(split))
        return self.envs[split]

    def _continue_episodes(self, split: str, numbers: np.ndarray) -> None:
        for env, part in zip(self.envs[split], np.split(numbers, self.stages)):
            env.set_next_episodes(part)

    def rounds(self, split: str) -> int:
        """Episodes per env (one per ``interact``) in which this worker's envs start every reset
        state of their share once (``env.<split>.each_reset_state_once``); 1 otherwise."""
        return max(env.rounds for env in self._build(split))

    def interact(self, split: str, num_chunk_steps: int, first_round: bool = False) -> dict[str, float]:
        """Run ``num_chunk_steps`` chunk steps on every stage; returns episode statistics.
        Training envs with ``auto_reset`` carry on where the last call stopped; otherwise every
        call starts fresh episodes. ``first_round`` with ``each_reset_state_once`` starts the
        envs' episode numbering over, so that every evaluation covers the same reset states."""
        envs = self._build(split)
        if first_round and self.cfg.env[split].each_reset_state_once:
            for env in envs:
                env.set_next_episodes(np.zeros(env.num_envs, np.int64))
        continue_episodes = split == "train" and self.cfg.env.train.auto_reset and split in self.last_obs
        obs = self.last_obs[split] if continue_episodes else [None] * self.stages
        stats, lock = self.stats[split], threading.Lock()
        steps, waits = [0] * self.stages, [0.0] * self.stages

        def run_stage(stage: int) -> Iterator[None]:
            """Reset (unless continuing) and step one stage, pausing after each message it sends."""
            env = envs[stage]
            if not continue_episodes:
                obs[stage] = env.reset()  # the policy starts on this stage while the next resets
                with lock:
                    self._check_finite(split, 0, stage, obs[stage], None)
            self.channel.put(obs_key(self.cfg, split, self.rank, stage), {"obs": obs[stage]})
            yield
            for step in range(1, num_chunk_steps + 1):
                tic = time.monotonic()
                actions = self.channel.get(action_key(self.cfg, split, self.rank, stage))
                waits[stage] += time.monotonic() - tic
                obs[stage], rewards, terminations, truncations, infos = env.chunk_step(actions)
                with lock:
                    self._check_finite(split, step, stage, obs[stage], rewards)
                    stats.update(infos)
                steps[stage] += rewards.size
                message = {"obs": obs[stage], "rewards": rewards, "terminations": terminations,
                           "truncations": truncations}
                if "final_obs" in infos:
                    message["final_obs"] = infos["final_obs"]
                    message["done"] = infos["done"]
                self.channel.put(obs_key(self.cfg, split, self.rank, stage), message)
                yield

        start = time.monotonic()
        stages = [run_stage(stage) for stage in range(self.stages)]
        if ENVS.declared(self.cfg.env[split].env_type)["concurrent_stages"] and self.stages > 1:
            _concurrently(stages)
            waited = sum(waits) / self.stages  # the stages wait side by side
        else:  # a chunk step of each stage in turn
            for _ in range(num_chunk_steps + 1):
                for stage in stages:
                    next(stage)
            waited = sum(waits)
        env_steps = sum(steps)
        self.last_obs[split] = obs
        for env in envs:  # one finished video file per call: workers are killed, not closed, at the end
            env.flush()
        episodes = stats.num_episodes
        metrics = stats.pop(prefix=f"{split}/")
        metrics[f"{split}/env_steps"] = float(env_steps)
        metrics[f"time/{split}_env_wait_s"] = waited  # for actions: the policy side bounds the rollout when long
        metrics[f"time/{split}_env_busy_s"] = time.monotonic() - start - waited
        if self.cfg.env.non_finite == "mask":
            metrics[f"{split}/non_finite"] = float(self.masked.pop(split, 0))
        metrics.update(_env_metrics(envs, split, episodes))
        return metrics

    def pop_videos(self, split: str) -> list[dict[str, Any]]:
        """The video files finished since the last call, with each episode's reset state, task,
        length and success (``VideoRecorder.pop_episodes``); none without ``save_video``."""
        return [e for env in self.envs.get(split, []) if isinstance(env, VideoRecorder) for e in env.pop_episodes()]

    def pop_samples(self, split: str) -> list[dict[str, Any]]:
        """Examples of the last ``interact`` (text envs: prompt, response, answer, reward)."""
        return [s for env in self.envs.get(split, []) for s in env.pop_samples()]

    def _check_finite(self, split: str, step: int, stage: int, obs: dict[str, Any],
                      rewards: np.ndarray | None) -> None:
        """NaN or inf in observations or rewards: with ``env.non_finite: error`` stop, naming this
        env rank, the chunk step and the envs; with ``mask`` set them to 0 (in place) and count
        the values masked (``<split>/non_finite``; episode figures such as the return are the
        simulator's, unmasked)."""
        parts = {k: v for k, v in obs.items() if isinstance(v, np.ndarray) and v.dtype.kind == "f"}
        if rewards is not None:
            parts["rewards"] = rewards
        bad = {k: ~np.isfinite(v) for k, v in parts.items()}
        bad = {k: b for k, b in bad.items() if b.any()}
        if not bad:
            return
        if self.cfg.env.non_finite == "error":
            per_stage = self.cfg.env[split].total_num_envs // self.world_size // self.stages
            first = (self.rank * self.stages + stage) * per_stage  # global index of this stage's env 0
            what = "; ".join(f"{k} of env(s) {sorted({first + i for i in np.nonzero(b)[0].tolist()})}"
                             for k, b in bad.items())
            raise FloatingPointError(
                f"env rank {self.rank}: non-finite values at {split} chunk step {step}: {what}; "
                "set env.non_finite=mask to zero and count them instead")
        for key, b in bad.items():
            parts[key][b] = 0
            self.masked[split] = self.masked.get(split, 0) + int(b.sum())

    def episode_state(self) -> dict[str, list[int]]:
        """Per split, the episode number each of this worker's envs starts next, in global env
        order: what the runner saves with a checkpoint."""
        live = {split: _next_episodes(envs) for split, envs in self.envs.items()}
        return {split: numbers.tolist() for split, numbers in (self.next_episodes | live).items()}

    def load_episode_state(self, state: dict[str, list[int]]) -> None:
        """Continue a saved run's episode numbering; ``state`` holds each split's numbers for all
        envs of the run (every worker's ``episode_state`` in rank order). The episodes in flight
        here are given up: the next ``interact`` resets every env."""
        for split, numbers in state.items():
            per_worker = self.cfg.env[split].total_num_envs // self.world_size
            mine = np.asarray(numbers[self.rank * per_worker:(self.rank + 1) * per_worker], np.int64)
            if split in self.envs:
                self._continue_episodes(split, mine)
            else:
                self.next_episodes[split] = mine
        self.last_obs.clear()

    def close(self) -> None:
        """Close the simulators, keeping their episode numbering for a rebuild."""
        for split, envs in self.envs.items():
            self.next_episodes[split] = _next_episodes(envs)
            for env in envs:
                env.close()
        self.envs.clear()

    def offload(self) -> None:
        """Simulators are rebuilt on the next ``interact``; episodes in flight are dropped."""
        self.close()
        self.last_obs.clear()


def _env_metrics(envs: list[Env], split: str, episodes: int) -> dict[str, float]:
    """An env's own counters (``pop_metrics``, e.g. the text env's unparsable responses), as
    fractions of this call's episodes; ``prompts_filtered`` stays a count, and the agent env's
    ``tool_s`` (seconds in tool calls, summed over calls that overlap) is logged as ``time/<split>_tool_s``."""
    totals: dict[str, float] = {}
    for env in envs:
        for key, value in env.pop_metrics().items():
            totals[key] = value if key == "prompts_filtered" else totals.get(key, 0.0) + value
    seconds = totals.pop("tool_s", None)
    out = {f"{split}/{k}": v if k == "prompts_filtered" else v / max(episodes, 1) for k, v in totals.items()}
    return out if seconds is None else {**out, f"time/{split}_tool_s": seconds}


def _concurrently(stages: list[Iterator[None]]) -> None:
    """Run each stage to its end in a thread of its own; the first error is raised at once (the
    other stages may be waiting for actions that will not come: their threads are left behind)."""
    pool = ThreadPoolExecutor(len(stages), "env-stage")
    futures = [pool.submit(deque, stage, maxlen=0) for stage in stages]
    done, _ = wait(futures, return_when=FIRST_EXCEPTION)
    pool.shutdown(wait=False)
    for future in done:
        future.result()


def _next_episodes(envs: list[Env]) -> np.ndarray:
    """The episode number each env of a split's stages starts next, stage after stage."""
    return np.concatenate([env.next_episodes() for env in envs])
