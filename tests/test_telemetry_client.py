"""The rank's telemetry client: never blocks, never raises, counts every drop, finds the agent again."""

import contextlib
import json
import logging
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from telemetry_records import hello, plain_step, progress, step

from gpuwatch.protocol.paths import SYSTEM_SOCKET, default_socket_path, socket_path_candidates
from gpuwatch.protocol.schema import MAX_RECORD_BYTES
from gpuwatch.trainer.telemetry import (
    BACKLOG_RECORDS,
    INBOX_RECORDS,
    TelemetryClient,
    captured_environment,
    run_log_file,
)

from conftest import wait_until


class Receiver:
    """A bare datagram socket standing in for the agent."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.setblocking(False)

    def records(self) -> list[dict]:
        out = []
        while True:
            try:
                out.append(json.loads(self.sock.recv(MAX_RECORD_BYTES + 1)))
            except BlockingIOError:
                return out

    def close(self) -> None:
        self.sock.close()
        self.path.unlink()


@pytest.fixture
def socket_path(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("client") / "agent.sock"


def _send_in_thread(client: TelemetryClient, records: list[dict]) -> None:
    """A send that blocked would hang the training loop: fail instead of hanging the suite."""
    thread = threading.Thread(target=lambda: [client.send(record) for record in records], daemon=True)
    thread.start()
    thread.join(10)
    assert not thread.is_alive(), "send() blocked"


def test_without_agent_every_record_is_dropped_counted_and_nothing_raises(socket_path):
    client = TelemetryClient(socket_path, heartbeat_interval=0)
    _send_in_thread(client, [hello(), *(step(number=n) for n in range(1000))])
    assert (client.sent, client.dropped, client.drops["no_agent"]) == (0, 1001, 1001)
    # A socket file left by a killed agent (nobody reading) is "no agent" too: ECONNREFUSED.
    Receiver(socket_path).sock.close()
    client.send(step())
    assert client.drops["no_agent"] == 1002


def test_records_arrive_once_the_agent_appears_hello_first(socket_path):
    client = TelemetryClient(socket_path, heartbeat_interval=0)
    client.send(hello())
    client.send(step(number=1))
    agent = Receiver(socket_path)
    client.send(step(number=2))
    received = agent.records()
    assert [record["kind"] for record in received] == ["hello", "step"]  # the lost hello is replayed
    assert received[1]["step"] == 2
    assert received[1]["client"] == {"sent": 1, "dropped": {"no_agent": 2}}  # the agent learns about drops
    assert client.sent == 2


def test_client_follows_an_agent_restart_on_the_same_path(socket_path):
    client = TelemetryClient(socket_path, heartbeat_interval=0)
    first = Receiver(socket_path)
    client.send(hello())
    first.close()
    client.send(step(number=1))
    second = Receiver(socket_path)
    client.send(step(number=2))
    assert [(r["kind"], r.get("step")) for r in second.records()] == [("hello", None), ("step", 2)]
    assert client.drops["no_agent"] == 1


def test_an_agent_restarted_between_two_datagrams_gets_the_hello_first(socket_path):
    """No send failed while it was down (a rank stepping slowly, or its steps held to fold): the socket at the path
    is a new one all the same, so the hello goes again."""
    client = TelemetryClient(socket_path, heartbeat_interval=0)
    first = Receiver(socket_path)
    client.send(hello())
    client.send(step(number=1))
    first.close()
    second = Receiver(socket_path)  # the same path, very likely the same inode number: a new socket all the same
    client.send(step(number=2))
    assert [(r["kind"], r.get("step")) for r in second.records()] == [("hello", None), ("step", 2)]
    assert client.dropped == 0


def test_a_stalled_agent_costs_drops_not_blocking_and_order_is_kept(socket_path):
    agent = Receiver(socket_path)  # never reads until the end: its kernel queue fills
    client = TelemetryClient(socket_path, heartbeat_interval=0)
    total = 3 * BACKLOG_RECORDS
    _send_in_thread(client, [step(number=n) for n in range(total)])
    assert client.drops["busy"] > 0
    received = agent.records()
    for extra in range(total, total + 100):  # the agent catches up: later sends flush the backlog
        client.send(step(number=extra))
        received += agent.records()
    numbers = [record["step"] for record in received]
    assert numbers == sorted(numbers) and numbers[-1] == total + 99
    assert len(numbers) + client.drops["busy"] == total + 100 == client.sent + client.dropped


def test_the_backlog_drains_by_itself_and_close_counts_what_never_left(socket_path):
    agent = Receiver(socket_path)
    client = TelemetryClient(socket_path, heartbeat_interval=0)
    _send_in_thread(client, [step(number=n) for n in range(40)])  # more than the kernel queues
    received = []

    def all_arrived() -> bool:
        received.extend(record["step"] for record in agent.records())
        return len(received) == 40

    wait_until(all_arrived, timeout=5, what="the backlog, retried by the client's own thread")
    assert received == list(range(40)) and client.dropped == 0

    stalled = TelemetryClient(socket_path, heartbeat_interval=0)
    _send_in_thread(stalled, [step(number=n) for n in range(40)])
    stalled.close(timeout=0.05)
    assert stalled.sent + stalled.drops["busy"] == 40 and stalled.drops["busy"] > 0


def _reading(agent: Receiver) -> list[dict]:
    """What `agent` receives, read as it arrives by a thread of its own until the socket closes: the kernel
    queues only a few datagrams."""
    received: list[dict] = []
    agent.sock.setblocking(True)

    def read() -> None:
        with contextlib.suppress(OSError):
            while payload := agent.sock.recv(MAX_RECORD_BYTES + 1):
                received.append(json.loads(payload))

    threading.Thread(target=read, daemon=True).start()
    return received


def test_submitted_records_are_built_on_the_clients_thread_and_all_sent_in_order_by_close(socket_path):
    agent = Receiver(socket_path)
    received = _reading(agent)
    client = TelemetryClient(socket_path, heartbeat_interval=0)
    builders: set[str] = set()

    def build(number: int):
        def record() -> dict | None:
            builders.add(threading.current_thread().name)
            return None if number % 10 == 9 else step(number=number)  # None: nothing to send
        return record

    for number in range(50):
        client.submit(build(number))
    wait_until(lambda: len(received) == 45, timeout=10, what="the first batch, sent by the client's own thread")
    assert builders == {"telemetry-client"}
    for number in range(50, 100):
        client.submit(build(number))
    client.close()  # at once: what was submitted and not yet sent goes out now, in order
    expected = [n for n in range(100) if n % 10 != 9]
    wait_until(lambda: len(received) == len(expected), timeout=10, what="every record sent")
    assert [record["step"] for record in received] == expected
    assert client.dropped == 0


def test_submitted_plain_steps_are_folded_and_anything_else_goes_at_once_after_them(socket_path, tmp_path):
    agent = Receiver(socket_path)
    received = _reading(agent)
    log_path = tmp_path / "rank-00000.jsonl"
    client = TelemetryClient(socket_path, run_log=log_path, heartbeat_interval=0, fold_seconds=3600)
    client.submit(lambda: plain_step(number=1, tokens=100 * 1))
    wait_until(lambda: len(received) == 1, timeout=10, what="the first step, at once: none went for fold_seconds")
    submitted = [*(plain_step(number=n, tokens=100 * n) for n in range(2, 6)), progress(step=5), step(number=6),
                 plain_step(number=7, tokens=700)]
    for record in submitted:
        client.submit(lambda record=record: record)
    client.close()  # sends the one step held
    wait_until(lambda: len(received) == 5, timeout=10, what="every datagram")

    assert [(r["kind"], r.get("step")) for r in received] == [
        ("step", 1), ("step", 5), ("progress", 5), ("step", 6), ("step", 7)]
    assert [point["step"] for point in received[1]["folded"]["steps"]] == [2, 3, 4]  # held until the progress record
    assert received[1]["folded"]["tokens"] == 200 + 300 + 400
    assert received[1]["folded"]["collectives"]["all_reduce"]["count"] == 3 * 2
    assert "folded" not in received[3]  # news (a memory reading, sampled signals): at once, nothing held before it
    assert client.sent == 8 and client.dropped == 0  # records, not datagrams
    logged = [json.loads(line) for line in log_path.read_text().splitlines()]
    assert [(r["kind"], r.get("step")) for r in logged] == [("step", 1)] + [(r["kind"], r["step"]) for r in submitted]
    assert not any("folded" in record for record in logged)  # the run log keeps every record whole


def test_held_steps_go_once_fold_seconds_have_passed_without_a_later_record(socket_path):
    agent = Receiver(socket_path)
    received = _reading(agent)
    client = TelemetryClient(socket_path, heartbeat_interval=0, fold_seconds=0.2)
    for number in range(1, 5):
        client.submit(lambda number=number: plain_step(number=number, tokens=100 * number))

    def steps() -> list[int]:
        return [n for r in received for n in [p["step"] for p in r.get("folded", {}).get("steps", [])] + [r["step"]]]

    wait_until(lambda: steps() == [1, 2, 3, 4], timeout=10, what="the held steps, sent by the client's thread")
    client.close()


class BlockedSocket:
    """A datagram socket whose sends wait until the test lets them go: an agent that never answers."""

    def __init__(self, real: socket.socket) -> None:
        self.real, self.entered, self.release = real, threading.Event(), threading.Event()

    def sendto(self, payload: bytes, address: bytes) -> int:
        self.entered.set()
        self.release.wait()
        return self.real.sendto(payload, address)

    def close(self) -> None:
        self.real.close()


def test_submit_never_waits_for_a_blocked_sender_and_counts_what_overflows_as_busy(socket_path, tmp_path):
    Receiver(socket_path)  # never read: once released, the sends run into its full queue, as with a stalled agent
    log_path = tmp_path / "rank-00000.jsonl"
    client = TelemetryClient(socket_path, run_log=log_path, heartbeat_interval=0)
    blocked = client._socket = BlockedSocket(client._socket)
    client.submit(lambda: step(number=0))
    assert blocked.entered.wait(10), "the client's thread never sent"  # it now holds the client's lock, waiting
    overflow = 10
    thread = threading.Thread(target=lambda: [client.submit(lambda n=n: step(number=n))
                                              for n in range(1, INBOX_RECORDS + overflow + 1)], daemon=True)
    thread.start()
    thread.join(10)
    assert not thread.is_alive(), "submit() blocked"
    assert client.drops == {"busy": overflow}
    blocked.release.set()
    client.close(timeout=0)
    # The run log has every record the hand-over kept: the first, then the whole inbox in order.
    logged = [json.loads(line)["step"] for line in log_path.read_text().splitlines()]
    assert logged == list(range(INBOX_RECORDS + 1))
    assert client.sent + client.dropped == INBOX_RECORDS + overflow + 1  # the rest met the agent's full queue


def test_run_log_file_is_one_file_per_rank_in_a_directory_or_the_jsonl_file_named(tmp_path):
    assert run_log_file(tmp_path / "runs" / "day-1", 7) == tmp_path / "runs" / "day-1" / "rank-00007.jsonl"
    assert (tmp_path / "runs" / "day-1").is_dir()  # made for the rank's file
    assert run_log_file(tmp_path / "logs" / "job.jsonl", 7) == tmp_path / "logs" / "job.jsonl"
    assert (tmp_path / "logs").is_dir()


def test_encoding_errors_and_oversized_records_are_counted_with_one_warning(socket_path, caplog):
    agent = Receiver(socket_path)
    client = TelemetryClient(socket_path, heartbeat_interval=0)
    with caplog.at_level(logging.WARNING, logger="gpuwatch.trainer.telemetry"):
        client.send(step(loss=object()))
        client.send(step(loss=object()))
        client.send(hello(env={f"NCCL_VAR_{i}": "x" * 1000 for i in range(20)}))
        client.send(None)
    assert client.drops == {"encode_error": 2, "too_large": 1, "error": 1}
    assert len([r for r in caplog.records if "encode_error" in r.getMessage()]) == 1
    client.send(step())
    assert len(agent.records()) == 1


def test_run_log_keeps_every_record_even_when_the_agent_is_absent(socket_path, tmp_path):
    log_path = tmp_path / "rank0.jsonl"
    with TelemetryClient(socket_path, run_log=log_path, heartbeat_interval=0) as client:
        client.send(hello())
        client.send(step(number=1, loss=float("nan")))
        client.send(step(number=2))
    lines = log_path.read_text().splitlines()
    assert [json.loads(line)["kind"] for line in lines] == ["hello", "step", "step"]
    assert json.loads(lines[1])["loss"] != json.loads(lines[1])["loss"]  # NaN kept
    assert client.drops["no_agent"] == 3


def test_a_failing_run_log_is_disabled_with_one_warning_and_sending_goes_on(socket_path, caplog):
    agent = Receiver(socket_path)
    with caplog.at_level(logging.WARNING, logger="gpuwatch.trainer.telemetry"):
        client = TelemetryClient(socket_path, run_log="/dev/full", heartbeat_interval=0)  # every write: ENOSPC
        for number in range(5):
            client.send(step(number=number))
        unwritable = TelemetryClient(socket_path, run_log=socket_path.parent / "missing" / "x.jsonl",
                                     heartbeat_interval=0)
        unwritable.send(step())
    assert len([r for r in caplog.records if "run log" in r.getMessage()]) == 2
    assert client.sent == 5 and len(agent.records()) == 6


def test_heartbeat_resends_the_hello_until_closed(socket_path):
    agent = Receiver(socket_path)
    client = TelemetryClient(socket_path, heartbeat_interval=0.02)
    client.send(hello())
    threading.Event().wait(0.3)
    client.close()
    hellos = len(agent.records())
    assert hellos >= 3
    threading.Event().wait(0.1)
    assert agent.records() == []  # stopped


def test_socket_path_from_argument_then_environment_then_the_shared_default(monkeypatch, tmp_path):
    monkeypatch.setenv("GPUWATCH_SOCKET", str(tmp_path / "env.sock"))
    assert TelemetryClient(tmp_path / "arg.sock").socket_path == tmp_path / "arg.sock"
    assert TelemetryClient().socket_path == tmp_path / "env.sock"
    assert default_socket_path() == tmp_path / "env.sock"  # the agent reads the same variable
    candidates = socket_path_candidates({})
    assert candidates == (SYSTEM_SOCKET, Path(f"/tmp/gpuwatch-{os.geteuid()}/telemetry.sock"))
    assert default_socket_path({}) in candidates


def test_a_root_agents_socket_the_rank_may_not_look_at_is_still_chosen(monkeypatch, tmp_path):
    """Agent as root, job as a user outside its group: stat() says EACCES. Sending there fails with a
    warning naming the socket; falling back to the user's own path would only say "no agent"."""
    system = tmp_path / "root-only" / "telemetry.sock"
    lstat = Path.lstat

    def no_access(path):
        if path == system:
            raise PermissionError(13, "Permission denied", str(path))
        return lstat(path)

    monkeypatch.setattr(Path, "lstat", no_access)
    monkeypatch.setattr("gpuwatch.protocol.paths.SYSTEM_SOCKET", system)
    monkeypatch.delenv("GPUWATCH_SOCKET", raising=False)
    assert TelemetryClient(heartbeat_interval=0).socket_path == system


def test_captured_environment_never_copies_secrets():
    environ = {
        "AWS_SECRET_ACCESS_KEY": "s3cr3t", "WANDB_API_KEY": "k", "NCCL_FAKE_TOKEN": "t", "HF_TOKEN": "t",
        "TORCH_PASSWORD": "p", "PYTORCH_AUTH_HEADER": "h", "HOME": "/root", "PATH": "/bin",
        "NCCL_DEBUG": "INFO", "NCCL_IB_DISABLE": "0", "CUDA_VISIBLE_DEVICES": "0,1", "MASTER_ADDR": "10.0.0.1",
        "WORLD_SIZE": "8", "LOCAL_RANK": "3", "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
        "NCCL_LONG": "x" * 5000,
    }
    assert captured_environment(environ) == {
        "CUDA_VISIBLE_DEVICES": "0,1", "LOCAL_RANK": "3", "MASTER_ADDR": "10.0.0.1", "NCCL_DEBUG": "INFO",
        "NCCL_IB_DISABLE": "0", "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "WORLD_SIZE": "8",
    }


def test_captured_environment_always_fits_the_hello_datagram(socket_path):
    environ = {f"NCCL_SETTING_{i:03d}": "v" * 1000 for i in range(200)}
    env = captured_environment(environ)
    assert 4 <= len(env) < 200
    agent = Receiver(socket_path)
    client = TelemetryClient(socket_path, heartbeat_interval=0)
    client.send(hello(env=env))
    assert client.sent == 1 and agent.records()[0]["env"] == env


def test_client_never_imports_torch(socket_path):
    code = ("import sys; sys.modules['torch'] = None\n"
            "from gpuwatch.trainer.telemetry import TelemetryClient\n"
            f"client = TelemetryClient({str(socket_path)!r})\n"
            "client.send({'v': 1, 'kind': 'step'})\n"
            "assert client.drops['no_agent'] == 1\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
