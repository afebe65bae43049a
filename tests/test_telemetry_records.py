"""The typed records (protocol/records.py), the one declaration of each record, against what decode does with
them: a record carrying every declared field round-trips, a field of the wrong type is refused at any depth, and
each declared constraint gives its reject reason. And the typed path end to end: records the trainer's client
wrote, read by the run-log source and through an agent's /api/v1/state, give the same facts, holding what the
records said; the diagnosis sources read them by attribute."""

from __future__ import annotations

import ast
import dataclasses
import json
import math
import re
import time
import types
import typing
from pathlib import Path
from typing import Annotated, Any

import msgspec
import pytest
from telemetry_records import JOB, collectives, hello, probe, progress, step

from gpuwatch.agent.snapshot import json_safe
from gpuwatch.agent.telemetry.readings import RankCounters, RankReadings, SampledSignals
from gpuwatch.agent.telemetry.rounds import StateReadings, rank_readings
from gpuwatch.agent.telemetry.store import TelemetryStore
from gpuwatch.diagnosis.sources import SourceError, run_log
from gpuwatch.diagnosis.sources import agent as agent_source
from gpuwatch.diagnosis.sources import telemetry as telemetry_source
from gpuwatch.protocol import records, schema
from gpuwatch.trainer.telemetry import TelemetryClient

KINDS = {"hello": records.Hello, "step": records.Step, "probe": records.Probe, "progress": records.Progress}

#: A record of each kind with every field its struct declares, at every depth (``test_the_full_records_hold_every_
#: declared_field`` holds them to the structs): what the tests below change one field of at a time.
FULL = {
    "hello": hello(
        1, cpus=8, virtual_stages=2, stage_modules=["layers.2", "norm"], backends={"default": "nccl"},
        framework="plain", command=["python", "train.py"], unavailable_from_outside=["tokens", "mfu"],
        notes=["a mesh it could not place"], global_batch=8, seq_len=32,
        model={"layers": 2, "hidden": 64, "heads": 4, "kv_heads": 4, "ffn": 256, "vocab": 128,
               "tied_embeddings": False, "gated": True, "bias": False, "norm_params": 1, "positions": 0,
               "source": "flags"}),
    "step": step(
        1, 5, exposed_collective_seconds=0.1, outside_model_seconds=0.01, cpu_seconds=0.2, cpu_wait_seconds=0.02,
        gradient_sync_bytes=1000,
        collective_calls={"default": 3}, groups={"tp": {"bytes": 10, "seconds": 0.1}}, samples=4,
        param_checksum="abc123", unavailable={"grad_norm": "nonfinite_gradient"},
        client={"sent": 3, "dropped": {"busy": 1}},
        folded={"steps": [{"step": 4, "time": 1.0, "step_seconds": 0.5, "compute_seconds": 0.3,
                           "dataloader_wait_seconds": 0.01, "optimizer_seconds": 0.02, "outside_model_seconds": 0.01,
                           "exposed_collective_seconds": 0.1, "cpu_seconds": 0.2, "cpu_wait_seconds": 0.02,
                           "pipeline": {"bubble_ratio": 0.2}, "loss": 2.5, "grad_norm": 1.0}],
                "collectives": collectives({"all_reduce": [0.002]}), "tokens": 4096, "samples": 4}),
    "probe": probe(),
    "progress": progress(
        1, collective={"group": "tp", "group_size": 2, "group_rank": 1},
        stack=[{"file": "train.py", "line": 12, "function": "step"}],
        error={"type": "RuntimeError", "message": "NCCL timeout"},
        flight_recorder={"op": "all_reduce", "group": "0", "group_desc": "default_pg", "seq": 4, "p2p": False,
                         "state": "scheduled"}, cpu_seconds=12.5),
}


def _declared(struct: type[msgspec.Struct], prefix: str = "") -> dict[str, Any]:
    """Every field path the struct declares, at every depth, and its annotation (``X`` of ``X | None``, constraints
    kept): an object's fields by name, a list's items as ``[]`` and a mapping's values as ``{}``."""
    out = {}
    for name, hint in typing.get_type_hints(struct, include_extras=True).items():
        out.update(_paths(_without_none(hint), f"{prefix}{name}"))
    return out


def _paths(hint: Any, path: str) -> dict[str, Any]:
    base = typing.get_args(hint)[0] if typing.get_origin(hint) is Annotated else hint
    out = {path: hint}
    if isinstance(base, type) and issubclass(base, msgspec.Struct):
        out.update(_declared(base, f"{path}."))
    elif typing.get_origin(base) is list:
        out.update(_paths(typing.get_args(base)[0], f"{path}[]"))
    elif typing.get_origin(base) is dict:
        out.update(_paths(typing.get_args(base)[1], f"{path}{{}}"))
    return out


def _without_none(hint: Any) -> Any:
    """``X`` of ``X | None``; ``hint`` itself otherwise."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        members = [arg for arg in typing.get_args(hint) if arg is not type(None)]
        return members[0] if len(members) == 1 else typing.Union[tuple(members)]  # noqa: UP007  # built from a tuple
    return hint


Found = tuple[str, tuple[Any, ...], Any, Any]


def _found(kind: str) -> list[Found]:
    """Each field of the full record of ``kind``, at every depth (a list's first item, a mapping's first value), as
    (the path ``_declared`` names it by, where it is in the record, its value, its declared annotation)."""
    return _fields_of(KINDS[kind], FULL[kind], (), "")


def _fields_of(struct: type[msgspec.Struct], value: dict[str, Any], where: tuple[Any, ...], path: str) -> list[Found]:
    hints = typing.get_type_hints(struct, include_extras=True)
    out = []
    for name, item in value.items():
        if name != struct.__struct_config__.tag_field:
            out += _field(_without_none(hints[name]), item, (*where, name), f"{path}{name}")
    return out


def _field(hint: Any, value: Any, where: tuple[Any, ...], path: str) -> list[Found]:
    base = typing.get_args(hint)[0] if typing.get_origin(hint) is Annotated else hint
    out = [(path, where, value, hint)]
    if isinstance(base, type) and issubclass(base, msgspec.Struct):
        out += _fields_of(base, value, where, f"{path}.")
    elif typing.get_origin(base) is list:
        out += _field(typing.get_args(base)[0], value[0], (*where, 0), f"{path}[]")
    elif typing.get_origin(base) is dict:
        key = next(iter(value))
        out += _field(typing.get_args(base)[1], value[key], (*where, key), f"{path}{{}}")
    return out


def _with(record: dict[str, Any], where: tuple[str | int, ...], value: Any) -> dict[str, Any]:
    record = json.loads(json.dumps(record))
    *parents, last = where
    target = record
    for key in parents:
        target = target[key]
    target[last] = value
    return record


def _verdict(record: dict[str, Any]) -> tuple[str, str]:
    try:
        schema.decode(schema.encode(record))
    except schema.RecordRejected as rejected:
        return rejected.reason, rejected.field
    return "accepted", ""


def _field_of(where: tuple[str | int, ...]) -> str:
    return ".".join(map(str, where))


@pytest.mark.parametrize("kind", KINDS)
def test_the_full_records_hold_every_declared_field(kind):
    """What a struct declares, the full record carries, so every field below is tried (and nothing undeclared: a
    field no struct declares is a KeyError in ``_found``)."""
    assert {path for path, *_ in _found(kind)} == set(_declared(KINDS[kind]))


@pytest.mark.parametrize("kind", KINDS)
def test_a_record_of_every_field_round_trips(kind):
    body = schema.decode(schema.encode(FULL[kind])).body
    assert isinstance(body, KINDS[kind])
    assert body.as_dict() == FULL[kind]
    assert schema.decode(msgspec.json.encode(body.as_dict())).body.as_dict() == FULL[kind]


def _every_field() -> list[Any]:
    """Each field of each kind, named by its kind and path: not by its value, which for ``time`` is the clock's when
    collected, and every xdist worker must collect the same ids."""
    return [pytest.param(kind, where, value, id=f"{kind}-{'.'.join(map(str, where))}")
            for kind in KINDS for _, where, value, _ in _found(kind) if where[0] != "v"]


@pytest.mark.parametrize(("kind", "where", "value"), _every_field())
def test_every_field_is_validated(kind, where, value):
    """A field of the wrong JSON type, at any depth, is refused as such, naming the field."""
    wrong = {} if isinstance(value, list) else []
    assert _verdict(_with(FULL[kind], where, wrong)) == ("bad_type", _field_of(where))


def _constraint_cases() -> list[tuple[str, tuple[Any, ...], Any, str]]:
    """For each field of the full records, values just past what its declaration allows, and the reason each must
    be refused for: bounds, lengths, labels, choices, as ``protocol/records.py`` states them (and a non-finite
    number: refused but where it may be NaN or Infinity)."""
    cases = []
    for kind in KINDS:
        for _, where, value, hint in _found(kind):
            base, *marks = typing.get_args(hint) if typing.get_origin(hint) is Annotated else (hint,)
            label = records.Refused("bad_label") in marks
            for mark in marks:
                if isinstance(mark, msgspec.Meta | records.WhenFinite):
                    cases += [(kind, where, bound, "out_of_range") for bound in (
                        None if mark.ge is None else mark.ge - 1, None if mark.le is None else mark.le + 1)
                        if bound is not None and math.isfinite(bound)]
                if isinstance(mark, msgspec.Meta) and mark.max_length is not None:
                    too_long = _longer(value, mark.max_length + 1)
                    if len(json.dumps(too_long)) < schema.MAX_RECORD_BYTES // 2:  # else: too_large, judged unread
                        cases.append((kind, where, too_long, "bad_label" if label else "out_of_range"))
                if isinstance(mark, msgspec.Meta) and mark.min_length is not None:
                    cases.append((kind, where, value[:-1], "out_of_range"))
                if isinstance(mark, records.OneOf) and where[0] != "v":
                    cases.append((kind, where, "no-such-choice", "out_of_range"))
                if isinstance(mark, records.WhenFinite):
                    cases.append((kind, where, math.nan, "accepted"))
            if label:
                cases.append((kind, where, "a b", "bad_label"))
            if base is float:
                cases.append((kind, where, math.inf, "not_finite"))
    return cases


def _longer(value: Any, length: int) -> Any:
    """A string, list or mapping of ``length`` characters or items, made from ``value``'s first."""
    if isinstance(value, str):
        return "x" * length
    if isinstance(value, list):
        return value[:1] * length
    key = next(iter(value))
    return {f"{key}{index}": value[key] for index in range(length)}


@pytest.mark.parametrize(("kind", "where", "value", "reason"), _constraint_cases(), ids=lambda part: str(part)[:40])
def test_each_declared_constraint_gives_its_reject_reason(kind, where, value, reason):
    expected = (reason, "" if reason == "accepted" else _field_of(where))
    assert _verdict(_with(FULL[kind], where, value)) == expected


def test_a_folded_step_declares_its_fields_as_the_step_does():
    """The fields a folded step keeps are the step record's own, held to the same rules."""
    step_hints = typing.get_type_hints(records.Step, include_extras=True)
    for name, hint in typing.get_type_hints(records.FoldedStep, include_extras=True).items():
        if name != "pipeline":
            assert hint == step_hints[name], name


def _documented(kind: str) -> dict[str, bool]:
    """The fields schema.py's docstring (the wire format for humans) lists for a kind: name -> optional (``?``)."""
    sections = re.split(r"^``(hello|step|probe|progress)`` — ", schema.__doc__ or "", flags=re.M)
    text = dict(zip(sections[1::2], sections[2::2], strict=True))[kind]
    named = {}
    for line in text.splitlines():
        if listed := re.match(r"^    ([a-z_]+\??(?:, [a-z_]+\??)*)(?:\s|$)", line):
            named.update((name.rstrip("?"), name.endswith("?")) for name in listed.group(1).split(", "))
    return named


@pytest.mark.parametrize("kind", KINDS)
def test_the_wire_formats_prose_names_each_field_as_declared(kind):
    """schema.py documents the record for humans: each field of a kind (besides the common ones, documented once),
    optional (``?``) where the struct's is."""
    common = set(records.CommonFields.__struct_fields__)
    declared = {field.name: not field.required for field in msgspec.structs.fields(KINDS[kind])
                if field.name not in common}
    assert {name: optional for name, optional in _documented(kind).items() if name not in common} == declared


def test_the_step_view_reads_each_of_its_fields_from_the_records():
    """Diagnosis' StepFacts is filled by name from a step record, its pipeline and a memory reading: from a record of
    every field, each of the view's fields holds the record's value (a field of the view that the record does not
    name would stay empty here)."""
    body = schema.decode(schema.encode(FULL["step"])).body
    assert isinstance(body, records.Step) and body.memory is not None and body.pipeline is not None
    view = dataclasses.asdict(telemetry_source.step(body, body.memory))
    view["groups"] = {group: totals.as_dict() for group, totals in view["groups"].items()}
    sent = {**FULL["step"], **FULL["step"]["pipeline"], **FULL["step"]["memory"], "memory_kind": "cuda"}
    assert view == {name: sent[name] for name in view}


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
