"""Soak: a long training run, watching for crashes and leaks.

Runs ``embodied-train`` on one of three configs (``--config``):

- ``tiny``: PPO on PushCube (4 envs, 10-step episodes, an eval every 25 steps, a checkpoint every
  50 keeping 2);
- ``vla``: the VLA learning bar's PPO (``maniskill_ppo_openvla_oft_push_cube`` from the SFT
  checkpoint of ``benchmarks/vla_learning.py``, whose demos and SFT run first into ``--out``
  unless they are there; the actor, env and rollout collocated on both cores as in the run whose
  actor rank died of heap corruption, issue 28);
- ``math``: ``math_grpo_tiny`` on the arithmetic prompts, warm-started as ``math_learning.py`` does;

for ``--steps`` steps or ``--minutes`` minutes (then it is stopped), with the runner's restarts
on: a worker that dies is counted (``restarts``, each with its signal and crash report from the
run's ``restarts.jsonl``), not fatal. Every ``--every`` seconds it samples the resident memory
(RSS) of each worker kind (a rank's process plus its children: the env workers' simulator
processes; the ranks of the latest launch) and the bytes of the run's shared-memory segments in
/dev/shm (channel slots and queues, env observation blocks: every ``embch.<host>.<pid>.*`` segment
of the driver or a worker). Prints each kind's RSS growth from the end of the warm-up
(``--warmup`` of the run) to the end, the /dev/shm series, and one line of JSON. Targets: no
restart, growth < 5 % per kind, /dev/shm flat after warm-up.

    flock /tmp/cpu.lock .venv/bin/python benchmarks/soak.py --steps 300
    flock /tmp/cpu.lock .venv/bin/python benchmarks/soak.py --config vla --minutes 120 --out results/soak_vla
    flock /tmp/cpu.lock .venv/bin/python benchmarks/soak.py --config math --minutes 120 --out results/soak_math
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from core.shm import creator_prefix  # noqa: E402

GROUPS = ("EnvGroup", "RolloutGroup", "ActorGroup")
PIDS = re.compile(r"rank \d+ pid (\d+) on node")
STEP = re.compile(r"(\d+)/(\d+) \[")
TINY = ["runner.val_check_interval=25", "runner.save_interval=50", "runner.max_ckpts_to_keep=2",
        "env.train.total_num_envs=4", "env.train.max_episode_steps=10",
        "env.eval.total_num_envs=4", "env.eval.max_episode_steps=10",
        "actor.global_batch_size=20", "actor.micro_batch_size=10"]


def rss(pid: int) -> int:
    """Resident bytes of a process and its descendants (0 once it is gone)."""
    try:
        proc = psutil.Process(pid)
        return sum(p.memory_info().rss for p in [proc, *proc.children(recursive=True)])
    except psutil.Error:
        return 0


def shm_bytes(pids: list[int]) -> int:
    prefixes = tuple(creator_prefix(pid) for pid in pids)
    total = 0
    for name in os.listdir("/dev/shm"):
        if name.startswith(prefixes):
            try:
                total += os.stat(os.path.join("/dev/shm", name)).st_size
            except FileNotFoundError:
                pass
    return total


def config_args(name: str, out: Path) -> list[str]:
    """The command-line arguments of each soaked config (its data and checkpoints made in ``out``)."""
    if name == "tiny":
        return TINY
    if name == "vla":
        sys.path.insert(0, str(ROOT / "benchmarks"))
        import vla_learning as bar

        demos = out / "push.h5" if (out / "push.json").exists() else bar.record_demos(out / "push", 100)
        sft = out / "sft_discrete" / "checkpoints" / "global_step_1000"
        if not sft.exists():
            bar.embodied("train", ["--config-name", "maniskill_sft_openvla_oft", *bar.CONTROL,
                                   f"data.demo_paths=[{demos}]", "actor.model.action_dim=4",
                                   f"runner.output_dir={out}", "runner.experiment_name=sft_discrete",
                                   "runner.max_epochs=1000", "runner.save_interval=1000"], out / "sft.log")
        return ["--config-name", bar.RL_CONFIG, *bar.rl_overrides(sft / "actor" / "model"), "runner.max_ckpts_to_keep=2"]
    from envs.arithmetic import write_split
    from policies.tiny_lm import warm_start

    if not (out / "model").exists():  # the prompts and warm start of math_learning.py
        write_split(out / "data")
        warm_start(out / "model", out / "data")
    return ["--config-name", "math_grpo_tiny", f"actor.model.model_path={out / 'model'}",
            f"data.train_data_paths=[{out / 'data' / 'train.jsonl'}]",
            f"data.val_data_paths=[{out / 'data' / 'test.jsonl'}]", "runner.max_ckpts_to_keep=2"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", choices=("tiny", "vla", "math"), default="tiny")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--minutes", type=float, default=None, help="run this long instead of --steps")
    parser.add_argument("--warmup", type=float, default=0.2, help="fraction of the run left out")
    parser.add_argument("--every", type=float, default=2.0, help="seconds between samples")
    parser.add_argument("--out", default=None, help="folder of the run (default: a fresh temporary one)")
    args = parser.parse_args()
    out = Path(args.out).resolve() if args.out else Path(tempfile.mkdtemp(prefix="soak-"))
    out.mkdir(parents=True, exist_ok=True)
    steps = 10**6 if args.minutes else args.steps
    command = [sys.executable, "-m", "embodied", "train", *config_args(args.config, out),
               f"runner.output_dir={out}", "runner.experiment_name=soak", f"runner.max_epochs={steps}"]
    print("$ " + " ".join(command[3:]), flush=True)
    log = open(out / "stdout", "w+")
    err = open(out / "stderr", "w+")
    proc = subprocess.Popen(command, stdout=log, stderr=err, cwd=ROOT)
    samples: list[dict] = []  # {"t", "step", "rss": {group: bytes}, "shm"}
    start = time.monotonic()
    stopped = False
    while proc.poll() is None:
        time.sleep(args.every)
        if args.minutes and time.monotonic() - start > args.minutes * 60:
            proc.send_signal(signal.SIGTERM)  # the run's time is up: the figures are what it did until now
            proc.wait()
            stopped = True
            break
        log.seek(0)
        pids: dict[str, list[int]] = {}  # each group's ranks of the latest launch (a restart launches anew)
        for line in log.read().splitlines():
            group = line.split(":", 1)[0]
            if group in GROUPS:
                pids[group] = [int(p) for p in PIDS.findall(line)]
        err.seek(0)
        progress = STEP.findall(err.read())
        if len(pids) < len(GROUPS) or not progress:
            continue
        step = int(progress[-1][0])
        everyone = [proc.pid] + [p for ps in pids.values() for p in ps]
        samples.append({"t": round(time.monotonic() - start, 1), "step": step,
                        "rss": {g: sum(rss(p) for p in ps) for g, ps in pids.items()},
                        "shm": shm_bytes(everyone)})
    if proc.returncode != 0 and not stopped:
        err.seek(0)
        sys.exit(f"the soak run failed:\n{err.read()[-3000:]}")
    restarts_log = out / "soak" / "restarts.jsonl"
    restarts = [json.loads(line) for line in restarts_log.read_text().splitlines()] if restarts_log.exists() else []
    samples = [s for s in samples if all(s["rss"].values())]  # workers end with the run
    warm = next(s for s in samples if s["t"] >= args.warmup * samples[-1]["t"])
    last = samples[-1]
    growth = {g: (last["rss"][g] - warm["rss"][g]) / warm["rss"][g] for g in GROUPS}
    after = [s["shm"] for s in samples if s["step"] >= warm["step"]]
    print(f"{args.config}: {last['step']} steps in {last['t']:.0f} s; {len(samples)} samples; "
          f"warm-up ends at step {warm['step']}; {len(restarts)} restart(s)")
    for r in restarts:
        print(f"  restart at step {r['step']}: {r['group']} rank {r['rank']} ({r['signal'] or 'no signal known'}), "
              f"{r['lost_steps']} step(s) lost; report {r['report']}")
    print(f"{'worker kind':<14} {'RSS after warm-up':>18} {'RSS at the end':>15} {'growth':>8}")
    for g in GROUPS:
        print(f"{g:<14} {warm['rss'][g] / 1e6:>15.1f} MB {last['rss'][g] / 1e6:>12.1f} MB {growth[g]:>8.2%}")
    print("/dev/shm bytes of the run over time (step: MB):")
    print("  " + ", ".join(f"{s['step']}: {s['shm'] / 1e6:.2f}" for s in samples[::max(1, len(samples) // 12)]))
    figures = {"config": args.config, "steps": last["step"], "wall_s": last["t"], "restarts": len(restarts),
               "signals": [r["signal"] for r in restarts],
               **{f"rss_growth_{g.removesuffix('Group').lower()}": round(v, 4) for g, v in growth.items()},
               "shm_mb_after_warmup_min": round(min(after) / 1e6, 3),
               "shm_mb_after_warmup_max": round(max(after) / 1e6, 3),
               "rss_growth_under_5_percent": all(v < 0.05 for v in growth.values()),
               "shm_flat": max(after) == min(after)}
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
