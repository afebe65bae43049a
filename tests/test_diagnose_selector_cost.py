"""No outlier selector's cost grows faster than what it reads (issue 47), counted by the engine, never timed.

The cluster of ``benchmarks/cluster_diagnosis.py`` (one real agent's exposition replicated per node, the same plan and
planted faults) at 32 and 128 nodes, backfilled with promtool and served by a real Prometheus that evaluates the
shipped rule file. Each selector the outlier fetch asks (``outliers.served``: every rule's, including rules added
later) is run with ``stats=all``, and the engine's samples touched compared between the two sizes:

* a node selector reads at most one series per node (a recorded per-node maximum it compares with its threshold; a
  sparse recorded signal holds only the nodes with something wrong), so it may touch at most one more sample per
  node added (96 from 32 to 128 nodes): linear in the nodes, and flat for a selector that looks at outliers only;
* a job selector reads a few series per job (recorded per job or per shard, or series only overdue or failed ranks
  export), so with one job at both sizes it may touch no more samples at 128 nodes than at 32.

A selector that scans every rank's series (8 a node) or every collector's (5 a node) fails here: the whole-job hello
selector over each rank's hello and step, and ``gpuwatch_collector_up != 1``, did before their recording rules.

The template's ranks run one pipeline stage and export no bubble ratio; the test adds one per rank (as a pipelined
job's ranks export it, below the rule's threshold), so that the bubble selector has a family to read.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import cluster_diagnosis  # noqa: E402

from gpuwatch.diagnosis.coverage import JOB, Selector  # noqa: E402
from gpuwatch.diagnosis.registry import REGISTRY  # noqa: E402
from gpuwatch.diagnosis.sources import outliers, prometheus  # noqa: E402

from conftest import COLLECTOR_TIMEOUT, require_tool  # noqa: E402

pytestmark = pytest.mark.integration

SIZES = (32, 128)
BUBBLE = "gpuwatch_train_window_bubble_ratio"


@pytest.fixture
def template(tmp_path, monkeypatch) -> list[cluster_diagnosis.Series]:
    """The benchmark's per-node template (its agent with the tests' generous collector deadline, as in
    test_benchmarks.py), with a bubble ratio per rank."""
    process = cluster_diagnosis._process

    def with_generous_deadline(command, *args, **kwargs):
        agent = command[1:4] == ["-m", "gpuwatch.cli.main", "agent"]
        return process([*command, *COLLECTOR_TIMEOUT] if agent else command, *args, **kwargs)

    monkeypatch.setattr(cluster_diagnosis, "_process", with_generous_deadline)
    series = cluster_diagnosis.capture_template(tmp_path)
    steps = [entry for entry in series if entry.name == "gpuwatch_train_window_steps"]
    assert steps and not any(entry.name == BUBBLE for entry in series)
    threshold = REGISTRY["PERF001"].params(None).max_bubble_ratio
    return series + [cluster_diagnosis.Series(BUBBLE, entry.labels, threshold / 4) for entry in steps]


def samples_touched(template: list[cluster_diagnosis.Series], nodes: int, workdir: Path) -> dict[Selector, int]:
    """Each selector's samples touched over the benchmark's cluster of ``nodes``, recording rules loaded."""
    workdir.mkdir()
    tsdb, *_ = cluster_diagnosis.backfill(template, cluster_diagnosis.Plan(nodes), workdir)
    with cluster_diagnosis.serve(tsdb, workdir, evaluation_interval="2s") as url:
        api = prometheus.Api(url)
        yardsticks = outliers._yardsticks(api)
        assert yardsticks[outliers.SENTINEL] == outliers.SENTINEL, "the recording rules are not in use"
        thresholds = outliers._thresholds({})
        return {selector: cluster_diagnosis.engine_cost(url, outliers.selector_query(selector, thresholds,
                                                                                      yardsticks)).samples
                for selector in outliers.served(REGISTRY).selectors}


def test_no_selector_touches_more_samples_than_one_per_node_or_more_as_the_cluster_grows_with_its_jobs(
        template, tmp_path):
    require_tool("promtool")
    require_tool("prometheus")
    small, large = (samples_touched(template, nodes, tmp_path / str(nodes)) for nodes in SIZES)
    added = SIZES[1] - SIZES[0]
    too_costly = []
    for selector, before in small.items():
        after = large[selector]
        allowed = before if selector.by == JOB else before + added
        if after > allowed:
            too_costly.append(f"{selector.what} (by {selector.by}): {before} samples at {SIZES[0]} nodes, {after} at "
                              f"{SIZES[1]}, at most {allowed}")
    assert not too_costly, "selectors whose cost grows faster than what they may read:\n" + "\n".join(too_costly)
