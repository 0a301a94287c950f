"""Stress of the shared-memory channel as the workers use it, run by tests/test_channel.py under
glibc's malloc checks and AddressSanitizer: producer processes with several threads put messages
of changing sizes (numpy arrays, torch tensors, nested skeletons) on several keys; the consumer's
threads take them, keep some views across later messages (so slots are reused while others are
held), compute on them with torch in other threads, drop them in any order, and check every
byte against what was sent. Prints ``ok <messages>`` and exits 0, or raises.

    python tests/channel_stress.py SECONDS
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import random
import sys
import threading
import time

import numpy as np
import torch

from embodied.channel import Channel

PRODUCERS, THREADS, KEYS = 2, 2, ("replay_buffer/0", "replay_buffer/1", "obs_buffer/0")


def message(seed: int) -> dict:
    """A trajectory-like message whose sizes change with the seed (slots grow and are reused)."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 64))
    return {"seed": seed, "source": (seed % 7, "rank"),
            "trajectory": {"obs": rng.integers(0, 256, (n, 16, 16, 3), dtype=np.uint8),
                           "logprobs": torch.from_numpy(rng.standard_normal((n, 4))).float(),
                           "tokens": torch.arange(seed, seed + n * 3, dtype=torch.int64).view(n, 3),
                           "empty": np.zeros((0, 2), np.float32)},
            "names": [f"task {i}" for i in range(n % 5)]}


def produce(channel: Channel, first: int, count: int) -> None:
    def run(start: int) -> None:
        for seed in range(start, first + count, THREADS):
            channel.put(KEYS[seed % len(KEYS)], message(seed))

    threads = [threading.Thread(target=run, args=(first + t,)) for t in range(THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def check(got: dict) -> None:
    want = message(got["seed"])
    assert got["source"] == want["source"] and got["names"] == want["names"]
    for key, value in want["trajectory"].items():
        mine = got["trajectory"][key]
        same = torch.equal(mine, value) if isinstance(value, torch.Tensor) else np.array_equal(mine, value)
        assert same, f"message {got['seed']}: {key} differs from what was sent"


def main(seconds: float) -> None:
    channel = Channel.create("stress", maxsize={"replay_buffer": 3, "obs_buffer": 0})
    per_producer = 400
    ctx = mp.get_context("spawn")
    total, received = 0, 0
    deadline = time.monotonic() + seconds
    held: queue.Queue = queue.Queue()  # views kept past later messages, dropped by another thread
    errors: list[BaseException] = []

    def consume(key: str, count: int) -> None:
        try:
            rng = random.Random(key)
            for _ in range(count):
                got = channel.get(key, timeout=60)
                check(got)
                if rng.random() < 0.3:
                    held.put(got)  # checked again, later, in another thread
        except BaseException as err:  # reported by the main thread
            errors.append(err)

    def recheck() -> None:
        while (got := held.get()) is not None:
            check(got)
            torch.from_numpy(got["trajectory"]["obs"]).float().mean()  # compute on the view
            del got

    while time.monotonic() < deadline:
        producers = [ctx.Process(target=produce, args=(channel, total + p * per_producer, per_producer))
                     for p in range(PRODUCERS)]
        for p in producers:
            p.start()
        seeds = range(total, total + PRODUCERS * per_producer)
        counts = {k: sum(1 for s in seeds if KEYS[s % len(KEYS)] == k) for k in KEYS}
        checker = threading.Thread(target=recheck)
        checker.start()
        consumers = [threading.Thread(target=consume, args=(k, n)) for k, n in counts.items()]
        for thread in consumers:
            thread.start()
        for thread in consumers:
            thread.join()
        held.put(None)
        checker.join()
        for p in producers:
            p.join(timeout=60)
            assert p.exitcode == 0, f"a producer exited with {p.exitcode}"
        if errors:
            raise errors[0]
        total += PRODUCERS * per_producer
        received += sum(counts.values())
    channel.close()
    print(f"ok {received}", flush=True)


if __name__ == "__main__":
    main(float(sys.argv[1]))
