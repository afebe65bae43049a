"""`gpuwatch agent` as a user runs it: endpoints, real-path fallbacks, clean shutdown, usage errors."""

import gzip
import signal
import socket
import subprocess
import sys
import urllib.request

import pytest

from conftest import FIXTURES, http_get, require_tool, wait_until

CORE_SERIES = [
    "gpuwatch_agent_info", "gpuwatch_collector_up", "gpuwatch_collector_duration_seconds",
    "gpuwatch_gpu_info", "gpuwatch_gpu_utilization_ratio", "gpuwatch_gpu_sm_active_ratio",
    "gpuwatch_gpu_sm_occupancy_ratio", "gpuwatch_gpu_tensor_active_ratio", "gpuwatch_gpu_memory_used_bytes",
    "gpuwatch_gpu_memory_total_bytes", "gpuwatch_gpu_power_watts", "gpuwatch_gpu_temperature_celsius",
    "gpuwatch_gpu_sm_clock_hertz", "gpuwatch_gpu_clock_event_active", "gpuwatch_gpu_pcie_link_generation",
    "gpuwatch_gpu_pcie_link_width", "gpuwatch_gpu_xid_errors_total", "gpuwatch_nvlink_up",
    "gpuwatch_nvlink_transmitted_bytes_total", "gpuwatch_nvlink_received_bytes_total", "gpuwatch_ib_port_up",
    "gpuwatch_ib_port_rate_bytes_per_second", "gpuwatch_ib_port_transmitted_bytes_total",
    "gpuwatch_ib_port_received_bytes_total",
]


def _series_names(text: str) -> set[str]:
    return {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")}


@pytest.mark.integration
def test_simulated_node_serves_every_core_series_and_passes_promtool(start_agent):
    agent = start_agent("--simulate", "dgx-h100", "--interval", "0.5")
    # GPM activity needs two NVML samples, so it appears from the second sampling round on.
    def second_round() -> str | None:
        text = agent.get("/metrics").decode()
        return text if "gpuwatch_gpu_sm_active_ratio" in text else None

    text = wait_until(second_round, what="second sampling round")
    names = _series_names(text)
    missing = [name for name in CORE_SERIES if name not in names]
    assert not missing, missing
    assert 'mode="simulated"' in text
    assert "gpuwatch_agent_simulation_cpu_seconds_total " in text  # what the scripted node costs the process
    assert text.count("gpuwatch_gpu_info{") == 8
    assert text.count("gpuwatch_nvlink_up{") == 8 * 18
    assert text.count("gpuwatch_ib_port_up{") == 8
    check = subprocess.run([require_tool("promtool"), "check", "metrics"], input=text, capture_output=True,
                           text=True)
    assert check.returncode == 0 and not check.stdout.strip() and not check.stderr.strip(), check


def test_state_gzip_healthz_and_not_found(start_agent):
    agent = start_agent("--simulate", "dgx-h100", "--interval", "0.5")
    state = agent.state()
    assert state["agent"]["mode"] == "simulated"
    assert all(status["up"] for status in state["collectors"].values()), state["collectors"]
    assert len(state["facts"]["nvml"]["gpus"]) == 8
    request = urllib.request.Request(agent.url + "/metrics", headers={"Accept-Encoding": "gzip"})
    with urllib.request.urlopen(request) as response:
        assert response.headers["Content-Encoding"] == "gzip"
        assert b"gpuwatch_gpu_info" in gzip.decompress(response.read())
    assert http_get(agent.url + "/healthz")[0] == 200
    assert http_get(agent.url + "/nope")[0] == 404


def test_real_path_without_gpu_reports_nvml_down_and_serves_the_rest(start_agent):
    """This machine has no NVIDIA driver: the real pynvml raises NVMLError_LibraryNotFound."""
    agent = start_agent("--sysfs-root", str(FIXTURES / "procfs-infiniband" / "sys"), "--interval", "0.5")
    state = agent.state()
    assert state["agent"]["mode"] == "real"
    for name in ("nvml", "nvlink"):
        assert state["collectors"][name]["up"] is False
        assert "NVML" in state["collectors"][name]["last_error"]
    assert state["collectors"]["infiniband"]["up"] is True
    text = agent.get("/metrics").decode()
    assert 'gpuwatch_collector_up{collector="nvml"} 0.0' in text
    assert 'gpuwatch_ib_port_transmitted_bytes_total{device="mlx4_0",port="1"} 1.0603645318e+11' in text


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_clean_shutdown_on_signal(start_agent, sig):
    agent = start_agent("--simulate", "a100-roce", "--interval", "0.2")
    code, output = agent.stop(sig)
    assert code == 0, output
    assert "Traceback" not in output
    assert "shutting down" in output


def _run_cli(*args):
    return subprocess.run([sys.executable, "-m", "gpuwatch.cli.main", *args], capture_output=True, text=True,
                          timeout=30)


def test_usage_errors_exit_2_with_a_message():
    bad_listen = _run_cli("agent", "--listen", "localhost")
    assert bad_listen.returncode == 2 and "is not HOST:PORT" in bad_listen.stderr
    both = _run_cli("agent", "--simulate", "dgx-h100", "--sysfs-root", "/tmp")
    assert both.returncode == 2 and "--simulate generates its own sysfs tree" in both.stderr
    preset = _run_cli("agent", "--simulate", "nope")
    assert preset.returncode == 2 and "dgx-h100" in preset.stderr


def test_port_in_use_is_a_clear_error_not_a_traceback():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = _run_cli("agent", "--simulate", "a100-roce", "--listen", f"127.0.0.1:{port}")
    assert result.returncode == 1
    assert "cannot listen on 127.0.0.1" in result.stderr and "Traceback" not in result.stderr


def test_agent_and_cli_never_import_torch():
    code = ("import sys; sys.modules['torch'] = None\n"  # any import of torch would now raise
            "from gpuwatch.agent import cli, daemon, collectors, simulate\n"
            "from gpuwatch.cli.main import main\n"
            "from click.testing import CliRunner\n"
            "result = CliRunner().invoke(main, ['--help'])\n"
            "assert result.exit_code == 0, result.output\n"
            "assert 'agent' in result.output and 'train' in result.output, result.output\n"
            "result = CliRunner().invoke(main, ['agent', '--help'])\n"
            "assert result.exit_code == 0 and '--telemetry.socket' in result.output, result.output\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


def test_collector_switch_disables_a_collector(start_agent):
    agent = start_agent("--simulate", "a100-roce", "--interval", "0.5", "--no-collector.nvlink")
    collectors = agent.state()["collectors"]
    assert "nvlink" not in collectors and collectors["nvml"]["up"] is True
    assert "gpuwatch_nvlink_" not in agent.get("/metrics").decode()
