"""Run compile jobs in a pool of spawned worker processes, with clean failure and interrupt semantics.

* Workers are *spawned* (fresh interpreters: the DSL/MLIR state must not be
  forked) and ignore SIGINT from their first instruction (they are started
  with it ignored): Ctrl-C reaches the parent, which kills them.
* A worker never outlives the build: it asks the kernel to SIGKILL it when
  its parent dies (``PR_SET_PDEATHSIG`` on Linux) and, as a second guard,
  a thread exits it as soon as its parent process changes.
* At most ``jobs`` tasks are in flight, so "running" below is exact.
* A failing task is reported with its exception; by default no new task is
  started after it (the ones already running finish, so their results are
  kept), with ``keep_going`` every task runs.
* ``KeyboardInterrupt`` (or any other exception in the parent) kills every
  worker at once and propagates.
"""
from __future__ import annotations

import os
import signal
import sys
import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

_PR_SET_PDEATHSIG = 1


def _die_with_parent(parent: int) -> None:
    """Worker initializer: exit when `parent` exits; leave SIGINT to the parent."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if sys.platform.startswith("linux"):
        try:
            import ctypes
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):  # pragma: no cover - exotic libc
            pass
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)

    def watch() -> None:
        while True:
            time.sleep(0.5)
            if os.getppid() != parent:
                os._exit(1)

    threading.Thread(target=watch, name="svdq-aot-parent-watch", daemon=True).start()


def peak_rss_mb() -> float:
    """Peak resident memory of this process so far, in MiB."""
    try:
        import resource
    except ImportError:  # pragma: no cover - non-POSIX
        return 0.0
    kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kb / 1024.0 if sys.platform != "darwin" else kb / (1024.0 * 1024.0)


class _sigint_ignored:
    """Ignore SIGINT in this (main) thread for the block; elsewhere a no-op.

    Python keeps an inherited "ignored" SIGINT, so a worker spawned inside the block never sees
    Ctrl-C, not even before its initializer runs.  The parent's own handler is back right after.
    """

    def __enter__(self):
        self.old = None
        if threading.current_thread() is threading.main_thread():
            self.old = signal.signal(signal.SIGINT, signal.SIG_IGN)
        return self

    def __exit__(self, *exc):
        if self.old is not None:
            signal.signal(signal.SIGINT, self.old)


@dataclass
class Outcome:
    item: Any
    result: Any = None
    error: BaseException | None = None


def _kill(pool: ProcessPoolExecutor) -> None:
    procs = list(getattr(pool, "_processes", {}) .values())
    for p in procs:
        try:
            p.kill()
        except (OSError, AttributeError, ValueError):
            pass
    for p in procs:
        try:
            p.join(timeout=5)
        except (OSError, AttributeError, ValueError, AssertionError):
            pass


def run_pool(fn: Callable[..., Any], items: Sequence[Any], args: Callable[[Any], tuple], jobs: int, *,
             keep_going: bool = False, on_start: Callable[[Any], None] | None = None,
             on_done: Callable[[Outcome], None] | None = None) -> list[Outcome]:
    """``fn(*args(item))`` for every item in `jobs` spawned workers; outcomes in completion order."""
    import multiprocessing

    todo: Iterable[Any] = iter(items)
    outcomes: list[Outcome] = []
    pool = ProcessPoolExecutor(max_workers=max(1, min(jobs, len(items))),
                               mp_context=multiprocessing.get_context("spawn"),
                               initializer=_die_with_parent, initargs=(os.getpid(),))
    running: dict[Future, Any] = {}
    stop = False
    try:
        def submit_next() -> bool:
            item = next(todo, _END)
            if item is _END:
                return False
            with _sigint_ignored():     # a worker spawned now starts with SIGINT ignored (kept across exec)
                running[pool.submit(fn, *args(item))] = item
            if on_start is not None:
                on_start(item)
            return True

        for _ in range(max(1, jobs)):
            if not submit_next():
                break
        while running:
            done, _ = wait(list(running), return_when=FIRST_COMPLETED)
            for f in sorted(done, key=lambda f: items.index(running[f])):
                item = running.pop(f)
                exc = f.exception()
                oc = Outcome(item, None if exc else f.result(), exc)
                outcomes.append(oc)
                if on_done is not None:
                    on_done(oc)
                if exc is not None and (not keep_going or isinstance(exc, BrokenProcessPool)):
                    stop = True
            while not stop and len(running) < jobs and submit_next():
                pass
    except BaseException:
        _kill(pool)
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    pool.shutdown(wait=True, cancel_futures=True)
    return outcomes


_END = object()
