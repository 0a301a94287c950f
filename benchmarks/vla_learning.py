"""A VLA that learns here: supervised fine-tuning of a tiny OpenVLA-OFT on recorded demos, then RL
lifts its held-out success, on ManiSkill PushCube-v1 from 64 px images, in one command.

    python benchmarks/vla_learning.py [--variants ppo,grpo,ppo_l1] [--demos 100] [--sft-steps 1000]
        [--rl-steps 160] [--out results/vla_learning]

1. **Demos**: the scripted pusher (``envs/experts.py``, reading object poses) drives PushCube in
   ``rgb+state``; its successful episodes from reset states 100000 on are written in ManiSkill's
   trajectory format with the 64 px main camera and the instruction (``embodied.record.record``).
2. **SFT**: ``embodied-train --config-name maniskill_sft_openvla_oft`` on them, a tiny OpenVLA-OFT
   (``policies/openvla_oft/tiny.py``) trained whole: cross-entropy on the action tokens (discrete
   head) or L1 on the actions (``ppo_l1``'s L1-regression head).
3. **RL**: ``embodied-train --config-name maniskill_ppo_openvla_oft_push_cube`` from the SFT
   checkpoint's ``actor/model`` folder: PPO with a fresh value head, or GRPO (groups of 4 from the
   same reset state, no value head); greedy evaluation every 10 steps.
4. **Held-out evaluation**: ``embodied-eval`` of the SFT and the last RL checkpoint on the same
   ``--eval-episodes`` greedy episodes, with videos. Their reset states are seeds drawn from
   [0, 2^31) (``envs.protocol.ResetStates``), so none is one of the demos' (checked).

The policy sees only the camera image and the instruction: no proprioception, no object or goal
pose. Camera 64 px: rendering dominates a step here (about 25 ms per frame with lavapipe, 6 ms
with the Panda's meshes simplified to 2000 triangles each, ``render_mesh_triangles``), and a
pushed cube's position relative to the target still shows at that size. Prints each run's curve
(time, step, held-out success, train return); the last line is JSON with ``success_sft``,
``success_rl`` and ``train_wall_s`` of the discrete-head PPO run, ``met_bar`` (RL >= SFT + 0.30,
SFT within [0.10, 0.60]) and ``variants`` holding the same for each variant.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

FIRST_DEMO_SEED = 100_000
EPISODE_STEPS = 40  # the pusher needs about 25
# the demos' control: the pusher moves the end effector (x, y, z, gripper)
CONTROL = [f"env.{split}.{key}" for split in ("train", "eval")
           for key in ("init_params.control_mode=pd_ee_delta_pos", f"max_episode_steps={EPISODE_STEPS}")]
RL_CONFIG = "maniskill_ppo_openvla_oft_push_cube"


def rl_overrides(model: Path | str) -> list[str]:
    """The RL run's overrides from an SFT checkpoint's ``actor/model`` folder (the demos' control
    and 4-dim actions), shared by this bar, ``soak.py --config vla`` and ``actor_stress.py``."""
    return [*CONTROL, "actor.model.action_dim=4", f"actor.model.model_path={model}"]


GRPO = ["algorithm.adv_type=grpo", "algorithm.group_size=4", "env.train.group_size=4",
        "env.train.use_fixed_reset_state_ids=true", "actor.model.add_value_head=false", "algorithm.value_clip=null"]
VARIANTS = {  # SFT head, RL overrides
    "ppo": ("discrete", []),
    "grpo": ("discrete", GRPO),
    "ppo_l1": ("l1_regression", ["actor.model.action_head=l1_regression"]),
}


def record_demos(out: Path, episodes: int, first_seed: int = FIRST_DEMO_SEED, num_envs: int = 8) -> Path:
    """Successful pusher episodes at 64 px, in ManiSkill's trajectory format (``out.h5``)."""
    from embodied.config import load_env_config
    from embodied.record import record, recording_env
    from envs import make_vector_env
    from envs.maniskill_demos import TrajectoryWriter
    from envs.experts import push_cube
    from envs.maniskill import check_params
    from envs.maniskill_scene import make_kwargs
    from envs.protocol import PRIVILEGED_STATES

    cfg = load_env_config("maniskill_push_cube", [
        "init_params.obs_mode=rgb+state", "init_params.control_mode=pd_ee_delta_pos", "init_params.wrist_camera=null",
        "init_params.camera_heights=64", "init_params.camera_widths=64", "init_params.render_mesh_triangles=2000",
        f"max_episode_steps={EPISODE_STEPS}"])
    env_cfg, _ = recording_env(cfg, num_envs)
    p = check_params(env_cfg.init_params)
    tic = time.monotonic()
    with make_vector_env(env_cfg, num_envs) as env, TrajectoryWriter(
            out, env_id=p["id"], env_kwargs=make_kwargs(p, 1, EPISODE_STEPS), max_episode_steps=EPISODE_STEPS,
            main_camera=p["main_camera"], source_type="motion_planning",
            source_desc="envs.experts.push_cube (scripted, reads object poses)") as writer:
        result = record(env, lambda obs: push_cube(obs[PRIVILEGED_STATES])[:, None], writer, episodes=episodes,
                        max_attempts=4 * episodes, first_reset_state=first_seed)
    if result.kept < episodes:
        sys.exit(f"the pusher succeeded in only {result.kept} of {result.attempts} episodes")
    print(f"demos: {result.kept} of {result.attempts} pusher episodes kept ({result.env_steps} env steps, "
          f"{time.monotonic() - tic:.0f} s) -> {writer.h5_path}", flush=True)
    return writer.h5_path


def embodied(command: str, args: list[str], log: Path) -> dict:
    """One ``embodied-train`` / ``embodied-eval`` run; its output goes to ``log``, its JSON line back."""
    line = [sys.executable, "-m", "embodied", command, *args]
    print("$ " + " ".join(["embodied-" + command, *args]), flush=True)
    with open(log, "w") as out:
        done = subprocess.run(line, cwd=ROOT, stdout=subprocess.PIPE, stderr=out, text=True)
    log.write_text(log.read_text() + done.stdout)
    if done.returncode:
        raise RuntimeError(f"embodied-{command} failed (exit {done.returncode}); its output: {log}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def curve(run_dir: Path, tag: str = "eval/success_once") -> list[dict]:
    """(time since the run's first event, step, success, train return) at every step that logged
    ``tag``: the held-out evals by default, ``train/success_once`` for the sampled episodes."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    tags = set(events.Tags()["scalars"])
    returns = {e.step: e.value for e in events.Scalars("train/return")} if "train/return" in tags else {}
    start = min(e.wall_time for tag in tags for e in events.Scalars(tag))
    return [{"time_s": round(e.wall_time - start, 1), "step": e.step, "success": round(e.value, 4),
             "return": round(returns[e.step], 3) if e.step in returns else None}
            for e in events.Scalars(tag)]


def held_out(ckpt: Path, out: Path, name: str, episodes: int) -> float:
    """Greedy success of a checkpoint on the eval episodes, with videos in ``out/name``."""
    result = embodied("eval", ["--config-name", RL_CONFIG, f"runner.ckpt_path={ckpt}", *CONTROL,
                               f"runner.output_dir={out}", f"runner.experiment_name={name}",
                               f"env.eval.total_num_envs={episodes}", "env.eval.video_cfg.save_video=true"],
                      out / f"{name}.log")
    return result["eval_success"]


def check_held_out(demo_file: Path, episodes: int) -> None:
    """The eval episodes' reset states (seeds) are none of the demos'."""
    from embodied.config import compose
    from envs.protocol import ResetStates

    seed = compose(RL_CONFIG).env.eval.seed
    states = ResetStates(None, episodes, seed)  # a fresh eval env's first episode in each of its envs
    seeds = set(states.ids(np.arange(episodes), np.zeros(episodes, int))[0].tolist())
    demo_seeds = {e["episode_seed"] for e in json.loads(demo_file.with_suffix(".json").read_text())["episodes"]}
    if None in demo_seeds or len(seeds) < episodes:
        sys.exit(f"{demo_file}: demo seeds {sorted(demo_seeds, key=str)[:5]}..., eval seeds {len(seeds)}: cannot check")
    if seeds & demo_seeds:
        sys.exit(f"eval reset states {sorted(seeds & demo_seeds)} are demo episodes")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", default="ppo,grpo,ppo_l1", help=f"comma list of {', '.join(VARIANTS)}")
    parser.add_argument("--demos", type=int, default=100, help="successful demo episodes to record")
    parser.add_argument("--sft-steps", type=int, default=1000, help="SFT optimizer steps (64 demo steps each)")
    parser.add_argument("--rl-steps", type=int, default=160,
                        help="steps of the discrete-head PPO run (2560 env steps each; 160 take about 30 min here)")
    parser.add_argument("--variant-steps", type=int, default=None, help="steps of the other variants (default: --rl-steps)")
    parser.add_argument("--eval-episodes", type=int, default=256,
                        help="held-out greedy episodes of the final evals (256: a standard error of about 3 points)")
    parser.add_argument("--out", default="results/vla_learning", help="folder of the demos, runs and videos")
    parser.add_argument("-o", "--override", action="append", default=[], help="extra override of the RL runs")
    args = parser.parse_args()
    variants = args.variants.split(",")
    if unknown := set(variants) - set(VARIANTS):
        parser.error(f"unknown variant(s) {sorted(unknown)}; choose from {', '.join(VARIANTS)}")
    out = (ROOT / args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)

    # what a previous run of this command left in --out (demos, finished SFT runs) is reused
    demos = out / "push.h5" if (out / "push.json").exists() else record_demos(out / "push", args.demos)
    check_held_out(demos, args.eval_episodes)
    sft = {}
    for head in sorted({VARIANTS[v][0] for v in variants}):
        name = f"sft_{head}"
        ckpt = out / name / "checkpoints" / f"global_step_{args.sft_steps}"
        if not ckpt.exists():
            embodied("train", ["--config-name", "maniskill_sft_openvla_oft", *CONTROL,
                               f"data.demo_paths=[{demos}]",
                               "actor.model.action_dim=4", f"actor.model.action_head={head}",
                               f"runner.output_dir={out}", f"runner.experiment_name={name}",
                               f"runner.max_epochs={args.sft_steps}", f"runner.save_interval={args.sft_steps}",
                               f"runner.val_check_interval={max(args.sft_steps // 5, 1)}"], out / f"{name}.log")
        sft[head] = (ckpt, held_out(ckpt, out, f"{name}_eval", args.eval_episodes), curve(out / name))
        print(f"SFT ({head} head): held-out success {sft[head][1]:.3f}; curve {sft[head][2]}", flush=True)

    results = {}
    for variant in variants:
        head, extra = VARIANTS[variant]
        ckpt, success_sft, _ = sft[head]
        name = f"rl_{variant}"
        try:
            steps = args.rl_steps if variant == "ppo" or args.variant_steps is None else args.variant_steps
            run = embodied("train", ["--config-name", RL_CONFIG, *rl_overrides(ckpt / "actor" / "model"),
                                     f"runner.output_dir={out}", f"runner.experiment_name={name}",
                                     f"runner.max_epochs={steps}", f"runner.save_interval={steps}",
                                     *extra, *args.override], out / f"{name}.log")
            success_rl = held_out(out / name / "checkpoints" / f"global_step_{steps}", out, f"{name}_eval",
                                  args.eval_episodes)
            results[variant] = {"success_sft": success_sft, "success_rl": success_rl, "train_wall_s": run["wall_s"],
                                "steps": steps, "env_steps": run["env_steps"], "curve": curve(out / name),
                                "met_bar": bool(0.10 <= success_sft <= 0.60 and success_rl >= success_sft + 0.30
                                                and run["wall_s"] <= 1800)}
            print(f"{variant}: held-out success {success_sft:.3f} after SFT -> {success_rl:.3f} after "
                  f"{steps} RL steps ({run['env_steps']} env steps, {run['wall_s']:.0f} s); curve:", flush=True)
            for point in results[variant]["curve"]:
                print(f"  {point}")
        except RuntimeError as err:  # one variant's failure leaves the others' results
            print(f"{variant}: {err}", flush=True)
            results[variant] = {"success_sft": success_sft, "success_rl": None, "train_wall_s": None,
                                "met_bar": False, "error": str(err)}
    top = results.get("ppo", next(iter(results.values())))
    print(json.dumps({k: top[k] for k in ("success_sft", "success_rl", "train_wall_s", "met_bar")}
                     | {"variants": {v: {k: r[k] for k in ("success_sft", "success_rl", "train_wall_s", "met_bar")}
                                     for v, r in results.items()}}), flush=True)


if __name__ == "__main__":
    main()
