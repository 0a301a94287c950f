"""A VLA that learns on real LIBERO tasks here: supervised fine-tuning of a tiny OpenVLA-OFT on
the scripted expert's demos of LIBERO-Object's first five tasks, then PPO lifts its held-out
success, in one command.

    python benchmarks/libero_learning.py [--demos-per-task 30] [--demo-noise 0.3] [--sft-steps 3000]
        [--rl-steps 30] [--out results/libero_learning]

1. **Demos**: ``python -m embodied.record --expert libero_pick_place`` (``envs/experts.py``, which
   reads the object and basket positions from the simulator) on init states 0-29 of each task,
   64 px agent view and wrist camera, the 8-d robot state and the instruction, in LIBERO's demo
   HDF5 layout (one file per task); executed with DART's translation noise (``--demo-noise``,
   ``--action-noise`` of the recorder) while the expert's own actions are recorded, so the demos
   show recoveries (held-out SFT success 0.03 without it, 0.12 with 0.3: benchmarks/README.md).
2. **SFT**: ``embodied-train --config-name libero_object_sft_openvla_oft`` on that folder: a tiny
   OpenVLA-OFT (``policies/openvla_oft/tiny.py``, public layout, 56 px, both images and the
   proprio projector, an LLM 128 wide) trained whole by cross-entropy on its action tokens,
   chunks of 8.
3. **RL**: ``embodied-train --config-name libero_object_ppo_openvla_oft`` from the SFT
   checkpoint's ``actor/model`` folder: PPO with a fresh value head on the demos' init states,
   16 envs x 200 steps a step, success reward.
4. **Held-out evaluation**: ``embodied-eval`` of the SFT and the RL checkpoints on init states
   30-49 of the five tasks, each once (100 greedy episodes; checked against the demos' init
   states); the final one with one video per episode and the HTML report.

Why these tasks: LIBERO-Object's pick-and-place scenes are the ones the scripted expert solves
(all ten tasks); five of them give 100 held-out init states (a suite task has 50) beside 30
demo states each. Why 200 steps: the expert needs about 110 (the suite's published limit, 280, only
lengthens failed episodes, which is most of an early policy's time here). The last line is JSON
with ``success_sft``, ``success_rl``, ``train_wall_s``, ``met_bar`` (SFT within [0.10, 0.60], RL
>= SFT + 0.25 within 3600 s) and the curve (per step: time, success of the sampled
episodes, return; held-out success at each evaluated checkpoint).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.vla_learning import curve, embodied  # noqa: E402

SFT, RL = "libero_object_sft_openvla_oft", "libero_object_ppo_openvla_oft"


def record_demos(out: Path, first: int, stop: int, overrides: list[str] = (), noise: float = 0.0) -> dict:
    """The expert's successful episodes from init states [first, stop) of each task, into the
    folder ``out`` (with ``noise``, executed with DART's translation noise); the recording's
    summary (its JSON line)."""
    from embodied.config import compose

    attempts = len(compose(SFT, list(overrides)).env.train.init_params.task_ids) * (stop - first)
    line = [sys.executable, "-m", "embodied.record", "--config-name", SFT, "--expert", "libero_pick_place",
            "--out", str(out), "--episodes", str(attempts), "--max-attempts", str(attempts), "--num-envs", "2",
            "--action-noise", str(noise),
            "env.train.init_params.privileged_states=true", f"env.train.init_params.init_state_range=[{first},{stop}]",
            *overrides]
    print("$ " + " ".join(line[1:]), flush=True)
    done = subprocess.run(line, cwd=ROOT, stdout=subprocess.PIPE, text=True)
    if done.returncode not in (0, 1):  # 1: fewer episodes kept than attempted (an expert's miss)
        raise RuntimeError(f"recording failed (exit {done.returncode})")
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    print(f"demos: {summary}", flush=True)
    return summary


def check_held_out(demos: Path, overrides: list[str] = ()) -> None:
    """No eval episode starts from an init state a demo of its task started from."""
    import h5py

    from embodied.config import compose

    first, stop = compose(RL, ["actor.model.model_path=x", *overrides]).env.eval.init_params.init_state_range
    for file in sorted(demos.glob("*.hdf5")):
        with h5py.File(file) as f:
            states = {int(f["data"][k].attrs["init_state"]) for k in f["data"]}
        if shared := {s for s in states if first <= s < stop}:
            sys.exit(f"{file}: demos start from held-out init states {sorted(shared)}")


def once(command: str, args: list[str], log: Path) -> dict:
    """``embodied(command, args)``'s JSON line, or that of an earlier run of it that finished."""
    if log.exists() and (last := (log.read_text().strip().splitlines() or [""])[-1]).startswith("{"):
        return json.loads(last)
    return embodied(command, args, log)


def held_out(ckpt: Path, out: Path, name: str, overrides: list[str] = (), videos: bool = True) -> dict:
    """Greedy success of a checkpoint on the held-out init states, with videos and the report in
    ``out/name`` (recording renders both cameras every step: 100 episodes took 1072 s with
    videos, 234 s without)."""
    return once("eval", ["--config-name", RL, f"runner.ckpt_path={ckpt}", f"runner.output_dir={out}",
                         f"runner.experiment_name={name}", f"env.eval.video_cfg.save_video={str(videos).lower()}",
                         *overrides], out / f"{name}.log")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--demos-per-task", type=int, default=30, help="init states 0..N-1 of each task recorded")
    parser.add_argument("--demo-noise", type=float, default=0.3,
                        help="std of the translation noise the expert's demos are executed with (DART; 0: none)")
    parser.add_argument("--sft-steps", type=int, default=3000, help="SFT optimizer steps (64 demo steps each)")
    parser.add_argument("--rl-steps", type=int, default=30,
                        help="PPO steps (3200 env steps each, about 50 s here: 0.12 -> 0.43 held out at 30)")
    parser.add_argument("--eval-every", type=int, default=None,
                        help="held-out eval of every N-th RL step's checkpoint too (100 episodes: ~8 min here each)")
    parser.add_argument("--out", default="results/libero_learning", help="folder of the demos, runs and videos")
    parser.add_argument("-o", "--override", action="append", default=[], help="extra override of every run")
    args = parser.parse_args()
    out = (ROOT / args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    extra = args.override

    # what a previous run of this command left in --out (demos, finished runs and evals) is reused
    demos = out / "demos"
    if not any(demos.glob("*.hdf5")):
        record_demos(demos, 0, args.demos_per_task, extra, args.demo_noise)
    check_held_out(demos, extra)
    common = [f"runner.output_dir={out}", *extra]
    sft_ckpt = out / "sft" / "checkpoints" / f"global_step_{args.sft_steps}"
    once("train", ["--config-name", SFT, f"data.demo_paths=[{demos}]", "runner.experiment_name=sft",
                   f"runner.max_epochs={args.sft_steps}", f"runner.save_interval={args.sft_steps}", *common],
         out / "sft.log")
    sft = held_out(sft_ckpt, out, "sft_eval", extra, videos=False)
    print(f"SFT: held-out success {sft['eval_success']:.3f} on {sft['episodes']:.0f} episodes", flush=True)

    interval = min(args.eval_every or args.rl_steps, args.rl_steps)
    run = once("train", ["--config-name", RL, f"actor.model.model_path={sft_ckpt / 'actor' / 'model'}",
                         "runner.experiment_name=rl", f"runner.max_epochs={args.rl_steps}",
                         f"runner.save_interval={interval}", *common], out / "rl.log")
    train_curve = curve(out / "rl", "train/success_once")
    evals = {0: sft["eval_success"]}
    for step in [*range(interval, args.rl_steps, interval), args.rl_steps]:
        evals[step] = held_out(out / "rl" / "checkpoints" / f"global_step_{step}", out, f"rl_eval_{step}",
                               extra, videos=step == args.rl_steps)["eval_success"]
        print(f"RL step {step}: held-out success {evals[step]:.3f}", flush=True)
    for point in train_curve:
        print(f"  {point}")
    success_sft, success_rl = sft["eval_success"], evals[args.rl_steps]
    print(json.dumps({"success_sft": success_sft, "success_rl": success_rl, "train_wall_s": run["wall_s"],
                      "met_bar": bool(0.10 <= success_sft <= 0.60 and success_rl >= success_sft + 0.25
                                      and run["wall_s"] <= 3600),
                      "episodes": sft["episodes"], "env_steps": run["env_steps"], "held_out_by_step": evals,
                      "curve": train_curve}), flush=True)


if __name__ == "__main__":
    main()
