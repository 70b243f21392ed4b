"""Each wait's share of the step projected from the worker count it was measured at to ``--scale N`` workers.

Data parallelism at a fixed global batch: N workers each take 1/N of every global batch. The models, per wait,
with the measured step as the unit (p the compute part, d, c, k the data, communication and checkpoint shares
measured at n workers):

- compute: each worker's part of the batch, p x n/N; the unexplained part of the step (verdict.py) with it;
- data: each worker loads its own part of the batch, so the wait shrinks with the compute, d x n/N (the share is
  unchanged);
- communication: a ring exchange sends (W-1)/W of the gradient (or parameter) bytes per rank at W ranks, at the
  link's bandwidth, so the exposed time is c x [(N-1)/N] / [(n-1)/n] (measured at n >= 2: the scaling
  experiment's N workers when it ran, else the configured count; from one worker there is no exchange to scale);
- checkpoint: every rank writes its shard of a sharded state (ZeRO stage >= 1), k x n/N; at stage 0 one full
  copy is written whatever N is, k;
- layout: the layout's host work per step (FSDP2's hooks, quantizing) is per parameter, not per sample: kept;
- failures: already at N (``failures.py``): the configured job's steps at the measured step time, failing
  N / n times as often (each worker at the same rate). A job that N workers finish sooner fails less in all, so
  the failures share at N is an upper bound where the step shrinks.

The projected step is the sum of the parts; each share is its part over it. Intervals move with their shares.
The models assume the per-rank link and storage bandwidth stay what they were where measured (one node here: a
cluster's cross-node links are usually slower, so communication is then a lower bound).
"""

from __future__ import annotations

MODELS = {
    "data": "each worker loads its own part of the global batch: the wait shrinks as the compute does (share kept)",
    "communication": "ring exchange: bytes per rank grow as (W-1)/W at the measured link bandwidth",
    "checkpoint": "sharded state (stage >= 1): each rank writes 1/W of it; stage 0: one full copy, W-independent",
    "layout": "the layout's host work per step (hooks, per-parameter bookkeeping): kept per step",
    "failures": "failures.py: the job's steps at the measured step, failing N/workers times as often (exact "
                "expectation for exponential failures; an upper bound where the step shrinks with N)",
}


def factors(*, measured_at: int, comm_measured_at: int, workers: int, zero_stage: int) -> dict[str, float | None]:
    """Seconds per step of each part at ``workers`` over its seconds where measured (None: cannot be projected)."""
    n, m, big = measured_at, comm_measured_at, workers
    shrink = n / big
    comm = ((big - 1) / big) / ((m - 1) / m) if m >= 2 else None
    return {"compute": shrink, "data": shrink, "unexplained": shrink, "communication": comm,
            "checkpoint": shrink if zero_stage >= 1 else 1.0}


def comm_measured_at(findings: dict, workers: int) -> int:
    """The worker count the communication share came from: the scaling experiment's, when it ran."""
    scaling = findings.get("scaling") or {}
    return scaling["workers"] if scaling.get("many") and "error" not in scaling else workers


def models(comm_measured_at: int) -> dict[str, str]:
    """Which model carried each wait to the projected count."""
    out = dict(MODELS)
    if comm_measured_at < 2:
        out["communication"] = ("measured at one worker: no exchange to scale, kept as measured; measure at two or "
                                "more (parallel.num_workers, or the scaling experiment)")
    return out


def project(shares: dict[str, float], intervals: dict[str, list[float]], *, measured_at: int,
            comm_measured_at: int, workers: int, zero_stage: int) -> tuple[dict, dict]:
    """``(shares, intervals)`` at ``workers``. ``failures`` passes through (it is modelled at ``workers``
    already); communication measured at one worker only stays as measured (``models`` says so)."""
    f = factors(measured_at=measured_at, comm_measured_at=comm_measured_at, workers=workers, zero_stage=zero_stage)
    if f["communication"] is None:
        f["communication"] = 1.0
    step_parts = {k: v for k, v in shares.items() if k != "failures"}
    compute = max(0.0, 1.0 - sum(step_parts.values()))
    new = {k: v * f.get(k, 1.0) for k, v in step_parts.items()}
    step = compute * f["compute"] + sum(new.values())
    if step <= 0:
        return dict(shares), dict(intervals)
    out = {k: v / step for k, v in new.items()}
    iv = {k: [lo * f.get(k, 1.0) / step, hi * f.get(k, 1.0) / step] for k, (lo, hi) in intervals.items()
          if k in step_parts}
    if "failures" in shares:
        out["failures"] = shares["failures"]
        iv["failures"] = intervals.get("failures", [shares["failures"]] * 2)
    return out, iv
