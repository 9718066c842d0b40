"""Registry and Tool: registration checks, lookups, defaults, fingerprint, async detection."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import pytest

from dispatcher import Dispatcher, Registry, Tool, ToolDefinitionError, UnknownTool


def _handler(args: Mapping[str, Any], ctx: Any) -> str:
    return "ok"


async def _async_handler(args: Mapping[str, Any], ctx: Any) -> str:
    return "ok"


def make_tool(name: str = "echo", **kw: Any) -> Tool:
    kw.setdefault("description", "Echo.")
    kw.setdefault("handler", _handler)
    return Tool(name=name, **kw)


@pytest.mark.parametrize("name", ["", "has space", "semi;colon", "x" * 129, "slash/name", "ünïcode"])
def test_bad_names_are_refused(name: str) -> None:
    """A name outside 1-128 letters, digits, '_', '-', '.' is a ToolDefinitionError."""
    with pytest.raises(ToolDefinitionError, match="tool name"):
        Registry().add(make_tool(name))


@pytest.mark.parametrize("name", ["a", "read_file", "ns.tool-2", "x" * 128])
def test_good_names_are_accepted(name: str) -> None:
    """Names of letters, digits, '_', '-' and '.' up to 128 characters register."""
    reg = Registry()
    reg.add(make_tool(name))
    assert name in reg


def test_name_with_trailing_newline_is_refused() -> None:
    """A name ending in a newline is refused."""
    with pytest.raises(ToolDefinitionError):
        Registry().add(make_tool("echo\n"))


def test_tool_definition_error_is_a_value_error() -> None:
    """ToolDefinitionError refines ValueError and shows the offending value."""
    with pytest.raises(ValueError, match="'bad name'"):
        Registry().add(make_tool("bad name"))


def test_non_object_schema_is_refused_naming_the_tool() -> None:
    """Parameters that do not describe an object are refused, naming the tool."""
    with pytest.raises(ToolDefinitionError, match=r"'arr'.*must describe an object.*'array'"):
        Registry().add(make_tool("arr", parameters={"type": "array"}))


def test_parameters_that_are_not_a_mapping_are_refused() -> None:
    """Parameters that are not a mapping are refused, naming the tool."""
    with pytest.raises(ToolDefinitionError, match="'lst'"):
        Registry().add(make_tool("lst", parameters=["type", "object"]))  # type: ignore[arg-type]


def test_invalid_json_schema_is_refused_naming_the_tool() -> None:
    """A schema that is not valid JSON Schema is refused, naming the tool."""
    bad = {"type": "object", "properties": {"a": {"type": 5}}}
    with pytest.raises(ToolDefinitionError, match="tool 'broken': invalid JSON schema"):
        Registry().add(make_tool("broken", parameters=bad))


def test_schema_that_is_not_json_is_refused() -> None:
    """A schema holding values JSON cannot write is refused."""
    params = {"type": "object", "properties": {"a": {"type": "string", "default": object()}}}
    with pytest.raises(ToolDefinitionError, match="tool 'odd'"):
        Registry().add(make_tool("odd", parameters=params))


def test_handler_must_be_callable() -> None:
    """A handler that cannot be called is refused."""
    with pytest.raises(ToolDefinitionError, match="handler is not callable"):
        Registry().add(make_tool("h", handler="nope"))


@pytest.mark.parametrize("timeout", [0, -1.0])
def test_timeout_must_be_positive(timeout: float) -> None:
    """A tool timeout must be positive seconds."""
    with pytest.raises(ToolDefinitionError, match="timeout must be positive"):
        Registry().add(make_tool("slow", timeout=timeout))


def test_not_a_tool_is_refused() -> None:
    """Only Tool values register."""
    with pytest.raises(ToolDefinitionError, match="expected a Tool"):
        Registry().add({"name": "echo"})  # type: ignore[arg-type]


def test_duplicate_registration_is_refused() -> None:
    """A second tool of the same name is refused and the first stays."""
    reg = Registry()
    first = reg.add(make_tool("echo", description="first"))
    with pytest.raises(ToolDefinitionError, match="already registered"):
        reg.add(make_tool("echo", description="second"))
    assert reg.get("echo") is first
    assert len(reg) == 1


def test_replace_swaps_the_tool() -> None:
    """replace=True registers the new tool under the same name."""
    reg = Registry([make_tool("echo", description="first")])
    second = reg.add(make_tool("echo", description="second"), replace=True)
    assert reg.get("echo") is second
    assert reg.names() == ["echo"]


def test_get_unknown_is_unknown_tool() -> None:
    """get of an unknown name raises UnknownTool, a LookupError, naming it."""
    reg = Registry()
    with pytest.raises(UnknownTool, match="'ghost'"):
        reg.get("ghost")
    with pytest.raises(LookupError):
        reg.get("ghost")
    assert issubclass(UnknownTool, LookupError)


def test_remove() -> None:
    """remove drops a tool; removing an unknown one raises UnknownTool."""
    reg = Registry([make_tool("a"), make_tool("b")])
    reg.remove("a")
    assert reg.names() == ["b"]
    assert "a" not in reg
    with pytest.raises(UnknownTool):
        reg.remove("a")


def test_registered_and_iteration_keep_order() -> None:
    """Names and iteration follow registration order; registered() gives None for unknown."""
    reg = Registry([make_tool("b"), make_tool("a"), make_tool("c")])
    assert reg.names() == ["b", "a", "c"]
    assert [t.name for t in reg] == ["b", "a", "c"]
    assert reg.registered("zzz") is None
    entry = reg.registered("a")
    assert entry is not None and entry.name == "a"


def test_fingerprint_ignores_registration_order() -> None:
    """The fingerprint does not depend on registration order."""
    a, b = make_tool("a"), make_tool("b")
    assert Registry([a, b]).fingerprint() == Registry([b, a]).fingerprint()


def test_fingerprint_changes_with_a_schema() -> None:
    """The fingerprint changes when a tool's schema or description changes, or a tool is added."""
    base = Registry([make_tool("a", parameters={"type": "object", "properties": {"x": {"type": "string"}}})])
    changed = Registry(
        [make_tool("a", parameters={"type": "object", "properties": {"x": {"type": "integer"}}})]
    )
    described = Registry(
        [
            make_tool(
                "a",
                description="Other.",
                parameters={"type": "object", "properties": {"x": {"type": "string"}}},
            )
        ]
    )
    more = Registry(
        [
            make_tool("a", parameters={"type": "object", "properties": {"x": {"type": "string"}}}),
            make_tool("b"),
        ]
    )
    prints = {r.fingerprint() for r in (base, changed, described, more)}
    assert len(prints) == 4


def test_defaults_are_extracted() -> None:
    """Top-level property defaults are extracted at registration; nested ones are not."""
    params = {
        "type": "object",
        "properties": {
            "path": {"type": "string", "default": "/w"},
            "depth": {"type": "integer", "default": 0},
            "opts": {"type": "object", "properties": {"deep": {"type": "boolean", "default": True}}},
            "plain": {"type": "string"},
        },
    }
    entry = Registry([make_tool("d", parameters=params)]).registered("d")
    assert entry is not None
    assert dict(entry.defaults) == {"path": "/w", "depth": 0}


def test_no_properties_no_defaults() -> None:
    """A schema without properties has no defaults; the default schema is an empty object."""
    entry = Registry([make_tool("d")]).registered("d")
    assert entry is not None
    assert dict(entry.defaults) == {}
    assert entry.tool.parameters == {"type": "object", "properties": {}}


def test_validator_is_compiled_at_registration() -> None:
    """The registered validator checks arguments against the schema."""
    params = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    entry = Registry([make_tool("v", parameters=params)]).registered("v")
    assert entry is not None
    assert entry.validator.is_valid({"n": 1})
    assert not entry.validator.is_valid({"n": "1"})
    assert not entry.validator.is_valid({})


class _AsyncCallable:
    async def __call__(self, args: Mapping[str, Any], ctx: Any) -> str:
        return "ok"


class _SyncCallable:
    def __call__(self, args: Mapping[str, Any], ctx: Any) -> str:
        return "ok"


@pytest.mark.parametrize(
    ("handler", "expected"),
    [
        (_async_handler, True),
        (_handler, False),
        (_AsyncCallable(), True),
        (_SyncCallable(), False),
        (functools.partial(_async_handler), True),
        (lambda args, ctx: "ok", False),
    ],
    ids=["async-def", "def", "async-call-object", "sync-call-object", "partial-async", "lambda"],
)
def test_is_async_detection(handler: Any, expected: bool) -> None:
    """is_async is true for async functions and objects with an async __call__."""
    entry = Registry([make_tool("h", handler=handler)]).registered("h")
    assert entry is not None
    assert entry.is_async is expected


def test_tool_schema_is_provider_neutral() -> None:
    """Tool.schema() gives name, description and parameters; schema_json holds the same."""
    tool = make_tool("s", parameters={"type": "object", "properties": {"q": {"type": "string"}}})
    assert tool.schema() == {
        "name": "s",
        "description": "Echo.",
        "parameters": {"type": "object", "properties": {"q": {"type": "string"}}},
    }
    entry = Registry([tool]).registered("s")
    assert entry is not None
    assert '"name":"s"' in entry.schema_json


def test_tool_defaults() -> None:
    """A Tool is deferred by default, not concurrent, not confirmed, not cached."""
    tool = make_tool()
    assert tool.deferred is True
    assert tool.concurrent is False and tool.confirm is False
    assert tool.cache is None and tool.timeout is None


def test_a_copy_has_the_same_tools_and_changes_apart() -> None:
    async def echo(args: Any, ctx: Any) -> str:
        return "echo"

    original = Registry([Tool("echo", "Echo.", echo, {"type": "object"}, deferred=False)])
    copied = original.copy()
    assert copied.names() == original.names() and copied.fingerprint() == original.fingerprint()
    copied.add(Tool("other", "Other.", echo, {"type": "object"}, deferred=False))
    copied.remove("echo")
    assert list(original.names()) == ["echo"] and list(copied.names()) == ["other"]


def test_each_dispatcher_has_a_core_registry_of_its_own() -> None:
    """The core tools are checked once per process; each dispatcher holds its own registry
    of them, so a change to one is not another's."""
    first, second = Dispatcher(Registry()), Dispatcher(Registry())
    first.core_registry.remove("find_tools")
    assert "find_tools" not in first.core_registry.names()
    assert "find_tools" in second.core_registry.names() and "run_tool" in second.core_registry.names()
    assert "find_tools" in Dispatcher(Registry()).core_registry.names()


@pytest.mark.parametrize(
    ("schema", "missing"),
    [
        ({"type": "object", "properties": {"a": {"$ref": "#/$defs/nothing"}}}, "'#/$defs/nothing'"),
        ({"type": "object", "properties": {"a": {"allOf": [{"$dynamicRef": "#gone"}]}}}, "'#gone'"),
    ],
)
def test_a_local_reference_that_points_nowhere_is_logged_at_registration(
    schema: dict[str, Any], missing: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A schema whose `#...` reference points nowhere in it registers (its calls fail, not its
    neighbours' registration), with a warning naming the tool and the reference."""
    reg = Registry([make_tool("odd", parameters=schema), make_tool("fine")])
    assert reg.names() == ["odd", "fine"]
    [warning] = [r.getMessage() for r in caplog.records if r.name == "threepass.registry"]
    assert "'odd'" in warning and missing in warning


def test_local_references_that_resolve_and_data_named_ref_are_not_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """References that resolve (a pointer, an anchor, the root), a property named `$ref` and a
    remote reference (judged only at call time, never fetched) log nothing."""
    schema = {
        "type": "object",
        "$defs": {"s": {"type": "string", "$anchor": "str"}},
        "properties": {
            "a": {"$ref": "#/$defs/s"},
            "b": {"$ref": "#str"},
            "c": {"items": {"$ref": "#"}},
            "$ref": {"type": "string"},
            "d": {"$ref": "urn:elsewhere"},
        },
    }
    Registry([make_tool("refs", parameters=schema)])
    assert [r for r in caplog.records if r.name == "threepass.registry"] == []
