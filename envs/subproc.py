"""A batch of single-scene simulators (a ``BatchedSim`` for ``VectorEnv``) in subprocesses.

CPU simulators such as ManiSkill's CPU backend or LIBERO's MuJoCo simulate one scene per env
instance; on a multi-core machine envs step in parallel only in separate processes, and more
processes than cores only add switching and memory (about 0.5 GB per ManiSkill process). So each
child holds a contiguous block of envs (by default one process per core). ``single_env_batch``
picks the form: a lone env steps in the calling process instead (``InProcessEnv``; a subprocess
would only add a pipe round trip and two process wake-ups per chunk, about 7-9 % of a 5-step
chunk of state-only PushCube here).

Each child builds its envs from picklable factories and writes their observations into one
shared-memory block that the parent preallocates for the whole batch (arrays are never pickled);
the pipe carries only commands, actions and per-step scalars, one round trip per chunk, not per
step. While a video records (``step_frames``), the images of every step follow the scalars as raw
bytes (``STEP_FRAMES``: the video's frames, not the policy's observation). Children start from a
forkserver, so the simulator's imports (``preload``) are paid once per parent process rather than
once per env. ``close()`` (also on errors, on garbage collection
and at exit) stops every child and unlinks the shared memory; a child whose parent dies sees its
pipe close and exits.
"""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import pickle
import secrets
import signal
import sys
import traceback
import weakref
from multiprocessing import shared_memory
from typing import Any, Callable, Protocol, Sequence

import numpy as np

from core.errors import EnvSetupError, ProcessDied
from core.shm import creator_prefix
from envs.protocol import STEP_FRAMES, video_keys

ObsSpec = dict[str, tuple[tuple[int, ...], np.dtype]]


class SingleEnv(Protocol):
    """One scene, as a process holds it."""

    obs_spec: ObsSpec  # observation key -> (shape without batch, dtype)
    action_dim: int
    num_reset_states: int | None
    task_description: str  # the task of the current episode (may change at a reset)

    def reset(self, state_id: int) -> None: ...

    def step(self, action: np.ndarray, observe: bool = True) -> tuple[float, bool, bool]:
        """Returns reward, terminated and success. ``observe``: ``observation()`` is read after
        this step (the chunk's last, or every step while a video records): a simulator that
        renders during its step (LIBERO) skips the cameras otherwise."""

    def observation(self) -> dict[str, np.ndarray]:
        """The current observation (read once per chunk; after every step only for videos)."""

    def close(self) -> None: ...


def _layout(spec: ObsSpec, num_envs: int) -> tuple[dict[str, tuple[int, tuple, np.dtype]], int]:
    """Byte offset, batched shape and dtype of every observation key in the shared block."""
    offsets, size = {}, 0
    for key, (shape, dtype) in spec.items():
        dtype = np.dtype(dtype)
        shape = (num_envs, *shape)
        offsets[key] = (size, shape, dtype)
        size += -(-int(np.prod(shape)) * dtype.itemsize // 64) * 64
    return offsets, max(size, 64)


def _views(buf: Any, layout: dict[str, tuple[int, tuple, np.dtype]]) -> dict[str, np.ndarray]:
    return {k: np.ndarray(shape, dtype, buffer=buf, offset=off)
            for k, (off, shape, dtype) in layout.items()}


# Steps and resets travel as raw bytes, a one-byte tag then the payload: pickling even a small
# array costs more than the round trip through the pipe. Only the one-off handshake (env
# description one way, shared block layout the other) and errors are pickled.
RESET, CHUNK, CLOSE, OK, ERROR = b"r", b"c", b"q", b"o", b"e"


def _frames_dtype(spec: ObsSpec) -> np.dtype:
    """One step's video images of one env, as a record (how ``STEP_FRAMES`` cross the pipe)."""
    return np.dtype([(k, np.dtype(spec[k][1]), spec[k][0]) for k in video_keys(spec)])


def _step_all(envs: Sequence[SingleEnv], actions: np.ndarray, frames: bool) -> bytes:
    """Every env's chunk of ``actions``: per step reward, terminated and success (float64), then,
    with ``frames``, each step's video images (``_frames_dtype`` records, env-major)."""
    results, shots = [], []
    dtype = _frames_dtype(envs[0].obs_spec) if frames else None
    for env, chunk in zip(envs, actions):
        for t, action in enumerate(chunk):
            results.append(env.step(action, observe=frames or t == len(chunk) - 1))
            if dtype is not None:
                obs = env.observation()
                shots.append(np.array(tuple(obs[k] for k in dtype.names), dtype).tobytes())
    return np.array(results, np.float64).tobytes() + b"".join(shots)


def _parse(reply: bytes, envs: int, chunk: int, frames: np.dtype | None) -> tuple[np.ndarray, np.ndarray | None]:
    """A ``_step_all`` reply: ``[envs, chunk, (reward, terminated, success)]`` and, with
    ``frames``, the frame records ``[envs, chunk]``."""
    count = envs * chunk
    scalars = np.frombuffer(reply, np.float64, count * 3).reshape(envs, chunk, 3)
    shots = None if frames is None else np.frombuffer(reply, frames, count, count * 3 * 8).reshape(envs, chunk)
    return scalars, shots


def _child(first: int, env_fns: Sequence[Callable[[], SingleEnv]], conn: Any, frames: bool) -> None:
    """A child's whole life: build its block of envs (global indices ``first`` onwards), attach
    to the shared block, serve commands for all of them."""
    shm = None
    gc.freeze()  # what the forkserver imported is never garbage: ManiSkill's gc.collect() per scene skips it
    try:
        envs = [fn() for fn in env_fns]
        if "torch" in sys.modules:
            # a process keeps one core busy; torch's default of a thread per core makes the
            # batch's processes spin against each other (two then step no faster than one,
            # measured with ManiSkill)
            sys.modules["torch"].set_num_threads(1)
        conn.send_bytes(OK + pickle.dumps([(e.obs_spec, e.action_dim, e.num_reset_states,
                                            e.task_description) for e in envs]))
        name, layout = conn.recv()
        shm = shared_memory.SharedMemory(name=name)
        views = _views(shm.buf, layout)
        rows = [{k: v[first + j] for k, v in views.items()} for j in range(len(envs))]
        while True:
            msg = conn.recv_bytes()
            tag, payload = msg[:1], msg[1:]
            if tag == CLOSE:
                break
            if tag == RESET:  # pairs of (index in the block, state id)
                touched = []
                for j, state in np.frombuffer(payload, np.int64).reshape(-1, 2):
                    envs[j].reset(int(state))
                    touched.append(int(j))
                # a reset may start another task (LIBERO): its description goes back
                reply = "\0".join(envs[j].task_description for j in touched).encode()
            else:  # CHUNK: actions [block, C, A] float32
                actions = np.frombuffer(payload, np.float32).reshape(len(envs), -1, envs[0].action_dim)
                reply = _step_all(envs, actions, frames)
                touched = range(len(envs))
            for j in touched:
                obs = envs[j].observation()
                for key, row in rows[j].items():
                    row[...] = obs[key]
            conn.send_bytes(OK + reply)
    except (EOFError, KeyboardInterrupt, BrokenPipeError):
        pass  # the parent is gone or stopping us
    except BaseException as exc:
        try:
            user_error = exc if isinstance(exc, EnvSetupError) else None
            conn.send_bytes(ERROR + pickle.dumps((user_error, traceback.format_exc())))
        except (OSError, ValueError):
            pass
    finally:
        rows = views = None
        if shm is not None:
            try:
                shm.close()
            except BufferError:
                pass
        # the envs are not closed: the process ends here (multiprocessing's os._exit, no teardown),
        # and their memory and render contexts go with it; ManiSkill's close collects garbage once
        # per env, 3.4 s for a block of 16 on this CPU
        conn.close()


class _Resources:
    """Everything that must not outlive the vector env; ``release`` is safe to call twice."""

    def __init__(self) -> None:
        self.procs: list[Any] = []
        self.conns: list[Any] = []
        self.shm: shared_memory.SharedMemory | None = None

    def release(self) -> None:
        for conn in self.conns:
            try:
                conn.send_bytes(CLOSE)
            except (OSError, ValueError):
                pass
        for proc in self.procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        for conn in self.conns:
            conn.close()
        self.procs, self.conns = [], []
        if self.shm is not None:
            shm, self.shm = self.shm, None
            shm.unlink()
            try:
                shm.close()
            except BufferError:
                pass  # a caller still holds a view; the memory goes when that view does


def _segment_name() -> str:
    return f"{creator_prefix(os.getpid())}env.{secrets.token_hex(6)}"


class SubprocVectorEnv:
    """``len(env_fns)`` single-scene envs in ``num_processes`` processes (contiguous blocks of
    envs; default one process per CPU core, at most one per env), stepped together; with
    ``step_frames`` chunk steps also return every step's video images (``STEP_FRAMES``)."""

    def __init__(self, env_fns: Sequence[Callable[[], SingleEnv]], preload: Sequence[str] = (),
                 num_processes: int | None = None, step_frames: bool = False):
        if not env_fns:
            raise ValueError("SubprocVectorEnv needs at least one env factory")
        self.num_envs = len(env_fns)
        procs = min(self.num_envs, num_processes or os.cpu_count() or 1)
        self._blocks = np.array_split(np.arange(self.num_envs), procs)
        self._res = _Resources()
        self._finalizer = weakref.finalize(self, self._res.release)
        self._obs: dict[str, np.ndarray] | None = None
        try:
            ctx = mp.get_context("forkserver")
            ctx.set_forkserver_preload(["envs.subproc", *preload])
            for i, block in enumerate(self._blocks):
                parent, child = ctx.Pipe()
                fns = [env_fns[j] for j in block]
                proc = ctx.Process(target=_child, args=(int(block[0]), fns, child, step_frames),
                                   daemon=True, name=f"envs-{block[0]}-{block[-1]}")
                proc.start()
                child.close()
                self._res.procs.append(proc)
                self._res.conns.append(parent)
            specs = [spec for i in range(procs) for spec in pickle.loads(self._recv(i))]
            obs_spec, self.action_dim, self.num_reset_states, _ = specs[0]
            for i, spec in enumerate(specs[1:], 1):
                if spec[:3] != specs[0][:3]:
                    raise ValueError(f"env {i} differs from env 0 in observations, action size or "
                                     f"reset states: {spec[:3]} vs {specs[0][:3]}")
            self.task_descriptions = [s[3] for s in specs]
            self._frames = _frames_dtype(obs_spec) if step_frames else None
            layout, size = _layout(obs_spec, self.num_envs)
            # named like the channels' segments, so that the shared memory of a process killed
            # before it could close this is swept once that process is gone
            self._res.shm = shared_memory.SharedMemory(create=True, size=size, name=_segment_name())
            self._obs = _views(self._res.shm.buf, layout)
            for conn in self._res.conns:
                conn.send((self._res.shm.name, layout))
        except BaseException:
            self.close()
            raise

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._res.procs]

    @property
    def shm_name(self) -> str | None:
        return self._res.shm.name if self._res.shm is not None else None

    def reset(self, env_ids: np.ndarray, state_ids: np.ndarray) -> dict[str, np.ndarray]:
        state = dict(zip(np.asarray(env_ids).tolist(), np.asarray(state_ids).tolist()))
        busy = []
        for i, block in enumerate(self._blocks):
            pairs = [(j, state[e]) for j, e in enumerate(block.tolist()) if e in state]
            if pairs:
                self._send(i, RESET + np.array(pairs, np.int64).tobytes())
                busy.append((i, [int(block[j]) for j, _ in pairs]))
        for i, envs in busy:
            for e, text in zip(envs, self._recv(i).decode().split("\0")):
                self.task_descriptions[e] = text
        return self._copy_obs()

    def step_chunk(self, actions: np.ndarray) -> tuple[dict[str, np.ndarray], np.ndarray,
                                                        np.ndarray, np.ndarray]:
        actions = np.ascontiguousarray(actions, np.float32)
        for i, block in enumerate(self._blocks):
            self._send(i, CHUNK + actions[block[0]:block[-1] + 1].tobytes())
        chunk = actions.shape[1]
        parsed = [_parse(self._recv(i), len(block), chunk, self._frames) for i, block in enumerate(self._blocks)]
        per_env = np.concatenate([scalars for scalars, _ in parsed])
        obs = self._copy_obs()
        if self._frames is not None:
            shots = np.concatenate([shots for _, shots in parsed])
            obs[STEP_FRAMES] = {k: shots[k] for k in self._frames.names}
        return obs, per_env[..., 0].astype(np.float32), per_env[..., 1] > 0, per_env[..., 2] > 0

    def close(self) -> None:
        self._obs = None  # drop the views into the shared block before it is closed
        self._finalizer()

    def _copy_obs(self) -> dict[str, np.ndarray]:
        return {k: v.copy() for k, v in self._obs.items()}

    def _send(self, i: int, msg: bytes) -> None:
        try:
            self._res.conns[i].send_bytes(msg)
        except OSError:  # a broken pipe: the process is gone
            self._died(i)

    def _recv(self, i: int) -> bytes:
        try:
            msg = self._res.conns[i].recv_bytes()
        except (EOFError, OSError):
            self._died(i)
        if msg[:1] == ERROR:
            user_error, tb = pickle.loads(msg[1:])
            if user_error is not None:
                raise user_error
            raise RuntimeError(f"env process {i} failed:\n{tb}")
        return msg[1:]

    def _died(self, i: int) -> None:
        proc = self._res.procs[i]
        proc.join(timeout=5)
        code = proc.exitcode
        killed = signal.Signals(-code).name if code is not None and code < 0 else None
        raise ProcessDied(f"env process {i} (pid {proc.pid}) died "
                          f"({f'of {killed}' if killed else f'exit code {code}'})", killed) from None


class InProcessEnv:
    """One ``SingleEnv`` stepped in this process, as a batch of one (``step_frames`` as in
    ``SubprocVectorEnv``)."""

    num_envs = 1

    def __init__(self, env_fn: Callable[[], SingleEnv], step_frames: bool = False):
        self.env = env_fn()
        self.action_dim = self.env.action_dim
        self.num_reset_states = self.env.num_reset_states
        self.task_descriptions = [self.env.task_description]
        self._frames = _frames_dtype(self.env.obs_spec) if step_frames else None

    def reset(self, env_ids: np.ndarray, state_ids: np.ndarray) -> dict[str, np.ndarray]:
        if len(env_ids):
            self.env.reset(int(state_ids[0]))
            self.task_descriptions = [self.env.task_description]
        return self._obs()

    def step_chunk(self, actions: np.ndarray) -> tuple[dict[str, np.ndarray], np.ndarray,
                                                        np.ndarray, np.ndarray]:
        reply = _step_all([self.env], actions, self._frames is not None)
        steps, shots = _parse(reply, 1, actions.shape[1], self._frames)
        obs = self._obs()
        if shots is not None:
            obs[STEP_FRAMES] = {k: shots[k] for k in self._frames.names}
        return obs, steps[..., 0].astype(np.float32), steps[..., 1] > 0, steps[..., 2] > 0

    def close(self) -> None:
        self.env.close()

    def _obs(self) -> dict[str, np.ndarray]:
        return {k: np.array(v)[None] for k, v in self.env.observation().items()}


def single_env_batch(env_fns: Sequence[Callable[[], SingleEnv]], preload: Sequence[str] = (),
                     num_processes: int | None = None, step_frames: bool = False) -> InProcessEnv | SubprocVectorEnv:
    """The ``BatchedSim`` for these single-scene envs: in this process when there is one, in
    subprocesses otherwise (see ``SubprocVectorEnv`` for ``num_processes`` and ``step_frames``)."""
    if len(env_fns) == 1:
        return InProcessEnv(env_fns[0], step_frames)
    return SubprocVectorEnv(env_fns, preload, num_processes, step_frames)
