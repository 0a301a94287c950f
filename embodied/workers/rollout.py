"""Rollout worker: batched policy inference for the env stages it serves, recording what the
actor needs to recompute log-probs, and shipping the finished trajectories to the actor ranks."""

from __future__ import annotations

import itertools
import time
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

import numpy as np
import torch
from omegaconf import DictConfig

from embodied.backends import build_rollout_policy
from embodied.config.validate import replicas
from embodied.batch import Trajectory
from embodied.channel import Channel
from embodied.channel.keys import action_key, obs_key, replay_key
from embodied.worker import Worker
from envs import ENVS
from envs.protocol import NO_TOKEN
from policies.base import ActOutput, Policy

# the config keys read here (tests/test_schema.py: every schema key is read or refused)
CONFIG_KEYS = ("actor.model.do_sample", "algorithm.sampling_params.temperature_eval")
PROBE_ROWS = 8  # responses of the first rollout kept to check every weight sync (serving engines)
POLL_S = 0.001  # how often stages that step on their own are looked at, while none has an observation


def replay_pieces(num_rollout: int, num_actor: int, envs_per_rollout: int) -> list[tuple[int, int, int, int]]:
    """How rollout ranks' env columns split over actor groups (data-parallel ranks): ``(rollout,
    group, start, stop)``. Rollout rank r holds global columns ``[r * n, (r + 1) * n)``; group k
    trains an equal, contiguous share of them."""
    per_actor = num_rollout * envs_per_rollout // num_actor
    pieces = []
    for r in range(num_rollout):
        lo, hi = r * envs_per_rollout, (r + 1) * envs_per_rollout
        for k in range(lo // per_actor, (hi - 1) // per_actor + 1):
            pieces.append((r, k, max(lo, k * per_actor) - lo, min(hi, (k + 1) * per_actor) - lo))
    return pieces


class RolloutWorker(Worker):
    def __init__(self, cfg: DictConfig, channel: Channel, env_world_size: int, actor_world_size: int):
        self.cfg, self.channel = cfg, channel
        self.replicas = replicas(cfg)  # actor ranks that train on the same samples
        self.actor_groups = actor_world_size // self.replicas
        self.device = torch.device("cuda" if self.accelerator == "gpu" else "cpu")
        if self.accelerator == "cpu":
            torch.set_num_threads(1)
        self.policy = build_rollout_policy(cfg, cpu_threads=1).to(self.device).eval()
        self.probe: dict[str, Any] | None = None  # see check_sync
        self.version = 0  # updates applied to the weights acting now (the samples carry it)
        stages = cfg.rollout.pipeline_stage_num
        # (env rank, stage) streams this rank serves, in a fixed order
        self.streams = [(e, s) for e in range(env_world_size) if e % self.world_size == self.rank
                        for s in range(stages)]

    def set_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        """The actor's trainable weights after ``version`` updates."""
        self.policy.load_trainable_state_dict(state_dict)
        self.version = version

    def probe_batch(self) -> dict[str, Any] | None:
        """A few responses of this rank's first training rollout (``forward_inputs`` and actions)."""
        return self.probe

    def check_sync(self, probe: dict[str, Any], actor_logprobs: torch.Tensor, step: int) -> float:
        """With a serving engine: the largest per-token gap between the engine's log-probs of
        ``probe`` and the actor's; a gap above the engine's tolerance is an error naming the step."""
        return self.policy.verify_sync(probe["forward_inputs"], probe["actions"], actor_logprobs, step=step)

    def load_checkpoint(self, folder: str, version: int) -> None:
        """Weights of a training checkpoint's ``actor`` folder, in the policy's own layout."""
        self.set_weights(self.policy.read_checkpoint(folder), version)

    def offload(self) -> None:
        """Free the policy's memory between phases (``Policy.release_weights``)."""
        self.policy.release_weights()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def reload(self) -> None:
        self.policy.restore_weights()

    @torch.no_grad()
    def generate(self, split: str, num_chunk_steps: int, seed: int) -> dict[str, float]:
        """Serve ``num_chunk_steps`` chunk steps of every stream; training trajectories go to the
        actor ranks through the replay channel. ``seed`` makes the sampling of one training step
        the same in an interrupted-and-resumed run as in an uninterrupted one. Returns the time
        spent waiting for observations and the rest (inference, bookkeeping)."""
        torch.manual_seed(seed * 1009 + self.rank)
        train = split == "train"
        if split == "eval":  # greedy unless temperature_eval > 0
            temperature = self.cfg.algorithm.sampling_params.temperature_eval or None
            do_sample = temperature is not None
        else:  # training, and eval_pass_k, sample as training does
            temperature, do_sample = None, self.cfg.actor.model.do_sample
        records = {stream: defaultdict(list) for stream in self.streams}
        served = dict.fromkeys(self.streams, 0)  # observations taken from each stream so far
        turns = itertools.cycle(self.streams)
        concurrent = ENVS.declared(self.cfg.env[split].env_type)["concurrent_stages"]
        start, waited = time.monotonic(), 0.0
        while served:
            tic = time.monotonic()
            # a stream at a time in a fixed order (the same samples however the stages are timed),
            # or, where the env's stages step on their own, every stream whose observation waits
            streams = self._waiting(split, served) if concurrent else [next(turns)]
            messages = {stream: self.channel.get(obs_key(self.cfg, split, *stream)) for stream in streams}
            waited += time.monotonic() - tic
            acting = []
            for stream, message in messages.items():
                record = records[stream]
                if served[stream] > 0 and train:
                    self._record_env(record, message)
                if served[stream] == num_chunk_steps:
                    del served[stream]
                    if train and self.policy.has_value_head:
                        record["values"].append(self.policy.values(message["obs"]))
                else:
                    served[stream] += 1
                    acting.append(stream)
            if acting:
                self._act(split, acting, [messages[s]["obs"] for s in acting], [records[s] for s in acting], train,
                          do_sample, temperature)
        if train:
            self._send(Trajectory.cat([self._trajectory(records[s]) for s in self.streams], dim=1))
        return {"time/rollout_wait": waited, "time/rollout_busy": time.monotonic() - start - waited}

    def _act(self, split: str, streams: list[tuple[int, int]], observations: list[dict[str, Any]],
             records: list[dict[str, list]], train: bool, do_sample: bool, temperature: float | None) -> None:
        """Act on the observations of ``streams`` in one batch; each stream gets its actions."""
        for stream, record, out in zip(streams, records, act_together(self.policy, observations, do_sample=do_sample,
                                                                      temperature=temperature)):
            token_mask = torch.ones_like(out.logprobs, dtype=torch.bool) if out.token_mask is None else out.token_mask
            sent = out.actions if out.token_mask is None else out.actions.masked_fill(~token_mask, NO_TOKEN)
            self.channel.put(action_key(self.cfg, split, *stream), sent.cpu().numpy())
            if train and self.probe is None:
                self.probe = {"forward_inputs": {k: v[:PROBE_ROWS].clone() for k, v in out.forward_inputs.items()},
                              "actions": out.actions[:PROBE_ROWS].clone()}
            if train:
                record["actions"].append(out.actions)
                record["logprobs"].append(out.logprobs)
                record["token_mask"].append(token_mask)
                record["forward_inputs"].append(out.forward_inputs)
                if out.values is not None:
                    record["values"].append(out.values)

    def _waiting(self, split: str, streams: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
        """The streams with an observation waiting, once there is one."""
        keys = {stream: obs_key(self.cfg, split, *stream) for stream in streams}
        while True:
            ready = [stream for stream, key in keys.items() if self.channel.qsize(key)]
            if ready:
                return ready
            time.sleep(POLL_S)

    def _record_env(self, record: dict[str, list], message: dict[str, Any]) -> None:
        for key in ("rewards", "terminations", "truncations"):
            record[key].append(torch.as_tensor(np.array(message[key])))
        if self.policy.has_value_head:
            envs = len(message["rewards"])
            reset = torch.zeros(envs, dtype=torch.bool)
            final = torch.zeros(envs)
            if "final_obs" in message:  # auto-reset: the next observation starts a new episode
                reset = torch.as_tensor(np.array(message["done"]))
                final = self._bootstrap(self.policy.values(message["final_obs"]))
            record["final_values"].append(final)
            record["auto_reset"].append(reset)

    def _bootstrap(self, values: torch.Tensor) -> torch.Tensor:
        """The value that bootstraps an episode's last step: the chunk's value, or with
        action-level values the value of the observation's first action."""
        return values[..., 0] if self.cfg.actor.model.value_type == "action_level" else values

    def _trajectory(self, record: dict[str, list]) -> Trajectory:
        traj = Trajectory(
            forward_inputs={k: torch.stack([f[k] for f in record["forward_inputs"]]) for k in record["forward_inputs"][0]},
            **{k: torch.stack(record[k]) for k in ("actions", "logprobs", "token_mask", "rewards", "terminations",
                                                   "truncations")})
        traj.versions = torch.full(traj.rewards.shape[:2], self.version, dtype=torch.int64)
        if self.policy.has_value_head:
            # where no auto-reset happened, the episode's final observation is simply the next one
            values = torch.stack(record["values"])
            next_values = self._bootstrap(values[1:])
            traj.values = values
            traj.final_values = torch.where(torch.stack(record["auto_reset"]), torch.stack(record["final_values"]),
                                            next_values)
        return traj

    def _send(self, traj: Trajectory) -> None:
        """Each actor group's share (``replay_pieces``) to every rank of the group."""
        envs = traj.rewards.shape[1]
        for r, k, start, stop in replay_pieces(self.world_size, self.actor_groups, envs):
            if r == self.rank:
                piece = traj.map(lambda x: x[:, start:stop].numpy())
                for rank in range(k * self.replicas, (k + 1) * self.replicas):
                    self.channel.put(replay_key(self.cfg, rank), {"source": (self.rank, start), "trajectory": piece})


def act_together(policy: Policy, observations: list[dict[str, Any]], **sampling: Any) -> list[ActOutput]:
    """One ``policy.act`` over several streams' observations (arrays and tensors stacked, lists
    joined), split back into each stream's share."""
    if len(observations) == 1:
        return [policy.act(observations[0], **sampling)]
    out = policy.act({key: _cat([obs[key] for obs in observations]) for key in observations[0]}, **sampling)
    parts, stop = [], 0
    for obs in observations:
        rows = slice(stop, stop + len(next(v for v in obs.values() if isinstance(v, (np.ndarray, torch.Tensor)))))
        stop = rows.stop
        parts.append(ActOutput(actions=out.actions[rows], logprobs=out.logprobs[rows],
                               values=None if out.values is None else out.values[rows],
                               forward_inputs={k: v[rows] for k, v in out.forward_inputs.items()},
                               token_mask=None if out.token_mask is None else out.token_mask[rows]))
    return parts


def _cat(values: list[Any]) -> Any:
    if isinstance(values[0], np.ndarray):
        return np.concatenate(values)
    if isinstance(values[0], torch.Tensor):
        return torch.cat(values)
    return [x for v in values for x in v]
