"""The walk of a config from the command line to the placement plan stays short.

Measured as issue 30 counts it: run ``embodied-train --dry-run`` of the default config under a
profiler and collect each distinct call from a function of one module of ``embodied/`` to a
function of another (each such call is a trip away that the reader returns from). Printing the
summary is not part of the walk. At 02ef0cf this found 16 returns into 14 functions; the limit is
half of that.
"""

from __future__ import annotations

import contextlib
import functools
import io
import sys
from pathlib import Path

from embodied import cli

ROOT = Path(__file__).resolve().parents[1]
EMBODIED = ROOT / "embodied"


@functools.cache
def _module(filename: str) -> str | None:
    path = Path(filename)
    return str(path.relative_to(ROOT)) if path.is_relative_to(EMBODIED) else None


def walk_returns(argv: list[str]) -> set[tuple[str, str, str, str]]:
    """(caller module, caller, callee module, callee) of each cross-module call in ``embodied/``,
    on a second run of the command (the first one's imports are not the walk), its caches
    emptied so that every call enters its function."""
    edges = set()

    def add(caller_code, callee_code) -> None:
        callee, caller = _module(callee_code.co_filename), _module(caller_code.co_filename)
        if callee and caller and callee != caller and caller_code.co_name != "summary":
            edges.add((caller, caller_code.co_name, callee, callee_code.co_name))

    def profile(frame, event, arg):
        if event == "call" and frame.f_back is not None and frame.f_code.co_name != "<module>":
            add(frame.f_back.f_code, frame.f_code)

    with contextlib.redirect_stdout(io.StringIO()):
        assert cli._main(argv, "embodied-train") == 0
        for name, module in list(sys.modules.items()):
            if name.split(".")[0] == "embodied":
                for value in vars(module).values():
                    if callable(getattr(value, "cache_clear", None)):
                        value.cache_clear()
        sys.setprofile(profile)
        try:
            code = cli._main(argv, "embodied-train")
        finally:
            sys.setprofile(None)
    assert code == 0
    return edges


def test_the_default_configs_walk_to_its_plan_returns_at_most_8_times():
    edges = walk_returns(["--dry-run"])
    listing = "\n".join(f"{a}:{f} -> {b}:{g}" for a, f, b, g in sorted(edges))
    assert len(edges) <= 8, listing
    # the walk does reach the layer's stages: composing, the schema, refusals, placement, checkpoints
    reached = {callee for _, _, callee, _ in edges}
    assert {"embodied/config/__init__.py", "embodied/config/schema.py", "embodied/config/refused.py",
            "embodied/placement.py", "embodied/config/preflight.py"} <= reached, listing


if __name__ == "__main__":  # the figure and the walk: python tests/test_config_walk.py [--dry-run overrides]
    found = walk_returns(sys.argv[1:] or ["--dry-run"])
    print(f"{len(found)} returns into {len({(b, g) for _, _, b, g in found})} functions")
    for a, f, b, g in sorted(found):
        print(f"  {a}:{f} -> {b}:{g}")
