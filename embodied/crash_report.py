"""Crash reports: a worker process that dies of a signal leaves its backtraces in the run's log
folder, so that a crash can be reported from that folder alone.

Each worker writes to ``<log_path>/crashes/<group>_rank<r>_pid<pid>.txt``, empty while it lives.
On SIGSEGV, SIGABRT, SIGBUS, SIGFPE or SIGILL it appends gdb's native backtraces of all threads
(``crash_report.c``, built once per machine into ``~/.cache/embodied-rl``; skipped, and said so in
the file, without gdb or a C compiler) and then faulthandler's Python stacks of all threads. A
SIGKILL (``kill -9``, the OOM killer) leaves the file empty: nothing runs in a process killed so.
The driver reads the signal back (``signal_of``) and removes the empty files of workers that ended
normally (``remove_if_empty``).
"""

from __future__ import annotations

import ctypes
import faulthandler
import hashlib
import os
import re
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path

from core.cache import cache_dir

SOURCE = Path(__file__).with_suffix(".c")
FOLDER = "crashes"  # under runner.logger.log_path
_FATAL_PYTHON = re.compile(r"^Fatal Python error: (.+)$", re.M)
_NATIVE = re.compile(r"^=== .* signal (\d+): native backtraces", re.M)
# faulthandler's words for the signals it handles
_PYTHON_NAMES = {"Segmentation fault": signal.SIGSEGV, "Aborted": signal.SIGABRT, "Bus error": signal.SIGBUS,
                 "Floating-point exception": signal.SIGFPE, "Illegal instruction": signal.SIGILL}
_open_report = None  # the file faulthandler writes to: kept open for the life of the process
_native = None  # the loaded handler library: kept loaded for the life of the process


def report_path(folder: str | Path, group: str, rank: int, pid: int) -> Path:
    return Path(folder) / f"{group}_rank{rank}_pid{pid}.txt"


def enable(folder: str | Path, group: str, rank: int) -> Path:
    """Make this process write its crash report into ``folder``; returns the report's path."""
    global _open_report, _native
    path = report_path(folder, group, rank, os.getpid())
    path.parent.mkdir(parents=True, exist_ok=True)
    _open_report = open(path, "a")
    faulthandler.enable(file=_open_report, all_threads=True)
    gdb = shutil.which("gdb")
    library, why = (None, "gdb is not installed") if gdb is None else _build()
    if library is not None:
        _native = ctypes.CDLL(str(library))
        if _native.install(gdb.encode(), str(path).encode(), f"{group} rank {rank} pid {os.getpid()}".encode()):
            library, why = None, "a path is too long for the native handler"
    if library is None:  # said at once, so that a crash report without native stacks says why
        _open_report.write(f"(native backtraces unavailable: {why})\n")
        _open_report.flush()
    return path


def _build() -> tuple[Path | None, str]:
    """The handler library for this source, compiled on first use (atomically: workers starting
    at once may all compile it); None and the reason when no compiler works."""
    source = SOURCE.read_bytes()
    cache = cache_dir()
    library = cache / f"crash_report-{hashlib.sha256(source).hexdigest()[:16]}.so"
    if library.is_file():
        return library, ""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        return None, "no C compiler (cc) to build embodied/crash_report.c"
    try:
        cache.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=cache, suffix=".so")
        os.close(fd)
        done = subprocess.run([compiler, "-O2", "-shared", "-fPIC", "-o", tmp, str(SOURCE)],
                              capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            os.unlink(tmp)
            return None, f"{compiler} failed on {SOURCE}: {done.stderr.strip()[-300:]}"
        os.replace(tmp, library)
    except (OSError, subprocess.SubprocessError) as err:
        return None, f"cannot build {SOURCE} into {cache}: {err}"
    return library, ""


def signal_of(report: Path) -> str | None:
    """The fatal signal a report records (``SIGABRT``), or None when it holds no crash."""
    try:
        text = report.read_text(errors="replace")
    except OSError:
        return None
    if match := _NATIVE.search(text):
        return signal.Signals(int(match.group(1))).name
    if (match := _FATAL_PYTHON.search(text)) and match.group(1) in _PYTHON_NAMES:
        return _PYTHON_NAMES[match.group(1)].name
    return None


def remove_if_empty(report: Path) -> None:
    """Drop the report of a worker that ended without a crash (empty, or only the note that
    native stacks were unavailable), and the folder once nothing is left in it."""
    try:
        text = report.read_text(errors="replace")
        if not text.strip() or (text.startswith("(native backtraces unavailable") and text.count("\n") == 1):
            report.unlink()
        report.parent.rmdir()
    except OSError:  # gone already, or other reports remain
        pass
