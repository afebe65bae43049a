"""NVML collector, driven through the scripted stand-in for pynvml; and the stand-in's fidelity to the
real pynvml API (same functions, signatures, error classes and struct types), so it cannot drift."""

import inspect
import json
import time
from types import SimpleNamespace

import pynvml
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gpuwatch.agent.collectors.base import CollectorContext, CollectorError
from gpuwatch.agent.collectors.nvml import NvmlCollector
from gpuwatch.agent.collectors.readings import GpuProcessReading, GpuReading, NvmlReadings, PcieReading
from gpuwatch.agent.exposition import Renderer
from gpuwatch.agent.simulate import PRESETS, fake_nvml
from gpuwatch.agent.simulate.fake_nvml import FakeNvml
from gpuwatch.agent.snapshot import Snapshot

H100 = PRESETS["dgx-h100"]
GPUS = [str(index) for index in range(H100.gpu_count)]
SM_ACTIVE, SM_OCCUPANCY, TENSOR = (pynvml.NVML_GPM_METRIC_SM_UTIL, pynvml.NVML_GPM_METRIC_SM_OCCUPANCY,
                                   pynvml.NVML_GPM_METRIC_ANY_TENSOR_UTIL)
XID = "gpuwatch_gpu_xid_errors_total"
FAULT_XIDS = {"48", "63", "64", "74", "79", "92", "94", "95", "119", "120"}
POWER = "gpuwatch_gpu_power_watts"


def node(preset=H100, **kwargs):
    fake = FakeNvml(preset, seed=7, **kwargs)
    return fake, NvmlCollector(CollectorContext(nvml=fake, simulated=True))


def values(result, sample_name):
    """{label values in family order: value} of one series name."""
    return {tuple(s.labels.values()): s.value
            for family in result.families for s in family.samples if s.name == sample_name}


def gpu(result, index) -> GpuReading:
    return result.readings.gpus[index]


# -- activity: GPM or the utilisation fallback ----------------------------------------------------

def test_gpm_activity_is_averaged_between_the_previous_and_the_current_sample():
    fake, collector = node()
    first = collector.collect()
    assert gpu(first, 0).activity_source == "gpm"
    assert values(first, "gpuwatch_gpu_activity_source") == {(index, "gpm"): 1 for index in GPUS}
    assert values(first, "gpuwatch_gpu_sm_active_ratio") == {}  # one sample: nothing to compare yet

    before = dict(fake.gpus[0].activity)
    fake.advance(1.0)  # the GPU runs at `before` for 1 s, then its activity wanders
    second = collector.collect()
    after = dict(fake.gpus[0].activity)
    fake.advance(3.0)
    third = collector.collect()

    assert before[SM_ACTIVE] != after[SM_ACTIVE]
    for result, activity in ((second, before), (third, after)):
        for name, metric in (("sm_active", SM_ACTIVE), ("sm_occupancy", SM_OCCUPANCY),
                             ("tensor_active", TENSOR)):
            exported = values(result, f"gpuwatch_gpu_{name}_ratio")
            assert exported[("0",)] == pytest.approx(activity[metric] / 100)  # percent -> ratio
            assert set(exported) == {(index,) for index in GPUS}
            assert all(0 <= value <= 1 for value in exported.values())


def test_without_gpm_sm_activity_falls_back_to_the_utilization_rate_and_says_so():
    fake, collector = node(PRESETS["a100-roce"])
    collector.collect()
    fake.advance(1.0)
    result = collector.collect()
    assert [g.activity_source for g in result.readings.gpus] == ["utilization"] * 4
    assert values(result, "gpuwatch_gpu_activity_source") == {(str(i), "utilization"): 1 for i in range(4)}
    utilization = values(result, "gpuwatch_gpu_utilization_ratio")
    assert len(utilization) == 4 and all(0.5 < value <= 1 for value in utilization.values())
    assert values(result, "gpuwatch_gpu_sm_active_ratio") == utilization
    assert values(result, "gpuwatch_gpu_sm_occupancy_ratio") == {}
    assert values(result, "gpuwatch_gpu_tensor_active_ratio") == {}


def test_gpm_support_is_decided_per_gpu():
    fake, collector = node()
    fake.set_gpm_supported(False, gpu=1)
    collector.collect()
    fake.advance(1.0)
    result = collector.collect()
    sources = values(result, "gpuwatch_gpu_activity_source")
    assert sources[("1", "utilization")] == 1 and sources[("0", "gpm")] == 1
    assert ("1",) not in values(result, "gpuwatch_gpu_tensor_active_ratio")
    assert ("0",) in values(result, "gpuwatch_gpu_tensor_active_ratio")


# -- units ----------------------------------------------------------------------------------------

def test_values_are_exported_in_base_units():
    fake, collector = node()
    result = collector.collect()
    state = fake.gpus[3]
    assert values(result, "gpuwatch_gpu_memory_total_bytes")[("3",)] == 80 * 1024**3
    assert values(result, "gpuwatch_gpu_memory_used_bytes")[("3",)] == state.memory_used
    assert values(result, "gpuwatch_gpu_memory_reserved_bytes")[("3",)] == 512 * 1024**2
    assert values(result, POWER)[("3",)] == pytest.approx(state.power_mw / 1000)  # mW -> W
    assert 100 < values(result, POWER)[("3",)] <= H100.power_limit_watts
    assert values(result, "gpuwatch_gpu_temperature_celsius")[("3",)] == state.temperature
    assert values(result, "gpuwatch_gpu_sm_clock_hertz")[("3",)] == 1980e6  # MHz -> Hz
    assert values(result, "gpuwatch_gpu_memory_clock_hertz")[("3",)] == 2619e6
    assert gpu(result, 3).memory_total_bytes == 80 * 1024**3


def test_identity_is_labelled_on_gpu_info():
    fake, collector = node()
    result = collector.collect()
    info = values(result, "gpuwatch_gpu_info")
    assert (("3", fake.gpus[3].uuid, "00000000:4B:00.0", H100.gpu_model, H100.driver_version)) in info
    assert len(info) == 8
    assert result.readings.driver_version == H100.driver_version
    assert gpu(result, 3).pci_bus_id == "00000000:4B:00.0"


# -- health: throttling, PCIe, ECC, Xid -----------------------------------------------------------

def test_clock_event_reasons_are_decoded_one_series_per_reason():
    fake, collector = node()
    fake.set_clock_event_reasons(
        2, pynvml.nvmlClocksEventReasonSwPowerCap | pynvml.nvmlClocksEventReasonHwThermalSlowdown)
    result = collector.collect()
    reasons = {reason: value for (index, reason), value in
               values(result, "gpuwatch_gpu_clock_event_active").items() if index == "2"}
    assert reasons == {
        "gpu_idle": 0, "applications_clocks_setting": 0, "sw_power_cap": 1, "hw_slowdown": 0,
        "sync_boost": 0, "sw_thermal_slowdown": 0, "hw_thermal_slowdown": 1, "hw_power_brake": 0,
        "display_clocks_setting": 0,
    }
    assert gpu(result, 2).clock_event_reasons == ("sw_power_cap", "hw_thermal_slowdown")
    assert gpu(result, 0).clock_event_reasons == ()


def test_clock_reasons_come_from_the_throttle_name_on_drivers_before_r535():
    fake, collector = node()
    fake.fail("nvmlDeviceGetCurrentClocksEventReasons", pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
    fake.set_clock_event_reasons(1, pynvml.nvmlClocksEventReasonHwSlowdown)
    result = collector.collect()
    assert result.errors == []
    assert gpu(result, 1).clock_event_reasons == ("hw_slowdown",)
    assert values(result, "gpuwatch_gpu_clock_event_active")[("1", "hw_slowdown")] == 1


def test_pcie_link_trained_below_its_maximum_shows_current_and_max():
    fake, collector = node()
    fake.set_pcie_link(5, generation=3, width=8)
    result = collector.collect()
    generation = values(result, "gpuwatch_gpu_pcie_link_generation")
    width = values(result, "gpuwatch_gpu_pcie_link_width")
    assert (generation[("5", "current")], generation[("5", "max")]) == (3, 5)
    assert (width[("5", "current")], width[("5", "max")]) == (8, 16)
    assert generation[("0", "current")] == generation[("0", "max")] == 5
    assert gpu(result, 5).pcie == PcieReading(current_generation=3, max_generation=5, current_width=8, max_width=16,
                                              replays=0)
    assert values(result, "gpuwatch_gpu_pcie_replays_total")[("5",)] == 0


def test_ecc_errors_are_counters_and_an_uncorrectable_one_leaves_a_row_remap_pending():
    fake, collector = node()
    fake.inject_ecc(4, corrected=3, uncorrected=1)
    result = collector.collect()
    for counter in ("volatile", "aggregate"):
        ecc = values(result, f"gpuwatch_gpu_ecc_{counter}_errors_total")
        assert (ecc[("4", "corrected")], ecc[("4", "uncorrected")]) == (3, 1)
        assert (ecc[("0", "corrected")], ecc[("0", "uncorrected")]) == (0, 0)
    assert values(result, "gpuwatch_gpu_row_remap_pending")[("4",)] == 1
    assert values(result, "gpuwatch_gpu_row_remap_pending")[("0",)] == 0
    assert gpu(result, 4).remapped_rows.pending == 1
    assert gpu(result, 4).ecc_volatile.counts() == {"corrected": 3, "uncorrected": 1}
    kinds = {family.name: family.type for family in result.families}
    assert kinds["gpuwatch_gpu_ecc_volatile_errors"] == "counter"
    assert kinds["gpuwatch_gpu_ecc_aggregate_errors"] == "counter"


def occurred(result):
    return {labels: count for labels, count in values(result, XID).items() if count}


def test_fault_xids_start_at_zero_so_their_first_occurrence_counts():
    _, collector = node()
    result = collector.collect()
    assert values(result, XID) == {(index, code): 0 for index in GPUS for code in FAULT_XIDS}
    assert gpu(result, 0).xid_errors == {}


def _record_event_waits(monkeypatch, fake) -> list[int]:
    """The timeout of every nvmlEventSetWait_v2 call the collector makes from now on, in order."""
    waits = []
    wait = fake.nvmlEventSetWait_v2
    monkeypatch.setattr(fake, "nvmlEventSetWait_v2", lambda event_set, timeout: waits.append(timeout) or
                        wait(event_set, timeout))
    return waits


def test_xid_errors_count_per_gpu_and_code_and_accumulate(monkeypatch):
    fake, collector = node()
    waits = _record_event_waits(monkeypatch, fake)
    collector.collect()
    for index, code in ((2, 79), (2, 79), (2, 48), (6, 13)):
        fake.inject_xid(index, code)
    first = collector.collect()
    counts = occurred(first)
    assert counts == {("2", "79"): 2, ("2", "48"): 1, ("6", "13"): 1}
    assert len(values(first, XID)) == 8 * len(FAULT_XIDS) + 1  # Xid 13 (an application fault) joins
    assert occurred(collector.collect()) == counts  # drained once, never forgotten
    fake.inject_xid(2, 79)
    result = collector.collect()
    assert occurred(result)[("2", "79")] == 3
    assert gpu(result, 2).xid_errors == {"79": 3, "48": 1}
    assert gpu(result, 0).xid_errors == {} and gpu(result, 0).xid_watched is True
    assert set(waits) == {0}  # never blocks waiting for events


def test_an_xid_storm_is_drained_in_bounded_slices_and_every_event_is_counted(monkeypatch):
    """A GPU spewing Xids (a flapping NVLink, a dying board) must not stall a sampling round: each
    collect drains a bounded number of events, the rest wait for the next round, none is lost."""
    fake, collector = node()
    collector.collect()
    storm = 2500
    for _ in range(storm):
        fake.inject_xid(3, 74)
    waits = _record_event_waits(monkeypatch, fake)
    counts, calls = [], []
    for _ in range(3):
        counts.append(occurred(collector.collect()).get(("3", "74"), 0))
        calls.append(len(waits) - sum(calls))
    assert counts == [1000, 2000, 2500]  # nvml._MAX_EVENTS_PER_COLLECT per round, then the remainder
    assert calls == [1000, 1000, 501]  # the bound is what keeps a round short: the last one ends on an empty set
    assert occurred(collector.collect()) == {("3", "74"): storm}


def test_compute_processes_are_readings_and_memory_series():
    fake, collector = node()
    result = collector.collect()
    used = fake.gpus[0].memory_used
    assert gpu(result, 0).processes == (GpuProcessReading(pid=4242, used_memory_bytes=used),)
    assert values(result, "gpuwatch_gpu_process_memory_bytes")[("0", "4242")] == used


# -- failures ---------------------------------------------------------------------------------------

def test_without_a_driver_collect_fails_with_the_reason_until_the_driver_loads():
    """A node without a driver: every collect tries nvmlInit and fails with the reason (how often it is tried is
    the sampler's back-off); once the driver has loaded, the next collect succeeds."""
    fake, collector = node(library_missing=True)
    for _ in range(2):
        with pytest.raises(CollectorError, match="NVML library not found: no NVIDIA driver on this node"):
            collector.collect()
    fake.library_missing = False  # the driver finished loading
    assert len(collector.collect().readings.gpus) == 8


def test_a_gpu_lost_mid_run_is_reported_and_the_others_are_still_served():
    fake, collector = node()
    before = gpu(collector.collect(), 5)
    fake.inject_xid(5, 79)
    fake.lose_gpu(5)
    result = collector.collect()
    assert values(result, "gpuwatch_gpu_lost") == {(index,): int(index == "5") for index in GPUS}
    # Identity and Xid counts only: every value it would have to answer for now is unknown.
    assert gpu(result, 5) == GpuReading(index=5, lost=True, uuid=fake.gpus[5].uuid, pci_bus_id=before.pci_bus_id,
                                        model=H100.gpu_model, xid_watched=True, xid_errors={"79": 1})
    assert [error for error in result.errors if error.startswith("gpu 5:")] == ["gpu 5: GPU is lost"]
    assert set(values(result, POWER)) == {(index,) for index in GPUS if index != "5"}
    assert occurred(result) == {("5", "79"): 1}
    assert {labels[0] for labels in values(result, "gpuwatch_gpu_info")} == set(GPUS)


def test_a_gpu_lost_before_start_is_reported_lost():
    fake, collector = node()
    fake.lose_gpu(0)
    result = collector.collect()
    assert gpu(result, 0) == GpuReading(index=0, lost=True)  # no identity: never read
    assert gpu(result, 1).lost is False
    assert values(result, "gpuwatch_gpu_lost")[("0",)] == 1
    assert any(error.startswith("gpu 0:") for error in result.errors)
    assert len(values(result, POWER)) == 7


def test_an_unsupported_value_is_just_omitted():
    fake, collector = node()
    fake.fail("nvmlDeviceGetPowerUsage", pynvml.NVML_ERROR_NOT_SUPPORTED, gpu=1)
    result = collector.collect()
    assert result.errors == []
    assert ("1",) not in values(result, POWER) and ("0",) in values(result, POWER)
    assert gpu(result, 1).power_watts is None and gpu(result, 0).power_watts is not None
    assert ("1",) in values(result, "gpuwatch_gpu_temperature_celsius")


def test_any_other_nvml_error_costs_the_value_and_is_reported():
    fake, collector = node()
    fake.fail("nvmlDeviceGetComputeRunningProcesses", pynvml.NVML_ERROR_NO_PERMISSION)
    result = collector.collect()
    assert values(result, "gpuwatch_gpu_process_memory_bytes") == {}
    assert len(result.errors) == 8
    assert result.errors[0] == "gpu 0: nvmlDeviceGetComputeRunningProcesses: Insufficient Permissions"
    assert len(values(result, POWER)) == 8


def test_close_shuts_nvml_down():
    fake, collector = node()
    collector.collect()
    collector.close()
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        fake.nvmlDeviceGetCount()


# -- exposition -----------------------------------------------------------------------------------

def test_exposition_parses_with_help_on_every_family_and_readings_are_json():
    fake, collector = node()
    collector.collect()
    fake.inject_xid(0, 48)
    fake.advance(1.0)
    result = collector.collect()
    text = Renderer().render(result.families).decode()
    families = {family.name: family for family in text_string_to_metric_families(text)}
    contract = {"gpuwatch_gpu_info", "gpuwatch_gpu_utilization_ratio", "gpuwatch_gpu_sm_active_ratio",
                "gpuwatch_gpu_sm_occupancy_ratio", "gpuwatch_gpu_tensor_active_ratio",
                "gpuwatch_gpu_memory_used_bytes", "gpuwatch_gpu_memory_total_bytes",
                "gpuwatch_gpu_power_watts", "gpuwatch_gpu_temperature_celsius", "gpuwatch_gpu_sm_clock_hertz",
                "gpuwatch_gpu_clock_event_active", "gpuwatch_gpu_pcie_link_generation",
                "gpuwatch_gpu_pcie_link_width", "gpuwatch_gpu_xid_errors"}
    assert contract <= set(families)
    assert all(family.documentation for family in families.values())
    assert families["gpuwatch_gpu_xid_errors"].type == "counter"
    state = json.loads(Snapshot(0.0, [], {}, {"nvml": result.readings}, {}).state_json)
    assert state["facts"]["nvml"]["gpus"][0]["xid_errors"] == {"48": 1}
    assert NvmlReadings.from_dict(state["facts"]["nvml"]) == result.readings


# -- the stand-in is pynvml's shape -----------------------------------------------------------------

HOOKS = {"advance", "lose_gpu", "set_gpm_supported", "set_nvlink_up", "inject_nvlink_errors", "inject_xid",
         "inject_ecc", "set_clock_event_reasons", "set_pcie_link", "hang", "fail", "listens_for_xid", "fail_row_remap"}


def _parameters(function):
    return [(p.name, p.kind, p.default) for p in inspect.signature(function).parameters.values()]


def test_the_fake_offers_only_real_pynvml_functions_with_their_signatures():
    fake = FakeNvml(H100)
    public = {name for name, _ in inspect.getmembers(FakeNvml, callable) if not name.startswith("_")}
    assert public >= HOOKS
    functions = public - HOOKS
    assert len(functions) > 30
    for name in sorted(functions):
        real = getattr(pynvml, name, None)
        assert inspect.isfunction(real), f"{name} is not a pynvml function"
        assert _parameters(getattr(fake, name)) == _parameters(real), name
    with pytest.raises(AttributeError):
        fake.nvmlDeviceGetNvLinkUtilizationCounter  # noqa: B018 - real functions are never forwarded


def test_the_fake_raises_pynvml_errors_and_returns_pynvml_structs():
    fake = FakeNvml(H100)
    for name in ("NVMLError", "NVMLError_GpuIsLost", "NVMLError_NotSupported", "NVMLError_LibraryNotFound",
                 "NVMLError_Timeout"):
        assert getattr(fake, name) is getattr(pynvml, name)
    assert fake.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX == pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        fake.nvmlDeviceGetCount()
    with pytest.raises(pynvml.NVMLError_LibraryNotFound):
        FakeNvml(H100, library_missing=True).nvmlInit()

    fake.nvmlInit()
    handle = fake.nvmlDeviceGetHandleByIndex(0)
    assert isinstance(handle, pynvml.c_nvmlDevice_t)
    assert isinstance(fake.nvmlDeviceGetMemoryInfo(handle, pynvml.nvmlMemory_v2), pynvml.c_nvmlMemory_v2_t)
    assert isinstance(fake.nvmlDeviceGetMemoryInfo(handle), pynvml.c_nvmlMemory_t)
    assert isinstance(fake.nvmlDeviceGetUtilizationRates(handle), pynvml.c_nvmlUtilization_t)
    (tx,) = fake.nvmlDeviceGetFieldValues(handle, [(pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, 0)])
    assert isinstance(tx, pynvml.c_nvmlFieldValue_t)
    assert (tx.nvmlReturn, tx.valueType) == (pynvml.NVML_SUCCESS, pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG)
    with pytest.raises(pynvml.NVMLError_Timeout):
        fake.nvmlEventSetWait_v2(fake.nvmlEventSetCreate(), 0)
    fake.lose_gpu(1)
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        fake.nvmlDeviceGetHandleByIndex(1)
    fake.fail("nvmlDeviceGetPowerUsage", pynvml.NVML_ERROR_NOT_SUPPORTED)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        fake.nvmlDeviceGetPowerUsage(handle)


def test_a_scripted_hang_blocks_the_call_like_a_stuck_driver(monkeypatch):
    """Every call of the hung function blocks in the calling thread for the scripted time, until the hang ends.
    The fake's sleep is recorded instead of slept: the test proves the blocking, not the machine's speed."""
    fake, collector = node()
    collector.collect()
    sleeps = []
    monkeypatch.setattr(fake_nvml, "time", SimpleNamespace(sleep=sleeps.append, monotonic=time.monotonic))
    fake.hang("nvmlDeviceGetPowerUsage", 0.05)
    collector.collect()
    assert [seconds for seconds in sleeps if seconds] == [0.05] * len(GPUS)  # one blocked call per GPU
    sleeps.clear()
    fake.hang("nvmlDeviceGetPowerUsage", 0)
    collector.collect()
    assert not any(sleeps)


def test_the_fast_field_value_view_has_pynvml_s_layout():
    """field_values reads NVML's array through its own Structure: it must match c_nvmlFieldValue_t member for
    member, or every NVLink and PCIe field would be read from the wrong bytes."""
    import ctypes

    from gpuwatch.agent.collectors._nvml_common import _FieldValue

    real = pynvml.c_nvmlFieldValue_t
    assert ctypes.sizeof(_FieldValue) == ctypes.sizeof(real)
    assert [(name, getattr(_FieldValue, name).offset) for name, _ in real._fields_] == \
        [(name, getattr(real, name).offset) for name, _ in real._fields_]


def test_the_scripted_nvml_counts_the_cpu_time_of_its_outermost_calls_once():
    """What ``--simulate`` costs the agent's process is told apart from the agent's own work: each outermost call
    into the scripted NVML adds its thread's CPU time once, however many scripted functions it calls inside."""
    ticks = iter(range(1000))
    fake = FakeNvml(H100, cpu_clock=lambda: float(next(ticks)))
    fake.nvmlInit()
    handle = fake.nvmlDeviceGetHandleByIndex(0)
    assert fake.cpu_seconds == 2.0  # two calls, each read the clock at entry and exit: one tick apiece

    calls = []

    def nested(handle):
        calls.append(fake.nvmlDeviceGetName(handle))  # a scripted function calling another: one outermost call
        return fake.nvmlDeviceGetName(handle)

    fake.nvmlDeviceGetUUID = fake_nvml._nvml_function(lambda self, handle: nested(handle)).__get__(fake)
    fake.nvmlDeviceGetUUID(handle)
    assert fake.cpu_seconds == 3.0 and calls
