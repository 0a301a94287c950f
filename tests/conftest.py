"""Suite-wide checks and shared fixtures.

No test may leave the project's shared-memory segments behind in /dev/shm.

The project names every segment it makes ``embch.<host>.<creator pid>.*`` (channels, env
observation blocks). One counts as left behind when it appeared during the test and, a few
seconds after the test, no live process maps or holds it open (other programs' segments, and
those of other sessions running beside the suite that are still in use, do not count).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

SHM = "/dev/shm"
PREFIX = "embch."  # embodied.channel.PREFIX
SETTLE_S = 10.0  # killed workers' processes may take this long to exit and be swept


def _segments() -> set[str]:
    try:
        return {name for name in os.listdir(SHM) if name.startswith(PREFIX)}
    except FileNotFoundError:
        return set()


def _in_use() -> set[str]:
    """Names of /dev/shm files that some live process maps or has open."""
    used = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/maps") as maps:
                for line in maps:
                    at = line.find(SHM + "/")
                    if at >= 0:
                        used.add(line[at + len(SHM) + 1:].split()[0])
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith(SHM + "/"):
                    used.add(target[len(SHM) + 1:].split()[0])
        except OSError:  # the process exited meanwhile, or is not ours to read
            continue
    return used


def leaked_segments(before: set[str], settle: float = SETTLE_S) -> list[str]:
    """Segments made since ``before`` that nobody uses, after waiting up to ``settle`` seconds."""
    deadline = time.monotonic() + settle
    while True:
        new = _segments() - before
        left = sorted(new - _in_use()) if new else []
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)


DURATIONS = Path(__file__).with_name("durations.json")  # seconds per module, measured in a full-tier run


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--store-durations", action="store_true",
                     help=f"write each module's total test time to {DURATIONS.name} (the full tier's order)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The longest modules first, by the seconds ``--store-durations`` measured (modules with slow
    tests next, the rest last), each in its own order: the full tier runs in three processes, one
    module at a time each (scripts/test.sh: pytest-xdist's ``--dist loadfile``), and the short
    modules then fill the end instead of one long module running alone at it. A stale record only
    costs balance."""
    seconds = json.loads(DURATIONS.read_text()) if DURATIONS.is_file() else {}
    slow = {item.path for item in items if item.get_closest_marker("slow")}
    root = Path(str(config.rootpath))
    items.sort(key=lambda item: (-seconds.get(item.path.relative_to(root).as_posix(), 0), item.path not in slow))


def pytest_sessionfinish(session: pytest.Session) -> None:
    """``--store-durations``: the module sums of the reports pytest's terminal reporter kept (what
    ``--durations`` reads; with xdist, the controller holds every process's reports)."""
    if not session.config.getoption("--store-durations") or hasattr(session.config, "workerinput"):
        return
    seconds: dict[str, float] = {}
    for reports in session.config.pluginmanager.get_plugin("terminalreporter").stats.values():
        for report in reports:
            if isinstance(report, pytest.TestReport):
                path = report.nodeid.split("::")[0]
                seconds[path] = seconds.get(path, 0.0) + report.duration
    DURATIONS.write_text(json.dumps({k: round(v, 1) for k, v in sorted(seconds.items())}, indent=1) + "\n")


@pytest.fixture(autouse=True)
def no_shared_memory_left_behind():
    before = _segments()
    yield
    left = leaked_segments(before)
    if left:
        pytest.fail(f"the test left shared-memory segments in {SHM}: {left}", pytrace=False)


@pytest.fixture(scope="session")
def ray_session():
    """One local Ray cluster for the end-to-end runs made in this process (tests/runs.py
    ``embodied``); each run's ``Cluster`` joins it instead of starting its own. Yields its
    address, for runs in subprocesses that may join it too (``Run(..., ray_address=)``)."""
    from unittest import mock

    import ray

    # No log monitor: with log_to_driver off nothing reads what it forwards, and it rescans the
    # session's log folder (a file per worker the session ever ran) ten times a second: 160
    # CPU-seconds of a full suite run, measured per process
    with mock.patch("ray._private.node.Node.start_log_monitor"):
        ray.init(address="local", include_dashboard=False, log_to_driver=False)
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()


@pytest.fixture(scope="session")
def tiny_math(tmp_path_factory) -> dict[str, Path]:
    """The arithmetic prompt set and a warm-started tiny causal LM, made once per test session
    (about 15 s) for the math tests: ``{"data": folder with train.jsonl / test.jsonl, "model":
    HF checkpoint folder, "accuracy": its held-out greedy accuracy}``."""
    import torch

    from envs.arithmetic import held_out_accuracy, write_split
    from policies.tiny_lm import warm_start

    root = tmp_path_factory.mktemp("math")
    write_split(root / "data")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        warm_start(root / "model", root / "data")
        accuracy = held_out_accuracy(root / "model", root / "data")
    finally:
        torch.set_num_threads(threads)
    return {"data": root / "data", "model": root / "model", "accuracy": accuracy}


@pytest.fixture(scope="session")
def tiny_agent(tmp_path_factory) -> dict[str, Path]:
    """Arithmetic rows and a random tiny causal LM whose character tokenizer covers printable
    text (tool calls included) and whose positions cover agent_arithmetic_tools_tiny's context:
    ``{"data": folder with train.jsonl / test.jsonl, "model": HF checkpoint folder}``."""
    import json
    import string

    from policies.tiny_lm import build_model, train_tokenizer

    root = tmp_path_factory.mktemp("agent")
    tokenizer = train_tokenizer([string.printable])
    build_model(len(tokenizer), tokenizer.pad_token_id, tokenizer.eos_token_id, positions=256).save_pretrained(
        root / "model")
    tokenizer.save_pretrained(root / "model")
    (root / "data").mkdir()
    for name, first in (("train", 100), ("test", 500)):
        rows = [{"prompt": f"{a}*{a % 89 + 10}=", "answer": str(a * (a % 89 + 10))} for a in range(first, first + 32)]
        (root / "data" / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {"data": root / "data", "model": root / "model"}


def stand_in_assets(folder: Path) -> Path:
    """The asset folder layout LIBERO's suites need, without the meshes (not available here):
    enough for config checks, never for building a suite's scene."""
    from envs.libero import ASSET_FOLDERS

    for name in ASSET_FOLDERS:
        (folder / name).mkdir(parents=True, exist_ok=True)
    return folder
