"""Channel throughput and latency between two worker processes on one node, against baselines.

An observation batch (64 x 256 x 256 x 3 uint8 images = 12.6 MB, plus states, task strings and a
step counter) goes from a producer worker to a consumer worker, many times, through:

* our channel: the consumer gets shared-memory views (what ``Channel.get`` returns);
* our channel, with the consumer copying the arrays into a reused buffer (like for like with Ray);
* Ray's object store between the same two actors: ``ray.put``, the ref through a
  ``ray.util.queue.Queue``, ``ray.get`` and a copy into a reused buffer;
* ``multiprocessing.Queue`` between two processes (pickled through a pipe);
* ``np.copyto`` into a warm buffer in one process: the physical limit.

Bounded queues hold 2 messages everywhere. Then the same bulk message across two Ray nodes (a
two-raylet cluster on this machine): the channel's cross-node path against Ray's object store. Also the latency of a 1 KB message (half a ping-pong
round trip) for the channel, Ray's queue and ``multiprocessing.Queue``. Prints a table of medians
and, last, one line of JSON.

    flock /tmp/cpu.lock python benchmarks/channel.py
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import time
from typing import Any

import numpy as np
import ray
from ray.util.queue import Queue as RayQueue

from embodied.channel import Channel
from embodied.cluster import Cluster
from embodied.worker import Worker, WorkerGroup

KEY = "obs_buffer/0"
BOUND = 2


def make_batch() -> dict:
    rng = np.random.default_rng(0)
    return {
        "main_images": rng.integers(0, 256, (64, 256, 256, 3), dtype=np.uint8),
        "states": rng.standard_normal((64, 32)).astype(np.float32),
        "task_descriptions": ["put the carrot on the plate"] * 64,
        "step": 0,
    }


def array_bytes(batch: dict) -> int:
    return sum(v.nbytes for v in batch.values() if isinstance(v, np.ndarray))


def small_message() -> dict:
    return {"actions": np.zeros(256, np.float32)}  # 1 KB of array data


def copy_into(buffers: dict, item: dict) -> None:
    for k, buf in buffers.items():
        np.copyto(buf, item[k])


def intervals(stamps: list[float], warmup: int) -> list[float]:
    return [b - a for a, b in zip(stamps[warmup:], stamps[warmup + 1:])]


class Bench(Worker):
    """Producer (rank of ProducerGroup) or consumer (rank of ConsumerGroup) of every transport."""

    def __init__(self) -> None:
        self.batch = make_batch()
        self.buffers = {k: np.empty_like(v) for k, v in self.batch.items() if isinstance(v, np.ndarray)}
        for buf in self.buffers.values():
            buf.fill(1)  # warm

    def produce_channel(self, ch: Channel, n: int) -> None:
        for step in range(n):
            self.batch["step"] = step
            ch.put(KEY, self.batch)

    def consume_channel(self, ch: Channel, n: int, copy: bool) -> list[float]:
        stamps = []
        for step in range(n):
            item = ch.get(KEY)
            assert item["step"] == step
            if copy:
                copy_into(self.buffers, item)
            del item  # gives the slot back to the producer
            stamps.append(time.perf_counter())
        return stamps

    def produce_ray(self, queue: RayQueue, n: int) -> None:
        for step in range(n):
            self.batch["step"] = step
            queue.put([ray.put(self.batch)])  # in a list, so the queue passes the ref on

    def consume_ray(self, queue: RayQueue, n: int) -> list[float]:
        stamps = []
        for step in range(n):
            item = ray.get(queue.get()[0])
            assert item["step"] == step
            copy_into(self.buffers, item)
            del item
            stamps.append(time.perf_counter())
        return stamps

    def ping_channel(self, ch: Channel, n: int) -> list[float]:
        msg, rtts = small_message(), []
        for _ in range(n):
            start = time.perf_counter()
            ch.put("ping", msg)
            del msg
            msg = ch.get("pong")
            rtts.append(time.perf_counter() - start)
        return rtts

    def pong_channel(self, ch: Channel, n: int) -> None:
        for _ in range(n):
            msg = ch.get("ping")
            ch.put("pong", msg)
            del msg

    def ping_ray(self, ping: RayQueue, pong: RayQueue, n: int) -> list[float]:
        return _ping(ping, pong, n)

    def pong_ray(self, ping: RayQueue, pong: RayQueue, n: int) -> None:
        for _ in range(n):
            pong.put(ping.get())


def _ping(ping: Any, pong: Any, n: int) -> list[float]:
    """Round trips of a small message through two queues (``put`` / ``get``) and a pong peer."""
    msg, rtts = small_message(), []
    for _ in range(n):
        start = time.perf_counter()
        ping.put(msg)
        msg = pong.get()
        rtts.append(time.perf_counter() - start)
    return rtts


def _mp_produce(queue, n: int) -> None:
    batch = make_batch()
    for step in range(n):
        queue.put({**batch, "step": step})  # a new dict: the queue pickles it later, in a thread


def _mp_consume(queue, n: int, out) -> None:
    batch = make_batch()
    buffers = {k: np.empty_like(v) for k, v in batch.items() if isinstance(v, np.ndarray)}
    stamps = []
    for step in range(n):
        item = queue.get()
        assert item["step"] == step
        copy_into(buffers, item)
        stamps.append(time.perf_counter())
    out.put(stamps)


def _mp_pong(ping, pong, n: int) -> None:
    for _ in range(n):
        pong.put(ping.get())


def run_mp(n: int, warmup: int) -> list[float]:
    ctx = mp.get_context("spawn")
    queue, out = ctx.Queue(maxsize=BOUND), ctx.Queue()
    procs = [ctx.Process(target=_mp_produce, args=(queue, n)),
             ctx.Process(target=_mp_consume, args=(queue, n, out))]
    for p in procs:
        p.start()
    stamps = out.get(timeout=600)
    for p in procs:
        p.join()
    return intervals(stamps, warmup)


def run_mp_latency(n: int) -> list[float]:
    ctx = mp.get_context("spawn")
    ping, pong = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_mp_pong, args=(ping, pong, n))
    proc.start()
    rtts = _ping(ping, pong, n)
    proc.join()
    return rtts


def memcpy(batch: dict, n: int) -> list[float]:
    dst = {k: np.empty_like(v) for k, v in batch.items() if isinstance(v, np.ndarray)}
    copy_into(dst, batch)  # warm
    times = []
    for _ in range(n):
        start = time.perf_counter()
        copy_into(dst, batch)
        times.append(time.perf_counter() - start)
    return times


CROSS_CHANNEL = "channel across nodes + copy into reused buffer"
CROSS_RAY = "Ray object store across nodes + copy"


def cross_node(n: int, warmup: int) -> dict[str, list[float]]:
    """Producer on one Ray node, consumer on another: the channel's cross-node path (the key
    lives on the producer's node; the consumer's gets go through that node's agent and the object
    store) against ``ray.put`` + a Ray queue + ``ray.get`` between the same two workers."""
    from ray.cluster_utils import Cluster as RayTestCluster

    nodes = RayTestCluster(initialize_head=True, head_node_args={"num_cpus": 1})
    nodes.add_node(num_cpus=1)
    nodes.wait_for_nodes()
    try:
        cluster = Cluster(num_nodes=2, ray_address=nodes.address)
        plan = cluster.plan({"producer": 0, "consumer": 1})
        producer = WorkerGroup.launch(Bench, cluster, plan, "producer", name="ProducerGroup")
        consumer = WorkerGroup.launch(Bench, cluster, plan, "consumer", name="ConsumerGroup")
        ch = Channel.create("bench", maxsize=BOUND)
        ch.put(KEY, {"step": -1})  # the driver is on the producer's node: the key lives there
        assert ch.get(KEY) == {"step": -1}
        out = {}
        calls = [producer.execute("produce_channel", ch, n), consumer.execute("consume_channel", ch, n, True)]
        out[CROSS_CHANNEL] = intervals([c.wait() for c in calls][1][0], warmup)
        queue = RayQueue(maxsize=BOUND, actor_options={"num_cpus": 0})
        calls = [producer.execute("produce_ray", queue, n), consumer.execute("consume_ray", queue, n)]
        out[CROSS_RAY] = intervals([c.wait() for c in calls][1][0], warmup)
        producer.shutdown()
        consumer.shutdown()
        ch.close()
        cluster.shutdown()
        return out
    finally:
        nodes.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--messages", type=int, default=60, help="bulk messages per transport")
    parser.add_argument("--warmup", type=int, default=10, help="first messages left out")
    parser.add_argument("--pings", type=int, default=400, help="small-message round trips")
    parser.add_argument("--cross-messages", type=int, default=30, help="bulk messages across nodes")
    args = parser.parse_args()
    n, warm = args.messages, args.warmup
    nbytes = array_bytes(make_batch())

    cluster = Cluster(num_nodes=1)
    plan = cluster.plan({"producer": 0, "consumer": cluster.devices_per_node - 1})
    producer = WorkerGroup.launch(Bench, cluster, plan, "producer", name="ProducerGroup")
    consumer = WorkerGroup.launch(Bench, cluster, plan, "consumer", name="ConsumerGroup")

    def both(produce, consume) -> list:
        calls = [produce, consume]
        return [c.wait() for c in calls][1][0]

    per_msg: dict[str, list[float]] = {}
    per_msg["memcpy (np.copyto, one process)"] = memcpy(make_batch(), n)
    ch = Channel.create("bench", maxsize=BOUND)
    stamps = both(producer.execute("produce_channel", ch, n),
                  consumer.execute("consume_channel", ch, n, False))
    per_msg["channel (shared-memory views)"] = intervals(stamps, warm)
    stamps = both(producer.execute("produce_channel", ch, n),
                  consumer.execute("consume_channel", ch, n, True))
    per_msg["channel + copy into reused buffer"] = intervals(stamps, warm)
    queue = RayQueue(maxsize=BOUND, actor_options={"num_cpus": 0})
    stamps = both(producer.execute("produce_ray", queue, n), consumer.execute("consume_ray", queue, n))
    per_msg["Ray object store + copy into reused buffer"] = intervals(stamps, warm)
    per_msg["multiprocessing.Queue (pickle)"] = run_mp(n, warm)

    latency: dict[str, list[float]] = {}
    pings = args.pings
    rtts = both(consumer.execute("pong_channel", ch, pings), producer.execute("ping_channel", ch, pings))
    latency["channel"] = rtts[warm:]
    ping_q, pong_q = (RayQueue(actor_options={"num_cpus": 0}) for _ in range(2))
    rtts = both(consumer.execute("pong_ray", ping_q, pong_q, pings // 4),
                producer.execute("ping_ray", ping_q, pong_q, pings // 4))
    latency["Ray queue"] = rtts[warm:]
    latency["multiprocessing.Queue"] = run_mp_latency(pings)[warm:]

    producer.shutdown()
    consumer.shutdown()
    ch.close()
    cluster.shutdown()
    cross = cross_node(args.cross_messages, warm // 2)

    gbps = {name: nbytes / statistics.median(t) / 1e9 for name, t in per_msg.items()}
    limit = gbps["memcpy (np.copyto, one process)"]
    print(f"bulk: {nbytes / 1e6:.1f} MB of arrays per message, {n - warm} timed messages, bound {BOUND}")
    print(f"{'path':<45} {'ms/msg':>8} {'GB/s':>7} {'x memcpy':>9}")
    for name, t in per_msg.items():
        print(f"{name:<45} {statistics.median(t) * 1e3:>8.3f} {gbps[name]:>7.2f} {gbps[name] / limit:>9.2f}")
    print(f"\n1 KB message, one way (half the median round trip):")
    half_ms = {name: statistics.median(t) / 2 * 1e3 for name, t in latency.items()}
    for name, ms in half_ms.items():
        print(f"{name:<45} {ms:>8.3f} ms")
    print(f"\nacross two Ray nodes (two raylets on this machine), {args.cross_messages - warm // 2} timed messages:")
    cross_gbps = {name: nbytes / statistics.median(t) / 1e9 for name, t in cross.items()}
    for name, t in cross.items():
        print(f"{name:<45} {statistics.median(t) * 1e3:>8.3f} {cross_gbps[name]:>7.2f}")
    channel = gbps["channel (shared-memory views)"]
    ray_gbps = gbps["Ray object store + copy into reused buffer"]
    figures = {
        "payload_mb": round(nbytes / 1e6, 2),
        "memcpy_gbps": round(limit, 2),
        "channel_gbps": round(channel, 2),
        "channel_copy_gbps": round(gbps["channel + copy into reused buffer"], 2),
        "ray_gbps": round(ray_gbps, 2),
        "mp_queue_gbps": round(gbps["multiprocessing.Queue (pickle)"], 2),
        "channel_vs_memcpy": round(channel / limit, 3),
        "channel_vs_ray": round(channel / ray_gbps, 2),
        "channel_copy_vs_ray": round(gbps["channel + copy into reused buffer"] / ray_gbps, 2),
        "small_msg_latency_ms": round(half_ms["channel"], 4),
        "ray_small_msg_latency_ms": round(half_ms["Ray queue"], 4),
        "mp_queue_small_msg_latency_ms": round(half_ms["multiprocessing.Queue"], 4),
        "cross_node_channel_gbps": round(cross_gbps[CROSS_CHANNEL], 3),
        "cross_node_ray_gbps": round(cross_gbps[CROSS_RAY], 3),
        "cross_node_channel_vs_ray": round(cross_gbps[CROSS_CHANNEL] / cross_gbps[CROSS_RAY], 2),
    }
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
