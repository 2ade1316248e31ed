"""deltalens.io.usage: a task's wall time and the peak of resident memory while it ran, read by sampling."""

from __future__ import annotations

import sys
import time

import pytest
from support import resident_block

from deltalens.io.usage import Usage, rss_kb

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/statm")

MB = 1 << 20


def test_rss_is_what_the_kernel_reports():
    with open("/proc/self/status") as f:
        status = dict(line.split(":", 1) for line in f.read().splitlines() if ":" in line)
    assert abs(rss_kb() - int(status["VmRSS"].split()[0])) < 2048


def test_the_peak_of_a_block_sees_memory_it_held_and_freed():
    before = rss_kb()
    with Usage(every=0.01) as u:
        block = resident_block(300 * MB)  # written, so resident
        time.sleep(0.2)
        del block
        time.sleep(0.05)
    assert u.peak_rss_kb >= before + 250 * 1024  # the 300 MB were seen while held
    assert rss_kb() < u.peak_rss_kb - 250 * 1024  # and given back since: a peak, not the level at the end
    assert 0.25 <= u.wall_s < 5


def test_the_start_is_read_on_entry_and_memory_held_before_counts_in_the_peak():
    held = resident_block(200 * MB)  # resident before the block
    with Usage(every=0.01) as u:
        time.sleep(0.05)
    assert u.start_rss_kb >= 200 * 1024 and u.peak_rss_kb >= u.start_rss_kb
    assert u.peak_rss_kb - u.start_rss_kb < 50 * 1024  # the block itself added little
    del held


def test_gib_counts_1024_byte_kilobytes():
    from deltalens.io.usage import gib

    assert gib(9_856_000) == "9.40" and gib(1 << 20) == "1.00"


def test_the_reading_interval_is_checked():
    with pytest.raises(ValueError, match="every must be > 0"):
        Usage(every=0)
