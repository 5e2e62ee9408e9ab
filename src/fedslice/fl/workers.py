"""Concurrent clients on the CPU: a round's clients trained by K forked worker processes.

Each round, the engine forks K workers *after* the server's work of the previous round, so each
worker starts from exactly the state a client trained in-process would see: the loaded model,
the data, the method's caches. Nothing is copied: the backbone's pages are shared copy-on-write
(a worker writes only the small trainable tensors it loads and its own activations). Each
worker runs at one intra-op thread; K of them use K cores better than one process at K threads
on the short sequences of federated clients (clients are independent, a large share of a step
is single-threaded Python and small kernels).

Work is handed out one client at a time over a pipe, so a worker that finishes early takes the
next client; a client's result depends only on its payload, data and seed (never on which
worker trained it or in which order), and the server sorts replies by client before it
aggregates: the final tensors equal the sequential run's at the same thread count.

A worker that dies (killed, out of memory) loses only the client it was training: that client
counts as dropped for the round (the reason is recorded), the worker is replaced, the other
clients' replies are kept. Workers die with the main process (``PR_SET_PDEATHSIG``) and are
always reaped, so no orphan is left. An exception inside a client's training is raised in the
main process, as in the sequential run.
"""

from __future__ import annotations

import ctypes
import gc
import itertools
import logging
import os
import pickle
import signal
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection, Pipe, wait
from typing import Any

import torch

from fedslice.heap import trim_heap

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
_STOP = None


@dataclass
class WorkerLost:
    """A client whose worker process died before replying."""

    reason: str


class WorkerError(RuntimeError):
    """An exception raised by a client's training inside a worker process."""


def _die_with_parent(parent: int) -> None:
    """Ask the kernel to kill this process when its parent dies (Linux), then check the parent
    did not die already."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):  # pragma: no cover - not Linux
        pass
    if os.getppid() != parent:
        os._exit(1)


def _serve(conn: Connection, task: Callable[[Any], Any], parent: int) -> None:
    """The worker's loop: receive a job, run it, send back ("ok", result) or ("error", text)."""
    _die_with_parent(parent)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C: the main process stops the workers
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    torch.set_num_threads(1)
    while True:
        try:
            job = conn.recv()
        except (EOFError, OSError):
            return
        if job is _STOP:
            return
        try:
            out = ("ok", task(job))
        except BaseException as e:  # noqa: BLE001 - reported to the main process
            out = ("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
        try:
            conn.send_bytes(pickle.dumps(out, protocol=pickle.HIGHEST_PROTOCOL))
        except (BrokenPipeError, OSError):
            return


def _fork_worker(task: Callable[[Any], Any], on_start: Callable[[], None] | None) -> tuple[int, Connection]:
    parent_end, child_end = Pipe(duplex=True)
    parent = os.getpid()
    pid = os.fork()
    if pid == 0:  # the worker
        code = 0
        try:
            parent_end.close()
            if on_start is not None:
                on_start()
            _serve(child_end, task, parent)
        except BaseException:  # noqa: BLE001
            code = 1
        finally:
            os._exit(code)  # no atexit handlers, no flushing of the parent's buffers
    child_end.close()
    return pid, parent_end


def _exit_reason(pid: int) -> str:
    """Reap a finished worker and say how it ended."""
    try:
        _, status = os.waitpid(pid, 0)
    except ChildProcessError:
        return "worker process exited"
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        name = signal.Signals(sig).name if sig in signal.Signals._value2member_map_ else str(sig)
        hint = " (killed: out of memory?)" if sig == signal.SIGKILL else ""
        return f"worker process died of {name}{hint}"
    return f"worker process exited with code {os.WEXITSTATUS(status)}"


#: forked rounds between full collections before a fork: the others collect the young
#: generations only (a full collection walks every object of the process: 0.2-0.4 s with
#: torch, transformers and flwr loaded; the young ones hold a round's garbage). Cyclic garbage
#: that reached the old generation waits at most this many rounds (frozen in between, then back)
FULL_COLLECT_EVERY = 8
_forks = itertools.count()


def _collect_before_fork() -> None:
    if next(_forks) % FULL_COLLECT_EVERY == 0:
        gc.collect()
    else:
        gc.collect(1)


def run_forked(task: Callable[[Any], Any], jobs: list[Any], workers: int, *,
               on_result: Callable[[Any, Any], None] | None = None,
               on_start: Callable[[], None] | None = None) -> dict[Any, Any]:
    """``{job: task(job)}`` computed by ``workers`` forked processes (a :class:`WorkerLost` for a
    job whose worker died). ``jobs`` must be hashable and picklable (client ids); ``task`` runs in
    the worker, so it sees the state of this process at the fork; its result must pickle.
    ``on_result(job, result)`` is called in this process as results arrive; ``on_start`` in each
    worker after the fork (e.g. to silence progress output)."""
    pending = list(jobs)
    results: dict[Any, Any] = {}
    live: dict[Connection, tuple[int, Any]] = {}  # connection -> (pid, job being run)

    def start() -> None:
        pid, conn = _fork_worker(task, on_start)
        live[conn] = (pid, None)
        dispatch(conn)

    def dispatch(conn: Connection) -> None:
        pid, _ = live[conn]
        if pending:
            job = pending.pop(0)
            live[conn] = (pid, job)
            conn.send(job)
        else:
            live[conn] = (pid, None)
            try:
                conn.send(_STOP)
            except (BrokenPipeError, OSError):
                pass
            conn.close()
            del live[conn]
            _exit_reason(pid)

    def finish(job: Any, result: Any) -> None:
        results[job] = result
        if on_result is not None:
            on_result(job, result)

    # fork from a small, settled heap: freed pages back to the kernel, and every object alive
    # now moved out of the collector's reach, so a worker's collections do not write to (and
    # copy) the pages of the parent's objects (Python's gc docs: freeze before fork)
    _collect_before_fork()
    trim_heap()
    gc.freeze()
    try:
        for _ in range(min(workers, len(pending))):
            start()
        while live:
            for conn in wait(list(live)):
                pid, job = live[conn]
                try:
                    status, payload = pickle.loads(conn.recv_bytes())
                except (EOFError, OSError, pickle.UnpicklingError):
                    conn.close()
                    del live[conn]
                    reason = _exit_reason(pid)
                    if job is not None:
                        log.warning("client %s lost: %s", job, reason)
                        finish(job, WorkerLost(reason))
                    if pending:
                        start()  # a replacement, forked from the unchanged state of this round
                    continue
                if status == "error":
                    raise WorkerError(f"client {job} failed in a worker process: {payload}")
                finish(job, payload)
                dispatch(conn)
    finally:
        for conn, (pid, _) in list(live.items()):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            conn.close()
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass
        gc.unfreeze()
    return results
