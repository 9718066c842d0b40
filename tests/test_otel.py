"""dispatcher.otel with the SDK's in-memory exporter: a span per call (served or decided
ones too) under a span per batch, the GenAI attributes, content only when asked for, and
the trace context for MCP."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator, Mapping
from typing import Any

import anyio
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from cache import MemoryResultCache
from dispatcher import CachePolicy, Deny, Dispatcher, Interrupt, Registry, Tool, ToolCall
from dispatcher.otel import instrument, mcp_meta


@pytest.fixture
def traced() -> Iterator[tuple[TracerProvider, InMemorySpanExporter]]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield provider, exporter
    provider.shutdown()


TEXT = {"type": "object", "properties": {"text": {"type": "string"}}}


def _registry() -> Registry:
    async def echo(args: Mapping[str, Any], ctx: Any) -> str:
        await anyio.sleep(0.01)
        return str(args["text"])

    async def boom(args: Mapping[str, Any], ctx: Any) -> str:
        raise RuntimeError("the tool broke")

    async def hang(args: Mapping[str, Any], ctx: Any) -> str:
        await anyio.sleep_forever()
        raise AssertionError("unreachable")

    return Registry(
        [
            Tool("echo", "Echo the text.", echo, TEXT, concurrent=True, deferred=False),
            Tool("boom", "Always fails.", boom, {"type": "object"}, concurrent=True, deferred=False),
            Tool("hang", "Never returns.", hang, {"type": "object"}, concurrent=True, deferred=False),
            Tool("risky", "Needs approval.", echo, TEXT, deferred=False, confirm=True),
            Tool("page", "A cached page.", echo, TEXT, deferred=False, cache=CachePolicy(ttl=60)),
        ]
    )


def _calls(spans: tuple[ReadableSpan, ...]) -> dict[str, ReadableSpan]:
    return {str(s.attributes["gen_ai.tool.call.id"]): s for s in spans if s.name.startswith("execute_tool")}


def _batches(spans: tuple[ReadableSpan, ...]) -> list[ReadableSpan]:
    return [s for s in spans if s.name == "threepass batch"]


async def test_each_call_gets_a_genai_span_under_its_batch_span(
    traced: tuple[TracerProvider, InMemorySpanExporter],
) -> None:
    """A batch makes one span per call — named execute_tool {name}, kind INTERNAL, with the
    GenAI attributes — whose parent is the batch's span, itself under the caller's span."""
    provider, exporter = traced
    d = Dispatcher(_registry())
    instrument(d, tracer_provider=provider)
    with provider.get_tracer("test").start_as_current_span("agent turn") as outer:
        results = await d.session("s1").dispatch([ToolCall("c1", "echo", {"text": "hi"})])
    spans = exporter.get_finished_spans()
    (batch,) = _batches(spans)
    span = _calls(spans)["c1"]
    assert span.name == "execute_tool echo" and span.kind is SpanKind.INTERNAL
    assert dict(span.attributes or {}) == {
        "gen_ai.operation.name": "execute_tool",
        "gen_ai.tool.name": "echo",
        "gen_ai.tool.call.id": "c1",
        "gen_ai.tool.description": "Echo the text.",
        "gen_ai.tool.type": "function",
        "gen_ai.conversation.id": "s1",
        "threepass.served_by": "ran",
        "threepass.status": "ok",
    }
    assert span.status.status_code is StatusCode.UNSET
    assert span.parent is not None and span.parent.span_id == batch.context.span_id
    assert batch.parent is not None and batch.parent.span_id == outer.get_span_context().span_id
    assert span.context.trace_id == outer.get_span_context().trace_id
    started = results[0].started
    assert started is not None
    assert span.start_time == int(started * 1e9)
    assert span.end_time is not None and span.end_time - span.start_time >= 9_000_000  # it slept 10 ms


async def test_the_batch_span_carries_the_pass_timings_within_its_own_time(
    traced: tuple[TracerProvider, InMemorySpanExporter],
) -> None:
    """The batch span has its session, run, round, call count and outcome, and three pass
    timings whose sum is its length; its calls' spans lie inside it."""
    provider, exporter = traced
    d = Dispatcher(_registry())
    instrument(d, tracer_provider=provider)
    await d.session("s1").dispatch(
        [ToolCall("c1", "echo", {"text": "a"}), ToolCall("c2", "echo", {"text": "b"})]
    )
    spans = exporter.get_finished_spans()
    (batch,) = _batches(spans)
    a = dict(batch.attributes or {})
    assert {
        k: a[k] for k in ("threepass.session.id", "threepass.run", "threepass.round", "threepass.calls")
    } == {
        "threepass.session.id": "s1",
        "threepass.run": 1,
        "threepass.round": 1,
        "threepass.calls": 2,
    }
    assert a["threepass.outcome"] == "ok"
    timings = [float(a[f"threepass.pass{n}.duration"]) for n in (1, 2, 3)]  # type: ignore[arg-type]
    assert all(t >= 0 for t in timings) and timings[1] >= 0.009  # echo sleeps 10 ms
    assert batch.start_time is not None and batch.end_time is not None
    assert abs((batch.end_time - batch.start_time) - sum(timings) * 1e9) < 1000  # ns, rounding only
    for span in _calls(spans).values():
        assert span.start_time is not None and span.end_time is not None
        assert batch.start_time <= span.start_time <= span.end_time <= batch.end_time + 1_000_000


async def test_deduped_cached_denied_expired_and_failed_calls_have_spans_saying_so(
    traced: tuple[TracerProvider, InMemorySpanExporter],
) -> None:
    """Calls that never ran get spans too, with served_by saying how they were answered;
    every result that is not ok sets error.type to its status and an error status."""
    provider, exporter = traced
    d = Dispatcher(_registry(), cache=MemoryResultCache(), gate=lambda call, ctx: Deny("not today"))
    instrument(d, tracer_provider=provider)
    s = d.session("s1")
    await s.dispatch([ToolCall("warm", "page", {"text": "p"})])
    await s.dispatch(
        [
            ToolCall("c1", "echo", {"text": "x"}),
            ToolCall("c2", "echo", {"text": "x"}),  # served from c1
            ToolCall("c3", "boom", {}),
            ToolCall("c4", "risky", {"text": "y"}),  # the gate denies it
            ToolCall("c5", "nope", {}),  # no such tool
        ]
    )
    s.new_run()
    await s.dispatch([ToolCall("c6", "page", {"text": "p"})])  # the result cache answers
    s.new_run(deadline=anyio.current_time() - 1)
    await s.dispatch([ToolCall("c7", "echo", {"text": "late"})])
    spans = _calls(exporter.get_finished_spans())
    seen = {
        cid: (
            span.attributes["threepass.served_by"],  # type: ignore[index]
            span.attributes["threepass.status"],  # type: ignore[index]
            span.attributes.get("error.type"),  # type: ignore[union-attr]
            span.status.status_code,
        )
        for cid, span in spans.items()
    }
    assert seen == {
        "warm": ("ran", "ok", None, StatusCode.UNSET),
        "c1": ("ran", "ok", None, StatusCode.UNSET),
        "c2": ("deduped", "ok", None, StatusCode.UNSET),
        "c3": ("ran", "failed", "failed", StatusCode.ERROR),
        "c4": ("decided", "denied", "denied", StatusCode.ERROR),
        "c5": ("decided", "rejected", "rejected", StatusCode.ERROR),
        "c6": ("cached", "ok", None, StatusCode.UNSET),
        "c7": ("decided", "expired", "expired", StatusCode.ERROR),
    }
    assert spans["c3"].status.description == "RuntimeError: the tool broke"
    assert "gen_ai.tool.description" not in (spans["c5"].attributes or {})


async def test_arguments_and_results_are_recorded_only_when_opted_in_and_redacted(
    traced: tuple[TracerProvider, InMemorySpanExporter],
) -> None:
    """By default no span holds a call's arguments or result; with capture_content=True
    they are there, with credentials redacted in both (a secret's value wherever it appears)."""
    provider, exporter = traced
    secret = "sk-live-0123456789abcdef"
    d = Dispatcher(_registry())
    stop = instrument(d, tracer_provider=provider)
    s = d.session("s1")
    await s.dispatch([ToolCall("c1", "echo", {"text": "plain"})])
    stop()
    instrument(d, tracer_provider=provider, capture_content=True)
    await s.dispatch([ToolCall("c2", "echo", {"text": secret, "api_key": secret})])
    spans = _calls(exporter.get_finished_spans())
    assert set(spans) == {"c1", "c2"}  # one span each: the first instrumentation stopped
    plain = spans["c1"].attributes or {}
    assert "gen_ai.tool.call.arguments" not in plain and "gen_ai.tool.call.result" not in plain
    captured = spans["c2"].attributes or {}
    assert '"text": "' in str(captured["gen_ai.tool.call.arguments"])
    assert captured["gen_ai.tool.call.result"] != ""
    assert secret not in str(captured["gen_ai.tool.call.arguments"])
    assert secret not in str(captured["gen_ai.tool.call.result"])


async def test_a_cancelled_batch_ends_its_unfinished_calls_spans_with_an_error(
    traced: tuple[TracerProvider, InMemorySpanExporter],
) -> None:
    """When the caller cancels a batch, the call that finished has its span, the one cut
    short ends with error.type "cancelled", and the batch span ends with an error."""
    provider, exporter = traced
    d = Dispatcher(_registry())
    instrument(d, tracer_provider=provider)
    with anyio.move_on_after(0.3):
        await d.session("s1").dispatch([ToolCall("c1", "echo", {"text": "x"}), ToolCall("c2", "hang", {})])
    spans = exporter.get_finished_spans()
    (batch,) = _batches(spans)
    calls = _calls(spans)
    assert (batch.status.status_code, (batch.attributes or {})["error.type"]) == (
        StatusCode.ERROR,
        "cancelled",
    )
    assert calls["c1"].status.status_code is StatusCode.UNSET
    hung = calls["c2"]
    assert hung.status.status_code is StatusCode.ERROR
    assert dict(hung.attributes or {})["error.type"] == "cancelled"
    assert dict(hung.attributes or {})["threepass.status"] == "unfinished"


async def test_a_gate_interrupt_makes_an_interrupted_batch_span_and_no_call_spans(
    traced: tuple[TracerProvider, InMemorySpanExporter],
) -> None:
    """A batch a gate interrupted ran nothing: its span says "interrupted" (not an error),
    and its calls get their spans when the resumed batch answers them."""
    provider, exporter = traced
    d = Dispatcher(_registry(), gate=lambda call, ctx: Interrupt("ask"))
    instrument(d, tracer_provider=provider)
    s = d.session("s1")
    with pytest.raises(Exception, match="interrupt"):
        await s.dispatch([ToolCall("c1", "risky", {"text": "x"})])
    spans = exporter.get_finished_spans()
    (batch,) = _batches(spans)
    assert (batch.attributes or {})["threepass.outcome"] == "interrupted"
    assert batch.status.status_code is StatusCode.UNSET and _calls(spans) == {}


def test_mcp_meta_is_the_current_trace_context_as_traceparent(
    traced: tuple[TracerProvider, InMemorySpanExporter],
) -> None:
    """Inside a span, mcp_meta() gives the W3C traceparent of that span; outside, nothing."""
    provider, _ = traced
    assert mcp_meta() == {}
    with provider.get_tracer("test").start_as_current_span("call") as span:
        meta = mcp_meta()
    ctx = span.get_span_context()
    assert meta["traceparent"] == f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{ctx.trace_flags:02x}"
    assert trace.get_current_span() is trace.INVALID_SPAN


def test_importing_the_kernel_imports_no_opentelemetry() -> None:
    """`import dispatcher` loads no opentelemetry module."""
    code = "import sys, dispatcher; print([m for m in sys.modules if m.startswith('opentelemetry')])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
