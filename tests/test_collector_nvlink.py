"""NVLink collector, driven through the scripted stand-in for pynvml."""

import itertools

import pynvml
import pytest

from gpuwatch.agent.collectors.base import CollectorContext, CollectorError
from gpuwatch.agent.collectors.nvlink import NvlinkCollector
from gpuwatch.agent.collectors.readings import NvlinkReading, NvlinkReadings
from gpuwatch.agent.simulate import PRESETS
from gpuwatch.agent.simulate.fake_nvml import FakeNvml

H100 = PRESETS["dgx-h100"]
LINKS = {(str(gpu), str(link)) for gpu in range(H100.gpu_count) for link in range(H100.nvlinks_per_gpu)}
TX = "gpuwatch_nvlink_transmitted_bytes_total"
RX = "gpuwatch_nvlink_received_bytes_total"
SPEED = "gpuwatch_nvlink_speed_bytes_per_second"


def node(preset=H100, **kwargs):
    fake = FakeNvml(preset, seed=3, **kwargs)
    return fake, NvlinkCollector(CollectorContext(nvml=fake, simulated=True))


def values(result, sample_name):
    """{label values in family order: value} of one series name."""
    return {tuple(s.labels.values()): s.value
            for family in result.families for s in family.samples if s.name == sample_name}


def answer_not_supported(monkeypatch, fake, *field_ids):
    """The driver answers NotSupported for these fields, as one that predates them does."""
    real = fake.nvmlDeviceGetFieldValues

    def get_field_values(handle, fieldIds):
        field_values = real(handle, fieldIds)
        for value in field_values:
            if value.fieldId in field_ids:
                value.nvmlReturn = pynvml.NVML_ERROR_NOT_SUPPORTED
        return field_values

    monkeypatch.setattr(fake, "nvmlDeviceGetFieldValues", get_field_values)


def test_every_link_of_every_gpu_is_up_at_its_rated_speed():
    _, collector = node()
    result = collector.collect()
    assert result.errors == []
    assert values(result, "gpuwatch_nvlink_up") == dict.fromkeys(LINKS, 1)
    assert values(result, SPEED) == dict.fromkeys(LINKS, 26_562 * 1_000_000)  # MB/s -> bytes/s
    assert len(result.readings.links) == 144
    assert result.readings.links[0] == NvlinkReading(
        gpu=0, link=0, up=True, speed_bytes_per_second=26_562_000_000,
        tx_bytes=values(result, TX)[("0", "0")], rx_bytes=values(result, RX)[("0", "0")],
        errors={"crc": 0, "replay": 0, "recovery": 0},
    )


def test_bytes_are_kib_times_1024_and_grow_at_a_plausible_rate():
    fake, collector = node()
    rounds = []
    for _ in range(3):
        rounds.append(collector.collect())
        fake.advance(1.0)
    for name in (TX, RX):
        series = [values(result, name) for result in rounds]
        assert set(series[-1]) == LINKS
        for before, after in itertools.pairwise(series):
            for key in LINKS:
                assert 1e9 < after[key] - before[key] < 26.562e9  # per second: busy, below the rated speed
    last = values(rounds[-1], TX)
    link = fake.gpus[4].links[9]  # the fake advanced once more since the last collect
    assert last[("4", "9")] % 1024 == 0
    assert last[("4", "9")] < link.tx_bytes


def test_a_link_going_down_reads_zero_and_stops_counting():
    fake, collector = node()
    fake.set_nvlink_up(3, 7, False)
    before = collector.collect()
    fake.advance(1.0)
    after = collector.collect()
    up = values(after, "gpuwatch_nvlink_up")
    assert up[("3", "7")] == 0
    assert sum(up.values()) == len(LINKS) - 1
    assert values(after, TX)[("3", "7")] == values(before, TX)[("3", "7")]
    assert values(after, TX)[("3", "6")] > values(before, TX)[("3", "6")]
    assert next(link for link in after.readings.links if (link.gpu, link.link) == (3, 7)).up is False


def test_link_errors_are_counters_per_kind():
    fake, collector = node()
    fake.inject_nvlink_errors(1, 4, crc=5, replay=2, recovery=1)
    result = collector.collect()
    errors = values(result, "gpuwatch_nvlink_errors_total")
    assert [errors[("1", "4", kind)] for kind in ("crc", "replay", "recovery")] == [5, 2, 1]
    assert errors[("1", "5", "crc")] == 0
    assert len(errors) == 3 * len(LINKS)
    assert {family.name: family.type for family in result.families}["gpuwatch_nvlink_errors"] == "counter"


def test_one_field_value_call_per_gpu_reads_every_link(monkeypatch):
    fake, collector = node()
    collector.collect()  # finds the links
    calls = []
    for name in ("nvmlDeviceGetFieldValues", "nvmlDeviceGetNvLinkState"):
        real = getattr(fake, name)
        monkeypatch.setattr(fake, name, lambda *args, name=name, real=real: calls.append(name) or real(*args))
    fake.set_nvlink_up(0, 1, False)
    result = collector.collect()
    assert calls == ["nvmlDeviceGetFieldValues"] * 8
    assert values(result, "gpuwatch_nvlink_up")[("0", "1")] == 0


def test_a_driver_without_the_state_field_asks_each_link(monkeypatch):
    fake, collector = node()
    answer_not_supported(monkeypatch, fake, pynvml.NVML_FI_DEV_NVLINK_GET_STATE)
    fake.set_nvlink_up(6, 17, False)
    result = collector.collect()
    assert result.errors == []
    assert values(result, "gpuwatch_nvlink_up") == {key: int(key != ("6", "17")) for key in LINKS}


def test_a_driver_without_per_link_speed_or_error_fields_falls_back_or_omits(monkeypatch):
    fake, collector = node()
    answer_not_supported(monkeypatch, fake, pynvml.NVML_FI_DEV_NVLINK_GET_SPEED,
                         pynvml.NVML_FI_DEV_NVLINK_ERROR_DL_CRC)
    result = collector.collect()
    assert result.errors == []
    assert values(result, SPEED) == dict.fromkeys(LINKS, 26_562_000_000)  # the speed all links share
    kinds = {labels[2] for labels in values(result, "gpuwatch_nvlink_errors_total")}
    assert kinds == {"replay", "recovery"}
    assert set(values(result, TX)) == LINKS


def test_a_gpu_without_nvlink_just_has_no_links():
    _, collector = node(PRESETS["a100-roce"])
    result = collector.collect()
    assert (list(result.families), result.readings, result.errors) == ([], NvlinkReadings(links=()), [])


def test_a_lost_gpu_loses_its_links_and_the_others_stay():
    fake, collector = node()
    collector.collect()
    fake.lose_gpu(2)
    result = collector.collect()
    assert set(values(result, "gpuwatch_nvlink_up")) == {key for key in LINKS if key[0] != "2"}
    assert result.errors == ["gpu 2: GPU is lost"]
    assert {link.gpu for link in result.readings.links} == {0, 1, 3, 4, 5, 6, 7}


def test_without_a_driver_collect_raises_the_reason():
    _, collector = node(library_missing=True)
    with pytest.raises(CollectorError, match="NVML library not found: no NVIDIA driver on this node"):
        collector.collect()
