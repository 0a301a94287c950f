"""The VLA actor's update alone, for as long as asked: one step of issue 28's bisection.

The heap corruption of issue 28 killed an FSDP2 actor rank of the VLA learning bar's PPO, 135
steps in, and has not come back in any run since (benchmarks/README.md). This approximates what
that rank ran, without Ray, the channel, the env or the rollout workers: two processes
(``torch.multiprocessing``), FSDP2 over gloo through the framework's own backend
(``embodied.backends.FSDP``: ``fully_shard`` per block, then the root), the learning bar's actor
config (``maniskill_ppo_openvla_oft_push_cube``: micro-batches of 40, updates of 160 samples over
both ranks, 2 epochs of 4 updates a step, gradient clipping) on an SFT checkpoint's weights, and
after each step the weight gather of the sync to the rollout (``trainable_state_dict``) and every
``--save-every`` steps the checkpoint's gathers (``FSDP.save``). Where it differs from the
trainer: one Adam group at ``actor.optim.lr`` (the trainer gives the value head ``value_lr``), a
policy-gradient-plus-value stand-in for the PPO loss, and micro-batches shuffled whole. The
samples are one rollout's, made once by the policy itself on random 64 px frames; advantages
are redrawn every step.

Run it under a memory checker so that a bad free aborts at once, e.g. AddressSanitizer::

    LD_PRELOAD="/usr/lib/x86_64-linux-gnu/libasan.so.8 /usr/lib/x86_64-linux-gnu/libstdc++.so.6" \\
    ASAN_OPTIONS=detect_leaks=0:alloc_dealloc_mismatch=0:log_path=/tmp/asan/asan:abort_on_error=1 \\
        .venv/bin/python benchmarks/actor_stress.py --model <sft>/actor/model --minutes 45

A rank that dies or raises ends the run; the JSON line says which, with its exit code (negative:
the signal) or its exception, and the steps both ranks had finished.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

def _rank(rank: int, port: int, args: argparse.Namespace, results) -> None:
    import psutil

    from embodied.backends import FSDP
    from embodied.config import compose
    from embodied.config.validate import chunk_steps, rollout_window
    from envs.maniskill import task_description

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    torch.set_num_threads(1)  # as in a Ray worker with one CPU
    import vla_learning as bar

    # the PPO run of the learning bar, as benchmarks/soak.py --config vla starts it
    cfg = compose(bar.RL_CONFIG, bar.rl_overrides(args.model))
    backend = FSDP(cfg, "cpu")
    torch.manual_seed(0)
    policy = backend.build(torch.device("cpu"))
    actor = cfg.actor

    # one rollout's samples on this rank: 320 chunks (64 envs x 10 chunks over 2 ranks)
    task = task_description(cfg.env.train.init_params.id)
    chunks = chunk_steps(rollout_window(cfg.env.train), cfg.actor.model.num_action_chunks)
    per_rank, micro = cfg.env.train.total_num_envs * chunks // 2, actor.micro_batch_size
    gen = torch.Generator().manual_seed(rank)
    size = (cfg.env.train.init_params.camera_heights, cfg.env.train.init_params.camera_widths)
    inputs, actions = [], []
    policy.eval()
    with torch.no_grad():
        for _ in range(per_rank // micro):
            frames = torch.randint(0, 256, (micro, *size, 3), generator=gen, dtype=torch.uint8).numpy()
            out = policy.act({"main_images": frames, "states": torch.zeros(micro, 9).numpy(),
                              "task_descriptions": [task] * micro})
            inputs.append(out.forward_inputs)
            actions.append(out.actions)
    policy = backend.wrap(policy)  # sampled unsharded, as the rollout worker does
    optimizer = torch.optim.Adam([p for p in policy.parameters() if p.requires_grad], lr=actor.optim.lr)
    per_update = actor.global_batch_size // 2
    start, steps, updates = time.monotonic(), 0, 0
    deadline = start + 60 * args.minutes
    while time.monotonic() < deadline and (args.steps is None or steps < args.steps):
        policy.train()
        for _ in range(cfg.algorithm.update_epochs):
            order = torch.randperm(len(inputs), generator=gen)
            for first in range(0, len(order), per_update // micro):
                pieces = order[first:first + per_update // micro]
                for i, piece in enumerate(pieces.tolist()):
                    backend.micro_batch(policy, last=i == len(pieces) - 1)
                    new = policy(inputs[piece], actions[piece])
                    advantages = torch.randn(micro, generator=gen)
                    loss = -(new.logprobs.flatten(1).mean(-1) * advantages).mean()
                    loss = (loss + (new.values.float().reshape(micro, -1).mean(-1) - advantages).pow(2).mean()) / len(pieces)
                    loss.backward()
                backend.clip_gradients(policy, actor.optim.clip_grad)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                updates += 1
        weights = policy.trainable_state_dict()  # the sync to the rollout: gathers every shard
        del weights
        steps += 1
        if steps % args.save_every == 0:
            backend.save(policy, optimizer, Path(args.out) / f"step{steps}")  # every rank gathers, rank 0 writes
        results[rank] = {"steps": steps, "updates": updates, "minutes": (time.monotonic() - start) / 60}
        if rank == 0:
            rss = psutil.Process().memory_info().rss / 2**20
            print(f"step {steps}: {updates} updates, {(time.monotonic() - start) / steps:.1f} s a step, "
                  f"rank 0 RSS {rss:.0f} MB", flush=True)
    torch.distributed.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="an SFT checkpoint's actor/model folder")
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--steps", type=int, default=None, help="stop after this many steps (default: --minutes)")
    parser.add_argument("--save-every", type=int, default=10, help="steps between checkpoints, as the config saves")
    parser.add_argument("--out", default=None, help="checkpoint folder (default: a temporary one)")
    args = parser.parse_args()
    if not (Path(args.model) / "config.json").is_file():
        sys.exit(f"actor_stress.py: --model {args.model} has no config.json; give an SFT checkpoint's actor/model folder")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as scratch, mp.Manager() as manager:
        args.out = args.out or scratch
        results = manager.dict()
        died = None
        try:
            mp.spawn(_rank, args=(port, args, results), nprocs=2)
        except mp.ProcessExitedException as err:
            died = {"rank": err.error_index, "exit_code": err.exit_code}
        except mp.ProcessRaisedException as err:
            died = {"rank": err.error_index, "raised": str(err).strip().splitlines()[-1]}
        results = dict(results)
    print(json.dumps({"steps": min((r["steps"] for r in results.values()), default=0),
                      "updates": min((r["updates"] for r in results.values()), default=0),
                      "minutes": round(max((r["minutes"] for r in results.values()), default=0.0), 1),
                      "died": died}))
    sys.exit(1 if died else 0)


if __name__ == "__main__":
    main()
