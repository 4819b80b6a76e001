"""Shared fixtures: tiny transformers checkpoints per architecture, built once per session."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from tiny_checkpoints import build_checkpoint, build_mtp_checkpoint  # noqa: E402


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """Function arch -> (folder, transformers model), cached per session."""
    cache: dict[str, tuple[Path, object]] = {}

    def get(arch: str):
        if arch not in cache:
            folder = tmp_path_factory.mktemp(f"ckpt-{arch}")
            cache[arch] = (folder, build_checkpoint(arch, folder))
        return cache[arch]

    return get


@pytest.fixture(scope="session")
def mtp_checkpoint(tmp_path_factory):
    """Function arch -> (folder, main transformers model, transformers model whose last layer is
    the MTP block, the MTP-only tensors): ``build_mtp_checkpoint``, cached per session."""
    cache: dict[str, tuple] = {}

    def get(arch: str):
        if arch not in cache:
            folder = tmp_path_factory.mktemp(f"mtp-{arch}")
            cache[arch] = (folder, *build_mtp_checkpoint(arch, folder))
        return cache[arch]

    return get


@pytest.fixture(scope="session")
def demo_path():
    from batchgen_data.model.demo import ensure_demo_checkpoint

    return ensure_demo_checkpoint()


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory):
    """A real local Ray (2 CPUs) per test module; actors need fractional CPUs on this machine."""
    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    env_vars = {"BATCHGEN_DATA_CACHE": os.environ["BATCHGEN_DATA_CACHE"], "DS_ACCELERATOR": "cpu",
                "TORCH_EXTENSIONS_DIR": os.environ["TORCH_EXTENSIONS_DIR"]}
    ray.init(num_cpus=2, include_dashboard=False, _temp_dir=str(tmp_path_factory.mktemp("ray")),
             log_to_driver=False, runtime_env={"env_vars": env_vars})
    ray.data.DataContext.get_current().enable_progress_bars = False
    yield
    ray.shutdown()



def pytest_configure(config):
    # Keep generated files inside the run's own folders, not the home directory.
    root = Path(__file__).resolve().parent.parent / ".cache"
    os.environ.setdefault("BATCHGEN_DATA_CACHE", str(root / "batchgen-data"))
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(root / "torch_extensions"))
    os.environ.setdefault("TIKTOKEN_CACHE_DIR", str(root / "tiktoken"))
    os.environ.setdefault("HF_HOME", str(root / "huggingface"))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def native():
    """The compiled CPU kernels, or a skip where they do not build here (no C++ compiler or
    torch headers)."""
    from batchgen_data.model.native import load_native

    module = load_native()
    if module is None:
        pytest.skip("the native kernels do not build here (no C++ compiler or torch headers)")
    return module


# The slow tier: what starts Ray, kills processes, runs notebooks and examples, builds a wheel or
# runs a benchmark. ``pytest -m "not slow"`` is the quick loop; CI runs everything.
_SLOW_FILES = {"test_examples.py", "test_wheel_install.py", "test_fault_tolerance.py", "test_node_failure.py",
               "test_ray_ranks.py", "test_expert_parallel.py", "test_cli.py", "test_run_batch.py", "test_hostile_inputs.py",
               "test_bad_inputs.py", "test_row_errors_cli.py"}
_SLOW_FOLDERS = {"benchmarks", "distributed"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        path = Path(str(item.fspath))
        if ("ray_cluster" in getattr(item, "fixturenames", ()) or path.name in _SLOW_FILES
                or _SLOW_FOLDERS & set(path.relative_to(Path(__file__).parent).parts[:-1])):
            item.add_marker(pytest.mark.slow)
