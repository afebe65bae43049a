"""The typed records (protocol/records.py) against the schema's field specs (protocol/schema.py): the same fields,
required alike, nested alike, of the same kind of value, so that the two declarations cannot drift apart."""

from __future__ import annotations

import types
import typing
from typing import Annotated, Any, Literal

import msgspec
import pytest

from gpuwatch.protocol import records, schema

KINDS = {"hello": records.Hello, "step": records.Step, "probe": records.Probe, "progress": records.Progress}


def _without_none(hint: Any) -> Any:
    """``X`` of ``X | None``; ``hint`` itself otherwise."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        members = [arg for arg in typing.get_args(hint) if arg is not type(None)]
        return members[0] if len(members) == 1 else typing.Union[tuple(members)]  # noqa: UP007  # built from a tuple
    return hint


def _scalar(hint: Any) -> Any:
    """The plain Python type(s) a hint holds: Annotated constraints dropped, a Literal of labels a str, the float
    that may be non-finite a float; a union as a set of them."""
    if typing.get_origin(hint) is Annotated:
        return _scalar(typing.get_args(hint)[0])
    if typing.get_origin(hint) is Literal:
        return frozenset(type(value) for value in typing.get_args(hint))
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return frozenset().union(*(_scalar(arg) for arg in typing.get_args(hint)))
    return frozenset({float if hint is records.MaybeNonFinite else hint})


def _agree(struct: type[msgspec.Struct], spec: schema._Field, path: str) -> None:
    assert spec.fields is not None, f"{path}: the schema's rule is not an object"
    fields = {field.name: field for field in msgspec.structs.fields(struct)}
    tag = {struct.__struct_config__.tag_field} - {None}  # a record's kind: the struct's tag, not a field
    assert set(fields) == spec.fields.keys() - tag, path
    assert {name for name, field in fields.items() if field.required} == spec.required - tag, path
    hints = typing.get_type_hints(struct)
    for name in fields:
        _same(hints[name], spec.fields[name], f"{path}.{name}")


def _same(hint: Any, spec: schema._Field, path: str) -> None:
    """The struct's annotation ``hint`` states what ``spec`` checks."""
    hint = _without_none(hint)
    origin = typing.get_origin(hint)
    if isinstance(hint, type) and issubclass(hint, msgspec.Struct):
        _agree(hint, spec, path)
    elif origin is list:
        assert spec.item is not None, f"{path}: a list in the struct, not in the schema"
        _same(typing.get_args(hint)[0], spec.item, f"{path}[]")
    elif origin is dict:
        if spec.check is schema._check_environment:  # names dropped unless allowed, not a rule msgspec states
            assert hint == dict[str, str], path
            return
        if spec.item is not None:  # a mapping of the schema's: {name: value}
            value_spec = spec.item
        else:  # an object of the schema's whose every field is optional and the same rule: {op: calls}
            assert spec.fields is not None and not spec.required, f"{path}: a dict in the struct"
            value_spec, *others = spec.fields.values()
            assert all(other is value_spec for other in others), path
        _same(typing.get_args(hint)[1], value_spec, f"{path}{{}}")
    else:
        assert spec.fields is None and spec.item is None, f"{path}: a scalar in the struct, not in the schema"
        assert _scalar(hint) == _scalar(spec.type), path


@pytest.mark.parametrize("kind", KINDS)
def test_each_record_struct_states_the_schemas_fields(kind):
    _agree(KINDS[kind], schema._KINDS[kind], kind)


def test_a_struct_that_drifts_from_the_schema_is_caught():
    class Drifted(records.CommonFields, tag="progress"):
        step: int
        phase: str
        stalled_seconds: float
        overdue_seconds: float | None = None  # required by the schema
        collective: records.InFlight | None = None
        stack: list[records.StackFrame] | None = None
        error: records.StepError | None = None

    with pytest.raises(AssertionError):
        _agree(Drifted, schema._PROGRESS, "progress")
