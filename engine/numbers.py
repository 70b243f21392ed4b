"""Numbers as people read them: durations, byte counts, shares, rates and ratios, formatted the same way in the
terminal lines, the HTML pages and the rendered docs. Standard library only, so every room can use it."""

from __future__ import annotations

KIB, MIB, GIB = 2**10, 2**20, 2**30


def _three_figures(v: float) -> str:
    """Three significant figures for 1 <= v < 1000 (fewer below 1): 338, 11.0, 1.04."""
    return f"{v:.0f}" if v >= 100 else f"{v:.1f}" if v >= 10 else f"{v:.2f}"


def rate(x: float) -> str:
    """A throughput (samples/s, images/s): 338k, 11.0k, 1.04k, 538, 28.7."""
    if x >= 1e6:
        return f"{x / 1e6:.2f}M"
    return f"{_three_figures(x / 1e3)}k" if x >= 1e3 else _three_figures(x)


def thousands(x: float | None) -> str:
    """A throughput in a verdict line: 12.3k at a thousand and over, whole numbers below; "?" when unmeasured."""
    if x is None:
        return "?"
    return f"{x / 1000:.1f}k" if x >= 1000 else f"{x:.0f}"


def seconds(x: float | None) -> str:
    """A duration given in seconds: 4.4 ms, 27 ms, 2.68 s, 14.6 s, 3 min 32 s; "-" when there is none."""
    if x is None:
        return "-"
    if x < 1e-3:
        return f"{x * 1e6:.0f} µs"
    if x < 0.01:
        return f"{x * 1e3:.1f} ms"
    if x < 1:
        return f"{x * 1e3:.0f} ms"
    if x < 10:
        return f"{x:.2f} s"
    if x < 60:
        return f"{x:.1f} s"
    minutes, rest = divmod(round(x), 60)
    return f"{minutes} min {rest} s"


def seconds_plain(x: float) -> str:
    """A duration always in seconds: 15.2 s at ten and over, three significant figures below (0.0081 s)."""
    return f"{x:.1f} s" if x >= 10 else f"{x:.3g} s"


def millis(x: float) -> str:
    """A duration already in milliseconds: 27 ms, 4.4 ms."""
    return f"{x:.0f} ms" if x >= 10 else f"{x:.1f} ms"


def figure(x: float) -> str:
    """A measured value without a unit: three significant figures, thousands separated (0.123, 1.23e+04)."""
    return f"{x:,.3g}"


def size(x: float) -> str:
    """A byte count in binary units, three significant figures: 84.3 MiB, 651 MiB, 2.35 GiB, 512 B."""
    for unit, scale in (("GiB", GIB), ("MiB", MIB), ("KiB", KIB)):
        if x >= scale:
            return f"{_three_figures(x / scale)} {unit}"
    return f"{x:.0f} B"


def mib(x: float) -> str:
    """A size already in MiB (the benchmarks record memory that way), as ``size`` writes it."""
    return size(x * MIB)


def megabytes(n: float) -> str:
    """A byte count in whole MB (binary: 2**20), or whole KB below one MB: 1,536 MB, 12 KB."""
    return f"{n / MIB:,.0f} MB" if n >= MIB else f"{n / KIB:,.0f} KB"


def elements(n: int) -> str:
    """A tensor length in Mi elements: 4M, 16M (K below one Mi)."""
    return f"{n / MIB:.0f}M" if n >= MIB else f"{n / KIB:.0f}K"


def percent(frac: float, digits: int | None = None) -> str:
    """A share of a whole: 64%, 0.3%; ``digits`` fixes the decimals (otherwise none at 10% and over or at 0)."""
    v = frac * 100
    if digits is None:
        digits = 0 if abs(v) >= 10 or v == 0 else 1
    return f"{v:.{digits}f}%"


def share_interval(share: float, interval: list[float]) -> str:
    """A share with its interval, in whole percent: 41% (35%-47%)."""
    return f"{share:.0%} ({interval[0]:.0%}-{interval[1]:.0%})"


def ratio(x: float) -> str:
    """A ratio: 628x, 20.4x, 1.12x, 0.0088x."""
    if x >= 100:
        return f"{x:,.0f}x"
    return f"{_three_figures(x)}x" if x >= 0.1 else f"{x:.2g}x"


def count(n: float) -> str:
    """A count, rounded, thousands separated: 12,345."""
    return f"{round(n):,}"


def gbit(x: float) -> str:
    """A network rate already in Gbit/s, three significant figures."""
    return f"{x:.3g} Gbit/s"
