"""A real redis-server for tests and the bench: on a free loopback port, with no
persistence and its own folder, stopped by its PID; it can be stopped and started again on
the same port (outage tests)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

__all__ = ["RedisServer", "free_port", "running_redis"]

_START_TIMEOUT = 10.0


def free_port() -> int:
    """A loopback TCP port nobody listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _ping(port: int, timeout: float = 0.2) -> bool:
    """True if a Redis on `port` answers PING with PONG (raw RESP: no client needed)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as conn:
            conn.sendall(b"PING\r\n")
            return conn.recv(16).startswith(b"+PONG")
    except OSError:
        return False


class RedisServer:
    """One redis-server process at a time on `port`; `start`, `stop` (SIGTERM, then SIGKILL
    by PID), `kill` (SIGKILL: a crash), `start` again."""

    def __init__(self, program: str, folder: Path, port: int | None = None) -> None:
        self.program = program
        self.folder = folder
        self.port = port if port is not None else free_port()
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        """Start the server and wait until it answers PING."""
        if self.process is not None:
            raise RuntimeError("redis-server is already running")
        self.folder.mkdir(parents=True, exist_ok=True)
        argv = [self.program, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                "--appendonly", "no", "--dir", str(self.folder), "--daemonize", "no",
                "--logfile", str(self.folder / "redis.log")]  # fmt: skip
        self.process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + _START_TIMEOUT
        while not _ping(self.port):
            if self.process.poll() is not None or time.monotonic() > deadline:
                log = (self.folder / "redis.log").read_text(errors="replace")[-2000:]
                self._reap(signal.SIGKILL)
                raise RuntimeError(f"redis-server did not start on port {self.port}:\n{log}")
            time.sleep(0.01)

    def stop(self) -> None:
        """Stop the server by its PID (SIGTERM, SIGKILL after 5 s); nothing if not running."""
        self._reap(signal.SIGTERM)

    def kill(self) -> None:
        """SIGKILL the server: what a crashed or unplugged Redis looks like."""
        self._reap(signal.SIGKILL)

    def _reap(self, sig: signal.Signals) -> None:
        process, self.process = self.process, None
        if process is None or process.poll() is not None:
            return
        os.kill(process.pid, sig)
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            os.kill(process.pid, signal.SIGKILL)
            process.wait(timeout=5)


@contextlib.contextmanager
def running_redis(program: str, folder: Path | None = None) -> Iterator[RedisServer]:
    """A started `RedisServer`, stopped on the way out."""
    with contextlib.ExitStack() as stack:
        if folder is None:
            folder = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="threepass-redis-")))
        server = RedisServer(program, folder)
        server.start()
        stack.callback(server.stop)
        yield server
