"""Rollout worker: batched policy inference for the env stages it serves, recording what the
actor needs to recompute log-probs, and shipping the finished trajectories to the actor ranks."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import numpy as np
import torch
from omegaconf import DictConfig

from embodied.algorithms.trajectory import tree_cat, tree_map
from embodied.channel import Channel
from embodied.worker import Worker
from embodied.workers.env import action_key, obs_key
from policies import build_policy

# the config keys read here (tests/test_schema.py: every schema key is read or refused)
CONFIG_KEYS = ("actor.model.do_sample", "actor.model.add_value_head", "actor.model.is_lora")


def replay_pieces(num_rollout: int, num_actor: int, envs_per_rollout: int) -> list[tuple[int, int, int, int]]:
    """How rollout ranks' env columns split over actor ranks: ``(rollout, actor, start, stop)``.
    Rollout rank r holds global columns ``[r * n, (r + 1) * n)``; actor k trains an equal,
    contiguous share of them."""
    per_actor = num_rollout * envs_per_rollout // num_actor
    pieces = []
    for r in range(num_rollout):
        lo, hi = r * envs_per_rollout, (r + 1) * envs_per_rollout
        for k in range(lo // per_actor, (hi - 1) // per_actor + 1):
            pieces.append((r, k, max(lo, k * per_actor) - lo, min(hi, (k + 1) * per_actor) - lo))
    return pieces


@torch.no_grad()
def _release_weights(model: torch.nn.Module) -> None:
    """Every tensor of ``model.state_dict()`` becomes a meta tensor (same shape and dtype, no
    storage); ``load_state_dict(..., assign=True)`` restores them. Non-persistent buffers, which
    no state dict carries, stay as they are."""
    for name in model.state_dict():
        owner, _, attr = name.rpartition(".")
        module = model.get_submodule(owner)
        tensor = getattr(module, attr)
        meta = tensor.to("meta")
        setattr(module, attr, torch.nn.Parameter(meta, tensor.requires_grad)
                if isinstance(tensor, torch.nn.Parameter) else meta)


class RolloutWorker(Worker):
    def __init__(self, cfg: DictConfig, channel: Channel, env_world_size: int, actor_world_size: int):
        self.cfg, self.channel = cfg, channel
        self.actor_world_size = actor_world_size
        self.device = torch.device("cuda" if self.accelerator == "gpu" else "cpu")
        if self.accelerator == "cpu":
            torch.set_num_threads(1)
        self.policy = build_policy(cfg.actor.model).to(self.device).eval()
        self.offloaded = False
        stages = cfg.rollout.pipeline_stage_num
        # (env rank, stage) streams this rank serves, in a fixed order
        self.streams = [(e, s) for e in range(env_world_size) if e % self.world_size == self.rank
                        for s in range(stages)]

    def set_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        if self.cfg.actor.model.is_lora:
            from policies.lora import load_adapter_state_dict

            load_adapter_state_dict(self.policy, state_dict)
        elif self.offloaded:  # the weights' memory was released: take the new tensors as they are
            dtypes = {k: v.dtype for k, v in self.policy.state_dict().items()}
            self.policy.load_state_dict({k: v.to(self.device, dtypes.get(k, v.dtype))
                                         for k, v in state_dict.items()}, assign=True)
            self.offloaded = False
        else:
            self.policy.load_state_dict(state_dict)

    def load_checkpoint(self, folder: str) -> None:
        """Weights of a training checkpoint's ``actor`` folder, in the policy's own layout."""
        self.set_weights(self.policy.read_checkpoint(folder))

    def offload(self) -> None:
        """Free the policy's memory between phases. The next ``set_weights`` brings full weights
        back, so their memory is released outright (meta tensors: shapes only); with LoRA only
        the adapters come back, so the model moves to host memory until ``reload``."""
        if self.offloaded:
            return
        if self.cfg.actor.model.is_lora:
            self.policy.to("cpu")
        else:
            _release_weights(self.policy)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        self.offloaded = True

    def reload(self) -> None:
        """LoRA: the model back onto the device. Full weights return with ``set_weights``."""
        if self.offloaded and self.cfg.actor.model.is_lora:
            self.policy.to(self.device)
            self.offloaded = False

    @torch.no_grad()
    def generate(self, split: str, num_chunk_steps: int, seed: int) -> None:
        """Serve ``num_chunk_steps`` chunk steps of every stream; training trajectories go to the
        actor ranks through the replay channel. ``seed`` makes the sampling of one training step
        the same in an interrupted-and-resumed run as in an uninterrupted one."""
        torch.manual_seed(seed * 1009 + self.rank)
        train = split == "train"
        do_sample = self.cfg.actor.model.do_sample if split != "eval" else False  # eval: greedy; eval_pass_k samples
        records = {stream: defaultdict(list) for stream in self.streams}
        for t in range(num_chunk_steps + 1):
            for stream in self.streams:
                message = self.channel.get(obs_key(self.cfg, split, *stream))
                record = records[stream]
                if t > 0 and train:
                    self._record_env(record, message)
                if t == num_chunk_steps:
                    if train and self.policy_has_values:
                        record["values"].append(self.policy.act(message["obs"], do_sample=False).values)
                    continue
                out = self.policy.act(message["obs"], do_sample=do_sample)
                self.channel.put(action_key(self.cfg, split, *stream), out.actions.cpu().numpy())
                if train:
                    record["actions"].append(out.actions)
                    record["logprobs"].append(out.logprobs)
                    record["token_mask"].append(torch.ones_like(out.logprobs, dtype=torch.bool)
                                                if out.token_mask is None else out.token_mask)
                    record["forward_inputs"].append(out.forward_inputs)
                    if out.values is not None:
                        record["values"].append(out.values)
        if train:
            self._send([self._trajectory(records[s]) for s in self.streams])

    @property
    def policy_has_values(self) -> bool:
        return bool(self.cfg.actor.model.add_value_head)

    def _record_env(self, record: dict[str, list], message: dict[str, Any]) -> None:
        for key in ("rewards", "terminations", "truncations"):
            record[key].append(torch.as_tensor(np.array(message[key])))
        if self.policy_has_values:
            envs = len(message["rewards"])
            reset = torch.zeros(envs, dtype=torch.bool)
            final = torch.zeros(envs)
            if "final_obs" in message:  # auto-reset: the next observation starts a new episode
                reset = torch.as_tensor(np.array(message["done"]))
                final = self._bootstrap(self.policy.act(message["final_obs"], do_sample=False).values)
            record["final_values"].append(final)
            record["auto_reset"].append(reset)

    def _bootstrap(self, values: torch.Tensor) -> torch.Tensor:
        """The value that bootstraps an episode's last step: the chunk's value, or with
        action-level values the value of the observation's first action."""
        return values[..., 0] if self.cfg.actor.model.value_type == "action_level" else values

    def _trajectory(self, record: dict[str, list]) -> dict[str, Any]:
        traj: dict[str, Any] = {k: torch.stack(v) for k, v in record.items() if k != "forward_inputs"}
        traj["forward_inputs"] = {k: torch.stack([f[k] for f in record["forward_inputs"]])
                                  for k in record["forward_inputs"][0]}
        if "final_values" in traj:
            # where no auto-reset happened, the episode's final observation is simply the next one
            next_values = self._bootstrap(traj["values"][1:])
            traj["final_values"] = torch.where(traj.pop("auto_reset"), traj["final_values"], next_values)
        return traj

    def _send(self, trajectories: list[dict[str, Any]]) -> None:
        traj = tree_cat(trajectories, dim=1)
        envs = traj["rewards"].shape[1]
        queue = self.cfg.actor.channel.queue_name
        for r, k, start, stop in replay_pieces(self.world_size, self.actor_world_size, envs):
            if r == self.rank:
                piece = tree_map(lambda x: x[:, start:stop].numpy(), traj)
                self.channel.put(f"{queue}/{k}", {"source": (self.rank, start), "trajectory": piece})
