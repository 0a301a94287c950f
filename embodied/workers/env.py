"""Env worker: owns ``total_num_envs / world_size`` envs of each split, in
``rollout.pipeline_stage_num`` stages, and trades observations for actions with its rollout
worker through the channel, one stage at a time, so that one stage steps while another infers."""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig

from embodied.channel import Channel
from embodied.worker import Worker
from envs.episode_stats import EpisodeStats
from envs.vector_env import make_vector_env


def obs_key(cfg: DictConfig, split: str, env_rank: int, stage: int) -> str:
    return f"{cfg.env.channel.queue_name}/{split}/{env_rank}/{stage}"


def action_key(cfg: DictConfig, split: str, env_rank: int, stage: int) -> str:
    return f"{cfg.rollout.channel.queue_name}/{split}/{env_rank}/{stage}"


class EnvWorker(Worker):
    def __init__(self, cfg: DictConfig, channel: Channel):
        self.cfg, self.channel = cfg, channel
        self.stages = cfg.rollout.pipeline_stage_num
        self.envs: dict[str, list[Any]] = {}
        self.last_obs: dict[str, list[dict[str, Any]]] = {}
        self.stats = {"train": EpisodeStats(), "eval": EpisodeStats()}
        self._build("train")  # fail at launch, not at the first step, on a bad env config

    def _build(self, split: str) -> list[Any]:
        if split not in self.envs:
            env_cfg = self.cfg.env[split]
            per_worker = env_cfg.total_num_envs // self.world_size
            per_stage = per_worker // self.stages
            self.envs[split] = [
                make_vector_env(env_cfg, per_stage, seed_offset=self.rank * per_worker + stage * per_stage,
                                name=f"{split}_rank{self.rank}_stage{stage}")
                for stage in range(self.stages)
            ]
        return self.envs[split]

    def interact(self, split: str, num_chunk_steps: int) -> dict[str, float]:
        """Run ``num_chunk_steps`` chunk steps on every stage; returns episode statistics.
        Training envs with ``auto_reset`` carry on where the last call stopped; otherwise every
        call starts fresh episodes."""
        envs = self._build(split)
        continue_episodes = split == "train" and self.cfg.env.train.auto_reset and split in self.last_obs
        obs = self.last_obs[split] if continue_episodes else [None] * self.stages
        for stage, env in enumerate(envs):
            if not continue_episodes:
                obs[stage] = env.reset()  # the policy starts on this stage while the next resets
            self.channel.put(obs_key(self.cfg, split, self.rank, stage), {"obs": obs[stage]})
        stats = self.stats[split]
        env_steps = 0
        for _ in range(num_chunk_steps):
            for stage, env in enumerate(envs):
                actions = self.channel.get(action_key(self.cfg, split, self.rank, stage))
                obs[stage], rewards, terminations, truncations, infos = env.chunk_step(actions)
                stats.update(infos)
                env_steps += rewards.size
                message = {"obs": obs[stage], "rewards": rewards, "terminations": terminations,
                           "truncations": truncations}
                if "final_obs" in infos:
                    message["final_obs"] = infos["final_obs"]
                    message["done"] = infos["done"]
                self.channel.put(obs_key(self.cfg, split, self.rank, stage), message)
        self.last_obs[split] = obs
        metrics = stats.pop(prefix=f"{split}/")
        metrics[f"{split}/env_steps"] = float(env_steps)
        return metrics

    def close(self) -> None:
        for envs in self.envs.values():
            for env in envs:
                env.close()
        self.envs.clear()

    def offload(self) -> None:
        """Simulators are rebuilt on the next ``interact``; episodes in flight are dropped."""
        self.close()
        self.last_obs.clear()
