"""Every diagnosis rule on Facts built in the test: one that fires (with the right evidence), one just on the
other side of its threshold that stays silent, one with the needed facts missing (silent, reported not run)."""

from __future__ import annotations

import dataclasses
import math
import statistics

import hypothesis
import pytest
from diagnose_facts import GIB, NDR, facts, gpu, node, port, rank, step, window
from hypothesis import strategies as st

from gpuwatch.diagnosis import engine
from gpuwatch.diagnosis.facts import (
    BandwidthMeasurement,
    CollectiveFacts,
    CounterSample,
    Facts,
    History,
    InterfaceFacts,
    NvlinkFacts,
    Peers,
    RankFacts,
    Sampled,
    SourceInfo,
    StepFacts,
    medians_of_others,
)
from gpuwatch.diagnosis.registry import Severity
from gpuwatch.protocol.records import GroupTotals
from gpuwatch.protocol.schema import STEP_PHASES


def run(code: str, f: Facts, overrides=None) -> engine.Report:
    return engine.run(f, engine.select([code]), overrides)


def fired(code: str, f: Facts, overrides=None) -> list:
    result = run(code, f, overrides)
    assert code in result.ran, result.skipped
    assert {finding.code for finding in result.findings} <= {code}
    assert result.findings, f"{code} did not fire"
    return result.findings


def silent(code: str, f: Facts) -> None:
    result = run(code, f)
    assert code in result.ran, result.skipped
    assert result.findings == [], [x.title for x in result.findings]


def not_run(code: str, f: Facts, reason: str) -> None:
    result = run(code, f)
    assert result.findings == [] and result.ran == []
    assert [s.code for s in result.skipped] == [code]
    assert reason in result.skipped[0].reason, result.skipped[0].reason


def texts(findings) -> str:
    return "\n".join([f.title for f in findings] + [e.text for f in findings for e in f.evidence]
                     + [f.fix for f in findings])


# -- network config ---------------------------------------------------------------------------------


def _two_nodes(env: dict, ranks: int = 4, **fields) -> list[RankFacts]:
    """A job whose ranks are split over node-a and node-b."""
    return [rank(r, dp=ranks, host="node-a" if r < ranks // 2 else "node-b", env=env, **fields) for r in range(ranks)]


def test_nccl001_one_finding_per_job_naming_the_active_ports_of_each_node():
    ports = [port("mlx5_0"), port("mlx5_1"), port("mlx5_2", state="DOWN")]
    nodes = [node("node-a", ib_ports=ports), node("node-b", ib_ports=ports[:1])]
    (finding,) = fired("NCCL001", facts(nodes, _two_nodes({"NCCL_IB_DISABLE": "1"})))
    assert finding.severity is Severity.CRITICAL
    assert finding.title == ("NCCL_IB_DISABLE=1 while 3 InfiniBand/RoCE port(s) are active on node-a, node-b: "
                             "node-a: mlx5_0/1, mlx5_1/1; node-b: mlx5_0/1")
    assert "mlx5_2" not in texts([finding])
    assert {(e.where.node, e.where.port) for e in finding.evidence[1:]} == {
        ("node-a", "mlx5_0/1"), ("node-a", "mlx5_1/1"), ("node-b", "mlx5_0/1")}
    assert "ranks 0-3 of job job-1 on node-a, node-b" in finding.evidence[0].text
    assert "NCCL_IB_DISABLE=0" in finding.fix


def test_nccl001_preflight_shell_and_nccl_net_socket():
    shell = node(env={"NCCL_NET": "Socket"})
    (finding,) = fired("NCCL001", facts([shell]))
    assert "pre-flight shell on node-a" in finding.evidence[0].text


def test_nccl001_premises_a_job_on_one_node_or_without_nccl_is_not_judged():
    """Inside one node NCCL never uses InfiniBand, and a gloo job never reads NCCL's variables: the rule does not
    run, and says why. A pre-flight shell is still judged: before launch nothing is known of the job."""
    one_node = [rank(r, dp=2, env={"NCCL_IB_DISABLE": "1"}, backends={"default": "nccl"}) for r in range(2)]
    not_run("NCCL001", facts([node()], one_node), "job job-1 runs on one node (node-a)")
    gloo = _two_nodes({"NCCL_IB_DISABLE": "1"}, backends={"default": "gloo", "dp": "gloo"})
    not_run("NCCL001", facts([node("node-a"), node("node-b")], gloo), "job job-1 uses gloo, not NCCL")
    assert len(fired("NCCL001", facts([node(env={"NCCL_IB_DISABLE": "1"})], gloo))) == 1  # the pre-flight shell's


def test_nccl001_silent_when_ib_enabled_or_no_port_active():
    silent("NCCL001", facts([node("node-a"), node("node-b")], _two_nodes({"NCCL_IB_DISABLE": "0"})))
    down = [port("mlx5_0", state="DOWN")]
    silent("NCCL001", facts([node("node-a", ib_ports=down), node("node-b", ib_ports=down)],
                            _two_nodes({"NCCL_IB_DISABLE": "1"})))


def test_nccl001_not_run_without_port_facts():
    bare = node(ib_ports=None, missing={"ib_ports": "infiniband collector down: EACCES"})
    not_run("NCCL001", facts([bare], _two_nodes({"NCCL_IB_DISABLE": "1"})), "infiniband collector down: EACCES")


def test_nccl002_roce_ports_without_gid_index():
    roce = [port("mlx5_0", link_layer="Ethernet", rate=100e9 / 8), port("mlx5_1", link_layer="Ethernet")]
    both = [node("node-a", ib_ports=roce), node("node-b", ib_ports=roce)]
    (finding,) = fired("NCCL002", facts(both, _two_nodes({"NCCL_DEBUG": "WARN"})))
    assert finding.title == "4 RoCE port(s) on node-a, node-b but NCCL_IB_GID_INDEX is not set"
    assert "NCCL_IB_GID_INDEX=3" in finding.fix and "mlx5_0/1" in texts([finding])
    silent("NCCL002", facts(both, _two_nodes({"NCCL_IB_GID_INDEX": "3"})))
    silent("NCCL002", facts([node("node-a"), node("node-b")], _two_nodes({})))  # InfiniBand, not RoCE
    # A whole job on one RoCE node: NCCL uses no RoCE port inside a node.
    not_run("NCCL002", facts([node(ib_ports=roce)], [rank(r, dp=2, env={}) for r in range(2)]), "runs on one node")


def test_nccl002_not_run_without_environment():
    not_run("NCCL002", facts([node()], [rank(0, env=None)]), "no NCCL environment")


@pytest.mark.parametrize(("spec", "problem"), [
    ("eth9", "no interface of that name exists"),
    ("eth1", "eth1 is down"),
    ("docker0", "only reaches this host"),
    ("=lo", "only reaches this host"),
    ("^eth,docker", "excludes every interface"),
])
def test_nccl003_unusable_socket_interface(spec, problem):
    (finding,) = fired("NCCL003", facts([node()], [rank(0, dp=2, env={"NCCL_SOCKET_IFNAME": spec})]))
    assert problem in finding.title
    assert finding.fix.startswith("export NCCL_SOCKET_IFNAME=eth0")


def test_nccl003_silent_on_a_usable_interface_or_loopback_for_a_one_node_job():
    silent("NCCL003", facts([node()], [rank(0, dp=2, env={"NCCL_SOCKET_IFNAME": "eth"})]))
    silent("NCCL003", facts([node()], [rank(0, dp=2, env={"NCCL_SOCKET_IFNAME": "^docker,lo"})]))
    # Every rank of the job is known and on node-a: loopback is fine.
    silent("NCCL003", facts([node()], [rank(r, dp=2, env={"NCCL_SOCKET_IFNAME": "lo"}) for r in range(2)]))


def test_nccl003_not_run_without_interfaces():
    not_run("NCCL003", facts([node(interfaces=None, missing={"interfaces": "network interfaces are not exported"})],
                             [rank(0, env={"NCCL_SOCKET_IFNAME": "eth9"})]), "network interfaces are not exported")


def test_nccl004_p2p_disabled_on_nvlink_node():
    (finding,) = fired("NCCL004", facts([node()], [rank(0, env={"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1"})]))
    assert "NCCL_P2P_DISABLE=1 and NCCL_SHM_DISABLE=1" in finding.title
    assert "8 GPU(s) on node-a with 144 NVLink links up" in texts([finding])


def test_nccl004_silent_for_shm_alone_or_without_nvlink():
    silent("NCCL004", facts([node()], [rank(0, env={"NCCL_SHM_DISABLE": "1", "NCCL_P2P_DISABLE": "0"})]))
    silent("NCCL004", facts([node(nvlinks=[])], [rank(0, env={"NCCL_P2P_DISABLE": "1"})]))


def test_nccl004_not_run_without_nvlink_facts():
    not_run("NCCL004", facts([node(nvlinks=None)], [rank(0, env={"NCCL_P2P_DISABLE": "1"})]), "NVLink facts unknown")


def _all_reduce(p50: float, p99: float, count: int = 200) -> dict:
    return {"all_reduce": CollectiveFacts("all_reduce", count, p50 * count, 1 << 30, p50, p99)}


def test_nccl005_heavy_tail_on_a_multi_node_job():
    ranks = [rank(0, dp=2, host="node-a", collectives=_all_reduce(0.083, 0.142)),
             rank(1, dp=2, host="node-b", collectives=_all_reduce(0.085, 0.160)),
             rank(2, dp=2, host="node-b", env={"NCCL_ALGO": "Tree"}, collectives=_all_reduce(0.031, 0.045))]
    (finding,) = fired("NCCL005", facts([node("node-a"), node("node-b")], ranks))
    assert "rank 0: all-reduce p50 83.00 ms, p99 142.00 ms (1.7x)" in texts([finding])
    assert "rank 2" not in texts([finding]) and "NCCL_ALGO=Tree" in finding.fix


def test_nccl005_leaves_a_tail_on_some_ranks_only_to_the_peer_they_waited_for():
    """Rank 1 came late to some calls (its checkpoint): rank 0's all-reduces waited for it, rank 1's did not."""
    ranks = [rank(0, dp=2, host="node-a", collectives=_all_reduce(0.083, 0.500)),
             rank(1, dp=2, host="node-b", collectives=_all_reduce(0.083, 0.090))]
    silent("NCCL005", facts([node("node-a"), node("node-b")], ranks))


def test_nccl005_silent_below_ratio_with_tree_or_on_one_node():
    two_nodes = [node("node-a"), node("node-b")]
    silent("NCCL005", facts(two_nodes, [rank(0, dp=2, host="node-a", collectives=_all_reduce(0.1, 0.169)),
                                        rank(1, dp=2, host="node-b", collectives=_all_reduce(0.1, 0.1))]))
    silent("NCCL005", facts(two_nodes, [rank(0, dp=2, host="node-a", env={"NCCL_ALGO": "Tree"},
                                             collectives=_all_reduce(0.1, 0.5)), rank(1, dp=2, host="node-b")]))
    not_run("NCCL005", facts([node()], [rank(r, dp=2, collectives=_all_reduce(0.1, 0.5)) for r in range(2)]),
            "runs on one node")
    silent("NCCL005", facts(two_nodes, [rank(0, dp=2, host="node-a", collectives=_all_reduce(0.1, 0.5, count=99)),
                                        rank(1, dp=2, host="node-b")]))


def test_nccl005_not_run_without_collectives():
    not_run("NCCL005", facts([node()], [rank(0)]), "no collective timings")


# -- hardware ---------------------------------------------------------------------------------------


def test_hw001_down_links_named_per_gpu():
    links = [NvlinkFacts(i, 18, (4, 7) if i == 3 else (), 18 * 26.5e9) for i in range(8)]
    (finding,) = fired("HW001", facts([node(nvlinks=links)]))
    assert finding.title == "2 NVLink link(s) down on node-a (GPU 3)"
    assert finding.evidence[0].where.gpu == 3 and "link(s) 4, 7 down of 18" in finding.evidence[0].text


def test_hw001_silent_when_all_up_or_gpu_has_no_links():
    silent("HW001", facts([node(nvlinks=[NvlinkFacts(0, 18, (), 1.0), NvlinkFacts(1, 0, (), None)])]))


def test_hw001_not_run_without_nvlink_facts():
    not_run("HW001", facts([node(nvlinks=None, missing={"nvlinks": "nvlink collector down"})]), "nvlink collector down")


def test_hw002_degraded_pcie_under_load():
    gpus = [gpu(0), gpu(1, pcie_generation=3), gpu(2, pcie_width=8, sm_active_ratio=0.305)]
    (finding,) = fired("HW002", facts([node(gpus=gpus)]))
    assert [e.where.gpu for e in finding.evidence] == [1, 2]
    assert "PCIe Gen3 x16 of Gen5 x16 at 85% load" in finding.evidence[0].text


def test_hw002_silent_on_idle_gpu():
    # Idle GPUs lower their PCIe generation on purpose: just under the load threshold, nothing to say.
    silent("HW002", facts([node(gpus=[gpu(0, pcie_generation=1, sm_active_ratio=0.295, utilization_ratio=0.9)])]))


def test_hw002_not_run_without_gpus():
    not_run("HW002", facts([node(gpus=None, missing={"gpus": "nvml: NVML library not found"})]), "NVML library")


def test_hw003_down_slow_and_erring_ports():
    ports = [port("mlx5_0"), port("mlx5_1", rate=NDR / 2), port("mlx5_2", state="DOWN"),
             port("mlx5_3", errors_increase={"symbol_error": 9.0, "link_error_recovery": 2.0}, window_seconds=600)]
    findings = fired("HW003", facts([node(ib_ports=ports)]))
    by_problem = {f.title.split(" port(s) on node-a ")[1].split(":")[0]: f for f in findings}
    assert set(by_problem) == {"not ACTIVE", "slower than its peers", "with rising error counters"}
    assert by_problem["not ACTIVE"].evidence[0].where.port == "mlx5_2/1"
    assert "mlx5_1/1 runs at 200 Gb/s, its peers at 400 Gb/s" in by_problem["slower than its peers"].evidence[0].text
    erring = by_problem["with rising error counters"].evidence[0]
    assert "link_error_recovery +2, symbol_error +9 in 600 s" in erring.text


def test_hw003_silent_at_the_error_threshold_and_for_ports_without_peers():
    ports = [port("mlx5_0", errors_increase={"symbol_error": 10.0}), port("mlx5_1"),
             port("mlx4_0", state="DOWN")]  # no active mlx4 peer: a spare port, not a broken one
    silent("HW003", facts([node(ib_ports=ports)]))
    # RoCE: a 25G frontend ConnectX-6 Dx next to 400G ConnectX-7 data ports is not their slow peer.
    roce = [port(f"mlx5_{i}", link_layer="Ethernet", hca="MT_0000000838") for i in range(2)]
    roce.append(port("mlx5_2", link_layer="Ethernet", rate=25e9 / 8, hca="MT_0000000359"))
    silent("HW003", facts([node(ib_ports=roce)]))
    roce[2].hca = "MT_0000000838"
    assert "mlx5_2/1 runs at 25 Gb/s" in texts(fired("HW003", facts([node(ib_ports=roce)])))


def test_hw003_not_run_without_port_facts():
    not_run("HW003", facts(), "no node facts")


def test_hw004_xid_ecc_and_pending_remap():
    gpus = [gpu(0), gpu(2, xid_errors={"79": 1, "48": 0}), gpu(5, ecc_uncorrected=2, remap_pending=True),
            gpu(6, xid_errors={"13": 3})]
    findings = fired("HW004", facts([node(gpus=gpus)]))
    assert [f.evidence[0].where.gpu for f in findings] == [2, 5, 6]
    assert "Xid 79 (GPU has fallen off the bus) x1" in findings[0].title and "Xid 48" not in texts(findings[:1])
    assert "nvidia-smi -r -i 5" in findings[1].fix
    assert "compute-sanitizer" in findings[2].fix  # Xid 13 is usually the application's


def test_hw004_silent_with_zero_counts():
    silent("HW004", facts([node(gpus=[gpu(0, xid_errors={"79": 0, "48": 0}, ecc_uncorrected=0)])]))


def test_hw004_not_run_without_gpus():
    not_run("HW004", facts([node(gpus=None)]), "GPU facts (NVML) unknown")


def test_hw005_thermal_throttle_under_load():
    gpus = [gpu(0), gpu(4, clock_event_reasons=("sw_power_cap", "hw_thermal_slowdown"), temperature_celsius=91.0,
                    sm_clock_hertz=990e6), gpu(5, clock_event_reasons=("hw_power_brake",), sm_active_ratio=0.305)]
    (finding,) = fired("HW005", facts([node(gpus=gpus)]))
    assert [e.where.gpu for e in finding.evidence] == [4, 5]
    assert "hw_thermal_slowdown at 85% load, 91 °C, SM clock 990 MHz" in finding.evidence[0].text
    assert "sw_power_cap" not in finding.evidence[0].text


def test_hw005_silent_at_power_cap_or_when_idle():
    silent("HW005", facts([node(gpus=[gpu(0, clock_event_reasons=("sw_power_cap",)),
                                      gpu(1, clock_event_reasons=("hw_slowdown",), sm_active_ratio=0.295)])]))


def test_hw005_not_run_without_gpus():
    not_run("HW005", facts([node(gpus=None)]), "GPU facts (NVML) unknown")


# -- performance ------------------------------------------------------------------------------------


def _pipeline(m: int | None, measured: float | None, pp: int = 4, theory: float | None = None) -> list[RankFacts]:
    return [rank(r, pp=pp, micro_batches=m, last=step(bubble_ratio=measured, bubble_ratio_theoretical=theory))
            for r in range(pp)]


def test_perf001_too_few_micro_batches_says_how_many():
    (finding,) = fired("PERF001", facts(ranks=_pipeline(m=1, measured=0.74)))
    assert finding.title == "pipeline bubble 74% in job job-1 (p=4, m=1): too few micro-batches"
    assert "theoretical 75% for p=4, m=1" in finding.evidence[0].text
    assert "from 1 to at least 12" in finding.fix and "m ≥ 4p = 16" in finding.fix


def test_perf001_measured_far_above_theory_blames_the_stages():
    (finding,) = fired("PERF001", facts(ranks=_pipeline(m=16, measured=0.45)))
    assert "against 16% in theory" in finding.title and "rebalance layers" in finding.fix


def test_perf001_theoretical_fallback_and_threshold_override():
    # Nothing measured: the schedule's own bubble is judged.
    (finding,) = fired("PERF001", facts(ranks=_pipeline(m=4, measured=None)))
    assert "theoretical bubble 43% (nothing measured)" in finding.evidence[0].text
    relaxed = {"PERF001": {"max_bubble_ratio": 0.5}}
    assert run("PERF001", facts(ranks=_pipeline(m=4, measured=None)), relaxed).findings == []


def test_perf001_silent_at_the_threshold():
    silent("PERF001", facts(ranks=_pipeline(m=12, measured=0.2)))  # (4-1)/(12+4-1) = 0.2 exactly
    silent("PERF001", facts(ranks=[rank(0, dp=2)]))  # no pipeline


def _on_cpu(ranks: list[RankFacts]) -> list[RankFacts]:
    return [dataclasses.replace(r, gpu_index=None, gpu_uuid=None) for r in ranks]


def test_perf001_above_a_sound_schedule_on_an_oversubscribed_node_is_information():
    """4 CPU ranks on 2 CPUs: a stage waiting for a CPU counts as idle, so the bubble says little about the stages."""
    (finding,) = fired("PERF001", facts([node(cpus=2)], ranks=_on_cpu(_pipeline(m=16, measured=0.45))))
    assert finding.severity == Severity.INFO and "fewer CPUs than ranks" in finding.title
    assert finding.evidence[-1].text == "node node-a runs 4 CPU ranks on 2 CPUs: their timings include waiting for " \
                                       "a CPU"
    # A CPU per rank: gloo's sends and receives between stages still outweigh a CPU micro-batch's share of a GPU's.
    (finding,) = fired("PERF001", facts([node(cpus=4)], ranks=_on_cpu(_pipeline(m=16, measured=0.45))))
    assert finding.severity == Severity.INFO and finding.title.endswith("on CPU ranks")
    # Ranks computing on GPUs: the stages are to blame again.
    (finding,) = fired("PERF001", facts([node(cpus=2)], ranks=_pipeline(m=16, measured=0.45)))
    assert finding.severity == Severity.WARNING and "rebalance layers" in finding.fix
    # Too few micro-batches is the schedule's own bubble, however busy the node.
    (finding,) = fired("PERF001", facts([node(cpus=2)], ranks=_on_cpu(_pipeline(m=1, measured=0.74))))
    assert finding.severity == Severity.WARNING and "too few micro-batches" in finding.title


def test_perf001_not_run_without_bubble_or_micro_batches():
    not_run("PERF001", facts(ranks=_pipeline(m=None, measured=None)), "neither a measured bubble nor micro_batches")


def _scheduled(ranks: list[RankFacts], schedule: str, virtual_stages: int | None = None) -> list[RankFacts]:
    return [dataclasses.replace(r, layout=dataclasses.replace(r.layout, schedule=schedule,
                                                              virtual_stages=virtual_stages)) for r in ranks]


def test_perf001_theory_follows_the_schedule_the_hellos_name():
    """p=4, m=4: GPipe and 1F1B idle 3/7 of the step; interleaved over v=2 chunks 3/11; a zero-bubble schedule
    with m ≥ p nothing, so the same measured bubble is the stages' fault, not the micro-batches'."""
    for schedule in ("gpipe", "1f1b"):
        (finding,) = fired("PERF001", facts(ranks=_scheduled(_pipeline(m=4, measured=0.45), schedule)))
        assert "too few micro-batches" in finding.title and "theoretical 43%" in finding.evidence[0].text
    (finding,) = fired("PERF001", facts(ranks=_scheduled(_pipeline(m=4, measured=0.45), "interleaved_1f1b", 2)))
    assert "too few micro-batches" in finding.title and "theoretical 27%" in finding.evidence[0].text
    assert "from 4 to at least 6" in finding.fix  # 3/(2·6+3) = 20 %
    (finding,) = fired("PERF001", facts(ranks=_scheduled(_pipeline(m=4, measured=0.45), "zbv_zero_bubble", 2)))
    assert "against 0% in theory" in finding.title and "rebalance layers" in finding.fix
    silent("PERF001", facts(ranks=_scheduled(_pipeline(m=8, measured=0.15), "interleaved_1f1b", 2)))


def test_perf001_a_schedule_it_does_not_model_takes_the_ranks_own_theory():
    """Interleaved without its chunk count, DualPipeV, a framework's own: the bubble the ranks report stands in."""
    for schedule, chunks in (("interleaved_1f1b", None), ("dualpipev", 2), ("my_schedule", None)):
        (finding,) = fired("PERF001", facts(ranks=_scheduled(_pipeline(m=4, measured=0.45, theory=0.1), schedule,
                                                             chunks)))
        assert "against 10% in theory" in finding.title, schedule
    (finding,) = fired("PERF001", facts(ranks=_scheduled(_pipeline(m=2, measured=0.6), "zbv_zero_bubble", 2)))
    assert "theoretical" not in finding.evidence[0].text  # m < p: not modelled, and no rank says


def _compute(times: dict[int, float], dp: int = 8, pp: int = 1, hosts=None) -> list[RankFacts]:
    hosts = hosts or {}
    # Whole-step times are even (the all-reduce waits for the slowest): only busy time tells, here all compute.
    return [rank(r, dp=dp, pp=pp, host=hosts.get(r, "node-a"), last=step(step_seconds=1.0, compute_seconds=t))
            for r, t in times.items()]


def _phased(slow: dict[str, float], dp: int = 4) -> list[RankFacts]:
    """A data-parallel job whose steps take 1 s everywhere: each rank busy 0.4 s (data 0.05, compute 0.25, optimizer
    0.05, outside the model 0.05) and waiting the rest in collectives, but rank 3, whose phases in ``slow`` take that
    long instead, and who waits for no one."""
    def phases(number: int) -> dict[str, float]:
        usual = {"dataloader_wait_seconds": 0.05, "compute_seconds": 0.25, "optimizer_seconds": 0.05,
                 "outside_model_seconds": 0.05}
        own = {**usual, **slow} if number == 3 else usual
        return {**own, "exposed_collective_seconds": 1.0 - sum(own.values())}

    return [rank(r, dp=dp, last=step(step_seconds=1.0, **phases(r))) for r in range(dp)]


def test_perf002_straggler_from_busy_time_not_step_time():
    ranks = _compute({r: 0.6 if r == 5 else 0.3 for r in range(8)}, hosts={r: "node-b" for r in range(4, 8)})
    (finding,) = fired("PERF002", facts(ranks=ranks))
    assert finding.title == ("straggler in job job-1: rank 5 on node-b is busy up to 2.00x the median, the extra in "
                             "compute (forward and backward)")
    assert finding.evidence[0].where.rank == 5 and finding.evidence[0].where.node == "node-b"
    assert "HW005" in finding.fix and "the node" in finding.fix


#: (phase, its step record field, how PERF002's title names it, a part of its fix): every phase of the schema.
PHASES = [
    ("data", "dataloader_wait_seconds", "loading its data", "DataLoader workers"),
    ("compute", "compute_seconds", "compute (forward and backward)", "throttling (HW005)"),
    ("optimizer", "optimizer_seconds", "the optimizer step", "offloaded to the CPU"),
    ("outside_model", "outside_model_seconds", "work outside the model (callbacks, logging, evaluation, "
                                               "checkpointing)", "rank-0-only work"),
]


def test_perf002_knows_every_phase_of_the_schema():
    assert {(phase, field) for phase, field, _, _ in PHASES} == set(STEP_PHASES.items())


@pytest.mark.parametrize(("phase", "field", "named", "advice"), PHASES)
def test_perf002_names_the_phase_that_holds_the_extra_time_and_its_fix(phase, field, named, advice):
    """Rank 3 spends 0.5 s more in one phase: the others wait for it in their collectives, its step is as long as
    theirs, and its busy time (0.9 s against 0.4 s) names it, with that phase and the fix there."""
    usual = {"dataloader_wait_seconds": 0.05, "compute_seconds": 0.25, "optimizer_seconds": 0.05,
             "outside_model_seconds": 0.05}
    ranks = _phased({field: usual[field] + 0.5})
    (finding,) = fired("PERF002", facts(ranks=ranks))
    assert finding.title == f"straggler in job job-1: rank 3 on node-a is busy up to 2.25x the median, the extra in " \
                            f"{named}"
    straggler = finding.evidence[0]
    assert straggler.where.rank == 3
    assert straggler.text.endswith(f"the extra is in {named}: {usual[field] + 0.5:.3g} s against "
                                   f"{usual[field]:.3g} s")
    values = straggler.values
    assert values["phase"] == phase and values["ratio"] == pytest.approx(0.9 / 0.4)
    assert (values["busy_seconds"], values["median_seconds"]) == (pytest.approx(0.9), pytest.approx(0.4))
    assert {name: values[name] for name in usual} == pytest.approx({**usual, field: usual[field] + 0.5})
    assert {name: values[f"peers_{name}"] for name in usual} == pytest.approx(usual)
    assert finding.evidence[1].text.startswith("ranks 0-2 wait a median 0.5 s per step in collectives")
    assert advice in finding.fix and "rank 3" in finding.fix
    # the fast ranks' wait is the straggler's finding, not the network's
    silent("PERF004", facts(ranks=ranks))
    silent("PERF003", facts(ranks=ranks))


def test_perf002_gives_one_finding_per_phase():
    ranks = _phased({"outside_model_seconds": 0.5})
    ranks[2] = dataclasses.replace(_phased({"compute_seconds": 0.7})[3], rank=2)
    titles = sorted(f.title for f in fired("PERF002", facts(ranks=ranks)))
    assert [title.split(", the extra in ")[1] for title in titles] == [
        "compute (forward and backward)", "work outside the model (callbacks, logging, evaluation, checkpointing)"]


def test_perf002_silent_just_under_the_ratio_whatever_the_phase():
    """Busy 0.49 s against 0.4 s is 1.225x, under 1.25: quiet, with a margin (0.09 s) over the step share asked."""
    margin = {"PERF002": {"min_step_share": 0.05}}
    assert run("PERF002", facts(ranks=_phased({"outside_model_seconds": 0.14})), margin).findings == []
    assert len(run("PERF002", facts(ranks=_phased({"outside_model_seconds": 0.16})), margin).findings) == 1


def test_perf002_judges_ranks_that_report_compute_only():
    """An older client reports compute alone: busy is that, and the phase is compute."""
    (finding,) = fired("PERF002", facts(ranks=_compute({0: 0.3, 1: 0.3, 2: 0.9}, dp=3)))
    assert finding.evidence[0].values["phase"] == "compute"
    assert "outside_model_seconds" not in finding.evidence[0].values


def test_perf002_compares_a_rank_with_the_others_of_its_stage():
    """Two replicas: the slow one is judged against the other alone, not a median that includes itself."""
    (finding,) = fired("PERF002", facts(ranks=_compute({0: 0.3, 1: 1.2}, dp=2)))
    assert finding.evidence[0].text == ("rank 1 (node-a) is busy 1.2 s per step (median of 20 steps (81-100, 10 s)), "
                                        "4.00x the median 0.3 s of its peers, in a 1 s step; the extra is in compute "
                                        "(forward and backward): 1.2 s against 0.3 s")


def test_perf002_on_an_oversubscribed_node_needs_a_larger_gap():
    busy = node(cpus=2)  # 8 CPU ranks on 2 CPUs: one step's compute time varies by up to ~2x
    silent("PERF002", facts([busy], ranks=_on_cpu(_compute({r: 0.87 if r == 5 else 0.3 for r in range(8)}))))
    (finding,) = fired("PERF002", facts([busy], ranks=_on_cpu(_compute({r: 0.9 if r == 5 else 0.3 for r in range(8)}))))
    assert "3.00x the median" in finding.evidence[0].text
    assert finding.evidence[-1].values == {"ranks": 8, "cpus": 2}


def test_perf002_asks_cpu_ranks_for_a_larger_gap_and_says_why():
    """Ranks on CPUs share the host's cores, with each other and with the rest of the host: 2x is within their noise
    whatever the CPU count (a run log knows it from the hellos), 3x is a straggler; the evidence says which case."""
    cpu_ranks = _on_cpu(_compute({0: 0.3, 1: 0.3, 2: 0.3, 3: 0.6}, dp=4))
    for cpus in (2, 4, None):
        silent("PERF002", facts(ranks=[dataclasses.replace(r, cpus=cpus) for r in cpu_ranks]))
    slow = _on_cpu(_compute({0: 0.3, 1: 0.3, 2: 0.3, 3: 0.9}, dp=4))
    (shared,) = fired("PERF002", facts(ranks=[dataclasses.replace(r, cpus=2) for r in slow]))
    assert shared.evidence[-1].values == {"ranks": 4, "cpus": 2}  # oversubscribed, from the ranks' hellos
    (own,) = fired("PERF002", facts(ranks=[dataclasses.replace(r, cpus=4) for r in slow]))
    assert "compute on CPUs, whose cores they share" in own.evidence[-1].text
    gpu_ranks = _compute({0: 0.3, 1: 0.3, 2: 0.3, 3: 0.6}, dp=4)  # with a GPU each, 2x is a straggler
    assert len(fired("PERF002", facts(ranks=gpu_ranks))) == 1


def test_perf002_takes_a_cpu_ranks_wait_for_a_core_out_of_its_busy_time():
    """On a contended host a CPU rank that waited for a core looks busy: rank 3's 1.2 s against 0.3 s (4x), of which it
    ran 0.3 s and waited 0.9 s on the kernel's run queue (``cpu_wait_seconds``), is 0.3 s of its own, and it is not a
    straggler. Its peers waited 0.4 s each, all of it as they woke from collectives (their busy 0.3 s is all on a CPU):
    their busy time stays 0.3 s, never below their time on a CPU. A rank that slept 0.9 s while busy, with no wait, is
    a straggler, and the evidence says the busy times are net of the waits."""
    def ranks(ran: float, wait: float) -> list[RankFacts]:
        return _on_cpu([rank(r, dp=4, last=step(step_seconds=1.5, compute_seconds=1.2 if r == 3 else 0.3,
                                                 cpu_seconds=ran if r == 3 else 0.3,
                                                 cpu_wait_seconds=wait if r == 3 else 0.4)) for r in range(4)])

    silent("PERF002", facts(ranks=ranks(0.3, 0.9)))
    (finding,) = fired("PERF002", facts(ranks=ranks(0.3, 0.0)))
    assert finding.evidence[0].where.rank == 3 and finding.evidence[0].values["busy_seconds"] == pytest.approx(1.2)
    assert finding.evidence[0].values["median_seconds"] == pytest.approx(0.3)
    assert finding.evidence[-1].text == ("busy times are net of each rank's wait for a CPU, never below its time on "
                                         "one: the ranks waited for one (Linux's run-queue delay) a median 0.4 s per "
                                         "step, up to 0.4 s")


def test_perf002_judges_window_medians_not_the_latest_step():
    """The latest step is one noisy sample: a slow last step over a healthy window is silent, a slow window
    with a fast last step is not."""
    noisy_last_step = [rank(r, dp=2, last=step(compute_seconds=0.3 if r == 0 else 0.9),
                            window=window(step(compute_seconds=0.3))) for r in range(2)]
    silent("PERF002", facts(ranks=noisy_last_step))
    slow = [rank(r, dp=2, last=step(compute_seconds=0.3), window=window(step(compute_seconds=0.3 if r == 0 else 0.9)))
            for r in range(2)]
    (finding,) = fired("PERF002", facts(ranks=slow))
    assert "is busy 0.9 s per step (median of 20 steps (81-100, 10 s)), 3.00x the median 0.3 s" in \
        finding.evidence[0].text
    assert finding.evidence[0].values["window_steps"] == 20


def test_perf002_needs_a_margin_that_matters_against_the_step():
    """2.5x slower compute on a 2 ms step whose compute is a sliver of it: 0.15 ms extra is noise, not a
    straggler; 0.5 ms extra (a quarter of the step) is one."""
    tiny = [rank(r, dp=2, last=step(step_seconds=0.002, compute_seconds=0.00025 if r == 1 else 0.0001))
            for r in range(2)]
    silent("PERF002", facts(ranks=tiny))
    assert len(run("PERF002", facts(ranks=tiny), {"PERF002": {"min_step_share": 0.05}}).findings) == 1
    (finding,) = fired("PERF002", facts(ranks=[rank(r, dp=2, last=step(step_seconds=0.002, compute_seconds=0.0006
                                                                        if r == 1 else 0.0001)) for r in range(2)]))
    assert finding.evidence[0].values["step_seconds"] == 0.002


def test_perf002_needs_enough_steps_in_the_window():
    few = [rank(r, dp=2, window=window(step(compute_seconds=0.9 if r else 0.3), steps=4)) for r in range(2)]
    not_run("PERF002", facts(ranks=few), "fewer than 5 steps")


def test_perf002_names_the_others_waiting_as_evidence_not_a_network_problem():
    """The fast ranks wait in the all-reduce for the straggler: that is evidence of PERF002, and PERF004 (which
    judges transfer, the straggler's own exposed time) stays silent."""
    ranks = [rank(r, dp=4, last=step(step_seconds=1.0, compute_seconds=0.9 if r == 3 else 0.3,
                                     exposed_collective_seconds=0.02 if r == 3 else 0.62)) for r in range(4)]
    (finding,) = fired("PERF002", facts(ranks=ranks))
    waiting = finding.evidence[1]
    assert waiting.text.startswith("ranks 0-2 wait a median 0.6 s per step in collectives for the slow rank(s)")
    silent("PERF004", facts(ranks=ranks))


def test_perf002_from_a_partial_view_says_among_which_ranks_it_judged():
    """An agent on one node of two sees ranks 0-3 of 8: rank 3 is still named (it is among them), with the evidence
    that it was judged among 4 of the job's 8 ranks and how to see them all; the reason counts the job's 8."""
    ranks = [rank(r, dp=8, last=step(step_seconds=1.0, compute_seconds=0.9 if r == 3 else 0.3,
                                     exposed_collective_seconds=0.02 if r == 3 else 0.62)) for r in range(4)]
    (finding,) = fired("PERF002", facts(ranks=ranks))
    (seen,) = [e for e in finding.evidence if "ranks_seen" in e.values]
    assert seen.values == {"ranks_seen": 4, "world_size": 8, "missing_ranks": [4, 5, 6, 7]}
    assert "judged among the 4 of the job's 8 ranks this source sees (0-3)" in seen.text
    assert "all 8 ranks of the job wait for it" in finding.reason
    everyone = ranks + [rank(r, dp=8, last=step(step_seconds=1.0, compute_seconds=0.3, exposed_collective_seconds=0.62))
                        for r in range(4, 8)]
    (finding,) = fired("PERF002", facts(ranks=everyone))
    assert not [e for e in finding.evidence if "ranks_seen" in e.values]


def test_perf002_names_a_node_whose_ranks_are_all_slow():
    times = {r: 0.6 if r >= 6 else 0.3 for r in range(8)}
    (finding,) = fired("PERF002", facts(ranks=_compute(times, hosts={6: "node-c", 7: "node-c"})))
    assert "node node-c" in finding.title
    assert "replace or exclude node node-c" in finding.fix


def test_perf002_silent_under_ratio_and_across_unequal_stages():
    silent("PERF002", facts(ranks=_compute({r: 0.37 if r == 5 else 0.3 for r in range(8)})))
    # pp=2: stage 1 has twice the layers; ranks are compared with their own stage only.
    silent("PERF002", facts(ranks=_compute({r: 0.6 if r >= 4 else 0.3 for r in range(8)}, dp=4, pp=2)))


def test_perf002_takes_the_stage_yardsticks_of_ranks_it_was_not_given():
    """An outlier fetch brings one rank and the stage's medians over all 64 of its ranks (facts.peers): the rank is
    judged against them, phase by phase."""
    (slow,) = [r for r in _phased({"dataloader_wait_seconds": 0.5}) if r.rank == 3]
    peers = {("job-1", 0, name): Peers(value, 64) for name, value in (
        ("busy_seconds", 0.4), ("dataloader_wait_seconds", 0.05), ("compute_seconds", 0.25),
        ("optimizer_seconds", 0.05), ("outside_model_seconds", 0.05))}
    peers["job-1", None, "step_seconds"] = Peers(1.0, 64)
    (finding,) = fired("PERF002", facts(ranks=[slow], peers=peers))
    assert finding.evidence[0].values["phase"] == "data"
    assert finding.evidence[0].values["peers_dataloader_wait_seconds"] == 0.05


def test_perf002_not_run_without_any_phase():
    not_run("PERF002", facts(ranks=[rank(0, last=step(compute_seconds=None))]), "step records lack every phase")


def _input(waits: dict[int, float], pp: int = 1) -> list[RankFacts]:
    return [rank(r, dp=len(waits) // pp, pp=pp, last=step(dataloader_wait_seconds=w)) for r, w in waits.items()]


def test_perf003_input_stall_with_low_gpu_activity():
    gpus = [gpu(i, sm_active_ratio=0.2 if i == 1 else 0.9) for i in range(8)]
    (finding,) = fired("PERF003", facts([node(gpus=gpus)], _input({0: 0.12, 1: 0.15})))
    assert finding.evidence[0].text == ("rank 1: waits 0.15 s for input in a 0.5 s step (30%, median of 20 steps "
                                        "(81-100, 10 s)); its GPU is 20% busy (low)")
    assert "num_workers" in finding.fix


def test_perf003_leaves_a_wait_few_ranks_have_to_perf002():
    """Half of the ranks waiting, the others not, is not the job's input pipeline: their own loaders, stragglers."""
    silent("PERF003", facts(ranks=_input({0: 0.15, 1: 0.15, 2: 0.01, 3: 0.01})))
    (finding,) = fired("PERF003", facts(ranks=_input({0: 0.15, 1: 0.15, 2: 0.15, 3: 0.01})))
    assert "3 of 4 rank(s)" in finding.title
    assert len(run("PERF003", facts(ranks=_input({0: 0.15, 1: 0.01})), {"PERF003": {"rank_share": 0.4}}).findings) == 1


def test_perf003_judges_the_share_within_a_pipeline_stage():
    """Only the first stage loads data: its ranks all waiting is the job's input, though they are half of the job."""
    (finding,) = fired("PERF003", facts(ranks=_input({0: 0.15, 1: 0.15, 2: 0.0, 3: 0.0}, pp=2)))
    assert {e.where.rank for e in finding.evidence} == {0, 1}


def test_perf003_on_an_oversubscribed_node_is_information():
    ranks = _on_cpu(_input({0: 0.15, 1: 0.15, 2: 0.15, 3: 0.01}))
    (finding,) = fired("PERF003", facts([node(cpus=2)], ranks))
    assert finding.severity == Severity.INFO and finding.title.endswith("on a node with fewer CPUs than ranks")
    assert finding.evidence[-1].values == {"ranks": 4, "cpus": 2}
    (finding,) = fired("PERF003", facts([node(cpus=4)], ranks))
    assert finding.severity == Severity.WARNING


def test_perf003_judges_window_medians():
    one_slow_fetch = rank(0, last=step(dataloader_wait_seconds=0.2), window=window(step(dataloader_wait_seconds=0.01)))
    silent("PERF003", facts(ranks=[one_slow_fetch]))
    slow_input = rank(0, last=step(dataloader_wait_seconds=0.01), window=window(step(dataloader_wait_seconds=0.15)))
    (finding,) = fired("PERF003", facts(ranks=[slow_input]))
    assert "rank 0: waits 0.15 s for input in a 0.5 s step (30%, median of 20 steps" in finding.evidence[0].text


def test_perf003_silent_just_under_the_share_or_for_a_sub_millisecond_wait():
    silent("PERF003", facts(ranks=[rank(0, last=step(dataloader_wait_seconds=0.099))]))
    # half of a 1.5 ms step, but 0.75 ms: fetching a batch costs that much however the loader is set up
    silent("PERF003", facts(ranks=[rank(0, last=step(step_seconds=0.0015, dataloader_wait_seconds=0.00075))]))


def test_perf003_not_run_without_dataloader_wait():
    not_run("PERF003", facts(ranks=[rank(0)]), "dataloader_wait_seconds")


def _exposed(seconds: dict[int, float], compute: float = 1.0, step_seconds: float = 2.0, **layout) -> list[RankFacts]:
    return [rank(r, **layout, last=step(step_seconds=step_seconds, compute_seconds=compute,
                                        exposed_collective_seconds=e)) for r, e in seconds.items()]


def test_perf004_judges_the_transfer_of_the_rank_that_waits_least():
    """Ranks 0-2 waited for rank 3's arrival; the transfer itself is what rank 3 was exposed to, 0.6 s."""
    (finding,) = fired("PERF004", facts(ranks=_exposed({0: 0.9, 1: 0.8, 2: 0.9, 3: 0.6}, dp=4)))
    assert "CCR 0.60" in finding.title and "4 ranks" in finding.title
    assert finding.evidence[0].text.startswith("transfer 0.6 s per step: the exposed collective time of rank 3")
    assert finding.evidence[2].values == {"max_wait_seconds": pytest.approx(0.3)}


def test_perf004_silent_at_threshold_when_it_does_not_matter_against_the_step_and_for_hybrid_jobs():
    silent("PERF004", facts(ranks=_exposed({r: 0.5 for r in range(4)}, dp=4)))
    # CCR 3 on a toy: 0.3 ms of transfer against 0.1 ms of compute in a 2 ms step is not worth restructuring for.
    silent("PERF004", facts(ranks=_exposed({r: 0.0003 for r in range(2)}, compute=0.0001, step_seconds=0.002, dp=2)))
    silent("PERF004", facts(ranks=_exposed({r: 2.0 for r in range(4)}, tp=2, dp=2)))


def test_perf004_leaves_latency_bound_all_reduces_of_tiny_models_alone():
    """A few KiB per step: the all-reduce's time is its latency, which hybrid parallelism does not change."""
    def moved(per_step: float) -> dict:
        return {"all_reduce": CollectiveFacts("all_reduce", 100, 50.0, bytes=per_step * 100)}

    tiny = [rank(r, dp=2, steps=100, collectives=moved(4096), last=step(step_seconds=0.004, compute_seconds=0.0005,
                                                                       exposed_collective_seconds=0.0015))
            for r in range(2)]
    silent("PERF004", facts(ranks=tiny))
    large = [dataclasses.replace(r, collectives=moved(64 * 2**20)) for r in tiny]
    (finding,) = fired("PERF004", facts(ranks=large))
    assert "64 MiB per step" in finding.evidence[0].text


def test_perf004_not_run_without_exposed_collective_time():
    not_run("PERF004", facts(ranks=[rank(0, dp=2, collectives={})]), "step records lack exposed_collective_seconds")


def _over_two_nodes(exposed: dict[int, float], *, sync_bytes: float | None = 8 * 2**20, compute: float = 1.0,
                    backend: str = "gloo", env: dict | None = None, **fields) -> list[RankFacts]:
    """A 4-rank DDP job, ranks 0-1 on node-a and 2-3 on node-b, each rank's step with its exposed collective time
    and DDP's all-reduce volume."""
    return [rank(r, dp=4, host="node-a" if r < 2 else "node-b", backends={"default": backend}, env=env,
                 process_groups={"default": [0, 1, 2, 3]},
                 last=step(step_seconds=2.5, compute_seconds=compute, exposed_collective_seconds=e,
                           gradient_sync_bytes=sync_bytes), **fields) for r, e in exposed.items()]


def _nic_nodes(speed: float | None = 10e9 / 8, mgmt: float | None = 1e9 / 8, **parts) -> list:
    """node-a and node-b, each with eth0 at ``speed`` (bytes/s) and a slower management NIC."""
    return [node(name, ib_ports=[], interfaces=[
        InterfaceFacts("eth0", True, False, (f"10.0.0.{i}",), speed_bytes_per_second=speed),
        InterfaceFacts("mgmt0", True, False, (f"192.168.0.{i}",), speed_bytes_per_second=mgmt),
        InterfaceFacts("lo", True, True, ("127.0.0.1",))], **parts) for i, name in enumerate(("node-a", "node-b"))]


def test_perf004_from_a_partial_view_says_whom_the_ranks_wait_for_never_a_verdict():
    """Node a's agent sees ranks 0-1 of 4, which wait 0.74 s a step for rank 3 on node b: no transfer time can be
    taken from them, and the rule says so, with how to see the whole job."""
    seen = _over_two_nodes({0: 0.74, 1: 0.74})
    agent_a = SourceInfo("agent", "http://node-a:9400")
    (finding,) = fired("PERF004", facts(_nic_nodes(), seen, sources=[agent_a]))
    assert finding.severity is Severity.INFO
    assert finding.title == ("job job-1: ranks 0-1 wait a median 0.74 s a step in collectives, with ranks not "
                             "reporting here (2-3): transfer or waiting cannot be told apart from this partial view")
    assert finding.evidence[0].values == {"wait_seconds": 0.74, "ranks": [0, 1], "missing_ranks": [2, 3],
                                          "world_size": 4}
    assert "--agent http://node-a:9400 --agent URL" in finding.fix and "--prometheus" in finding.fix
    assert "communication-bound" not in texts([finding])
    # The whole job: rank 3 computes 0.74 s longer and waits for no one; the others wait for it, not for transfer.
    whole = seen + [dataclasses.replace(r, last=step(step_seconds=2.5, compute_seconds=1.74 if r.rank == 3 else 1.0,
                                                     exposed_collective_seconds=0.0 if r.rank == 3 else 0.74,
                                                     gradient_sync_bytes=8 * 2**20))
                    for r in _over_two_nodes({2: 0.74, 3: 0.0})]
    whole = [dataclasses.replace(r, window=window(r.last)) for r in whole]
    silent("PERF004", facts(_nic_nodes(), whole))
    assert fired("PERF002", facts(_nic_nodes(), whole))[0].evidence[0].where.rank == 3


def test_perf004_names_a_slow_network_with_its_bandwidth_against_the_nics_rating():
    """8 MiB all-reduced in 1.3 s over 4 ranks is 77 Mb/s of bus bandwidth (algbw × 2(n−1)/n) on NICs rated
    10 Gb/s: the network, not the job."""
    (finding,) = fired("PERF004", facts(_nic_nodes(), _over_two_nodes({r: 1.3 for r in range(4)})))
    busbw = 8 * 2**20 / 1.3 * 2 * 3 / 4
    assert finding.title == (
        "job job-1 is communication-bound on a slow network: sockets (TCP) across nodes node-a, node-b "
        "(node-a:eth0 (10 Gb/s), node-b:eth0 (10 Gb/s)) delivers 77.4 Mb/s bus bandwidth of its rated 10 Gb/s (0.77%) "
        "to group default, CCR 1.30")
    (bandwidth,) = [e for e in finding.evidence if "busbw_bytes_per_second" in e.values]
    assert bandwidth.values["busbw_bytes_per_second"] == pytest.approx(busbw)
    assert bandwidth.values["crosses_nodes"] is True and bandwidth.values["nodes"] == ["node-a", "node-b"]
    assert "algbw 51.6 Mb/s × 2(4−1)/4" in bandwidth.text
    assert "tc qdisc show" in finding.fix and "node-a, node-b" in finding.fix and "no_sync" not in finding.fix
    # GLOO_SOCKET_IFNAME names the NIC the job uses: the 1 Gb/s one is the rating then.
    (finding,) = fired("PERF004", facts(_nic_nodes(), _over_two_nodes({r: 1.3 for r in range(4)},
                                                                      env={"GLOO_SOCKET_IFNAME": "mgmt0"})))
    assert "of its rated 1 Gb/s" in finding.title and "GLOO_SOCKET_IFNAME=mgmt0" in texts([finding])


def _counted(nodes: list, rates: dict[str, float], drops: dict[str, int] | None = None) -> list:
    """``nodes`` whose eth0 counters grow at ``rates[node]`` bytes/s each way (and count ``drops``) in samples 5 s
    apart around the step window the ranks of ``_windowed`` end at 1,000 s (wall clock)."""
    def samples(name: str) -> list[CounterSample]:
        return [CounterSample(t, {"eth0": (int(rates[name] * t), int(rates[name] * t), 0,
                                           (drops or {}).get(name, 0) * (t > 975)), "mgmt0": (0, 0, 0, 0)})
                for t in range(940, 1011, 5)]
    return [dataclasses.replace(n, traffic=samples(n.name)) for n in nodes]


def _windowed(ranks: list[RankFacts]) -> list[RankFacts]:
    """``ranks`` whose windows of 20 steps (2.5 s each) end at 1,000 s."""
    return [dataclasses.replace(r, window=window(r.last, ended=1000.0, seconds=50.0)) for r in ranks]


def test_perf004_reads_the_nics_counters_over_the_step_window_and_names_a_slow_side_only_where_they_show_one():
    """The job's NICs carry 9.68 MB/s each way over its step window (950-1,000 s): 7.7 % of 1 Gb/s. Node b's NIC
    alone counts drops: it is the slow side. With no drops the counters show the same rate on both sides (a
    collective moves in lockstep) and name no side; a NIC negotiated at a tenth of the speed runs 10x busier."""
    ranks = _windowed(_over_two_nodes({r: 1.3 for r in range(4)}))
    rate = 9.68e6
    (finding,) = fired("PERF004", facts(_counted(_nic_nodes(), {"node-a": rate, "node-b": rate}, {"node-b": 12}),
                                        ranks))
    assert finding.title.endswith("; the slow side is node-b")
    counters = {e.values["node"]: e.values for e in finding.evidence if "interface" in e.values}
    assert set(counters) == {"node-a", "node-b"}
    # 945 is before the window: the samples inside it are 950-1,000 s
    assert counters["node-b"]["seconds"] == 50 and counters["node-b"]["transmit_bytes"] == pytest.approx(rate * 50, 1)
    assert counters["node-b"]["drops"] == 12 and counters["node-a"]["drops"] == 0
    assert counters["node-a"]["bytes_per_step"] == pytest.approx(rate * 2.5, rel=1e-6)  # 20 steps in 50 s
    assert counters["node-a"]["utilization"] == pytest.approx(rate / (10e9 / 8))
    (side,) = [e for e in finding.evidence if "slow_side" in e.values]
    assert side.values["slow_side"] == "node-b" and "eth0 alone counted errors or drops" in side.text
    assert "(first node-b's)" in finding.fix

    (even,) = fired("PERF004", facts(_counted(_nic_nodes(), {"node-a": rate, "node-b": rate}), ranks))
    assert "slow side" not in even.title
    (side,) = [e for e in even.evidence if "slow_side" in e.values]
    assert side.values["slow_side"] is None and "do not tell which side is slow" in side.text

    slower_b = [_nic_nodes()[0], _nic_nodes(speed=1e9 / 8)[1]]
    (finding,) = fired("PERF004", facts(_counted(slower_b, {"node-a": rate, "node-b": rate}), ranks))
    assert finding.title.endswith("the slow side is node-b")
    (side,) = [e for e in finding.evidence if "slow_side" in e.values]
    assert "runs at 7.74% of its speed, the others at most 0.77%" in side.text

    # Counters without samples inside the window (an agent started after the job) give no traffic evidence.
    late = [dataclasses.replace(n, traffic=[s for s in n.traffic if s.time > 995]) for n in
            _counted(_nic_nodes(), {"node-a": rate, "node-b": rate})]
    (finding,) = fired("PERF004", facts(late, ranks))
    assert not [e for e in finding.evidence if "interface" in e.values or "slow_side" in e.values]


def test_perf004_rates_a_network_its_links_do_not_by_the_jobs_own_probe_across_it():
    """NICs whose speed no source gives (Prometheus from an older agent, a driver that does not say): the job's own
    `gpuwatch probe` across the nodes measured 8 Gb/s, and 77 Mb/s of bus bandwidth is 1 % of that, a slow network;
    another job's probe, or one inside a node, rates nothing."""
    ranks = _over_two_nodes({r: 1.3 for r in range(4)})
    probe = BandwidthMeasurement("node-a", "socket", "all_reduce", 4 << 20, 1e9, 4, job="job-1")
    (finding,) = fired("PERF004", facts(_nic_nodes(speed=None, mgmt=None), ranks, bandwidth=[probe]))
    assert "on a slow network" in finding.title and "of its rated 8 Gb/s" in finding.title, finding.title
    (bandwidth,) = [e for e in finding.evidence if "busbw_bytes_per_second" in e.values]
    assert "gpuwatch probe measured 8 Gb/s of all_reduce bus bandwidth on it (socket)" in bandwidth.text
    for other in (dataclasses.replace(probe, job="job-2"), dataclasses.replace(probe, interconnect="loopback")):
        (finding,) = fired("PERF004", facts(_nic_nodes(speed=None, mgmt=None), ranks, bandwidth=[other]))
        assert "the path's rating is unknown" in finding.title


def test_perf004_a_heavy_job_on_a_healthy_network_keeps_the_job_shaped_fix():
    """1 GiB a step in 1.3 s is 9.9 Gb/s of bus bandwidth on 10 Gb/s NICs: the path is healthy, the job heavy."""
    ranks = _over_two_nodes({r: 1.3 for r in range(4)}, sync_bytes=2**30)
    (finding,) = fired("PERF004", facts(_nic_nodes(), ranks))
    assert finding.title.endswith("with pure data parallelism over 4 ranks, a heavy job on a healthy path")
    assert "no_sync" in finding.fix and "bucket_cap_mb" in finding.fix
    (bandwidth,) = [e for e in finding.evidence if "busbw_bytes_per_second" in e.values]
    assert "99% of its rated 10 Gb/s" in bandwidth.text
    # Just at a quarter of the rating is still the job's.
    quarter = _over_two_nodes({r: 1.3 for r in range(4)}, sync_bytes=0.25 * 10e9 / 8 * 1.3 / 1.5 * 1.001)
    assert "healthy path" in fired("PERF004", facts(_nic_nodes(), quarter))[0].title
    # Unknown NIC speeds: no verdict on the network, and it says why.
    unknown = fired("PERF004", facts(_nic_nodes(speed=None, mgmt=None), ranks))[0]
    assert "the path's rating is unknown" in unknown.title


def test_perf004_judges_each_timed_group_and_gives_a_sharded_job_its_own_fix():
    """An FSDP job timed by the hooks: its all-gathers and reduce-scatters (bus factor (n−1)/n) over NCCL and two
    NDR ports a node (800 Gb/s), 100 GiB a step in 1 s (644 Gb/s of bus bandwidth) is healthy; the fix speaks FSDP."""
    moved = {"all_gather": CollectiveFacts("all_gather", 100, 60.0, bytes=1e12),
             "reduce_scatter": CollectiveFacts("reduce_scatter", 100, 40.0, bytes=5e11)}
    ranks = [dataclasses.replace(r, collectives=moved, last=dataclasses.replace(
        r.last, groups={"default": GroupTotals(bytes=100 * GIB, seconds=1.0)}))
        for r in _over_two_nodes({r: 1.3 for r in range(4)}, backend="nccl", sync_bytes=None)]
    nodes = [node(name, ib_ports=[port("mlx5_0"), port("mlx5_1")]) for name in ("node-a", "node-b")]
    (finding,) = fired("PERF004", facts(nodes, ranks))
    assert "sharded data parallelism" in finding.title and "healthy path" in finding.title
    assert "reshard_after_forward" in finding.fix and "no_sync" not in finding.fix
    (bandwidth,) = [e for e in finding.evidence if "busbw_bytes_per_second" in e.values]
    assert bandwidth.values["busbw_bytes_per_second"] == pytest.approx(100 * GIB * 3 / 4)
    assert bandwidth.values["rated_bytes_per_second"] == 2 * NDR and bandwidth.values["path"] == "InfiniBand"
    assert bandwidth.values["links"] == ["node-a:mlx5_0/1", "node-a:mlx5_1/1", "node-b:mlx5_0/1", "node-b:mlx5_1/1"]
    slow = [dataclasses.replace(r, last=dataclasses.replace(r.last, groups={"default": GroupTotals(
        bytes=GIB, seconds=1.0)})) for r in ranks]
    assert "on a slow network: InfiniBand across nodes" in fired("PERF004", facts(nodes, slow))[0].title
    # A group moving a few bytes (a logged loss) is bound by latency: no evidence of a slow path.
    logged = [dataclasses.replace(r, last=dataclasses.replace(r.last, groups={
        "default": GroupTotals(bytes=100 * GIB, seconds=1.0), "dp": GroupTotals(bytes=4, seconds=0.001)}),
        process_groups={"default": [0, 1, 2, 3], "dp": [0, 1, 2, 3]}) for r in ranks]
    assert "healthy path" in fired("PERF004", facts(nodes, logged))[0].title


def _hybrid(tp: int, pp: int, dp: int, groups: dict[str, GroupTotals] | None, exposed: float = 1.3) -> list[RankFacts]:
    """A tp × pp × dp job over NCCL on 8-GPU nodes, each rank's latest step with ``groups`` (its timed calls by
    process group) and its exposed collective time."""
    world = tp * pp * dp
    return [rank(r, tp=tp, pp=pp, dp=dp, host=f"node-{'ab'[r // 8]}", backends={"default": "nccl"},
                 process_groups={"tp": [r // tp * tp + i for i in range(tp)],
                                 "pp": [r % (tp * dp) + i * tp * dp for i in range(pp)],
                                 "dp": [r // (tp * dp) * tp * dp + r % tp + i * tp for i in range(dp)]},
                 collectives={"all_reduce": CollectiveFacts("all_reduce", 100, 130.0, bytes=100 * 64 * GIB)},
                 last=step(step_seconds=2.5, compute_seconds=1.0, exposed_collective_seconds=exposed, groups=groups))
            for r in range(world)]


def test_perf004_on_a_hybrid_job_gives_the_fix_of_the_dimension_whose_group_dominates():
    """A tp 4 × dp 2 job on one node whose steps spend most of their exposed time on group tp, at two thirds of
    NVLink (healthy): keep TP in the NVLink domain and overlap it, not DDP's no_sync. Group pp dominating a pp 2 × dp
    4 job: more micro-batches. A hybrid job whose steps do not say which group took the time: no verdict."""
    tp_heavy = {"tp": GroupTotals(bytes=200 * GIB, seconds=1.0), "dp": GroupTotals(bytes=50 * GIB, seconds=0.2)}
    (finding,) = fired("PERF004", facts([node()], _hybrid(4, 1, 2, tp_heavy)))
    assert "most of it on group tp (tensor parallelism) of a tp 4 × pp 1 × dp 2 job" in finding.title
    assert finding.title.endswith("a heavy job on a healthy path"), finding.title
    assert "NVLink domain" in finding.fix and "no_sync" not in finding.fix
    (tp_bandwidth, _) = [e.values for e in finding.evidence if "busbw_bytes_per_second" in e.values]
    assert tp_bandwidth["group"] == "tp" and tp_bandwidth["path"] == "NVLink" and not tp_bandwidth["crosses_nodes"]

    pp_heavy = {"pp": GroupTotals(bytes=400 * GIB, seconds=1.1), "dp": GroupTotals(bytes=50 * GIB, seconds=0.2)}
    (finding,) = fired("PERF004", facts([node(), node("node-b")], _hybrid(1, 2, 4, pp_heavy)))
    assert "group pp (pipeline parallelism)" in finding.title and "more micro-batches" in finding.fix

    silent("PERF004", facts([node()], _hybrid(4, 1, 2, None)))
    # On CPU ranks (no GPU) a hybrid job's per-layer collectives outweigh its compute by the device: information.
    on_cpus = [dataclasses.replace(r, gpu_index=None, gpu_uuid=None) for r in _hybrid(4, 1, 2, tp_heavy)]
    (finding,) = fired("PERF004", facts([node()], on_cpus))
    assert finding.severity is Severity.INFO and finding.title.endswith(", on CPU ranks")


def test_perf005_nvlink_below_rating():
    rated = 18 * 26.5e9
    measured = BandwidthMeasurement("node-a", "nvlink", "all_reduce", 1 << 30, 0.63 * rated, 8, gpu=0)
    (finding,) = fired("PERF005", facts([node()], bandwidth=[measured]))
    assert finding.title == "NVLink on node-a delivers 63% of its rated bandwidth"
    ib = BandwidthMeasurement("node-a", "infiniband", "all_reduce", 1 << 30, 0.5 * NDR, 16)
    assert "InfiniBand on node-a delivers 50%" in fired("PERF005", facts([node()], bandwidth=[ib]))[0].title


def test_perf005_silent_at_the_fraction():
    measured = BandwidthMeasurement("node-a", "nvlink", "all_reduce", 1 << 30, 0.7 * 18 * 26.5e9, 8, gpu=0)
    silent("PERF005", facts([node()], bandwidth=[measured]))


def test_perf005_not_run_without_measurement():
    not_run("PERF005", facts([node()], [rank(0)]), "gpuwatch probe")


def _stages(busy: dict[int, float | list[float]], dp: int = 2, wait: float = 0.18, modules=None,
            **fields) -> list[RankFacts]:
    """A pipeline of len(busy) stages × dp replicas: each stage's ranks computing ``busy[stage]`` seconds a step (a
    list: one figure per replica), the other stages waiting ``wait`` in collectives; ``modules`` by stage."""
    pp, ranks = len(busy), []
    slowest = max(busy, key=lambda s: max(busy[s]) if isinstance(busy[s], list) else busy[s])
    for number in range(pp * dp):
        stage, replica = number // dp, number % dp
        own = busy[stage][replica] if isinstance(busy[stage], list) else busy[stage]
        r = rank(number, pp=pp, dp=dp, micro_batches=8, last=step(
            step_seconds=0.45, compute_seconds=own, exposed_collective_seconds=0.01 if stage == slowest else wait,
            bubble_ratio=0.4 if stage != slowest else 0.05), **fields)
        if modules is not None:
            r.layout = dataclasses.replace(r.layout, stage_modules=tuple(modules[stage]))
        ranks.append(r)
    return ranks


def test_perf006_names_the_slow_stage_its_layers_and_the_wait_of_its_neighbour():
    """The observed case: stage 1 busy 271 ms a step against stage 0's 134 ms, which waits 180 ms in its receives."""
    modules = {0: ["tok_embeddings", "layers.0", "layers.1"], 1: ["layers.2", "layers.3", "norm", "output"]}
    (finding,) = fired("PERF006", facts(ranks=_stages({0: 0.134, 1: 0.271}, modules=modules)))
    assert finding.title == ("pipeline stage 1 of job job-1 is busy 2.02x the other stages: they wait for it every "
                             "micro-batch")
    slow, phase, other = finding.evidence[:3]
    assert (slow.values["pp_stage"], slow.values["ranks"], slow.values["busy_seconds"],
            slow.values["others_seconds"]) == (1, [2, 3], 0.271, 0.134)
    assert slow.values["modules"] == modules[1] and "it holds layers.2, layers.3, norm, output" in slow.text
    assert phase.values["phase"] == "compute"
    assert (other.values["pp_stage"], other.values["wait_seconds"]) == (0, 0.18)
    assert "waits 0.18 s a step in collectives" in other.text
    assert "move layers from stage 1 (layers.2, layers.3, norm, output)" in finding.fix
    assert "the last stage also holds the output layer and the loss" in finding.fix
    assert "pipeline_parallel_split_points" in finding.fix and "--decoder-last-pipeline-num-layers" in finding.fix


def test_perf006_silent_on_balanced_stages_and_just_under_its_ratio():
    silent("PERF006", facts(ranks=_stages({0: 0.2, 1: 0.2, 2: 0.21, 3: 0.2})))
    silent("PERF006", facts(ranks=_stages({0: 0.2, 1: 0.259})))  # 1.295x
    assert fired("PERF006", facts(ranks=_stages({0: 0.2, 1: 0.262})))  # 1.31x
    silent("PERF006", facts(ranks=[rank(n, dp=4) for n in range(4)]))  # no pipeline
    # a margin that does not matter against the step: 1.5x of 20 ms in a 450 ms step
    silent("PERF006", facts(ranks=_stages({0: 0.02, 1: 0.03})))


def test_perf006_leaves_a_slow_replica_to_perf002():
    """One slow rank of a stage (a slow device) does not make its stage slow: the stage's figure is the lower median
    of its ranks', which one rank does not move with three replicas, and is the faster one's with two."""
    for busy in ({0: 0.134, 1: [0.134, 0.4, 0.134]}, {0: 0.134, 1: [0.134, 0.4]}):
        ranks = _stages(busy, dp=len(busy[1]))
        silent("PERF006", facts(ranks=ranks))
        (straggler,) = fired("PERF002", facts(ranks=ranks))
        assert straggler.evidence[0].where.rank == len(busy[1]) + 1
    # every replica of the stage slow alike: the stage
    assert fired("PERF006", facts(ranks=_stages({0: 0.134, 1: [0.27, 0.28, 0.27]}, dp=3)))


def test_perf006_leaves_a_stage_waiting_for_its_input_to_perf003():
    """Stage 0 loads the data: its ranks' extra time all in the loader is the input pipeline's, not the split's."""
    ranks = _stages({0: 0.134, 1: 0.134})
    for r in ranks[:2]:
        r.last = dataclasses.replace(r.last, dataloader_wait_seconds=0.2)
        r.window = window(r.last)
    silent("PERF006", facts(ranks=ranks))
    assert fired("PERF003", facts(ranks=ranks))


def test_perf006_says_what_it_does_not_know():
    """No stage_modules in the hellos, and an agent that sees two stages of four."""
    seen = [r for r in _stages({0: 0.134, 1: 0.271, 2: 0.134, 3: 0.134}) if r.layout.pp_stage < 2]
    (finding,) = fired("PERF006", facts(ranks=seen))
    texts = [e.text for e in finding.evidence]
    assert "only stage(s) 0, 1 of the job's 4 are seen by this source (busy times over a full window): the others " \
           "are not compared" in texts
    assert "which modules each stage holds is unknown: the hellos carry no stage_modules" in texts
    assert "holds" not in finding.fix.split(" to the other stages")[0]


def test_perf006_on_cpus_needs_the_larger_ratio():
    """CPU ranks share cores: 2x apart is not enough to tell, 3.5x is."""
    silent("PERF006", facts(ranks=_on_cpu(_stages({0: 0.134, 1: 0.271}))))
    (finding,) = fired("PERF006", facts(ranks=_on_cpu(_stages({0: 0.1, 1: 0.35}))))
    assert "compute on CPUs" in finding.evidence[-1].text


def test_perf006_and_perf001_do_not_both_report_the_slow_stage():
    """The slow stage's neighbours idle: the measured bubble is far above a sound schedule's (p=2, m=8: 11 %). PERF006
    names the stage; PERF001 says nothing more. Balanced stages with the same bubble are PERF001's."""
    ranks = _stages({0: 0.134, 1: 0.271})
    silent("PERF001", facts(ranks=ranks))
    assert fired("PERF006", facts(ranks=ranks))
    (finding,) = fired("PERF001", facts(ranks=_stages({0: 0.2, 1: 0.21})))
    assert "stages unbalanced or waiting on communication" in finding.title


def test_perf006_not_run_without_busy_times():
    not_run("PERF006", facts(ranks=[rank(n, pp=2, window=None) for n in range(2)]), "busy time")


# -- memory -----------------------------------------------------------------------------------------


def _cuda(reserved: float, allocated: float, peak: float | None = None, split: float | None = None) -> StepFacts:
    return step(memory_kind="cuda", reserved_bytes=reserved, allocated_bytes=allocated,
                peak_bytes=peak if peak is not None else allocated, inactive_split_bytes=split)


def test_mem001_fragmentation_names_expandable_segments():
    ranks = [rank(0, dp=2, alloc_retries=3, last=_cuda(85 * GIB, 60 * GIB, split=20 * GIB)),
             rank(1, dp=2, alloc_retries=0, last=_cuda(85 * GIB, 30 * GIB))]
    (finding,) = fired("MEM001", facts(ranks=ranks))
    assert finding.fix == "export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"
    (evidence,) = finding.evidence
    assert evidence.where.rank == 0
    assert "reserved 85.0 GiB, allocated 60.0 GiB (25.0 GiB, 29% held unused, 20.0 GiB of it in inactive split " \
           "blocks); 3 allocation retries" in evidence.text


def test_mem001_already_expandable_suggests_max_split():
    env = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    (finding,) = fired("MEM001", facts(ranks=[rank(0, env=env, alloc_retries=1, last=_cuda(10 * GIB, 5 * GIB))]))
    assert "max_split_size_mb:128" in finding.fix


def test_mem001_silent_without_retries_or_below_share():
    silent("MEM001", facts(ranks=[rank(0, alloc_retries=0, last=_cuda(85 * GIB, 30 * GIB))]))
    silent("MEM001", facts(ranks=[rank(0, alloc_retries=5, last=_cuda(100 * GIB, 75.1 * GIB))]))


def test_mem001_not_run_on_cpu_ranks():
    not_run("MEM001", facts(ranks=[rank(0, last=step(memory_kind="host_rss", peak_bytes=GIB))]), "CPU ranks")


def test_mem002_peak_near_capacity_and_ooms():
    ranks = [rank(0, dp=3, last=_cuda(78 * GIB, 70 * GIB, peak=77 * GIB)),
             rank(1, dp=3, ooms=1, last=_cuda(10 * GIB, 5 * GIB)), rank(2, dp=3, last=_cuda(40 * GIB, 30 * GIB))]
    (finding,) = fired("MEM002", facts([node()], ranks))
    assert finding.title == "GPU memory near capacity in job job-1: 2 rank(s), peak up to 96% of the GPU, 1 with OOMs"
    assert [e.text for e in finding.evidence] == ["rank 1: peak 5.0 GiB of 80.0 GiB (6%), 10.0 GiB reserved; 1 OOM(s)",
                                                  "rank 0: peak 77.0 GiB of 80.0 GiB (96%), 78.0 GiB reserved"]


def test_mem002_silent_just_under_capacity_share_and_for_cached_memory():
    silent("MEM002", facts([node()], [rank(0, last=_cuda(75.9 * GIB, 70 * GIB, peak=75.9 * GIB))]))
    # Reserved by the caching allocator but never allocated at once: not an OOM risk of its own.
    silent("MEM002", facts([node()], [rank(0, last=_cuda(79.5 * GIB, 60 * GIB, peak=70 * GIB))]))


def test_mem002_not_run_without_gpu_capacity():
    not_run("MEM002", facts(ranks=[rank(0, last=_cuda(77 * GIB, 70 * GIB))]), "GPU memory capacity unknown")


def _rss(values: list[float]) -> History:
    return History(host_rss_bytes=[(step_number, value) for step_number, value in enumerate(values, 1)])


def test_mem003_rss_growing_step_after_step():
    leak = _rss([GIB + n * 20 * 2**20 for n in range(50)])
    (finding,) = fired("MEM003", facts(ranks=[rank(0, history=leak), rank(1, history=_rss([GIB] * 50))]))
    (evidence,) = finding.evidence
    assert evidence.where.rank == 0 and "over steps 11–50, rising in 100% of them" in evidence.text


def test_mem003_silent_for_one_jump_small_growth_or_too_few_rising_steps():
    jump = _rss([GIB] * 25 + [2 * GIB] * 25)  # grew once (a cache filling), not step after step
    slow = _rss([GIB * (1 + 0.0026 * n) for n in range(50)])  # +9.9 % over the 40 judged steps (11-50)
    # 31 of the 39 judged steps rise (79 %), by 1 % each: grows a lot, but not step after step.
    deltas = [0.01 * GIB] * 31 + [0.0] * 8
    choppy = _rss([GIB] * 11 + [GIB + sum(deltas[:n]) for n in range(1, 40)])
    silent("MEM003", facts(ranks=[rank(0, history=jump), rank(1, history=slow), rank(2, history=choppy)]))


def test_mem003_not_run_from_a_single_snapshot():
    not_run("MEM003", facts(ranks=[rank(0, history=None)]), "one snapshot cannot show growth")


# -- convergence ------------------------------------------------------------------------------------


def test_conv001_fp16_without_scaler_names_gradscaler():
    history = History(loss=[(33, 2.1), (34, 2.0), (35, math.nan), (36, math.nan)])
    ranks = [rank(0, precision="fp16", history=history, nonfinite_steps=2, last=step(step=36, loss=math.nan))]
    (finding,) = fired("CONV001", facts(ranks=ranks))
    assert finding.severity is Severity.CRITICAL and "fp16 without a loss scaler" in finding.title
    assert finding.evidence[0].text == \
        "rank 0: loss nan at step 35; 2 non-finite step(s); precision fp16; no loss scaler"
    assert "GradScaler" in finding.fix


def test_conv001_silent_when_a_scaler_handles_overflow():
    scaled = step(loss=2.0, loss_scale=512.0)
    silent("CONV001", facts(ranks=[rank(0, precision="fp16", nonfinite_steps=3, last=scaled)]))


def test_conv001_not_run_without_loss():
    not_run("CONV001", facts(ranks=[rank(0, last=step(loss=None))]), "step records lack loss")


def test_conv002_absolute_and_spike():
    (finding,) = fired("CONV002", facts(ranks=[rank(0, last=step(grad_norm=150.0))]))
    assert finding.title == "gradient norm explosion in job job-1: 150 at step 100"
    spike = History(grad_norm=[(n, 1.0) for n in range(30)] + [(30, 12.0)])
    (finding,) = fired("CONV002", facts(ranks=[rank(0, history=spike)]))
    assert "grad norm 12 at step 30 (12x the running median 1)" in finding.evidence[0].text


def test_conv002_silent_below_both_thresholds():
    spike = History(grad_norm=[(n, 1.0) for n in range(30)] + [(30, 9.9)])
    silent("CONV002", facts(ranks=[rank(0, last=step(grad_norm=99.0)), rank(1, history=spike)]))


def test_conv002_not_run_without_grad_norm():
    not_run("CONV002", facts(ranks=[rank(0, last=step(grad_norm=None))]), "grad_norm")


def _checksums(values: list, steps: list | None = None) -> list[RankFacts]:
    steps = steps or [200] * len(values)
    return [rank(r, dp=len(values), param_checksum=Sampled(v, step=s))
            for r, (v, s) in enumerate(zip(values, steps, strict=True))]


def test_conv003_replica_diverged():
    (finding,) = fired("CONV003", facts(ranks=_checksums([1234.5, 1234.5, 1240.0, 1234.5])))
    assert finding.severity is Severity.CRITICAL
    assert finding.title == "DP replicas of job job-1 disagree at step 200: ranks 2 differ from rank 0"
    hex_sums = fired("CONV003", facts(ranks=_checksums(["abc1", "abc2"])))
    assert "rank 1 (dp 1): parameter checksum abc2" in texts(hex_sums)


def test_conv003_silent_within_tolerance_or_at_different_steps():
    silent("CONV003", facts(ranks=_checksums([1234.5, 1234.5 * (1 + 9.9e-6)])))
    silent("CONV003", facts(ranks=_checksums([1234.5, 999.0], steps=[200, 100])))


def test_conv003_not_run_without_checksums():
    not_run("CONV003", facts(ranks=[rank(r, dp=2) for r in range(2)]), "param_checksum")


def _cosines(values: list[float], tp: int = 1) -> list[RankFacts]:
    return [rank(r, tp=tp, dp=len(values) // tp, grad_cosine=Sampled(v, step=50)) for r, v in enumerate(values)]


def test_conv004_identical_gradients_across_replicas():
    (finding,) = fired("CONV004", facts(ranks=_cosines([1.0, 0.999999, 0.99999, 1.0])))
    assert "DistributedSampler" in finding.fix and len(finding.evidence) == 4


def test_conv004_silent_when_one_replica_differs():
    silent("CONV004", facts(ranks=_cosines([1.0, 0.999999, 0.99998, 1.0])))
    silent("CONV004", facts(ranks=_cosines([0.9990, 0.9989])))  # exploding gradients point alike, data differs
    silent("CONV004", facts(ranks=_cosines([math.nan, math.nan])))  # NaN gradients: CONV001's case, not duplicates


def test_conv004_not_run_without_cosine():
    not_run("CONV004", facts(ranks=[rank(r, dp=2) for r in range(2)]), "grad_cosine_similarity")


def test_conv005_out_of_band_is_info_only():
    (low,) = fired("CONV005", facts(ranks=_cosines([0.8, 0.79, 0.81, 0.8])))
    assert low.severity is Severity.INFO and "skewed" in low.title
    (high,) = fired("CONV005", facts(ranks=_cosines([0.97, 0.96, 0.97, 0.98])))
    assert high.severity is Severity.INFO and "batch larger than useful" in high.title


def test_conv005_silent_at_band_edges():
    silent("CONV005", facts(ranks=_cosines([0.85, 0.85])))
    silent("CONV005", facts(ranks=_cosines([math.nan, math.nan])))
    silent("CONV005", facts(ranks=_cosines([0.95, 0.95])))


def test_conv005_not_run_without_cosine():
    not_run("CONV005", facts(ranks=[rank(0)]), "grad_cosine_similarity")


def test_conv004_not_run_says_why_the_ranks_could_not_compute_a_cosine():
    """Zero gradients have no direction: the ranks say so, and the report passes it on instead of blaming the
    records for lacking a field."""
    zero = [rank(r, dp=2, unavailable={"grad_cosine_similarity": "zero_gradient"}) for r in range(2)]
    not_run("CONV004", facts(ranks=zero), "ranks 0-1 of job job-1 reported it unavailable: every gradient element "
                                         "was zero")


def test_conv004_fix_names_the_general_cause_not_one_framework():
    (finding,) = fired("CONV004", facts(ranks=_cosines([1.0, 1.0])))
    assert "every data-parallel rank must draw different data" in finding.fix
    assert "seed or offset each rank's sampling" in finding.fix


@pytest.mark.parametrize(("fields", "sign"), [
    ({"loss_min": 0.0, "loss_max": 0.0}, "loss 0 at all 20 steps"),
    ({"loss_min": 2.302585, "loss_max": 2.302585}, "loss 2.30259 at all 20 steps"),
    ({"grad_norm_max": 0.0}, "gradient norm 0 at all 20 steps"),
    ({"checksums": 3, "distinct_checksums": 1}, "parameter checksum unchanged over 3 measurements"),
])
def test_conv006_a_model_that_does_not_learn(fields, sign):
    ranks = [rank(r, dp=2, window=window(step(), **fields)) for r in range(2)]
    (finding,) = fired("CONV006", facts(ranks=ranks))
    assert finding.severity is Severity.CRITICAL
    assert finding.title == "job job-1 is not learning: ranks 0-1 show no change in loss, gradients or parameters"
    assert sign in finding.evidence[0].text and "window: 20 steps (81-100, 10 s)" in finding.evidence[0].text
    assert "one logit per class" in finding.fix and "learning rate is not 0" in finding.fix


def test_conv006_silent_while_the_model_learns_or_the_window_is_short():
    silent("CONV006", facts(ranks=[rank(r, dp=2) for r in range(2)]))
    # a loss that moves by more than rounding; a first measured checksum alone shows no change
    silent("CONV006", facts(ranks=[rank(0, window=window(step(), loss_min=2.0, loss_max=2.0 + 1e-5, checksums=1,
                                                         distinct_checksums=1))]))
    short = [rank(0, window=window(step(), steps=4, loss_min=0.0, loss_max=0.0, grad_norm_max=0.0))]
    not_run("CONV006", facts(ranks=short), "fewer than 5 steps")


# -- topology ---------------------------------------------------------------------------------------


def _groups(shared: bool) -> list[RankFacts]:
    ranks = []
    for r in range(4):  # pp=2 × dp=2, tp=1: rank = stage * 2 + dp
        stage, dp = r // 2, r % 2
        pp_group = [dp, 2 + dp]
        dp_group = [stage * 2, stage * 2 + 1]
        groups = {"pp": [0, 1, 2, 3], "dp": [0, 1, 2, 3]} if shared else {"pp": pp_group, "dp": dp_group}
        ranks.append(rank(r, pp=2, dp=2, process_groups=groups))
    return ranks


def test_topo001_shared_pp_and_dp_group():
    (finding,) = fired("TOPO001", facts(ranks=_groups(shared=True)))
    assert finding.severity is Severity.CRITICAL and "new_group" in finding.fix
    assert finding.evidence[0].text == "rank 0: pipeline group [0-3] and data-parallel group [0-3] for pp=2, dp=2"


def test_topo001_silent_with_separate_groups():
    silent("TOPO001", facts(ranks=_groups(shared=False)))


def test_topo001_not_run_without_process_groups():
    not_run("TOPO001", facts(ranks=[rank(r, pp=2, dp=2) for r in range(4)]), "process_groups")


def test_topo002_tp_group_across_nodes():
    # tp=4 with 2 GPUs per node: each TP group straddles two nodes.
    ranks = [rank(r, tp=4, dp=2, host=f"node-{r // 2}") for r in range(8)]
    (finding,) = fired("TOPO002", facts(ranks=ranks))
    assert finding.evidence[0].text == "TP group of stage 0, dp 0: ranks 0-1 on node-0, ranks 2-3 on node-1"
    assert finding.title == "2 tensor-parallel group(s) of job job-1 span nodes (tp=4)"


def test_topo002_silent_when_tp_stays_inside_nodes():
    silent("TOPO002", facts(ranks=[rank(r, tp=4, dp=2, host=f"node-{r // 4}") for r in range(8)]))


def test_topo002_not_run_without_placement():
    not_run("TOPO002", facts(ranks=[rank(0, tp=2, host=None)]), "hostname")


@hypothesis.given(st.lists(st.sampled_from([0.01, 0.5, 1.0]) | st.floats(0.001, 10), min_size=2, max_size=40))
def test_medians_of_others_match_the_median_of_each_rank_s_peers(values):
    """PERF002 judges each rank against its peers without itself; the one-sort shortcut must agree with the
    plain definition, ties included."""
    expected = [statistics.median(values[:i] + values[i + 1:]) for i in range(len(values))]
    assert medians_of_others(values) == pytest.approx(expected)


def test_ranks_measured_from_outside_without_a_known_layout_are_not_compared_as_peers_and_say_why():
    """`gpuwatch run` on a job without a DDP model over every rank: its ranks' layout is not the job's (a pipeline's
    stages would read as replicas), so the rules that compare peers do not run, and say so."""
    slow = step(compute_seconds=3.0, step_seconds=3.5)
    outside = [rank(r, dp=2, layout=None, unavailable_from_outside=("layout",),
                    param_checksum=Sampled(float(r), step=10), **({"last": slow} if r == 1 else {})) for r in (0, 1)]
    for code in ("PERF002", "CONV003"):
        not_run(code, facts(ranks=outside), "measured from outside (gpuwatch run)")
