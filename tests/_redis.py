"""A real redis-server for tests and the bench: on a free loopback port, with no
persistence and its own folder, stopped by its PID; it can be stopped and started again on
the same port (outage tests)."""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import anyio

__all__ = ["RedisServer", "Worker", "free_port", "running_redis", "worker_main"]

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
            # a server that wants a password answers -NOAUTH: it is up all the same
            return conn.recv(16).startswith((b"+PONG", b"-NOAUTH"))
    except OSError:
        return False


class RedisServer:
    """One redis-server process at a time on `port`; `start`, `stop` (SIGTERM, then SIGKILL
    by PID), `kill` (SIGKILL: a crash), `start` again."""

    def __init__(
        self, program: str, folder: Path, port: int | None = None, *, password: str | None = None
    ) -> None:
        self.program = program
        self.folder = folder
        self.port = port if port is not None else free_port()
        self.password = password
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password is not None else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def start(self) -> None:
        """Start the server and wait until it answers PING."""
        if self.process is not None:
            raise RuntimeError("redis-server is already running")
        self.folder.mkdir(parents=True, exist_ok=True)
        argv = [self.program, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                "--appendonly", "no", "--dir", str(self.folder), "--daemonize", "no",
                "--logfile", str(self.folder / "redis.log")]  # fmt: skip
        if self.password is not None:
            argv += ["--requirepass", self.password]
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


# --- a worker process: a Dispatcher sharing a RedisResultCache, driven by JSON lines -------

WORKER_SCRIPT = (
    "import sys; sys.path.insert(0, sys.argv[1]); "
    "from tests._redis import worker_main; worker_main(sys.argv[2:])"
)


def _worker_registry() -> Any:
    from dispatcher import CachePolicy, Registry, Tool

    # sync handlers: they run in worker threads, so they may block
    def read_file(args: Mapping[str, Any], ctx: Any) -> str:
        seen = Path(args["path"]).read_text()
        hold = args.get("hold")
        if hold:  # say the read has happened, then wait for the test's go-ahead
            Path(hold + ".started").write_text("")
            deadline = time.monotonic() + 30
            while not Path(hold + ".go").exists() and time.monotonic() < deadline:
                time.sleep(0.01)
        return seen

    def list_dir(args: Mapping[str, Any], ctx: Any) -> str:
        return "\n".join(sorted(p.name for p in Path(args["path"]).iterdir()))

    def write_file(args: Mapping[str, Any], ctx: Any) -> str:
        Path(args["path"]).write_text(args["text"])
        return "written"

    path = {"type": "object", "properties": {"path": {"type": "string"}, "hold": {"type": "string"}}}
    text = {"type": "object", "properties": {"path": {"type": "string"}, "text": {"type": "string"}}}
    shared = CachePolicy(scope="shared")
    return Registry(
        [
            Tool("read_file", "Read.", read_file, path, deferred=False, concurrent=True, cache=shared,
                 reads=lambda a: {"file:" + a["path"]}),
            Tool("list_dir", "List.", list_dir, path, deferred=False, concurrent=True, cache=shared,
                 reads=lambda a: {"file:" + a["path"] + "/"}),
            Tool("write_file", "Write.", write_file, text, deferred=False,
                 writes=lambda a: {"file:" + a["path"]}),
        ]
    )  # fmt: skip


def worker_main(argv: list[str]) -> None:
    """`url namespace backend`: each stdin line is a JSON list of calls `[name, args]`,
    dispatched in a fresh session; each answer a JSON list of `{ok, content, cached}`."""
    from cache import RedisResultCache
    from dispatcher import Dispatcher, ToolCall

    url, namespace, backend = argv
    # room to answer on a loaded machine: the tests assert hits, not timeouts
    store = RedisResultCache(url, namespace=namespace, timeout=5.0, connect_timeout=5.0)
    dispatcher = Dispatcher(_worker_registry(), cache=store)

    async def serve() -> None:
        for n, line in enumerate(iter(sys.stdin.readline, "")):
            calls = [ToolCall(f"c{i}", name, args) for i, (name, args) in enumerate(json.loads(line))]
            results = await dispatcher.session(f"s{n}").dispatch(calls)
            answer = [{"ok": r.ok, "content": r.content, "cached": r.cached} for r in results]
            sys.stdout.write(json.dumps(answer) + "\n")
            sys.stdout.flush()

    anyio.run(serve, backend=backend)


class Worker:
    """A worker process (see `worker_main`): `send` a batch, `receive` its results."""

    def __init__(self, repo: Path, url: str, namespace: str, backend: str = "trio") -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-c", WORKER_SCRIPT, str(repo), url, namespace, backend],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    def send(self, calls: list[tuple[str, dict[str, Any]]]) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps(calls) + "\n")
        self.process.stdin.flush()

    def receive(self, timeout: float = 20.0) -> list[dict[str, Any]]:
        assert self.process.stdout is not None
        ready, _, _ = select.select([self.process.stdout], [], [], timeout)
        if not ready:
            raise TimeoutError(f"worker {self.process.pid} did not answer within {timeout} s")
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"worker {self.process.pid} exited ({self.process.wait()})")
        answer: list[dict[str, Any]] = json.loads(line)
        return answer

    def dispatch(self, calls: list[tuple[str, dict[str, Any]]]) -> list[dict[str, Any]]:
        self.send(calls)
        return self.receive()

    def close(self) -> None:
        if self.process.poll() is None:
            assert self.process.stdin is not None
            self.process.stdin.close()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.kill(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=5)
        if self.process.stdout is not None:
            self.process.stdout.close()
