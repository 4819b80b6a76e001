"""The demo checkpoint's staging folders: a writer killed mid-generation leaves one behind, and the
next start removes it, but never a folder whose writer still runs."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from batchgen_data.model.demo import (
    _STALE_STAGING_S,
    DEMO_VERSION,
    _host_id,
    _process_start,
    _staging_prefix,
    ensure_demo_checkpoint,
)

REPO = Path(__file__).resolve().parents[2]
ENSURE = "from batchgen_data.model.demo import ensure_demo_checkpoint; ensure_demo_checkpoint()"
STAGING_WAIT_S = 20.0  # the writer makes its staging folder right after its imports (~2 s)
GENERATE_TIMEOUT_S = 120.0  # one generation takes ~6 s on 2 idle cores


def python(cache: Path) -> tuple[list[str], dict]:
    """The command and environment of a fresh process calling ``ensure_demo_checkpoint`` on
    ``cache``."""
    return [sys.executable, "-c", ENSURE], {**os.environ, "BATCHGEN_DATA_CACHE": str(cache)}


def staging_folders(cache: Path) -> list[Path]:
    return sorted(cache.glob(".demo-*"))


def finished_checkpoint(cache: Path) -> Path:
    """A stand-in for a generated checkpoint, so ``ensure_demo_checkpoint`` only cleans."""
    folder = cache / f"demo-qwen3-moe-{DEMO_VERSION}"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    return folder


def test_staging_of_a_writer_killed_mid_generation_is_removed_by_the_next_start(tmp_path):
    command, env = python(tmp_path)
    writer = subprocess.Popen(command, env=env, cwd=REPO)
    try:
        deadline = time.monotonic() + STAGING_WAIT_S
        while not staging_folders(tmp_path):
            assert writer.poll() is None, "the writer ended before its staging folder appeared"
            assert time.monotonic() < deadline, "no staging folder appeared"
            time.sleep(0.02)
        writer.kill()  # SIGKILL: the writer's `finally` that removes its staging never runs
        writer.wait()
        assert writer.returncode == -9
        (left,) = staging_folders(tmp_path)

        done = subprocess.run(command, check=False, env=env, cwd=REPO, timeout=GENERATE_TIMEOUT_S)
        assert done.returncode == 0
        assert not left.exists()
        assert staging_folders(tmp_path) == []
        folder = tmp_path / f"demo-qwen3-moe-{DEMO_VERSION}"
        assert (folder / "config.json").is_file() and (folder / "model.safetensors").is_file()
    finally:
        writer.kill()  # no-op once it ended; a failed assert above must not leave it running
        writer.wait()


def test_staging_of_a_live_writer_is_kept_and_of_a_dead_one_removed(tmp_path, monkeypatch):
    monkeypatch.setenv("BATCHGEN_DATA_CACHE", str(tmp_path))
    finished_checkpoint(tmp_path)
    live = Path(tempfile.mkdtemp(prefix=_staging_prefix(os.getpid()), dir=tmp_path))
    (live / "model.safetensors").write_bytes(b"partly written")
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()  # reaped: its pid names no process now
    dead = Path(tempfile.mkdtemp(prefix=_staging_prefix(ended.pid), dir=tmp_path))

    ensure_demo_checkpoint()

    assert live.is_dir() and (live / "model.safetensors").read_bytes() == b"partly written"
    assert not dead.exists()


def test_staging_of_an_earlier_process_with_a_live_pid_is_removed(tmp_path, monkeypatch):
    """Pids repeat (a container's CLI is often the same pid every run): a staging folder named by
    this pid but another start time was left by an earlier process, not by this one."""
    started = _process_start(os.getpid())
    if started is None:
        pytest.skip("process start times are read from /proc (Linux)")
    monkeypatch.setenv("BATCHGEN_DATA_CACHE", str(tmp_path))
    finished_checkpoint(tmp_path)
    earlier = tmp_path / f".demo-{os.getpid()}-{started - 1}-{_host_id()}-abcd1234"
    earlier.mkdir()

    ensure_demo_checkpoint()

    assert not earlier.exists()


@pytest.mark.parametrize(
    "name",
    [".demo-abcd1234", ".demo-123-456-another-host-abcd1234"],
    ids=["legacy name without a pid", "another host of a shared cache"],
)
def test_staging_of_a_writer_we_cannot_ask_is_removed_once_stale(tmp_path, monkeypatch, name):
    monkeypatch.setenv("BATCHGEN_DATA_CACHE", str(tmp_path))
    finished_checkpoint(tmp_path)
    young, stale = tmp_path / name, tmp_path / f"{name}5678"
    for folder in (young, stale):
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(b"partly written")
    past = time.time() - _STALE_STAGING_S - 60
    for path in (stale / "model.safetensors", stale):
        os.utime(path, (past, past))

    ensure_demo_checkpoint()

    assert young.is_dir()
    assert not stale.exists()
