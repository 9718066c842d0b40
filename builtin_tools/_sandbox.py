"""The OS sandbox `run_command` runs commands in: bubblewrap (`bwrap`) on Linux.

Inside it a command sees the system folders read-only (`/usr`, `/bin`, `/lib*`, `/sbin`,
`/etc` with its password hashes and private keys masked), fresh empty `/tmp`, `/root`
and `/home`, its own `/proc` and a minimal `/dev`, and the workspace: read-only for a
command that ran without confirmation, writable for one the gate approved. Nothing
else of the host exists there (other users' files, other projects, the agent's own
state). Every namespace is unshared, the network too unless the caller asks for it,
so a command can open no socket to anything outside; the sandbox dies with its parent,
and when the command exits, everything it left running in the background dies with it.

No capability is left to the command, so it cannot remount what it was given
read-only. Whether bwrap can start is learnt by starting it once, with the options used for
real, and remembered for the process; a failure is logged once. Nothing from the
dispatcher's passes, trio or asyncio may be imported here.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

import attrs

__all__ = ["SandboxStatus", "bwrap_argv", "command_sandbox", "probe_sandbox"]

_log = logging.getLogger("threepass.shell")

# Bound read-only at their own path; a symbolic link (merged /usr) is recreated as one.
_SYSTEM_PATHS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc")
# Secrets in /etc: readable only by root on the host, but root inside the sandbox is the
# same user. (Run the agent as another user and the host's permissions hide the rest.)
_MASKED_FILES = (
    "/etc/shadow", "/etc/shadow-", "/etc/gshadow", "/etc/gshadow-", "/etc/sudoers",
    "/etc/security/opasswd", "/etc/krb5.keytab", "/etc/ipsec.secrets",
)  # fmt: skip
_MASKED_FOLDERS = (
    "/etc/ssh", "/etc/ssl/private", "/etc/pki/tls/private", "/etc/sudoers.d", "/etc/letsencrypt",
    "/etc/wireguard", "/etc/NetworkManager/system-connections", "/etc/ipsec.d/private",
)  # fmt: skip
_EMPTY_FOLDERS = ("/tmp", "/var/tmp", "/root", "/home", "/run")
# With the network shared, name resolution may need the resolver's socket folder.
_RESOLVER_PATHS = ("/run/systemd/resolve",)
_PROBE_TIMEOUT = 10.0


@attrs.frozen
class SandboxStatus:
    """Whether commands run in the sandbox: `program` is the bwrap used, `reason` says
    why not when `active` is False."""

    active: bool
    program: str | None
    reason: str | None


def bwrap_argv(
    program: str,
    command: Sequence[str],
    *,
    workspace: Path,
    cwd: Path,
    writable: bool,
    network: bool,
    read_only_paths: Sequence[str] = (),
) -> list[str]:
    """The argv that runs `command` (an argv, run as is: no shell is added) in the
    sandbox, in `cwd`, with `workspace` writable or not and the network shared or not.
    `read_only_paths` are further host folders to show read-only (a toolchain, say)."""
    # Run by root, bwrap keeps every capability inside unless told: with CAP_SYS_ADMIN
    # a command could remount the read-only binds (the workspace, the system) writable.
    argv = [program, "--unshare-all", "--cap-drop", "ALL", "--die-with-parent", "--new-session"]
    if network:
        argv.append("--share-net")
    for path in _SYSTEM_PATHS:
        if os.path.islink(path):
            argv += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            argv += ["--ro-bind", path, path]
    for path in _MASKED_FILES:
        if os.path.isfile(path):
            argv += ["--ro-bind", "/dev/null", path]
    for path in _MASKED_FOLDERS:
        if os.path.isdir(path):
            argv += ["--tmpfs", path, "--remount-ro", path]
    argv += ["--proc", "/proc", "--dev", "/dev"]
    for path in _EMPTY_FOLDERS:
        argv += ["--tmpfs", path]
    if network:
        for path in _RESOLVER_PATHS:
            argv += ["--ro-bind-try", path, path]
    for path in read_only_paths:
        argv += ["--ro-bind", os.fspath(path), os.fspath(path)]
    # Last, so it shows through the empty folders above when it lives under one of them.
    root = os.fspath(workspace)
    argv += ["--bind" if writable else "--ro-bind", root, root]
    argv += ["--chdir", os.fspath(cwd), "--", *command]
    return argv


def command_sandbox(program: str | None = None) -> SandboxStatus:
    """The status of the sandbox `run_command` uses: bwrap from PATH, or `program`."""
    found = program if program is not None else shutil.which("bwrap")
    if found is None:
        return _report(SandboxStatus(False, None, "bwrap is not installed (Debian package bubblewrap)"))
    return probe_sandbox(found)


@functools.cache
def probe_sandbox(program: str) -> SandboxStatus:
    """Start `program` (bwrap) once with the real options; remembered for the process."""
    with tempfile.TemporaryDirectory(prefix="threepass-probe-") as folder:
        root = Path(os.path.realpath(folder))
        argv = bwrap_argv(program, ["true"], workspace=root, cwd=root, writable=False, network=False)
        try:
            done = subprocess.run(
                argv, stdin=subprocess.DEVNULL, capture_output=True, timeout=_PROBE_TIMEOUT, check=False
            )
        except (OSError, subprocess.SubprocessError) as exc:
            return _report(SandboxStatus(False, program, f"{program} cannot start: {exc}"))
    if done.returncode != 0:
        said = done.stderr.decode("utf-8", errors="replace").strip().splitlines()
        why = said[-1] if said else f"exit code {done.returncode}"
        return _report(SandboxStatus(False, program, f"{program} cannot start a sandbox: {why}"))
    return SandboxStatus(True, program, None)


_reported: set[str | None] = set()


def _report(status: SandboxStatus) -> SandboxStatus:
    if status.reason not in _reported:
        _reported.add(status.reason)
        _log.warning("run_command has no sandbox, so every command needs confirmation: %s", status.reason)
    return status
