"""The agent side in-process: per-rank store (counters, caps, TTL) and the collector's socket and series."""

import gc
import json
import math
import os
import random
import socket
import stat
import statistics
import subprocess
import sys
import time
import weakref
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from telemetry_records import JOB, closed, collectives, coordinates, hello, plain_step, progress, samples, step

from gpuwatch.agent.collectors.base import CollectorContext, CollectorError
from gpuwatch.agent.collectors.telemetry import TelemetryCollector
from gpuwatch.agent.exposition import Renderer
from gpuwatch.agent.telemetry.exits import ExitWatcher
from gpuwatch.agent.telemetry.series import RankSeries, families
from gpuwatch.agent.telemetry.store import OpTotals, TelemetryStore
from gpuwatch.agent.telemetry.window import (
    BUSY,
    PHASE_TIMINGS,
    TIMING_ORDER,
    TIMINGS,
    WINDOW_SECONDS,
    WINDOW_STEPS,
    StepPoint,
    StepWindow,
    summarize,
)
from gpuwatch.diagnosis.sources import prometheus as prometheus_source
from gpuwatch.protocol.records import CollectiveTotals, FoldedStep, ModelShapeFields, Step, convert
from gpuwatch.protocol.schema import COLLECTIVE_BUCKETS, MAX_FOLDED_STEPS, encode
from gpuwatch.trainer.telemetry import TelemetryClient, fold_steps

from conftest import require_tool, wait_until


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _feed(store: TelemetryStore, *records: dict) -> list[str | None]:
    return [store.ingest(encode(record)) for record in records]


def test_store_accumulates_step_increments_and_keeps_the_latest_values():
    store = TelemetryStore()
    assert _feed(store, hello(0), step(0, 1), step(0, 2, tokens=1000, grad_cosine_similarity=None),
                 step(0, 3, loss=float("nan"), collectives=collectives({"all_reduce": [20.0]}))) == [None] * 4
    (state,), records = store.snapshot()
    assert state.counters() == {"steps": 3, "nonfinite_steps": 1, "tokens": 4096 + 1000 + 4096, "samples": 0,
                                "alloc_retries": 3, "ooms": 0}
    all_reduce = state.collectives["all_reduce"]
    assert (all_reduce.calls, all_reduce.bytes) == (5, 5 << 20)
    assert all_reduce.as_dict() == {"count": 5, "bytes": 5 << 20, "seconds": all_reduce.seconds,
                                    "buckets": all_reduce.buckets}  # the step record's names, as the state serves
    assert all_reduce.buckets[-1] == 1  # the 20 s call landed in the overflow bucket
    assert state.collectives["send"].calls == 2
    assert state.last_step.step == 3
    assert state.sampled["grad_cosine_similarity"] == (3, 0.9)
    assert records["accepted", ""] == 4


def _plain_steps(count: int, seed: int) -> list[dict]:
    """Plain steps (nothing sampled, every value finite: what a client folds) of varied timings and counts."""
    chance = random.Random(seed)
    records = []
    for number in range(1, count + 1):
        calls = {op: [chance.expovariate(1000) for _ in range(chance.randrange(4))]
                 for op in ("all_reduce", "all_gather", "send")}
        record = plain_step(0, number, time=1000.0 + number, step_seconds=chance.uniform(0.1, 2),
                            compute_seconds=chance.uniform(0.05, 1), loss=chance.uniform(1, 3),
                            grad_norm=chance.uniform(0, 5), tokens=chance.randrange(10_000),
                            samples=chance.randrange(64), collectives=collectives(calls))
        if chance.random() < 0.3:
            del record["pipeline"]
        records.append(record)
    return records


@pytest.mark.parametrize("seed", range(5))
def test_steps_folded_into_one_record_leave_the_store_as_those_steps_one_by_one(seed):
    steps = _plain_steps(1 + MAX_FOLDED_STEPS, seed)
    one_by_one, folded = TelemetryStore(), TelemetryStore()
    _feed(one_by_one, hello(0), *steps)
    assert _feed(folded, hello(0), fold_steps(steps[-1], steps[:-1])) == [None, None]
    (alone,), _ = one_by_one.snapshot()
    (together,), _ = folded.snapshot()
    assert together.counters() == alone.counters()
    assert together.counters()["steps"] == len(steps)
    for op, totals in alone.collectives.items():
        assert together.collectives[op].calls == totals.calls
        assert together.collectives[op].bytes == totals.bytes
        assert together.collectives[op].buckets == totals.buckets
        assert together.collectives[op].seconds == pytest.approx(totals.seconds)
    assert together.window.points() == alone.window.points()
    assert together.last_step == alone.last_step  # the step's own fields: ``folded`` is not kept


def test_a_snapshot_hands_out_the_same_copy_of_a_rank_until_the_rank_changes():
    store = TelemetryStore()
    _feed(store, hello(0), hello(1), step(0, 1), step(1, 1))
    first, _ = store.snapshot()
    _feed(store, step(1, 2))
    store.note_exits(lambda pid: True)  # nobody exited: no change
    second, _ = store.snapshot()
    assert second[0] is first[0]
    assert second[1] is not first[1]
    assert (first[1].last_step.step, second[1].last_step.step) == (1, 2)  # the copy handed out stays as it was
    _feed(store, progress(0))
    third, _ = store.snapshot()
    assert third[0] is not second[0] and third[0].progress is not None and second[0].progress is None


def test_a_rank_forgotten_and_back_is_not_served_its_old_copy():
    clock = FakeClock()
    store = TelemetryStore(ttl=60, clock=clock)
    _feed(store, hello(0), step(0, 1))
    (before,), _ = store.snapshot()
    clock.now += 61
    assert store.expire()
    _feed(store, hello(0), step(0, 7))  # as many records as before: the same version number, a new state
    (after,), _ = store.snapshot()
    assert after.version == before.version and after.last_step.step == 7


def test_store_keeps_a_bounded_window_of_recent_steps_by_count_by_the_ranks_clock_and_per_run():
    store = TelemetryStore()
    _feed(store, *(step(0, n, time=1000.0 + n, compute_seconds=0.1 * n) for n in range(1, WINDOW_STEPS + 11)))
    (state,), _ = store.snapshot()
    points = state.window.points()
    assert [p.step for p in points] == list(range(11, WINDOW_STEPS + 11))  # the latest WINDOW_STEPS
    _feed(store, step(0, WINDOW_STEPS + 11, time=1000.0 + WINDOW_STEPS + 10 + WINDOW_SECONDS))
    (state,), _ = store.snapshot()
    assert [p.step for p in state.window.points()] == [WINDOW_STEPS + 10, WINDOW_STEPS + 11]  # older than 300 s
    _feed(store, step(0, 1, time=5000.0))  # a restarted rank counts from 1 again: a new window
    (state,), _ = store.snapshot()
    assert [p.step for p in state.window.points()] == [1]


def test_window_summary_is_robust_to_outliers_and_counts_what_it_judged():
    window = StepWindow()
    for n, (compute, loss) in enumerate([(0.1, 2.0), (0.1, 1.9), (5.0, 1.8), (0.1, float("nan")), (0.1, 1.7)], 1):
        window.add(convert(step(0, n, time=100.0 + n, compute_seconds=compute, loss=loss,
                                param_checksum=1.0 if n < 5 else 2.0), Step))
    summary = summarize(window.points())
    assert summary.median("compute_seconds") == 0.1  # one 5 s step does not move the median
    assert (summary.steps, summary.first_step, summary.last_step, summary.seconds) == (5, 1, 5, 4.0)
    assert (summary.loss_steps, summary.loss_min, summary.loss_max) == (4, 1.7, 2.0)  # NaN left out
    assert (summary.checksums, summary.distinct_checksums) == (5, 2)
    assert summary.describe() == "5 steps (1-5, 4 s)"
    assert summarize(()) is None


_REPORTED = st.none() | st.floats(-1e3, 1e3)  # a timing: reported or not
_LOSS = st.none() | st.floats(allow_nan=True, allow_infinity=True)  # any float: NaN, infinities, sums that overflow


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.lists(_REPORTED, min_size=len(TIMING_ORDER), max_size=len(TIMING_ORDER)), _LOSS, _LOSS),
                min_size=1, max_size=70))
def test_window_summary_takes_every_median_and_finite_range_by_their_definition(rows):
    """The summary's shortcuts (sorting a column whole, summing it to test it finite) against the definitions: the
    median of the steps that reported a timing, and the finite losses and gradient norms only."""
    points = [StepPoint(n, float(n), *timings, loss, norm) for n, (timings, loss, norm) in enumerate(rows)]
    summary = summarize(points)
    for name in TIMING_ORDER:
        reported = [getattr(point, name) for point in points if getattr(point, name) is not None]
        assert summary.median(name) == (statistics.median(reported) if reported else None)
    # busy: each step's phases that it reported, summed in their order, less its wait for a CPU where it reported that
    # and its time on one, never below that time; the steps that reported no phase left out
    busy = [max(sum(phases) - point.cpu_wait_seconds, min(sum(phases), point.cpu_seconds))
            if point.cpu_wait_seconds is not None and point.cpu_seconds is not None else sum(phases)
            for point in points
            if (phases := [getattr(point, name) for name in PHASE_TIMINGS if getattr(point, name) is not None])]
    assert summary.median(BUSY) == (statistics.median(busy) if busy else None)
    losses = [point.loss for point in points if point.loss is not None and math.isfinite(point.loss)]
    norms = [point.grad_norm for point in points if point.grad_norm is not None and math.isfinite(point.grad_norm)]
    assert (summary.loss_steps, summary.loss_min, summary.loss_max) == (len(losses), min(losses, default=None),
                                                                        max(losses, default=None))
    assert (summary.grad_norm_steps, summary.grad_norm_max) == (len(norms), max(norms, default=None))


_CALLS = st.lists(st.integers(0, 3) | st.integers(0, 2**40), min_size=len(COLLECTIVE_BUCKETS) + 1,
                  max_size=len(COLLECTIVE_BUCKETS) + 1)  # mostly empty buckets, as an op's calls leave them


@settings(max_examples=200, deadline=None)
@given(st.lists(_CALLS, min_size=1, max_size=6))
def test_op_totals_add_up_every_bucket_of_every_step(steps):
    totals = OpTotals()
    for buckets in steps:
        totals = totals.plus(CollectiveTotals(count=sum(buckets), bytes=8 * sum(buckets), seconds=0.5, buckets=buckets))
    assert totals.buckets == tuple(map(sum, zip(*steps, strict=True)))
    assert (totals.calls, totals.bytes, totals.seconds) == (sum(map(sum, steps)), 8 * sum(map(sum, steps)),
                                                           0.5 * len(steps))
    assert type(totals) is OpTotals and totals.as_dict()["count"] == totals.calls


def test_a_step_point_reads_every_timing_at_its_path():
    body: dict = {"v": 1, "job": JOB, "rank": 0, "step": 7, "time": 1.5, "loss": 2.0, "grad_norm": 3.0,
                  "param_checksum": "ab", "pipeline": {"busy_seconds": 1.0, "idle_seconds": 0.0}}
    for number, path in enumerate(TIMINGS.values(), 1):
        *objects, field = path
        node = body
        for key in objects:
            node = node.setdefault(key, {})
        node[field] = number / 10
    point = StepPoint.of(convert(body, Step))
    assert StepPoint._fields[2:2 + len(TIMING_ORDER)] == TIMING_ORDER  # each timing in the field of its name
    assert {name: getattr(point, name) for name in TIMINGS} == {
        name: number / 10 for number, name in enumerate(TIMINGS, 1)}
    assert (point.step, point.time, point.loss, point.grad_norm, point.param_checksum) == (7, 1.5, 2.0, 3.0, "ab")
    assert StepPoint.from_dict(point.as_dict()) == point
    bare = StepPoint.of(FoldedStep(step=8, time=2.0, step_seconds=0.5))  # no optional timings, no pipeline
    assert [getattr(bare, name) for name in TIMINGS] == [0.5] + [None] * (len(TIMINGS) - 1) and bare.loss is None


def test_unavailable_signals_are_kept_until_measured_again_and_exported_with_their_reason():
    store, per_rank = TelemetryStore(), RankSeries()
    no_cosine = {"grad_cosine_similarity": None}
    _feed(store, hello(0), step(0, 10, **no_cosine, unavailable={"grad_cosine_similarity": "zero_gradient"}))
    text = _rendered(store, per_rank).decode()
    assert samples(text, "gpuwatch_train_signal_unavailable") == {
        coordinates(0, signal="grad_cosine_similarity", reason="zero_gradient"): 10}
    _feed(store, step(0, 20, grad_cosine_similarity=0.5))  # measured again: the reason no longer stands
    assert samples(_rendered(store, per_rank).decode(), "gpuwatch_train_signal_unavailable") == {}


def test_window_figures_are_exported_per_rank():
    store, per_rank = TelemetryStore(), RankSeries()
    _feed(store, hello(0, backends={"default": "gloo"}, time=90.0),
          *(step(0, n, time=100.0 + n, compute_seconds=0.2, outside_model_seconds=0.1 * n,
                 exposed_collective_seconds=0.05, samples=32) for n in range(1, 6)))
    text = _rendered(store, per_rank).decode()
    medians = samples(text, "gpuwatch_train_window_median_seconds")
    assert medians[coordinates(0, timing="compute_seconds")] == 0.2
    assert medians[coordinates(0, timing="exposed_collective_seconds")] == 0.05
    assert medians[coordinates(0, timing="outside_model_seconds")] == pytest.approx(0.3)
    # the steps' phases summed (data 0.01, compute 0.2, optimizer 0.02, outside the model 0.1 n), their median
    assert medians[coordinates(0, timing="busy_seconds")] == pytest.approx(0.53)
    assert samples(text, "gpuwatch_train_outside_model_seconds") == {coordinates(0): pytest.approx(0.5)}
    assert samples(text, "gpuwatch_train_hello_timestamp_seconds") == {coordinates(0): 90.0}
    assert samples(text, "gpuwatch_train_window_steps") == {coordinates(0): 5}
    assert samples(text, "gpuwatch_train_window_bubble_ratio") == {coordinates(0): 0.2}
    assert samples(text, "gpuwatch_train_window_param_checksums_distinct") == {coordinates(0): 5}
    assert samples(text, "gpuwatch_train_samples_total") == {coordinates(0): 160}
    (info,) = samples(text, "gpuwatch_train_rank_info")
    assert ("backend", "gloo") in info


def test_what_a_rank_trains_is_exported_and_read_back_by_prometheus_as_the_hello_said_it():
    """The hello's model block and batch become gpuwatch_train_model_info's labels, which the Prometheus source turns
    back into the same record struct: the PLAN rules predict from Prometheus what they predict from an agent."""
    model = {"layers": 12, "hidden": 768, "heads": 12, "kv_heads": 4, "ffn": 3072, "vocab": 50257,
             "tied_embeddings": True, "gated": False, "positions": 0, "source": "hf"}
    store, per_rank = TelemetryStore(), RankSeries()
    _feed(store, hello(0, model=model, global_batch=64, seq_len=2048), hello(1), step(0, 1), step(1, 1))
    text = _rendered(store, per_rank).decode()
    (labels,) = samples(text, "gpuwatch_train_model_info")  # rank 1 said nothing of its model: no series
    labels = dict(labels)
    assert (labels["rank"], labels["kv_heads"], labels["tied_embeddings"], labels["bias"], labels["seq_len"]) == \
        ("0", "4", "true", "", "2048")
    workload = prometheus_source._workload(labels)
    assert workload is not None and (workload.global_batch, workload.seq_len) == (64, 2048)
    assert workload.model == convert(model, ModelShapeFields)
    assert prometheus_source._workload({**labels, "layers": "twelve"}) is None  # not a model: no workload


def test_nonfinite_flag_or_values_count_a_nonfinite_step():
    store = TelemetryStore()
    _feed(store, step(nonfinite=True), step(grad_norm=float("inf")), step())
    (state,), _ = store.snapshot()
    assert state.nonfinite_steps == 2


def test_client_drop_counters_become_increments_across_a_rank_restart():
    store = TelemetryStore()
    _feed(store,
          step(number=1, client={"sent": 5, "dropped": {"no_agent": 3}}),
          step(number=2, client={"sent": 9, "dropped": {"no_agent": 4, "busy": 2}}),
          step(number=1, client={"sent": 1, "dropped": {"no_agent": 1}}))  # the rank's process restarted
    _, records = store.snapshot()
    assert records["dropped", "no_agent"] == 3 + 1 + 1
    assert records["dropped", "busy"] == 2


def test_caps_reject_new_jobs_and_ranks_but_keep_serving_known_ones():
    store = TelemetryStore(max_ranks=4, max_jobs=2)
    assert _feed(store, hello(0, job="a"), hello(1, job="a"), hello(0, job="b")) == [None] * 3
    assert _feed(store, hello(0, job="c")) == ["cardinality"]  # a third job
    assert _feed(store, hello(2, job="a"), hello(3, job="a")) == [None, "cardinality"]  # a fifth rank
    assert _feed(store, step(1, job="a"), step(0, job="b")) == [None, None]
    ranks, records = store.snapshot()
    assert [(s.job, s.rank) for s in ranks] == [("a", 0), ("a", 1), ("a", 2), ("b", 0)]
    assert records["rejected", "cardinality"] == 2


def test_a_new_job_at_the_cap_takes_the_place_of_the_job_that_ended_longest_ago_never_of_one_that_died():
    """A node that runs many short jobs: jobs that ended normally (hooks closed, process gone) make room; a job
    whose rank died without closing its hooks stays for the hang diagnosis, and so does a live one."""
    clock = FakeClock()
    store = TelemetryStore(max_jobs=2, clock=clock)

    def ran(job: str, pid: int, phase: str) -> None:
        """A job of one rank (process `pid`) whose last progress record says `phase`, then its process exits."""
        for record in (hello(0, job=job), progress(0, job=job, phase=phase, stalled=0.0)):
            assert store.ingest(encode(record), sender_pid=pid) is None
        store.mark_exited(pid, 2000.0)
        clock.now += 1

    def jobs() -> list[str]:
        return sorted({state.job for state in store.snapshot()[0]})

    ran("first", 11, "closed")
    ran("second", 12, "closed")
    assert _feed(store, hello(0, job="third")) == [None]  # "first" ended longest ago: forgotten
    assert jobs() == ["second", "third"]
    assert _feed(store, hello(0, job="fourth")) == [None]  # then "second"
    assert jobs() == ["fourth", "third"]
    assert _feed(store, hello(0, job="fifth")) == ["cardinality"]  # both live: nothing ended to make room

    store = TelemetryStore(max_jobs=1, clock=clock)
    ran("crashed", 13, "collective")  # gone without closing its hooks: a death
    assert _feed(store, hello(0, job="next")) == ["cardinality"]
    assert jobs() == ["crashed"]


def test_a_step_record_queued_behind_an_error_record_does_not_erase_it_and_a_restart_starts_afresh():
    """The hooks send a step's error at once while the step before it may still wait on the sender thread: the late
    step record is older news than the error (its step is not beyond the progress record's). The next step, or a
    hello from a restarted process, is news."""
    store = TelemetryStore()
    error = {"type": "InjectedFailure", "message": "rank 3 fails"}
    assert _feed(store, hello(0), progress(0, stalled=0.0, error=error), step(0, 3)) == [None] * 3
    (state,), _ = store.snapshot()
    assert state.progress is not None and state.progress.as_dict()["error"] == error and state.last_step.step == 3
    _feed(store, step(0, 4))  # caught by the script, and training went on
    assert store.snapshot()[0][0].progress is None

    _feed(store, progress(0, stalled=0.0, error=error))
    store.ingest(encode(step(0, 4)), sender_pid=41)
    store.mark_exited(41, 2000.0)
    _feed(store, hello(0))  # the rank's process restarted
    (state,), _ = store.snapshot()
    assert (state.progress, state.exited_time) == (None, None)


def test_received_datagrams_are_applied_in_order_by_the_next_reader_or_by_the_receiver_past_the_byte_bound(
        monkeypatch):
    """The receiver only queues; whoever reads the store next applies what was queued before reading, so an exit mark
    lands after the records its process sent (a hello queued before a death does not clear the death). Past the byte
    bound the receiver applies the oldest itself, a few at a time, so it is back at the socket soon."""
    store = TelemetryStore()
    store.receive(encode(hello(0)), 41)
    store.receive(encode(step(0, 1)), 41)
    store.receive(b"not json", 41)
    assert store._pending  # nothing applied yet
    store.mark_exited(41, 2000.0)
    (state,), records = store.snapshot()
    assert (state.last_step.step, state.exited_time, state.sender_pid) == (1, 2000.0, 41)
    assert (records["accepted", ""], records["rejected", "not_json"]) == (2, 1)

    datagrams = [encode(step(0, number)) for number in range(2, 8)]  # lengths vary with the clock's digits
    monkeypatch.setattr("gpuwatch.agent.telemetry.store.MAX_PENDING_BYTES", sum(map(len, datagrams[:3])))
    monkeypatch.setattr("gpuwatch.agent.telemetry.store.RECEIVER_APPLY_BYTES", len(datagrams[0]) + len(datagrams[1]))
    for datagram in datagrams[:3]:
        store.receive(datagram, 41)
    assert len(store._pending) == 3  # at the bound, not past it
    store.receive(datagrams[3], 41)
    assert [datagram for datagram, _ in store._pending] == datagrams[2:4]  # the receiver applied the oldest two
    monkeypatch.setattr("gpuwatch.agent.telemetry.store.MAX_PENDING_BYTES", 0)
    monkeypatch.setattr("gpuwatch.agent.telemetry.store.RECEIVER_APPLY_BYTES", 1)
    store.receive(datagrams[4], 41)
    store.receive(datagrams[5], 41)
    assert [datagram for datagram, _ in store._pending] == datagrams[4:6]  # at least one a time, the oldest first
    (state,), _ = store.snapshot()
    assert (state.steps, state.last_step.step, store._pending) == (7, 7, [])


def test_silent_ranks_expire_after_the_ttl_and_free_their_slot():
    clock = FakeClock()
    store = TelemetryStore(ttl=60, max_ranks=2, clock=clock)
    _feed(store, hello(0), hello(1))
    clock.now += 50
    _feed(store, step(1))
    clock.now += 20
    assert [(s.job, s.rank) for s in store.expire()] == [(JOB, 0)]
    assert [s.rank for s in store.snapshot()[0]] == [1]
    assert _feed(store, hello(2)) == [None]


def test_a_closed_rank_whose_process_runs_outlives_the_ttl_until_it_exits():
    """Closed ranks send nothing more: one whose watched process has not exited stays past the TTL (HANG007 judges
    it), and goes once the process exits; without a known pid (another pid namespace) the TTL applies as ever."""
    clock = FakeClock()
    store = TelemetryStore(ttl=60, clock=clock)
    for rank, pid in ((0, 21), (1, None)):
        for record in (hello(rank), closed(rank)):
            assert store.ingest(encode(record), sender_pid=pid) is None
    clock.now += 61
    assert [s.rank for s in store.expire()] == [1]
    clock.now += 600
    assert store.expire() == [] and [s.rank for s in store.snapshot()[0]] == [0]
    store.mark_exited(21, 2000.0)
    assert [s.rank for s in store.expire()] == [0]


def test_rejections_are_counted_by_reason():
    store = TelemetryStore()
    assert _feed(store, step(job='evil"}'), step(step_seconds=-1)) == ["bad_label", "out_of_range"]
    assert store.ingest(b"\x00garbage") == "not_json"
    _, records = store.snapshot()
    assert (records["rejected", "bad_label"], records["rejected", "not_json"], records["accepted", ""]) == (1, 1, 0)


@pytest.fixture
def socket_path(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("collector") / "run" / "telemetry.sock"


@pytest.fixture
def open_collector():
    collectors: list[TelemetryCollector] = []

    def start(path: Path, **context) -> TelemetryCollector:
        collector = TelemetryCollector(CollectorContext(telemetry_socket=path, **context))
        collectors.append(collector)
        return collector

    yield start
    for collector in collectors:
        collector.close()


@pytest.mark.integration
def test_collector_serves_every_rank_with_its_coordinates_and_passes_promtool(socket_path, open_collector):
    collector = open_collector(socket_path)
    client = TelemetryClient(socket_path, heartbeat_interval=0)
    for rank in range(8):
        client.send(hello(rank, process_groups={"dp": [rank % 4, rank % 4 + 4], "tp": list(range(8))}))
        client.send(step(rank, 1, compute_seconds=0.1 * (rank + 1), collective_calls={"dp": 3, "tp": 40 + rank}))
    client.send(step(7, 2, memory={"kind": "host_rss", "peak_bytes": 123}, param_checksum="00ff"))
    wait_until(lambda: collector.store.snapshot()[1]["accepted", ""] == 17, timeout=5, what="records")
    result = collector.collect()
    text = Renderer().render(result.families).decode()

    assert samples(text, "gpuwatch_train_compute_seconds")[coordinates(6)] == pytest.approx(0.7)
    assert len(samples(text, "gpuwatch_train_step_seconds")) == 8
    buckets = samples(text, "gpuwatch_train_collective_seconds_bucket")
    assert buckets[coordinates(6, op="all_reduce", le="0.001")] == 0
    assert buckets[coordinates(6, op="all_reduce", le="0.002")] == 1  # 1.5 ms
    assert buckets[coordinates(6, op="all_reduce", le="+Inf")] == 2
    assert samples(text, "gpuwatch_train_collective_seconds_count")[coordinates(6, op="all_reduce")] == 2
    assert samples(text, "gpuwatch_train_collective_seconds_sum")[coordinates(6, op="all_reduce")] == \
        pytest.approx(0.0045)
    assert samples(text, "gpuwatch_train_collective_bytes_total")[coordinates(6, op="send")] == 1 << 20
    assert samples(text, "gpuwatch_gpu_job_info") == {
        frozenset({"gpu": str(r % 4), "job": JOB, "rank": str(r),
                   "uuid": f"GPU-0000000{r}-1111-2222-3333-444444444444"}.items()): 1
        for r in range(8)}
    info = samples(text, "gpuwatch_train_rank_info")
    assert info[coordinates(0, faults="slow_rank", schedule="1f1b", micro_batches="4", virtual_stages="",
                            precision="bf16", world_size="8", tp_size="2", pp_size="2", dp_size="2",
                            torch_version="2.13.0+cpu", nccl_version="2.21.5", backend="",
                            unavailable_from_outside="")] == 1
    # the hello's groups as runs of ranks, and the latest step's count of calls on each
    assert {labels for labels in samples(text, "gpuwatch_train_process_group_info") if ("rank", "5") in labels} == {
        coordinates(5, group="dp", members="1,5"), coordinates(5, group="tp", members="0-7")}
    calls = samples(text, "gpuwatch_train_collective_calls")
    assert (calls[coordinates(5, group="tp")], calls[coordinates(5, group="dp")]) == (45, 3)
    assert coordinates(7, group="tp") not in calls  # its latest step (2) counted none
    assert samples(text, "gpuwatch_telemetry_records_total")[frozenset({"result": "accepted", "reason": ""}.items())] \
        == 17
    # Rank 7's latest step is a CPU step: host RSS only, no allocator series; a hex checksum stays in /api/v1/state.
    assert samples(text, "gpuwatch_train_memory_peak_bytes")[coordinates(7, kind="host_rss")] == 123
    assert len(samples(text, "gpuwatch_train_memory_reserved_bytes")) == 7
    assert coordinates(7) not in samples(text, "gpuwatch_train_param_checksum")
    assert samples(text, "gpuwatch_train_param_checksum")[coordinates(6)] == 1234.5
    assert samples(text, "gpuwatch_train_steps_total")[coordinates(7)] == 2

    readings = result.readings
    assert readings["socket"] == str(socket_path)
    assert [(r["rank"], r["hello"].pid) for r in readings["ranks"]] == [(r, 4000 + r) for r in range(8)]
    # The hellos claim pids 4000+; the kernel says who really sent them (here: this test process).
    assert readings["processes"][3] == {"pid": os.getpid(), "job": JOB, "rank": 3}
    assert {r["sender_pid"] for r in readings["ranks"]} == {os.getpid()}
    assert readings["ranks"][7]["sampled"]["param_checksum"] == {"step": 2, "value": "00ff"}
    assert readings["records"]["accepted"] == 17
    check = subprocess.run([require_tool("promtool"), "check", "metrics"], input=text, capture_output=True,
                           text=True)
    assert check.returncode == 0 and not check.stdout.strip() and not check.stderr.strip(), check


def test_ranks_without_hello_are_tracked_but_not_exported(socket_path, open_collector):
    collector = open_collector(socket_path)
    collector.store.ingest(encode(step(3)))
    text = Renderer().render(collector.collect().families).decode()
    assert "gpuwatch_train_step_seconds{" not in text
    assert 'gpuwatch_telemetry_ranks{job="job-42"} 1.0' in text


def test_socket_is_private_and_removed_on_close(socket_path, open_collector):
    collector = open_collector(socket_path)
    assert stat.S_ISSOCK(os.lstat(socket_path).st_mode)
    assert stat.S_IMODE(os.lstat(socket_path).st_mode) == 0o660
    assert stat.S_IMODE(os.lstat(socket_path.parent).st_mode) == 0o750
    receiver = collector._receiver._thread
    collector.close()
    assert not socket_path.exists() and not receiver.is_alive()


def test_stale_socket_of_a_killed_agent_is_replaced(socket_path, open_collector):
    socket_path.parent.mkdir(mode=0o750)
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    stale.bind(str(socket_path))
    stale.close()  # the file stays, nobody listens: what SIGKILL leaves behind
    collector = open_collector(socket_path)
    collector.collect()
    client = TelemetryClient(socket_path, heartbeat_interval=0)
    client.send(hello())
    assert client.sent == 1


def test_a_second_agent_on_a_live_socket_is_refused_and_does_not_steal_it(socket_path, open_collector):
    first = open_collector(socket_path)
    second = open_collector(socket_path)
    with pytest.raises(CollectorError, match="already listening"):
        second.collect()
    second.close()
    TelemetryClient(socket_path, heartbeat_interval=0).send(hello())
    wait_until(lambda: first.store.snapshot()[0], timeout=5, what="the first agent still receiving")


@pytest.mark.parametrize("occupant", ["symlink", "file", "directory"])
def test_foreign_things_at_the_path_are_left_alone_and_reported(socket_path, open_collector, occupant):
    socket_path.parent.mkdir(mode=0o750)
    target = socket_path.parent / "elsewhere"
    target.write_text("precious")
    if occupant == "symlink":
        socket_path.symlink_to(target)
    elif occupant == "file":
        socket_path.write_text("precious")
    else:
        socket_path.mkdir()
    collector = open_collector(socket_path)
    with pytest.raises(CollectorError, match=r"symlink|not a socket"):
        collector.collect()
    assert target.read_text() == "precious"
    assert os.path.lexists(socket_path) and not stat.S_ISSOCK(os.lstat(socket_path).st_mode)
    # Once the operator clears the path, the next sampling round binds the socket.
    if occupant == "directory":
        socket_path.rmdir()
    else:
        socket_path.unlink()
    collector.collect()
    assert stat.S_ISSOCK(os.lstat(socket_path).st_mode)


def test_directories_others_control_are_refused(socket_path, open_collector):
    socket_path.parent.mkdir(mode=0o777)
    os.chmod(socket_path.parent, 0o777)
    with pytest.raises(CollectorError, match="writable by group or others"):
        open_collector(socket_path).collect()
    os.chmod(socket_path.parent, 0o750)
    os.chown(socket_path.parent, 4242, -1)
    with pytest.raises(CollectorError, match="belongs to uid 4242"):
        open_collector(socket_path).collect()
    too_long = socket_path.parent.parent / ("x" * 120) / "telemetry.sock"
    with pytest.raises(CollectorError, match="longer than"):
        open_collector(too_long).collect()


def test_close_leaves_a_successors_socket_alone(socket_path, open_collector):
    collector = open_collector(socket_path)
    socket_path.unlink()  # an operator removed it and another agent took the path
    successor = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    successor.bind(str(socket_path))
    collector.close()
    assert socket_path.exists()
    successor.close()


def test_collect_expires_silent_ranks_so_their_series_disappear(socket_path, open_collector):
    collector = open_collector(socket_path, telemetry_ttl=0.2)
    collector.store.ingest(encode(hello()))
    collector.store.ingest(encode(step()))
    assert "gpuwatch_train_loss{" in Renderer().render(collector.collect().families).decode()
    time.sleep(0.3)
    result = collector.collect()
    text = Renderer().render(result.families).decode()
    assert "gpuwatch_train_" + "loss{" not in text and "gpuwatch_telemetry_ranks{" not in text
    assert result.readings["ranks"] == []


def _rendered(store: TelemetryStore, per_rank: RankSeries) -> bytes:
    ranks, records = store.snapshot()
    return Renderer().render(families(ranks, records, per_rank))


def test_rank_lines_are_what_prometheus_client_writes_and_follow_every_change():
    """Parsed by prometheus-client and written back by its generate_latest, the page comes out byte for byte:
    the per-rank lines are exposition as the library writes it (sorted, escaped labels; Go float format)."""
    store, per_rank = TelemetryStore(), RankSeries()
    env = {"NCCL_IB_DISABLE": "1", "NCCL_SOCKET_IFNAME": 'ib0,"odd"\\name', "NCCL_DEBUG": "INFO"}
    many = collectives({"all_gather": [0.001, 0.2]})["all_gather"]  # an op past a million calls: Go's exponents
    many.update(count=2_345_678, buckets=[count * 1_172_839 for count in many["buckets"]])
    _feed(store, hello(0, env=env), step(0, 1, collectives=collectives({"all_reduce": [0.002, 30.0]})),
          hello(1), step(1, 1, loss=float("nan"), tokens=3_000_000, collectives={"all_gather": many}), hello(2))
    first = _rendered(store, per_rank)
    counts = samples(first.decode(), "gpuwatch_train_collective_seconds_count")
    assert counts[coordinates(1, op="all_gather")] == 2_345_678 and b"} 2.345678e+06\n" in first
    registry = CollectorRegistry()
    registry.register(_Static(list(text_string_to_metric_families(first.decode()))))
    assert generate_latest(registry) == first
    assert 'name="NCCL_SOCKET_IFNAME",' in first.decode() and "NCCL_DEBUG" not in first.decode()

    _feed(store, step(1, 2, loss=1.5))  # only rank 1 moves: its lines change, the others are reused as they were
    second = _rendered(store, per_rank).decode()
    assert samples(second, "gpuwatch_train_loss") == {coordinates(1): 1.5, coordinates(0): 2.5}
    assert samples(second, "gpuwatch_train_steps_total") == {coordinates(0): 1, coordinates(1): 2, coordinates(2): 0}


class _Static:
    def __init__(self, families):
        self.families = families

    def collect(self):
        return self.families


def test_every_per_rank_family_is_named_in_the_agent_docs():
    """docs/agent.md lists every gpuwatch_train_* family a user can query; a new family without a line there fails."""
    docs = (Path(__file__).parent.parent / "docs" / "agent.md").read_text()
    store = TelemetryStore()
    _feed(store, hello(0), step(0, 1))
    ranks, records = store.snapshot()
    names = {family.name for family in families(ranks, records)}
    missing = sorted(name for name in names if f"`{name}" not in docs)
    assert not missing, f"not in docs/agent.md: {missing}"


def test_a_rank_whose_process_exited_is_no_longer_named_to_the_host_collector():
    """Its pid may be the next process's: the host must not export another process's memory as the rank's."""
    store = TelemetryStore()
    store.ingest(encode(hello(0)), sender_pid=41)
    store.ingest(encode(hello(1)), sender_pid=42)
    assert store.sender_pids() == {41: (JOB, 0), 42: (JOB, 1)}
    store.mark_exited(41, 2000.0)
    assert store.sender_pids() == {42: (JOB, 1)}


def _ranks(result) -> list[int]:
    return [rank["rank"] for rank in result.readings["ranks"]]


def test_a_round_serves_the_latest_result_until_it_is_read_and_after_while_nothing_reached_the_store(
        socket_path, open_collector):
    collector = open_collector(socket_path)
    first = collector.collect()
    collector.store.ingest(encode(hello(0)))
    assert collector.collect() is first  # nobody used it yet: its first use reads the store as it is then
    assert _ranks(first) == [0]
    assert collector.collect() is first  # read, and nothing came since: no copy, no readings built again
    collector.store.ingest(encode(hello(1)))
    second = collector.collect()
    assert second is not first and _ranks(second) == [0, 1]
    assert _ranks(first) == [0]  # a round once read stays as it was read
    assert collector.collect() is second
    collector.store.ingest(b"garbage")  # a rejection is news too: its count moved
    assert collector.collect().readings["records"]["rejected"]["not_json"] == 1


def test_the_rounds_nobody_uses_leave_the_queue_to_the_one_that_is_rendered(socket_path, open_collector,
                                                                             monkeypatch):
    """At 5 s sampling and a 15 s scrape interval, two rounds in three are never rendered: their datagrams are
    applied by the third's read, in one batch, and the store is copied once."""
    collector = open_collector(socket_path)
    store = collector.store
    copies = []
    snapshot = store.snapshot
    monkeypatch.setattr(store, "snapshot", lambda: copies.append(1) or snapshot())
    rounds = []
    for number in range(1, 4):
        if number == 1:
            store.receive(encode(hello(0)))
        store.receive(encode(step(0, number)))
        rounds.append(collector.collect())
        assert store.has_queued() and store.changes == 0  # nothing applied, nothing copied
    text = Renderer().render(rounds[-1].families).decode()
    assert samples(text, "gpuwatch_train_steps_total") == {coordinates(0): 3}
    assert not store.has_queued() and copies == [1]
    assert rounds[-1].readings["ranks"][0]["counters"]["steps"] == 3 and copies == [1]  # the same read


def test_a_round_nobody_holds_is_freed_at_once_without_the_cyclic_collector(socket_path, open_collector):
    """The agent runs the cyclic collector rarely (``Sampler.run``): a round's copy of 64 ranks caught in a reference
    cycle stayed in memory until it ran, +6.5 MB of RSS."""
    collector = open_collector(socket_path)
    gc.disable()
    try:
        collector.store.ingest(encode(hello(0)))
        first = collector.collect()
        assert _ranks(first) == [0]
        collector.store.ingest(encode(step(0, 1)))
        assert collector.collect() is not first
        freed = weakref.ref(first)
        del first
        assert freed() is None
    finally:
        gc.enable()


def test_a_rank_that_exits_before_the_store_is_read_is_timed_from_its_first_record(socket_path, open_collector):
    """The receiver has each sender watched as its first datagram arrives, not when a round next reads the store."""
    collector = open_collector(socket_path)
    subprocess.run(
        [sys.executable, "-c", "import json, sys; from gpuwatch.trainer.telemetry import TelemetryClient; "
         "client = TelemetryClient(sys.argv[1], heartbeat_interval=0); client.send(json.loads(sys.argv[2])); "
         "client.close()", str(socket_path), json.dumps(hello(0))], check=True, timeout=60)
    wait_until(lambda: any(state.exited_time is not None for state in collector.store.snapshot()[0]), timeout=10,
               what="the sender's exit marked")
    state, = collector.store.snapshot()[0]
    assert state.hello is not None and state.sender_pid is not None


def test_an_idle_node_is_served_its_last_result_without_reading_the_store(socket_path, open_collector, monkeypatch):
    collector = open_collector(socket_path)
    first = collector.collect()

    def must_not_run(*_args: object) -> None:
        raise AssertionError("the store was read on an idle node")

    for name in ("expire", "note_exits", "snapshot", "probes"):
        monkeypatch.setattr(collector.store, name, must_not_run)
    assert collector.collect() is first  # no rank, nothing received: nothing to expire, mark or apply
    monkeypatch.undo()
    collector.store.receive(encode(hello(0)))  # queued, not yet applied: the next round applies it
    assert [rank["rank"] for rank in collector.collect().readings["ranks"]] == [0]


def test_a_pid_whose_exit_was_reported_is_watched_again():
    """The kernel may give an exited rank's pid to a later process: its exit must be reported too."""
    exits: list[int] = []
    watcher = ExitWatcher(lambda pid, _when: exits.append(pid))
    try:
        process = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
        watcher.watch([process.pid])
        watcher.watch([process.pid])  # watched already: not twice
        process.communicate(b"", timeout=60)
        wait_until(lambda: exits == [process.pid], timeout=10, what="the exit reported")
        watcher.watch([process.pid])  # now gone: reported at once, as a new process of that pid would be watched
        assert exits == [process.pid, process.pid]
    finally:
        watcher.close()
