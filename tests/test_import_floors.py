"""The package's layers import downward only, and no modules import each other in a circle.

Floors, top to bottom: jobs -> operators -> rebalance -> engine -> model, rebalance.core -> config,
errors, paths. A sub-package may have a floor of its own (``rebalance.core``, the pure rebalancing
policy, sits below the engine, whose expert-parallel driver asks its move rule).
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
    "budget": 0,  # a sequence's tokens left: one rule for the scheduler and the rebalancer
    "model": 1,
    "rebalance.core": 1,  # the rebalancing policy: pure Python, floor 0 only
    "engine": 2,
    "rebalance": 3,  # the coordinator, its Ray actor, the simulator
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


def _nodes(tree: ast.AST, runtime_only: bool):
    """Every node of ``tree``; with ``runtime_only``, not those under ``if TYPE_CHECKING:``."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        if runtime_only and isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            stack.extend(node.orelse)
            continue
        stack.extend(ast.iter_child_nodes(node))


def _imports(name: str, path: Path, modules: dict[str, Path], runtime_only: bool = False) -> set[str]:
    """The package modules ``name`` imports, resolved to modules (``from pkg import mod`` -> mod);
    with ``runtime_only``, not the type-only ones (``if TYPE_CHECKING:``: never executed)."""
    is_package = path.name == "__init__.py"
    targets = set()
    for node in _nodes(ast.parse(path.read_text()), runtime_only):
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
    """The floor of the longest part of ``module``'s path that has one."""
    parts = module.split(".")[1:]
    for end in range(len(parts), 0, -1):
        if ".".join(parts[:end]) in FLOORS:
            return FLOORS[".".join(parts[:end])]
    return None


def _graph(runtime_only: bool = False) -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules, runtime_only) for name, path in modules.items()}


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
    graph = _graph(runtime_only=True)  # a type-only import runs no code: no cycle at run time
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
        "import sys; import batchgen_data.rebalance.ray_actor;"
        "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith('torch'))[:3]"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_rebalancing_core_imports_neither_torch_nor_ray():
    # rebalance/core/ is the policy the simulator runs at 128 actors: every module of it, and the
    # simulator, in a process that has neither.
    code = (
        "import sys, pkgutil, importlib, batchgen_data.rebalance.core as core;"
        "names = [m.name for m in pkgutil.iter_modules(core.__path__)]; assert 'pool' in names, names;"
        "[importlib.import_module('batchgen_data.rebalance.core.' + n) for n in names];"
        "import batchgen_data.rebalance.simulate.run;"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'ray'));"
        "assert not bad, bad[:5]"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_rebalance_modules_stay_short():
    long = {str(p.relative_to(REPO)): n for p in (REPO / "batchgen_data" / "rebalance").rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 300}
    assert not long, f"modules over 300 lines: {long}"
