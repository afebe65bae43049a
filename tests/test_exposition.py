"""The fast renderer must produce exactly what prometheus-client's own generate_latest does."""

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, InfoMetricFamily
from prometheus_client.utils import floatToGoString

from gpuwatch.agent.exposition import CounterFamily, GaugeFamily, Renderer, format_value


def _families():
    gauge = GaugeMetricFamily("gpuwatch_test_ratio", "A ratio.\nWith a second line and a \\ backslash.",
                              labels=["gpu", "job"])
    gauge.add_metric(["0", 'evil"job\nwith}{newline\\'], 0.25)
    gauge.add_metric(["1", "plain"], math.nan)
    gauge.add_metric(["2", "plain"], math.inf)
    counter = CounterMetricFamily("gpuwatch_test_bytes", "Bytes.", labels=["link"])
    counter.add_metric(["3"], 12345678901234.0)
    histogram = HistogramMetricFamily("gpuwatch_test_seconds", "Latency.", labels=["op"])
    histogram.add_metric(["all_reduce"], buckets=[("0.1", 1.0), ("+Inf", 3.0)], sum_value=0.7)
    info = InfoMetricFamily("gpuwatch_test", "Info.", value={"version": "1"})
    unlabelled = GaugeMetricFamily("gpuwatch_test_plain", "No labels.", value=-1.5e-7)
    return [gauge, counter, histogram, info, unlabelled]


def _latest(families):
    registry = CollectorRegistry()
    registry.register(_Static(families))
    return generate_latest(registry)


class _Static:
    def __init__(self, families):
        self.families = families

    def collect(self):
        return self.families


def test_render_matches_prometheus_client_byte_for_byte():
    assert Renderer().render(_families()) == _latest(_families())


def test_rerender_after_changes_matches_prometheus_client():
    """Reused families, reused lines and re-formatted values together still give generate_latest's bytes."""
    renderer = Renderer()
    renderer.render(_families())
    changed = _families()
    changed[0].samples[1] = changed[0].samples[1]._replace(value=0.5)  # one value of three
    changed[1].samples[0] = changed[1].samples[0]._replace(value=7)  # an int, the fast formatting path
    changed[1].samples.append(changed[1].samples[0]._replace(labels={"link": "4"}, value=2_000_000))  # new series
    changed[3].documentation = "Info, documented anew."
    assert renderer.render(changed) == _latest(changed)
    assert renderer.render(_families()) == _latest(_families())


def test_unchanged_family_is_reused_without_formatting():
    renderer = Renderer()
    renderer.render(_families())
    cached = renderer._families["gpuwatch_test_seconds"]
    renderer.render(_families())
    assert renderer._families["gpuwatch_test_seconds"] is cached


def test_second_render_reuses_cache_and_forgets_vanished_series():
    renderer = Renderer()
    first = _families()
    renderer.render(first)
    gauge = GaugeMetricFamily("gpuwatch_test_ratio", "A ratio.", labels=["gpu"])
    gauge.add_metric(["7"], 1.0)
    text = renderer.render([gauge]).decode()
    assert 'gpuwatch_test_ratio{gpu="7"} 1.0' in text
    assert "gpuwatch_test_bytes" not in text
    # Only the live families stay cached: an expired rank or lost GPU does not leak memory.
    assert list(renderer._families) == ["gpuwatch_test_ratio"]
    assert renderer._families["gpuwatch_test_ratio"].keys == [("gpuwatch_test_ratio", {"gpu": "7"})]


def test_value_changes_between_renders_are_reflected():
    renderer = Renderer()
    for value in (1.0, 2.0):
        gauge = GaugeMetricFamily("gpuwatch_test_value", "V.", labels=["gpu"])
        gauge.add_metric(["0"], value)
        text = renderer.render([gauge]).decode()
    assert 'gpuwatch_test_value{gpu="0"} 2.0' in text
    assert 'gpuwatch_test_value{gpu="0"} 1.0' not in text


@given(st.one_of(st.floats(), st.integers(-10**20, 10**20), st.integers(10**6, 2**53 + 1),
                 st.floats(1e5, 1e17),  # the floats Go writes with an exponent from 1e6 up: clocks, FLOP/s
                 st.sampled_from([1e6, 999_999.9999999999, -1e300, 1e-5, -0.0, 1e300, -1e301, 10**6, 2**53 - 1, 2**53,
                                  2**53 + 1, 10**15, 4096 * 10**6, -10**7, 1e16, 9_999_999_999_999_998.0,
                                  1_000_000_040.0, 1_733_280_000.123456, 1.5e12])))
def test_format_value_writes_what_prometheus_client_writes(value):
    assert format_value(value) == floatToGoString(value)


def _row_families(ratio: float = 0.25, links: int = 1):
    """The collectors' families (GaugeFamily, CounterFamily) and prometheus-client's of the same series."""
    built = []
    for gauge_type, counter_type in ((GaugeFamily, CounterFamily), (GaugeMetricFamily, CounterMetricFamily)):
        gauge = gauge_type("gpuwatch_test_ratio", "A ratio.\nWith a \\ backslash.", labels=["gpu", "job"])
        gauge.add_metric(["0", 'evil"job\nwith}{newline\\'], ratio)
        gauge.add_metric(["1", "plain"], math.nan)
        counter = counter_type("gpuwatch_test_bytes_total", "Bytes.", labels=["link"])
        for link in range(links):
            counter.add_metric([str(link)], 12345678901234.0 + link)
        unlabelled = gauge_type("gpuwatch_test_plain", "No labels.", value=7)
        built.append([gauge, counter, unlabelled])
    return built


def test_row_families_render_as_prometheus_clients_families_do_and_give_the_same_samples():
    renderer = Renderer()
    for ratio, links in ((0.25, 1), (0.5, 1), (0.5, 3), (0.5, 3), (0.75, 2)):  # values, new series, none, gone
        rows, reference = _row_families(ratio, links)
        assert renderer.render(rows) == _latest(reference) == _latest(rows)
        assert [family.samples for family in rows] == [family.samples for family in reference]


def test_a_row_family_takes_its_series_only_through_add_metric():
    gauge = GaugeFamily("gpuwatch_test_ratio", "A ratio.", labels=["gpu"])
    with pytest.raises(TypeError, match="add_metric"):
        gauge.samples = [("gpuwatch_test_ratio", {"gpu": "0"}, 1.0)]
    with pytest.raises(ValueError, match="at most one"):
        GaugeFamily("gpuwatch_test_ratio", "A ratio.", labels=["gpu"], value=1.0)
