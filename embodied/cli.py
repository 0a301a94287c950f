"""``embodied-train`` and ``embodied-eval``: compose the Hydra config, validate it before anything
starts, print the plan, then run. A config mistake exits with code 2 and one message."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from omegaconf import DictConfig

from core.errors import ConfigError
from embodied import rlinf
from embodied.config import build_policy, chunk_steps, compose, to_yaml, training_steps
from embodied.placement import PlacementPlan
from embodied.validate import validate

DEFAULT_CONFIG = "maniskill_ppo_mlp"


def load(config_name: str, overrides: Sequence[str] = (), config_dir: str | None = None
         ) -> tuple[DictConfig, PlacementPlan]:
    """Compose, schema-check and validate; the one entry point for configs."""
    cfg = compose_any(config_name, overrides, config_dir)
    return cfg, validate(cfg)


def compose_any(config_name: str, overrides: Sequence[str] = (), config_dir: str | None = None) -> DictConfig:
    """Our config, or an RLinf experiment file carried over to our schema (embodied/rlinf.py)."""
    if config_dir is not None and rlinf.is_rlinf_config(config_dir, config_name):
        return rlinf.compose(config_name, overrides, config_dir)
    return compose(config_name, overrides, config_dir)


def config_yaml(config_name: str, overrides: Sequence[str] = (), config_dir: str | None = None
                ) -> tuple[str, str | None]:
    """The config as YAML of ours, and what could not be carried over (None when all was): an
    RLinf experiment's native experiment file, or our composed config."""
    if config_dir is not None and rlinf.is_rlinf_config(config_dir, config_name):
        translation = rlinf.read(config_dir, config_name, overrides)
        return translation.native_yaml(), translation.message() if translation.problems else None
    return to_yaml(compose(config_name, overrides, config_dir)), None


def summary(cfg: DictConfig, plan: PlacementPlan) -> str:
    """A few lines that say what will run, where, and with which batch arithmetic."""
    algo, actor, model = cfg.algorithm, cfg.actor, cfg.actor.model
    lines = [
        f"experiment: {cfg.runner.experiment_name} ({cfg.runner.task_type}), "
        f"logs in {cfg.runner.logger.log_path} via {list(cfg.runner.logger.logger_backends)}",
        f"model: {model.model_type}" + (f" from {model.model_path}" if model.get("model_path") else "")
        + (f", LoRA rank {model.lora_rank}" if model.get("is_lora") else ""),
        f"algorithm: {algo.adv_type} advantages, {algo.loss_type} loss (clip {algo.ratio_clip_eps}), "
        f"group_size {algo.group_size}, {algo.update_epochs} update epoch(s)",
        f"actor: lr {actor.optim.lr}, global batch {actor.global_batch_size} in micro-batches of "
        f"{actor.micro_batch_size} x {plan.world_size('actor')} rank(s)",
    ]
    if cfg.runner.task_type == "embodied":
        for split in ("train", "eval"):
            env = cfg.env[split]
            task = env.init_params.get("id", env.get("task_suite_name", ""))
            lines.append(
                f"env.{split}: {env.env_type} {task}, {env.total_num_envs} envs, "
                f"{env.max_episode_steps} steps/episode, group_size {env.group_size}"
            )
        chunks = model.num_action_chunks
        lines.append(
            f"rollout: {chunk_steps(cfg.env.train.max_episode_steps, chunks)} chunk steps of {chunks} action(s), "
            f"{cfg.rollout.pipeline_stage_num} pipeline stage(s), sampling={model.do_sample}"
        )
    else:
        lines.append(f"data: {list(cfg.data.train_data_paths)}, {cfg.data.rollout_batch_size} prompts/step")
    steps = training_steps(cfg.runner)
    lines.append(f"steps: {steps}, validate every {cfg.runner.val_check_interval}, "
                 f"save every {cfg.runner.save_interval}")
    return "\n".join(lines + [plan.describe()])


def _parse(argv: Sequence[str] | None, prog: str, export: bool = False) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog=prog, description="Compose a config from config/ with Hydra overrides and run it.")
    parser.add_argument("--config-name", "-cn", default=DEFAULT_CONFIG,
                        help=f"experiment file in config/ (default: {DEFAULT_CONFIG})")
    parser.add_argument("--config-path", "-cp", default=None,
                        help="folder holding the configs (default: the project's config/)")
    parser.add_argument("--dry-run", action="store_true",
                        help="print the resolved plan and exit without starting anything")
    if export:
        parser.add_argument("--out", required=True, help="folder to write the exported checkpoint into")
    else:
        parser.add_argument("--print-config", action="store_true",
                            help="print the config as YAML of this framework and exit (an RLinf config: "
                                 "its native experiment file)")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides such as actor.optim.lr=1e-4")
    return parser.parse_intermixed_args(argv)


def _main(argv: Sequence[str] | None, prog: str, extra: Sequence[str] = ()) -> int:
    args = _parse(argv, prog)
    try:
        if args.print_config:
            text, untranslated = config_yaml(args.config_name, [*extra, *args.overrides], args.config_path)
            print(text, end="", flush=True)
            if untranslated:
                print(f"{prog}: config error: {untranslated}", file=sys.stderr)
            return 2 if untranslated else 0
        cfg, plan = load(args.config_name, [*extra, *args.overrides], args.config_path)
    except ConfigError as err:
        print(f"{prog}: config error: {err}", file=sys.stderr)
        return 2
    print(summary(cfg, plan), flush=True)
    if args.dry_run:
        print(f"{prog}: config OK (dry run, nothing started)")
        return 0
    from embodied.checkpoint import CheckpointWriteError
    from embodied.runner import print_result, run
    from embodied.worker import WorkerError

    try:
        print_result(run(cfg, plan))
    except (WorkerError, CheckpointWriteError) as err:
        print(f"{prog}: {' '.join(str(err).split())}", file=sys.stderr)  # one line, group and rank first
        return 1
    return 0


def _export(argv: Sequence[str] | None, prog: str) -> int:
    args = _parse(argv, prog, export=True)
    try:
        cfg, _ = load(args.config_name, ["runner.only_eval=true", *args.overrides], args.config_path)
    except ConfigError as err:
        print(f"{prog}: config error: {err}", file=sys.stderr)
        return 2
    import json
    from pathlib import Path

    from embodied import checkpoint

    policy = build_policy(cfg.actor.model)
    source = cfg.actor.model.model_path
    if cfg.runner.ckpt_path is not None:
        source = checkpoint.resolve(cfg.runner.ckpt_path, "runner.ckpt_path")
        # read_checkpoint checks names and shapes; a LoRA checkpoint holds only what trains
        policy.load_state_dict(policy.read_checkpoint(Path(source) / "actor"), strict=False)
    try:
        policy.export_pretrained(args.out)
    except ConfigError as err:
        print(f"{prog}: config error: {err}", file=sys.stderr)
        return 2
    print(json.dumps({"exported": str(args.out), "from": str(source)}), flush=True)
    return 0


def export(argv: Sequence[str] | None = None) -> None:
    """A training run's checkpoint (``runner.ckpt_path``) on top of ``actor.model.model_path``,
    written as one pretrained checkpoint folder (LoRA merged) to ``--out``."""
    sys.exit(_export(argv, "embodied-export"))


def train(argv: Sequence[str] | None = None) -> None:
    sys.exit(_main(argv, "embodied-train"))


def evaluate(argv: Sequence[str] | None = None) -> None:
    """Evaluation only: greedy episodes of ``runner.ckpt_path`` on the eval envs."""
    sys.exit(_main(argv, "embodied-eval", extra=[
        "runner.only_eval=true", "env.eval.video_cfg.video_base_dir=videos/${runner.experiment_name}"]))
