"""``embodied-train``, ``embodied-eval`` and ``embodied-export``: compose the Hydra config (for an
evaluated or exported checkpoint, with the model settings it carries: embodied/config/preflight.py),
validate it before anything starts, print the plan, then run. A config mistake exits with code 2
and one message."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from omegaconf import DictConfig

from core.errors import ConfigError
from embodied.config import preflight, rlinf
from embodied.config import build_policy, compose, to_yaml
from embodied.placement import PlacementPlan
from embodied.config.validate import chunk_steps, rollout_window, training_steps, validate

DEFAULT_CONFIG = "maniskill_ppo_mlp"


def load(config_name: str, overrides: Sequence[str] = (), config_dir: str | None = None
         ) -> tuple[DictConfig, PlacementPlan]:
    """Compose, schema-check and validate; the one entry point for configs."""
    cfg, _ = prepare(config_name, overrides, config_dir)
    return cfg, validate(cfg)


def prepare(config_name: str, overrides: Sequence[str] = (), config_dir: str | None = None
            ) -> tuple[DictConfig, list[str]]:
    """The composed config with the model settings of the checkpoint an evaluation or export
    reads, and notes of what they changed."""
    cfg = compose_any(config_name, overrides, config_dir)
    if not (cfg.runner.only_eval and cfg.runner.ckpt_path is not None):
        return cfg, []
    try:  # what the config says without the command line, to tell what the command line set
        without = compose_any(config_name, [], config_dir)
    except ConfigError:
        without = None
    return preflight.with_checkpoint_model(cfg, preflight.given_model_keys(cfg, without, overrides))


def compose_any(config_name: str, overrides: Sequence[str] = (), config_dir: str | None = None) -> DictConfig:
    """Our config, or an RLinf experiment file carried over to our schema (embodied/config/rlinf.py)."""
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
        f"{actor.micro_batch_size} x {plan.ranks['actor']} rank(s)",
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
            f"rollout: {chunk_steps(rollout_window(cfg.env.train), chunks)} chunk steps of {chunks} action(s), "
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
    parser.add_argument("--config-name", "-cn", default=None,
                        help=f"experiment file in config/ (default: {DEFAULT_CONFIG}; for embodied-eval and "
                             "embodied-export of a runner.ckpt_path, the config stored with that checkpoint)")
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


def _config(args: argparse.Namespace, from_checkpoint: bool) -> tuple[str, str | None, list[str]]:
    """The config named on the command line; without one, that of the checkpoint evaluated or
    exported (``from_checkpoint``) when it carries one, else DEFAULT_CONFIG. Third: overrides that
    go first (a stored config's run folders derive again from this command's run name)."""
    if args.config_name is not None:
        return args.config_name, args.config_path, []
    stored = preflight.stored_config(args.overrides) if from_checkpoint else None
    return (*stored, preflight.run_path_defaults(stored[1])) if stored else (DEFAULT_CONFIG, args.config_path, [])


def _main(argv: Sequence[str] | None, prog: str, extra: Sequence[str] = (), evaluation: bool = False) -> int:
    args = _parse(argv, prog)
    try:
        name, folder, first = _config(args, from_checkpoint=evaluation)
        if args.print_config:
            text, untranslated = config_yaml(name, [*first, *extra, *args.overrides], folder)
            print(text, end="", flush=True)
            if untranslated:
                print(f"{prog}: config error: {untranslated}", file=sys.stderr)
            return 2 if untranslated else 0
        cfg, notes = prepare(name, [*first, *extra, *args.overrides], folder)
        plan = validate(cfg)
    except ConfigError as err:
        print(f"{prog}: config error: {err}", file=sys.stderr)
        return 2
    print("\n".join([*notes, summary(cfg, plan)]), flush=True)
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
    except ConfigError as err:  # found only once running (runner.save_interval_minutes)
        print(f"{prog}: config error: {err}", file=sys.stderr)
        return 2
    return 0


def _export(argv: Sequence[str] | None, prog: str) -> int:
    args = _parse(argv, prog, export=True)
    try:
        name, folder, first = _config(args, from_checkpoint=True)
        cfg, notes = prepare(name, [*first, "runner.only_eval=true", *args.overrides], folder)
        validate(cfg)
    except ConfigError as err:
        print(f"{prog}: config error: {err}", file=sys.stderr)
        return 2
    if notes:
        print("\n".join(notes), file=sys.stderr, flush=True)
    import json
    from pathlib import Path

    from embodied import checkpoint, demonstrations
    from embodied.algorithms import POLICY_LOSSES

    if POLICY_LOSSES.declared(cfg.algorithm.loss_type)["imitation"]:  # an SFT run's model, as it trained
        cfg = demonstrations.prepare(cfg)
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
    sys.exit(_main(argv, "embodied-eval", evaluation=True, extra=["runner.only_eval=true"]))
