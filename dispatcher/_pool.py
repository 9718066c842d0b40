"""The pool of worker processes for `Tool(isolation="process")`, one per Dispatcher,
started on the first such call, and the workers' own loop (`_serve`; what crosses to a
worker is `_process`'s). It keeps as many workers as the Dispatcher's limit at most. Each
worker is a process group of its own, and a kill is SIGKILL to the group: the processes
a handler started go with it. An idle worker that ended is not handed out, and a call
sent to a worker that had ended (`WorkerGone`) goes to another.

A worker starts in a thread (the first one also starts the forkserver, a few hundred
milliseconds, more on a loaded machine); that time counts toward the first call's timeout.
A call whose timeout comes while its worker is still starting is timed out then, without
waiting for the thread, and the worker, once started, waits idle for the next call
(`Start`). Waiting for a reply is `_backend.wait_readable` on the pipe, so nothing here
imports trio or asyncio; it needs a loop that can watch a file descriptor (POSIX: not
asyncio's Proactor loop on Windows).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.connection
import os
import pickle
import signal
import threading
from collections.abc import Callable, Mapping
from typing import Any

import attrs

from ._exceptions import ToolError
from ._process import ProcessContext

__all__ = ["ProcessPool", "Start", "WorkerGone"]


class WorkerGone(Exception):
    """The worker a call was given had ended before the call reached it: nothing ran, and
    the call may be given another worker."""


def _serve(conn: multiprocessing.connection.Connection) -> None:
    """A worker's loop: one (handler, args, ctx) in, one reply out, until the pipe closes."""
    # a group of its own, so that a kill reaches what its handlers started too (`_kill_group`)
    with contextlib.suppress(OSError):
        os.setpgrp()
    # a Ctrl-C at the terminal reaches the host's process group: the host decides, not us
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    from ._results import describe

    while True:
        try:
            handler, args, ctx = conn.recv()
        except EOFError:
            return
        except Exception as exc:
            conn.send(("raised", f"the arguments could not be read in the worker process: {describe(exc)}"))
            continue
        reply: tuple[Any, ...]
        try:
            reply = ("ok", handler(args, ctx))
        except ToolError as exc:
            reply = ("tool_error", exc.message, exc.retryable)
        except KeyboardInterrupt:
            reply = ("keyboard",)
        except BaseException as exc:  # everything a handler raises is its failure
            reply = ("raised", describe(exc))
        try:
            conn.send(reply)
        except Exception as exc:
            conn.send(("raised", f"the result could not be sent back from the worker: {describe(exc)}"))


@attrs.define(eq=False)
class _Worker:
    process: Any  # multiprocessing's Process of the forkserver context
    conn: multiprocessing.connection.Connection


class ProcessPool:
    """Idle workers kept for the next call; busy ones are the calls' own until they answer."""

    def __init__(self, keep: int = 1) -> None:
        self._keep = max(1, keep)  # workers kept at most: the Dispatcher's limit, as no more run at once
        methods = multiprocessing.get_all_start_methods()
        self._mp: Any = multiprocessing.get_context("forkserver" if "forkserver" in methods else "spawn")
        if "forkserver" in methods:
            # the server imports the kernel once; each worker is a fork of it
            self._mp.set_forkserver_preload(["dispatcher._pool"])
        self._idle: list[_Worker] = []
        self._busy: set[_Worker] = set()
        self._dying: list[Any] = []
        self._closed = False
        # workers whose call stopped waiting while they started, handed over from their
        # thread; the lock also orders a hand-over against `shutdown`
        self._lock = threading.Lock()
        self._adopted: list[_Worker] = []

    def alive(self) -> int:
        return len(self._idle) + len(self._busy) + len(self._adopted)

    def take(self) -> _Worker | None:
        """An idle worker, or None (start one with a `Start`, in a thread: it waits for a fork)."""
        self._reap()
        if self._closed:
            raise RuntimeError("this Dispatcher was shut down: its worker processes are gone")
        if self._adopted:
            with self._lock:
                self._idle.extend(self._adopted)
                self._adopted.clear()
        while self._idle:
            worker = self._idle.pop()
            # an idle worker's pipe holds nothing to read: one that reads has ended (EOF),
            # which the forkserver may not have reaped yet, as `is_alive` waits for
            if worker.process.is_alive() and not _readable(worker.conn):
                return worker
            self._kill(worker)
        return None

    def start(self) -> _Worker:
        """A new worker (called in a thread; it touches none of the pool's bookkeeping)."""
        here, there = self._mp.Pipe()
        process = self._mp.Process(target=_serve, args=(there,), daemon=True, name="threepass-worker")
        process.start()
        there.close()
        return _Worker(process, here)

    def _adopt(self, worker: _Worker) -> None:
        """Keep a worker nobody waits for any more, for the next call, unless the pool has
        as many as it keeps already (the lock is held; the idle and busy ones, which the
        loop's thread changes, are only counted here: a bound, not a ledger)."""
        if self._closed or len(self._idle) + len(self._busy) + len(self._adopted) >= self._keep:
            _kill_group(worker.process)
            with contextlib.suppress(Exception):
                worker.conn.close()
        else:
            self._adopted.append(worker)

    async def run(
        self,
        worker: _Worker,
        handler: Callable[..., Any],
        args: Mapping[str, Any],
        ctx: ProcessContext,
        wait_readable: Callable[[int], Any],
    ) -> Any:
        """Run one call on `worker`: its return value, or a ToolError saying what the handler
        raised (a KeyboardInterrupt is raised as itself); `WorkerGone` if the worker had
        ended before the call reached it.
        Cancelled (the timeout) or dead, the worker is killed; answered, it goes back idle."""
        answered = False
        self._busy.add(worker)
        try:
            if self._closed:
                raise RuntimeError("this Dispatcher was shut down: its worker processes are gone")
            try:
                worker.conn.send((handler, dict(args), ctx))
            except (pickle.PicklingError, TypeError, AttributeError) as exc:
                answered = True  # nothing was written: the worker is still waiting, unharmed
                raise ToolError(f"the arguments cannot be sent to a worker process: {exc}") from None
            except OSError:  # its end of the pipe closed: it had ended, and read nothing
                raise WorkerGone from None
            await wait_readable(worker.conn.fileno())
            try:
                reply = worker.conn.recv()
            except (EOFError, OSError):
                code = _exit_code(worker.process)
                raise ToolError(
                    f"the worker process running {ctx.tool_name} ended without answering ({code})"
                ) from None
            answered = True
        finally:
            self._busy.discard(worker)
            if answered and not self._closed:
                self._idle.append(worker)
            else:
                self._kill(worker)
        kind = reply[0]
        if kind == "ok":
            return reply[1]
        if kind == "tool_error":
            raise ToolError(reply[1], retryable=reply[2])
        if kind == "keyboard":
            raise KeyboardInterrupt
        raise ToolError(reply[1])  # the worker's `describe` of what the handler raised

    def _kill(self, worker: _Worker) -> None:
        _kill_group(worker.process)
        with contextlib.suppress(Exception):
            worker.conn.close()
        self._dying.append(worker.process)

    def _reap(self) -> None:
        """Collect the workers that were killed (without waiting for any)."""
        if not self._dying:
            return
        still = []
        for process in self._dying:
            if process.is_alive():
                still.append(process)
            else:
                with contextlib.suppress(Exception):
                    process.close()
        self._dying = still

    def shutdown(self) -> None:
        """Kill every worker, idle or busy; the pool refuses new calls from now on. A busy
        worker's pipe is left to its call, which sees it end and fails."""
        with self._lock:
            self._closed = True
            self._idle.extend(self._adopted)
            self._adopted.clear()
        for worker in self._busy:
            _kill_group(worker.process)
        for worker in self._idle:
            self._kill(worker)
        self._idle.clear()
        for process in self._dying:
            with contextlib.suppress(Exception):
                process.join(1)
        self._dying = []
        self._reap()


class Start:
    """One worker started for one call, in a thread (`__call__`), which the call may stop
    waiting for (its timeout, `abandon`): then the worker goes to the pool once started,
    whichever of the two comes second."""

    __slots__ = ("_abandoned", "_pool", "_worker")

    def __init__(self, pool: ProcessPool) -> None:
        self._pool = pool
        self._worker: _Worker | None = None
        self._abandoned = False

    def __call__(self) -> _Worker:
        worker = self._pool.start()
        with self._pool._lock:
            self._worker = worker
            if self._abandoned:
                self._pool._adopt(worker)
        return worker

    def abandon(self) -> None:
        with self._pool._lock:
            self._abandoned = True
            if self._worker is not None:
                self._pool._adopt(self._worker)


def _readable(conn: multiprocessing.connection.Connection) -> bool:
    """Whether `conn` has something to read, or has ended (a closed one counts as ended)."""
    try:
        return conn.poll()
    except (OSError, EOFError, ValueError):
        return True


def _kill_group(process: Any) -> None:
    """SIGKILL a worker and the processes its handlers started: its process group (`_serve`
    makes it one of its own), while the worker is not known to have ended (its id is then
    still its own), and the worker itself in any case."""
    with contextlib.suppress(Exception):
        if process.exitcode is None:
            os.killpg(process.pid, signal.SIGKILL)
    with contextlib.suppress(Exception):
        process.kill()


def _exit_code(process: Any) -> str:
    process.join(1)
    code = process.exitcode
    if code is None:
        return "still running"
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-code).name}"
    return f"exit code {code}"
