"""OpenTelemetry: a span per tool call, following the GenAI semantic conventions for tool
execution, under a span per batch that carries the pass timings.

`instrument(dispatcher)` subscribes to the dispatcher's `BatchEvent`s rather than its
hooks, because hooks see only the calls that start: every call of a batch gets its span,
whether it ran, was served again in its run (`deduped`), came from the result cache
(`cached`) or was decided without running (`decided`: denied, rejected, invalid, expired,
a schema returned). A batch is reported once it has committed, so the spans are made then,
with the start and end times the batch measured: a call that ran spans its own run; one
served or decided in pass 1 is an instant at the end of pass 1.

Span `execute_tool {name}`, kind INTERNAL:

    gen_ai.operation.name   "execute_tool"
    gen_ai.tool.name, gen_ai.tool.call.id, gen_ai.tool.description, gen_ai.tool.type
    gen_ai.conversation.id  the session's id
    threepass.served_by     ran | deduped | cached | decided | not_started
    threepass.status        the result's status, or "unfinished" for a call cut short
    error.type              the status of a result that is not ok; for a call the batch
                            never finished, the batch's outcome ("cancelled", "blocked")
    gen_ai.tool.call.arguments, gen_ai.tool.call.result
                            only with `capture_content=True`, credentials redacted by the
                            recording's rule (and their values wherever they appear)

Span `threepass batch`, kind INTERNAL, the parent of its calls' spans and a child of
whatever span is current where `dispatch` was awaited: `threepass.session.id`,
`threepass.run`, `threepass.round`, `threepass.calls`, `threepass.outcome`,
`threepass.pass1.duration`, `threepass.pass2.duration`, `threepass.pass3.duration`
(seconds); a batch cancelled, blocked or cut by an error ends with an error status.

For MCP servers, `mcp_meta()` is the current trace context as a `params._meta` dict. While
a call runs, the current span is the one around `dispatch` (a call's own span is made
after its batch commits), so a server's spans join the trace under that one.

Imports opentelemetry-api (the `threepass[otel]` extra); `import dispatcher` never imports
this module.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping

from opentelemetry import propagate, trace
from opentelemetry.trace import SpanKind, StatusCode, Tracer, TracerProvider
from opentelemetry.util.types import AttributeValue

from ._credentials import credential_values, redact_arguments, redact_text
from ._dispatcher import Dispatcher
from ._types import BatchEvent, ToolCall, ToolResult

__all__ = ["instrument", "mcp_meta"]

_FAILED_OUTCOMES = frozenset({"cancelled", "blocked", "error"})


def instrument(
    dispatcher: Dispatcher,
    *,
    tracer_provider: TracerProvider | None = None,
    capture_content: bool = False,
) -> Callable[[], None]:
    """Make spans for every batch and call of `dispatcher` (the module's docstring lists
    them), with `tracer_provider` or the global one. `capture_content=True` adds each
    call's arguments and result. Returns a function that stops it."""
    tracer = trace.get_tracer("threepass", tracer_provider=tracer_provider)

    def on_batch(event: BatchEvent) -> None:
        _report(tracer, dispatcher, event, capture_content)

    return dispatcher.subscribe_batches(on_batch)


def mcp_meta() -> dict[str, str]:
    """The current trace context as W3C Trace Context entries (`traceparent`, and
    `tracestate` when there is one), by the global propagator: what an MCP `tools/call`
    sends as `params._meta` so the server's spans join this trace. Empty outside a span."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return carrier


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)


def _report(tracer: Tracer, dispatcher: Dispatcher, event: BatchEvent, capture: bool) -> None:
    start = _ns(event.started)
    planned = start + _ns(event.pass1)  # pass 1 over: what was decided, was decided by now
    executed = planned + _ns(event.pass2)
    end = executed + _ns(event.pass3)
    attributes: dict[str, AttributeValue] = {
        "gen_ai.conversation.id": event.session_id,
        "threepass.session.id": event.session_id,
        "threepass.run": event.run_id,
        "threepass.round": event.round,
        "threepass.calls": len(event.calls),
        "threepass.outcome": event.outcome,
        "threepass.pass1.duration": event.pass1,
        "threepass.pass2.duration": event.pass2,
        "threepass.pass3.duration": event.pass3,
    }
    batch = tracer.start_span(
        "threepass batch", kind=SpanKind.INTERNAL, attributes=attributes, start_time=start
    )
    if event.outcome in _FAILED_OUTCOMES:
        batch.set_attribute("error.type", event.outcome)
        batch.set_status(StatusCode.ERROR, f"the batch ended {event.outcome}")
    inside = trace.set_span_in_context(batch)
    for index, call in enumerate(event.calls):
        result = event.results[index]
        ran = index in event.ran
        if result is not None and result.started is not None:
            begun = _ns(result.started)
            done = begun + _ns(result.duration)
        elif result is None:
            begun, done = (planned if ran else executed), executed
        else:
            begun = done = planned
        span = tracer.start_span(
            f"execute_tool {call.name}",
            context=inside,
            kind=SpanKind.INTERNAL,
            attributes=_call_attributes(dispatcher, event, call, result, ran, capture),
            start_time=begun,
        )
        if result is None:
            span.set_attribute("error.type", event.outcome)
            span.set_status(StatusCode.ERROR, f"the call did not finish: the batch ended {event.outcome}")
        elif not result.ok:
            span.set_attribute("error.type", result.status.value)
            failure = result.error() or {}
            span.set_status(StatusCode.ERROR, str(failure.get("error", result.status.value)))
        span.end(end_time=done)
    batch.end(end_time=end)


def _call_attributes(
    dispatcher: Dispatcher,
    event: BatchEvent,
    call: ToolCall,
    result: ToolResult | None,
    ran: bool,
    capture: bool,
) -> dict[str, AttributeValue]:
    if result is not None and result.deduped:
        served = "deduped"
    elif result is not None and result.cached:
        served = "cached"
    elif ran:
        served = "ran"
    elif result is None:
        served = "not_started"
    else:
        served = "decided"
    attributes: dict[str, AttributeValue] = {
        "gen_ai.operation.name": "execute_tool",
        "gen_ai.tool.name": call.name,
        "gen_ai.tool.call.id": call.id,
        "gen_ai.tool.type": "function",
        "gen_ai.conversation.id": event.session_id,
        "threepass.served_by": served,
        "threepass.status": "unfinished" if result is None else result.status.value,
    }
    registered = dispatcher.registry.registered(call.name) or dispatcher.core_registry.registered(call.name)
    if registered is not None:
        attributes["gen_ai.tool.description"] = registered.tool.description
    if capture:
        args = call.arguments
        if isinstance(args, Mapping):
            secrets = credential_values(args)
            shown = json.dumps(redact_arguments(args), ensure_ascii=False, sort_keys=True, default=str)
            # a secret's value is hidden wherever it appears, not only under its own name
            attributes["gen_ai.tool.call.arguments"] = redact_text(shown, secrets)
        else:  # arguments that never parsed: the text the model sent
            attributes["gen_ai.tool.call.arguments"] = args
            secrets = frozenset()
        if result is not None:
            attributes["gen_ai.tool.call.result"] = redact_text(result.content, secrets)
    return attributes
