"""``diagnose --prometheus`` on the engines large clusters run: a real Prometheus and a real VictoriaMetrics, both
scraping the same real simulated agents fed by the real TelemetryClient. The outlier fetch must find what the full
pull finds; TLS, basic auth and a tenant header come from ``--http.config.file``; an engine that cannot answer a
query yields rules reported as not run because of the source, never an all-clear."""

from __future__ import annotations

import http.server
import json
import math
import shutil
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import bcrypt
import pytest
import yaml
from click.testing import CliRunner
from telemetry_records import hello, step
from test_webconfig import write_pki

from gpuwatch.agent.telemetry.window import MIN_WINDOW_STEPS
from gpuwatch.cli.main import main
from gpuwatch.trainer.telemetry import TelemetryClient

from conftest import free_port, http_get, stop_server, wait_until

pytestmark = pytest.mark.integration

PASSWORD = "diag-s3cret"
TOKEN = "tok-8c1e5f"
RULES = Path(__file__).resolve().parent.parent / "alerts" / "gpuwatch.rules.yml"
TENANT = "team-a"
MEMORY = {"kind": "cuda", "peak_bytes": 3 << 30, "allocated_bytes": 2 << 30, "reserved_bytes": 3 << 29,
          "inactive_split_bytes": 1 << 20, "alloc_retries": 0, "ooms": 0}
FRAGMENTED = {**MEMORY, "reserved_bytes": 8 << 30, "allocated_bytes": 4 << 30, "alloc_retries": 9}


class VictoriaMetrics:
    """A real single-node VictoriaMetrics (Debian's victoria-metrics) scraping ``targets`` itself."""

    def __init__(self, workdir: Path, targets: list[str]) -> None:
        binary = shutil.which("victoria-metrics")
        if binary is None:
            pytest.fail("victoria-metrics not found: apt-get install victoria-metrics (.ci/run does)")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = workdir / "vm-scrape.yml"
        config.write_text(json.dumps({"global": {"scrape_interval": "1s"}, "scrape_configs": [
            {"job_name": "gpuwatch", "honor_labels": True, "static_configs": [{"targets": targets}]}]}))
        self.log = (workdir / "victoria-metrics.log").open("w")
        self.proc = subprocess.Popen(
            [binary, f"-storageDataPath={workdir / 'vm-data'}", f"-httpListenAddr=127.0.0.1:{self.port}",
             f"-promscrape.config={config}", "-search.latencyOffset=0s", "-search.disableCache"],
            stdout=self.log, stderr=subprocess.STDOUT)
        wait_until(lambda: http_get(self.url + "/health", timeout=1)[0] == 200, what="victoria-metrics ready")

    def stop(self) -> None:
        stop_server(self.proc, self.log)


def _count(url: str, expr: str) -> int:
    status, body, _ = http_get(f"{url}/api/v1/query?" + urllib.parse.urlencode({"query": expr}))
    result = json.loads(body)["data"]["result"] if status == 200 else []
    return int(float(result[0]["value"][1])) if result else 0


def _feed(agents, faults: dict[int, dict]) -> None:
    """Four ranks per agent (one job, tp over the node), a full window each; ``faults`` by global rank."""
    world = 4 * len(agents)
    for index, agent in enumerate(agents):
        uuids = [gpu["uuid"] for gpu in agent.state()["facts"]["nvml"]["gpus"]]
        with TelemetryClient(agent.telemetry_socket, heartbeat_interval=0) as client:
            for local in range(4):
                rank = index * 4 + local
                fault = faults.get(rank, {})
                client.send(hello(rank, hostname=f"node-{index}", local_rank=local, world_size=world, tp_size=4,
                                  dp_size=len(agents), dp_rank=index, tp_rank=local,
                                  gpu={"index": local, "uuid": uuids[local]}, env=fault.get("env", {})))
                for number in range(1, MIN_WINDOW_STEPS + 2):
                    client.send(step(rank, number, memory=fault.get("memory", MEMORY), loss=fault.get("loss", 2.0)))


def _feed_unmeasured(agent) -> None:
    """A second job of two ranks whose hellos came five minutes ago and no step since (HANG005)."""
    with TelemetryClient(agent.telemetry_socket, heartbeat_interval=0) as client:
        for rank in range(2):
            client.send(hello(rank, job="unmeasured", hostname="node-0", local_rank=rank, world_size=2, tp_size=1,
                              pp_size=1, dp_size=2, tp_rank=0, pp_stage=0, dp_rank=rank, gpu=None, env={},
                              time=time.time() - 300))


def _diagnose(url: str, *extra: str) -> tuple[int, dict | None, str]:
    result = CliRunner().invoke(main, ["diagnose", "--prometheus", url, "--format", "json", *extra])
    try:
        return result.exit_code, json.loads(result.stdout), result.output
    except ValueError:
        return result.exit_code, None, result.output


def _judged(document: dict) -> set[tuple[str, str]]:
    """(rule, node) of each warning and critical finding."""
    return {(f["code"], e["where"].get("node", "?")) for f in document["findings"] if f["severity"] != "info"
            for e in f["evidence"] if e["where"].get("node")}


@pytest.fixture
def cluster(start_agent, prometheus_server, tmp_path) -> Iterator[tuple[list[str], object, VictoriaMetrics]]:
    """Two simulated nodes, a NaN rank, a fragmented rank and one rank with NCCL_IB_DISABLE=1 on node-1, and a job
    whose ranks never stepped on node-0, scraped by Prometheus and by VictoriaMetrics."""
    agents = [start_agent("--simulate", "dgx-h100", "--interval", "0.5", "--node", f"node-{i}") for i in range(2)]
    targets = [f"127.0.0.1:{agent.port}" for agent in agents]
    # Prometheus evaluates the shipped recording rules (the outlier fetch uses them); VictoriaMetrics single-node
    # evaluates none (that takes vmalert), so the fetch computes the same yardsticks in its queries there.
    prometheus = prometheus_server(targets, honor_labels=True, settings={
        "rule_files": [str(RULES)], "global": {"scrape_interval": "1s", "evaluation_interval": "1s",
                                               "query_log_file": str(tmp_path / "queries.log")}})
    vm = VictoriaMetrics(tmp_path, targets)
    try:
        _feed(agents, {5: {"loss": math.nan}, 6: {"memory": FRAGMENTED}, 7: {"env": {"NCCL_IB_DISABLE": "1"}}})
        _feed_unmeasured(agents[0])
        wait_until(lambda: _count(prometheus.url, "count(gpuwatch:diagnose:recording_rules)") > 0,
                   timeout=90, what="the recording rules evaluated")
        for url in (prometheus.url, vm.url):
            wait_until(lambda url=url: _count(url, "count(gpuwatch_train_window_steps >= 5)") == 8
                       and _count(url, "count(gpuwatch_ib_port_up)") > 0
                       and _count(url, "count(gpuwatch_train_env_info)") == 1,
                       timeout=90, what=f"8 ranks with full windows in {url}")
        # The recorded signals lag the samples by up to an evaluation: wait until they show the planted faults.
        wait_until(lambda: all(_count(prometheus.url, f"count({name})") == count for name, count in (
            ("gpuwatch:train_nonfinite:by_instance", 1), ("gpuwatch:train_alloc_trouble:by_instance", 1),
            ("gpuwatch:train_env_info:count_by_value", 1))) and _count(
                prometheus.url, "sum(gpuwatch:train_window_busy_seconds:count_by_stage)") == 8,
                   timeout=90, what="the recording rules over the planted faults")
        yield targets, prometheus, vm
    finally:
        vm.stop()


def test_outlier_fetch_finds_what_the_full_pull_finds_on_prometheus_and_victoriametrics(cluster, tmp_path):
    _, prometheus, vm = cluster
    planted = {("CONV001", "node-1"), ("MEM001", "node-1"), ("NCCL001", "node-1"), ("HANG005", "node-0")}
    for url in (prometheus.url, vm.url):
        documents = {}
        for mode in ("full", "outliers"):
            code, document, output = _diagnose(url, "--prometheus.fetch", mode, "--fail-on", "never")
            assert code == 0 and document is not None, output
            assert document["sources"][0]["fetch"] == mode and document["sources"][0]["nodes"] == 2
            documents[mode] = document
        # VictoriaMetrics does not store NaN samples (it reads them as staleness markers): the NaN loss is
        # Prometheus' to show (docs/promql-engines.md).
        expected = planted if url == prometheus.url else planted - {("CONV001", "node-1")}
        assert expected <= _judged(documents["full"]), (url, documents["full"]["findings"])
        not_fetched = {item["code"] for item in documents["outliers"]["not_run"] if item["cause"] == "fetch"}
        assert _judged(documents["outliers"]) == {(code, node) for code, node in _judged(documents["full"])
                                                  if code not in not_fetched}, url
        assert not [item for item in documents["outliers"]["not_run"] if item["cause"] == "source"]
    sent = (tmp_path / "queries.log").read_text()  # the fixture's Prometheus logs every query it ran
    assert "gpuwatch:train_window_busy_seconds:median_by_stage" in sent


def _proxy(upstream: str, tenant: str) -> tuple[str, http.server.ThreadingHTTPServer]:
    """A reverse proxy that, as a Mimir gateway does, refuses a request without the tenant header and the bearer
    token; it echoes what it got in its refusal, as careless proxies do."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.do_POST()

        def do_POST(self) -> None:
            if self.headers.get("X-Scope-OrgID") != tenant or self.headers.get("Authorization") != f"Bearer {TOKEN}":
                self.send_response(401)
                self.end_headers()
                self.wfile.write(f"refused: {dict(self.headers)}".encode())
                return
            body = self.rfile.read(int(self.headers.get("Content-Length", 0))) if self.command == "POST" else None
            request = urllib.request.Request(upstream + self.path, data=body, headers={
                "Content-Type": self.headers.get("Content-Type", "")})
            with urllib.request.urlopen(request, timeout=60) as answer:
                payload = answer.read()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{server.server_address[1]}", server


def test_a_tenant_header_and_a_bearer_token_reach_victoriametrics_behind_a_gateway(cluster, tmp_path):
    _, _, vm = cluster
    url, server = _proxy(vm.url, TENANT)
    try:
        code, _, output = _diagnose(url, "--fail-on", "never")
        assert code == 2 and "401" in output and "Traceback" not in output and len(output.strip().splitlines()) == 1
        (tmp_path / "token").write_text(TOKEN + "\n")
        config = tmp_path / "http.yml"
        config.write_text(yaml.safe_dump({"http_headers": {"X-Scope-OrgID": {"values": ["someone-else"]}},
                                          "authorization": {"credentials_file": "token"}}))
        code, _, output = _diagnose(url, "--http.config.file", str(config), "--fail-on", "never")
        assert code == 2 and "401" in output and TOKEN not in output and "<secret>" in output, output
        config.write_text(yaml.safe_dump({"http_headers": {"X-Scope-OrgID": {"values": [TENANT]}},
                                          "authorization": {"credentials_file": "token"}}))
        code, document, output = _diagnose(url, "--http.config.file", str(config), "--fail-on", "never")
        assert code == 0 and document is not None, output
        assert ("MEM001", "node-1") in _judged(document)
    finally:
        server.shutdown()


def test_tls_and_basic_auth_from_the_http_config_and_no_credential_in_any_message(cluster, tmp_path):
    targets, _, _ = cluster
    pki = write_pki(tmp_path)
    web = tmp_path / "web.yml"
    web.write_text(yaml.safe_dump({
        "tls_server_config": {"cert_file": str(pki["tls.crt"]), "key_file": str(pki["tls.key"])},
        "basic_auth_users": {"diag": bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(4)).decode()}}))
    port = free_port()
    config = tmp_path / "prometheus.yml"
    config.write_text(json.dumps({"global": {"scrape_interval": "1s"}, "scrape_configs": [
        {"job_name": "gpuwatch", "honor_labels": True, "static_configs": [{"targets": targets}]}]}))
    (tmp_path / "password").write_text(PASSWORD + "\n")
    with (tmp_path / "tls-prometheus.log").open("w") as log:
        proc = subprocess.Popen([shutil.which("prometheus") or "prometheus", f"--config.file={config}",
                                 f"--storage.tsdb.path={tmp_path / 'tls-tsdb'}", f"--web.config.file={web}",
                                 f"--web.listen-address=127.0.0.1:{port}"], stdout=log, stderr=subprocess.STDOUT)
    url = f"https://127.0.0.1:{port}"
    good = tmp_path / "good.yml"
    good.write_text(yaml.safe_dump({"basic_auth": {"username": "diag", "password_file": "password"},
                                    "tls_config": {"ca_file": str(pki["ca.crt"])}}))
    try:
        def ready() -> bool:
            code, document, _ = _diagnose(url, "--http.config.file", str(good), "--fail-on", "never")
            return code == 0 and document is not None and ("CONV001", "node-1") in _judged(document)

        wait_until(ready, timeout=90, interval=1, what="diagnose over TLS with basic auth")
        wrong = tmp_path / "wrong.yml"
        wrong.write_text(yaml.safe_dump({"basic_auth": {"username": "diag", "password": PASSWORD + "-no"},
                                         "tls_config": {"ca_file": str(pki["ca.crt"])}}))
        untrusted = tmp_path / "untrusted.yml"
        untrusted.write_text(yaml.safe_dump({"basic_auth": {"username": "diag", "password": PASSWORD}}))
        for http_config, expected in ((wrong, "401"), (untrusted, "CERTIFICATE_VERIFY_FAILED")):
            code, _, output = _diagnose(url, "--http.config.file", str(http_config))
            assert code == 2 and expected in output, output
            assert PASSWORD not in output and "Traceback" not in output and len(output.strip().splitlines()) == 1
    finally:
        proc.terminate()
        proc.wait(15)


@pytest.mark.parametrize("document, message", [
    ({"basic_auth": {"username": "u", "password": PASSWORD, "password_file": "x"}}, "mutually exclusive"),
    ({"basic_auth": {"username": "u", "password": PASSWORD}, "authorization": {"credentials": PASSWORD}},
     "at most one"),
    ({"oauth2": {"client_id": "x"}}, "OAuth 2 is not supported"),
    ({"tls_config": {"ca_file": "missing-ca.pem"}}, "cannot load"),
    ({"authorization": {"credentials_file": "missing-token"}}, "cannot read"),
    ({"http_headers": {"X-Scope-OrgID": {"values": "team-a"}}}, "must be a list"),
    ({"tls_config": {"insecure_skip_verify": "yes"}}, "true or false"),
    ({"proxy_url": "http://proxy:3128"}, "a proxy is not supported"),
])
def test_a_bad_http_config_is_one_line_and_exit_status_2(tmp_path, document, message):
    config = tmp_path / "http.yml"
    config.write_text(yaml.safe_dump(document))
    result = CliRunner().invoke(main, ["diagnose", "--prometheus", "http://127.0.0.1:9", "--http.config.file",
                                       str(config)])
    assert result.exit_code == 2 and message in result.output, result.output
    assert PASSWORD not in result.output and len(result.output.strip().splitlines()) == 1


def test_a_query_the_engine_refuses_leaves_its_rules_not_run_and_fails_unless_partial_is_allowed(
        start_agent, prometheus_server, tmp_path):
    """Prometheus with a small --query.max-samples refuses the larger queries (too many samples) and answers the
    smaller: the rules resting on a refused read are not run because of the source, and --fail-on fails."""
    agent = start_agent("--simulate", "dgx-h100", "--interval", "0.5", "--node", "node-0")
    prometheus = prometheus_server([f"127.0.0.1:{agent.port}"], extra_args=["--query.max-samples=100"])
    _feed([agent], {})
    wait_until(lambda: _count(prometheus.url, "count(gpuwatch_train_window_steps >= 5)") == 4, timeout=60,
               what="4 ranks in Prometheus")
    code, document, output = _diagnose(prometheus.url, "--prometheus.fetch", "full")
    assert code == 1 and document is not None, output
    unanswered = {item["code"]: item["reason"] for item in document["not_run"] if item["cause"] == "source"}
    assert {"CONV001", "PERF002", "HANG001"} <= set(unanswered), document["not_run"]
    assert "ranks query failed" in unanswered["CONV001"] and "samples" in unanswered["CONV001"]
    assert "could not run because the source could not answer" in output
    code, document, output = _diagnose(prometheus.url, "--prometheus.fetch", "full", "--allow-partial")
    assert code == 0 and document is not None, output


def test_a_query_timeout_is_sent_as_the_engines_parameter_and_a_timed_out_read_is_no_all_clear(
        start_agent, prometheus_server):
    """`--query.timeout` reaches Prometheus as the query's own timeout, fractions of a second included: 2.5 s
    answers; a microsecond times every query out in Prometheus' queue (its own `timeout` error), the first
    included, so diagnose has nothing to judge and says so in one line, never an all clear. (Rules left unanswered
    by some queries only: the refused-query test above.)"""
    agent = start_agent("--simulate", "dgx-h100", "--interval", "0.5", "--node", "node-0")
    prometheus = prometheus_server([f"127.0.0.1:{agent.port}"])
    _feed([agent], {})
    wait_until(lambda: _count(prometheus.url, "count(gpuwatch_train_window_steps >= 5)") == 4, timeout=60,
               what="4 ranks in Prometheus")
    _, document, output = _diagnose(prometheus.url, "--query.timeout", "2.5")
    assert document is not None and document["findings"], output  # answered: the fed job's findings are there
    assert not [item for item in document["not_run"] if item["cause"] == "source"], document["not_run"]
    for extra in ((), ("--allow-partial",)):  # nothing answered at all: an error, which no option makes a pass
        code, document, output = _diagnose(prometheus.url, "--query.timeout", "0.000001", *extra)
        assert code == 2 and document is None and "query timed out" in output, output
        assert len(output.strip().splitlines()) == 1 and "Traceback" not in output
