"""The package as users install it: a wheel built from the tracked files, installed into a fresh
virtual environment outside the checkout, imports every module and runs the README's main job.

The fresh environment sees this one's third-party packages through a path file (installing torch
and Ray again would take minutes and the network) but not its editable install of this project:
a path file adds a folder to ``sys.path`` without running the path files inside it, and the
editable install is such a path file. So every ``batchgen_data`` module comes from the wheel.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def _tracked_files() -> list[str]:
    """The files a clean clone has (what a source distribution or a Docker build copies)."""
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("needs a git checkout to know which files are tracked")
    out = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, text=True, check=True)
    return [name for name in out.stdout.split("\0") if name and (REPO / name).is_file()]


@pytest.fixture(scope="module")
def wheel_venv(tmp_path_factory) -> Path:
    """A fresh virtual environment with the project installed from its wheel (no editable link)."""
    root = tmp_path_factory.mktemp("wheel")
    src = root / "src"
    for name in _tracked_files():
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / name, src / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "-w", str(root / "dist"), str(src)], check=True, timeout=300)
    [wheel] = (root / "dist").glob("batchgen_data-*.whl")
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    ours = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    Path(site, "third_party.pth").write_text("".join(f"{path}\n" for path in sorted(ours)))
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps",
                    "--no-index", str(wheel)], check=True, timeout=300)
    return venv


def _module_name(path: Path) -> str:
    """``batchgen_data/engine/core/x.py`` -> ``batchgen_data.engine.core.x``; ``operators/`` is
    ``batchgen_data.operators``."""
    parts = path.relative_to(REPO).with_suffix("").parts
    if parts[0] == "operators":
        parts = ("batchgen_data", *parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    return env


def test_the_wheel_holds_every_module_and_imports_each(wheel_venv, tmp_path):
    """Every module under ``batchgen_data/`` and ``operators/`` is in the wheel (operators as
    ``batchgen_data.operators``, no top-level ``operators``), with the native sources, and each
    imports from the installed copy."""
    expected = sorted(_module_name(path) for folder in ("batchgen_data", "operators")
                      for path in (REPO / folder).rglob("*.py") if "__pycache__" not in path.parts)
    code = (
        "import importlib, importlib.resources, importlib.util, json, pkgutil, sys, batchgen_data;"
        "names = sorted(['batchgen_data'] + [m.name for m in pkgutil.walk_packages(batchgen_data.__path__, 'batchgen_data.')]);"
        "[importlib.import_module(name) for name in names];"
        "import batchgen_data.model.native as native;"
        "print(json.dumps({'names': names, 'file': batchgen_data.__file__, 'top_operators': importlib.util.find_spec('operators') is not None,"
        "'native_sources': sorted(p.name for p in importlib.resources.files(native).iterdir() if p.name.endswith(('.cpp', '.h')))}))"
    )
    out = subprocess.run([str(wheel_venv / "bin" / "python"), "-c", code], cwd=tmp_path, env=_env(),
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    found = json.loads(out.stdout.strip().splitlines()[-1])
    assert found["file"].startswith(str(wheel_venv)), found["file"]  # the installed copy, not the checkout
    assert found["names"] == expected
    assert not found["top_operators"]
    assert found["native_sources"] == sorted(p.name for p in (REPO / "batchgen_data/model/native").iterdir()
                                             if p.suffix in (".cpp", ".h"))


def test_the_installed_command_runs_the_readme_job(wheel_venv, demo_path, tmp_path):
    """The wheel's ``batchgen-data`` command runs the README's main job (its first tickets) on the
    demo model from a folder outside the checkout."""
    lines = (REPO / "examples/data/support_tickets.jsonl").read_text().splitlines()[:4]
    (tmp_path / "tickets.jsonl").write_text("\n".join(lines) + "\n")
    shutil.copy(REPO / "examples/data/triage_prompt.txt", tmp_path / "triage_prompt.txt")
    out = subprocess.run([str(wheel_venv / "bin" / "batchgen-data"), "run", "tickets.jsonl", "runs/tickets",
                          "--prompt-template", "triage_prompt.txt", "--max-tokens", "8"],
                         cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.concat_tables(pq.read_table(p) for p in sorted((tmp_path / "runs" / "tickets").glob("part-*.parquet")))
    assert table.num_rows == 4
    assert table.column("__inference_error__").null_count == 4
    assert all(n > 0 for n in table.column("num_generated_tokens").to_pylist())
