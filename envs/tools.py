"""Tools an agent env runs between turns, in the env worker: each call bounded in time and output
length, and its outcome counted (logged per episode as ``<split>/tool_calls``, ``tool_timeouts``,
``tool_errors``, ``tool_truncated``; ``<split>/<figure>/<name>`` is the per-task namespace).

A response calls a tool in one of two forms: ``<tool_call>{"name": ..., "arguments": {...}}
</tool_call>`` (the Hermes / Qwen chat format) or ``<NAME>body</NAME>`` for a tool NAME taking one
argument (``<python>print(1)</python>``, ``<calculator>3*7</calculator>``). The first call in a
response is run; a call that does not parse, names no known tool, or lacks its argument fails its
turn as an error, and the run goes on.
"""

from __future__ import annotations

import ast
import json
import operator
import re
import time
from collections.abc import Callable
from dataclasses import dataclass

from core.errors import ConfigError
from envs import sandbox

OK, ERROR, TIMEOUT = sandbox.OK, sandbox.ERROR, sandbox.TIMEOUT
SIDES = ("left", "right", "middle")  # which part of a long output is kept (veRL's meaning)
_JSON_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)
_TAG_CALL = re.compile(r"<(\w+)>(.*?)</\1>", re.S)


@dataclass(frozen=True)
class Call:
    name: str
    argument: str


@dataclass(frozen=True)
class Output:
    text: str
    status: str  # OK, ERROR or TIMEOUT
    truncated: bool = False


def find_call(text: str, tools: dict[str, "Tool"]) -> Call | Output | None:
    """The first tool call in ``text``: a ``Call``, an ERROR ``Output`` saying why it is malformed,
    or None when the response calls no tool."""
    json_call, tag_call = _JSON_CALL.search(text), None
    for match in _TAG_CALL.finditer(text):
        if match.group(1) in tools:
            tag_call = match
            break
    if json_call and (tag_call is None or json_call.start() < tag_call.start()):
        try:
            call = json.loads(json_call.group(1))
            name, arguments = call["name"], call.get("arguments", {})
        except (json.JSONDecodeError, TypeError, KeyError) as err:
            return Output(f"malformed tool call ({type(err).__name__}): expected "
                          '{"name": ..., "arguments": {...}}', ERROR)
        if name not in tools:
            return Output(f"unknown tool {name!r}; tools are {sorted(tools)}", ERROR)
        argument = arguments.get(tools[name].argument) if isinstance(arguments, dict) else None
        if not isinstance(argument, str):
            return Output(f"tool {name!r} needs a string argument {tools[name].argument!r}", ERROR)
        return Call(name, argument)
    if tag_call:
        return Call(tag_call.group(1), tag_call.group(2).strip())
    return None


def truncate(text: str, limit: int, side: str) -> tuple[str, bool]:
    """At most ``limit`` characters of ``text``: ``left`` keeps the start, ``right`` the end,
    ``middle`` both ends; a marker shows where text was cut."""
    if len(text) <= limit:
        return text, False
    if side == "left":
        return text[:limit] + "...(truncated)", True
    if side == "right":
        return "(truncated)..." + text[-limit:], True
    return text[:limit // 2] + "...(truncated)..." + text[len(text) - (limit - limit // 2):], True


@dataclass(frozen=True)
class Tool:
    run: Callable[[str, float], Output]  # (argument, time limit in s) -> output
    argument: str  # its argument's name in the JSON form


def run_python(code: str, timeout_s: float) -> Output:
    result = sandbox.run_python(code, sandbox.Limits(wall_s=timeout_s, cpu_s=max(1, round(timeout_s))))
    if result.status == OK:
        return Output(result.stdout, OK)
    if result.status == TIMEOUT:
        return Output(result.stdout + f"\n(stopped: over the {timeout_s:g} s limit)", TIMEOUT)
    lines = result.stderr.strip().splitlines()
    return Output(result.stdout + (lines[-1] if lines else f"exit status {result.returncode}"), ERROR)


_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
              ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
              ast.USub: operator.neg, ast.UAdd: operator.pos}
MAX_DIGITS = 100  # the calculator refuses larger numbers (an exponent could take any time)


def calculate(expression: str, timeout_s: float = 0.0) -> Output:
    """Integer and decimal arithmetic (+ - * / // % ** and parentheses), evaluated from the
    syntax tree, never ``eval``; done in microseconds, so ``timeout_s`` is not needed."""
    def value(node: ast.AST) -> int | float:
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](value(node.operand))
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) * len(str(abs(left))) > MAX_DIGITS:
                raise OverflowError("result too large")
            result = _OPERATORS[type(node.op)](left, right)
            if isinstance(result, int) and len(str(abs(result))) > MAX_DIGITS:
                raise OverflowError("result too large")
            return result
        raise ValueError(f"not arithmetic: {ast.dump(node)[:60]}")

    try:
        result = value(ast.parse(expression.strip(), mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError, OverflowError, TypeError) as err:
        return Output(f"error: {err}", ERROR)
    if isinstance(result, float) and result.is_integer():
        result = int(result)
    return Output(str(result), OK)


TOOLS = {"python": Tool(run_python, "code"), "calculator": Tool(calculate, "expression")}


def tools_named(names: list[str], key: str) -> dict[str, Tool]:
    unknown = [n for n in names if n not in TOOLS]
    if unknown:
        raise ConfigError(f"{key} = {names!r}: unknown tool(s) {unknown}; tools are {sorted(TOOLS)}")
    return {n: TOOLS[n] for n in names}


class ToolRunner:
    """Runs the tool a response calls, within the limits, and counts what happened."""

    def __init__(self, tools: dict[str, Tool], timeout_s: float, max_output: int, side: str):
        if side not in SIDES:
            raise ConfigError(f"tool_response_truncate_side = {side!r}: expected one of {SIDES}")
        self.tools, self.timeout_s, self.max_output, self.side = tools, timeout_s, max_output, side
        self.counts = dict.fromkeys(("calls", "timeouts", "errors", "truncated"), 0)
        self.seconds = 0.0  # wall time in tools: a share of the env's time that generation does not cause

    def __call__(self, response: str) -> Output | None:
        """The bounded output of the tool ``response`` calls, or None if it calls none."""
        call = find_call(response, self.tools)
        if call is None:
            return None
        self.counts["calls"] += 1
        if isinstance(call, Call):
            tic = time.monotonic()
            try:
                call = self.tools[call.name].run(call.argument, self.timeout_s)
            except Exception as err:  # a tool's own bug fails the turn, never the run
                call = Output(f"tool {call.name!r} failed: {type(err).__name__}: {err}", ERROR)
            self.seconds += time.monotonic() - tic
        self.counts["timeouts"] += call.status == TIMEOUT
        self.counts["errors"] += call.status == ERROR
        text, cut = truncate(call.text, self.max_output, self.side)
        self.counts["truncated"] += cut
        return Output(text, call.status, cut)

    def pop_metrics(self) -> dict[str, float]:
        """The counts, and ``tool_s``: the seconds spent in tools (a time, not a count per episode)."""
        counts, self.counts = self.counts, dict.fromkeys(self.counts, 0)
        seconds, self.seconds = self.seconds, 0.0
        return {**{f"tool_{k}": float(v) for k, v in counts.items()}, "tool_s": seconds}
