"""`gpuwatch report` without a browser: the page's model from real run logs with planted faults (the findings are
the engine's, linked to their view, ranks and steps), the Perfetto trace held to the Trace Event Format, the plan's
overlay, and bad input (an empty directory, a run log without steps, a truncated one, an unknown job, a plan that is
not one) as one line or a page that says what is missing. The browser's side: tests/test_report_browser.py."""

from __future__ import annotations

import itertools
import json
import re
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner
from report_runs import (  # the session's run logs are conftest's fixtures
    STEPS,
    STRAGGLER,
)

from gpuwatch.cli.plan import plan
from gpuwatch.diagnosis.facts import ProgressFacts, RankFacts
from gpuwatch.report import model as report_model
from gpuwatch.report.cli import report
from gpuwatch.report.model import PHASES, FindingView

pytestmark = pytest.mark.integration

DATA = re.compile(r'<script type="application/json" id="report-data">(.*?)</script>', re.S)


def write(*args: str, output: Path) -> tuple[int, str]:
    result = CliRunner().invoke(report, [*args, "-o", str(output)])
    return result.exit_code, result.output


def model(page: Path) -> dict:
    return json.loads(DATA.search(page.read_text()).group(1).replace("<\\/", "</"))


def test_the_page_needs_no_network_and_shows_the_straggler_first(straggler_log, tmp_path):
    page = tmp_path / "report.html"
    assert write("--run-log", str(straggler_log), output=page) == (0, f"{page}\n")
    text = page.read_text()
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", text)  # nothing fetched: all inline
    assert "uPlot" in text and "MIT" in text
    data = model(page)
    # ranks by layout coordinates: dp, then pp, then tp (tp1 × pp2 × dp2: rank = pp * 2 + dp)
    assert [(r["dp"], r["pp"], r["tp"]) for r in data["ranks"]] == [(0, 0, 0), (0, 1, 0), (1, 0, 0), (1, 1, 0)]
    assert [r["rank"] for r in data["ranks"]] == [0, 2, 1, 3]
    (straggler,) = [f for f in data["findings"] if f["code"] == "PERF002"]
    assert straggler["view"] == "heatmap" and straggler["ranks"] == [STRAGGLER]
    assert data["findings"][0]["severity"] in {"critical", "warning"}  # findings worst first, as diagnose orders
    heat = data["heatmap"]
    assert heat["of"] == "steps" and heat["bin"] == 1 and heat["steps"] == list(range(1, STEPS + 1))
    busiest = max(range(4), key=lambda i: sorted(heat["busy_seconds"][i])[STEPS // 2])
    assert data["ranks"][busiest]["rank"] == STRAGGLER
    assert data["phases"]["phases"] == [name for name, _ in PHASES]
    assert {c["name"] for c in data["curves"]} >= {"step time", "loss", "gradient norm", "learning rate",
                                                   "gradient cosine similarity"}
    assert {op["op"] for op in data["collectives"]} >= {"all_reduce", "send", "recv"}
    groups = {group["group"]: group for group in data["groups"]}
    assert set(groups) >= {"dp", "pp"}
    waited = dict(zip([r["rank"] for r in data["ranks"]], groups["dp"]["rank_median_seconds"], strict=True))
    assert waited[STRAGGLER + 1] > waited[STRAGGLER]  # its DP partner waits for the straggler, which does not
    assert data["hang"] is None  # every rank closed: its last progress record is no stall
    # measurements to 4 significant digits, the generation time whole (4 digits of it would be days off)
    measured = [v for row in heat["busy_seconds"] for v in row if v is not None]
    assert measured and all(v == float(f"{v:.4g}") for v in measured)
    assert data["generated_at"] != float(f"{data['generated_at']:.4g}")
    assert abs(data["generated_at"] - page.stat().st_mtime) < 60


def test_the_trace_is_trace_event_format_one_process_per_rank_one_track_per_phase(straggler_log, tmp_path):
    """Perfetto's trace processor cannot run here offline (the `perfetto` package downloads its binary when first
    used), so the file is held to the Trace Event Format's rules: the JSON object form, metadata naming processes and
    threads, complete ("X") events with µs timestamps and durations."""
    trace_path = tmp_path / "trace.json"
    assert write("--run-log", str(straggler_log), "--trace", str(trace_path), output=tmp_path / "r.html")[0] == 0
    trace = json.loads(trace_path.read_text())
    assert trace["displayTimeUnit"] == "ms"
    events = trace["traceEvents"]
    assert {event["ph"] for event in events} == {"M", "X"}
    processes = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert sorted(processes) == [0, 1, 2, 3] and processes[2] == "rank 2 (dp 0, pp 1, tp 0)"
    for pid in processes:
        threads = {e["tid"]: e["args"]["name"] for e in events
                   if e["ph"] == "M" and e["name"] == "thread_name" and e["pid"] == pid}
        assert [threads[tid] for tid in sorted(threads)][:len(PHASES)] == [name for name, _ in PHASES]
        assert {name for name in threads.values() if name.startswith("collective ")} >= {"collective all_reduce"}
        slices = [e for e in events if e["ph"] == "X" and e["pid"] == pid]
        assert {e["args"]["step"] for e in slices} == set(range(1, STEPS + 1))
        for event in slices:
            assert isinstance(event["ts"], float | int) and event["dur"] >= 0 and event["tid"] in threads
        for step in range(1, STEPS + 1):  # a step's phases are laid end to end: none overlaps the next
            phases = sorted((e for e in slices if e["args"]["step"] == step and e["tid"] <= len(PHASES)),
                            key=lambda e: e["ts"])
            assert all(a["ts"] + a["dur"] <= b["ts"] + 1 for a, b in itertools.pairwise(phases))


def test_the_bubble_is_measured_per_stage_against_the_schedule(bubble_log, tmp_path):
    page = tmp_path / "bubble.html"
    assert write("--run-log", str(bubble_log), output=page)[0] == 0
    data = model(page)
    bubble = data["bubble"]
    assert bubble["stages"] == [0, 1, 2, 3]
    assert bubble["theoretical"] == [0.75] * 4  # (p - 1) / (m + p - 1) with one micro-batch
    assert all(measured > 0.5 for measured in bubble["measured"])
    (finding,) = [f for f in data["findings"] if f["code"] == "PERF001"]
    assert finding["view"] == "bubble"


def test_a_hang_shows_the_rank_the_collective_and_who_waits_for_it(hang_log, tmp_path):
    page = tmp_path / "hang.html"
    assert write("--run-log", str(hang_log), output=page)[0] == 0
    hang = model(page)["hang"]
    assert hang["culprits"] == [3]
    first, *waiting = hang["waits"]
    assert first["rank"] == 3 and first["stack_top"].endswith("_hang_before_all_reduce")
    peer = next(wait for wait in waiting if wait["group"] == "dp")  # rank 2: stage 1, dp group [2, 3]
    assert (peer["rank"], peer["op"], peer["waits_for"]) == (2, "all_reduce", [3])


def test_a_closed_rank_a_finding_names_has_its_row_in_the_hang():
    """A rank stuck as it exits (HANG007) closed its hooks: its row shows it, where a closed rank is otherwise no
    stall, and a job whose ranks all closed and that no finding names has no hang section."""
    closed = ProgressFacts(step=20, phase="closed", stalled_seconds=0, overdue_seconds=0)
    ranks = [RankFacts(job="j", rank=rank, progress=closed) for rank in (0, 1)]
    named = FindingView("HANG007", "warning", "rank 1 ended training but did not exit", (), "", "", "hang", (1,), ())
    hang = report_model.hang(ranks, [named])
    assert hang is not None and hang.culprits == (1,)
    assert [(wait.rank, wait.step, wait.phase) for wait in hang.waits] == [(1, 20, "closed")]
    assert report_model.hang(ranks, []) is None


def test_the_plans_prediction_for_the_jobs_layout_is_overlaid(straggler_log, tmp_path):
    planned = CliRunner().invoke(plan, ["--reference", "--gpus", "4", "--gpus-per-node", "4", "--gpu", "h100-80gb",
                                        "--global-batch", "16", "--seq-len", "64", "--format", "json", "--top", "100"])
    assert planned.exit_code == 0, planned.output
    (tmp_path / "plan.json").write_text(planned.output)
    page = tmp_path / "r.html"
    assert write("--run-log", str(straggler_log), "--plan", str(tmp_path / "plan.json"), output=page)[0] == 0
    data = model(page)
    entry = next(e for e in json.loads(planned.output)["feasible"]
                 if (e["layout"]["tp"], e["layout"]["pp"], e["layout"]["dp"], e["layout"]["micro_batches"],
                     e["layout"]["schedule"]) == (1, 2, 2, 8, "1f1b"))
    assert data["plan"]["matched"] and data["plan"]["layout"] == "tp1 pp2 dp2 m8 1f1b"
    step_time = next(c for c in data["curves"] if c["name"] == "step time")
    assert step_time["planned"] == pytest.approx(entry["step_seconds"], rel=1e-3)
    assert data["bubble"]["planned"] == pytest.approx(entry["bubble"], rel=1e-3)


def _copy(log: Path, into: Path, keep) -> Path:
    into.mkdir()
    for path in log.glob("rank-*.jsonl"):
        (into / path.name).write_text("".join(line for line in path.read_text().splitlines(True) if keep(line)))
    return into


def test_a_run_log_without_steps_gets_a_page_that_says_so(straggler_log, tmp_path):
    hellos = _copy(straggler_log, tmp_path / "hellos", lambda line: '"kind":"hello"' in line)
    page = tmp_path / "r.html"
    assert write("--run-log", str(hellos), output=page)[0] == 0
    data = model(page)
    assert any("reported no step" in line for line in data["missing"])
    assert data["heatmap"] is None and data["curves"] == []
    assert "HANG005" in {f["code"] for f in data["findings"]}  # the engine's word: hellos and no step


def test_a_truncated_run_log_is_shown_with_the_cut_line_named(straggler_log, tmp_path):
    cut = tmp_path / "cut"
    shutil.copytree(straggler_log, cut)
    last = cut / "rank-00003.jsonl"
    last.write_bytes(last.read_bytes()[:-200])  # the last record cut short, as a killed writer leaves it
    page = tmp_path / "r.html"
    assert write("--run-log", str(cut), output=page)[0] == 0
    assert any("rank-00003.jsonl" in note for note in model(page)["notes"])


@pytest.mark.parametrize(("args", "message"), [
    (("--job", "nope"), "unknown job 'nope'; the source holds: straggler"),
    ((), None),
])
def test_bad_input_is_one_line_and_status_2(straggler_log, tmp_path, args, message):
    empty = tmp_path / "empty"
    empty.mkdir()
    source = ("--run-log", str(straggler_log)) if args else ("--run-log", str(empty))
    code, output = write(*source, *args, output=tmp_path / "r.html")
    assert code == 2 and len(output.strip().splitlines()) == 1 and output.startswith("gpuwatch report: error: ")
    assert message in output if message else "holds no *.jsonl file" in output
    assert not (tmp_path / "r.html").exists()


def test_a_plan_that_is_not_gpuwatch_plan_json_is_refused(straggler_log, tmp_path):
    (tmp_path / "plan.json").write_text('{"schema": "other"}')
    code, output = write("--run-log", str(straggler_log), "--plan", str(tmp_path / "plan.json"),
                         output=tmp_path / "r.html")
    assert code == 2 and output.strip() == (f"gpuwatch report: error: {tmp_path / 'plan.json'} is not `gpuwatch plan "
                                            "--format json` output (schema gpuwatch.plan/1)")


def test_no_source_is_a_usage_error(tmp_path):
    code, output = write(output=tmp_path / "r.html")
    assert code == 2 and "give a source" in output
