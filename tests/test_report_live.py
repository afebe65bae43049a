"""`gpuwatch report` from the live sources, with no stand-ins: a real agent (`gpuwatch agent --simulate`) receives a
straggling job's telemetry through the real TelemetryClient, and the page is made from the agent (`--agent URL`) and
from a real Prometheus scraping it (`--prometheus URL --job J`). The timings are injected into the step records, so
the straggler does not depend on the machine's speed. Each page holds every rank in layout order, the engine's
straggler finding (the only one) linked to the slow rank, that rank's row busiest in the heatmap of window medians,
and says plainly that a live source keeps no per-step history (the curves and the waits per process group need a run
log); the Prometheus page also says it has no collective latency buckets, which the agent's page draws. The trace from
a live source names each rank and holds no slice. The run-log source: tests/test_report.py.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from telemetry_records import hello, step
from test_diagnose_every_rule_at_scale import BASE_HELLO, BASE_STEP, _count, _send
from test_report import model, write

from gpuwatch.agent.telemetry.window import MIN_WINDOW_STEPS
from gpuwatch.report.model import PHASES

from conftest import AgentProcess, wait_until

pytestmark = pytest.mark.integration

JOB = "live-straggler"
NODE = "node-1"
RANKS = 8  # telemetry_records' layout: tp2 × pp2 × dp2, rank = tp + 2 dp + 4 pp
STEPS = MIN_WINDOW_STEPS + 1  # a full window
STRAGGLER = 5  # dp0 pp1 tp1
#: Every rank's step lasts as long as the straggler's (the others wait for it); its compute takes 5x the others'.
STEP_SECONDS, COMPUTE_SECONDS, STRAGGLER_COMPUTE_SECONDS = 2.0, 0.3, 1.5
#: The ranks in layout order (dp, pp, tp).
LAYOUT_ORDER = sorted(range(RANKS), key=lambda rank: (rank // 2 % 2, rank // 4, rank % 2))
#: What the page says a live source cannot give (report/model.py ``missing``).
NO_HISTORY = ("no per-step history: the source keeps only each rank's window (a run log has every step); the heatmap "
              "and phases show window medians, the curves and the waits per process group are left out")
NO_BUCKETS = ("no collective latency buckets: the source gives each op's calls and time, not their histogram (an agent "
              "or a run log has it); the skew per op is shown")


@pytest.fixture
def agent(start_agent) -> Iterator[AgentProcess]:
    """An agent that has every rank's hello and full window of the straggling job."""
    agent = start_agent("--simulate", "dgx-h100", "--node", NODE, "--interval", "1", "--telemetry.ttl", "600")
    uuids = [gpu["uuid"] for gpu in agent.state()["facts"]["nvml"]["gpus"]]
    records = [hello(rank, JOB, **BASE_HELLO, hostname=NODE, local_rank=rank, gpu={"index": rank, "uuid": uuids[rank]})
               for rank in range(RANKS)]
    records += [step(rank, number, JOB, **BASE_STEP, step_seconds=STEP_SECONDS,
                     compute_seconds=STRAGGLER_COMPUTE_SECONDS if rank == STRAGGLER else COMPUTE_SECONDS)
                for number in range(1, STEPS + 1) for rank in range(RANKS)]
    _send({NODE: agent}, {NODE: records})
    wait_until(lambda: sorted((r["rank"], r["last_step"]["step"]) for r in agent.state()["facts"]["telemetry"]["ranks"]
                              if r["last_step"]) == [(rank, STEPS) for rank in range(RANKS)],
               timeout=30, what=f"{RANKS} ranks at step {STEPS} in the agent's state")
    yield agent


def _assert_live_page(page: Path, source: str) -> dict:
    """The structure both live sources give: ranks, the straggler linked, window medians, what is missing."""
    data = model(page)
    assert data["job"] == JOB and data["sources"] and data["sources"][0].startswith(source)
    assert [r["rank"] for r in data["ranks"]] == LAYOUT_ORDER
    assert [(r["dp"], r["pp"], r["tp"]) for r in data["ranks"]] == sorted(
        (rank // 2 % 2, rank // 4, rank % 2) for rank in range(RANKS))
    assert {r["node"] for r in data["ranks"]} == {NODE}
    (straggler,) = data["findings"]  # the planted fault and nothing else: every other record is healthy
    assert straggler["code"] == "PERF002" and straggler["severity"] == "warning"
    assert straggler["view"] == "heatmap" and straggler["ranks"] == [STRAGGLER]
    assert NO_HISTORY in data["missing"]  # said plainly: the per-step curves need a run log
    assert data["curves"] == []
    heat = data["heatmap"]  # one column: each rank's window median
    assert heat["of"] == "window medians" and heat["bin"] == 1 and len(heat["busy_seconds"]) == RANKS
    assert all(len(row) == 1 for row in heat["busy_seconds"])
    busiest = max(range(RANKS), key=lambda i: heat["busy_seconds"][i][0])
    assert data["ranks"][busiest]["rank"] == STRAGGLER
    assert data["phases"]["phases"] == [name for name, _ in PHASES]
    compute = data["phases"]["values"][[name for name, _ in PHASES].index("compute")]
    assert compute[LAYOUT_ORDER.index(STRAGGLER)] == pytest.approx(STRAGGLER_COMPUTE_SECONDS)
    assert all(c == pytest.approx(COMPUTE_SECONDS) for i, c in enumerate(compute) if i != LAYOUT_ORDER.index(STRAGGLER))
    assert data["hang"] is None
    assert data["groups"] == []  # the waits per process group are step records': said in NO_HISTORY
    ops = {op["op"]: op for op in data["collectives"]}
    assert set(ops) == {"all_reduce"} and ops["all_reduce"]["skew"] == pytest.approx(1.0)
    return data


def test_a_report_from_an_agent_shows_every_rank_and_links_the_straggler(agent, tmp_path):
    page, trace_path = tmp_path / "agent.html", tmp_path / "trace.json"
    assert write("--agent", agent.url, "--trace", str(trace_path), output=page) == (0, f"{page}\n{trace_path}\n")
    data = _assert_live_page(page, "agent ")
    (calls,) = [op["buckets"] for op in data["collectives"]]  # the agent keeps each op's latency histogram
    assert sum(calls) == 2 * STEPS * RANKS and NO_BUCKETS not in data["missing"]
    # the trace of a live source: a process per rank, named by its layout, and no slice (no step history)
    events = json.loads(trace_path.read_text())["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert sorted(names) == list(range(RANKS)) and names[STRAGGLER] == "rank 5 (dp 0, pp 1, tp 1)"
    assert {e["ph"] for e in events} == {"M"}


def test_a_report_from_prometheus_scraping_the_agent_shows_the_same(agent, prometheus_server, tmp_path):
    server = prometheus_server([f"127.0.0.1:{agent.port}"], honor_labels=True)  # the job label is the training job's
    for what, expr in (("every rank", f"count(gpuwatch_train_rank_info{{job='{JOB}'}})"),
                       ("every rank's full window",
                        f"count(gpuwatch_train_window_steps{{job='{JOB}'}} >= {MIN_WINDOW_STEPS})")):
        wait_until(lambda expr=expr: _count(server.url, expr) == RANKS, timeout=60, interval=0.5,
                   what=f"{what} in Prometheus ({expr} == {RANKS})")
    page = tmp_path / "prometheus.html"
    assert write("--prometheus", server.url, "--job", JOB, output=page) == (0, f"{page}\n")
    data = _assert_live_page(page, "prometheus ")
    assert NO_BUCKETS in data["missing"]  # the fetch reads each op's count and sum: said, not drawn empty
