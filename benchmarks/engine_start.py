"""vLLM engine start on a CPU: vLLM's default compile cache (AOT, which with torch 2.13 fails to
load its own artifacts and compiles again at every start) against ours (``VLLM_USE_AOT_COMPILE=0``,
set by ``policies/engines/vllm.py``: vLLM's older compile cache, which loads).

Each start is a fresh process that builds the framework's vLLM rollout policy
(``VLLMCausalLM``) on a new copy of the model folder, as every run and test does; the first
round warms both caches and is not counted. Rounds alternate the two; the ratio is of the median
start times (the whole constructor: vLLM's import, engine, compile or cache load).

    flock /tmp/cpu.lock .venv/bin/python benchmarks/engine_start.py [--rounds 3] [--model tiny]

The last line is JSON with ``aot_s``, ``ours_s`` and ``ratio`` (aot / ours).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

START = """
import sys, time
sys.path.insert(0, {root!r})
from pathlib import Path
tic = time.perf_counter()
from benchmarks.generation import model_cfg
from policies.engines.vllm import VLLMCausalLM
engine = VLLMCausalLM(model_cfg(Path({folder!r}), 4), {{"enforce_eager": False, "max_running_requests": 64}},
                      cpu_threads=2)
print(time.perf_counter() - tic)
engine.shutdown()
"""


def start(model: Path, aot: bool, copy: int) -> float:
    """Seconds to build the policy in a fresh process, on a fresh copy of ``model``."""
    folder = model.parent / f"copy{copy}"
    shutil.copytree(model, folder)
    env = {**os.environ, "VLLM_USE_AOT_COMPILE": "1" if aot else "0"}
    done = subprocess.run([sys.executable, "-c", START.format(root=str(ROOT), folder=str(folder))],
                          capture_output=True, text=True, env=env, timeout=600)
    if done.returncode:
        raise RuntimeError(done.stderr[-2000:])
    return float(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--model", default="tiny", help="a benchmarks/generation.py model")
    args = parser.parse_args()
    from benchmarks.generation import write_model

    times: dict[str, list[float]] = {"aot": [], "ours": []}
    with tempfile.TemporaryDirectory() as root:
        model = Path(root) / "model"
        write_model(args.model, model)
        copy = 0
        for round_ in range(args.rounds + 1):  # round 0 warms the caches
            for name in ("aot", "ours") if round_ % 2 == 0 else ("ours", "aot"):
                copy += 1
                seconds = start(model, name == "aot", copy)
                if round_:
                    times[name].append(seconds)
                print(f"round {round_}{' (warm-up)' if not round_ else ''}: {name} {seconds:.1f} s", flush=True)
    aot, ours = statistics.median(times["aot"]), statistics.median(times["ours"])
    print(json.dumps({"model": args.model, "aot_s": round(aot, 1), "ours_s": round(ours, 1),
                      "ratio": round(aot / ours, 2), "rounds": args.rounds}))


if __name__ == "__main__":
    main()
