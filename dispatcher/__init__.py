"""threepass: execute the tool calls of an LLM assistant message, in three passes.

Pass 1 decides every call (parse, unwrap `run_tool`, rewrite, existence, deferred
schemas, dedupe and cache, validation, the confirm gate) before anything runs; pass 2
runs what may run; pass 3 commits outcomes in call order.
"""

from ._dispatcher import Dispatcher, default_limit
from ._exceptions import (
    DispatchInterrupted,
    HookBlocked,
    SessionBusy,
    ToolDefinitionError,
    ToolError,
    UnknownTool,
)
from ._policy import CachePolicy
from ._process import ProcessContext
from ._recording import Divergence, ReplayReport, replay
from ._registry import Registry, Tool
from ._scripted import ScriptedRunner
from ._seams import (
    CacheEntry,
    CacheStatistics,
    CacheWrite,
    ErrorRecord,
    ErrorStore,
    Lease,
    ResultCache,
    SessionStore,
    StoredSession,
    ToolRunner,
)
from ._session import Session, SessionStatistics
from ._types import (
    Allow,
    Answer,
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
from ._watch import DispatcherStatistics, StuckCall

__all__ = [
    "Allow",
    "Answer",
    "BatchEvent",
    "CacheEntry",
    "CachePolicy",
    "CacheStatistics",
    "CacheWrite",
    "Deny",
    "DispatchInterrupted",
    "Dispatcher",
    "DispatcherStatistics",
    "Divergence",
    "ErrorRecord",
    "ErrorStore",
    "HistoryEntry",
    "HookBlocked",
    "Interrupt",
    "Lease",
    "ProcessContext",
    "Registry",
    "ReplayReport",
    "ResultCache",
    "ScriptedRunner",
    "Session",
    "SessionBusy",
    "SessionStatistics",
    "SessionStore",
    "Status",
    "StoredSession",
    "StuckCall",
    "Tool",
    "ToolCall",
    "ToolCallDispatchEvent",
    "ToolContext",
    "ToolDefinitionError",
    "ToolError",
    "ToolResult",
    "ToolResultEvent",
    "ToolRunner",
    "UnknownTool",
    "default_limit",
    "replay",
]
