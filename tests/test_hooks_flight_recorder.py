"""PyTorch's Flight Recorder as a second source (trainer/hooks/flight_recorder.py): its dump parsed from a real
2-rank gloo job, the parse held robust to what a dump may lack, and a hang in which rank 0's progress record carries
the all-reduce the recorder has not seen finish, beside the hooks' own account of it. Real gloo ranks, forked
(`gpuwatch.trainer.launch`); no timing assertion: rank 1 is released only once rank 0 has reported."""

from __future__ import annotations

import json
from collections import Counter
from datetime import timedelta
from typing import Any, cast

import pytest
import torch
import torch.distributed as dist

from gpuwatch.protocol.schema import decode, encode
from gpuwatch.trainer import hooks
from gpuwatch.trainer.hooks import progress as progress_module
from gpuwatch.trainer.hooks.flight_recorder import FlightEntry, FlightRecorder
from gpuwatch.trainer.hooks.progress import flight_recorder_field
from gpuwatch.trainer.launch import launch

#: How long a rank of these jobs may take (a loaded CI machine), and how long rank 1 waits to be released.
JOB_TIMEOUT_S = 120
RELEASE_TIMEOUT = timedelta(seconds=60)


def _collectives(device: torch.device) -> list[FlightEntry] | None:
    """A few collectives on the world and on a group described as "dp", and a send/recv; then the recorder."""
    rank = dist.get_rank()
    dp = dist.new_group([0, 1], group_desc="dp")
    tensor = torch.ones(4)
    for _ in range(3):
        dist.all_reduce(tensor)
    for _ in range(2):
        dist.all_reduce(tensor, group=dp)
    dist.broadcast(tensor, src=0)
    if rank == 0:
        dist.send(tensor, 1)
    else:
        dist.recv(tensor, 0)
    dist.all_gather([torch.empty(4) for _ in range(2)], tensor, group=dp)
    return FlightRecorder.read_settled()  # gloo retires the last work on its own thread, just after


@pytest.mark.integration
def test_the_dump_of_a_real_gloo_job_parses_into_its_collectives_per_group(monkeypatch):
    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "256")  # the forked ranks inherit it
    assert FlightRecorder.enabled() and FlightRecorder.buffer_size() == 256
    for entries in launch(_collectives, 2, device="cpu", timeout=JOB_TIMEOUT_S):
        assert entries is not None
        collectives = [entry for entry in entries if not entry.p2p]
        assert Counter((entry.group_desc, entry.op) for entry in collectives) == {
            ("default_pg", "all_reduce"): 3, ("default_pg", "broadcast"): 1, ("dp", "all_reduce"): 2,
            ("dp", "all_gather"): 1}
        by_group: dict[str, list[int]] = {}
        for entry in collectives:
            by_group.setdefault(entry.group_desc, []).append(entry.seq)
        assert by_group == {"default_pg": [1, 2, 3, 4], "dp": [1, 2, 3]}  # numbered per group, oldest first
        assert {entry.group for entry in collectives if entry.group_desc == "default_pg"} == {"0"}
        assert all(entry.backend == "gloo" and entry.finished for entry in entries)
        assert all(entry.duration_seconds is None for entry in entries)  # NCCL's timing only
        assert FlightRecorder.oldest_unfinished(entries) is None


def test_the_parse_keeps_what_a_dump_has_and_defaults_what_it_lacks():
    nccl = {"entries": [
        {"profiling_name": "nccl:all_reduce", "process_group": ["0", "default_pg"], "collective_seq_id": 7,
         "p2p_seq_id": 0, "is_p2p": False, "state": "completed", "retired": True, "duration_ms": 1.5},
        {"profiling_name": "nccl:send 0->1", "process_group": ["3", "pp"], "collective_seq_id": 0, "p2p_seq_id": 2,
         "is_p2p": True, "state": "started", "retired": False},
        {"pg_id": 2},  # an entry of another version: nothing but its group's id
        "no entry", {"process_group": "0", "collective_seq_id": -1, "duration_ms": True, "state": 3},
    ], "version": "2.10"}
    done, send, bare, odd = FlightRecorder.parse(json.dumps(nccl))
    assert done == FlightEntry("all_reduce", "nccl", "0", "default_pg", 7, False, "completed", True, 0.0015)
    assert (send.op, send.group_desc, send.seq, send.p2p, send.finished) == ("send 0->1", "pp", 2, True, False)
    assert bare == FlightEntry("unknown", "", "2", "", 0, False, "scheduled", False, None)
    assert (odd.group, odd.seq, odd.state, odd.duration_seconds) == ("", 0, "scheduled", None)
    assert FlightRecorder.oldest_unfinished([done, send, bare]) == send
    for dump in ("", "{", b"[]", '{"entries": {}}', "null", {"entries": None}, {"pg_status": {}}):
        assert FlightRecorder.parse(dump) == []
    # the progress record's field: fitted to the schema's labels and lengths, the description left out when empty
    field = flight_recorder_field([done, send._replace(group="g" * 500)])
    assert field == {"op": "send_0-_1", "group": "g" * 128, "group_desc": "pp", "seq": 2, "p2p": True,
                     "state": "started"}
    assert flight_recorder_field([done]) is None and flight_recorder_field([]) is None


def test_whether_it_is_on_follows_the_variables_as_torch_reads_them(monkeypatch):
    assert FlightRecorder.buffer_size({}) is None and FlightRecorder.enabled({})  # unset: torch's default
    assert FlightRecorder.buffer_size({"TORCH_NCCL_TRACE_BUFFER_SIZE": "2000"}) == 2000
    assert not FlightRecorder.enabled({"TORCH_FR_BUFFER_SIZE": "0", "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000"})
    assert FlightRecorder.buffer_size({"TORCH_FR_BUFFER_SIZE": "lots"}) is None
    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "0")
    watchdog = progress_module.Watchdog(progress_module.Progress(), lambda record: None, "job", 0, 0)
    assert watchdog.recorder is None  # off: never read
    monkeypatch.delattr(torch._C._distributed_c10d, "_dump_fr_trace_json")
    assert FlightRecorder.read() is None and flight_recorder_field() is None  # a torch without it


def _hang(device: torch.device) -> list[dict]:
    """Three steps, each an all-reduce timed by the hooks; in the fourth rank 1 stops before its all-reduce until
    rank 0's watchdog has reported where it waits. Every progress record that carries the recorder's field."""
    rank, store = dist.get_rank(), dist.distributed_c10d._get_default_store()
    sent: list[dict] = []

    class Client:
        def send(self, record):
            sent.append(record)
            if record.get("phase") == "collective" and "flight_recorder" in record:
                store.set("reported", "1")

        def submit(self, build):
            pass

        def close(self):
            pass

    monitor = hooks.Monitor(torch.nn.Linear(2, 2), job="fr-hang", client=cast(Any, Client()))
    tensor = torch.ones(4)
    for step in range(1, 5):
        if step == 4 and rank == 1:
            store.wait(["reported"], RELEASE_TIMEOUT)
        with monitor.step(), monitor.collective("all_reduce", tensor.numel() * 4):
            dist.all_reduce(tensor)
    monitor.close()
    return [record for record in sent if "flight_recorder" in record]


@pytest.mark.integration
def test_a_rank_waiting_in_an_all_reduce_reports_the_recorders_unfinished_one(monkeypatch):
    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "64")
    monkeypatch.setattr(progress_module, "OVERDUE_FLOOR_SECONDS", 0.2)  # overdue soon after the job's tiny steps
    waiting, stopped = launch(_hang, 2, device="cpu", timeout=JOB_TIMEOUT_S)
    assert stopped == []  # rank 1 finished every collective it started
    record = next(record for record in waiting if record["phase"] == "collective")
    body = decode(encode(record)).body.as_dict()  # what the agent takes
    assert body["flight_recorder"] == {"op": "all_reduce", "group": "0", "group_desc": "default_pg", "seq": 4,
                                       "p2p": False, "state": "scheduled"}
    # both sources agree: the hooks' own in-flight collective is the same call
    assert (body["collective"]["op"], body["collective"]["group"], body["collective"]["seq"]) == (
        "all_reduce", "default", 4)
