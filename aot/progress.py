"""Build progress: a live `rich` display on a terminal, one plain line per variant otherwise.

A `Progress` gets ``start(total, to_compile)``, ``running(name)`` when a
compile starts, ``finished(name, result, error)`` for every variant (cache
hits included) and ``close()``.  `LineProgress` writes
``[ i/n] <name>  <seconds>s  <compiled|cached>  <peak MiB>`` lines to a
callable (CI logs); `RichProgress` shows done/total, the variants compiling
now, elapsed time and ETA.  `make_progress` picks one for a stream.
"""
from __future__ import annotations

import sys
import time
from typing import Any, Callable, TextIO


class Progress:
    def start(self, total: int, to_compile: int) -> None: ...
    def running(self, name: str) -> None: ...
    def finished(self, name: str, result: Any, error: str | None) -> None: ...
    def close(self) -> None: ...


def _describe(result: Any) -> str:
    if result.cache == "hit":
        return "cached"
    mem = f"  peak {result.peak_rss_mb:.0f} MiB" if result.peak_rss_mb else ""
    return f"{result.seconds:.1f}s  compiled{mem}"


class LineProgress(Progress):
    """One plain line per finished variant."""

    def __init__(self, emit: Callable[[str], Any]):
        self.emit = emit
        self.total = 0
        self.n = 0

    def start(self, total: int, to_compile: int) -> None:
        self.total, self.n = total, 0

    def finished(self, name: str, result: Any, error: str | None) -> None:
        self.n += 1
        w = len(str(self.total))
        what = f"FAILED: {error}" if error else _describe(result)
        self.emit(f"[{self.n:>{w}}/{self.total}] {name}  {what}")


class RichProgress(Progress):
    """A live display: bar with done/total, elapsed and ETA, and the variants compiling now."""

    def __init__(self, stream: TextIO):
        from rich.console import Console
        self.console = Console(file=stream)
        self._live = None
        self._running: dict[str, float] = {}

    def start(self, total: int, to_compile: int) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress as RP, ProgressColumn, TextColumn, \
            TimeElapsedColumn, TimeRemainingColumn
        from rich.text import Text
        owner = self

        class Running(ProgressColumn):      # re-rendered at every refresh: the seconds keep counting
            def render(self, task):
                return Text(owner._now(), overflow="ellipsis", no_wrap=True)

        self._bar = RP(TextColumn("[bold]building"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                       TextColumn("eta"), TimeRemainingColumn(), Running(),
                       console=self.console, transient=False)
        self._task = self._bar.add_task("build", total=total)
        self._bar.start()
        if to_compile < total:
            self.console.print(f"{total - to_compile} of {total} variant(s) from the cache")

    def _now(self) -> str:
        t = time.monotonic()
        items = [f"{_short(n)} ({t - s:.0f}s)" for n, s in self._running.items()]
        return "compiling: " + ", ".join(items) if items else ""

    def running(self, name: str) -> None:
        self._running[name] = time.monotonic()

    def finished(self, name: str, result: Any, error: str | None) -> None:
        self._running.pop(name, None)
        if error:
            self.console.print(f"[red]FAILED[/red] {name}: {error}", markup=True, highlight=False)
        elif result.cache != "hit":
            self.console.print(f"{name}  {_describe(result)}", highlight=False)
        self._bar.update(self._task, advance=1)

    def close(self) -> None:
        if getattr(self, "_bar", None) is not None:
            self._bar.stop()


def _short(name: str) -> str:
    """A variant name without the ``svdq_`` prefix and the requirements suffix (``_reqn128k64``)."""
    short = name[5:] if name.startswith("svdq_") else name
    return short.rsplit("_req", 1)[0][:70]


def make_progress(stream: TextIO | None = None, *, plain: bool = False) -> Progress:
    """`RichProgress` when `stream` is a terminal and rich is installed, else `LineProgress`."""
    stream = stream or sys.stderr
    if not plain and stream.isatty():
        try:
            return RichProgress(stream)
        except ImportError:
            pass
    return LineProgress(lambda line: print(line, file=stream, flush=True))
