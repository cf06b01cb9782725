"""plan.json's JSON Schema, generated from the Plan dataclasses, and the validator every plan load goes through.

The schema cannot drift from the code: each property comes from a dataclass field of `planner.plan` (`Plan`,
`Mesh`, `StageSpec`, `OpPlacement`) — its JSON type from the annotation, its description from the docstring under
it, and its constraints (minimum, enum, placement strings, required) from the field's metadata (`plan._meta`).
`plan schema` prints it. `check_plan_dict` validates a loaded plan against it with a small validator for exactly the
keywords the schema uses (type, properties, required, additionalProperties, items, enum, minimum, pattern, $ref),
so no JSON Schema library is needed at run time, and reports the first problem as one line naming the field path:
`plan.json: mesh.tp: expected an integer >= 1, got "2"`.
"""
from __future__ import annotations

import ast
import collections.abc
import dataclasses
import functools
import inspect
import json
import re
import typing
from typing import Any, Mapping

from planner.errors import PlanError

DIALECT = "https://json-schema.org/draft/2020-12/schema"
"""The JSON Schema version the schema is written in."""
PLACEMENT_PATTERN = r"^(R|P|S\(-?[0-9]+\))$"
"""DTensor's shorthand over the tp axis: R replicate, P partial sums, S(d) shard tensor dim d."""


def _field_docs(cls: type) -> dict[str, str]:
    """The docstring under each annotated field of a dataclass, from its source (one line of whitespace each)."""
    tree = ast.parse(inspect.getsource(cls).lstrip())
    body = tree.body[0].body
    docs = {}
    for stmt, nxt in zip(body, body[1:]):
        if (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str)):
            docs[stmt.target.id] = " ".join(nxt.value.value.split())
    return docs


def _type_schema(tp: Any) -> dict[str, Any]:
    """JSON Schema of a Python annotation: int, float, bool, str, tuple[X, ...], Mapping[str, X], Any, or one of
    the plan's dataclasses (a $ref)."""
    if tp is Any:
        return {}
    if dataclasses.is_dataclass(tp):
        return {"$ref": f"#/$defs/{tp.__name__}"}
    simple = {bool: "boolean", int: "integer", float: "number", str: "string"}
    if tp in simple:
        return {"type": simple[tp]}
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        return {"type": "array", "items": _type_schema(args[0])}
    if origin in (dict, collections.abc.Mapping):
        return {"type": "object", "additionalProperties": _type_schema(args[1]) if args else {}}
    raise TypeError(f"plan_schema: no JSON Schema for the annotation {tp!r}; extend _type_schema")


def dataclass_schema(cls: type) -> dict[str, Any]:
    """The object schema of one plan dataclass: a property per field (type, description, metadata constraints),
    the required fields, no other keys."""
    hints = typing.get_type_hints(cls)
    docs = _field_docs(cls)
    props, required = {}, []
    for f in dataclasses.fields(cls):
        meta = f.metadata or {}
        prop = _type_schema(hints[f.name])
        extra = dict(meta.get("schema", {}))
        if "items" in extra and prop.get("type") == "array":
            prop["items"] = extra.pop("items")
        if extra.get("$ref"):
            prop = {}
        prop.update(extra)
        if f.name in docs:
            prop["description"] = docs[f.name]
        props[f.name] = prop
        if meta.get("required") or (f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING):
            required.append(f.name)
        elif isinstance(f.default, (int, float, str, bool)):
            prop["default"] = f.default
    return {"type": "object", "title": cls.__name__, "description": " ".join((cls.__doc__ or "").split()),
            "properties": props, "required": required, "additionalProperties": False}


@functools.lru_cache(maxsize=1)
def _schema_text() -> str:
    from planner.plan import Mesh, OpPlacement, Plan, StageSpec
    root = dataclass_schema(Plan)
    root = {"$schema": DIALECT, "title": "shardwise plan.json",
            "description": "A parallelization plan written by `plan ... -o plan.json` (or by hand) and read by "
                           "`plan measure` and `executor.apply_plan`. " + root["description"],
            **{k: v for k, v in root.items() if k not in ("title", "description")}}
    root["$defs"] = {c.__name__: dataclass_schema(c) for c in (Mesh, StageSpec, OpPlacement)}
    root["$defs"]["Placement"] = {"type": "string", "pattern": PLACEMENT_PATTERN,
                                  "title": "a placement over the tp axis (R, P or S(dim))"}
    return json.dumps(root, indent=1)


def plan_schema() -> dict[str, Any]:
    """plan.json's JSON Schema (draft 2020-12), as a fresh dict."""
    return json.loads(_schema_text())


# ---- the validator -------------------------------------------------------------------------------------------------
_TYPE_WORDS = {"object": "an object", "array": "a list", "string": "a string", "integer": "an integer",
               "number": "a number", "boolean": "true or false"}


def _is_type(value: Any, t: str) -> bool:
    if t == "integer":
        return (isinstance(value, int) and not isinstance(value, bool)) or (
            isinstance(value, float) and value.is_integer())
    if t == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return {"object": dict, "array": list, "string": str, "boolean": bool}[t] is type(value) or (
        t == "object" and isinstance(value, Mapping)) or (t == "array" and isinstance(value, tuple))


def _show(value: Any) -> str:
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _key(path: str, key: str) -> str:
    """`path.key`, or `path["key"]` for keys that are not plain words (op names hold dots)."""
    if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
        return f"{path}.{key}" if path else key
    return f"{path}[{json.dumps(key)}]"


def _expected(schema: Mapping[str, Any]) -> str:
    """What a value must be, in words: 'an integer >= 1', 'one of none, selective, full', 'a placement ...'."""
    if "enum" in schema:
        return "one of " + ", ".join(str(v) for v in schema["enum"])
    if "pattern" in schema:
        return schema.get("title") or f"a string matching {schema['pattern']}"
    words = _TYPE_WORDS.get(schema.get("type", ""), "a value")
    if "minimum" in schema:
        words += f" >= {schema['minimum']}"
    return words


def _errors(value: Any, schema: Mapping[str, Any], root: Mapping[str, Any], path: str):
    """Yield (path, message) for each way `value` breaks `schema`; stops descending at the first type error."""
    if "$ref" in schema:
        schema = root["$defs"][schema["$ref"].rsplit("/", 1)[1]]
    t = schema.get("type")
    if t and not _is_type(value, t):
        yield path, f"expected {_expected(schema)}, got {_show(value)}"
        return
    if "enum" in schema and value not in schema["enum"]:
        yield path, f"expected {_expected(schema)}, got {_show(value)}"
    if "minimum" in schema and value < schema["minimum"]:
        yield path, f"expected {_expected(schema)}, got {_show(value)}"
    if "pattern" in schema and not re.search(schema["pattern"], value):
        yield path, f"expected {_expected(schema)}, got {_show(value)}"
    if t == "array":
        for i, item in enumerate(value):
            yield from _errors(item, schema.get("items", {}), root, f"{path}[{i}]")
    if t == "object":
        props = schema.get("properties", {})
        for key in schema.get("required", ()):
            if key not in value:
                yield path, f"missing key {key!r}"
        extra = schema.get("additionalProperties", True)
        for key, item in value.items():
            if key in props:
                yield from _errors(item, props[key], root, _key(path, str(key)))
            elif extra is False:
                yield path, f"unknown key {key!r} (known: {', '.join(sorted(props))})"
            elif isinstance(extra, Mapping):
                yield from _errors(item, extra, root, _key(path, str(key)))


def plan_errors(data: Any) -> list[str]:
    """Every way `data` (parsed plan.json) breaks the schema, as `path: message` lines."""
    schema = plan_schema()
    return [f"{path}: {msg}" if path else msg for path, msg in _errors(data, schema, schema, "")]


def check_plan_dict(data: Any, where: str = "plan") -> None:
    """Raise PlanError `where: path: message` for the first way `data` breaks plan.json's schema."""
    if not isinstance(data, Mapping):
        raise PlanError(f"{where}: expected a JSON object at the top level, got {_show(data)}")
    schema = plan_schema()
    for path, msg in _errors(data, schema, schema, ""):
        raise PlanError(f"{where}: {path}: {msg}" if path else f"{where}: {msg}")


def main(argv: list[str]) -> int:
    """`plan schema [-o FILE]`: print plan.json's JSON Schema, or write it atomically."""
    from planner.cli import ArgParser
    from planner.plan import check_output, write_atomic
    p = ArgParser(prog="plan schema", description="Print the JSON Schema of plan.json (draft 2020-12), generated "
                  "from the plan's dataclasses. `plan measure`, `apply_plan` and every command that reads a plan "
                  "validate it against this schema and name the field path of the first problem.")
    p.add_argument("-o", "--output", metavar="FILE", help="write the schema here instead of printing it")
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    args = p.parse_args(argv)
    if args.output is not None:  # `-o ""` printed to stdout: refused as every other command's empty -o
        check_output(args.output, "-o")
        write_atomic(args.output, _schema_text() + "\n")
        print(f"wrote {args.output}")
    else:
        print(_schema_text())
    return 0
