"""A Ctrl-C while the local job's event loop runs unwinds it without an unretrieved task error."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

# Tasks that spend their steps in synchronous work (as writing a part or decoding does), where a
# SIGINT handler that raises lands inside a task. The handler installed first stands for the CLI's.
_SCRIPT = textwrap.dedent("""
    import asyncio, gc, logging, os, signal, sys, threading, time
    from batchgen_data.jobs.interrupt import run_interruptible

    logging.basicConfig(level=logging.WARNING)
    def raising(signum, frame):
        raise KeyboardInterrupt
    signal.signal(signal.SIGINT, raising)
    unwound = []

    async def main():
        async def worker():
            while True:
                start = time.monotonic()
                while time.monotonic() - start < 0.2:
                    pass
                await asyncio.sleep(0)
        try:
            await asyncio.gather(*(worker() for _ in range(3)))
        finally:
            unwound.append(True)

    threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT)).start()
    runner = run_interruptible if sys.argv[1] == "interruptible" else asyncio.run
    try:
        runner(main())
    except KeyboardInterrupt:
        print("interrupted", unwound == [True], signal.getsignal(signal.SIGINT) is raising)
    gc.collect()
""")


def _run(variant: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _SCRIPT, variant], capture_output=True, text=True, timeout=60)


@pytest.mark.timeout(120)
def test_ctrl_c_cancels_the_loop_and_leaves_no_unretrieved_task_exception():
    for _ in range(3):  # where the signal lands is timing: a few tries
        proc = _run("interruptible")
        assert proc.stdout.strip() == "interrupted True True", proc.stdout + proc.stderr
        assert "never retrieved" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


@pytest.mark.timeout(60)
def test_the_raising_handler_alone_leaves_one_which_is_what_the_helper_avoids():
    proc = _run("plain")
    assert "Task exception was never retrieved" in proc.stderr, proc.stdout + proc.stderr
