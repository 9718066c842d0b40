"""What the attacks on run_command's gate share: a gate that records what it was asked,
a dispatcher of the shell tools bound to a workspace, and git and payload scripts to
build hostile repositories with."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import anyio

from builtin_tools import default_registry
from dispatcher import Allow, Deny, Dispatcher, ToolCall, ToolResult


class Gate:
    """Records each command it is asked about, and allows or refuses them all."""

    def __init__(self, allow: bool = False) -> None:
        self.allow = allow
        self.asked: list[dict[str, Any]] = []

    def __call__(self, call: ToolCall, ctx: Any) -> Allow | Deny:
        self.asked.append(dict(call.arguments))
        return Allow() if self.allow else Deny("refused by the test's gate")

    def commands(self) -> list[Any]:
        return [args.get("command") for args in self.asked]


def shell_dispatcher(ws: Path, gate: Gate, **options: Any) -> Dispatcher:
    """A dispatcher of run_command and background_command in `ws`, asking `gate`."""
    registry = default_registry(ws, include=["run_command", "background_command"], **options)
    return Dispatcher(registry, gate=gate)


async def run_command(
    ws: Path, args: dict[str, Any], *, gate: Gate | None = None, **options: Any
) -> ToolResult:
    """One run_command call in `ws`, asking `gate` (one that refuses, if none)."""
    gate = gate if gate is not None else Gate()
    with anyio.fail_after(30):
        return await shell_dispatcher(ws, gate, **options).invoke("run_command", args)


def git_in(cwd: Path, *args: str) -> None:
    """git in `cwd`, with a committer and local clones allowed."""
    subprocess.run(
        ["git", "-c", "user.name=t", "-c", "user.email=t@example.org",
         "-c", "protocol.file.allow=always", *args],
        cwd=cwd, check=True, capture_output=True, timeout=30,
    )  # fmt: skip


def payload(folder: Path, mark: str, body: str = "cat") -> Path:
    """An executable script in `folder` that prints `mark` to stderr, then runs `body`."""
    script = folder / "payload.sh"
    script.write_text(f"#!/bin/bash\necho {mark} >&2\n{body}\n")
    script.chmod(0o755)
    return script
