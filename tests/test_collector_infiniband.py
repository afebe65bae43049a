"""InfiniBand collector: against the real procfs sysfs fixture, against broken copies of it, and against
the simulated node's generated tree."""

import errno
import json
import os
import shutil
import socket
import threading
import time
from pathlib import Path

import pytest

from gpuwatch.agent.collectors import infiniband
from gpuwatch.agent.collectors.base import CollectorContext, CollectorError
from gpuwatch.agent.collectors.infiniband import InfinibandCollector
from gpuwatch.agent.collectors.readings import InfinibandReadings
from gpuwatch.agent.simulate import PRESETS
from gpuwatch.agent.simulate.sysfs import SimulatedSysfs
from gpuwatch.agent.snapshot import Snapshot

FIXTURE_SYS = Path(__file__).parent / "fixtures" / "procfs-infiniband" / "sys"
CLASS = "class/infiniband"


def collect(root):
    collector = InfinibandCollector(CollectorContext(sysfs_root=root))
    try:
        return collector.collect()
    finally:
        collector.close()


def values(result, sample_name):
    """{label values in family order: value} of one series name."""
    return {tuple(s.labels.values()): s.value
            for family in result.families for s in family.samples if s.name == sample_name}


@pytest.fixture
def fixture_copy(tmp_path):
    """A writable copy of the fixture, to break on purpose."""
    root = tmp_path / "sys"
    shutil.copytree(FIXTURE_SYS, root, symlinks=True)
    return root


def write(root, relative, text):
    (root / CLASS / relative).write_text(text + "\n")


# -- the real fixture -----------------------------------------------------------------------------

def test_byte_counters_are_the_words_times_four_as_procfs_expects():
    result = collect(FIXTURE_SYS)
    assert result.errors == []
    assert values(result, "gpuwatch_ib_port_transmitted_bytes_total") == {
        ("hfi1_0", "1"): 1094233306172,
        ("mlx4_0", "1"): 106036453180,
        ("mlx4_0", "2"): 106161427560,
        ("mlx5_0", "1"): 4 * 2880761508848,
    }
    received = values(result, "gpuwatch_ib_port_received_bytes_total")
    assert received[("hfi1_0", "1")] == 1380366808104
    assert received[("mlx4_0", "1")] == 8884894436
    assert received[("mlx4_0", "2")] == 9841747136
    assert values(result, "gpuwatch_ib_port_transmitted_packets_total")[("hfi1_0", "1")] == 568318856
    assert values(result, "gpuwatch_ib_port_transmit_wait_ticks_total") == {
        ("hfi1_0", "1"): 0, ("mlx4_0", "1"): 3599, ("mlx4_0", "2"): 3846, ("mlx5_0", "1"): 0,
    }


def test_rates_states_and_link_layer():
    result = collect(FIXTURE_SYS)
    assert values(result, "gpuwatch_ib_port_rate_bytes_per_second") == {
        ("hfi1_0", "1", "InfiniBand"): 12.5e9,  # 100 Gb/sec (4X EDR)
        ("mlx4_0", "1", "InfiniBand"): 5e9,  # 40 Gb/sec (4X QDR)
        ("mlx4_0", "2", "InfiniBand"): 5e9,
        ("mlx5_0", "1", "InfiniBand"): 3.125e9,  # 25 Gb/sec (1X EDR)
    }
    up = values(result, "gpuwatch_ib_port_up")
    assert set(up.values()) == {1} and len(up) == 4
    assert set(values(result, "gpuwatch_ib_port_state_id").values()) == {4}
    # The fixture's mlx5_0 really says "4: ACTIVE" in phys_state: the number is exported as read.
    assert values(result, "gpuwatch_ib_port_physical_state_id") == {
        ("hfi1_0", "1"): 5, ("mlx4_0", "1"): 5, ("mlx4_0", "2"): 5, ("mlx5_0", "1"): 4,
    }
    port = result.readings.ports[0]
    assert (port.device, port.port, port.state, port.state_id, port.phys_state) == ("hfi1_0", 1, "ACTIVE", 4, "LinkUp")
    assert port.transmitted_bytes == 1094233306172
    state = json.loads(Snapshot(0.0, [], {}, {"infiniband": result.readings}, {}).state_json)
    assert InfinibandReadings.from_dict(state["facts"]["infiniband"]) == result.readings


def test_device_info_including_the_omni_path_adapter_without_hca_type():
    info = values(collect(FIXTURE_SYS), "gpuwatch_ib_device_info")
    assert info == {
        ("hfi1_0", "HPE 100Gb 1-port OP101 QSFP28 x16 PCIe Gen3 with Intel Omni-Path Adapter",
         "1.27.0", "", ""): 1,
        ("mlx4_0", "SM_1141000001000", "2.31.5050", "MT4099", ""): 1,
        ("mlx5_0", "SM_2001000001034", "14.28.2006", "MT4118", "0a7f:bc12:45ef:d23b"): 1,
    }


def test_hw_counters_and_error_counters():
    result = collect(FIXTURE_SYS)
    hw = values(result, "gpuwatch_ib_port_hw_counters_total")
    assert {device for device, _, _ in hw} == {"mlx5_0"}
    assert hw[("mlx5_0", "1", "req_cqe_error")] == 3481
    assert hw[("mlx5_0", "1", "rx_read_requests")] == 175528982
    assert ("mlx5_0", "1", "lifespan") not in hw  # a cache period in ms, not a counter
    assert len(hw) == 24
    errors = values(result, "gpuwatch_ib_port_errors_total")
    assert len(errors) == 4 * 12 and set(errors.values()) == {0}
    assert ("mlx4_0", "2", "symbol_error") in errors
    # unicast/multicast exist only in the extended counter group (mlx5 here).
    unicast = values(result, "gpuwatch_ib_port_transmitted_unicast_packets_total")
    assert unicast == {("mlx5_0", "1"): 10907922116}
    assert values(result, "gpuwatch_ib_port_counter_saturated") == {}


# -- driver quirks cost one value -----------------------------------------------------------------

def test_no_pma_and_unreadable_files_cost_one_value_each(fixture_copy, monkeypatch):
    write(fixture_copy, "mlx4_0/ports/1/counters/port_xmit_data", "N/A (no PMA)")
    rate = fixture_copy / CLASS / "mlx4_0/ports/2/rate"
    rate.unlink()
    rate.mkdir()  # reading it fails with EISDIR, a real OSError
    einval = str(fixture_copy / CLASS / "mlx5_0/ports/1/counters/symbol_error")
    real_read = infiniband.SysfsFiles.read

    def read(files, path, inode):
        if path == einval:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_read(files, path, inode)

    monkeypatch.setattr(infiniband.SysfsFiles, "read", read)
    result = collect(fixture_copy)

    assert len(result.errors) == 3
    assert any("mlx4_0/ports/1/counters/port_xmit_data: unexpected content 'N/A (no PMA)'" in e
               for e in result.errors)
    assert any("mlx4_0/ports/2/rate: Is a directory" in e for e in result.errors)
    assert any(e.startswith(einval) and "Invalid argument" in e for e in result.errors)
    transmitted = values(result, "gpuwatch_ib_port_transmitted_bytes_total")
    assert ("mlx4_0", "1") not in transmitted and transmitted[("mlx4_0", "2")] == 106161427560
    assert values(result, "gpuwatch_ib_port_received_bytes_total")[("mlx4_0", "1")] == 8884894436
    assert ("mlx4_0", "2", "InfiniBand") not in values(result, "gpuwatch_ib_port_rate_bytes_per_second")
    assert values(result, "gpuwatch_ib_port_up")[("mlx4_0", "2", "InfiniBand")] == 1
    errors = values(result, "gpuwatch_ib_port_errors_total")
    assert ("mlx5_0", "1", "symbol_error") not in errors and ("mlx5_0", "1", "link_downed") in errors
    assert len(values(result, "gpuwatch_ib_port_up")) == 4


def test_unparsable_state_costs_the_state_not_the_port(fixture_copy):
    write(fixture_copy, "hfi1_0/ports/1/state", "garbage")
    result = collect(fixture_copy)
    assert ("hfi1_0", "1", "InfiniBand") not in values(result, "gpuwatch_ib_port_up")
    assert values(result, "gpuwatch_ib_port_transmitted_bytes_total")[("hfi1_0", "1")] == 1094233306172
    assert (result.readings.ports[0].state, result.readings.ports[0].state_id) == (None, None)
    assert result.errors == [f"{fixture_copy / CLASS}/hfi1_0/ports/1/state: unexpected content 'garbage'"]


# -- counter widths ---------------------------------------------------------------------------------

def test_saturated_32_bit_counters_are_flagged_and_not_exported(fixture_copy):
    write(fixture_copy, "mlx4_0/ports/1/counters/port_xmit_data", str(2**32 - 1))
    write(fixture_copy, "mlx4_0/ports/1/counters/symbol_error", str(2**16 - 1))
    write(fixture_copy, "mlx4_0/ports/1/counters/link_downed", str(2**8 - 2))  # one below: still counting
    result = collect(fixture_copy)
    assert values(result, "gpuwatch_ib_port_counter_saturated") == {
        ("mlx4_0", "1", "symbol_error"): 1, ("mlx4_0", "1", "port_xmit_data"): 1,
    }
    assert ("mlx4_0", "1") not in values(result, "gpuwatch_ib_port_transmitted_bytes_total")
    errors = values(result, "gpuwatch_ib_port_errors_total")
    assert ("mlx4_0", "1", "symbol_error") not in errors
    assert errors[("mlx4_0", "1", "link_downed")] == 254
    port = next(p for p in result.readings.ports if (p.device, p.port) == ("mlx4_0", 1))
    assert port.transmitted_bytes is None
    assert port.saturated == ("symbol_error", "port_xmit_data")
    assert result.errors == []


def test_extended_group_data_counters_are_64_bit_even_at_the_32_bit_maximum(fixture_copy):
    # mlx5_0 has unicast_* files: the kernel chose the extended group, port_xmit_data is 64-bit.
    write(fixture_copy, "mlx5_0/ports/1/counters/port_xmit_data", str(2**32 - 1))
    result = collect(fixture_copy)
    assert values(result, "gpuwatch_ib_port_transmitted_bytes_total")[("mlx5_0", "1")] == 4 * (2**32 - 1)
    assert values(result, "gpuwatch_ib_port_counter_saturated") == {}


def test_pre_4_5_kernels_counters_ext_is_preferred(fixture_copy):
    write(fixture_copy, "mlx4_0/ports/1/counters/port_xmit_data", str(2**32 - 1))
    ext = fixture_copy / CLASS / "mlx4_0/ports/1/counters_ext"
    ext.mkdir()
    (ext / "port_xmit_data_64").write_text("123456789012\n")
    (ext / "port_unicast_xmit_packets").write_text("777\n")
    result = collect(fixture_copy)
    assert values(result, "gpuwatch_ib_port_transmitted_bytes_total")[("mlx4_0", "1")] == 4 * 123456789012
    assert values(result, "gpuwatch_ib_port_transmitted_unicast_packets_total") == {
        ("mlx4_0", "1"): 777, ("mlx5_0", "1"): 10907922116,
    }
    assert values(result, "gpuwatch_ib_port_counter_saturated") == {}


def test_a_counter_reset_is_exported_as_read_so_prometheus_sees_a_reset_not_a_spike(fixture_copy):
    """perfquery -R or a driver reload: the value drops. Exporting it as read is what rate() expects; a
    wrapped or agent-accumulated value would be a jump of ~2**64 or a stale total."""
    counter = "mlx5_0/ports/1/counters/port_xmit_data"
    before = values(collect(fixture_copy), "gpuwatch_ib_port_transmitted_bytes_total")[("mlx5_0", "1")]
    write(fixture_copy, counter, "25")
    result = collect(fixture_copy)
    assert values(result, "gpuwatch_ib_port_transmitted_bytes_total")[("mlx5_0", "1")] == 100 < before
    assert result.errors == [] and values(result, "gpuwatch_ib_port_counter_saturated") == {}


def test_a_saturated_32_bit_counter_comes_back_from_zero_after_its_reset(fixture_copy):
    write(fixture_copy, "mlx4_0/ports/1/counters/port_xmit_data", str(2**32 - 1))
    assert ("mlx4_0", "1") not in values(collect(fixture_copy), "gpuwatch_ib_port_transmitted_bytes_total")
    write(fixture_copy, "mlx4_0/ports/1/counters/port_xmit_data", "7")  # perfquery -R, then traffic
    result = collect(fixture_copy)
    assert values(result, "gpuwatch_ib_port_transmitted_bytes_total")[("mlx4_0", "1")] == 28
    assert values(result, "gpuwatch_ib_port_counter_saturated") == {}


def test_a_device_removed_between_listing_and_reading_is_skipped_without_errors(fixture_copy):
    """In sysfs class/infiniband/X is a symlink into /sys/devices: a hot-removed HCA leaves a name
    that no longer leads anywhere while the scan is under way."""
    class_dir = fixture_copy / CLASS
    shutil.rmtree(class_dir / "hfi1_0")
    (class_dir / "hfi1_0").symlink_to(fixture_copy / "devices" / "pci0000:00" / "gone")
    result = collect(fixture_copy)
    assert result.errors == []
    assert {labels[0] for labels in values(result, "gpuwatch_ib_device_info")} == {"mlx4_0", "mlx5_0"}
    assert ("mlx5_0", "1") in values(result, "gpuwatch_ib_port_transmitted_bytes_total")


# -- attributes kept open between collects ----------------------------------------------------------

def open_fds():
    return len(os.listdir("/proc/self/fd"))


def test_a_collector_kept_across_rounds_sees_rewritten_and_replaced_files(fixture_copy):
    collector = InfinibandCollector(CollectorContext(sysfs_root=fixture_copy))
    collector.collect()
    write(fixture_copy, "mlx5_0/ports/1/counters/port_xmit_data", "25")  # in place, as a test edits a file
    replaced = fixture_copy / CLASS / "mlx4_0/ports/1/state"
    staged = replaced.with_name("state.new")
    staged.write_text("1: DOWN\n")
    os.replace(staged, replaced)  # a new inode, as the simulated tree writes
    result = collector.collect()
    assert values(result, "gpuwatch_ib_port_transmitted_bytes_total")[("mlx5_0", "1")] == 100
    assert values(result, "gpuwatch_ib_port_state_id")[("mlx4_0", "1")] == 1
    assert result.errors == []
    collector.close()


def test_open_files_are_closed_when_their_device_goes_and_at_close(fixture_copy):
    baseline = open_fds()
    collector = InfinibandCollector(CollectorContext(sysfs_root=fixture_copy))
    collector.collect()
    all_ports = open_fds() - baseline
    shutil.rmtree(fixture_copy / CLASS / "mlx5_0")
    result = collector.collect()
    assert "mlx5_0" not in {labels[0] for labels in values(result, "gpuwatch_ib_device_info")}
    assert 0 < open_fds() - baseline < all_ports
    collector.close()
    assert open_fds() == baseline


def test_a_file_whose_descriptor_went_bad_is_reopened(fixture_copy):
    files = infiniband.SysfsFiles()
    path = str(fixture_copy / CLASS / "mlx5_0/ports/1/counters/symbol_error")
    inode = os.stat(path).st_ino
    assert files.read(path, inode) == b"0\n"
    files.sweep()
    os.close(files._kept[path][0])  # as the kernel invalidates it after a hot unplug (EBADF / ENODEV)
    assert files.read(path, inode) == b"0\n"
    files.close()


def test_beyond_the_limit_files_are_opened_per_read(fixture_copy):
    files = infiniband.SysfsFiles(limit=2)
    baseline = open_fds()
    counters = fixture_copy / CLASS / "mlx5_0/ports/1/counters"
    listing = files.listdir(str(counters))
    texts = {name: files.read(str(counters / name), inode) for name, inode in listing.items()}
    assert texts == {path.name: path.read_bytes() for path in counters.iterdir()}
    assert open_fds() - baseline == 2
    files.close()
    assert open_fds() == baseline


def test_a_directory_listing_is_reused_while_the_directory_stands(tmp_path, monkeypatch):
    """Listing ~40 directories was half a round. A listing is reused while its directory's inode and mtime stand;
    it is made again when the mtime moves, when the directory was modified within RACY_SECONDS (a change inside the
    timestamps' granularity), after LISTING_TTL_SECONDS, and after a round that did not list it."""
    directory = tmp_path / "counters"
    directory.mkdir()
    (directory / "a").write_text("1\n")
    an_hour_ago = time.time() - 3600
    os.utime(directory, (an_hour_ago, an_hour_ago))
    now = [0.0]
    files = infiniband.SysfsFiles(clock=lambda: now[0])
    scans = []
    scandir = os.scandir
    monkeypatch.setattr(infiniband.os, "scandir", lambda path: (scans.append(path), scandir(path))[1])

    def rounds(count: int) -> dict[str, int]:
        for _ in range(count):
            names = files.listdir(str(directory))
            files.sweep()
        return names

    assert rounds(3) == {"a": (directory / "a").stat().st_ino} and len(scans) == 1
    (directory / "b").write_text("2\n")
    os.utime(directory, (an_hour_ago + 1, an_hour_ago + 1))  # modified, long ago: not racy
    assert set(rounds(3)) == {"a", "b"} and len(scans) == 2
    now[0] += infiniband.LISTING_TTL_SECONDS
    rounds(3)
    assert len(scans) == 3
    files.sweep()  # a round that did not list it: forgotten
    rounds(1)
    assert len(scans) == 4
    os.utime(directory)  # modified just now: listed every round until it is RACY_SECONDS old
    rounds(3)
    assert len(scans) == 7
    files.close()


def test_pread_at_offset_zero_regenerates_a_live_sysfs_attribute():
    """The premise of SysfsFiles, on this machine's /sys: a kept descriptor reads the current value."""
    path = "/sys/class/net/lo/statistics/tx_packets"
    if not os.path.exists(path):
        pytest.skip("no /sys/class/net/lo")
    files = infiniband.SysfsFiles()
    before = int(files.read(path, None))
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
        for _ in range(3):
            udp.sendto(b"x", ("127.0.0.1", 9))
    assert int(files.read(path, None)) >= before + 3
    files.close()


# -- no InfiniBand at all ---------------------------------------------------------------------------

def test_missing_class_directory_means_no_ports_not_an_error(tmp_path):
    """No device is no data, not a failure (up, no alert); it holds for a minute, so the sampler does not run the
    collector again until then, while a node with devices is read every round."""
    result = collect(tmp_path)
    assert result.errors == []
    assert result.readings == InfinibandReadings(devices=(), ports=())
    assert result.families and all(not family.samples for family in result.families)
    assert result.unchanged_for_seconds == infiniband.RESCAN_ABSENT_SECONDS
    (tmp_path / CLASS).mkdir(parents=True)  # the class directory without devices: the same
    assert collect(tmp_path).unchanged_for_seconds == infiniband.RESCAN_ABSENT_SECONDS
    assert collect(FIXTURE_SYS).unchanged_for_seconds is None


def test_unlistable_class_directory_is_a_collector_error(tmp_path):
    (tmp_path / "class").mkdir()
    (tmp_path / CLASS).write_text("not a directory")
    with pytest.raises(CollectorError, match="cannot list"):
        collect(tmp_path)


# -- the simulated node -----------------------------------------------------------------------------

@pytest.fixture
def dgx(tmp_path):
    return SimulatedSysfs(PRESETS["dgx-h100"], tmp_path / "sys", seed=3)


def test_simulated_dgx_h100_has_eight_active_ndr_ports(dgx):
    result = collect(dgx.root)
    assert result.errors == []
    rates = values(result, "gpuwatch_ib_port_rate_bytes_per_second")
    assert rates == {(f"mlx5_{i}", "1", "InfiniBand"): 50e9 for i in range(8)}  # 400 Gb/s
    assert set(values(result, "gpuwatch_ib_port_up").values()) == {1}
    assert {labels[3] for labels in values(result, "gpuwatch_ib_device_info")} == {"MT4129"}
    assert len(values(result, "gpuwatch_ib_port_hw_counters_total")) == 8 * 24
    assert (dgx.root / CLASS / "mlx5_0").is_symlink()  # like the kernel: class links into devices/


def test_simulated_counters_advance_at_a_plausible_share_of_line_rate(dgx):
    before = values(collect(dgx.root), "gpuwatch_ib_port_transmitted_bytes_total")
    dgx.advance(2.0)
    after = collect(dgx.root)
    for port, value in values(after, "gpuwatch_ib_port_transmitted_bytes_total").items():
        assert 0.25 * 50e9 * 2 < value - before[port] < 0.85 * 50e9 * 2
    assert values(after, "gpuwatch_ib_port_counter_saturated") == {}


def test_simulated_port_down_shows_up_zero_and_stops_traffic(dgx):
    dgx.set_port_down("mlx5_3", phys_state="Polling")
    before = collect(dgx.root)
    dgx.advance(1.0)
    after = collect(dgx.root)
    assert values(after, "gpuwatch_ib_port_up")[("mlx5_3", "1", "InfiniBand")] == 0
    assert values(after, "gpuwatch_ib_port_up")[("mlx5_2", "1", "InfiniBand")] == 1
    assert values(after, "gpuwatch_ib_port_state_id")[("mlx5_3", "1")] == 1
    assert values(after, "gpuwatch_ib_port_physical_state_id")[("mlx5_3", "1")] == 2
    assert values(after, "gpuwatch_ib_port_errors_total")[("mlx5_3", "1", "link_downed")] == 1
    transmitted = "gpuwatch_ib_port_transmitted_bytes_total"
    assert values(after, transmitted)[("mlx5_3", "1")] == values(before, transmitted)[("mlx5_3", "1")]
    dgx.set_port_up("mlx5_3")
    assert values(collect(dgx.root), "gpuwatch_ib_port_up")[("mlx5_3", "1", "InfiniBand")] == 1


def test_simulated_faults_error_burst_no_pma_removal_and_32_bit_counters(dgx):
    dgx.bump_counter("mlx5_1", "symbol_error", 5)
    dgx.bump_counter("mlx5_2", "link_error_recovery", 10**6)  # 8-bit: sticks at 255
    dgx.bump_counter("mlx5_1", "local_ack_timeout_err", 7)
    dgx.make_unavailable("mlx5_4", "port_rcv_data")
    dgx.remove_device("mlx5_7")
    dgx.use_32bit_counters("mlx5_5")
    dgx.advance(1.0)
    result = collect(dgx.root)

    assert values(result, "gpuwatch_ib_port_errors_total")[("mlx5_1", "1", "symbol_error")] == 5
    assert values(result, "gpuwatch_ib_port_hw_counters_total")[("mlx5_1", "1", "local_ack_timeout_err")] == 7
    assert len(result.errors) == 1 and "mlx5_4/ports/1/counters/port_rcv_data" in result.errors[0]
    assert ("mlx5_4", "1") not in values(result, "gpuwatch_ib_port_received_bytes_total")
    assert ("mlx5_4", "1") in values(result, "gpuwatch_ib_port_transmitted_bytes_total")
    assert "mlx5_7" not in {labels[0] for labels in values(result, "gpuwatch_ib_port_up")}
    assert len(values(result, "gpuwatch_ib_port_up")) == 7
    assert values(result, "gpuwatch_ib_port_counter_saturated") == {
        ("mlx5_2", "1", "link_error_recovery"): 1,
        ("mlx5_5", "1", "port_xmit_data"): 1, ("mlx5_5", "1", "port_rcv_data"): 1,
    }
    assert ("mlx5_5", "1") not in values(result, "gpuwatch_ib_port_transmitted_bytes_total")
    assert ("mlx5_5", "1") not in values(result, "gpuwatch_ib_port_transmitted_unicast_packets_total")
    with pytest.raises(KeyError, match="no counter"):
        dgx.bump_counter("mlx5_0", "not_a_counter")


def test_simulated_roce_preset_is_ethernet_link_layer_with_congestion_counters(tmp_path):
    sim = SimulatedSysfs(PRESETS["a100-roce"], tmp_path / "sys")
    before = values(collect(sim.root), "gpuwatch_ib_port_hw_counters_total")
    sim.advance(1.0)
    result = collect(sim.root)
    assert values(result, "gpuwatch_ib_port_rate_bytes_per_second") == {
        ("mlx5_0", "1", "Ethernet"): 12.5e9, ("mlx5_1", "1", "Ethernet"): 12.5e9,
    }
    cnp = ("mlx5_0", "1", "np_cnp_sent")
    assert values(result, "gpuwatch_ib_port_hw_counters_total")[cnp] > before[cnp]


def test_a_reader_never_sees_half_written_files(dgx):
    errors, stop = [], threading.Event()

    def read_forever():
        while not stop.is_set():
            errors.extend(collect(dgx.root).errors)

    reader = threading.Thread(target=read_forever)
    reader.start()
    try:
        for _ in range(10):
            dgx.advance(0.01)
    finally:
        stop.set()
        reader.join()
    assert errors == []


def test_simulated_tree_regenerates_its_own_root_but_never_a_foreign_one(tmp_path):
    root = tmp_path / "sys"
    first = SimulatedSysfs(PRESETS["dgx-h100"], root)
    first.remove_device("mlx5_0")
    SimulatedSysfs(PRESETS["dgx-h100"], root)
    assert (root / CLASS / "mlx5_0").exists()
    foreign = tmp_path / "elsewhere"
    foreign.mkdir()
    (foreign / "precious").write_text("keep me")
    with pytest.raises(FileExistsError):
        SimulatedSysfs(PRESETS["dgx-h100"], foreign)
    assert (foreign / "precious").read_text() == "keep me"
