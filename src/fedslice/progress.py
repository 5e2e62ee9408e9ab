"""What a run is doing, as it does it: rounds, the clients of a round, local training,
distillation and evaluation.

Code that does the work reports through :func:`task`, which costs nothing unless a display is
active; :func:`activate` (used by the API and CLI) makes one active for a run, like logging's
handlers: there is no config behind it. Two displays:

* :class:`RichDisplay` on a terminal: a bar with ETA over rounds, plus bars of the current
  sub-tasks (clients of the round, a client's local steps, distillation, evaluation).
* :class:`LogDisplay` off a terminal (a batch job, ``fedslice run CONFIG > log.txt``): one line
  per round with the round, clients, mean train loss, dev metrics, elapsed time and ETA.
"""

from __future__ import annotations

import contextlib
import contextvars
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any, TextIO

_ACTIVE: contextvars.ContextVar[Display | None] = contextvars.ContextVar("fedslice_display",
                                                                         default=None)


def _noop(n: int = 1) -> None:
    return None


@contextlib.contextmanager
def task(description: str, total: int | None = None) -> Iterator[Callable[[int], None]]:
    """A sub-task of the active display (``advance(n=1)`` per unit done); a no-op without one."""
    display = _ACTIVE.get()
    if display is None:
        yield _noop
        return
    handle = display.start_task(description, total)
    try:
        yield lambda n=1: display.advance(handle, n)
    finally:
        display.end_task(handle)


def silence() -> None:
    """No display from here on in this context (a forked worker process: the main process
    reports its progress)."""
    _ACTIVE.set(None)


def round_done(record: dict[str, Any]) -> None:
    """Tell the active display (if any) that a round finished, with its metrics record."""
    display = _ACTIVE.get()
    if display is not None:
        display.round_done(record)


@contextlib.contextmanager
def activate(display: Display | None) -> Iterator[Display | None]:
    """Make ``display`` the active one for the duration (``None``: nothing is shown)."""
    token = _ACTIVE.set(display)
    try:
        if display is None:
            yield None
        else:
            with display:
                yield display
    finally:
        _ACTIVE.reset(token)


def fmt_duration(seconds: float | None) -> str:
    """``42s``, ``3m05s``, ``1h02m``; ``-`` if unknown."""
    if seconds is None or seconds != seconds or seconds < 0:
        return "-"
    s = int(round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def _num(value: Any, spec: str = ".4f") -> str:
    return "-" if value is None or value != value else format(value, spec)


#: dev metrics shown per round, when the task has them
DEV_METRICS = (("dev_accuracy", "dev accuracy"), ("dev_rougeL", "dev ROUGE-L"), ("dev_bleu", "dev BLEU"),
               ("dev_loss", "dev loss"))


def round_line(record: dict[str, Any], total_rounds: int, elapsed: float, *,
               verbose: bool = False) -> str:
    """The one-line summary of a round: round, clients, mean train loss, dev metrics, elapsed
    time and ETA (the mean round time so far times the rounds left)."""
    rnd = int(record["round"])
    eta = elapsed / rnd * (total_rounds - rnd) if rnd else None
    parts = [f"round {rnd}/{total_rounds}", f"clients {len(record.get('clients', []))}",
             f"train loss {_num(record.get('train_loss'))}"]
    for key, name in DEV_METRICS:
        if record.get(key) is not None:
            parts.append(f"{name} {_num(record[key], '.2f' if key in ('dev_bleu', 'dev_rougeL') else '.4f')}")
    if record.get("excluded"):
        parts.append(f"excluded {len(record['excluded'])}")
    if record.get("sim_time_s") is not None:  # devices on the simulated clock
        parts.append(f"simulated {fmt_duration(record['sim_time_s'])}")
    if verbose:
        for key, name in (("bytes_down_mean", "down"), ("bytes_up_mean", "up")):
            if record.get(key) is not None:
                parts.append(f"{name} {record[key] / 1e6:.2f} MB/client")
        losses = [f"{m['client']}:{_num(m.get('loss'), '.3f')}"
                  for m in record.get("client_metrics", [])]
        if losses:
            parts.append("client losses " + " ".join(losses))
    parts += [f"elapsed {fmt_duration(elapsed)}", f"ETA {fmt_duration(eta)}"]
    return " | ".join(parts)


class Display:
    """Base display: shows nothing (subclasses override what they show)."""

    def __enter__(self) -> Display:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None

    def start_task(self, description: str, total: int | None) -> Any:
        return None

    def advance(self, handle: Any, n: int = 1) -> None:
        return None

    def end_task(self, handle: Any) -> None:
        return None

    def round_done(self, record: dict[str, Any]) -> None:
        return None


class LogDisplay(Display):
    """One line per round on ``stream`` (flushed at once, so a log file is current)."""

    def __init__(self, total_rounds: int, name: str = "", stream: TextIO | None = None,
                 verbose: bool = False):
        self.total_rounds, self.name, self.verbose = total_rounds, name, verbose
        self.stream = stream
        self.t0 = time.perf_counter()

    def __enter__(self) -> LogDisplay:
        self.t0 = time.perf_counter()
        return self

    def round_done(self, record: dict[str, Any]) -> None:
        elapsed = record.get("elapsed_s")  # since round 1 began (setup time excluded)
        line = round_line(record, self.total_rounds,
                          time.perf_counter() - self.t0 if elapsed is None else elapsed,
                          verbose=self.verbose)
        stream = self.stream or sys.stdout
        print(f"{self.name}: {line}" if self.name else line, file=stream, flush=True)


class RichDisplay(Display):
    """Rich bars with ETA: rounds, and the sub-tasks running now (removed when they end)."""

    def __init__(self, total_rounds: int, name: str = "", console: Any = None):
        from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                                   TimeElapsedColumn, TimeRemainingColumn)
        self.bar = Progress(TextColumn("[bold]{task.description}"), BarColumn(),
                            MofNCompleteColumn(), TextColumn("{task.fields[stats]}"),
                            TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
                            console=console)
        self.rounds = self.bar.add_task(f"{name} rounds".strip(), total=total_rounds, stats="")
        self._streams: list[tuple[Any, Any]] = []

    def __enter__(self) -> RichDisplay:
        import logging

        self.bar.start()
        # Log records go above the bars: point stream handlers at the redirected stderr.
        for handler in logging.getLogger().handlers:
            if isinstance(handler, logging.StreamHandler) and handler.stream in (
                    sys.__stderr__, sys.__stdout__):
                self._streams.append((handler, handler.setStream(sys.stderr)))
        return self

    def __exit__(self, *exc: Any) -> None:
        for handler, stream in self._streams:
            handler.setStream(stream)
        self.bar.stop()

    def start_task(self, description: str, total: int | None) -> Any:
        return self.bar.add_task(f"  {description}", total=total, stats="")

    def advance(self, handle: Any, n: int = 1) -> None:
        self.bar.update(handle, advance=n)

    def end_task(self, handle: Any) -> None:
        self.bar.remove_task(handle)

    def round_done(self, record: dict[str, Any]) -> None:
        stats = f"loss {_num(record.get('train_loss'), '.3f')}"
        if record.get("dev_accuracy") is not None:
            stats += f"  dev acc {_num(record['dev_accuracy'], '.3f')}"
        if record.get("dev_rougeL") is not None:
            stats += f"  dev ROUGE-L {_num(record['dev_rougeL'], '.1f')}"
        self.bar.update(self.rounds, advance=1, stats=stats)


def make_display(total_rounds: int, name: str = "", *, enabled: bool = True,
                 verbose: bool = False, stream: TextIO | None = None) -> Display | None:
    """Rich bars if ``stream`` (default stdout) is a terminal, one line per round otherwise;
    ``None`` when not ``enabled``."""
    if not enabled:
        return None
    stream = stream or sys.stdout
    if getattr(stream, "isatty", lambda: False)():
        return RichDisplay(total_rounds, name)
    return LogDisplay(total_rounds, name, stream, verbose=verbose)
