"""Promises tried hard: arguments text whose secrets hide from the recorder's rule for
unparsed text, the executor's one-frame paths against the general one, settings changed
between batches, a session's turns, and replay run again and again."""

from __future__ import annotations

import contextlib
import json
import random
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import anyio
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dispatcher import Dispatcher, DispatchInterrupted, HookBlocked, Registry, Tool, ToolError, replay
from dispatcher._credentials import redact_json_text
from dispatcher._execute import HookSet

from ._fakes import call, openai_call
from ._fakes import raiser as _raiser
from ._fakes import swallow as _swallow

SECRET = "hunter2hunter2Secret"


# --- secrets in arguments text the json module does not read ------------------------------

UNPARSED = [
    '{"\\u0074oken": "%s", ',  # a credential name spelled with escapes
    '{"pass\\u0077ord": "%s", ',
    '{"tok\\u0065n"  :\t"%s"',
    '{"api_key": {"value": "%s"}, ',  # a credential's value that is an object
    '{"password": ["%s", ',  # or an array
    '{"headers": [["Authorization", "Bearer %s"]], ',  # a credential header as a pair
    '{"url": "https:\\/\\/user:%s@example.com/", ',  # a URL with its slashes escaped
    '{"url": "https://example.com/?acc\\u0065ss_token=%s", ',
    '{"url": "https://example.com/", "body": "{\\"password\\": \\"%s\\"", "x": 1}',  # a body cut short
    '{"url": "https://user:%s',  # cut before the @ that makes it user info
    '{"url": "https://example.com/", "body": "a=1&client_secret=%s',  # a form body
]


@pytest.mark.parametrize("text", UNPARSED)
def test_unparsed_arguments_text_keeps_no_secret(text: str) -> None:
    """Whatever way the text spells a credential's name or value, the secret is not in it."""
    out, secrets = redact_json_text(text % SECRET)
    assert SECRET not in out
    assert secrets


def test_numbers_under_a_credential_in_unparsed_text_stay_numbers() -> None:
    """A number's stand-in is digits: the text still fails to read where it did."""
    out, _ = redact_json_text('{"otp": 987654, "x": ')
    assert out == '{"otp": 100000, "x": '


def test_a_long_unparsed_text_is_read_in_linear_time() -> None:
    """A long run of letters is not scanned again from each of its letters for a URL scheme."""
    text = '{"key": 1, "q": "' + "a" * 200_000
    began = time.perf_counter()
    redact_json_text(text)
    assert time.perf_counter() - began < 1.0


async def test_unparsed_arguments_text_records_no_secret_and_replays(tmp_path: Path) -> None:
    """Every such text reaches the recording without its secret, and the recording replays."""
    schema = {"type": "object", "properties": {"headers": {}, "url": {"type": "string"}}}

    async def fetch(args: Mapping[str, Any], ctx: Any) -> str:
        return "fetched"

    def registry() -> Registry:
        return Registry([Tool("fetch", "Fetch.", fetch, schema, deferred=False)])

    # texts that fail inside a secret (a bad escape, a control character, a bad \\u, a
    # bare word) or in a number under a credential's name: the stand-ins fail alike
    failing = [
        '{"token": "%s\\x", "q": 1}',
        '{"token": "%s\n", "q": 1}',
        '{"token": "\\u12%s", "q": 1}',
        '{"url": "https://u:%s@h/\\x", "q": 1}',
        '{"token": %s, "q": 1}',
        '{"otp": 12x34, "q": 1}',
        '{"otp": -0.5e, "q": 1}',
        '{"otp": 0123, "q": 1}',
    ]
    texts = [*UNPARSED, *failing, '{"otp": 987654, "x": ', '{"pin": 4321']
    path = tmp_path / "s.jsonl"
    s = Dispatcher(registry()).session("s", record=path, mode="direct")
    for n, text in enumerate(texts):
        await s.dispatch([openai_call(f"c{n}", "fetch", text.replace("%s", SECRET))])
    s.close()
    assert SECRET not in path.read_text()
    assert "987654" not in path.read_text()
    report = await replay(path, Dispatcher(registry()))
    assert report.ok and report.calls == len(texts), report


_NAMES = st.sampled_from(["api_key", "token", "password", "Authorization", "X-Api-Key", "session"])
_PLAIN = st.sampled_from(["q", "path", "n", "items"])


def _escaped(name: str, picks: list[bool]) -> str:
    """`name` as JSON text with some of its letters spelled as unicode escapes."""
    return "".join(f"\\u{ord(c):04x}" if pick else c for c, pick in zip(name, picks, strict=False))


@settings(max_examples=150, deadline=None)
@given(
    name=_NAMES,
    picks=st.lists(st.booleans(), min_size=16, max_size=16),
    before=st.dictionaries(_PLAIN, st.integers() | st.text(max_size=5), max_size=3),
    wrap=st.sampled_from(["{}", "[]", "plain", "nested"]),
    space=st.sampled_from(["", " ", "\n\t", "  \r\n"]),
    cut=st.integers(min_value=0, max_value=40),
)
def test_a_secret_under_a_credential_name_never_survives(
    name: str, picks: list[bool], before: dict[str, Any], wrap: str, space: str, cut: int
) -> None:
    """Arguments text with a secret under a credential's name (spelled with escapes or not,
    at any depth, with any JSON space), whole or cut short after the secret, keeps no secret."""
    value = {"{}": {"v": SECRET}, "[]": [SECRET], "plain": SECRET, "nested": {"a": [{"b": SECRET}]}}[wrap]
    inner = json.dumps(value, separators=(",", ":" + space))
    body = ", ".join(f"{json.dumps(k)}:{space}{json.dumps(v)}" for k, v in before.items())
    key = '"' + _escaped(name, picks) + '"'
    text = "{" + body + (", " if body else "") + key + space + ":" + space + inner + ', "tail": "x"}'
    end = text.index(SECRET) + len(SECRET) + 1 + cut
    for candidate in (text, text[:end]):
        out, _ = redact_json_text(candidate)
        assert SECRET not in out, (candidate, out)


async def test_arguments_that_are_not_an_object_quote_no_part_of_a_secret(tmp_path: Path) -> None:
    """The error for arguments that are not an object quotes their start: a secret cut there
    is not whole, so it would not be found in the result; and JSON given as a JSON text
    (encoded twice) is read for secrets too. Neither reaches the recording; both replay."""
    long_secret = "sk-" + "q7" * 60

    async def fetch(args: Mapping[str, Any], ctx: Any) -> str:
        return "fetched"

    def registry() -> Registry:
        return Registry([Tool("fetch", "Fetch.", fetch, {"type": "object"}, deferred=False)])

    texts = [json.dumps([{"api_key": long_secret}]), json.dumps(json.dumps({"api_key": SECRET}))]
    path = tmp_path / "s.jsonl"
    s = Dispatcher(registry()).session("s", record=path, mode="direct")
    for n, text in enumerate(texts):
        results = await s.dispatch([openai_call(f"c{n}", "fetch", text)])
        assert results[0].status.value == "invalid_arguments"
        assert long_secret[:20] not in results[0].content
    s.close()
    recorded = path.read_text()
    assert long_secret[:20] not in recorded and SECRET not in recorded
    report = await replay(path, Dispatcher(registry()))
    assert report.ok and report.calls == len(texts), report


# --- pass 2's fast paths answer as the general one --------------------------------------------


def _returner(value: Any) -> Any:
    async def handler(args: Mapping[str, Any], ctx: Any) -> Any:
        await anyio.lowlevel.checkpoint()
        return value

    return handler


HANDLERS: dict[str, Any] = {
    "fine": _returner("fine"),
    "bytes": _returner(b"\xff\x00raw"),
    "mapping": _returner({"a": [1, 2]}),
    "none": _returner(None),
    "huge": _returner("x" * 5000),
    "accented": _returner("h\u00e9llo " * 50),
    "surrogate": _returner("a\ud800b"),
    "swallow": _swallow,
    "tool_error": _raiser(ToolError("nope", retryable=False)),
    "value_error": _raiser(ValueError("bad")),
    "exit": _raiser(SystemExit(3)),
    "generator_exit": _raiser(GeneratorExit()),
    "blocked": _raiser(HookBlocked("stop here")),
    "interrupted": _raiser(DispatchInterrupted([])),
    "keyboard": _raiser(KeyboardInterrupt()),
    "keyboard_group": _raiser(BaseExceptionGroup("g", [KeyboardInterrupt()])),
}


class _Nothing:
    """A hook that does nothing: its presence alone sends every call the general way."""

    def after(self, call: Any, result: Any, ctx: Any) -> None:
        return None


def _fast_registry(*, concurrent: bool = True) -> Registry:
    """The handlers above; only `swallow` has a short timeout (the others must not meet theirs)."""
    return Registry(
        [
            _tool(n, h, timeout=0.05 if n == "swallow" else 10.0, concurrent=concurrent)
            for n, h in HANDLERS.items()
        ]
    )


def _tool(name: str, handler: Any, *, concurrent: bool = True, **extra: Any) -> Tool:
    return Tool(name, name, handler, {"type": "object"}, concurrent=concurrent, deferred=False, **extra)


async def _outcome(d: Dispatcher, names: list[str]) -> tuple[Any, ...]:
    """What a batch of `names` gives: each result's status and content, or what it raised;
    and the limiter, which must be whole again."""
    s = d.session()
    try:
        results = await s.dispatch([call(f"c{n}", name) for n, name in enumerate(names)])
        got: Any = tuple((r.status.value, r.content) for r in results)
    except BaseException as exc:  # run control is what is compared
        got = type(exc).__name__
    assert d.limiter.borrowed_tokens == 0, names
    stats = d.statistics()
    assert (stats.in_use, stats.waiting) == (0, 0), names
    return got, tuple((e.call_id, e.result.status.value, e.result.content) for e in s.history)


@pytest.mark.parametrize("limit", [1, 2])
@pytest.mark.parametrize("concurrent", [True, False])
@pytest.mark.parametrize("name", list(HANDLERS))
async def test_the_fast_paths_answer_as_the_general_one(name: str, concurrent: bool, limit: int) -> None:
    """A call started on the batch's task (`_first_steps`, then `_rest` once it waited: run
    alone, or in a group at a limit of 1) and a worker's kept-slot call (`_run_kept`: a limit
    of 2 and a call before it that waits, beside which a worker starts) give what the
    general path gives (a hook that does nothing forces it); calls that are not concurrent
    each run alone, in groups of their own."""
    registry = _fast_registry(concurrent=concurrent)
    fast = Dispatcher(registry, max_concurrent=limit, max_output_bytes=2000)
    general = Dispatcher(registry, max_concurrent=limit, max_output_bytes=2000, hooks=[_Nothing()])
    for names in ([name], ["fine", name], ["fine", name, "fine"]):
        assert await _outcome(fast, names) == await _outcome(general, names), names


async def test_a_swallowed_cancellation_is_timed_out_on_a_mock_clock(autojump_clock: Any) -> None:
    """On trio's MockClock (where few real seconds pass) a call that swallows its cut and
    returns after its deadline is timed_out, run alone and on a kept slot alike."""
    d = Dispatcher(_fast_registry(), max_concurrent=1)
    s = d.session()
    for names in (["swallow"], ["fine", "swallow", "fine"]):
        results = await s.dispatch([call(f"m{n}{len(names)}", name) for n, name in enumerate(names)])
        assert [r.status.value for r in results] == ["timed_out" if n == "swallow" else "ok" for n in names]
    assert d.limiter.borrowed_tokens == 0


async def test_the_block_watch_names_a_tool_holding_the_loop_on_either_fast_path(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A handler that holds the loop past `block_threshold` is reported by name, run alone
    and on a worker's kept slot."""

    async def hog(args: Mapping[str, Any], ctx: Any) -> str:
        time.sleep(0.08)  # noqa: ASYNC251 - holding the loop is the point
        return "held"

    registry = Registry([_tool("hog", hog), _tool("fine", HANDLERS["fine"])])
    d = Dispatcher(registry, max_concurrent=1, block_threshold=0.03)
    s = d.session()
    caplog.set_level("WARNING", logger="threepass.execute")
    await s.dispatch([call("a", "hog")])
    await anyio.sleep(0.05)  # the report comes as the loop runs the probe again
    await s.dispatch([call("b", "fine"), call("c", "hog", n=2)])  # other arguments: not deduped
    await anyio.sleep(0.05)
    named = [r.getMessage() for r in caplog.records if "held the event loop" in r.getMessage()]
    assert any("hog (call a)" in m for m in named), named
    assert any("hog (call c)" in m for m in named), named
    assert d.statistics().loop_blocks == 2


# --- an executor copied from the last one: settings changed between batches ----------------


async def test_settings_changed_between_batches_hold_for_the_next_batch() -> None:
    """`d.timeout`, `d.max_output_bytes`, the hooks and `d.runner`, each changed between
    batches, are what the next batch runs under (and changed back, the old ones again)."""

    async def slow(args: Mapping[str, Any], ctx: Any) -> str:
        await anyio.sleep(0.02 if args["n"] != 3 else 0.5)  # the one under a short timeout waits long
        return "y" * 3000

    seen: list[str] = []

    class Audit:
        def after(self, c: Any, result: Any, ctx: Any) -> None:
            seen.append(c.id)

    async def scripted(c: Any, ctx: Any) -> str:
        return "scripted"

    d = Dispatcher(Registry([_tool("slow", slow)]), max_output_bytes=100_000)
    s = d.session()
    n = iter(range(100))

    async def run() -> Any:
        (result,) = await s.dispatch([call(f"c{next(n)}", "slow", n=next(n))])
        return result

    assert (await run()).status.value == "ok"
    d.timeout = 0.02
    assert (await run()).status.value == "timed_out"
    d.timeout = 30.0
    d.max_output_bytes = 1000
    cut = await run()
    assert cut.status.value == "ok" and cut.content.startswith("y" * 1000 + "\n")
    d.max_output_bytes = 100_000
    assert len((await run()).content) >= 3000
    d.hook_set = HookSet.of([Audit()])
    await run()
    assert len(seen) == 1
    d.hook_set = HookSet.of([])
    await run()
    assert len(seen) == 1
    d.runner = scripted
    assert (await run()).content == "scripted"
    d.runner = None
    assert (await run()).content == "y" * 3000
    assert d.limiter.borrowed_tokens == 0


# --- a session's turns -----------------------------------------------------------------------


async def _round(
    one: Any,
    arrived: set[int],
    scopes: dict[int, anyio.CancelScope],
    cancelled: set[int],
    order: list[int],
    rng: random.Random,
) -> None:
    """Start 30 dispatches, each queued before the next starts, cutting some short at random."""
    async with anyio.create_task_group() as tg:
        for n in range(30):
            tg.start_soon(one, n)
            while n not in arrived:
                await anyio.lowlevel.checkpoint()
            if rng.random() < 0.4:
                # often the next in line (whose turn may be coming as it is cut), else any
                waiting = [m for m in range(n + 1) if m not in cancelled and m not in order]
                victim = waiting[0] if waiting and rng.random() < 0.5 else rng.randrange(n + 1)
                cancelled.add(victim)
                scopes[victim].cancel()
            for _ in range(rng.randrange(3)):
                await anyio.lowlevel.checkpoint()


async def test_turns_stay_first_come_first_served_under_random_cancellations() -> None:
    """Many dispatches on one session, some cut short while they wait, as their turn comes
    or as they run (a seeded choice): batches never overlap, all that are not cut short run,
    in the order they came, and the session is free at the end."""
    rng = random.Random(20261201)
    running: list[int] = []
    order: list[int] = []

    async def step(args: Mapping[str, Any], ctx: Any) -> str:
        running.append(args["n"])
        assert len(running) == 1, running  # one batch at a time
        order.append(args["n"])
        try:
            for _ in range(args["n"] % 3):
                await anyio.lowlevel.checkpoint()
        finally:
            running.remove(args["n"])
        return "stepped"

    d = Dispatcher(Registry([_tool("step", step)]))
    s = d.session()
    for round_ in range(4):
        arrived: set[int] = set()
        cancelled: set[int] = set()
        scopes = {n: anyio.CancelScope() for n in range(30)}

        async def one(
            n: int,
            scopes: dict[int, anyio.CancelScope] = scopes,
            arrived: set[int] = arrived,
            r: int = round_,
        ) -> None:
            with scopes[n]:
                arrived.add(n)  # nothing awaits between this and taking a place in the queue
                await s.dispatch([call(f"r{r}n{n}", "step", n=n, round=r)])

        with anyio.fail_after(10):  # a lost turn would leave the rest waiting for ever
            await _round(one, arrived, scopes, cancelled, order, rng)
        assert order == sorted(order), order
        assert set(range(30)) - cancelled <= set(order), (round_, order)
        assert s._turns.waiting == 0 and not s._turns.taken
        order.clear()
    assert d.limiter.borrowed_tokens == 0
    assert (await s.dispatch([call("last", "step", n=99)]))[0].status.value == "ok"


async def test_a_handler_invoking_into_its_own_session_does_not_wait_for_a_turn() -> None:
    """`ctx.invoke` from a handler into the batch's own session, two deep, run alone, on a
    kept slot and from a task the handler starts, at a limit of 1: none waits for the turn
    its own batch holds."""

    async def leaf(args: Mapping[str, Any], ctx: Any) -> str:
        await anyio.lowlevel.checkpoint()
        return f"leaf {args['n']}"

    async def middle(args: Mapping[str, Any], ctx: Any) -> str:
        inner = await ctx.invoke("leaf", {"n": args["n"]})
        return f"middle({inner.content})"

    async def top(args: Mapping[str, Any], ctx: Any) -> str:
        got: list[str] = []

        async def side() -> None:
            got.append((await ctx.invoke("middle", {"n": args["n"] + 100})).content)

        async with anyio.create_task_group() as tg:
            tg.start_soon(side)
            got.append((await ctx.invoke("middle", {"n": args["n"]})).content)
        return " ".join(sorted(got))

    registry = Registry([_tool("leaf", leaf), _tool("middle", middle), _tool("top", top)])
    d = Dispatcher(registry, max_concurrent=1)
    s = d.session()
    with anyio.fail_after(5):
        (alone,) = await s.dispatch([call("a", "top", n=1)])
        group = await s.dispatch([call("b", "top", n=2), call("c", "top", n=3)])
    assert alone.content == "middle(leaf 1) middle(leaf 101)"
    assert [r.content for r in group] == [
        "middle(leaf 102) middle(leaf 2)",
        "middle(leaf 103) middle(leaf 3)",
    ]
    assert d.limiter.borrowed_tokens == 0


async def test_a_tools_keyboard_interrupt_hands_the_turn_to_those_waiting() -> None:
    """A tool's KeyboardInterrupt ends its batch (committed, then raised); the dispatches
    waiting behind it then run, in order."""
    order: list[str] = []
    release = anyio.Event()

    async def work(args: Mapping[str, Any], ctx: Any) -> str:
        order.append(args["name"])
        if args["name"] == "first":
            await release.wait()
            raise KeyboardInterrupt
        return "worked"

    d = Dispatcher(Registry([_tool("work", work)]), max_concurrent=1)
    s = d.session()
    raised: list[str] = []

    async def one(name: str) -> None:
        try:
            await s.dispatch([call(name, "work", name=name), call(name + "-2", "work", name=name + "-2")])
        except KeyboardInterrupt:
            raised.append(name)

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            for name in ("first", "second", "third"):
                tg.start_soon(one, name)
                await _until_waiting(s, name)
            release.set()
    assert raised == ["first"]
    assert order == ["first", "first-2", "second", "second-2", "third", "third-2"]
    assert [e.call_id for e in s.history] == ["first-2", "second", "second-2", "third", "third-2"]
    assert d.limiter.borrowed_tokens == 0 and not s._turns.taken


async def _until_waiting(s: Any, name: str) -> None:
    """Until the dispatch just started has its place: it runs, or it waits for its turn."""
    want = {"first": 0, "second": 1, "third": 2}[name]
    while not (s._turns.taken and s._turns.waiting == want):
        await anyio.lowlevel.checkpoint()


# --- the limiter's accounting with sessions competing -----------------------------------------


@pytest.mark.parametrize("limit", [1, 2])
async def test_two_sessions_at_a_small_limit_leave_the_limiter_whole(limit: int) -> None:
    """Two sessions compete for 1 or 2 slots with batches of every kind of call (lone ones,
    groups a worker runs on a kept slot, timeouts, failures, run control), some batches cut
    from outside mid-call (a seeded choice): after each round every slot is back."""
    rng = random.Random(limit)
    names = ["fine", "swallow", "value_error", "tool_error", "mapping", "huge", "blocked", "keyboard"]
    d = Dispatcher(_fast_registry(), max_concurrent=limit, max_output_bytes=2000)
    sessions = [d.session("left"), d.session("right")]
    counter = iter(range(10_000))

    async def batch(s: Any) -> None:
        picked = [rng.choice(names) for _ in range(rng.choice([1, 1, 2, 3, 4]))]
        calls = [call(f"k{next(counter)}", name, n=next(counter)) for name in picked]
        with anyio.CancelScope() as scope:
            if rng.random() < 0.3:
                scope.deadline = anyio.current_time() + rng.choice([0.0, 0.001, 0.01, 0.03])
            with contextlib.suppress(KeyboardInterrupt, HookBlocked):  # a tool's run control
                await s.dispatch(calls)

    with anyio.fail_after(20):
        for _ in range(6):
            async with anyio.create_task_group() as tg:
                for s in sessions:
                    for _ in range(3):
                        tg.start_soon(batch, s)
            assert d.limiter.borrowed_tokens == 0
            stats = d.statistics()
            assert (stats.in_use, stats.waiting, stats.stuck) == (0, 0, ())


# --- replay in a session of its own, each time --------------------------------------------------


async def test_replays_run_side_by_side_through_one_dispatcher(tmp_path: Path) -> None:
    """Replays of two recordings, three at a time through one Dispatcher (with a session
    store, and without), each report ok: none finds another's remembered calls or turn."""
    from cache import MemorySessionStore

    async def echo(args: Mapping[str, Any], ctx: Any) -> str:
        await anyio.sleep(0.001)
        return str(args["text"])

    def registry() -> Registry:
        return Registry([_tool("echo", echo)])

    paths = []
    for name in ("a", "b"):
        path = tmp_path / f"{name}.jsonl"
        s = Dispatcher(registry()).session(name, record=path)
        await s.dispatch([call("1", "echo", text="x"), call("2", "echo", text="y")])
        await s.dispatch([call("3", "echo", text="x")])  # deduped in its run
        await s.dispatch([openai_call("4", "echo", {"text": "z", "token": SECRET})])
        s.new_run()
        await s.dispatch([call("5", "echo", text="x")])  # a new run: it runs again
        s.close()
        paths.append(path)
        assert SECRET not in path.read_text()
    for store in (None, MemorySessionStore()):
        d = Dispatcher(registry(), session_store=store)
        namesake = d.session("replay:a")  # a session of the name replay would give: left alone
        await namesake.dispatch([call("1", "echo", text="x")])
        reports: list[Any] = []

        async def one(path: Path, d: Dispatcher = d, reports: list[Any] = reports) -> None:
            reports.append(await replay(path, d))

        async with anyio.create_task_group() as tg:
            for path in [*paths, *paths, paths[0]]:
                tg.start_soon(one, path)
        assert len(reports) == 5
        assert all(r.ok and r.calls == 5 for r in reports), reports
        assert d.limiter.borrowed_tokens == 0
        assert [e.call_id for e in namesake.history] == ["1"]


_CUT_DOCS: list[dict[str, Any]] = [
    {"url": f"https://user:{SECRET}@example.com/?access_token={SECRET}&q=1", "n": 1},
    {"headers": {"Authorization": f"Bearer {SECRET}", "Accept": "text/plain"}, "otp": 918273645},
    {"headers": [["X-Api-Key", SECRET], ["Accept", "*/*"]], "body": json.dumps({"password": SECRET})},
    {"url": "https://example.com/", "body": f"a=1&client_secret={SECRET}"},
    {"nested": {"deeper": [{"api_key": SECRET, "otp": 918273645}]}},
]


def test_arguments_cut_at_any_character_keep_no_whole_secret() -> None:
    """Each of these arguments, cut after any of its characters, keeps no whole secret; and
    what is kept is kept again, unchanged, when redacted once more (its stand-ins stay)."""
    for doc in _CUT_DOCS:
        for text in (json.dumps(doc), json.dumps(doc, indent=1)):
            for spelled in (text, text.replace('"api_key"', '"\\u0061pi_\\u006bey"')):
                for cut in range(1, len(spelled) + 1):
                    out, _ = redact_json_text(spelled[:cut])
                    assert SECRET not in out and "918273645" not in out, spelled[:cut]
                    if spelled is text:  # (a cut through an escape in a secret keeps it, as is)
                        assert redact_json_text(out)[0] == out, out


async def test_arguments_cut_anywhere_record_no_secret_and_replay(tmp_path: Path) -> None:
    """Arguments holding secrets every way the rule knows, cut at every few characters (a
    seeded sample): no whole secret reaches the recording, and it replays without a divergence."""
    rng = random.Random(7)
    pin = 918273645
    texts = []
    for doc in _CUT_DOCS:
        for text in (json.dumps(doc), json.dumps(doc, indent=1), json.dumps(doc, ensure_ascii=True)):
            texts.append(text.replace('"api_key"', '"\\u0061pi_\\u006bey"'))
            for _ in range(6):
                texts.append(text[: rng.randrange(len(text))])

    async def fetch(args: Mapping[str, Any], ctx: Any) -> str:
        return "fetched"

    def registry() -> Registry:
        return Registry([_tool("fetch", fetch)])

    path = tmp_path / "s.jsonl"
    s = Dispatcher(registry()).session("s", record=path, mode="direct")
    for n, text in enumerate(texts):
        await s.dispatch([openai_call(f"c{n}", "fetch", text)])
    s.close()
    recorded = path.read_text()
    assert SECRET not in recorded and str(pin) not in recorded
    report = await replay(path, Dispatcher(registry()))
    assert report.ok and report.calls == len(texts), report
