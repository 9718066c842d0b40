"""The tools that ship with threepass, bound to a workspace folder.

`default_registry(workspace)` registers all of them:

- files: read_files, find_files, edit_file, remove_file, restore_file, file_history
- shell: run_command, background_command (in a bubblewrap sandbox; `command_sandbox()`
  says whether it works)
- web: fetch_page, search_web, http_request, download_file
- meta (always loaded): reasoning_guide, write_todo, chat_history, ask_user, write_result,
  error_history, write_error, store_secret (the error memory: give the Dispatcher an
  `error_store`, e.g. `cache.DiskErrorStore()`, for them to remember anything)
- calculate: calculate

MCP servers are a tool source of their own: `builtin_tools.mcp.open_mcp` (the
`threepass[mcp]` extra), never imported from here, so the SDK stays optional.

`find_tools` and `run_tool` are not here: every session supplies them.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

from dispatcher._registry import Registry, Tool

from ._sandbox import SandboxStatus, command_sandbox
from ._workspace import Workspace
from .calculate import calculate_tools
from .files import file_tools
from .meta import CORE_TOOL_NAMES, meta_tools
from .shell import is_read_only_command, shell_tools
from .web import web_tools

__all__ = [
    "GROUPS",
    "SandboxStatus",
    "Workspace",
    "all_tools",
    "command_sandbox",
    "core_tool_names",
    "default_registry",
    "is_read_only_command",
]

GROUPS: dict[str, tuple[str, ...]] = {
    "files": (
        "read_files", "find_files", "edit_file", "remove_file", "restore_file", "file_history",
    ),
    "shell": ("run_command", "background_command"),
    "web": ("fetch_page", "search_web", "http_request", "download_file"),
    "meta": CORE_TOOL_NAMES,
    "calculate": ("calculate",),
}  # fmt: skip
"""Tool names by group; `include` accepts group names and tool names alike."""


def core_tool_names() -> list[str]:
    """The builtin tools that are always loaded (`deferred=False`), in request order."""
    return list(CORE_TOOL_NAMES)


def all_tools(
    workspace: str | os.PathLike[str] | Workspace,
    *,
    search_url: str | None = None,
    allow_private_network: bool = False,
    sandbox: bool = True,
    command_network: bool = False,
) -> list[Tool]:
    """Every builtin tool, bound to `workspace`, in the order `GROUPS` lists them."""
    ws = workspace if isinstance(workspace, Workspace) else Workspace(workspace)
    return [
        *file_tools(ws),
        *shell_tools(ws, sandbox=sandbox, command_network=command_network),
        *web_tools(ws, search_url=search_url, allow_private_network=allow_private_network),
        *meta_tools(ws),
        *calculate_tools(),
    ]


def default_registry(
    workspace: str | os.PathLike[str] | Workspace,
    *,
    include: Iterable[str] | None = None,
    search_url: str | None = None,
    allow_private_network: bool = False,
    sandbox: bool = True,
    command_network: bool = False,
) -> Registry:
    """A Registry of the builtin tools bound to `workspace` (an existing folder).

    `include` limits it to the named tools and groups (see `GROUPS`); an unknown name
    is a ValueError. `search_url` is the SearXNG-compatible endpoint of `search_web`
    (else the THREEPASS_SEARCH_URL environment variable, read at each call).

    The web tools never connect to link-local or cloud metadata addresses, and reach
    loopback and private ranges only with `allow_private_network=True` (the search
    endpoint may be on them anyway: it is the operator's own configuration).

    `run_command` runs every command in a bubblewrap sandbox (no network, the system
    read-only, homes hidden, only the workspace writable, and read-only for commands run
    without confirmation; see `command_sandbox()`). Where bwrap is missing or cannot
    start, every command needs confirmation. `sandbox=False` runs commands unsandboxed
    and lets read-only commands run unconfirmed: for hosts that are a sandbox already.
    `command_network=True` gives confirmed commands the network.

    The error memory's tools (`error_history`, `write_error`) reach the store the
    Dispatcher was given: `Dispatcher(registry, error_store=cache.DiskErrorStore())` keeps
    it beside the result cache (this package cannot import `cache`, so it does not make one).
    """
    tools = all_tools(
        workspace,
        search_url=search_url,
        allow_private_network=allow_private_network,
        sandbox=sandbox,
        command_network=command_network,
    )
    if include is not None:
        wanted = _expand(include)
        tools = [t for t in tools if t.name in wanted]
    return Registry(tools)


def _expand(include: Iterable[str]) -> set[str]:
    if isinstance(include, str):
        include = [include]
    known = {name for names in GROUPS.values() for name in names}
    wanted: set[str] = set()
    for name in include:
        if name in GROUPS:
            wanted.update(GROUPS[name])
        elif name in known:
            wanted.add(name)
        else:
            raise ValueError(
                f"unknown builtin tool or group {name!r}; groups are {sorted(GROUPS)}, "
                f"tools are {sorted(known)}"
            )
    return wanted
