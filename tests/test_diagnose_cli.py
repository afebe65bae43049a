"""`gpuwatch diagnose` as a user runs it: exit codes, --list-rules, --explain, the JSON report against its
documented schema, readable text, --preflight on a sysfs fixture, a simulated port down, source errors."""

from __future__ import annotations

import http.server
import json
import math
import re
import threading
from pathlib import Path

import pytest
from click.testing import CliRunner
from diagnose_facts import GIB, facts, gpu, node, port, rank, step
from test_diagnose_engine import CATALOGUE

from gpuwatch.agent.simulate import PRESETS
from gpuwatch.agent.simulate.sysfs import SimulatedSysfs
from gpuwatch.cli.main import main
from gpuwatch.diagnosis import cli as diagnose_cli
from gpuwatch.diagnosis import engine, report
from gpuwatch.diagnosis.facts import History, NvlinkFacts, Sampled, SourceInfo
from gpuwatch.diagnosis.sources import gather as sources_gather

from conftest import FIXTURES, free_port

SCHEMA = json.loads((Path(__file__).resolve().parents[1] / "docs" / "diagnose-report.schema.json").read_text())
IB_FIXTURE = FIXTURES / "procfs-infiniband" / "sys"
#: The shell of the test process may carry NCCL settings of its own; pre-flight runs start from none.
CLEAN_ENV = {"NCCL_IB_DISABLE": None, "NCCL_NET": None, "NCCL_SOCKET_IFNAME": None, "NCCL_P2P_DISABLE": None,
             "NCCL_IB_GID_INDEX": None}


# -- a minimal JSON Schema check (the keywords docs/diagnose-report.schema.json uses) ------------------

_TYPES = {"object": dict, "array": list, "string": str, "null": type(None), "boolean": bool}


def _is(value, kind: str) -> bool:
    if kind == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "number":
        return isinstance(value, int | float) and not isinstance(value, bool)
    return isinstance(value, _TYPES[kind])


def check_schema(value, schema: dict, path: str = "$", root: dict = SCHEMA) -> None:
    if "$ref" in schema:
        target = root
        for part in schema["$ref"].removeprefix("#/").split("/"):
            target = target[part]
        return check_schema(value, target, path, root)
    if "const" in schema:
        assert value == schema["const"], path
    if "enum" in schema:
        assert value in schema["enum"], (path, value)
    if "type" in schema:
        kinds = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
        assert any(_is(value, kind) for kind in kinds), (path, value, kinds)
    if "pattern" in schema:
        assert re.search(schema["pattern"], value), (path, value)
    if "minimum" in schema:
        assert value >= schema["minimum"], (path, value)
    if isinstance(value, dict):
        missing = set(schema.get("required", ())) - value.keys()
        assert not missing, (path, missing)
        properties = schema.get("properties", {})
        extra = schema.get("additionalProperties", True)
        for key, item in value.items():
            if key in properties:
                check_schema(item, properties[key], f"{path}.{key}", root)
            else:
                assert extra is not False, (path, f"unexpected {key!r}")
                if isinstance(extra, dict):
                    check_schema(item, extra, f"{path}.{key}", root)
    if isinstance(value, list):
        assert len(value) >= schema.get("minItems", 0), path
        for index, item in enumerate(value):
            check_schema(item, schema.get("items", {}), f"{path}[{index}]", root)
    return None


def test_the_schema_check_rejects_what_the_schema_forbids():
    good = report.to_json(engine.run(facts([node(gpus=[gpu(0, xid_errors={"79": 1})])])))
    check_schema(good, SCHEMA)
    finding = good["findings"][0]
    for broken in ({**good, "extra": 1}, {**good, "summary": {**good["summary"], "critical": -1}},
                   {**good, "findings": [{k: v for k, v in finding.items() if k != "fix"}]},
                   {**good, "findings": [{**finding, "code": "XX1"}]},
                   {**good, "findings": [{**finding, "severity": "fatal"}]},
                   {**good, "findings": [{**finding, "evidence": []}]}):
        with pytest.raises(AssertionError):
            check_schema(broken, SCHEMA)


def test_json_report_of_many_findings_matches_the_schema():
    """One report with findings of many rules, their evidence values, NaN included, all in the schema."""
    ranks = [rank(r, tp=2, pp=2, dp=2, host=f"node-{r // 2}", micro_batches=1, precision="fp16",
                  env={"NCCL_IB_DISABLE": "1", "NCCL_SOCKET_IFNAME": "eth9"}, alloc_retries=2,
                  param_checksum=Sampled(float(r), step=10), grad_cosine=Sampled(1.0, step=10),
                  history=History(loss=[(1, math.nan)], host_rss_bytes=[(n, GIB * (1 + n / 10)) for n in range(30)]),
                  last=step(loss=math.nan, grad_norm=500.0, bubble_ratio=0.8, memory_kind="cuda",
                            reserved_bytes=79 * GIB, allocated_bytes=40 * GIB, peak_bytes=79 * GIB,
                            compute_seconds=0.9 if r == 3 else 0.3, dataloader_wait_seconds=0.3,
                            exposed_collective_seconds=0.01 if r == 3 else 0.5))
             for r in range(8)]
    down = [port("mlx5_0"), port("mlx5_1", "DOWN")]
    nodes = [node(f"node-{n}", nvlinks=[NvlinkFacts(0, 18, (3,), 1.0)], ib_ports=down,
                  gpus=[gpu(i, xid_errors={"48": 1}) for i in range(2)])
             for n in range(4)]
    result = engine.run(facts(nodes, ranks, sources=[SourceInfo("agent", "http://x")]))
    document = json.loads(json.dumps(report.to_json(result), allow_nan=False))
    check_schema(document, SCHEMA)
    codes = {f["code"] for f in document["findings"]}
    assert len(codes) >= 15 and "PERF002" in codes  # with the waiting ranks, a list among the evidence values
    assert any(isinstance(v, list) for f in document["findings"] for e in f["evidence"] for v in e["values"].values())
    assert document["summary"]["critical"] == sum(f["severity"] == "critical" for f in document["findings"])


# -- CLI --------------------------------------------------------------------------------------------


def invoke(*args: str, env: dict | None = None, **kwargs):
    return CliRunner().invoke(main, ["diagnose", *args], env={**CLEAN_ENV, **(env or {})}, **kwargs)


def test_list_rules_text_and_json():
    result = invoke("--list-rules")
    assert result.exit_code == 0
    rows = [line.split()[0] for line in result.output.splitlines()[1:]]
    assert rows == [r.code for r in engine.catalogue()] and rows == list(CATALOGUE)
    assert "PERF001  warning   performance     Pipeline bubble ratio high" in result.output
    listed = json.loads(invoke("--list-rules", "--format", "json", "--select", "HW").output)
    assert [r["code"] for r in listed] == [code for code in CATALOGUE if code.startswith("HW")]


def test_explain_shows_reasoning_thresholds_and_needs():
    result = invoke("--explain", "perf001")
    assert result.exit_code == 0
    assert result.output.startswith("PERF001: Pipeline bubble ratio high\nfamily: performance    severity: warning")
    assert "(p − 1)/(m + p − 1)" in result.output
    assert "max_bubble_ratio = 0.2  — GPipe (Huang et al. 2019)" in result.output
    assert "Needs: pipeline bubble or micro-batches" in result.output


def test_explain_unknown_code_exits_2_with_the_list():
    result = invoke("--explain", "PERF999")
    assert result.exit_code == 2
    assert "unknown rule 'PERF999'" in result.output and "NCCL001, NCCL002" in result.output
    assert "Traceback" not in result.output


def test_preflight_ib_disabled_on_fixture_ports_is_critical():
    args = ("--preflight", "--sysfs-root", str(IB_FIXTURE))
    result = invoke(*args, "--fail-on", "critical", env={"NCCL_IB_DISABLE": "1"})
    assert result.exit_code == 1, result.output
    assert "CRITICAL" in result.output and "NCCL001" in result.output
    for name in ("hfi1_0/1", "mlx4_0/1", "mlx4_0/2", "mlx5_0/1"):
        assert f"active port {name}" in result.output
    assert "NCCL_IB_DISABLE=1 in the environment of the pre-flight shell" in result.output
    assert "export NCCL_IB_DISABLE=0" in result.output
    assert invoke(*args, "--fail-on", "never", env={"NCCL_IB_DISABLE": "1"}).exit_code == 0
    healthy = invoke(*args, env={"NCCL_IB_DISABLE": "0"})
    assert healthy.exit_code == 0 and "NCCL001" not in healthy.output.split("Not run")[0]


def test_preflight_json_matches_schema_and_keeps_secrets_out():
    result = invoke("--preflight", "--sysfs-root", str(IB_FIXTURE), "--format", "json",
                    env={"NCCL_IB_DISABLE": "1", "NCCL_IB_TOKEN": "s3cret", "AWS_SECRET_ACCESS_KEY": "s3cret"})
    assert result.exit_code == 1
    document = json.loads(result.output)
    check_schema(document, SCHEMA)
    assert document["sources"][0]["kind"] == "preflight"
    (finding,) = [f for f in document["findings"] if f["code"] == "NCCL001"]
    assert finding["severity"] == "critical"
    assert [e["where"].get("port") for e in finding["evidence"][1:]] == ["hfi1_0/1", "mlx4_0/1", "mlx4_0/2", "mlx5_0/1"]
    assert "s3cret" not in result.output
    assert {item["code"] for item in document["not_run"]} >= {"HW001", "PERF002"}


@pytest.mark.parametrize(("level", "status"), [("critical", 0), ("warning", 1), ("info", 1), ("never", 0)])
def test_fail_on_levels(monkeypatch, level, status):
    """One warning-level finding (HW001: a down NVLink link): exit 1 from --fail-on warning down."""
    down_link = facts([node("sim", nvlinks=[NvlinkFacts(0, 18, (2,), 1.0)])])
    monkeypatch.setattr(diagnose_cli, "gather", lambda *args: down_link)
    result = invoke("--select", "HW001", "--fail-on", level)
    assert result.exit_code == status and "HW001" in result.output


def test_simulated_port_down_is_found_from_local_sysfs(tmp_path, monkeypatch):
    sysfs = SimulatedSysfs(PRESETS["dgx-h100"], tmp_path / "sys")
    sysfs.set_port_down("mlx5_3", phys_state="Polling")
    monkeypatch.setattr(sources_gather, "DEFAULT_AGENT_URL", f"http://127.0.0.1:{free_port()}")
    result = invoke("--sysfs-root", str(tmp_path / "sys"), "--format", "json")
    assert result.exit_code == 1, result.output
    document = json.loads(result.output)
    check_schema(document, SCHEMA)
    (finding,) = [f for f in document["findings"] if f["code"] == "HW003"]
    assert finding["title"].endswith("not ACTIVE: mlx5_3/1")
    assert finding["evidence"][0]["text"] == "mlx5_3/1 is DOWN (physical: Polling) while 7 peer port(s) are ACTIVE"
    assert any("no local agent" in note for note in document["notes"])
    sysfs.set_port_up("mlx5_3")
    assert invoke("--sysfs-root", str(tmp_path / "sys"), "--select", "HW").exit_code == 0


def test_text_report_is_grouped_by_severity_and_coloured_only_on_a_tty(monkeypatch):
    ranks = [rank(r, dp=4, last=step(compute_seconds=0.9 if r == 2 else 0.3, loss=math.nan)) for r in range(4)]
    monkeypatch.setattr(diagnose_cli, "gather", lambda *args: facts([node()], ranks))
    plain = invoke("--select", "PERF002,CONV001", "--fail-on", "never")
    assert plain.exit_code == 0 and "\x1b[" not in plain.output
    lines = plain.output.splitlines()
    assert lines[0] == "gpuwatch diagnose: 1 critical, 1 warning, 0 info"
    assert lines.index("CRITICAL") < lines.index("  CONV001  non-finite loss in job job-1 on 4 rank(s)") \
        < lines.index("WARNING")
    assert ("      evidence  rank 2 (node-a) is busy 0.9 s per step (median of 20 steps (81-100, 10 s)), 3.00x the "
            "median 0.3 s of its peers, in a 0.5 s step; the extra is in compute (forward and backward): 0.9 s "
            "against 0.3 s") in lines
    assert any(line.startswith("      fix       ") for line in lines)
    coloured = invoke("--select", "PERF002,CONV001", color=True)
    assert "\x1b[31m" in coloured.output and coloured.exit_code == 1


def test_usage_and_config_errors_exit_2(tmp_path):
    assert invoke("--select", "BOGUS").exit_code == 2
    config = tmp_path / "c.yaml"
    config.write_text("thresholds: {PERF002: {nope: 1}}\n")
    result = invoke("--config", str(config), "--list-rules")
    assert result.exit_code == 2 and "has no threshold 'nope'" in result.output
    assert invoke("--format", "xml").exit_code == 2


@pytest.fixture
def http_stub():
    """A local HTTP server answering every GET with the body set on it: stands in for wrong endpoints."""
    class Handler(http.server.BaseHTTPRequestHandler):
        body = b""

        def do_GET(self):
            self.send_response(200)
            self.end_headers()
            self.wfile.write(Handler.body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    server.url = f"http://127.0.0.1:{server.server_address[1]}"
    server.handler = Handler
    yield server
    server.shutdown()
    server.server_close()


@pytest.mark.parametrize(("flag", "body", "message"), [
    ("--agent", b"<html>node_exporter</html>", "did not return JSON: is it a gpuwatch agent?"),
    ("--agent", b'{"status": "success", "data": {}}', "is not a gpuwatch agent's state"),
    ("--prometheus", b'{"agent": {}}', "is not a Prometheus HTTP API"),
    ("--prometheus", b'{"status": "success", "data": {"resultType": "vector", "result": []}}',
     "has no gpuwatch_agent_info series"),
    ("--prometheus", b'{"status": "error", "errorType": "bad_data", "error": "parse error"}', "parse error"),
])
def test_wrong_endpoints_exit_2_with_a_message(http_stub, flag, body, message):
    http_stub.handler.body = body
    result = invoke(flag, http_stub.url)
    assert result.exit_code == 2, result.output
    assert message in result.output and "Traceback" not in result.output


def test_unreachable_sources_exit_2(tmp_path):
    port = free_port()
    for flag in ("--agent", "--prometheus"):
        result = invoke(flag, f"http://127.0.0.1:{port}")
        assert result.exit_code == 2 and f"cannot reach http://127.0.0.1:{port}" in result.output
    result = invoke("--agent", "ftp://example")
    assert result.exit_code == 2 and "not an http:// or https:// URL" in result.output
    result = invoke("--run-log", str(tmp_path / "absent.jsonl"))
    assert result.exit_code == 2 and "cannot read run log" in result.output
    junk = tmp_path / "junk.jsonl"
    junk.write_text('{"v": 1, "kind": "step"}\nnot json\n')
    result = invoke("--run-log", str(junk))
    assert result.exit_code == 2 and "no valid telemetry record (2 bad line(s), first:" in result.output
    assert "junk.jsonl:1: missing_field: job" in result.output
