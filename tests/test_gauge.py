"""The flow's per-iteration record of what the process holds (flows.grpo.ProcessGauge)."""

import mmap
import sys

import pytest

from flows.grpo import ProcessGauge

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the per-iteration peak resets through /proc")

MB = 2**20


def _hold_and_free(megabytes: int) -> None:
    """Make ``megabytes`` resident, then give them back to the kernel (whatever the allocator)."""
    with mmap.mmap(-1, megabytes * MB) as block:
        for offset in range(0, len(block), mmap.PAGESIZE):
            block[offset] = 1


def test_the_iteration_peak_restarts_every_iteration_and_the_run_peak_keeps_the_maximum():
    gauge = ProcessGauge(reset_peaks=True)
    gauge.start_iteration()
    _hold_and_free(300)
    big = gauge.read()
    gauge.start_iteration()
    small = gauge.read()

    assert big["iteration_peak_rss_mb"] >= big["rss_mb"] + 250  # the freed 300 MB counted in its iteration
    assert small["iteration_peak_rss_mb"] <= big["iteration_peak_rss_mb"] - 250  # and not in the next one
    assert small["peak_rss_mb"] >= big["iteration_peak_rss_mb"]  # the run's maximum survives the reset
    assert small["open_files"] > 0 and small["child_processes"] >= 0


def test_without_reset_the_kernels_peak_is_left_alone_for_outside_tools():
    gauge = ProcessGauge()
    gauge.start_iteration()
    _hold_and_free(300)
    before = gauge.read()
    gauge.start_iteration()
    after = gauge.read()
    assert "iteration_peak_rss_mb" not in after
    assert ProcessGauge._high_water_mb() >= before["rss_mb"] + 250  # the freed 300 MB still in the high-water mark
    assert after["peak_rss_mb"] >= before["rss_mb"] + 250
