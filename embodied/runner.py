"""The driver loop. One training step reads like the algorithm:

    sync weights (actor -> rollout) -> roll out (env <-> rollout, pipelined) -> advantages and
    updates (actor) -> log -> maybe checkpoint -> maybe validate

or, for SFT (``algorithm.loss_type: sft``, ``ImitationRunner``: chosen once, ``runner_for``), the
trainer ranks draw their minibatches from the demonstrations they hold and update -> log -> maybe
checkpoint -> maybe validate (greedy episodes in the simulator, as for RL).

Where each piece runs is the workers' business; this file only says what happens in what order.
A worker process that dies is not the end of a run (``run``): every group is started again and
the run resumes from its last checkpoint, up to ``runner.max_restarts`` times; checkpoints come
every ``runner.save_interval`` steps and every ``runner.save_interval_minutes``, whichever is first.
Collocated roles take turns on the devices: each phase starts by naming the roles it runs
(``_turn``), and a role with ``enable_offload`` frees its memory while it idles (env workers
close their simulators and rebuild them for the next rollout, continuing the episode numbering).
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from collections import deque
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict, read_write
from tqdm import tqdm

from core.errors import ConfigError
from core.shm import sweep_dead_segments
from embodied import checkpoint, crash_report, demonstrations
from embodied.algorithms import POLICY_LOSSES
from embodied.channel import Channel
from embodied.channel.keys import queue_bounds
from embodied.cluster import Cluster
from embodied.config.validate import chunk_steps, offloaded_parts, replicas, rollout_window, training_steps
from embodied.loggers import MetricLogger
from embodied.placement import PlacementPlan
from embodied.report import write_eval_report
from embodied.worker import GroupCall, WorkerError, WorkerGroup
from embodied.workers.actor import ActorWorker
from embodied.workers.imitation import ImitationWorker
from embodied.workers.trainer import TrainerWorker
from embodied.workers.env import EnvWorker
from embodied.workers.rollout import RolloutWorker, replay_pieces

# the config keys read here (tests/test_schema.py: every schema key is read or refused)
CONFIG_KEYS = ("runner.val_check_interval", "runner.val_before_train", "runner.save_interval_minutes",
               "runner.max_restarts", "runner.save_interval", "runner.resume_dir", "runner.max_ckpts_to_keep", "runner.only_eval",
               "runner.ckpt_path", "algorithm.rollout_epoch", "algorithm.staleness_threshold", "data.val_pass_k",
               "env.group_name", "env.channel.name", "env.enable_offload", "rollout.group_name",
               "rollout.enable_offload", "actor.group_name", "actor.enable_offload")


class Runner:
    trainer: type[TrainerWorker] = ActorWorker  # the actor group's worker
    env_split = "train"  # the split the env workers build at launch (an evaluation's: eval)

    def __init__(self, cfg: DictConfig, plan: PlacementPlan, cluster: Cluster | None = None):
        """Start the worker groups on ``cluster`` (without one, on a cluster of its own that
        ``close`` shuts down)."""
        self.cfg, self.plan = cfg, plan
        self.start = time.monotonic()
        self.owns_cluster = cluster is None
        self.cluster = Cluster.from_config(cfg.cluster) if cluster is None else cluster
        self.channel = Channel.create(cfg.env.channel.name, maxsize=queue_bounds(cfg))
        self.env = self.rollout = self.actor = self.logger = None
        self.eval_videos: list[dict[str, Any]] = []  # of the last evaluation (embodied/report.py)
        try:
            self._launch(cfg, plan)
        except BaseException:
            self.close()
            raise
        chunks = cfg.actor.model.num_action_chunks
        self.train_chunk_steps = chunk_steps(rollout_window(cfg.env.train), chunks)
        self.eval_chunk_steps = chunk_steps(cfg.env.eval.max_episode_steps, chunks)
        if self.actor is not None:  # an evaluation reads nothing of env.train (validate.py checks none of it)
            rollout_ranks, groups = plan.ranks["rollout"], plan.ranks["actor"] // replicas(cfg)
            pieces = replay_pieces(rollout_ranks, groups, cfg.env.train.total_num_envs // rollout_ranks)
            self.pieces_per_actor = max(sum(1 for p in pieces if p[1] == k) for k in range(groups))
        self.ckpt_root = Path(cfg.runner.logger.log_path) / "checkpoints"
        self.logger = MetricLogger(cfg.runner.logger, OmegaConf.to_container(cfg))
        self.shared_reset_states = shared_reset_states(cfg)  # for the eval reports
        # a serving engine's weights are checked after every sync, on responses of the first rollout
        self.check_sync = cfg.rollout.backend != "huggingface"
        self.probe: dict[str, Any] | None = None
        self.sync_check: GroupCall | None = None  # the check of a sync in flight
        self.in_flight: deque = deque()  # rollouts started ahead of their step (staleness_threshold)
        self.step, self.env_steps = 0, 0
        self.done_step = 0  # the last step whose update finished (a crash loses those after its checkpoint)
        self.version = 0  # updates the actor's weights have had
        self.last_step = training_steps(cfg.runner)
        self.last_save = time.monotonic()

    def _launch(self, cfg: DictConfig, plan: PlacementPlan) -> None:
        """The env, rollout and (to train) actor groups, built at the same time; each rank writes
        a crash report into the run's log folder if it dies of a signal."""
        crashes = str(Path(cfg.runner.logger.log_path) / crash_report.FOLDER)
        env_ranks, actor_ranks = plan.ranks["env"], plan.ranks["actor"]
        self.env = WorkerGroup.launch(EnvWorker, self.cluster, plan, "env", name=cfg.env.group_name,
                                      args=(cfg, self.channel, "eval" if cfg.runner.only_eval else self.env_split),
                                      crash_dir=crashes, wait=False)
        self.rollout = WorkerGroup.launch(RolloutWorker, self.cluster, plan, "rollout",
                                          name=cfg.rollout.group_name, crash_dir=crashes, wait=False,
                                          args=(cfg, self.channel, env_ranks, actor_ranks))
        if not cfg.runner.only_eval:
            self.actor = WorkerGroup.launch(self.trainer, self.cluster, plan, "actor", name=cfg.actor.group_name,
                                            args=(cfg, self.channel), crash_dir=crashes, wait=False)
        for group in (self.env, self.rollout, self.actor):
            if group is not None:
                print(group.ready().describe(), flush=True)

    # ---------------------------------------------------------------- training
    def fit(self) -> dict[str, Any]:
        cfg = self.cfg.runner
        self._maybe_resume()
        last = self.last_step
        summary: dict[str, Any] = {}
        if cfg.val_before_train and self.step == 0:
            self.sync_weights()
            metrics = self.evaluate()
            self.logger.log(metrics, 0)
            self._log_samples(0)
            _print_eval("eval before training", metrics, self.shared_reset_states)
            summary["eval_success_before"] = metrics["eval/success_once"]
        with tqdm(total=last, initial=self.step, desc="train", unit="step", dynamic_ncols=True) as bar:
            while self.step < last:
                self.step += 1
                metrics = self.train_step()
                if cfg.val_check_interval > 0 and (self.step % cfg.val_check_interval == 0 or self.step == last):
                    self.sync_weights()  # evaluate this step's update, as its checkpoint holds it
                    metrics.update(self.evaluate())
                    self._log_samples(self.step)
                    _print_eval(f"eval at step {self.step}", metrics, self.shared_reset_states)
                    summary["eval_success"] = metrics["eval/success_once"]
                    summary |= _pass_at_k(metrics, self.cfg.data.val_pass_k)
                self.logger.log(metrics, self.step)
                self.done_step = self.step
                if self._save_due():
                    self.save()
                bar.update(1)
                bar.set_postfix(self._progress(metrics, summary))
        if checkpoint.latest(self.ckpt_root) != self.ckpt_root / f"global_step_{self.step}":
            self.save()  # the final weights are always kept
        return summary | self._totals()

    def _save_due(self) -> bool:
        """Every ``save_interval`` steps, and once ``save_interval_minutes`` have passed since the
        last checkpoint (or the start)."""
        cfg = self.cfg.runner
        if cfg.save_interval > 0 and self.step % cfg.save_interval == 0:
            return True
        minutes = cfg.save_interval_minutes
        return minutes is not None and time.monotonic() - self.last_save >= minutes * 60

    def _progress(self, metrics: dict[str, float], summary: dict[str, Any]) -> dict[str, str | int]:
        """The progress bar's figures after a step."""
        return {"env_steps": self.env_steps, "steps_per_s": f"{metrics['time/env_steps_per_s']:.0f}",
                "success": f"{metrics.get('train/success_once', float('nan')):.2f}"}

    def train_step(self) -> dict[str, float]:
        """Roll out, then update; with ``algorithm.staleness_threshold`` k > 0 the next k rollouts
        are already running (with the weights of k updates ago at most) while the actor updates
        on this one, and the new weights reach the rollout workers after the rollout in flight."""
        tic_step = time.monotonic()
        metrics: dict[str, float] = {}
        if not self.in_flight:  # synchronous (or the first step): this step's rollout starts now
            tic = time.monotonic()
            metrics |= self.sync_weights()
            metrics["time/sync"] = time.monotonic() - tic
            self._turn(self.rollout, self.env)
            self.in_flight.append(self._launch_rollout(self.step))
        # a resident actor takes trajectories as they arrive; one that offloads waits for its turn
        update = None if self._offloads(self.actor) else self._update()
        ahead = self.cfg.algorithm.staleness_threshold
        while len(self.in_flight) <= ahead and self.step + len(self.in_flight) <= self.last_step:
            self.in_flight.append(self._launch_rollout(self.step + len(self.in_flight)))
        env_calls, rollout_calls = self.in_flight.popleft()
        env_metrics = [_merge_ranks(call.wait()) for call in env_calls]
        metrics.update(_mean_dicts(env_metrics))
        metrics.update(_mean_dicts([r for call in rollout_calls for r in call.wait()]))
        # the env workers' own time for the rollout (it may have started during the last step)
        metrics["time/rollout"] = sum(m["time/train_env_busy_s"] + m["time/train_env_wait_s"] for m in env_metrics)
        steps = sum(m["train/env_steps"] for m in env_metrics)
        self.env_steps += int(steps)
        metrics["time/env_steps_per_s"] = steps / metrics["time/rollout"]
        metrics |= self._sync_gap()  # the check of the weights this rollout was generated with
        if self.check_sync and self.probe is None:
            self.probe = self.rollout.execute("probe_batch").wait()[0]

        tic = time.monotonic()
        self._turn(self.actor)
        metrics.update((update or self._update()).wait()[0])
        self.version = self.step
        metrics["time/update"] = time.monotonic() - tic
        if ahead:  # the new weights, for the rollouts after the ones in flight
            tic = time.monotonic()
            metrics |= self.sync_weights(wait=False)
            metrics["time/sync"] = time.monotonic() - tic
        metrics["time/step"] = time.monotonic() - tic_step
        metrics["time/env_steps_per_s_overall"] = steps / metrics["time/step"]
        # how long rollout and update computed at once (what running them one after the other costs more)
        metrics["time/overlap"] = max(metrics["time/rollout"] + metrics["time/actor_busy"] - metrics["time/step"], 0.0)
        metrics["train/total_env_steps"] = float(self.env_steps)
        return metrics

    def _launch_rollout(self, step: int) -> tuple[list[GroupCall], list[GroupCall]]:
        """Start the env and rollout workers on training step ``step``'s rollouts (they run after
        whatever those workers are doing); returns the calls to wait on."""
        env_calls, rollout_calls = [], []
        for epoch in range(self.cfg.algorithm.rollout_epoch):
            seed = step * self.cfg.algorithm.rollout_epoch + epoch
            env_calls.append(self.env.execute("interact", "train", self.train_chunk_steps))
            rollout_calls.append(self.rollout.execute("generate", "train", self.train_chunk_steps, seed))
        return env_calls, rollout_calls

    def _update(self) -> GroupCall:
        return self.actor.execute("update", self.step, self.pieces_per_actor * self.cfg.algorithm.rollout_epoch)

    def sync_weights(self, wait: bool = True) -> dict[str, float]:
        """The actor's weights (after ``self.version`` updates) into the rollout workers; with a
        serving engine, then checked: the engine's log-probs of the probe must be the actor's
        (``rollout/sync_logprob_gap``). Without ``wait`` the rollout workers take them after the
        rollouts they have in flight."""
        self._turn(self.actor, self.rollout)
        weights = self.actor.execute_in_store("get_weights").wait()[0][0]  # rank 0's, by reference
        call = self.rollout.execute("set_weights", weights, self.version)
        if self.check_sync and self.probe:
            logprobs = self.actor.execute("probe_logprobs", self.probe).wait()[0]
            self.sync_check = self.rollout.execute("check_sync", self.probe, logprobs, self.step)
        if wait:
            call.wait()
            return self._sync_gap()
        return {}

    def _sync_gap(self) -> dict[str, float]:
        """The result of the last sync's check (``rollout/sync_logprob_gap``), once it is known."""
        if self.sync_check is None:
            return {}
        gap, self.sync_check = max(self.sync_check.wait()), None
        return {"rollout/sync_logprob_gap": gap}

    def _turn(self, *running: WorkerGroup) -> None:
        """The next phase runs these groups: an idle one with ``<role>.enable_offload`` frees its
        memory first, then a running one gets its memory back (both no-ops when already so)."""
        groups = [g for g in (self.actor, self.rollout, self.env) if self._offloads(g)]
        for call in [g.execute("offload") for g in groups if g not in running]:
            call.wait()
        for call in [g.execute("reload") for g in groups if g in running]:
            call.wait()

    def _offloads(self, group: WorkerGroup | None) -> bool:
        return group is not None and bool(offloaded_parts(self.cfg, group.component))

    # -------------------------------------------------------------- evaluation
    def evaluate(self) -> dict[str, float]:
        """Greedy episodes on the eval envs; success, return and length per episode. With
        ``env.eval.each_reset_state_once`` as many rounds of episodes as it takes to start every
        reset state once (e.g. every LIBERO task x init state), whatever the number of envs.
        ``data.val_pass_k`` = k > 1 (text envs) also k sampled responses per eval prompt on the
        ``eval_pass_k`` envs, whose ``eval_pass_k/success_once`` is pass@k."""
        tic = time.monotonic()
        self._turn(self.rollout, self.env)
        metrics: dict[str, float] = {}
        for split in ("eval", "eval_pass_k") if self.cfg.data.val_pass_k > 1 else ("eval",):
            per_round, so_far = [], {}
            rounds = max(self.env.execute("rounds", split).wait())
            with tqdm(total=rounds, desc=split, unit="round", dynamic_ncols=True, leave=False) as bar:
                for r in range(rounds):
                    env_call = self.env.execute("interact", split, self.eval_chunk_steps, r == 0)
                    self.rollout.execute("generate", split, self.eval_chunk_steps, 0).wait()
                    per_round += env_call.wait()
                    so_far = _merge_ranks(per_round)
                    bar.update(1)
                    bar.set_postfix(episodes=f"{so_far.get(f'{split}/episodes', 0):.0f}",
                                    success=f"{so_far.get(f'{split}/success_once', float('nan')):.2f}",
                                    env_steps_per_s=f"{so_far[f'{split}/env_steps'] / (time.monotonic() - tic):.0f}")
            metrics.update(so_far)
        self.eval_videos = [v for rank in self.env.execute("pop_videos", "eval").wait() for v in rank]
        metrics["time/eval"] = time.monotonic() - tic
        return metrics

    def evaluate_checkpoint(self) -> dict[str, Any]:
        """``embodied-eval``: evaluate a training run's checkpoint (``runner.ckpt_path``, loaded
        into the rollout workers), or without one the pretrained ``actor.model.model_path`` the
        rollout workers were built from."""
        if self.cfg.runner.ckpt_path is None:
            source, step = self.cfg.actor.model.get("model_path"), 0
        else:
            source = checkpoint.resolve(self.cfg.runner.ckpt_path, "runner.ckpt_path")
            step = checkpoint.read_trainer_state(source)["step"]
            self.rollout.execute("load_checkpoint", str(Path(source) / "actor"), step).wait()
        metrics = self.evaluate()
        self.logger.log(metrics, step)
        self._log_samples(step)
        env = self.cfg.env.eval
        shared = self.shared_reset_states
        _print_eval(f"eval of {source} ({env.init_params.get('id', env.task_suite_name or '')})",
                    metrics, shared)
        report = write_eval_report(self.cfg.runner.logger.log_path, step=step, source=source,
                                   success=metrics["eval/success_once"], episodes=int(metrics["eval/episodes"]),
                                   tasks=_per_task(metrics), videos=self.eval_videos,
                                   config_yaml=OmegaConf.to_yaml(self.cfg))
        tqdm.write(f"eval report: {report}")
        return {"eval_success": metrics["eval/success_once"], "episodes": metrics["eval/episodes"],
                "tasks": _per_task(metrics), "reset_states_shared_with_train": shared, "report": str(report)} \
            | _pass_at_k(metrics, self.cfg.data.val_pass_k) | self._totals()

    def _log_samples(self, step: int) -> None:
        """Example responses of the last evaluation, from envs that keep them (text envs)."""
        per_rank = self.env.execute("pop_samples", "eval").wait()
        self.logger.log_samples("eval", [s for rank in per_rank for s in rank], step)

    # ------------------------------------------------------------ checkpoints
    def save(self) -> Path:
        """Actor weights and optimizer, step, env steps, every env's next episode number, and
        the run's resolved config (what ``embodied-eval`` and ``embodied-export`` read back)."""
        tic = time.monotonic()
        self._turn(self.actor)  # an actor offloaded for an eval gathers its state on its devices
        per_rank = self.env.execute("episode_state").wait()
        episodes = {split: [n for rank in per_rank for n in rank[split]] for split in per_rank[0]}
        folder = self.ckpt_root / f"global_step_{self.step}.partial"
        try:
            folder = checkpoint.partial_dir(self.ckpt_root, self.step)
            self.actor.execute("save", str(folder)).wait()
            final = checkpoint.commit(self.ckpt_root, self.step,
                                      {"env_steps": self.env_steps, "next_episodes": episodes},
                                      keep=self.cfg.runner.max_ckpts_to_keep, config=OmegaConf.to_yaml(self.cfg))
        except (OSError, WorkerError) as err:  # a full disk, a lost mount: stop with the last one intact
            shutil.rmtree(folder, ignore_errors=True)
            if isinstance(err, WorkerError) and err.died:  # a lost worker is the news, not the folder
                raise
            why = str(err) if isinstance(err, WorkerError) else f"{type(err).__name__}: {err}"
            free = shutil.disk_usage(self.ckpt_root).free / 1e6 if self.ckpt_root.is_dir() else 0.0
            raise checkpoint.CheckpointWriteError(
                f"checkpoint of step {self.step} not written ({why}); {free:.1f} MB free in "
                f"{self.ckpt_root}; the latest checkpoint is still {checkpoint.latest(self.ckpt_root)}"
            ) from err
        self.last_save = time.monotonic()
        took, minutes = self.last_save - tic, self.cfg.runner.save_interval_minutes
        if minutes is not None and took >= minutes * 60:  # it would checkpoint after every step
            raise ConfigError(
                f"runner.save_interval_minutes = {minutes}: one checkpoint takes {took:.1f} s here, longer "
                f"than the cadence; set it above {took / 60:.2f} (or null to checkpoint by runner.save_interval "
                f"alone). {final} is complete: add runner.resume_dir=auto to go on from it")
        return final

    def _maybe_resume(self) -> None:
        """Continue from a checkpoint as the run that wrote it would have gone on: rollouts and
        updates are seeded by the step, and the envs start the episodes (reset states) that run
        would have started next. Exact when the checkpoint fell on an episode boundary (every
        episode ends within its training step's rollout, e.g. ``auto_reset: false``, or
        ``ignore_terminations: true`` with one ``max_episode_steps`` episode per rollout);
        otherwise the training episodes in flight at the checkpoint restart from fresh reset states.
        Envs of a split whose ``total_num_envs`` differs from the checkpoint's start numbering anew.
        With nothing to continue, a run starts from the weights of ``runner.ckpt_path`` when set."""
        resume = self.cfg.runner.resume_dir
        if resume is None:
            return self._start_from_checkpoint()
        if resume == "auto":
            folder = checkpoint.latest(self.ckpt_root)
            if folder is None:
                return self._start_from_checkpoint()
        else:
            folder = checkpoint.resolve(resume, "runner.resume_dir")
        self.actor.execute("load", str(folder)).wait()
        state = checkpoint.read_trainer_state(folder)
        self.step, self.env_steps = state["step"], state["env_steps"]
        self.version = self.step
        episodes = {split: numbers for split, numbers in state.get("next_episodes", {}).items()
                    if len(numbers) == self.cfg.env[split].total_num_envs}
        self.env.execute("load_episode_state", episodes).wait()
        print(f"resumed from {folder} at step {self.step}", flush=True)

    def _start_from_checkpoint(self) -> None:
        """A fresh run from ``runner.ckpt_path`` (e.g. an SFT run's): its weights, at step 0
        with a fresh optimizer."""
        if self.cfg.runner.ckpt_path is None:
            return
        folder = checkpoint.resolve(self.cfg.runner.ckpt_path, "runner.ckpt_path")
        self.actor.execute("load", str(folder), False).wait()
        print(f"starting from the weights of {folder}", flush=True)

    def _totals(self) -> dict[str, Any]:
        return {"env_steps": self.env_steps, "wall_s": round(time.monotonic() - self.start, 1)}

    def close(self) -> None:
        if self.logger is not None:
            self.logger.close()
        for group in (self.actor, self.rollout, self.env):
            if group is not None:
                group.shutdown()
        self.channel.close()
        if self.owns_cluster:
            self.cluster.shutdown()
        sweep_dead_segments()  # shared memory of killed workers (their processes are gone now)


def _merge_ranks(per_rank: list[dict[str, float]]) -> dict[str, float]:
    """Env workers' ``<split>/<figure>[/<task>]`` metrics: counts and env steps summed, times
    (``*_s``) averaged, episode means weighted by each rank's ``<split>/episodes[/<task>]``."""
    out: dict[str, float] = {}
    for key in {k for m in per_rank for k in m}:
        split, figure, *task = key.split("/")
        if figure in ("episodes", "env_steps", "non_finite"):
            out[key] = sum(m.get(key, 0.0) for m in per_rank)
            continue
        if figure.endswith("_s"):
            out[key] = sum(m[key] for m in per_rank if key in m) / sum(1 for m in per_rank if key in m)
            continue
        count = "/".join([split, "episodes", *task])
        weights = [m.get(count, 0.0) if key in m else 0.0 for m in per_rank]
        if sum(weights):
            out[key] = sum(m.get(key, 0.0) * w for m, w in zip(per_rank, weights)) / sum(weights)
    return out


def _pass_at_k(metrics: dict[str, float], k: int) -> dict[str, Any]:
    """``{"pass_at_k": {"k", "success" (pass@k), "sampled_success" (mean of the k), "tasks"}}``
    from the ``eval_pass_k`` split's metrics; empty when it did not run (k = 1)."""
    if "eval_pass_k/success_once" not in metrics:
        return {}
    return {"pass_at_k": {"k": k, "success": metrics["eval_pass_k/success_once"],
                          "sampled_success": metrics["eval_pass_k/success"],
                          "tasks": _per_task(metrics, "eval_pass_k")}}


def _per_task(metrics: dict[str, float], split: str = "eval") -> dict[str, dict[str, float]]:
    """``{task: {"success": success_once, "episodes": count}}`` from the per-task eval metrics."""
    prefix = f"{split}/episodes/"
    tasks = sorted(k[len(prefix):] for k in metrics if k.startswith(prefix))
    return {t: {"success": metrics[f"{split}/success_once/{t}"], "episodes": int(metrics[prefix + t])}
            for t in tasks}


def shared_reset_states(cfg: DictConfig) -> int | None:
    """How many of the eval envs' reset states (e.g. LIBERO task x init state) the training envs
    also start from: 0 means disjoint; None when a split's states are unbounded seeds drawn at
    random, which cannot be listed."""
    from core.errors import ConfigError
    from envs import describe

    try:
        train = describe(cfg.env.train).reset_state_names
    except ConfigError:  # an evaluation's env.train, which nothing checked or runs
        return None
    evals = describe(cfg.env.eval).reset_state_names
    return None if train is None or evals is None else len(set(train) & set(evals))


def _print_eval(title: str, metrics: dict[str, float], shared: int | None = None) -> None:
    """The overall success, then one line per task (through tqdm, so a progress bar stays
    intact); the same for pass@k when it ran; and when known whether the eval's reset states
    were also trained on."""
    lines = []
    for split, name in (("eval", "success"), ("eval_pass_k", "pass@k")):
        if f"{split}/success_once" in metrics:
            episodes = int(metrics[f"{split}/episodes"])
            lines.append(f"{title if split == 'eval' else '  sampled'}: {name} {metrics[f'{split}/success_once']:.3f} "
                         f"over {episodes} episodes")
            lines += [f"  {task}: {name} {t['success']:.3f} over {t['episodes']} episodes"
                      for task, t in _per_task(metrics, split).items()]
    if shared is not None:
        lines.append("  train and eval reset states are disjoint" if shared == 0 else
                     f"  {shared} eval reset states are also training reset states (overlap)")
    tqdm.write("\n".join(lines))


def _mean_dicts(dicts: list[dict[str, float]]) -> dict[str, float]:
    keys = {k for d in dicts for k in d}
    return {k: sum(d[k] for d in dicts if k in d) / sum(1 for d in dicts if k in d) for k in keys}


class ImitationRunner(Runner):
    """SFT (``algorithm.loss_type: sft``): each step the trainer ranks draw their share of the
    global batch from the demonstrations they hold and take one optimizer step; no rollout runs
    between validations. Every worker builds the model as prepared for the demonstrations
    (``demonstrations.prepare``: e.g. OpenVLA-OFT's action statistics)."""

    trainer = ImitationWorker
    env_split = "eval"  # no training env is stepped

    def __init__(self, cfg: DictConfig, plan: PlacementPlan, cluster: Cluster | None = None):
        super().__init__(demonstrations.prepare(cfg), plan, cluster)

    def train_step(self) -> dict[str, float]:
        tic = time.monotonic()
        self._turn(self.actor)
        metrics = self.actor.execute("imitate", self.step).wait()[0]
        self.version = self.step
        metrics["time/update"] = metrics["time/step"] = time.monotonic() - tic
        return metrics

    def _progress(self, metrics: dict[str, float], summary: dict[str, Any]) -> dict[str, str | int]:
        return {"loss": f"{metrics['actor/imitation_loss']:.3f}",
                "success": f"{summary.get('eval_success', float('nan')):.2f}"}


def runner_for(cfg: DictConfig) -> type[Runner]:
    """The trainer, chosen once: imitation for an imitation loss, RL otherwise."""
    return ImitationRunner if POLICY_LOSSES.declared(cfg.algorithm.loss_type)["imitation"] else Runner


def run(cfg: DictConfig, plan: PlacementPlan) -> dict[str, Any]:
    """Train (or with ``runner.only_eval`` evaluate) and return the figures of the final JSON line.
    A worker that dies in training (``WorkerError.died``; one that raised is a bug, not a crash)
    brings every group down and up again on the same Ray cluster, resuming from the run's last
    checkpoint, up to ``runner.max_restarts`` times, unless it died during the same step as
    before the last restart (that crash repeats: a restart would only repeat it)."""
    cluster = Cluster.from_config(cfg.cluster)
    restarts: list[dict[str, Any]] = []
    try:
        while True:
            runner = runner_for(cfg)(cfg, plan, cluster)
            try:
                if cfg.runner.only_eval:
                    return runner.evaluate_checkpoint()
                return runner.fit() | ({"restarts": len(restarts)} if restarts else {})
            except WorkerError as err:
                if not err.died or cfg.runner.only_eval:
                    raise
                cfg = _restart(cfg, runner, err, restarts)
            finally:
                runner.close()
    finally:
        cluster.shutdown()


def _restart(cfg: DictConfig, runner: Runner, err: WorkerError, restarts: list[dict[str, Any]]) -> DictConfig:
    """Say what died and what is lost; the config that resumes from the last checkpoint, or the
    error again when no restart is left or the same step died twice."""
    signal = err.signal or "no crash report: SIGKILL (kill -9, the OOM killer) or an exit"
    report = f"; backtraces in {err.report}" if err.report else ""
    what = f"{' '.join(str(err).split())} [{signal}{report}]"  # one line: Ray's own messages span several
    if len(restarts) >= cfg.runner.max_restarts:
        left = f"; no restart left (runner.max_restarts = {cfg.runner.max_restarts})" if restarts else ""
        err.args = (what + left,)
        raise err
    if restarts and restarts[-1]["step"] == runner.step:
        err.args = (f"{what}; step {runner.step} died again after a restart, so the crash repeats: "
                    f"stopping after {len(restarts)} restart(s)",)
        raise err
    last = checkpoint.latest(runner.ckpt_root)
    saved = checkpoint.read_trainer_state(last)["step"] if last else 0
    restarts.append({"step": runner.step, "group": err.group, "rank": err.rank, "signal": err.signal,
                     "report": err.report, "lost_steps": max(runner.done_step - saved, 0),
                     "resumed_from": str(last) if last else None, "error": str(err)})
    with open(Path(cfg.runner.logger.log_path) / "restarts.jsonl", "a") as log:  # beside the metrics
        log.write(json.dumps(restarts[-1]) + "\n")
    tqdm.write(f"restart {len(restarts)} of {cfg.runner.max_restarts}: {what} during step {runner.step}; "
               f"{restarts[-1]['lost_steps']} finished step(s) lost, resuming from "
               f"{last or 'the start'}", file=sys.stderr)
    if last is None:  # nothing saved yet: the run starts as it first did
        return cfg
    cfg = cfg.copy()
    with read_write(cfg), open_dict(cfg):
        cfg.runner.resume_dir = str(last)
    OmegaConf.set_readonly(cfg, True)
    return cfg


def print_result(result: dict[str, Any]) -> None:
    print(json.dumps(result), flush=True)
