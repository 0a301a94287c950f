"""The agent envs' tools: the Python sandbox contains what model-written code tries (each case
with the real bubblewrap), the calculator is arithmetic only, and a call that hangs, crashes or
is malformed fails its turn, is counted, and leaves the runner working."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from envs import sandbox
from envs.tools import ERROR, OK, TIMEOUT, ToolRunner, calculate, find_call, tools_named, truncate

QUICK = sandbox.Limits(wall_s=4, cpu_s=2)


def test_python_runs_and_prints():
    result = sandbox.run_python("import numpy\nprint(sum(range(10)), numpy.int64(3) * 7)", QUICK)
    assert (result.status, result.stdout) == (OK, "45 21\n")


def test_a_socket_gets_no_network():
    result = sandbox.run_python("import socket\nsocket.create_connection(('1.1.1.1', 53), timeout=2)", QUICK)
    assert result.status == ERROR and "Network is unreachable" in result.stderr


def test_writes_land_only_in_the_scratch_folder(tmp_path):
    target = tmp_path / "outside.txt"
    home = Path.home() / "sandbox-was-here"
    code = (f"open('inside.txt', 'w').write('ok')\nimport os\nprint(sorted(os.listdir('.')))\n"
            f"for path in ({str(target)!r}, {str(home)!r}, '/dev/shm/x', '/tmp/x'):\n"
            "    try:\n        open(path, 'w').write('x')\n        print('wrote', path)\n"
            "    except OSError as err:\n        print('refused', path, err.errno)\n")
    result = sandbox.run_python(code, QUICK)
    assert result.status == OK, result.stderr
    assert "inside.txt" in result.stdout.splitlines()[0]
    assert not target.exists() and not home.exists() and not os.path.exists("/dev/shm/x")
    # /tmp and /dev/shm inside are private tmpfs: a write there is gone with the sandbox
    assert f"refused {target}" in result.stdout and f"refused {home}" in result.stdout


def test_an_interpreter_under_tmp_runs_inside_though_tmp_is_private(monkeypatch):
    """A checkout in /tmp has its virtualenv there, under the sandbox's own empty /tmp: it is
    mounted back, its folders enterable by the sandbox's uid (a fresh clone in /tmp failed every
    Python tool call: ``setpriv: failed to execute .../.venv/bin/python``), and the code runs on
    this interpreter's own standard library (not another installation's: the base prefix)."""
    with tempfile.TemporaryDirectory(dir="/tmp") as root:
        venv = Path(root) / "checkout" / ".venv"
        subprocess.run([sys._base_executable, "-m", "venv", "--without-pip", str(venv)], check=True)
        monkeypatch.setattr(sys, "executable", str(venv / "bin" / "python"))
        monkeypatch.setattr(sys, "prefix", str(venv))
        result = sandbox.run_python("import sys\nprint(sys.prefix, sys.base_prefix)", QUICK)
    assert (result.status, result.stdout) == (OK, f"{venv.resolve()} {Path(sys.base_prefix).resolve()}\n"), result.stderr


def test_a_fork_bomb_hits_the_process_limit_and_leaves_nothing_running(own_sandboxes):
    result = sandbox.run_python("import os\nwhile True:\n    os.fork()", QUICK)
    assert result.status == ERROR and "Resource temporarily unavailable" in result.stderr
    assert _no_sandbox_processes_left(own_sandboxes)


def test_ten_gigabytes_are_refused():
    result = sandbox.run_python("x = bytearray(10 * 2**30)", QUICK)
    assert result.status == ERROR and "MemoryError" in result.stderr


def test_a_busy_loop_is_stopped_by_its_cpu_time_and_a_sleeper_by_the_deadline(own_sandboxes):
    tic = time.monotonic()
    busy = sandbox.run_python("while True:\n    pass", sandbox.Limits(wall_s=30, cpu_s=1))
    assert busy.status == TIMEOUT and time.monotonic() - tic < 20  # the CPU limit, not the deadline
    tic = time.monotonic()
    sleeper = sandbox.run_python("import time\ntime.sleep(60)", sandbox.Limits(wall_s=1, cpu_s=5))
    assert sleeper.status == TIMEOUT and time.monotonic() - tic < 4
    assert _no_sandbox_processes_left(own_sandboxes)


def test_endless_output_stops_at_the_file_size_limit():
    result = sandbox.run_python("while True:\n    print('x' * 1000)", sandbox.Limits(wall_s=5, file_mb=1))
    assert result.status == ERROR and len(result.stdout) <= 1 << 20


@pytest.fixture
def own_sandboxes(tmp_path, monkeypatch) -> Path:
    """The folder this test's sandboxes are made in (their scratch folders' parent), so that
    sandboxes of tests running beside it in other processes are not counted as its own."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return tmp_path


def _no_sandbox_processes_left(root: Path, settle_s: float = 3.0) -> bool:
    """No process of a sandbox made under ``root`` runs within ``settle_s`` (the kernel ends a
    pid namespace's processes after its first one, not at once). A sandbox's processes are those
    running ``main.py`` whose command line (bwrap outside) or mounts (inside) name ``root``."""
    deadline = time.monotonic() + settle_s
    mark = str(root).encode()
    while True:
        running = 0
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
                running += b"main.py" in cmdline.split(b"\0") and (
                    mark in cmdline or mark in Path(f"/proc/{pid}/mountinfo").read_bytes())
            except OSError:
                continue
        if not running or time.monotonic() > deadline:
            return not running
        time.sleep(0.1)


def test_calculator_is_arithmetic_only():
    assert calculate("(12 + 30) * 2 - 7 // 2").text == "81"
    assert calculate("7 / 2").text == "3.5"
    for bad in ("__import__('os').system('true')", "9 ** 9 ** 9", "1 / 0", "2 +"):
        assert calculate(bad).status == ERROR, bad


def test_tool_calls_in_both_forms_and_malformed_ones():
    tools = tools_named(["python", "calculator"], "key")
    assert find_call("so <calculator>3 * 7</calculator>", tools).argument == "3 * 7"
    call = find_call('<tool_call>{"name": "python", "arguments": {"code": "print(1)"}}</tool_call>', tools)
    assert (call.name, call.argument) == ("python", "print(1)")
    assert find_call("the answer is 4", tools) is None
    for malformed, why in (("<tool_call>{name: python}</tool_call>", "malformed"),
                           ('<tool_call>{"name": "shell", "arguments": {}}</tool_call>', "unknown tool"),
                           ('<tool_call>{"name": "python", "arguments": {"src": "1"}}</tool_call>', "needs")):
        out = find_call(malformed, tools)
        assert out.status == ERROR and why in out.text


def test_truncation_keeps_the_side_the_config_names():
    text = "".join(str(i % 10) for i in range(100))
    assert truncate(text, 10, "left") == ("0123456789...(truncated)", True)
    assert truncate(text, 10, "right") == ("(truncated)...0123456789", True)
    assert truncate(text, 10, "middle") == ("01234...(truncated)...56789", True)
    assert truncate("short", 10, "left") == ("short", False)


def test_the_runner_counts_calls_timeouts_errors_and_truncations():
    # 3 s: a 1 s limit was once overrun by a print under the full suite's load
    runner = ToolRunner(tools_named(["python", "calculator"], "key"), timeout_s=3, max_output=40, side="left")
    assert runner("<calculator>6 * 7</calculator>").text == "42"
    assert runner("<python>print('y' * 100)</python>").truncated
    assert runner("<python>import time\ntime.sleep(30)</python>").status == TIMEOUT
    assert runner("<python>raise SystemExit(3)</python>").status == ERROR
    assert runner("<tool_call>not json</tool_call>").status == ERROR
    assert runner("no call here") is None
    metrics = runner.pop_metrics()
    seconds = metrics.pop("tool_s")
    assert metrics == {"tool_calls": 5.0, "tool_timeouts": 1.0, "tool_errors": 2.0,
                       "tool_truncated": 2.0}  # the long print and the malformed call's message
    assert 1.0 <= seconds < 10.0  # the sleeper ran to its 1 s deadline
    assert runner.pop_metrics() == dict.fromkeys(["tool_calls", "tool_timeouts", "tool_errors", "tool_truncated",
                                                  "tool_s"], 0.0)


def test_an_unknown_tool_or_side_is_a_config_error():
    from core.errors import ConfigError

    with pytest.raises(ConfigError, match="unknown tool"):
        tools_named(["shell"], "env.train.init_params.tools")
    with pytest.raises(ConfigError, match="tool_response_truncate_side"):
        ToolRunner({}, 1, 10, "top")
