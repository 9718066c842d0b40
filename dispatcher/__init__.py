"""threepass: execute the tool calls of an LLM assistant message, in three passes.

Pass 1 decides every call (parse, unwrap `run_tool`, rewrite, existence, deferred
schemas, dedupe and cache, validation, the confirm gate) before anything runs; pass 2
runs what may run; pass 3 commits outcomes in call order.
"""

from ._dispatcher import Dispatcher, default_limit
from ._exceptions import (
    DispatchInterrupted,
    HookBlocked,
    ToolDefinitionError,
    ToolError,
    UnknownTool,
)
from ._policy import CachePolicy
from ._recording import Divergence, ReplayReport, replay
from ._registry import Registry, Tool
from ._session import Session, SessionStatistics
from ._types import (
    Allow,
    BatchEvent,
    Deny,
    HistoryEntry,
    Interrupt,
    Status,
    ToolCall,
    ToolCallDispatchEvent,
    ToolContext,
    ToolResult,
    ToolResultEvent,
)

__all__ = [
    "Allow",
    "BatchEvent",
    "CachePolicy",
    "Deny",
    "DispatchInterrupted",
    "Dispatcher",
    "Divergence",
    "HistoryEntry",
    "HookBlocked",
    "Interrupt",
    "Registry",
    "ReplayReport",
    "Session",
    "SessionStatistics",
    "Status",
    "Tool",
    "ToolCall",
    "ToolCallDispatchEvent",
    "ToolContext",
    "ToolDefinitionError",
    "ToolError",
    "ToolResult",
    "ToolResultEvent",
    "UnknownTool",
    "default_limit",
    "replay",
]
