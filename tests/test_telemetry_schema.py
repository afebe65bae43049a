"""Telemetry record schema v1: what decode accepts, and the stable reason for everything it rejects."""

import json
import math

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from telemetry_records import hello, plain_step, probe, progress, step

from gpuwatch.agent.telemetry.store import TelemetryStore
from gpuwatch.protocol import schema
from gpuwatch.protocol.schema import (
    COLLECTIVE_BUCKETS,
    MAX_FOLDED_STEPS,
    MAX_GROUP_TEXT_CHARS,
    MAX_MODULE_NAME_CHARS,
    MAX_RECORD_BYTES,
    MAX_STAGE_MODULES,
    REJECT_REASONS,
    RecordRejected,
    bucket_index,
    decode,
    encode,
    env_name_allowed,
)
from gpuwatch.trainer.telemetry import fold_steps

_NO_CALLS = {"count": 0, "bytes": 0, "seconds": 0.0, "buckets": [0] * (len(COLLECTIVE_BUCKETS) + 1)}
#: A step with two earlier ones folded into it, as a client sends it.
_FOLDED = fold_steps(step(number=3), [plain_step(number=1, samples=8), plain_step(number=2, samples=8)])


def _reason(datagram: bytes) -> tuple[str, str]:
    with pytest.raises(RecordRejected) as rejected:
        decode(datagram)
    assert rejected.value.reason in REJECT_REASONS
    return rejected.value.reason, rejected.value.field


def _without(record: dict, *path: str) -> dict:
    record = json.loads(json.dumps(record))
    *parents, last = path
    target = record
    for key in parents:
        target = target[key]
    del target[last]
    return record


def test_valid_hello_and_step_decode_to_their_known_fields():
    record = decode(encode(hello(rank=5, future_field={"nested": [1, 2]})))
    assert (record.kind, record.job, record.rank) == ("hello", "job-42", 5)
    assert record.body.as_dict()["gpu"]["uuid"].startswith("GPU-00000005")
    assert "future_field" not in record.body.as_dict()  # forward compatible: ignored, not stored
    assert (record.body.tp_rank, record.body.dp_rank, record.body.pp_stage) == (1, 0, 1)

    body = decode(encode(step(step_seconds=2, lr=0))).body.as_dict()
    assert body["step_seconds"] == 2.0 and isinstance(body["step_seconds"], float)
    assert body["collectives"]["all_reduce"]["count"] == 2
    assert body["memory"]["kind"] == "cuda"


def test_the_fields_that_say_what_a_rank_runs_on_and_why_a_signal_is_missing():
    body = decode(encode(hello(cpus=2, backends={"default": "gloo", "dp": "gloo"}))).body.as_dict()
    assert (body["cpus"], body["backends"]) == (2, {"default": "gloo", "dp": "gloo"})
    assert _reason(encode(hello(cpus=0))) == ("out_of_range", "cpus")
    assert _reason(encode(hello(backends={"dp": "nccl; rm"}))) == ("bad_label", "backends.dp")
    body = decode(encode(step(samples=32, exposed_collective_seconds=0.01,
                              unavailable={"grad_cosine_similarity": "zero_gradient"}))).body.as_dict()
    assert (body["samples"], body["exposed_collective_seconds"]) == (32, 0.01)
    assert body["unavailable"] == {"grad_cosine_similarity": "zero_gradient"}
    assert _reason(encode(step(unavailable={"loss": "zero_gradient"}))) == ("out_of_range", "unavailable.loss")
    assert _reason(encode(step(unavailable={"grad_norm": "because"}))) == ("out_of_range", "unavailable.grad_norm")


def test_the_pipeline_layout_a_hello_says_its_virtual_stages_and_the_modules_of_its_stage():
    modules = ["layers.2", "layers.3", "norm", "output"]
    body = decode(encode(hello(schedule="interleaved_1f1b", virtual_stages=2, stage_modules=modules))).body
    assert (body.schedule, body.virtual_stages, body.stage_modules) == ("interleaved_1f1b", 2, modules)
    assert decode(encode(hello())).body.virtual_stages is None  # absent: one stage per rank
    assert _reason(encode(hello(virtual_stages=0))) == ("out_of_range", "virtual_stages")
    assert _reason(encode(hello(stage_modules=["layers.0"] * (MAX_STAGE_MODULES + 1)))) == ("out_of_range",
                                                                                          "stage_modules")
    assert _reason(encode(hello(stage_modules=["x" * (MAX_MODULE_NAME_CHARS + 1)]))) == ("out_of_range",
                                                                                       "stage_modules.0")
    assert _reason(encode(hello(stage_modules=[3]))) == ("bad_type", "stage_modules.0")


def test_minimal_step_of_a_partially_instrumented_script_is_accepted():
    minimal = {key: step()[key] for key in ("v", "kind", "job", "rank", "step", "time", "step_seconds")}
    assert set(decode(encode(minimal)).body.as_dict()) == set(minimal)


def test_nulls_count_as_absent_for_optional_fields():
    body = decode(encode(hello(gpu=None, schedule=None, nccl_version=None))).body.as_dict()
    assert "gpu" not in body and "schedule" not in body


@pytest.mark.parametrize("field, value", [
    ("loss", math.nan), ("loss", math.inf), ("loss", -math.inf), ("grad_norm", math.nan), ("grad_norm", math.inf),
])
def test_non_finite_loss_and_grad_norm_are_data(field, value):
    datagram = encode(step(**{field: value}))
    assert b"NaN" in datagram or b"Infinity" in datagram  # as json.dumps writes them
    decoded = decode(datagram).body.as_dict()[field]
    assert math.isnan(decoded) if math.isnan(value) else decoded == value


def test_environment_is_filtered_by_the_agent_too():
    env = {"NCCL_DEBUG": "INFO", "AWS_SECRET_ACCESS_KEY": "hunter2", "WANDB_API_KEY": "k", "NCCL_FAKE_TOKEN": "t",
           "HOME": "/root", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}
    body = decode(encode(hello(env=env))).body.as_dict()
    assert body["env"] == {"NCCL_DEBUG": "INFO", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}


@pytest.mark.parametrize("name, allowed", [
    ("NCCL_IB_HCA", True), ("CUDA_VISIBLE_DEVICES", True), ("PYTORCH_CUDA_ALLOC_CONF", True),
    ("MASTER_ADDR", True), ("LOCAL_RANK", True), ("TORCHELASTIC_RUN_ID", True),
    ("AWS_SECRET_ACCESS_KEY", False), ("WANDB_API_KEY", False), ("NCCL_FAKE_TOKEN", False),
    ("TORCH_HUB_PASSWORD", False), ("CUDA_CREDENTIALS", False), ("NCCL_AUTH_STRING", False),
    ("HF_TOKEN", False), ("PATH", False), ("nccl_debug", False), ("NCCL_DEBUG\n", False),
])
def test_env_name_allowlist(name, allowed):
    assert env_name_allowed(name) is allowed


def _mutated(**fields) -> bytes:
    return encode(step(**fields))


def _nested_unknown(levels: int) -> bytes:
    value: object = 1
    for _ in range(levels):
        value = [value]
    return encode(step(extension=value))


@pytest.mark.parametrize("datagram, reason, field", [
    (b"{" + b" " * MAX_RECORD_BYTES + b"}", "too_large", ""),
    (b"\xff\xfe{}", "not_json", ""),
    (json.dumps(step()).encode("utf-16"), "not_json", ""),
    (encode(step())[:-7], "not_json", ""),
    (b"", "not_json", ""),
    (b"[" * 5000, "too_deep", ""),
    (_nested_unknown(5), "too_deep", "extension"),
    (b"[]", "not_object", ""),
    (b'"step"', "not_object", ""),
    (_mutated(v=2), "bad_version", "v"),
    (_mutated(v="1"), "bad_version", "v"),
    (_mutated(v=True), "bad_version", "v"),
    (encode(_without(step(), "v")), "bad_version", "v"),
    (_mutated(kind="goodbye"), "bad_kind", "kind"),
    (_mutated(kind=["step"]), "bad_kind", "kind"),
    (encode(_without(step(), "step_seconds")), "missing_field", "step_seconds"),
    (encode(_without(hello(), "pid")), "missing_field", "pid"),
    (encode(_without(step(), "memory", "peak_bytes")), "missing_field", "memory.peak_bytes"),
    (_mutated(loss="2.5"), "bad_type", "loss"),
    (_mutated(rank=1.0), "bad_type", "rank"),
    (_mutated(step=True), "bad_type", "step"),
    (_mutated(nonfinite=1), "bad_type", "nonfinite"),
    (_mutated(memory={"kind": "cuda", "peak_bytes": 1.5}), "bad_type", "memory.peak_bytes"),
    (_mutated(collectives={"all_reduce": []}), "bad_type", "collectives.all_reduce"),
    (_mutated(step_seconds=-0.1), "out_of_range", "step_seconds"),
    (_mutated(mfu=1.5), "out_of_range", "mfu"),
    (_mutated(rank=2**40), "out_of_range", "rank"),
    (_mutated(tokens=10**400), "out_of_range", "tokens"),
    (_mutated(grad_cosine_similarity=1.5), "out_of_range", "grad_cosine_similarity"),
    (_mutated(param_checksum="not-hex"), "out_of_range", "param_checksum"),
    (_mutated(memory={"kind": "gpu", "peak_bytes": 1}), "out_of_range", "memory.kind"),
    (encode(hello(tp_rank=2)), "out_of_range", "tp_rank"),
    (_mutated(collectives={"all_reduce": {"count": 3, "bytes": 0, "seconds": 0.1, "buckets": [1] * 20}}),
     "out_of_range", "collectives.all_reduce.buckets"),
    (_mutated(collectives={"all_reduce": {"count": 1, "bytes": 0, "seconds": 0.1, "buckets": [1]}}),
     "out_of_range", "collectives.all_reduce.buckets"),
    (_mutated(collectives={"all_reduce": {"count": 0, "bytes": 0, "seconds": 0.1,
                                          "buckets": [0, 0, 0, -1, *[1] * 16]}}),
     "out_of_range", "collectives.all_reduce.buckets.3"),
    (_mutated(collectives={"all_reduce": {"count": 1, "bytes": 0, "seconds": 0.1, "buckets": [0, True] + [0] * 18}}),
     "bad_type", "collectives.all_reduce.buckets.1"),
    (encode({**_FOLDED, "folded": {"steps": [{"step": 2, "time": 1.0, "step_seconds": 0.5}] * 2}}),
     "out_of_range", "folded.steps"),  # each folded step numbered below the next
    (encode({**_FOLDED, "folded": {"steps": [{"step": 4, "time": 1.0, "step_seconds": 0.5}]}}),
     "out_of_range", "folded.steps"),  # and below the record's own
    (encode({**_FOLDED, "folded": {"steps": [{"step": n, "time": 1.0, "step_seconds": 0.5}
                                             for n in range(-MAX_FOLDED_STEPS, 1)]}}),
     "out_of_range", "folded.steps"),  # at most MAX_FOLDED_STEPS
    (encode({**_FOLDED, "folded": {**_FOLDED["folded"], "collectives": {"send": {**_NO_CALLS, "count": 1}}}}),
     "out_of_range", "folded.collectives.send.buckets"),
    (encode({**_FOLDED, "folded": {"steps": [{"step": 1, "time": 1.0, "step_seconds": 0.5, "loss_scale": 1.0}],
                                   "tokens": -1}}),
     "out_of_range", "folded.tokens"),
    (_mutated(step_seconds=math.nan), "not_finite", "step_seconds"),
    (_mutated(time=math.inf), "not_finite", "time"),
    (_mutated(lr=1e999), "not_finite", "lr"),  # too large for a float: infinite
    (_mutated(grad_cosine_similarity=math.nan), "not_finite", "grad_cosine_similarity"),
    (encode(hello(schedule="1f1b interleaved")), "bad_label", "schedule"),
    (encode(hello(faults=["slow_rank,fp16"])), "bad_label", "faults.0"),
    (encode(hello(gpu={"index": 0, "uuid": 'GPU-"0"'})), "bad_label", "gpu.uuid"),
])
def test_rejections_carry_a_stable_reason_and_the_field(datagram, reason, field):
    assert _reason(datagram) == (reason, field)


@pytest.mark.parametrize("job", ['a"b', "a\nb", "a}b", 'x",rank="0', "a\\b", "", "j" * 129, "jöb", "a b", "a{b"])
def test_label_injection_in_job_ids_is_rejected(job):
    assert _reason(encode(step(job=job))) == ("bad_label", "job")
    assert _reason(encode(hello(job=job))) == ("bad_label", "job")


def test_collective_buckets_cover_10us_to_10s_with_le_semantics():
    assert COLLECTIVE_BUCKETS[0] == 1e-5 and COLLECTIVE_BUCKETS[-1] == 10.0
    assert list(COLLECTIVE_BUCKETS) == sorted(set(COLLECTIVE_BUCKETS))
    assert bucket_index(1e-5) == 0  # a value on a bound belongs to that bound's bucket (le)
    assert bucket_index(1.01e-5) == 1
    assert bucket_index(10.0) == len(COLLECTIVE_BUCKETS) - 1
    assert bucket_index(60.0) == len(COLLECTIVE_BUCKETS)  # the overflow (+Inf) bucket


def test_a_full_step_record_fits_a_datagram_with_room_to_spare():
    assert len(encode(step())) < MAX_RECORD_BYTES / 4


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=512))
def test_random_bytes_are_rejected_never_crash(datagram):
    try:
        decode(datagram)
    except RecordRejected as rejected:
        assert rejected.reason in REJECT_REASONS


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from([step(), hello()]), st.data())
def test_mutated_valid_records_are_accepted_or_rejected_never_crash(record, data):
    """Replace one field, at any depth, with arbitrary JSON; what decode accepts the store must take."""
    record = json.loads(json.dumps(record))
    target = record
    while True:
        key = data.draw(st.sampled_from(sorted(target)))
        if isinstance(target[key], dict) and target[key] and data.draw(st.booleans()):
            target = target[key]
            continue
        target[key] = data.draw(_JSON)
        break
    store = TelemetryStore()
    store.ingest(encode(hello()))
    reason = store.ingest(encode(record))
    assert reason is None or reason in REJECT_REASONS


def _verdict(decoder, datagram: bytes) -> tuple:
    """What a decoder made of a datagram: the body as JSON text (1 and 1.0 differ there), or the rejection."""
    try:
        return "accepted", json.dumps(decoder(datagram).body.as_dict(), sort_keys=True)
    except RecordRejected as rejected:
        return "rejected", rejected.reason, rejected.field


def _by_the_checks_alone(datagram: bytes) -> schema.Record:
    return schema._record(schema._checked(datagram))


#: Values at and past the schema's bounds, and the shapes a careless client sends.
_EDGES = st.sampled_from([
    None, True, False, 0, -1, 1, 2**20 - 1, 2**20, 2**53, 2**63 - 1, 2**63, 2**64, -0.0, 0.5, 1.0, 1.001, 1.0011,
    -1.0011, 1e308, 1e999, math.nan, "", "a", "a\n", "a b", "x" * 129, "ab12EF", "0x1", "cuda", "all_reduce", [], [0],
    _NO_CALLS["buckets"], {}, _NO_CALLS,
])


@settings(max_examples=1000, deadline=None)
@given(st.sampled_from([step(), _FOLDED, progress(collective={}), probe(), hello()]), st.data())
def test_msgspec_form_and_the_checks_agree_on_every_record(record, data):
    """decode takes most records through msgspec's form of the fields; whatever it makes of a record, accepted as
    the same body or refused for the same reason and field, must be what the fields' checks alone make of it. A
    field at any depth is given a value at or past a bound, arbitrary JSON or none, or an unknown field is added."""
    record = json.loads(json.dumps(record))
    target = record
    while True:
        key = data.draw(st.sampled_from(sorted(target)))
        value = target[key]
        inner = value[0] if isinstance(value, list) and value else value  # a list of objects: its first
        if isinstance(inner, dict) and inner and data.draw(st.booleans()):
            target = inner
            continue
        change = data.draw(st.sampled_from(["edge", "edge", "edge", "json", "delete", "unknown"]))
        if change == "delete":
            del target[key]
        elif change == "unknown":
            target[key + "_"] = data.draw(_EDGES)
        else:
            target[key] = data.draw(_EDGES if change == "edge" else _JSON)
        break
    datagram = encode(record)
    assert _verdict(decode, datagram) == _verdict(_by_the_checks_alone, datagram)


@pytest.mark.parametrize("record", [step(), step(loss=None), _FOLDED, progress(collective={}), progress(), probe(),
                                    hello()],
                         ids=["step", "step-without-loss", "folded", "progress-in-collective", "progress", "probe",
                              "hello"])
def test_usual_records_take_msgspecs_form(record):
    """The fast form must hold for what clients send (or every record would pay for both): the hello too, whose
    environment a client has already filtered by name (``env_name_allowed``, a pattern msgspec checks)."""
    record = {name: value for name, value in record.items() if value is not None}
    body = schema._TYPED.decode(encode(record))
    assert msgspec.to_builtins(body) == decode(encode(record)).body.as_dict()


def test_records_with_unknown_fields_or_unallowed_variables_are_judged_by_the_checks():
    """msgspec's form refuses what the checks drop instead (an unknown field, a variable off the allowlist): the
    checks then judge the record, and the agent keeps it without them."""
    for record in (hello(env={"NCCL_DEBUG": "INFO", "WANDB_API_KEY": "k"}), step(extension={"a": 1})):
        with pytest.raises(msgspec.ValidationError):
            schema._TYPED.decode(encode(record))
        assert decode(encode(record)).body.as_dict() == _by_the_checks_alone(encode(record)).body.as_dict()


def test_a_null_optional_field_is_absent_in_either_form():
    """msgspec's form reads a null optional field as None, the checks drop it: the same body, without it."""
    datagram = encode(step(loss=None))
    assert schema._TYPED.decode(datagram).loss is None
    assert decode(datagram).body.as_dict() == _by_the_checks_alone(datagram).body.as_dict()
    assert "loss" not in decode(datagram).body.as_dict()


_RECORDER = {"op": "all_reduce", "group": "0", "group_desc": "default_pg", "seq": 4, "p2p": False,
             "state": "scheduled"}


@pytest.mark.parametrize(("change", "reason", "field"), [
    ({"op": "all reduce"}, "bad_label", "flight_recorder.op"),
    ({"group": "g" * (MAX_GROUP_TEXT_CHARS + 1)}, "out_of_range", "flight_recorder.group"),
    ({"group_desc": 3}, "bad_type", "flight_recorder.group_desc"),
    ({"seq": -1}, "out_of_range", "flight_recorder.seq"),
    ({"p2p": 0}, "bad_type", "flight_recorder.p2p"),
    ({"seq": None}, "missing_field", "flight_recorder.seq"),
])
def test_a_progress_record_carries_the_flight_recorders_unfinished_collective(change, reason, field):
    """The second source of a stalled rank (trainer/hooks/flight_recorder.py): the same body in either form, its
    description optional, its fields judged like the rest."""
    datagram = encode(progress(collective={}, flight_recorder=_RECORDER))
    assert decode(datagram).body.as_dict()["flight_recorder"] == _RECORDER
    assert _verdict(decode, datagram) == _verdict(_by_the_checks_alone, datagram)
    assert msgspec.to_builtins(schema._TYPED.decode(datagram)) == decode(datagram).body.as_dict()
    without_desc = {key: value for key, value in _RECORDER.items() if key != "group_desc"}
    assert decode(encode(progress(flight_recorder=without_desc))).body.as_dict()["flight_recorder"] == without_desc
    changed = {key: value for key, value in {**_RECORDER, **change}.items() if value is not None}
    assert _reason(encode(progress(flight_recorder=changed))) == (reason, field)
