"""Whether a JSON schema has a finite instance at all.

llguidance compiles `{"$ref": "#"}` (or an object that requires a property of
its own type, or a non-empty array of itself) without complaint, but the
grammar admits no text: every instance must contain another one. The runner
would then end the reply at once, empty. Such a schema is refused up front.

Productive schemas are found as productive grammar rules are: the local `$ref`
targets that have a finite instance, given those found so far, until none is
added; then the schema itself. Keywords this check does not know admit an
instance as far as it can tell (llguidance refuses what it cannot compile).
"""

from collections.abc import Mapping
from typing import Any, cast

# The types whose instances can hold other instances; any other has a finite one.
_CONTAINER_TYPES = frozenset({"object", "array"})


def has_finite_instance(schema: object) -> bool:
    """Whether some finite JSON value satisfies `schema` (a draft 2020-12 schema
    as llguidance reads it, `$ref`s local to it)."""
    refs = _local_refs(schema)
    productive = {ref for ref in refs if _resolve(schema, ref) is None}  # not ours to judge
    grew = True
    while grew:
        grew = False
        for ref in refs - productive:
            if _finite(_resolve(schema, ref), productive):
                productive.add(ref)
                grew = True
    return _finite(schema, productive)


def _local_refs(schema: object) -> set[str]:
    refs: set[str] = set()
    pending = [schema]
    while pending:
        value = pending.pop()
        if isinstance(value, dict):
            entries = cast(dict[str, object], value)
            ref = entries.get("$ref")
            if isinstance(ref, str) and ref.startswith("#"):
                refs.add(ref)
            pending.extend(entries.values())
        elif isinstance(value, list):
            pending.extend(cast(list[object], value))
    return refs


def _resolve(schema: object, ref: str) -> object | None:
    """The part of `schema` a `#/...` JSON pointer names; None if it names none."""
    target = schema
    for token in ref.removeprefix("#").split("/")[1:]:
        key = token.replace("~1", "/").replace("~0", "~")
        if isinstance(target, dict):
            target = cast(dict[str, object], target).get(key)
        elif isinstance(target, list) and key.isdigit() and int(key) < len(target):
            target = cast(list[object], target)[int(key)]
        else:
            return None
    return target


def _finite(schema: object, productive: set[str]) -> bool:
    """Whether `schema` has a finite instance when the refs in `productive` do."""
    if schema is False:
        return False
    if not isinstance(schema, dict):
        return True
    fields = cast(dict[str, Any], schema)
    ref = fields.get("$ref")
    if isinstance(ref, str) and ref.startswith("#") and ref not in productive:
        return False
    if not all(_finite(part, productive) for part in _schemas(fields.get("allOf"))):
        return False
    for key in ("anyOf", "oneOf"):
        branches = _schemas(fields.get(key))
        if branches and not any(_finite(branch, productive) for branch in branches):
            return False
    declared = fields.get("type")
    types = {declared} if isinstance(declared, str) else set(_strings(declared))
    if not types or types - _CONTAINER_TYPES:
        return True
    return ("object" in types and _finite_object(fields, productive)) or (
        "array" in types and _finite_array(fields, productive)
    )


def _schemas(value: object) -> list[object]:
    return cast(list[object], value) if isinstance(value, list) else []


def _strings(value: object) -> list[str]:
    return [item for item in _schemas(value) if isinstance(item, str)]


def _finite_object(fields: Mapping[str, Any], productive: set[str]) -> bool:
    properties = fields.get("properties")
    known = cast(dict[str, object], properties) if isinstance(properties, dict) else {}
    required = _strings(fields.get("required"))
    return all(_finite(known.get(name, True), productive) for name in required)


def _finite_array(fields: Mapping[str, Any], productive: set[str]) -> bool:
    least = fields.get("minItems")
    prefix = _schemas(fields.get("prefixItems"))
    items = fields.get("items", True)
    count = least if isinstance(least, int) and least > 0 else 0
    # Positions past the prefix all take `items`: checking one of them is enough.
    needed = prefix[:count] + ([items] if count > len(prefix) else [])
    return all(_finite(item, productive) for item in needed)
