"""How much a measured figure moves from run to run, from the run's own samples: a bootstrap over the steps of a
short training run (a share of the step) or over windows of a measuring loop (a rate).

The verdict compares shares only beyond these intervals: one short run on a shared machine moved the demo's
communication share between 18% and 21% and flipped the verdict across the 20% line. A 90% interval is the
bootstrap's 5th and 95th percentiles; resampling uses a fixed seed, so the same samples give the same interval.
"""

from __future__ import annotations

import statistics

ROUNDS = 1000  # bootstrap resamples: enough for stable 5th/95th percentiles of a ratio of sums
WINDOWS = 10  # a measuring loop's samples are cut into this many consecutive windows, one rate each (with 5,
#               the bootstrap's 5th percentile of the median was often the slowest window itself)
PER_WINDOW = 3  # items per window at least: a prefetch queue handing over two batches at once read as infinite
MIN_ITEMS = 5 * PER_WINDOW  # a measuring loop runs at least this many items: five windows for a median
LOW, HIGH = 0.05, 0.95


def ratio_interval(parts: list[float], totals: list[float]) -> list[float]:
    """90% interval of ``sum(parts) / sum(totals)`` when the (part, total) pairs are resampled: the share of the
    step a wait takes, from its per-step rows."""
    import numpy as np

    p, t = np.asarray(parts, float), np.asarray(totals, float)
    if len(p) < 2:
        v = float(p.sum() / max(t.sum(), 1e-12))
        return [v, v]
    idx = np.random.default_rng(0).integers(0, len(p), (ROUNDS, len(p)))
    ratios = p[idx].sum(1) / np.maximum(t[idx].sum(1), 1e-12)
    return [float(np.quantile(ratios, LOW)), float(np.quantile(ratios, HIGH))]


def pooled_ratio(runs: list[dict], part: str) -> tuple[float, list[float]] | None:
    """``sum(part) / sum(step_s)`` over the steps of several runs of one measurement (each run's ``per_step``
    samples, as ``experiments.short_run`` records them), with its 90% interval; None when a run lacks them."""
    samples = [r.get("per_step") for r in runs]
    if not samples or any(not s or not s.get("step_s") for s in samples):
        return None
    parts = [x for s in samples for x in s[part]]
    totals = [x for s in samples for x in s["step_s"]]
    return sum(parts) / max(sum(totals), 1e-12), ratio_interval(parts, totals)


def median_interval(values: list[float]) -> list[float]:
    """90% interval of the median of ``values`` (window rates, step rates) under resampling."""
    import numpy as np

    v = np.asarray(values, float)
    if len(v) < 2:
        return [float(v[0]), float(v[0])] if len(v) else [0.0, 0.0]
    idx = np.random.default_rng(0).integers(0, len(v), (ROUNDS, len(v)))
    medians = np.median(v[idx], axis=1)
    return [float(np.quantile(medians, LOW)), float(np.quantile(medians, HIGH))]


def window_rates(durations: list[float], items_each: float) -> list[float]:
    """Items per second in up to ``WINDOWS`` consecutive windows of at least ``PER_WINDOW`` items each, for a loop
    whose i-th item took ``durations[i]``. Windows rather than single items: a prefetching loader hands over
    batches in bursts (several at once, then a wait), so one batch's time says little; several average it out."""
    n = len(durations)
    windows = max(1, min(WINDOWS, n // PER_WINDOW))
    cuts = [round(i * n / windows) for i in range(windows + 1)]
    return [(cuts[i + 1] - cuts[i]) * items_each / max(sum(durations[cuts[i]:cuts[i + 1]]), 1e-12)
            for i in range(windows)]


def rate_with_interval(durations: list[float], items_each: float) -> tuple[float, list[float]]:
    """The median window rate (a burst from another process slows one window, not the figure) and its interval."""
    rates = window_rates(durations, items_each)
    return statistics.median(rates), median_interval(rates)


TRIM = 0.1  # a trimmed mean leaves out this share of the samples at each end


def trimmed_mean(values) -> float:
    """The mean of ``values`` without the lowest and highest ``TRIM`` of them: a burst of other work slows a few
    samples and moves it little, while it still counts every sample between (a median jumps between the two
    modes of a step that is slowed beside a decoding pool one step in two)."""
    import numpy as np

    v = np.sort(np.asarray(values, float), axis=-1)
    k = int(v.shape[-1] * TRIM)
    return v[..., k:v.shape[-1] - k].mean(axis=-1)


def trimmed_ratio_interval(slow: list[float], fast: list[float]) -> list[float]:
    """90% interval of ``trimmed_mean(slow) / trimmed_mean(fast)`` when each sample is resampled on its own (two
    loops measured one after the other: the step beside the loader against the step alone)."""
    import numpy as np

    a, b = np.asarray(slow, float), np.asarray(fast, float)
    if len(a) < 2 or len(b) < 2:
        v = float(trimmed_mean(a) / max(trimmed_mean(b), 1e-12)) if len(a) and len(b) else 0.0
        return [v, v]
    rng = np.random.default_rng(0)
    ra = trimmed_mean(a[rng.integers(0, len(a), (ROUNDS, len(a)))])
    rb = trimmed_mean(b[rng.integers(0, len(b), (ROUNDS, len(b)))])
    ratios = ra / np.maximum(rb, 1e-12)
    return [float(np.quantile(ratios, LOW)), float(np.quantile(ratios, HIGH))]
