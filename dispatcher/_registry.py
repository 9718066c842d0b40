"""`Tool` (a definition) and `Registry` (the named set a dispatcher serves).

Registration is where a tool is checked: its name, its JSON schema (Draft 2020-12,
checked once) and its compiled validators (jsonschema, the authority, and jsonschema-rs
for the hot path where it is sure to agree: `_fastcheck`). Nothing here runs a tool.
"""

from __future__ import annotations

import inspect
import json
import logging
import re
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Literal

import attrs
import jsonschema
import referencing
import referencing.exceptions
import referencing.jsonschema
import xxhash

from ._exceptions import ToolDefinitionError, UnknownTool
from ._fastcheck import compile_fast
from ._policy import CachePolicy
from ._process import why_not_importable

__all__ = [
    "Registry", "RegisteredTool", "Tool", "Handler", "ResourceFn", "ArgsPredicate", "Isolation",
    "strict_problem",
]  # fmt: skip

log = logging.getLogger("threepass.registry")

Handler = Callable[..., Any]
"""`(args: dict, ctx: ToolContext) -> str | dict | list | bytes`, sync or async."""
ResourceFn = Callable[[Mapping[str, Any]], Any]
"""`(args) -> set[str]` of resource keys, sync or async."""
ArgsPredicate = Callable[[Mapping[str, Any]], Any]
"""`(args) -> bool`, sync or async."""
Isolation = Literal["thread", "process"]
"""Where a sync handler runs: a worker thread (reported at its timeout, but it runs on and
keeps its slot until it returns) or a worker process (killed at its timeout)."""

_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,128}$")
_EMPTY_SCHEMA: Mapping[str, Any] = {"type": "object", "properties": {}}


def _default_parameters() -> Mapping[str, Any]:
    return dict(_EMPTY_SCHEMA)


@attrs.frozen
class Tool:
    """A tool definition.

    `concurrent` and `confirm` may be a bool or a predicate on the arguments.
    `reads` / `writes` return the resource keys a call touches (`"file:/abs/path"`,
    `"url:https://..."`); a call that writes anything is never deduped or cached, and
    its success invalidates what overlaps it. `writes` returning `{"file:/"}` says
    "unknown effects on files". `timeout` is seconds (None: the dispatcher's).
    `strict=True` asks the providers to hold the model to the schema (OpenAI's strict
    mode); it is granted only to a schema strict mode can take (`strict_problem`).

    `isolation="process"` runs a sync handler in a worker process, killed (and its slot
    freed) at its timeout. The handler must be importable (a module-level function, not a
    lambda or closure), its arguments and result picklable, and its `ctx` is a
    `ProcessContext` snapshot (call_id, tool_name, session_id, run_id, round, timeout):
    session state, history and `invoke` stay in the host. None: the registry's default.
    """

    name: str
    description: str
    handler: Handler
    parameters: Mapping[str, Any] = attrs.field(factory=_default_parameters)
    concurrent: bool | ArgsPredicate = False
    deferred: bool = True
    confirm: bool | ArgsPredicate = False
    cache: CachePolicy | None = None
    timeout: float | None = None
    reads: ResourceFn | None = None
    writes: ResourceFn | None = None
    strict: bool = False
    isolation: Isolation | None = None

    def schema(self) -> dict[str, Any]:
        """Name, description and parameters, provider-neutral."""
        return {
            "name": self.name,
            "description": self.description,
            "parameters": dict(self.parameters),
        }


@attrs.frozen
class RegisteredTool:
    """A tool as the registry holds it: checked, with what pass 1 needs ready-made."""

    tool: Tool
    validator: Any  # a jsonschema Draft202012Validator
    defaults: Mapping[str, Any]
    defaults_mutable: bool
    is_async: bool
    schema_json: str
    takes_force: bool = False
    """Has a result-cache policy and no `force` parameter of its own: `force` is ours."""
    plain: bool = False
    """No reads, writes or cache policy and a fixed `concurrent`: no seam to evaluate."""
    cached_plain: bool = False
    """As `plain`, but with a cache policy that asks no `when`: only whether the arguments
    carry a credential decides that a call is looked up in the result cache."""
    in_process: bool = False
    """A sync handler run in a worker process (`isolation="process"`, its own or the registry's)."""
    fast: Any = None
    """A jsonschema-rs validator that decides validity on the hot path, or None where
    jsonschema (`validator`, the authority, which writes every error) decides alone."""

    @property
    def name(self) -> str:
        return self.tool.name


def _is_async_callable(fn: Callable[..., Any]) -> bool:
    if inspect.iscoroutinefunction(fn):
        return True
    call = getattr(fn, "__call__", None)  # noqa: B004 - an object with an async __call__
    return call is not None and inspect.iscoroutinefunction(call)


# Where a schema's `$ref`s are looked up: the schema itself (and the JSON Schema
# metaschemas, which jsonschema adds to any registry it is given), nothing else.
# jsonschema's default registry fetches any other http(s) reference with urlopen (a
# deprecated fallback, but live): a tool schema from an MCP server could then make pass 1
# reach any address, and wait on it. Here such a reference is unresolvable, and pass 1
# fails that one call saying so.
_OFFLINE_REFS: referencing.Registry[Any] = referencing.Registry()
# The keywords of Draft 2020-12 whose value is a subschema, a list of them, or a map of
# them (where `$ref` and `$dynamicRef` mean a reference; elsewhere, such as under
# `properties` names or inside `enum`, `default` or `const`, they are data)
_ONE_SCHEMA = frozenset(
    {
        "additionalProperties", "contains", "else", "if", "items", "not", "propertyNames",
        "then", "unevaluatedItems", "unevaluatedProperties", "additionalItems",
    }
)  # fmt: skip
_LIST_OF_SCHEMAS = frozenset({"allOf", "anyOf", "oneOf", "prefixItems"})
_MAP_OF_SCHEMAS = frozenset({"$defs", "definitions", "properties", "patternProperties", "dependentSchemas"})


def _local_refs(node: Any, found: list[str], root: bool = True) -> None:
    """Every `#...` reference (`$ref`, `$dynamicRef`) in `node`, a schema, into `found`; a
    subschema with an `$id` of its own is another document's base, and is left out."""
    if not isinstance(node, Mapping) or (not root and "$id" in node):
        return
    for keyword in ("$ref", "$dynamicRef"):
        ref = node.get(keyword)
        if isinstance(ref, str) and ref.startswith("#"):
            found.append(ref)
    for keyword, value in node.items():
        if keyword in _ONE_SCHEMA:
            _local_refs(value, found, False)
        if keyword in _LIST_OF_SCHEMAS and isinstance(value, list):
            for sub in value:
                _local_refs(sub, found, False)
        elif keyword in _MAP_OF_SCHEMAS and isinstance(value, Mapping):
            for sub in value.values():
                _local_refs(sub, found, False)


def _unresolvable_local_refs(schema: Mapping[str, Any]) -> list[str]:
    """The references into `schema` itself (`#/...`, `#anchor`) that point nowhere in it.
    Others (`urn:`, `http://`, a relative file) need a fetch to be judged, which
    registration never makes: they fail each call instead."""
    refs: list[str] = []
    _local_refs(schema, refs)
    if not refs:
        return []
    resource = referencing.jsonschema.DRAFT202012.create_resource(schema)
    resolver = _OFFLINE_REFS.resolver_with_root(resource)
    missing = []
    for ref in dict.fromkeys(refs):
        try:
            resolver.lookup(ref)
        except referencing.exceptions.Unresolvable:
            missing.append(ref)
    return missing


def _top_level_defaults(schema: Mapping[str, Any]) -> dict[str, Any]:
    props = schema.get("properties")
    if not isinstance(props, Mapping):
        return {}
    return {
        name: spec["default"]
        for name, spec in props.items()
        if isinstance(spec, Mapping) and "default" in spec
    }


def _defaults_off_schema(validator: Any, schema: Mapping[str, Any], defaults: Mapping[str, Any]) -> list[str]:
    """The top-level parameters whose default fails the parameter's own schema (such as
    `default: null` on a typed parameter). A subschema that cannot be checked alone (a
    `$ref` into the whole schema, say) is given the benefit of the doubt."""
    props = schema.get("properties") or {}
    bad = []
    for name, value in defaults.items():
        try:
            if not validator.evolve(schema=props[name]).is_valid(value):
                bad.append(name)
        except Exception:
            continue
    return bad


# What OpenAI's strict mode takes (its structured-outputs subset of JSON Schema).
_STRICT_KEYWORDS = frozenset(
    {
        "type", "properties", "required", "additionalProperties", "items", "enum", "const",
        "anyOf", "$ref", "$defs", "definitions", "description", "title",
        "pattern", "format", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum",
        "multipleOf", "minItems", "maxItems",
    }
)  # fmt: skip
_STRICT_MAX_DEPTH = 10
_STRICT_MAX_PROPERTIES = 5000


def strict_problem(schema: Mapping[str, Any]) -> str | None:
    """Why strict mode cannot take `schema` (None: it can). Every object must set
    `additionalProperties: false` and require every property; only the keywords strict
    mode knows may appear; at most 10 levels of nesting and 5000 properties."""
    if "anyOf" in schema:
        return "the root is an anyOf"
    count = 0

    def walk(node: Any, where: str, depth: int) -> str | None:
        nonlocal count
        if not isinstance(node, Mapping):
            return f"{where} is not a schema object"
        if depth > _STRICT_MAX_DEPTH:
            return f"{where} nests deeper than {_STRICT_MAX_DEPTH} levels"
        unknown = sorted(set(node) - _STRICT_KEYWORDS)
        if unknown:
            return f"{where} uses {', '.join(unknown)}"
        kinds = node.get("type")
        props = node.get("properties")
        if kinds == "object" or (isinstance(kinds, list) and "object" in kinds) or props is not None:
            if node.get("additionalProperties") is not False:
                return f"{where} does not set additionalProperties to false"
            props = props or {}
            if not isinstance(props, Mapping):
                return f"{where}.properties is not an object"
            missing = sorted(set(props) - set(node.get("required") or ()))
            if missing:
                return f"{where} does not require {', '.join(missing)}"
            count += len(props)
            if count > _STRICT_MAX_PROPERTIES:
                return f"more than {_STRICT_MAX_PROPERTIES} properties"
            for name, sub in props.items():
                if found := walk(sub, f"{where}.properties.{name}", depth + 1):
                    return found
        children: list[tuple[str, Any]] = []
        if "items" in node:
            children.append((f"{where}.items", node["items"]))
        options = node.get("anyOf") or ()
        children += [(f"{where}.anyOf[{i}]", sub) for i, sub in enumerate(options)]
        for defs in ("$defs", "definitions"):
            named = node.get(defs) or {}
            if not isinstance(named, Mapping):
                return f"{where}.{defs} is not an object"
            children += [(f"{where}.{defs}.{name}", sub) for name, sub in named.items()]
        for at, sub in children:
            if found := walk(sub, at, depth + 1):
                return found
        return None

    return walk(schema, "$", 1)


def register_check(tool: Tool, isolation: Isolation = "thread") -> RegisteredTool:
    """Check `tool` and compile its validator; raise ToolDefinitionError naming the fault.
    `isolation` is the registry's default, for a tool that names none."""
    if not isinstance(tool, Tool):
        raise ToolDefinitionError(f"expected a Tool, got {tool!r}")
    if not isinstance(tool.name, str) or not _NAME.fullmatch(tool.name):
        raise ToolDefinitionError(
            f"a tool name is 1-128 characters of letters, digits, '_', '-' or '.', got {tool.name!r}"
        )
    if not callable(tool.handler):
        raise ToolDefinitionError(f"tool {tool.name!r}: handler is not callable, got {tool.handler!r}")
    schema = tool.parameters
    if not isinstance(schema, Mapping):
        raise ToolDefinitionError(f"tool {tool.name!r}: parameters must be a JSON schema object")
    if schema.get("type", "object") != "object":
        raise ToolDefinitionError(
            f"tool {tool.name!r}: parameters must describe an object, got type {schema.get('type')!r}"
        )
    try:
        jsonschema.Draft202012Validator.check_schema(schema)
    except jsonschema.SchemaError as exc:
        raise ToolDefinitionError(f"tool {tool.name!r}: invalid JSON schema: {exc.message}") from exc
    try:
        schema_json = json.dumps(tool.schema(), sort_keys=True, separators=(",", ":"))
    except (TypeError, ValueError) as exc:
        raise ToolDefinitionError(f"tool {tool.name!r}: schema is not JSON: {exc}") from exc
    # The seams are pure functions of the arguments, judged in pass 1, which never waits:
    # an async one would be truthy (or not iterable) without ever running, so say so here.
    seams = {"reads": tool.reads, "writes": tool.writes, "concurrent": tool.concurrent,
             "confirm": tool.confirm, "cache.when": tool.cache.when if tool.cache else None}  # fmt: skip
    for seam, fn in seams.items():
        if fn is not None and not isinstance(fn, bool) and _is_async_callable(fn):
            raise ToolDefinitionError(
                f"tool {tool.name!r}: {seam} must be a plain function of the arguments, got async {fn!r}"
            )
    if tool.timeout is not None and not tool.timeout > 0:
        raise ToolDefinitionError(f"tool {tool.name!r}: timeout must be positive, got {tool.timeout!r}")
    if tool.strict and (problem := strict_problem(schema)) is not None:
        log.warning("tool %r asks for strict mode, which its schema cannot take: %s", tool.name, problem)
    is_async = _is_async_callable(tool.handler)
    in_process = _in_process(tool, isolation, is_async)
    defaults = _top_level_defaults(schema)
    if missing := _unresolvable_local_refs(schema):
        # Logged, not refused: a source of many tools (an MCP server) registers them all
        # at once, and one broken schema must not take its siblings down. Each call of
        # this tool fails instead, naming the reference (pass 1, `_validate`).
        log.warning(
            "tool %r: its schema refers to %s, which it does not hold; every call of it will fail",
            tool.name,
            ", ".join(map(repr, missing)),
        )
    validator = jsonschema.Draft202012Validator(schema, format_checker=None, registry=_OFFLINE_REFS)
    if defaults and (bad := _defaults_off_schema(validator, schema, defaults)):
        message = (
            f"tool {tool.name!r}: the default of {', '.join(map(repr, bad))} fails its own schema; "
            "calls that leave it out are still valid (defaults are filled after validation), "
            "but the handler receives that default"
        )
        log.warning("%s", message)
        warnings.warn(message, UserWarning, stacklevel=3)
    return RegisteredTool(
        tool=tool,
        validator=validator,
        defaults=defaults,
        defaults_mutable=any(isinstance(v, dict | list) for v in defaults.values()),
        is_async=is_async,
        schema_json=schema_json,
        takes_force=tool.cache is not None and "force" not in (schema.get("properties") or {}),
        plain=tool.reads is None
        and tool.writes is None
        and tool.cache is None
        and isinstance(tool.concurrent, bool),
        cached_plain=tool.reads is None
        and tool.writes is None
        and tool.cache is not None
        and tool.cache.when is None
        and isinstance(tool.concurrent, bool),
        in_process=in_process,
        fast=compile_fast(schema, tool.name),
    )


def _in_process(tool: Tool, default: Isolation, is_async: bool) -> bool:
    """Whether `tool` runs in a worker process; a tool that asks and cannot is refused. An
    async handler runs on the loop whatever the registry's default (it has no thread to
    leave behind); asking for a process by name for one is an error."""
    if tool.isolation not in (None, "thread", "process"):
        raise ToolDefinitionError(
            f"tool {tool.name!r}: isolation is 'thread', 'process' or None, got {tool.isolation!r}"
        )
    isolation = tool.isolation or default
    if isolation != "process":
        return False
    if is_async:
        if tool.isolation is None:
            return False
        raise ToolDefinitionError(
            f"tool {tool.name!r}: isolation='process' runs sync handlers; {tool.handler!r} is async"
        )
    why = why_not_importable(tool.handler)
    if why is not None:
        asked = "asks for" if tool.isolation else "gets the registry's default"
        raise ToolDefinitionError(f"tool {tool.name!r} {asked} isolation='process', but its handler: {why}")
    return True


class Registry:
    """The tools a dispatcher can run, by name, in registration order."""

    def __init__(self, tools: list[Tool] | None = None, *, isolation: Isolation = "thread") -> None:
        """`isolation` is where the sync handlers of tools that name none run: "process" puts
        every such tool in worker processes, and registration refuses any that cannot go
        (a lambda, a closure). It is the registry's, not the dispatcher's, so that the check
        happens where tools are defined, once, as each is added."""
        if isolation not in ("thread", "process"):
            raise ValueError(f"isolation is 'thread' or 'process', got {isolation!r}")
        self.isolation: Isolation = isolation
        self._tools: dict[str, RegisteredTool] = {}
        for tool in tools or ():
            self.add(tool)

    def add(self, tool: Tool, *, replace: bool = False) -> Tool:
        """Register `tool`. A second tool of the same name is an error unless `replace`."""
        registered = register_check(tool, self.isolation)
        if tool.name in self._tools and not replace:
            raise ToolDefinitionError(f"a tool named {tool.name!r} is already registered")
        self._tools[tool.name] = registered
        return tool

    def copy(self) -> Registry:
        """A registry of the same tools, checked already (registration checks each schema
        against the metaschema, which costs a millisecond or so): adding to or removing
        from one leaves the other as it was."""
        copied = Registry(isolation=self.isolation)
        copied._tools = dict(self._tools)
        return copied

    def remove(self, name: str) -> None:
        try:
            del self._tools[name]
        except KeyError:
            raise UnknownTool(f"no tool named {name!r}") from None

    def get(self, name: str) -> Tool:
        try:
            return self._tools[name].tool
        except KeyError:
            raise UnknownTool(f"no tool named {name!r}") from None

    def registered(self, name: str) -> RegisteredTool | None:
        return self._tools.get(name)

    def names(self) -> list[str]:
        return list(self._tools)

    def __contains__(self, name: object) -> bool:
        return name in self._tools

    def __iter__(self) -> Iterator[Tool]:
        return (r.tool for r in self._tools.values())

    def __len__(self) -> int:
        return len(self._tools)

    def fingerprint(self) -> str:
        """A hash of every tool's name, description and schema: recordings carry it."""
        h = xxhash.xxh3_128()
        for name in sorted(self._tools):
            h.update(self._tools[name].schema_json.encode())
            h.update(b"\x00")
        return h.hexdigest()
