"""Shared test helpers: free ports, a real agent subprocess, a real Prometheus server."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

FIXTURES = Path(__file__).parent / "fixtures"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_get(url: str, timeout: float = 5.0) -> tuple[int, bytes, dict[str, str]]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status, response.read(), dict(response.headers)
    except urllib.error.HTTPError as error:
        return error.code, error.read(), dict(error.headers)


def wait_until(predicate, timeout: float = 20.0, interval: float = 0.1, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError):
            value = predicate()
            if value:
                return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


#: How often a test polls ``gpuwatch diagnose`` for a verdict it waits for (``wait_until``'s interval): once a
#: second, as a user polls it. A verdict changes at most once per agent round (0.5-1 s in the tests), and each poll is
#: a whole diagnosis and a read of the source: at wait_until's default 0.1 s the hang tests spent most of their CPU
#: (58 s of test_e2e_hangs.py's) asking.
VERDICT_POLL_S = 1.0


#: Every test agent's collector deadline (``args`` may set another): generous, so that on a loaded machine a healthy
#: collector never misses a round and drops out of the one page or state a test reads. The deadline itself is
#: tested with an injected hang (test_sampler.py, test_collector_nvml.py).
COLLECTOR_TIMEOUT = ("--collector-timeout", "30")


class AgentProcess:
    """``gpuwatch agent`` run as a user would run it, in its own process.

    Its telemetry socket is ``telemetry_socket`` (passed as GPUWATCH_SOCKET, so ``--telemetry.socket``
    in ``args`` still wins): tests never touch the machine's real /run/gpuwatch.
    """

    def __init__(self, *args: str, telemetry_socket: Path, port: int | None = None) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.telemetry_socket = telemetry_socket
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "gpuwatch.cli.main", "agent", "--listen", f"127.0.0.1:{self.port}",
             *COLLECTOR_TIMEOUT, *args],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env={**os.environ, "GPUWATCH_SOCKET": str(telemetry_socket)},
        )
        try:
            wait_until(self._healthy, what=f"agent on {self.url} (args {args})")
        except BaseException:  # the caller gets no handle on an agent that never turned healthy: stop it here
            self.stop()
            raise

    def _healthy(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"agent exited with {self.proc.returncode}:\n{self.proc.stdout.read()}")
        return http_get(self.url + "/healthz", timeout=1)[0] == 200

    def get(self, path: str) -> bytes:
        status, body, _ = http_get(self.url + path)
        assert status == 200, (path, status, body[:200])
        return body

    def state(self) -> dict:
        return json.loads(self.get("/api/v1/state"))

    def stop(self, sig: int = signal.SIGTERM) -> tuple[int, str]:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            output, _ = self.proc.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            output, _ = self.proc.communicate()
        return self.proc.returncode, output


@pytest.fixture
def start_agent(tmp_path_factory):
    """Start ``gpuwatch agent *args``; ``telemetry_socket`` defaults to a fresh private directory
    (short: a Unix socket path holds at most 107 bytes)."""
    agents: list[AgentProcess] = []

    def start(*args: str, telemetry_socket: Path | None = None) -> AgentProcess:
        socket_path = telemetry_socket or tmp_path_factory.mktemp("agent") / "telemetry.sock"
        agent = AgentProcess(*args, telemetry_socket=socket_path)
        agents.append(agent)
        return agent

    yield start
    for agent in agents:
        agent.stop()


class IdleSender:
    """A process that sends records to an agent, its progress records of closed hooks with its own CPU time then (as
    the hooks' are), and idles until closed: a rank whose training ended and whose process does not exit (HANG007).
    The agent reads a rank's process CPU time by the pid its records came from, which a test's own process, sending
    for other ranks too, cannot stand in for."""

    SCRIPT = """
import json, sys, time
from gpuwatch.trainer.telemetry import TelemetryClient
client = TelemetryClient(sys.argv[1], heartbeat_interval=0)
for record in json.loads(sys.argv[2]):
    if record.get("phase") == "closed":
        record["cpu_seconds"] = time.process_time()
    client.send(record)
client.close(timeout=60)
print(client.dropped, flush=True)
sys.stdin.read()
"""

    def __init__(self, telemetry_socket: Path, records: list[dict[str, Any]]) -> None:
        self.process = subprocess.Popen([sys.executable, "-c", self.SCRIPT, str(telemetry_socket),
                                         json.dumps(records)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        text=True)
        assert self.process.stdout is not None
        assert self.process.stdout.readline().strip() == "0", "the idle sender's records were all sent"

    def close(self) -> None:
        assert self.process.stdin is not None
        self.process.stdin.close()
        self.process.wait(30)


def require_tool(name: str) -> str:
    """Integration tests need Prometheus' binaries; .ci/run installs them. Missing is a failure, not a skip."""
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"{name} not found: install Debian's 'prometheus' package (apt-get install prometheus)")
    return path


def stop_server(proc: subprocess.Popen, log) -> None:
    """Terminate a server process a test started (killed after 15 s), then close its log."""
    proc.terminate()
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        proc.kill()
    log.close()


class PrometheusServer:
    """A real Prometheus server on 127.0.0.1 with a temporary TSDB."""

    def __init__(self, workdir: Path, scrape_targets: list[str], scrape_interval: str = "1s",
                 honor_labels: bool = False, extra_args: tuple[str, ...] | list[str] = (),
                 settings: dict | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = workdir / "prometheus.yml"
        config.write_text(json.dumps({
            "global": {"scrape_interval": scrape_interval, "evaluation_interval": scrape_interval},
            "scrape_configs": [{"job_name": "gpuwatch", "honor_labels": honor_labels,
                                "static_configs": [{"targets": scrape_targets}]}],
            **(settings or {}),
        }))
        self.log = (workdir / "prometheus.log").open("w")
        self.proc = subprocess.Popen(
            [require_tool("prometheus"), f"--config.file={config}", f"--storage.tsdb.path={workdir / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--web.enable-lifecycle", *extra_args],
            stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, "GOMAXPROCS": "1"},
        )
        wait_until(lambda: http_get(self.url + "/-/ready", timeout=1)[0] == 200, what="prometheus ready")

    def query(self, expr: str) -> list[dict]:
        url = self.url + "/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        status, body, _ = http_get(url)
        payload = json.loads(body)
        assert status == 200 and payload["status"] == "success", payload
        return payload["data"]["result"]

    def stop(self) -> None:
        stop_server(self.proc, self.log)


@pytest.fixture
def prometheus_server(tmp_path):
    servers: list[PrometheusServer] = []

    def start(targets: list[str], **kwargs) -> PrometheusServer:
        server = PrometheusServer(tmp_path, targets, **kwargs)
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()


@pytest.fixture(scope="module")
def agent(tmp_path_factory) -> Iterator[AgentProcess]:
    """The user's agent for a module of real jobs (tests/foreign.py): `gpuwatch agent --simulate dgx-h100 --interval
    1`, its telemetry socket in a folder of its own. A module that needs another agent defines its own `agent`."""
    from foreign import simulated_agent  # foreign imports this module: not at its import

    with simulated_agent(tmp_path_factory.mktemp("agent")) as agent:
        yield agent


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    """Where a module's job runs keep their run logs and results."""
    return tmp_path_factory.mktemp("runs")


def _report_run(name: str) -> Any:
    """The session fixture ``name``: report_runs' run log of that name (a real gloo run of the reference trainer),
    made once a session for tests/test_report.py and tests/test_report_browser.py alike. Imported when first used:
    it imports torch, which most of the suite's tests do not need."""

    @pytest.fixture(scope="session", name=name)
    def run_log(tmp_path_factory: pytest.TempPathFactory) -> Path:
        import report_runs

        return getattr(report_runs, name)(tmp_path_factory)

    return run_log


straggler_log, bubble_log, hang_log = (_report_run(name) for name in ("straggler_log", "bubble_log", "hang_log"))


def sharing(module: str, values: Iterable[Any], run: Callable[[Any], str] = str,
            ids: Sequence[str] | None = None) -> list[Any]:
    """``values`` as ``parametrize``'s parameters (a tuple per parameter where it takes several), each marked
    ``shares(f"{module}:{run(value)}")``: the tests of one run read it in one xdist worker, and each run's tests
    can go to another worker (``_shared``). ``ids``: the parameters' ids, where parametrize's own would differ."""
    return [pytest.param(*(value if isinstance(value, tuple) else (value,)),
                         marks=pytest.mark.shares(f"{module}:{run(value)}"), id=None if ids is None else ids[index])
            for index, value in enumerate(values)]


#: How much of a bytes parameter names its test (``pytest_make_parametrize_id``).
BYTES_ID_CHARS = 40


def pytest_make_parametrize_id(val: object) -> str | None:
    """A bytes parameter is named by its start, not all of it: xdist's workers must each collect the very same test
    ids, and a whole encoded record holds the time it was made at (tests/telemetry_records.py), which differs from
    one worker's collection to the next. Ids its start leaves alike pytest numbers in their order."""
    if isinstance(val, bytes) and len(val) > BYTES_ID_CHARS:
        return repr(val[:BYTES_ID_CHARS])[2:-1]  # escaped, as pytest escapes a whole one
    return None


def _shared(item: pytest.Item) -> set[str]:
    """What ``item`` shares with other tests that costs a run to make: each session fixture of the tests' own by
    name; its module's fixtures as one (or, for a test marked ``shares(NAME)``, NAME instead: its module's fixtures
    are cheap and what it reads is made per name, e.g. one framework job)."""
    shared = set()
    marked = item.get_closest_marker("shares")
    if marked is not None:
        shared.add(f"shares:{marked.args[0]}")
    definitions_by_name = item._fixtureinfo.name2fixturedefs if isinstance(item, pytest.Function) else {}
    for name, definitions in definitions_by_name.items():
        definition = definitions[-1]
        if not definition.baseid:  # pytest's own and plugins' (tmp_path_factory, ...)
            continue
        if definition.scope == "session":
            shared.add(f"session:{name}")
        elif definition.scope in ("package", "module", "class") and marked is None:
            shared.add(f"module:{item.nodeid.split('::')[0]}")
    return shared


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Group the tests for pytest-xdist's ``--dist loadgroup`` (pyproject's addopts): tests that share something
    that costs a run to make (``_shared``: a real job, an agent, a Prometheus server made by a module or session
    fixture) are in one ``xdist_group``, the connected tests' union, so that one worker makes it once, as a run without
    workers does; a test that shares nothing goes to whichever worker is free. Runs before xdist's own hook
    (tryfirst), which reads the marks.

    The modules with integration tests go first, in their order: they start processes and wait on them and are most
    of the suite's time; the in-process tests fill the workers' gaps at the end. xdist then sends the groups out
    largest first (its loadscope order), and a test in no group is a group of one, so the in-process tests still come
    last and no long group starts at the end."""
    parent: dict[str, str] = {}

    def root(key: str) -> str:
        while parent.setdefault(key, key) != key:
            key = parent[key]
        return key

    shared = {item: sorted(_shared(item)) for item in items}
    for keys in shared.values():
        for key in keys[1:]:
            parent[root(key)] = root(keys[0])
    integration = {item.path for item in items if item.get_closest_marker("integration") is not None}
    for item, keys in shared.items():
        if keys:
            item.add_marker(pytest.mark.xdist_group(root(keys[0])))
    items.sort(key=lambda item: item.path not in integration)
