"""SIGTERM handled like Ctrl-C, so that a run that is killed politely cleans up and keeps its work.

Python's default for SIGTERM (``kill PID``, a scheduler's time limit, ``docker stop``) ends the
process at once: no ``finally`` runs, so a run folder would be left as it was and the processes a
deployment started would keep running. Inside :func:`terminate_as_interrupt` SIGTERM raises
:class:`KeyboardInterrupt` instead, which unwinds through the same cleanup as Ctrl-C.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def terminate_as_interrupt() -> Iterator[None]:
    """While inside, SIGTERM raises ``KeyboardInterrupt("signal 15")`` in the main thread (in
    other threads signals cannot be handled: nothing changes there)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
