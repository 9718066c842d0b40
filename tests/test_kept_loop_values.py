"""What pass 2's kept run of calls (`Executor._run_kept`: one frame for the async calls at
the front of a worker's queue while it keeps its limiter slot) lets go of, as a frame a
call did: a handler's returned value before the next call runs, its ToolContext, and
nothing of later calls held by the run control a call raised; and the values `maker`
makes for every call (ToolResult, ToolContext) are the classes' own in every way a
caller can see, on any thread. (`ToolResult.__subclasses__()` lists the private class
`maker` fills: CPython lets an instance's class be changed only to a class of the same
layout, and with a `__weakref__` slot only a subclass that adds none has it.)"""

from __future__ import annotations

import copy
import gc
import json
import pickle
import threading
import weakref
from collections.abc import Callable, Coroutine, Mapping
from typing import Any

import anyio
import attrs
import pytest

from dispatcher import Dispatcher, DispatchInterrupted, Registry, Status, Tool, ToolContext, ToolResult
from dispatcher._types import new_context, new_result


def _call(cid: str, name: str, args: Any) -> dict[str, Any]:
    return {"id": cid, "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}


def _tool(name: str, handler: Any, **kw: Any) -> Tool:
    kw.setdefault("concurrent", True)
    return Tool(name, name, handler, {"type": "object"}, deferred=False, **kw)


class _Held:
    """A handler's return value that is neither text nor JSON: its `str` is the content."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __str__(self) -> str:
        return f"held {self.n}"


def _on(backend: str, main: Callable[[], Coroutine[Any, Any, Any]]) -> Any:
    return anyio.run(main, backend=backend)


@pytest.mark.parametrize("backend", ["trio", "asyncio"])
@pytest.mark.parametrize("limit", [1, 3])
def test_a_kept_calls_returned_value_is_let_go_before_the_next_call_runs(backend: str, limit: int) -> None:
    """What a handler returned is gone once its result is made: the next call of the same
    worker does not run while it is still held (a value holding a file, a lock or a large
    buffer is let go as its call ends, as on 177b81f)."""
    refs: dict[int, weakref.ref[_Held]] = {}
    alive: list[tuple[int, bool]] = []

    async def make(args: Mapping[str, Any], ctx: Any) -> _Held:
        n = args["n"]
        if n:  # a _Held is in no cycle: it goes with its last reference, no collection needed
            alive.append((n - 1, refs[n - 1]() is not None))
        value = _Held(n)
        refs[n] = weakref.ref(value)
        return value

    async def main() -> list[str]:
        d = Dispatcher(Registry([_tool("make", make)]), max_concurrent=limit)
        results = await d.session("s").dispatch([_call(f"c{i}", "make", {"n": i}) for i in range(5)])
        return [r.content for r in results]

    contents = _on(backend, main)
    assert [json.loads(c) for c in contents] == [f"held {i}" for i in range(5)]
    assert alive == [(n, False) for n in range(4)]


@pytest.mark.parametrize("backend", ["trio", "asyncio"])
@pytest.mark.parametrize("limit", [1, 3])
def test_a_kept_calls_context_is_let_go_as_the_next_call_starts(backend: str, limit: int) -> None:
    """The ToolContext a call was told is gone by the time the next call of its worker runs."""
    refs: dict[int, weakref.ref[Any]] = {}
    alive: list[tuple[int, bool]] = []

    async def tell(args: Mapping[str, Any], ctx: Any) -> str:
        n = args["n"]
        if n:
            alive.append((n - 1, refs[n - 1]() is not None))
        refs[n] = weakref.ref(ctx)
        return "told"

    async def main() -> None:
        d = Dispatcher(Registry([_tool("tell", tell)]), max_concurrent=limit)
        await d.session("s").dispatch([_call(f"c{i}", "tell", {"n": i}) for i in range(5)])

    _on(backend, main)
    assert alive == [(n, False) for n in range(4)]


@pytest.mark.parametrize("backend", ["trio", "asyncio"])
def test_a_kept_calls_value_is_not_held_by_the_run_control_a_later_call_raised(backend: str) -> None:
    """A call that interrupts the run: the exception the caller gets holds none of the values
    the calls after it (on the same worker) returned."""
    refs: list[weakref.ref[_Held]] = []

    async def make(args: Mapping[str, Any], ctx: Any) -> _Held:
        if args["n"] == 1:
            raise DispatchInterrupted([])
        value = _Held(args["n"])
        refs.append(weakref.ref(value))
        return value

    caught: list[BaseException] = []

    async def main() -> None:
        d = Dispatcher(Registry([_tool("make", make)]), max_concurrent=1)
        try:
            await d.session("s").dispatch([_call(f"c{i}", "make", {"n": i}) for i in range(4)])
        except DispatchInterrupted as exc:
            caught.append(exc)

    _on(backend, main)
    assert len(caught) == 1 and len(refs) == 3
    gc.collect()
    assert [r() is not None for r in refs] == [False, False, False]


def _constructors() -> tuple[Any, Any]:
    """The kernel's constructors of ToolContext and ToolResult for every call."""
    return new_context, new_result


def _made() -> list[tuple[Any, Any]]:
    """Pairs of (made by the kernel's constructors, made by the class), every field set."""
    new_context, new_result = _constructors()

    host = object()
    return [
        (
            new_result("c", "n", Status.ok, "t", False, True, False, True, 1.5, 0.25),
            ToolResult("c", "n", Status.ok, "t", False, True, False, True, 1.5, 0.25),
        ),
        (
            new_result("c", "n", Status.failed, "", True, False, True, False, None, 0.0),
            ToolResult("c", "n", Status.failed, "", True, False, True, False),
        ),
        (new_context("c", "n", 1, 2, 3.5, None), ToolContext("c", "n", 1, 2, 3.5, None)),
        (new_context("c", "n", 1, 2, None, host), ToolContext("c", "n", 1, 2, None, host)),  # type: ignore[arg-type]
    ]


def test_made_values_copy_pickle_and_evolve_as_the_classes_own() -> None:
    for made, own in _made():
        assert type(made) is type(own) and made.__class__ is own.__class__
        assert made == own and hash(made) == hash(own) and repr(made) == repr(own)
        assert made.__reduce_ex__(4)[1:] == own.__reduce_ex__(4)[1:]
        if made.__class__ is ToolResult:
            for protocol in range(pickle.HIGHEST_PROTOCOL + 1):
                assert pickle.dumps(made, protocol) == pickle.dumps(own, protocol)
                assert pickle.loads(pickle.dumps(made, protocol)) == own
        for copied in (copy.copy(made), copy.deepcopy(made), attrs.evolve(made)):
            assert type(copied) is type(own) and copied == own
        assert attrs.asdict(made, recurse=False) == attrs.asdict(own, recurse=False)
        assert attrs.astuple(made, recurse=False) == attrs.astuple(own, recurse=False)
        assert dir(made) == dir(own)
        assert gc.is_tracked(made) == gc.is_tracked(own)
        assert gc.get_referents(made)[-1] is type(own)
        assert made.__sizeof__() == own.__sizeof__()
        assert weakref.ref(made)() is made
        first = attrs.fields(type(own))[0].name
        with pytest.raises(attrs.exceptions.FrozenInstanceError):
            setattr(made, first, "x")
        with pytest.raises(attrs.exceptions.FrozenInstanceError):
            delattr(made, first)
        with pytest.raises(AttributeError):
            made.__dict__  # noqa: B018  # slotted: no dict
    made = _made()[0][0]
    ref = weakref.ref(made)
    del made
    assert ref() is None  # let go as its last reference goes, no collection needed


def test_users_subclass_the_result_classes_as_before() -> None:
    @attrs.frozen
    class Tagged(ToolResult):
        tag: str = ""

    class Plain(ToolResult):
        pass

    tagged = Tagged("c", "n", Status.ok, "t", tag="x")
    assert tagged != ToolResult("c", "n", Status.ok, "t") and tagged.tag == "x"
    plain = Plain("c", "n", Status.ok, "t")
    assert type(plain) is Plain and isinstance(plain, ToolResult)
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        plain.content = "u"  # type: ignore[misc]


def test_made_values_are_their_own_on_every_thread() -> None:
    new_context, new_result = _constructors()

    wrong: list[int] = []

    def work(offset: int) -> None:
        for i in range(offset, offset + 5000):
            result = new_result(str(i), "n", Status.ok, "t", False, False, False, False, None, 0.0)
            ctx = new_context(str(i), "n", i, 1, None, None)
            if type(result) is not ToolResult or result.call_id != str(i) or type(ctx) is not ToolContext:
                wrong.append(i)

    threads = [threading.Thread(target=work, args=(k * 5000,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert wrong == []
