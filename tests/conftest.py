"""Every async test runs twice, on trio and on asyncio (anyio's pytest plugin), unless it
needs trio itself: a test that takes trio's `autojump_clock`, that is marked
`@pytest.mark.trio` (alone or by its module), or whose module imports trio to use its
own API, runs on trio only, under pytest-trio."""

from __future__ import annotations

import inspect
import os
from typing import Any

import pytest
import xdist.plugin

BACKENDS = ("trio", "asyncio")


@pytest.hookimpl(tryfirst=True)
def pytest_xdist_auto_num_workers(config: pytest.Config) -> int | None:
    """`-n auto`: three workers to two cores (addopts caps them at four). Nearly half of a
    worker's time is spent waiting, not computing (timeouts running out, servers and worker
    processes starting), and a third worker fills it: 185 s became 138 s on two cores, where
    a fourth added CPU time and saved 3 s more. PYTEST_XDIST_AUTO_NUM_WORKERS still decides
    when set."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return None  # xdist's own hook reads it
    cores = int(xdist.plugin.pytest_xdist_auto_num_workers(config))  # what -n auto gives alone
    return cores + cores // 2


@pytest.fixture(params=BACKENDS)
def anyio_backend(request: pytest.FixtureRequest) -> str:
    """The event loop an async test runs on."""
    return str(request.param)


def _marks(holder: Any) -> list[Any]:
    marks = getattr(holder, "pytestmark", [])
    return marks if isinstance(marks, list) else [marks]


def _marker_names(obj: Any, collector: pytest.Collector) -> set[str]:
    module = getattr(collector, "module", None)
    return {m.name for m in _marks(obj) + (_marks(module) if module is not None else [])}


@pytest.hookimpl(tryfirst=True)
def pytest_pycollect_makeitem(collector: pytest.Collector, name: str, obj: Any) -> None:
    """Mark each coroutine test for the plugin that will run it (before anyio's own hook
    reads the marks)."""
    if not (isinstance(collector, pytest.Module | pytest.Class) and collector.istestfunction(obj, name)):
        return
    inner = obj.hypothesis.inner_test if hasattr(obj, "hypothesis") else obj
    if not inspect.iscoroutinefunction(inner):
        return
    marks = _marker_names(obj, collector)
    if "trio" in marks or "anyio" in marks:
        return
    module = getattr(collector, "module", None)
    uses_trio = module is not None and inspect.ismodule(getattr(module, "trio", None))
    if uses_trio or "autojump_clock" in inspect.signature(inner).parameters:
        pytest.mark.trio(obj)
    else:
        pytest.mark.anyio(obj)
