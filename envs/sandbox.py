"""Run untrusted Python (a model's tool call) in a sandbox: its own process tree, no network, no
writes outside a scratch folder, CPU-time, memory, file-size and process-count limits, killed at
a wall-clock deadline.

Mechanism: bubblewrap (Debian's ``bubblewrap``, installed by ``scripts/setup.sh``) puts the code in
fresh user, network, pid, IPC and UTS namespaces with the root file system mounted read-only and
only the scratch folder writable (``/tmp`` and ``/dev/shm`` are private tmpfs, gone with the
sandbox); rlimits bound CPU time, address space, file size and processes. Chosen over seccomp
filters and bare rlimits because namespaces deny the network and the file system as a whole, not
call by call, and bwrap needs no daemon and no root. Run as root, bwrap mounts as root and
util-linux's ``setpriv`` drops the code to a uid of its own with no capabilities (so that the
process-count limit, which the kernel never applies to root, counts only this sandbox's
processes); run as another user, bwrap uses a user namespace and the limit counts that user's
processes already alive.
The deadline kills bwrap, whose pid namespace takes every process of the sandbox with it.
"""

from __future__ import annotations

import itertools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from core.errors import EnvSetupError

OK, ERROR, TIMEOUT = "ok", "error", "timeout"
OUT_OF_CPU = (128 + signal.SIGXCPU, 128 + signal.SIGKILL)  # bwrap's exit status when RLIMIT_CPU hit
INSIDE = "/tmp/scratch"  # where the code sees its scratch folder (its working directory)
PRIVATE = (Path("/tmp"), Path("/dev/shm"))  # empty tmpfs in each sandbox
_UIDS = itertools.count((os.getpid() % 4096) * 16)  # distinct sandbox uids per process


@dataclass(frozen=True)
class Limits:
    wall_s: float = 5.0
    cpu_s: int = 5
    memory_mb: int = 512
    processes: int = 16
    file_mb: int = 16  # any file written, stdout and stderr included


@dataclass(frozen=True)
class Result:
    status: str  # OK; ERROR (nonzero exit, a limit hit); TIMEOUT (past the deadline or the CPU time)
    stdout: str
    stderr: str
    returncode: int | None


def bwrap() -> str:
    path = shutil.which("bwrap")
    if path is None:
        raise EnvSetupError("the Python tool needs bubblewrap (bwrap) for its sandbox: run scripts/setup.sh "
                            "or `apt-get install bubblewrap`")
    return path


def run_python(code: str, limits: Limits = Limits()) -> Result:
    """Run ``code`` with ``python -I`` in a fresh sandbox; its scratch folder is deleted after."""
    root = Path(tempfile.mkdtemp(prefix="embodied-sandbox-"))
    scratch, out, err = root / "scratch", root / "stdout", root / "stderr"
    root.chmod(0o711)  # the sandbox's uid reaches its scratch folder, never the output files
    scratch.mkdir()
    (scratch / "main.py").write_text(code)
    python = [sys.executable, "-I", "main.py"]
    if os.geteuid() == 0:  # bwrap mounts as root; setpriv then drops to the sandbox's own uid
        uid = 100_000 + next(_UIDS) % 65_536
        for path in (scratch, scratch / "main.py"):
            os.chown(path, uid, uid)
        namespaces = ["--unshare-net", "--unshare-pid", "--unshare-ipc", "--unshare-uts"]
        python = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--no-new-privs",
                  "--inh-caps=-all", "--bounding-set=-all", *python]
        processes = limits.processes
    else:
        namespaces = ["--unshare-all"]
        processes = _processes_of(os.getuid()) + limits.processes
    mb = 1 << 20  # prlimit, not preexec_fn: the env workers calling this have threads
    rlimits = ["prlimit", f"--cpu={limits.cpu_s}", f"--as={limits.memory_mb * mb}", f"--fsize={limits.file_mb * mb}",
               f"--nproc={processes}", "--core=0"]
    command = [*rlimits, bwrap(), "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc",
               *(arg for private in PRIVATE for arg in ("--tmpfs", str(private))),
               *_interpreter_mounts(os.geteuid() == 0), "--bind", str(scratch), INSIDE, "--chdir", INSIDE,
               *namespaces, "--die-with-parent", "--new-session", "--clearenv",
               "--setenv", "HOME", INSIDE, "--setenv", "TMPDIR", INSIDE, "--setenv", "PATH", "/usr/bin:/bin", *python]

    try:
        with open(out, "wb") as stdout, open(err, "wb") as stderr:
            proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=stdout, stderr=stderr,
                                    start_new_session=True)
            try:
                returncode = proc.wait(timeout=limits.wall_s)
                status = OK if returncode == 0 else TIMEOUT if returncode in OUT_OF_CPU else ERROR
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                returncode, status = proc.wait(), TIMEOUT
        return Result(status, _read(out), _read(err), returncode)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _interpreter_mounts(other_uid: bool) -> list[str]:
    """Mounts that show the sandbox this interpreter, read-only: a prefix in the sandbox's private
    ``/tmp`` or ``/dev/shm`` (a checkout and its virtualenv in /tmp) and, for a sandbox uid other
    than ours, one behind a folder others cannot enter (root's home holding pyenv, then hidden under
    an empty tmpfs) are mounted back, the folders on their way made enterable (bwrap makes them
    0700, and Python then falls back to another installation's standard library or finds none)."""
    mounts: list[str] = []
    made: set[Path] = set()
    for prefix in sorted({Path(sys.base_prefix).resolve(), Path(sys.prefix).resolve()}):
        hidden = next((p for p in PRIVATE if prefix.is_relative_to(p)), None)
        if hidden is None and other_uid:
            closed = [p for p in reversed(prefix.parents) if not p.stat().st_mode & 0o001]
            hidden = closed[0] if closed else None
            if hidden is not None and hidden not in made:
                mounts += ["--tmpfs", str(hidden)]
                made.add(hidden)
        if hidden is None:
            continue
        for folder in reversed(prefix.parents):
            if folder.is_relative_to(hidden) and folder != hidden and folder not in made:
                mounts += ["--perms", "0755", "--dir", str(folder)]
                made.add(folder)
        mounts += ["--ro-bind", str(prefix), str(prefix)]
    return mounts


def _read(path: Path, limit: int = 1 << 20) -> str:
    with open(path, "rb") as f:
        return f.read(limit).decode("utf-8", errors="replace")


def _processes_of(uid: int) -> int:
    count = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            count += os.stat(f"/proc/{pid}").st_uid == uid
        except OSError:
            continue
    return count
