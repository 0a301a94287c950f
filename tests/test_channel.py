"""Channels between real processes (Ray actors, plain subprocesses): exactness, order, bounds,
shared-memory reuse, cleanup after kills, crashes and Ctrl-C, and the cross-node fallback."""

from __future__ import annotations

import mmap
import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import ray
import torch

from core.shm import SHM_DIR, creator_prefix
from embodied.channel import Channel
from embodied.cluster import Cluster

pytestmark = pytest.mark.timeout(120)
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def segments(prefix: str = "embch.") -> list[str]:
    return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(prefix))


def payload(step: int) -> dict:
    """A nested observation-like message with every kind of leaf, the same for a given step."""
    rng = np.random.default_rng(step)
    return {
        "step": step,
        "obs": {
            "main_images": rng.integers(0, 256, (4, 32, 32, 3), dtype=np.uint8),
            "states": rng.standard_normal((4, 9)).astype(np.float32),
            "task_descriptions": [f"pick cube {i}" for i in range(4)],
            "transposed": rng.standard_normal((3, 5)).T,  # not contiguous
            "empty": np.zeros((0, 7), np.int32),
            "scalar_array": np.float64(step) * np.ones(()),
            "names": np.array(["a", "bcd"]),
        },
        "actions": torch.from_numpy(rng.standard_normal((4, 8, 7))).to(torch.bfloat16),
        "logprobs": torch.arange(step, step + 6, dtype=torch.int64).view(2, 3),
        "dones": torch.tensor([True, False, step % 2 == 0]),
        "meta": ("text", 3.5, None, np.int16(step), [1, {"deep": np.arange(step + 1, dtype=np.uint16)}]),
    }


def assert_same(got, want, where="item") -> None:
    assert type(got) is type(want), f"{where}: {type(got)} != {type(want)}"
    if isinstance(want, dict):
        assert list(got) == list(want), where
        for k in want:
            assert_same(got[k], want[k], f"{where}[{k!r}]")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want)):
            assert_same(g, w, f"{where}[{i}]")
    elif isinstance(want, np.ndarray):
        assert (got.dtype, got.shape) == (want.dtype, want.shape), where
        assert got.tobytes() == want.tobytes(), where
    elif isinstance(want, torch.Tensor):
        assert (got.dtype, got.shape) == (want.dtype, want.shape), where
        assert got.contiguous().view(torch.uint8).numpy().tobytes() == \
            want.contiguous().view(torch.uint8).numpy().tobytes(), where
    else:
        assert got == want, where


@ray.remote(num_cpus=0)
class Peer:
    """A separate process that produces or consumes on a channel."""

    def put_steps(self, ch: Channel, key: str, steps: list[int], tag: str | None = None) -> int:
        for step in steps:
            item = payload(step) if tag is None else {"tag": tag, "step": step}
            ch.put(key, item)
        return len(steps)

    def put_forever(self, ch: Channel, key: str) -> None:
        step = 0
        while True:
            ch.put(key, payload(step))
            step += 1

    def get(self, ch: Channel, key: str, timeout: float | None = None):
        return ch.get(key, timeout=timeout)

    def pid(self) -> int:
        return os.getpid()


@pytest.fixture(scope="module")
def cluster():
    cluster = Cluster(num_nodes=1)
    yield cluster
    cluster.shutdown()
    assert segments(creator_prefix(os.getpid())) == []  # every channel of this module cleaned up


@pytest.fixture
def channel(cluster):
    made = []

    def create(maxsize=0, name="env_buffer_list"):
        ch = Channel.create(name, maxsize=maxsize)
        made.append(ch)
        return ch

    yield create
    for ch in made:
        ch.close()
        assert segments(ch._prefix) == []


@pytest.mark.slow
def test_nested_payloads_round_trip_bit_exact_and_in_order(channel):
    ch = channel()
    peer = Peer.remote()
    # worker process -> driver
    done = peer.put_steps.remote(ch, "obs_buffer/0", list(range(12)))
    for step in range(12):
        assert_same(ch.get("obs_buffer/0", timeout=30), payload(step), f"step {step}")
    assert ray.get(done) == 12
    # driver -> worker process (the worker's item comes back through Ray to be compared here)
    for step in range(5):
        ch.put("action_buffer/0", payload(100 + step))
    for step in range(5):
        assert_same(ray.get(peer.get.remote(ch, "action_buffer/0", 30)), payload(100 + step))
    assert ch.qsize("obs_buffer/0") == ch.qsize("action_buffer/0") == 0


def test_arrays_arrive_as_views_of_reused_shared_memory(channel):
    ch = channel(maxsize=2)
    peer = Peer.remote()
    done = peer.put_steps.remote(ch, "obs_buffer/0", list(range(40)))
    slot_sets = []
    for step in range(40):
        item = ch.get("obs_buffer/0", timeout=30)
        images = item["obs"]["main_images"]
        assert isinstance(images.base.base.obj, mmap.mmap)  # no copy: a view of the segment
        segment = images.base  # the whole slot; tensors are views of it too
        assert 0 <= item["logprobs"].data_ptr() - segment.ctypes.data < segment.nbytes
        assert int(images[0, 0, 0, 0]) == int(payload(step)["obs"]["main_images"][0, 0, 0, 0])
        del item, images, segment
        slot_sets.append(set(segments(ch._prefix)))
    ray.get(done)
    # 40 messages through a handful of segments: the producer reuses the slots the consumer gave
    # back (when the pool peaks depends on scheduling, so the bound is on all slots ever made).
    made = set().union(*slot_sets)
    slots = [n for n in made if n[len(ch._prefix):].startswith("s")]
    assert 1 <= len(slots) <= 4  # queue bound 2 + one being written + one held here


@pytest.mark.slow
def test_many_producers_keep_their_order(channel):
    ch = channel(maxsize=3)
    peers = [Peer.remote() for _ in range(3)]
    done = [p.put_steps.remote(ch, "replay_buffer", list(range(40)), tag=f"p{i}")
            for i, p in enumerate(peers)]
    seen = {f"p{i}": [] for i in range(3)}
    for _ in range(120):
        item = ch.get("replay_buffer", timeout=30)
        seen[item["tag"]].append(item["step"])
    assert ray.get(done) == [40, 40, 40]
    assert all(steps == list(range(40)) for steps in seen.values())


@pytest.mark.slow
def test_bounded_queue_blocks_producer_until_a_get(channel):
    ch = channel(maxsize=2)
    peer = Peer.remote()
    done = peer.put_steps.remote(ch, "obs_buffer/0", [0, 1, 2])
    deadline = time.monotonic() + 120  # an actor starts in seconds under load
    while ch.qsize("obs_buffer/0") < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    ready, _ = ray.wait([done], timeout=1.0)
    assert not ready and ch.qsize("obs_buffer/0") == 2  # the third put is waiting
    with pytest.raises(TimeoutError, match=r"'obs_buffer/0' stayed full \(2 items\) for 0.2s"):
        ch.put("obs_buffer/0", {"x": np.zeros(3)}, timeout=0.2)
    assert ch.get("obs_buffer/0")["step"] == 0
    assert ray.get(done, timeout=60) == 3  # unblocked by the get
    assert [ch.get("obs_buffer/0")["step"] for _ in range(2)] == [1, 2]


def test_get_waits_for_a_put_and_times_out(channel):
    ch = channel()
    with pytest.raises(TimeoutError, match="nothing arrived on 'action_buffer/1' within 0.2s"):
        ch.get("action_buffer/1", timeout=0.2)
    peer = Peer.remote()
    ray.get(peer.pid.remote(), timeout=120)  # started (under load an actor's start takes seconds)
    pending = peer.get.remote(ch, "action_buffer/1")
    ready, _ = ray.wait([pending], timeout=1.0)
    assert not ready  # waiting on the empty queue
    ch.put("action_buffer/1", {"actions": np.full((2, 7), 0.5, np.float32)})
    got = ray.get(pending, timeout=60)
    assert got["actions"].tolist() == [[0.5] * 7] * 2


def test_unbounded_and_per_queue_bounds(channel):
    ch = channel(maxsize={"obs_buffer": 1, "action_buffer": 0})
    for i in range(500):
        ch.put("action_buffer/0", {"i": i, "a": np.full(4, i)}, timeout=0)  # never waits
    assert ch.qsize("action_buffer/0") == 500
    ch.put("obs_buffer/0", {"i": 0})
    with pytest.raises(TimeoutError):
        ch.put("obs_buffer/0", {"i": 1}, timeout=0.1)
    assert [ch.get("action_buffer/0")["a"][0] for _ in range(500)] == list(range(500))
    with pytest.raises(KeyError, match="queue 'replay_buffer', which has no queue_size; the channel's queues are"):
        ch.put("replay_buffer/0", {"i": 0})
    with pytest.raises(ValueError, match=r"obs_buffer.queue_size=-1; expected an integer >= 0"):
        Channel.create("bad", maxsize={"obs_buffer": -1})


def test_killed_producer_leaves_nothing_in_dev_shm(channel):
    ch = channel(maxsize=2)
    peer = Peer.remote()
    peer.put_forever.remote(ch, "obs_buffer/0")
    deadline = time.monotonic() + 120  # an actor starts in seconds under load
    while ch.qsize("obs_buffer/0") < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    ray.kill(peer)  # killed while waiting on the full queue
    time.sleep(0.5)
    for step in range(2):  # what it sent is intact
        assert_same(ch.get("obs_buffer/0", timeout=5), payload(step))
    assert segments(ch._prefix)  # the dead producer's slots are still there...
    ch.close()
    assert segments(ch._prefix) == []  # ...until the channel closes


CHILD = textwrap.dedent("""
    import multiprocessing as mp, os, sys, time
    import numpy as np
    from embodied.channel import Channel

    def produce(ch):
        ch.put("obs_buffer/0", {"img": np.ones((64, 64, 3), np.uint8)})

    if __name__ == "__main__":
        # Ctrl-C raises KeyboardInterrupt even when this test runs in a background job (which
        # starts its children with SIGINT ignored)
        import signal; signal.signal(signal.SIGINT, signal.default_int_handler)
        ch = Channel.create("env_buffer_list", maxsize=0)
        p = mp.get_context("spawn").Process(target=produce, args=(ch,))
        p.start(); p.join()
        assert ch.get("obs_buffer/0", timeout=30)["img"].sum() == 64 * 64 * 3
        ch.put("obs_buffer/0", {"img": np.zeros(10)})
        print("READY", flush=True)
        mode = sys.argv[1]
        if mode == "crash":
            sys.stdin.readline()
            raise RuntimeError("driver crashed")
        ch.get("action_buffer/0")  # blocks until killed or interrupted
""")


@pytest.mark.parametrize("mode", ["crash", "ctrl-c", "sigterm", "sigkill"])
def test_driver_crash_ctrl_c_and_kill_leave_nothing_behind(cluster, mode, tmp_path):
    """A driver without Ray whose producer is a spawned process: the creator cleans up."""
    script = tmp_path / "driver.py"
    script.write_text(CHILD)
    proc = subprocess.Popen([sys.executable, str(script), mode], cwd=REPO, text=True,
                            env={**os.environ, "PYTHONPATH": REPO}, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout.readline().strip() == "READY"
    prefix = creator_prefix(proc.pid)
    assert len(segments(prefix)) >= 2  # a queue and the producer's slots
    time.sleep(0.3)  # the driver is now waiting in get() (or on stdin)
    signals = {"ctrl-c": signal.SIGINT, "sigterm": signal.SIGTERM, "sigkill": signal.SIGKILL}
    if mode in signals:
        proc.send_signal(signals[mode])
    _, err = proc.communicate("go\n", timeout=30)
    if mode == "crash":
        assert "RuntimeError: driver crashed" in err
    if mode == "ctrl-c":
        assert "KeyboardInterrupt" in err
    if mode == "sigterm":
        assert proc.returncode == 128 + signal.SIGTERM
    if mode == "sigkill":
        assert segments(prefix)  # nothing could run in the killed driver...
        Channel.create("next_run").close()  # ...so the next channel made on this node sweeps
    assert segments(prefix) == []


MULTI_NODE = textwrap.dedent("""
    import time
    import numpy as np, ray
    from ray.cluster_utils import Cluster as LocalNodes
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
    from embodied.channel import Channel

    nodes = LocalNodes(initialize_head=True, head_node_args={"num_cpus": 1})
    nodes.add_node(num_cpus=1)
    ray.init(address=nodes.address)
    nodes.wait_for_nodes()
    here = ray.get_runtime_context().get_node_id()
    other = [n["NodeID"] for n in ray.nodes() if n["Alive"] and n["NodeID"] != here][0]

    @ray.remote(num_cpus=0)
    def produce(ch, key, n):
        for i in range(n):
            ch.put(key, {"i": i, "img": np.full((8, 16, 16, 3), i, np.uint8), "s": ["x"] * i})
        return ray.get_runtime_context().get_node_id()

    @ray.remote(num_cpus=0)
    def consume(ch, key, n):
        return [ch.get(key, timeout=60) for _ in range(n)]

    @ray.remote(num_cpus=0)
    def touch(ch, key):
        return ch.qsize(key)

    ch = Channel.create("env_buffer_list", maxsize=2)
    on_other = dict(scheduling_strategy=NodeAffinitySchedulingStrategy(other, soft=False))
    # key 'a' lives on the other node (a process there touches it first); this node reads it remotely
    assert ray.get(touch.options(**on_other).remote(ch, "a")) == 0
    done = produce.options(**on_other).remote(ch, "a", 6)
    deadline = time.monotonic() + 60
    while ch.qsize("a") < 2 and time.monotonic() < deadline:  # counted on the key's node
        time.sleep(0.05)
    assert ch.qsize("a") == 2  # the bound: the producer waits with its third item
    items = [ch.get("a", timeout=60) for _ in range(6)]
    assert ray.get(done) == other
    # key 'b' lives here; a consumer on the other node reads it remotely
    ch.put("b", {"i": -1, "img": np.zeros((2, 2), np.float32), "s": []})
    remote = consume.options(**on_other).remote(ch, "b", 4)
    for i in range(3):
        ch.put("b", {"i": i, "img": np.full((2, 2), i, np.float32), "s": ["y"]})
    items_b = ray.get(remote)
    assert [x["i"] for x in items] == list(range(6)), items
    assert all((x["img"] == x["i"]).all() and x["img"].dtype == np.uint8 and x["s"] == ["x"] * x["i"] for x in items)
    assert [x["i"] for x in items_b] == [-1, 0, 1, 2]
    assert all((x["img"] == max(x["i"], 0)).all() for x in items_b)
    assert ray.get(ch._homes.claim.remote("a", "?")) == other
    assert ray.get(ch._homes.claim.remote("b", "?")) == here
    ch.close()
    ray.shutdown()
    nodes.shutdown()
    print("CROSS-NODE OK")
""")


@pytest.mark.slow
def test_cross_node_keys_fall_back_to_the_object_store(tmp_path):
    """Two Ray nodes on this machine (ray.cluster_utils): a key's home is the node that touched it
    first, and processes on the other node reach it through Ray's object store (and count what
    waits in it)."""
    out = subprocess.run([sys.executable, "-c", MULTI_NODE], cwd=REPO, capture_output=True,
                         text=True, timeout=110)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "CROSS-NODE OK" in out.stdout


MALLOC_CHECKS = {  # how each checker is preloaded into every process of the stress, and what it says
    "glibc": ({"LD_PRELOAD": "/lib/x86_64-linux-gnu/libc_malloc_debug.so.0", "MALLOC_CHECK_": "3",
               "MALLOC_PERTURB_": "165"}, "free(): "),
    "asan": ({"LD_PRELOAD": "/usr/lib/x86_64-linux-gnu/libasan.so.8",
              "ASAN_OPTIONS": "detect_leaks=0:alloc_dealloc_mismatch=0"}, "attempting double-free"),
}
DOUBLE_FREE = "import ctypes; libc = ctypes.CDLL(None); libc.malloc.restype = ctypes.c_void_p; " \
              "libc.free.argtypes = [ctypes.c_void_p]; " \
              "p = libc.malloc(64); libc.free(p); libc.free(p)"


@pytest.mark.slow
@pytest.mark.parametrize("checker", sorted(MALLOC_CHECKS))
def test_channel_stress_is_clean_under_malloc_checks(checker):
    """Producer processes and consumer threads hammer the channel (slots reused while other views
    are held, views read by other threads, messages of changing sizes) under glibc's malloc checks
    or AddressSanitizer in every process: every byte arrives as sent and no heap error is raised.
    The same preload does catch a double free (so a clean stress run means something)."""
    env, says = MALLOC_CHECKS[checker]
    if not os.path.exists(env["LD_PRELOAD"]):
        pytest.skip(f"{env['LD_PRELOAD']} is not installed")
    env = {**os.environ, **env}
    bad = subprocess.run([sys.executable, "-c", DOUBLE_FREE], env=env, capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0 and says in bad.stderr, bad.stderr[-2000:]
    script = os.path.join(os.path.dirname(__file__), "channel_stress.py")
    done = subprocess.run([sys.executable, script, "8"], env=env, capture_output=True, text=True, timeout=300,
                          cwd=os.path.dirname(os.path.dirname(script)))
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("ok ") and int(done.stdout.split()[1]) >= 800
    assert "ERROR: AddressSanitizer" not in done.stderr and "free(): " not in done.stderr
