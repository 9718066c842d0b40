"""Step 3 of pass 1, the rewriters (symfonic's contract, `seeds/symfonic-guide13-...`).

A chain in registration order: None passes the call on, `{"tool_name", "args"}` rewrites
it; a malformed return or a raise is dropped with a logged warning (which names a return's
type and keys, never its values: they may hold a credential); a target outside the
palette drops the rewrite; `call_id` never changes. The session awaits this between
`Planner.parse` and `Planner.lookups`; the planner applies each accepted rewrite.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ._backend import ordinary_failure
from ._execute import _maybe_await
from ._plan import RUN_TOOL, Draft, Planner
from ._results import shown
from ._types import ToolCallDispatchEvent

__all__ = ["rewrite"]

log = logging.getLogger("threepass.session")


def _shape(value: object) -> str:
    """What a rewriter returned, told without its values: they may hold a credential it
    injected in a form the credential rule cannot read (`[("api_key", ...)]` is no
    mapping), and a log is kept at rest. Its type, and a mapping's keys."""
    if isinstance(value, Mapping):
        try:
            keys = [shown(key, 40) for key in list(value)[:10]]
        except Exception:  # a mapping that cannot be walked: its type says enough
            return f"a {type(value).__name__}"
        return f"a {type(value).__name__} with keys {', '.join(keys) or '(none)'}"
    return f"a {type(value).__name__}"


async def rewrite(
    planner: Planner,
    drafts: list[Draft],
    rewriters: Sequence[Callable[..., Any]],
    *,
    state: dict[str, Any],
    session_id: str,
    run_id: int,
    round: int,
) -> None:
    """Symfonic's chain: registration order, None passes, a malformed return or a raise is
    dropped with a warning, a target outside the palette drops the rewrite, call ids stay."""
    palette = planner.palette()
    for draft in drafts:
        if draft.step != "parsed" or draft.args is None:
            continue
        name, args = draft.name, draft.args
        for fn in rewriters:
            event = ToolCallDispatchEvent(
                session_id=session_id,
                run_id=run_id,
                round=round,
                call_id=draft.call_id,
                tool_name=name,
                args=args,
                available_tools=palette,
            )
            try:
                ret = await _maybe_await(fn(event, state))
            except BaseException as exc:
                if not ordinary_failure(exc):
                    raise
                log.warning("rewriter %s raised on call %s; skipped", shown(fn), draft.call_id, exc_info=True)
                continue
            if ret is None:
                continue
            if not isinstance(ret, Mapping) or "tool_name" not in ret or "args" not in ret:
                log.warning(
                    "rewriter %s returned %s, not {'tool_name', 'args'}; dropped", shown(fn), _shape(ret)
                )
                continue
            if not isinstance(ret["tool_name"], str) or not isinstance(ret["args"], Mapping):
                log.warning(
                    "rewriter %s returned tool_name/args of the wrong types: %s and %s, not text "
                    "and a mapping; dropped",
                    shown(fn),
                    type(ret["tool_name"]).__name__,
                    type(ret["args"]).__name__,
                )
                continue
            if "call_id" in ret:
                log.warning(
                    "rewriter %s tried to change call_id of %s; call_id kept", shown(fn), draft.call_id
                )
            try:
                name, args = ret["tool_name"], dict(ret["args"])
            except Exception:
                log.warning(
                    "rewriter %s returned args that cannot be read; dropped", shown(fn), exc_info=True
                )
                continue
        if (name, args) == (draft.name, draft.args):
            continue
        if name not in palette or name == RUN_TOOL:
            # run_tool is unwrapped before rewriters speak: a rewrite to it would run its stub
            log.warning(
                "rewrite of call %s to %r dropped: not a tool a call can be rewritten to",
                draft.call_id,
                name,
            )
            continue
        planner.apply_rewrite(draft, name, args)
