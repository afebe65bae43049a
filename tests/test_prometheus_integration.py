
"""A real Prometheus server scrapes a real `gpuwatch agent --simulate` and answers queries on its series."""

import pytest

from conftest import wait_until

pytestmark = pytest.mark.integration


def test_prometheus_scrapes_simulated_dgx_h100(start_agent, prometheus_server):
    agent = start_agent("--simulate", "dgx-h100", "--interval", "0.5")
    prometheus = prometheus_server([f"127.0.0.1:{agent.port}"], scrape_interval="1s")

    up = wait_until(lambda: prometheus.query('up{job="gpuwatch"} == 1'), what="target up")
    assert len(up) == 1
    gpus = wait_until(lambda: prometheus.query("gpuwatch_gpu_info"), what="gpu info")
    assert {sample["metric"]["gpu"] for sample in gpus} == {str(i) for i in range(8)}
    assert all(sample["metric"]["model"] == "NVIDIA H100 80GB HBM3" for sample in gpus)
    assert len(prometheus.query("gpuwatch_nvlink_up == 1")) == 8 * 18
    assert len(prometheus.query('gpuwatch_ib_port_up{link_layer="InfiniBand"} == 1')) == 8
    assert prometheus.query('gpuwatch_agent_info{mode="simulated"}')

    # Counters really are counters: after a few scrapes rate() sees traffic on every link and port.
    nvlink_rate = wait_until(
        lambda: prometheus.query("sum(rate(gpuwatch_nvlink_transmitted_bytes_total[4s])) > 0"),
        what="nvlink rate")
    assert float(nvlink_rate[0]["value"][1]) > 0
    ib_rates = wait_until(lambda: prometheus.query("rate(gpuwatch_ib_port_received_bytes_total[4s]) > 0"),
                          what="ib rate")
    assert len(ib_rates) == 8
    # Ratios are in 0..1 as the metric conventions say.
    for sample in prometheus.query("gpuwatch_gpu_sm_active_ratio"):
        assert 0.0 <= float(sample["value"][1]) <= 1.0
