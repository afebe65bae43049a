"""The ``probe`` telemetry record: what decode accepts and rejects, and how the agent's store keeps it."""

from __future__ import annotations

import pytest
from telemetry_records import JOB, hello, probe

from gpuwatch.agent.telemetry.store import TelemetryStore, probe_peaks
from gpuwatch.protocol.records import Probe, convert
from gpuwatch.protocol.schema import MAX_PROBE_RESULTS, RecordRejected, decode, encode


def _rejected(record: dict) -> tuple[str, str]:
    with pytest.raises(RecordRejected) as rejected:
        decode(encode(record))
    return rejected.value.reason, rejected.value.field


def _row(**fields) -> dict:
    return {**probe()["results"][0], **fields}


def test_valid_probe_decodes_to_its_known_fields():
    record = decode(encode(probe(future_field=[1, 2])))
    assert (record.kind, record.job, record.rank) == ("probe", JOB, 0)
    assert record.body.interconnect == "infiniband" and record.body.hostnames == ["node-1", "node-2"]
    assert len(record.body.as_dict()["results"]) == 4 and record.body.as_dict()["results"][0]["op"] == "all_reduce"
    assert "future_field" not in record.body.as_dict()
    minimal = {key: value for key, value in probe().items() if key not in ("hostnames", "dtype")}
    assert decode(encode(minimal)).body.as_dict().keys() == minimal.keys()


@pytest.mark.parametrize(("change", "expected"), [
    ({"interconnect": "ethernet"}, ("out_of_range", "interconnect")),
    ({"results": [_row(op="all_to_all")]}, ("out_of_range", "results.0.op")),
    ({"results": [_row(seconds=-1.0)]}, ("out_of_range", "results.0.seconds")),
    ({"results": [_row(busbw_bytes_per_second=float("nan"))]}, ("not_finite", "results.0.busbw_bytes_per_second")),
    ({"results": [_row(bytes=0)]}, ("out_of_range", "results.0.bytes")),
    ({"results": [_row(bytes=1.5)]}, ("bad_type", "results.0.bytes")),
    ({"results": [_row()] * (MAX_PROBE_RESULTS + 1)}, ("out_of_range", "results")),
    ({"results": []}, ("out_of_range", "results")),
    ({"rank": 2}, ("out_of_range", "rank")),
    ({"nodes": 3}, ("out_of_range", "nodes")),
    ({"ranks_per_node": 3}, ("out_of_range", "ranks_per_node")),
    ({"nodes": 1}, ("out_of_range", "hostnames")),
    ({"hostname": "node 1"}, ("bad_label", "hostname")),
    ({"world_size": 0}, ("out_of_range", "world_size")),
])
def test_probe_rejections_name_reason_and_field(change, expected):
    assert _rejected(probe(**change)) == expected


def test_missing_results_is_a_missing_field():
    record = probe()
    del record["results"]
    assert _rejected(record) == ("missing_field", "results")


def test_store_keeps_the_latest_probe_per_job_apart_from_the_ranks():
    store = TelemetryStore(max_jobs=2)
    assert store.ingest(encode(probe(busbw=10e9))) is None
    assert store.ingest(encode(probe(busbw=20e9))) is None
    (latest,) = store.probes()
    assert probe_peaks(latest)["all_reduce"].busbw_bytes_per_second == 20e9
    ranks, records = store.snapshot()
    assert ranks == [] and records["accepted", ""] == 2  # a probe is no rank: no series, no cardinality slot

    store.ingest(encode(hello(0)))
    for job in ("job-b", "job-c"):  # a third job's probe pushes out the least recently received one
        store.ingest(encode(probe(job=job)))
    assert [p.job for p in store.probes()] == ["job-b", "job-c"]
    assert [(s.job, s.rank) for s in store.snapshot()[0]] == [(JOB, 0)]


def test_probe_peaks_pick_each_ops_best_size():
    peaks = probe_peaks(convert(probe(busbw=40e9), Probe))
    assert {op: (row.bytes, row.busbw_bytes_per_second) for op, row in peaks.items()} == {
        "all_reduce": (64 << 20, 40e9), "all_gather": (64 << 20, 36e9)}
