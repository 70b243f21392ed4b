"""The shared number formats: each one's steps between units, and the inputs at the edges (0, negative, None)."""

from __future__ import annotations

from dutycycle.engine import numbers


def test_rate_three_figures_in_k_and_m():
    assert [numbers.rate(x) for x in (0, 28.7, 538, 1040, 11_000, 338_000, 2_500_000)] == \
        ["0.00", "28.7", "538", "1.04k", "11.0k", "338k", "2.50M"]


def test_thousands_and_unmeasured():
    assert numbers.thousands(None) == "?"
    assert [numbers.thousands(x) for x in (0, 999.4, 1000, 12_345, -5)] == ["0", "999", "1.0k", "12.3k", "-5"]


def test_seconds_steps_through_units():
    assert numbers.seconds(None) == "-"
    assert [numbers.seconds(x) for x in (0, 0.0004, 0.0044, 0.027, 2.68, 14.6, 212)] == \
        ["0 µs", "400 µs", "4.4 ms", "27 ms", "2.68 s", "14.6 s", "3 min 32 s"]
    assert numbers.seconds(3600) == "60 min 0 s"


def test_seconds_plain_and_figure():
    assert numbers.seconds_plain(15.163434147000771) == "15.2 s"
    assert numbers.seconds_plain(0.0081) == "0.0081 s" and numbers.seconds_plain(0) == "0 s"
    assert numbers.figure(0.123456) == "0.123" and numbers.figure(12_345.0) == "1.23e+04"
    assert numbers.figure(-2.5) == "-2.5"


def test_millis():
    assert [numbers.millis(x) for x in (0, 4.44, 27.3)] == ["0.0 ms", "4.4 ms", "27 ms"]


def test_sizes_in_binary_units():
    assert [numbers.size(x) for x in (0, 512, 2048, 84.3 * 2**20, 651 * 2**20, 2.35 * 2**30)] == \
        ["0 B", "512 B", "2.00 KiB", "84.3 MiB", "651 MiB", "2.35 GiB"]
    assert numbers.size(5000 * 2**30) == "5000 GiB"  # no unit above GiB: the figure grows
    assert numbers.mib(651) == "651 MiB" and numbers.mib(0) == "0 B"


def test_megabytes_and_elements():
    assert [numbers.megabytes(x) for x in (0, 12 * 2**10, 2**20, 1536 * 2**20)] == \
        ["0 KB", "12 KB", "1 MB", "1,536 MB"]
    assert [numbers.elements(n) for n in (0, 4096, 2**22, 16 * 2**20)] == ["0K", "4K", "4M", "16M"]


def test_percent_decimals():
    assert [numbers.percent(x) for x in (0, 0.003, 0.64, 1.0, -0.5, -0.003)] == \
        ["0%", "0.3%", "64%", "100%", "-50%", "-0.3%"]
    assert numbers.percent(0.6412, digits=2) == "64.12%"
    assert numbers.share_interval(0.41, [0.35, 0.47]) == "41% (35%-47%)"


def test_ratio_count_gbit():
    assert [numbers.ratio(x) for x in (0, 0.0088, 0.1, 1.12, 20.4, 628, 12_345)] == \
        ["0x", "0.0088x", "0.10x", "1.12x", "20.4x", "628x", "12,345x"]
    assert [numbers.count(n) for n in (0, 12_345.6, -3)] == ["0", "12,346", "-3"]
    assert numbers.gbit(93.456) == "93.5 Gbit/s"
