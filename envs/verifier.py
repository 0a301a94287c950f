"""Scoring responses against reference answers with math-verify, safely inside env workers.

math-verify bounds its own parse/verify time with ``signal.alarm``, which only works on a
process's main thread: called from a worker thread it raises, and a broad ``except`` would
turn every answer into a silent 0. So scoring runs in a small pool of spawned processes, where
each task runs on the child's main thread with math-verify's own timeouts, and the caller waits
with a deadline of its own: the responses of a task that hangs or kills a child score 0, are
counted, and the pool is replaced. Nothing here depends on the caller's thread.

What counts as the answer: what math-verify extracts from the response (a ``\\boxed{}`` first,
else the last expression). One rule on top: the extracted answer may not use a binary operator
(``+ - * / ^``, ``\\cdot``, ``\\times``, ``\\div``, ``\\frac``) that the reference answer does
not use, because math-verify *evaluates* expressions: "12+35" would otherwise count as "47",
and a policy that copies the question's expression would be rewarded for it.
"""

from __future__ import annotations

import concurrent.futures as cf
import functools
import multiprocessing
import re
from dataclasses import dataclass

CORRECT, WRONG, UNPARSABLE, TIMEOUT = "correct", "wrong", "unparsable", "timeout"
CHUNK = 32  # pairs per task sent to a scoring process
# a binary operator: one that follows an operand (a digit, letter, closing bracket or brace)
_BINARY = re.compile(r"(?<=[\w)\]}])\s*(\+|-|\*|/|\^|\\cdot|\\times|\\div)|\\frac")


def unsimplified(extracted: str, reference: str) -> bool:
    """True when ``extracted`` uses a binary operator that ``reference`` does not."""
    ops = {m.group(0).strip() for m in _BINARY.finditer(extracted)}
    return bool(ops - {m.group(0).strip() for m in _BINARY.finditer(reference)})


@functools.lru_cache(maxsize=4096)
def _parse_reference(reference: str, timeout_s: int) -> list:
    """A group's responses share one reference: parsed once (parsing is most of the cost)."""
    from math_verify import parse

    return parse(reference, parsing_timeout=timeout_s)


def score_one(response: str, reference: str, timeout_s: int = 5) -> str:
    """One of ``correct``, ``wrong``, ``unparsable``: call on a main thread (math-verify's
    timeouts use ``signal.alarm``)."""
    from math_verify import parse, verify

    gold = _parse_reference(reference, timeout_s)
    pred = parse(response, parsing_timeout=timeout_s)
    if not pred:
        return UNPARSABLE
    if unsimplified(str(pred[-1]), reference):
        return WRONG
    return CORRECT if verify(gold, pred, timeout_seconds=timeout_s) else WRONG


def score_many(pairs: list[tuple[str, str]], timeout_s: int = 5) -> list[str]:
    return [score_one(response, reference, timeout_s) for response, reference in pairs]


def _warm_up() -> str:
    return score_one("1", "1")


@dataclass
class Verdicts:
    status: list[str]

    @property
    def correct(self) -> list[bool]:
        return [s == CORRECT for s in self.status]

    def count(self, status: str) -> int:
        return sum(s == status for s in self.status)


class Verifier:
    """``score(responses, references)`` through ``processes`` spawned children, each response
    given ``timeout_s`` (math-verify's own bound) and the batch ``deadline_s`` overall."""

    def __init__(self, processes: int = 1, timeout_s: int = 5, deadline_s: float = 30.0):
        self.processes, self.timeout_s, self.deadline_s = processes, timeout_s, deadline_s
        self._pool: cf.ProcessPoolExecutor | None = None

    def _start(self) -> cf.ProcessPoolExecutor:
        if self._pool is None:
            self._pool = cf.ProcessPoolExecutor(self.processes, mp_context=multiprocessing.get_context("spawn"))
            self._pool.submit(_warm_up).result()  # imports math-verify and sympy once, off the clock
        return self._pool

    def score(self, responses: list[str], references: list[str]) -> Verdicts:
        """Each distinct (response, reference) pair is scored once (math-verify is deterministic;
        a group's responses often repeat), in tasks of ``CHUNK`` pairs: one message per task, not
        per response. What a task has not returned by the deadline, or lost to a crash, is TIMEOUT."""
        pairs = list(dict.fromkeys(zip(responses, references)))
        chunks = [pairs[i:i + CHUNK] for i in range(0, len(pairs), CHUNK)]
        pool = self._start()
        futures = [pool.submit(score_many, chunk, self.timeout_s) for chunk in chunks]
        done, pending = cf.wait(futures, timeout=self.deadline_s)
        verdicts: dict[tuple[str, str], str] = {}
        for chunk, future in zip(chunks, futures):
            scored = future in done and future.exception() is None
            verdicts.update(zip(chunk, future.result() if scored else [TIMEOUT] * len(chunk)))
        if pending or any(f.exception() is not None for f in done):
            self._kill()  # a child that hung past the deadline, raised or died: a fresh pool next time
        return Verdicts([verdicts[pair] for pair in zip(responses, references)])

    def _kill(self) -> None:
        pool, self._pool = self._pool, None
        if pool is None:
            return
        for process in list(getattr(pool, "_processes", {}).values()):
            process.kill()
        pool.shutdown(wait=False, cancel_futures=True)

    def close(self) -> None:
        self._kill()
