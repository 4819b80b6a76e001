"""Running the local job's event loop so that a Ctrl-C unwinds it cleanly.

The CLI's own SIGINT handler raises ``KeyboardInterrupt`` wherever the main thread is. Inside an
event loop that is often the middle of a task's step (writing a part, decoding a batch): asyncio
then stores the exception on that task, stops the loop, and nobody retrieves it, so at exit it
logs "Task exception was never retrieved" with a traceback. While the loop runs, a Ctrl-C
instead cancels the job's main task (what ``asyncio.run`` does with Python's default handler):
every await unwinds, every ``finally`` runs (the engine shuts down), and ``asyncio.run`` raises
``KeyboardInterrupt`` once the loop is closed. A second Ctrl-C raises at once, as usual.
"""

from __future__ import annotations

import asyncio
import signal
import threading
from collections.abc import Coroutine
from typing import Any


def run_interruptible(main: Coroutine[Any, Any, Any]) -> Any:
    """``asyncio.run(main)`` where a Ctrl-C cancels ``main`` and then raises KeyboardInterrupt.

    The caller's SIGINT handler is put back afterwards (it may record that a Ctrl-C came, as the
    CLI's does: a ``KeyboardInterrupt`` out of here means one did).
    """
    if threading.current_thread() is not threading.main_thread():  # signals go to the main thread only
        return asyncio.run(main)
    previous = signal.getsignal(signal.SIGINT)
    # asyncio.Runner turns SIGINT into a cancel of the main task only when it finds Python's
    # default handler installed.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        return asyncio.run(main)
    finally:
        signal.signal(signal.SIGINT, previous)
