"""The layers import downward only (docs/architecture.md): ``core`` imports nothing of ours;
``envs`` and ``policies`` import ``core`` and themselves; ``embodied`` may import all of them.
The algorithms import neither policies nor the config layer, the workers no module of
``policies`` but the interface and the registry, and no modules import each other in a circle.
Every import counts, also those inside functions."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("core", "envs", "policies", "embodied")
ALLOWED = {"core": {"core"}, "envs": {"core", "envs"}, "policies": {"core", "policies"},
           "embodied": set(PACKAGES)}


def _module(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """Each module of ours -> the modules of ours it imports (a ``from a import b`` counts ``a.b``
    when that is a module, else ``a``)."""
    modules = {_module(p, root): p for pkg in PACKAGES for p in sorted((root / pkg).rglob("*.py"))}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in modules else node.module
                           for alias in node.names]
            else:
                continue
            found |= {t for t in targets if t.split(".")[0] in PACKAGES}
        graph[name] = found
    return graph


def upward(graph: dict[str, set[str]]) -> list[str]:
    return sorted(f"{m} -> {t}" for m, targets in graph.items() for t in targets
                  if t.split(".")[0] not in ALLOWED[m.split(".")[0]])


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in graph:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            # a package importing its own submodules (an __init__ re-export) is not a circle
            if len(component) > 1 and not all(c.startswith(min(component, key=len)) for c in component):
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_layers_import_downward_only():
    assert upward(import_graph()) == []


def test_no_modules_import_each_other_in_a_circle():
    assert circles(import_graph()) == []


def test_the_algorithms_import_no_policy_and_no_config():
    graph = import_graph()
    for module, targets in graph.items():
        if module.startswith("embodied.algorithms"):
            bad = {t for t in targets if t.startswith(("policies", "embodied.config.schema", "embodied.config"))}
            assert not bad, f"{module} imports {bad}"


def test_workers_reach_policies_through_the_interface_only():
    graph = import_graph()
    for module, targets in graph.items():
        if module.startswith("embodied.workers"):
            bad = {t for t in targets if t.startswith("policies") and t not in ("policies", "policies.base")}
            assert not bad, f"{module} imports {bad}"


def test_the_checks_see_a_violation(tmp_path):
    """The graph finds an upward import and a circle in a tree made to have both."""
    for pkg in PACKAGES:
        (tmp_path / pkg).mkdir()
        (tmp_path / pkg / "__init__.py").write_text("")
    (tmp_path / "envs" / "a.py").write_text("from embodied.b import x\n")
    (tmp_path / "embodied" / "b.py").write_text("def f():\n    from embodied.c import y\n")
    (tmp_path / "embodied" / "c.py").write_text("import embodied.b\n")
    graph = import_graph(tmp_path)
    assert upward(graph) == ["envs.a -> embodied.b"]
    assert circles(graph) == [["embodied.b", "embodied.c"]]


def test_only_the_backend_registry_imports_the_megatron_package():
    """Megatron's backend and policy live in policies/megatron; the rest of the tree reaches them
    through the training-backend registry (embodied/backends.py) and the contract in core."""
    graph = import_graph()
    importers = {m for m, targets in graph.items() if not m.startswith("policies.megatron")
                 and any(t.startswith("policies.megatron") for t in targets)}
    assert importers == {"embodied.backends"}


def test_the_env_worker_imports_no_torch():
    """Each env rank is a Ray process of its own whose simulators run in processes of their own;
    importing torch there added about 1.5 CPU-seconds to every env rank's start for nothing."""
    code = ("import sys, embodied.workers.env; "
            "print(sorted(m for m in ('torch', 'transformers', 'mani_skill') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stdout + done.stderr[-2000:]


def _code_strings(path: Path) -> set[str]:
    """The string constants of a module, docstrings left out."""
    tree = ast.parse(path.read_text())
    docs = {id(n.body[0].value) for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef)) and n.body
            and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    return {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
            and id(n) not in docs}


def test_sft_stands_beside_rl_and_the_demo_readers_and_recorder_name_no_env():
    """The RL actor never touches demonstrations (SFT has its own trainer); the demo reader and
    the recorder ask the env's declared format (envs/*_demos.py) instead of naming an env."""
    from envs import ENVS

    graph = import_graph()
    assert "embodied.demonstrations" not in graph["embodied.workers.actor"]
    assert "embodied.demonstrations" in graph["embodied.workers.imitation"]
    env_modules = {f"envs.{name}" for name in ENVS.names()}
    for module in ("envs.demos", "embodied.record"):
        assert not {t for t in graph[module] if t.split("_demos")[0] in env_modules}, module
        strings = _code_strings(ROOT / Path(*module.split(".")).with_suffix(".py"))
        assert not strings & set(ENVS.names()), (module, strings & set(ENVS.names()))
    assert {name for name in ENVS.names() if ENVS.declared(name)["demos"]} == {"maniskill", "libero"}
