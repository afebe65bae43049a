"""The typed records (protocol/records.py) against the schema's field specs (protocol/schema.py): the same fields,
required alike, nested alike, of the same kind of value, so that the two declarations cannot drift apart. And the
typed path end to end: records the trainer's client wrote, read by the run-log source and through an agent's
/api/v1/state, give the same facts, holding what the records said; the diagnosis sources read them by attribute."""

from __future__ import annotations

import ast
import dataclasses
import json
import math
import time
import types
import typing
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
import pytest
from telemetry_records import JOB, collectives, hello, probe, progress, step

from gpuwatch.agent.snapshot import json_safe
from gpuwatch.agent.telemetry.readings import RankCounters, RankReadings, SampledSignals
from gpuwatch.agent.telemetry.rounds import StateReadings, rank_readings
from gpuwatch.agent.telemetry.store import TelemetryStore
from gpuwatch.diagnosis.sources import SourceError, run_log
from gpuwatch.diagnosis.sources import agent as agent_source
from gpuwatch.protocol import records, schema
from gpuwatch.trainer.telemetry import TelemetryClient

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
        assert spec.item is not None, f"{path}: a dict in the struct, not a mapping in the schema"
        value_spec = spec.item  # {name: value}, or {op: calls} of some keys (``_keyed``)
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


# --- the typed path end to end: client → run log / agent state → typed records → facts -------------------------------


def _records() -> list[dict[str, Any]]:
    """A rank's story with every kind of record and most optional fields: what the facts are checked against."""
    calls = collectives({"all_reduce": [0.002, 0.004], "broadcast": [1e-4]})
    return [
        hello(1, backends={"default": "nccl"}, cpus=8, notes=["a mesh it could not place"]),
        step(1, 1, loss=2.5, grad_norm=1.5, collectives=calls, collective_calls={"default": 3}, tokens=100,
             memory={"kind": "cuda", "peak_bytes": 7 << 30, "allocated_bytes": 6 << 30, "alloc_retries": 2},
             pipeline={"busy_seconds": 0.8, "idle_seconds": 0.2, "bubble_ratio": 0.2}),
        step(1, 2, loss=2.25, grad_norm=1.25, collectives=calls, grad_cosine_similarity=0.75, param_checksum="abc123",
             unavailable={"grad_norm": "nonfinite_gradient"},
             memory={"kind": "cuda", "peak_bytes": 6 << 30, "allocated_bytes": 5 << 30, "alloc_retries": 1}),
        progress(1, collective={"group": "tp", "group_size": 2, "group_rank": 1},
                 stack=[{"file": "train.py", "line": 12, "function": "step"}],
                 error={"type": "RuntimeError", "message": "NCCL timeout"}),
        probe(),
    ]


def _logged(tmp_path, records_sent: list[dict[str, Any]]):
    """The records as the trainer's client writes them (its encoder, a run log), and the log's path."""
    path = tmp_path / "rank.jsonl"
    with TelemetryClient(tmp_path / "no-agent.sock", run_log=path, heartbeat_interval=0) as client:
        for record in records_sent:
            client.send(record)
    return path


def _agent_state(lines: list[bytes]) -> Any:
    """An agent's /api/v1/state, as JSON on the wire, after it received ``lines``."""
    store = TelemetryStore()
    for line in lines:
        assert store.ingest(line) is None
    ranks, counts = store.snapshot()
    telemetry = StateReadings(Path("/run/gpuwatch.sock"), None, 120.0)(ranks, counts, store.probes())
    state = {"agent": {"node": "n1", "mode": "real"}, "timestamp": time.time(),
             "collectors": {"telemetry": {"up": True}}, "facts": {"telemetry": telemetry}}
    return json.loads(json.dumps(json_safe(state), allow_nan=False))


def test_a_rank_reads_into_the_same_facts_from_an_agent_and_from_a_run_log(tmp_path):
    path = _logged(tmp_path, _records())
    from_log = run_log.read(path)
    from_agent = agent_source.facts_from_state(_agent_state(path.read_bytes().splitlines()), "http://n1/")
    (logged,), (served,) = from_log.ranks, from_agent.ranks
    assert served.node == "n1" and logged.node == "node-1"
    assert dataclasses.replace(served, node=None, hello_age_seconds=None) == dataclasses.replace(
        logged, node=None, hello_age_seconds=None, history=None)
    assert from_agent.bandwidth == [dataclasses.replace(peak, node="n1") for peak in from_log.bandwidth]


def test_facts_hold_what_the_records_said(tmp_path):
    sent = _records()
    path = _logged(tmp_path, sent)
    (rank,) = agent_source.facts_from_state(_agent_state(path.read_bytes().splitlines()), "http://n1/").ranks
    said_hello = sent[0]
    assert (rank.job, rank.rank, rank.hostname, rank.cpus) == (JOB, 1, "node-1", 8)
    assert (rank.gpu_index, rank.gpu_uuid) == (said_hello["gpu"]["index"], said_hello["gpu"]["uuid"])
    assert (rank.env, rank.process_groups, rank.backends) == (said_hello["env"], {"tp": [0, 1]}, {"default": "nccl"})
    assert (rank.faults, rank.hello_notes) == (("slow_rank",), ("a mesh it could not place",))
    assert rank.layout is not None and (rank.layout.tp_rank, rank.layout.dp_rank, rank.layout.schedule) == (
        1, 0, "1f1b")
    assert rank.last is not None
    assert (rank.last.step, rank.last.loss, rank.last.grad_norm) == (2, 2.25, 1.25)
    assert (rank.last.memory_kind, rank.last.peak_bytes, rank.last.allocated_bytes) == ("cuda", 6 << 30, 5 << 30)
    assert (rank.steps, rank.alloc_retries) == (2, 3)
    assert {op: (calls.count, calls.bytes) for op, calls in rank.collectives.items()} == {
        op: (2 * len(latencies), 2 * sent[1]["collectives"][op]["bytes"])
        for op, latencies in {"all_reduce": [1, 2], "broadcast": [1]}.items()}
    assert (rank.grad_cosine.value, rank.grad_cosine.step) == (0.75, 2)
    assert (rank.param_checksum.value, rank.param_checksum.step) == ("abc123", 2)
    assert rank.unavailable == {"grad_norm": "nonfinite_gradient"}
    assert rank.window is not None and (rank.window.steps, rank.window.loss_min) == (2, 2.25)
    progress_facts = rank.progress
    assert progress_facts is not None and progress_facts.collective is not None
    assert (progress_facts.collective.group, progress_facts.collective.members) == ("tp", (0, 1))
    assert progress_facts.stack == ("train.py:12 step",)
    assert progress_facts.error == "RuntimeError: NCCL timeout"


def test_a_non_finite_loss_reads_back_from_the_agents_json(tmp_path):
    path = _logged(tmp_path, [hello(0), step(0, 1, loss=float("nan"), grad_norm=float("inf"))])
    (rank,) = agent_source.facts_from_state(_agent_state(path.read_bytes().splitlines()), "http://n1/").ranks
    assert rank.last is not None and math.isnan(rank.last.loss) and rank.last.grad_norm == math.inf
    assert rank.nonfinite_steps == 1


def test_the_typed_rank_state_names_every_key_the_agent_writes(tmp_path):
    """``rank_readings`` and ``RankReadings`` are the two ends of one JSON object: a key one adds is the other's."""
    store = TelemetryStore()
    for record in _records()[:3]:
        store.ingest(schema.encode(record))
    (state,), _ = store.snapshot()
    written = rank_readings(state)
    assert set(written) == set(RankReadings.__struct_fields__)
    assert set(written["counters"]) == set(RankCounters.__struct_fields__)
    assert set(written["sampled"]) == set(SampledSignals.__struct_fields__)


@pytest.mark.parametrize(("rank", "where"), [
    ({"job": JOB, "rank": "zero"}, "$.telemetry.ranks[0].rank"),
    ({"rank": 0}, "$.telemetry.ranks[0]"),
    ({"job": JOB, "rank": 0, "hello": {"kind": "hello", "world_size": 2}}, "$.telemetry.ranks[0].hello"),
    ({"job": JOB, "rank": 0, "counters": {"steps": "many"}}, "$.telemetry.ranks[0].counters.steps"),
])
def test_a_malformed_rank_in_an_agents_state_is_a_source_error_saying_where(rank, where):
    state = {"agent": {"node": "n1"}, "collectors": {}, "facts": {"telemetry": {"ranks": [rank]}}}
    with pytest.raises(SourceError) as raised:
        agent_source.facts_from_state(state, "http://n1/")
    message = str(raised.value)
    assert where in message and "\n" not in message


# --- no string keys on record bodies in the agent's telemetry and the diagnosis sources -------------------------------

ROOT = Path(__file__).resolve().parent.parent
#: The files that read telemetry (relative to the repository); each may read these string keys, for the reason given.
ALLOWED_STRING_KEYS = {
    "diagnosis/sources/agent.py": (
        frozenset({"agent", "node", "mode", "facts", "collectors", "last_error", "partial_errors", "timestamp"}),
        "the state's envelope: the agent's identity and its collectors' statuses, not telemetry records"),
    "diagnosis/sources/run_log.py": (frozenset(), ""),
    "diagnosis/sources/telemetry.py": (frozenset(), ""),
    "diagnosis/sources/local.py": (frozenset(), ""),
    "agent/telemetry/series.py": (frozenset({"memory", "default"}),
                            "the store's sampled signals by name (``SAMPLED_FIELDS``), and the default process group "
                            "among a hello's backends: mappings, not record fields"),
    "agent/telemetry/window.py": (frozenset({"step", "time", "loss", "grad_norm", "param_checksum", "bubble_ratio"}),
                            "``StepPoint.from_dict`` reads a point's own JSON form back from /api/v1/state, and a "
                            "summary its medians by timing"),
    **{f"agent/telemetry/{path.name}": (frozenset(), "") for path in (ROOT / "agent" / "telemetry").glob("*.py")
       if path.name not in {"series.py", "window.py"}},
}


def _string_keys(path: Path) -> set[str]:
    """Every ``x.get("key", ...)`` and ``x["key"]`` of ``path``."""
    keys = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get"
                and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            keys.add(node.args[0].value)
        elif (isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant)
              and isinstance(node.slice.value, str)):
            keys.add(node.slice.value)
    return keys


@pytest.mark.parametrize("name", ALLOWED_STRING_KEYS)
def test_telemetry_is_read_by_attribute_not_by_string_key(name):
    allowed, _why = ALLOWED_STRING_KEYS[name]
    assert _string_keys(ROOT / name) - allowed == set()


def test_every_telemetry_module_is_checked():
    assert {f"agent/telemetry/{path.name}" for path in (ROOT / "agent" / "telemetry").glob("*.py")} \
        <= ALLOWED_STRING_KEYS.keys()


def test_the_string_key_check_finds_both_forms(tmp_path):
    source = tmp_path / "reader.py"
    source.write_text('def f(body):\n    return body.get("loss"), body["step"], body.get(name), body[0]\n')
    assert _string_keys(source) == {"loss", "step"}
