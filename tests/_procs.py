"""The host's process table as the process tests read it: whether a process still lives
(a zombie does not), and which live processes carry a given argument."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["alive", "pids_with_argument"]


def alive(pid: int) -> bool:
    """Whether process `pid` runs (a zombie still answers kill(0): it is dead for us)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:  # gone while we looked (the read of a dying process says ESRCH)
        return False


def pids_with_argument(argument: str) -> list[int]:
    """The live processes on the host that have `argument` among their arguments."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            words = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if argument.encode() in words and alive(int(entry.name)):
            found.append(int(entry.name))
    return found
