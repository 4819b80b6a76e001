"""The package's layers import downward only, and no modules import each other in a circle.

Floors, top to bottom: jobs -> operators -> distributed -> engine -> model -> config, errors, paths.
Every import counts, at module level or inside a function (a lazy import is still a dependency).
The package root ``batchgen_data/__init__.py`` is the public facade and may re-export any floor.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# Top-level part of the package -> floor (higher floors may import lower ones, never the reverse).
FLOORS = {
    "errors": 0,
    "config": 0,  # every config: the engine's, vLLM's engine arguments, Ray Data LLM's processor and stages
    "paths": 0,
    "hardware": 0,  # the CPU's name, for cache keys and benchmark reports
    "heap": 0,  # giving freed heap memory back to the OS (glibc's malloc_trim)
    "model": 1,
    "engine": 2,
    "distributed": 3,
    "operators": 4,
    "jobs": 5,
    "processor": 5,  # Ray Data LLM's processor API over the operator
}


# Upward imports allowed, each with its reason. None: an Engine configured for expert parallelism
# runs an executor that lives beside it in the engine floor (``engine/executor/``), and the rank
# processes that executor starts run an ``InProcessExecutor`` (no module imports its caller back).
ALLOWED_UPWARD: dict[tuple[str, str], str] = {}


def _modules() -> dict[str, Path]:
    """Every module of the installed package by dotted name (``operators/`` ships as
    ``batchgen_data.operators``)."""
    found = {}
    for root, prefix in ((REPO / "batchgen_data", "batchgen_data"), (REPO / "operators", "batchgen_data.operators")):
        for path in root.rglob("*.py"):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join([prefix, *parts])] = path
    return found


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package modules ``name`` imports, resolved to modules (``from pkg import mod`` -> mod)."""
    is_package = path.name == "__init__.py"
    targets = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            candidates = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative import
                base = name.split(".")[: len(name.split(".")) - node.level + (1 if is_package else 0)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            candidates = [f"{module}.{alias.name}" for alias in node.names] + [module]
        else:
            continue
        for candidate in candidates:
            if candidate in modules:
                targets.add(candidate)
                break
            # ``import batchgen_data.model.layers`` also names its parents; keep the module itself
            while candidate and candidate not in modules:
                candidate = candidate.rpartition(".")[0]
            if candidate and candidate != "batchgen_data":
                targets.add(candidate)
                break
    targets.discard(name)
    return targets


def _floor(module: str) -> int | None:
    parts = module.split(".")
    return FLOORS.get(parts[1]) if len(parts) > 1 else None


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def test_every_package_part_has_a_floor():
    unplaced = sorted({m.split(".")[1] for m in _modules() if m != "batchgen_data" and _floor(m) is None})
    assert not unplaced, f"modules outside every floor: {unplaced}; add them to FLOORS"


def test_imports_go_downward_only():
    upward = []
    for module, targets in _graph().items():
        if module == "batchgen_data":  # the facade re-exports the public API
            continue
        for target in targets:
            if target != "batchgen_data" and _floor(target) > _floor(module) and (module, target) not in ALLOWED_UPWARD:
                upward.append(f"{module} -> {target}")
    assert not upward, "upward imports:\n" + "\n".join(sorted(upward))


def test_no_import_cycles():
    graph = _graph()
    # A package's own __init__ re-exporting its children is not a cycle with them: Python runs
    # the parent first either way. Drop child -> ancestor-package edges before the search.
    edges = {m: {t for t in ts if not m.startswith(t + ".") and (m, t) not in ALLOWED_UPWARD} for m, ts in graph.items()}
    state: dict[str, int] = {}  # 1 = on the stack, 2 = done
    cycles = []

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                cycles.append(" -> ".join(stack[stack.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt, stack)
        stack.pop()
        state[node] = 2

    for node in sorted(edges):
        if node not in state:
            visit(node, [])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_the_checker_sees_real_edges():
    graph = _graph()
    assert "batchgen_data.engine.core.scheduler" in graph["batchgen_data.engine.executor.in_process"]
    assert "batchgen_data.engine.core.kv_manager" in graph["batchgen_data.engine.core.scheduler"]
    assert "batchgen_data.model.moe.native_backend" in graph["batchgen_data.model.moe.backends"]  # lazy import
    assert "batchgen_data.operators.rows" in graph["batchgen_data.jobs.runner"]


def test_the_engine_core_imports_without_torch():
    # engine/core/ (records, scheduler, KV manager, progress) is torch-free: every module of it.
    code = (
        "import sys, pkgutil, importlib, batchgen_data.engine.core as core;"
        "names = [m.name for m in pkgutil.iter_modules(core.__path__)]; assert 'kv_manager' in names, names;"
        "[importlib.import_module('batchgen_data.engine.core.' + n) for n in names];"
        "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith('torch'))[:3]"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_work_pool_coordinator_imports_without_torch():
    # The coordinator is its own Ray actor process, started while the operator actors load their
    # models: importing torch there costs every rebalanced job ~1.5 s of CPU at start-up.
    code = (
        "import sys; import batchgen_data.distributed.coordinator;"
        "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith('torch'))[:3]"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
