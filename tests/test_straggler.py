"""--log-straggler: the slowest and fastest replicas by ReCoVer's measured seconds per microbatch."""
from __future__ import annotations

from megatron.training.straggler import straggler_line


def test_the_report_names_the_slowest_and_fastest_replicas_against_the_median():
    timings = {0: 0.010, 1: 0.030, 2: 0.011, 3: None, 4: 0.012}
    line = straggler_line(timings, 1)
    assert line == ("stragglers (ms per microbatch, median 11.5): slowest replica 1 30.0 ms "
                    "(2.61x) | fastest replica 0 10.0 ms (0.87x)")
    two = straggler_line(timings, 2)
    assert "slowest replica 1 30.0 ms (2.61x), replica 4 12.0 ms" in two
    assert "fastest replica 0 10.0 ms (0.87x), replica 2 11.0 ms" in two


def test_nothing_to_compare_until_two_replicas_were_measured():
    assert straggler_line({0: 0.01, 1: None}, 1) is None
    assert straggler_line({}, 1) is None
