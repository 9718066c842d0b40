"""Attacks on telling a tool's own CancelledError (its failure) from a real cancellation
(the batch's, or the timeout's cut) on asyncio: tools that swallow the cut and raise
anew, tools that uncancel(), nested invoke, threads, processes, hooks, cancels that land
while a sibling's own CancelledError is being handled, and many rounds of it."""

from __future__ import annotations

import asyncio
import contextlib
import random
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import pytest

from dispatcher import Dispatcher, Registry, Status, Tool, ToolResult

from ._fakes import NO_ARGUMENTS, TEXT_SCHEMA, call

pytestmark = pytest.mark.parametrize("anyio_backend", ["asyncio"])


async def _echo(args: Mapping[str, Any], ctx: Any) -> str:
    await anyio.lowlevel.checkpoint()
    return str(args["text"])


async def _future(args: Mapping[str, Any], ctx: Any) -> str:
    future = asyncio.get_running_loop().create_future()
    future.cancel()
    return str(await future)


async def _naps(args: Mapping[str, Any], ctx: Any) -> str:
    await anyio.sleep(10)
    return "woke"


async def _fresh_in_except(args: Mapping[str, Any], ctx: Any) -> str:
    """Takes the cut and raises a CancelledError of its own while handling it."""
    try:
        await asyncio.sleep(10)
    except asyncio.CancelledError:
        raise asyncio.CancelledError("mine") from None
    return "never"


async def _fresh_after(args: Mapping[str, Any], ctx: Any) -> str:
    """Swallows the cut, then raises a CancelledError of its own (no context)."""
    with contextlib.suppress(asyncio.CancelledError):
        await asyncio.sleep(10)
    raise asyncio.CancelledError


async def _uncancels(args: Mapping[str, Any], ctx: Any) -> str:
    """Takes the cut, says it is not cancelled (uncancel), and lets it go on."""
    try:
        await asyncio.sleep(10)
    except asyncio.CancelledError:
        task = asyncio.current_task()
        assert task is not None
        task.uncancel()
        raise
    return "never"


async def _own_timeout(args: Mapping[str, Any], ctx: Any) -> str:
    """Its own asyncio.timeout, far shorter than the call's: a TimeoutError, its failure."""
    async with asyncio.timeout(0.01):
        await asyncio.sleep(10)
    return "never"


def _thread_naps_then_raises(args: Mapping[str, Any], ctx: Any) -> str:
    import time

    time.sleep(0.3)
    raise asyncio.CancelledError


async def _invokes_future(args: Mapping[str, Any], ctx: Any) -> str:
    inner: ToolResult = await ctx.invoke("future", {})
    return f"{inner.status.value}:{'CancelledError' in inner.content}"


def _thread_raises(args: Mapping[str, Any], ctx: Any) -> str:
    raise asyncio.CancelledError


async def _invokes_thread(args: Mapping[str, Any], ctx: Any) -> str:
    inner: ToolResult = await ctx.invoke("thread_raises", {})
    return f"{inner.status.value}:{'CancelledError' in inner.content}"


async def _invokes_naps(args: Mapping[str, Any], ctx: Any) -> str:
    inner: ToolResult = await ctx.invoke("naps", {})
    return f"inner {inner.status.value}"


_TOOLS = {
    "future": _future,
    "naps": _naps,
    "fresh_in_except": _fresh_in_except,
    "fresh_after": _fresh_after,
    "uncancels": _uncancels,
    "own_timeout": _own_timeout,
    "thread_naps": _thread_naps_then_raises,
    "invokes_future": _invokes_future,
    "invokes_naps": _invokes_naps,
    "thread_raises": _thread_raises,
    "invokes_thread": _invokes_thread,
}


def _dispatcher(*, concurrent: bool, timeout: float = 10.0, hooks: Any = (), **timeouts: float) -> Dispatcher:
    tools = [
        Tool(
            name,
            "Cancelled inside.",
            fn,
            NO_ARGUMENTS,
            concurrent=concurrent,
            deferred=False,
            timeout=timeouts.get(name),
        )
        for name, fn in _TOOLS.items()
    ]
    tools.append(Tool("echo", "Echo.", _echo, TEXT_SCHEMA, concurrent=concurrent, deferred=False))
    return Dispatcher(Registry(tools), timeout=timeout, hooks=list(hooks))


def _shapes(name: str) -> list[list[str]]:
    """The call alone, first of two, and between two siblings."""
    return [[name], [name, "echo"], ["echo", name, "echo"]]


async def _run(d: Dispatcher, names: list[str]) -> list[ToolResult]:
    s = d.session("attack", mode="direct")
    batch = [call(str(i), n, text=str(i)) if n == "echo" else call(str(i), n) for i, n in enumerate(names)]
    with anyio.fail_after(10):
        return await s.dispatch(batch)


def _check(names: list[str], results: list[ToolResult], culprit: str, status: Status) -> None:
    assert [r.call_id for r in results] == [str(i) for i in range(len(names))]
    for i, (n, r) in enumerate(zip(names, results, strict=True)):
        if n == "echo":
            assert (r.status, r.content) == (Status.ok, str(i)), r
        else:
            assert r.status is status, (culprit, names, r)


@pytest.mark.parametrize("concurrent", [True, False])
@pytest.mark.parametrize("shape", [0, 1, 2])
async def test_a_tool_that_raises_anew_while_handling_its_cut_times_out(concurrent: bool, shape: int) -> None:
    """A CancelledError raised while handling the timeout's (its context) is the timeout."""
    names = _shapes("fresh_in_except")[shape]
    d = _dispatcher(concurrent=concurrent, fresh_in_except=0.1)
    _check(names, await _run(d, names), "fresh_in_except", Status.timed_out)


@pytest.mark.parametrize("shape", [1, 2])
async def test_a_tool_that_uncancels_its_cut_among_siblings_still_times_out(shape: int) -> None:
    """The watchdog cut it (slot.cut): whatever it does with the cancellation, it timed out."""
    names = _shapes("uncancels")[shape]
    d = _dispatcher(concurrent=True, uncancels=0.1)
    _check(names, await _run(d, names), "uncancels", Status.timed_out)


@pytest.mark.parametrize(("concurrent", "shape"), [(True, 0), (False, 0), (False, 1), (False, 2)])
async def test_a_tool_that_uncancels_its_cut_in_its_own_scope_times_out(concurrent: bool, shape: int) -> None:
    """Alone or in turn, its own cancel scope caught the cut: the timeout, as before."""
    names = _shapes("uncancels")[shape]
    d = _dispatcher(concurrent=concurrent, uncancels=0.1)
    _check(names, await _run(d, names), "uncancels", Status.timed_out)


@pytest.mark.parametrize("concurrent", [True, False])
@pytest.mark.parametrize("shape", [0, 1, 2])
async def test_a_tool_that_swallows_its_cut_then_raises_anew_times_out(concurrent: bool, shape: int) -> None:
    """It ran past its timeout and was cut: the result is its timeout, and siblings keep theirs."""
    names = _shapes("fresh_after")[shape]
    d = _dispatcher(concurrent=concurrent, fresh_after=0.1)
    _check(names, await _run(d, names), "fresh_after", Status.timed_out)


@pytest.mark.parametrize("concurrent", [True, False])
@pytest.mark.parametrize("shape", [0, 1, 2])
async def test_a_tools_own_asyncio_timeout_is_its_failure(concurrent: bool, shape: int) -> None:
    """A tool's own asyncio.timeout, far shorter than its call's, is its failure (TimeoutError)."""
    names = _shapes("own_timeout")[shape]
    results = await _run(_dispatcher(concurrent=concurrent), names)
    _check(names, results, "own_timeout", Status.failed)
    assert all("TimeoutError" in r.content for r, n in zip(results, names, strict=True) if n != "echo")


@pytest.mark.parametrize("concurrent", [True, False])
async def test_a_thread_that_raises_cancelled_error_past_its_timeout_timed_out(concurrent: bool) -> None:
    """A sync tool whose thread raises CancelledError after its timeout was reported is that timeout."""
    names = ["thread_naps", "echo"]
    d = _dispatcher(concurrent=concurrent, thread_naps=0.05)
    _check(names, await _run(d, names), "thread_naps", Status.timed_out)


@pytest.mark.parametrize("outer", ["invokes_future", "invokes_thread"])
@pytest.mark.parametrize("concurrent", [True, False])
@pytest.mark.parametrize("shape", [0, 1, 2])
async def test_a_nested_invoke_whose_tool_raises_cancelled_error_itself_fails_alone(
    concurrent: bool, shape: int, outer: str
) -> None:
    """The inner call (async, or sync in a thread) fails; the outer call returns, saying so."""
    names = _shapes(outer)[shape]
    results = await _run(_dispatcher(concurrent=concurrent), names)
    _check(names, results, outer, Status.ok)
    assert all(r.content == "failed:True" for r, n in zip(results, names, strict=True) if n != "echo")


@pytest.mark.parametrize("concurrent", [True, False])
@pytest.mark.parametrize("shape", [0, 1, 2])
async def test_a_call_cut_while_its_nested_invoke_runs_times_out(concurrent: bool, shape: int) -> None:
    """The outer call's cut reaches the inner call as cancellation, not as its failure."""
    names = _shapes("invokes_naps")[shape]
    d = _dispatcher(concurrent=concurrent, invokes_naps=0.1)
    _check(names, await _run(d, names), "invokes_naps", Status.timed_out)


class _SlowAfter:
    """An after hook that, for a failed call, awaits a future something else cancels,
    after first waiting a while (when the test cancels the batch)."""

    def __init__(self) -> None:
        self.entered = asyncio.Event()

    async def after(self, call: Any, result: Any, ctx: Any) -> None:
        if result.status is Status.failed:
            self.entered.set()
            await asyncio.sleep(0.2)
            await _future({}, ctx)


@pytest.mark.parametrize("concurrent", [True, False])
async def test_a_cancel_while_a_siblings_own_cancelled_error_is_handled_propagates(concurrent: bool) -> None:
    """task.cancel() lands while an after hook handles a call's own CancelledError: the
    batch is cancelled, and the session goes on."""
    hook = _SlowAfter()
    d = _dispatcher(concurrent=concurrent, hooks=[hook])
    s = d.session("cancel", mode="direct")
    task = asyncio.create_task(
        s.dispatch([call("1", "echo", text="a"), call("2", "future"), call("3", "naps")])
    )
    with anyio.fail_after(5):
        await hook.entered.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    with anyio.fail_after(5):
        [after] = await s.dispatch([call("4", "echo", text="next")])
    assert (after.status, after.content) == (Status.ok, "next")


@pytest.mark.parametrize("concurrent", [True, False])
async def test_an_enclosing_task_group_cancelled_cancels_the_batch(concurrent: bool) -> None:
    """A task group around dispatch, cancelled, cancels the batch: no results, cancellation raised."""
    d = _dispatcher(concurrent=concurrent)
    s = d.session("group", mode="direct")
    returned: list[Any] = []

    async def batch() -> None:
        returned.append(
            await s.dispatch([call("1", "future"), call("2", "naps"), call("3", "echo", text="x")])
        )

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(batch)
            await anyio.sleep(0.1)
            tg.cancel_scope.cancel()
    assert returned == []


async def test_a_cancel_at_the_moment_a_tool_raises_its_own_is_the_batch_cancelled() -> None:
    """The dispatching task is cancelled in the very step a call's future is cancelled:
    the cancellation wins (the batch raises), never a result."""
    loop = asyncio.get_running_loop()
    futures: list[asyncio.Future[None]] = []
    all_waiting = asyncio.Event()
    wanted = [0]

    async def waits(args: Mapping[str, Any], ctx: Any) -> str:
        future = loop.create_future()
        futures.append(future)
        if len(futures) == wanted[0]:
            all_waiting.set()
        await future
        return "never"

    d = Dispatcher(Registry([Tool("waits", "W.", waits, TEXT_SCHEMA, concurrent=True, deferred=False)]))
    for n in (1, 3):
        futures.clear()
        all_waiting.clear()
        wanted[0] = n
        s = d.session(f"moment{n}", mode="direct")
        task = asyncio.create_task(s.dispatch([call(str(i), "waits", text=str(i)) for i in range(n)]))
        with anyio.fail_after(5):
            await all_waiting.wait()
        for f in futures:
            f.cancel()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


def _expect(name: str) -> Status:
    return {"future": Status.failed, "echo": Status.ok, "naps": Status.timed_out}[name]


@pytest.mark.parametrize("concurrent", [True, False])
async def test_many_rounds_of_own_and_real_cancellations(concurrent: bool) -> None:
    """Round after round, a random batch of calls that fail with their own CancelledError,
    calls that time out and calls that succeed; some rounds cancelled from outside at a
    random moment. Each round returns exactly the expected results or raises
    CancelledError (only when cancelled), and the task is left with no cancellation."""
    rng = random.Random(20261201)
    d = _dispatcher(concurrent=concurrent, naps=0.02)
    s = d.session("rounds", mode="direct")
    for round in range(60):
        names = [rng.choice(["future", "echo", "echo", "naps"]) for _ in range(rng.randint(1, 6))]
        batch = [
            call(f"{round}-{i}", n, text=str(i)) if n == "echo" else call(f"{round}-{i}", n)
            for i, n in enumerate(names)
        ]
        cancel_after = rng.choice([None, None, 0.0, 0.005, 0.015, 0.03])
        task = asyncio.create_task(s.dispatch(batch))
        if cancel_after is not None:
            await asyncio.sleep(cancel_after)
            task.cancel()
        try:
            with anyio.fail_after(10):
                results = await task
        except asyncio.CancelledError:
            assert cancel_after is not None, (round, names)
            assert task.cancelled()
            continue
        assert [r.call_id for r in results] == [c.id for c in batch]
        assert [r.status for r in results] == [_expect(n) for n in names], (round, names, results)
        current = asyncio.current_task()
        assert current is not None and current.cancelling() == 0


def _process_raises(args: Mapping[str, Any], ctx: Any) -> str:
    raise asyncio.CancelledError


_PROCESS_CHILD = """
import sys
sys.path.insert(0, {root!r})
import anyio
from dispatcher import Dispatcher, Registry, Status, Tool
from tests._fakes import NO_ARGUMENTS, TEXT_SCHEMA, call
from tests.test_attack_cancelled import _echo, _process_raises

async def main():
    tools = [
        Tool("proc", "P.", _process_raises, NO_ARGUMENTS, deferred=False, isolation="process"),
        Tool("echo", "Echo.", _echo, TEXT_SCHEMA, concurrent=True, deferred=False),
    ]
    d = Dispatcher(Registry(tools), timeout=20)
    try:
        s = d.session("proc", mode="direct")
        results = await s.dispatch([call("1", "proc"), call("2", "echo", text="x")])
        print(results[0].status.value, "CancelledError" in results[0].content, results[1].status.value)
    finally:
        d.shutdown()

anyio.run(main, backend="asyncio")
"""


def test_a_process_tool_that_raises_cancelled_error_fails(anyio_backend: str) -> None:
    """In a process of its own: the forkserver a worker process needs outlives the test."""
    root = str(Path(__file__).resolve().parent.parent)
    done = subprocess.run(
        [sys.executable, "-c", _PROCESS_CHILD.format(root=root)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["failed", "True", "ok"], done.stdout


async def _gate_awaits_a_cancelled_future(call: Any, ctx: Any) -> None:
    await _future({}, ctx)


async def _rewriter_awaits_a_cancelled_future(event: Any, state: Any) -> None:
    await _future({}, None)


async def test_a_gate_that_raises_cancelled_error_itself_denies_the_call() -> None:
    """As a gate that raises any other exception: the call is denied, the batch returns."""
    tools = [Tool("echo", "Echo.", _echo, TEXT_SCHEMA, concurrent=True, deferred=False, confirm=True)]
    s = Dispatcher(Registry(tools), gate=_gate_awaits_a_cancelled_future).session("gate", mode="direct")
    with anyio.fail_after(5):
        [result] = await s.dispatch([call("1", "echo", text="a")])
    assert result.status is Status.denied and "CancelledError" in result.content


async def test_a_rewriter_that_raises_cancelled_error_itself_is_skipped() -> None:
    """As a rewriter that raises any other exception: skipped, the call runs as sent."""
    tools = [Tool("echo", "Echo.", _echo, TEXT_SCHEMA, concurrent=True, deferred=False)]
    d = Dispatcher(Registry(tools), rewriters=[_rewriter_awaits_a_cancelled_future])
    s = d.session("rewriter", mode="direct")
    with anyio.fail_after(5):
        [result] = await s.dispatch([call("1", "echo", text="a")])
    assert (result.status, result.content) == (Status.ok, "a")


@pytest.mark.parametrize("concurrent", [True, False])
async def test_a_tools_own_cancelled_error_at_the_moment_of_its_timeout_never_loses_the_batch(
    concurrent: bool,
) -> None:
    """The future a call awaits is cancelled by a timer set for the call's deadline, so its
    own CancelledError and the timeout's cut land in the same few loop steps: the call is
    failed or timed out, its siblings ok, round after round; nothing escapes dispatch."""
    loop = asyncio.get_running_loop()
    timeout = 0.02

    async def racing(args: Mapping[str, Any], ctx: Any) -> str:
        future = loop.create_future()
        loop.call_later(timeout + float(args["text"]) * 0.001, future.cancel)
        return str(await future)

    tools = [
        Tool("racing", "R.", racing, TEXT_SCHEMA, concurrent=concurrent, deferred=False, timeout=timeout),
        Tool("echo", "Echo.", _echo, TEXT_SCHEMA, concurrent=concurrent, deferred=False),
    ]
    s = Dispatcher(Registry(tools)).session("race", mode="direct")
    for round in range(30):
        skew = str(round % 3 - 1)  # the timer a little before, at, or after the deadline
        batch = [call(f"{round}a", "echo", text="a"), call(f"{round}r", "racing", text=skew)]
        batch.append(call(f"{round}b", "echo", text="b"))
        with anyio.fail_after(5):
            results = await s.dispatch(batch)
        assert [r.status for r in results][::2] == [Status.ok, Status.ok]
        assert results[1].status in (Status.failed, Status.timed_out), results[1]
    task = asyncio.current_task()
    assert task is not None and task.cancelling() == 0
