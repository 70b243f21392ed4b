"""Work lost to failures, priced by the job: the fourth wait ("is the accelerator redoing work lost to
failures?") as a model a person can check by hand, exact for exponential failures.

The job: T seconds of training (its steps, ``run.max_steps`` or ``run.epochs`` of the training split, times the
measured step without saves) on N workers that each fail at lambda per worker-hour, independently, so the job
fails at L = N lambda (its mean time between failures M = 1 / L). A failure is noticed D seconds after it happens
(detection) and the worker group trains again R seconds later (restart: launch and restore); the work since the
newest commit is done again. A commit every tau seconds of training stalls the step C seconds (the save).

The exact expectation. The job is a chain of segments, each ending in a commit: floor(T / tau) segments of tau + C
and, when tau does not divide T, one of the rest + C (the trainer also commits at its last step); without
checkpoints one segment of T: a failure restarts the job from the start. A segment of w seconds is attempted until
one attempt runs w seconds without a failure. Failures are memoryless, so each attempt fails with probability
q = 1 - e^(-L w), independently, and the failed attempts are geometric in number with mean q / (1 - q) =
e^(L w) - 1. A failed attempt lasts the failure time t given t < w, whose mean is 1/L - w / (e^(L w) - 1), then
D + R. So

    E[segment] = w + (e^(L w) - 1) (1/L - w / (e^(L w) - 1) + D + R) = (e^(L w) - 1) (1/L + D + R)

and E[wall] is its sum over the segments; ETTR = T / E[wall]. Restart from zero is the one segment w = T:
(e^(L T) - 1) / L + (e^(L T) - 1)(D + R), which is T (1 + L T / 2 + ...) + L T (D + R) for L T << 1: a job much
shorter than M loses almost nothing, whatever M is. Failures during detection and restart are not counted (they
lengthen R, which is measured). The failures wait is the time that is neither training nor saving:
1 - (T + saves x C) / E[wall]; the saves are the checkpoint wait's.

The commit intervals (tau, training seconds between commits), all reported:

- Young (1974): sqrt(2 C M), from minimising the lost time to first order;
- Daly (2006): sqrt(2 C M) (1 + sqrt(C / (2 M)) / 3 + C / (18 M)) - C for C < 2 M, higher order;
- NVIDIA (Saxena, Hukerikar, Blaz, Raj, "Optimal Checkpoint Interval with Availability as an Objective Function",
  arXiv 2410.18124): maximising availability with the save time Ts = C, the mean time to failure Tf = M and the
  recovery time Tr = D + R, the period Tc = Ts + sqrt(2 (Tf + Tr) Ts + Ts^2); here tau = Tc - Ts. (Availability
  A = (1 - Ts / Tc) Tf / (Tf + Tr + Tc / 2), a period Tc of which Ts saves and half a period redone per failure:
  dA/dTc = 0 gives Tc^2 - 2 Ts Tc - 2 Ts (Tf + Tr) = 0.) It is Young's for C, D + R << M;
- exact: the whole number of steps between commits that minimises E[wall] above, searched numerically.

Each is rounded to whole steps and never longer than the job (a commit at its end only); the recommendation is the
one the exact model gives the best ETTR. No checkpoints at all is the recommendation when the exact ETTR without
them is within ``NO_CHECKPOINT_MARGIN`` of that best: a point of ETTR is less than the spread of the step time
that T is built on (a short run's step moves by a few percent from one run to the next on a shared machine), and a
checkpoint costs more than the stall the model counts (storage, and a background write's contention for the cores,
which the checkpoint experiment sees in the step).

The default lambda is the Llama 3 report's: 419 unexpected interruptions in 54 days of training on 16,384 GPUs
(Meta, "The Llama 3 Herd of Models", 2024, section 3.3.4), that is 419 / (54 * 24 * 16384) = 1.97e-5 per GPU-hour.
The default detection time is what Ray takes to notice the failure the product recovers from without help, a lost
node (``default_detect_s``); ``checkpoint.failure_detect_s`` sets another (a hang is noticed only at the
process-group timeout).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

import numpy as np

LLAMA3_RATE_PER_WORKER_HOUR = 419 / (54 * 24 * 16384)
# Ray's node health check (GCS): a node is declared dead after RAY_health_check_failure_threshold (5) missed
# checks RAY_health_check_period_ms (3,000) apart; Ray's defaults, read from ray._raylet.Config in Ray 2.58.1
RAY_NODE_CHECK_PERIOD_S = 3.0
RAY_NODE_CHECK_FAILURES = 5
SCAN = 100_000  # the exact search tries every step count up to this many at once (a few milliseconds)
NO_CHECKPOINT_MARGIN = 0.01  # ETTR points: no checkpoints when they gain less (the module docstring says why)
MODEL = ("exact for exponential failures: each segment of w seconds ending in a commit takes "
         "(e^(Lw) - 1)(1/L + D + R) in expectation, L = N lambda; no checkpoints = one segment of the whole job")


def default_detect_s(controller_poll_s: float) -> float:
    """Seconds from a failure to Ray Train acting on it, for a lost node: Ray's health check declares the node
    dead after its missed checks, and the Train controller sees its workers gone at its next poll
    (``ray.health_check_interval_s``). A crashed worker process is seen sooner (one poll); a hung collective only
    at the process group's timeout."""
    return RAY_NODE_CHECK_PERIOD_S * RAY_NODE_CHECK_FAILURES + controller_poll_s


@dataclass
class FailureCosts:
    save_s: float  # C: the step's stall per save (the configured mode, synchronous or asynchronous)
    restart_s: float  # R: from acting on a failure to the resumed step (worker group start, restore)
    step_s: float  # one optimizer step of the job, without saves
    detect_s: float  # D: from the failure to acting on it (default_detect_s, or checkpoint.failure_detect_s)
    rate_per_worker_hour: float = LLAMA3_RATE_PER_WORKER_HOUR

    @property
    def down_s(self) -> float:
        """Per failure, besides the work done again: detection and restart."""
        return self.detect_s + self.restart_s


def duration(seconds: float | None) -> str:
    """Seconds as a person reads a job's length or a time between failures: 90 s, 12 min, 5.2 h, 3.1 days."""
    if seconds is None or math.isinf(seconds):
        return "never"
    if seconds < 120:
        return f"{seconds:.0f} s" if seconds >= 10 else f"{seconds:.2g} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    if seconds < 172800:
        return f"{seconds / 3600:,.1f} h"
    return f"{seconds / 86400:,.1f} days" if seconds < 730 * 86400 else f"{seconds / (365 * 86400):,.1f} years"


def workers_text(n: int) -> str:
    return f"{n:,} worker" + ("" if n == 1 else "s")


def mtbf_s(workers: int, rate_per_worker_hour: float) -> float:
    """The job's mean time between failures, in seconds."""
    return math.inf if rate_per_worker_hour <= 0 else 3600.0 / (workers * rate_per_worker_hour)


# ------------------------------------------------------------------------------------------ the exact model


def _redo(x):
    """(e^x - 1 - x) / x: a segment's expected work done again over its length, at x = L w. A series below 1e-5,
    where the difference would cancel (its next term, x^3/24, is under 1e-11 of the value there)."""
    x = np.asarray(x, dtype=float)
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        direct = np.expm1(x) / np.where(x < 1e-5, 1.0, x) - 1.0
    return np.where(x < 1e-5, x / 2 + x * x / 6, direct)


def _segments(job_s: float, interval_s, save_s: float):
    """The segments of a plan as (length of the full ones, how many, length of the last one or 0): with a commit
    every ``interval_s`` seconds of training (None or 0: none, one segment of the whole job)."""
    if not interval_s or interval_s >= job_s:
        return 0.0, 0, job_s + (save_s if interval_s else 0.0)
    full = math.floor(job_s / interval_s * (1 + 1e-12))  # a whole number of intervals stays whole
    rest = job_s - full * interval_s
    return interval_s + save_s, full, (rest + save_s) if rest > 1e-9 * job_s else 0.0


def plan(job_s: float, rate_per_s: float, interval_s: float | None, save_s: float, down_s: float) -> dict:
    """The exact expectation for one plan: wall time, failures, work lost (redone, detection and restart), saves,
    ETTR and the failures' share of the wall time. ``rate_per_s``: the job's failure rate L; ``interval_s``:
    training seconds between commits (None: no checkpoints, a failure restarts the job from the start)."""
    w_full, n_full, w_last = _segments(job_s, interval_s, save_s)
    lengths = np.array([w_full, w_last])
    counts = np.array([n_full, 1 if w_last > 0 else 0])
    with np.errstate(over="ignore", invalid="ignore"):
        x = rate_per_s * lengths
        failures = float(np.sum(counts * np.expm1(x)))
        lost = float(np.sum(counts * (lengths * _redo(x) + np.expm1(x) * down_s)))
    saves = int(counts.sum()) if interval_s else 0
    busy = job_s + saves * save_s
    if not math.isfinite(lost):  # e^(L w) beyond a float: the job never ends
        return {"wall_s": None, "failures": None, "lost_s": None, "saves": saves, "ettr": 0.0, "failure_share": 1.0}
    wall = busy + lost
    return {"wall_s": wall, "failures": failures, "lost_s": lost, "saves": saves,
            "ettr": job_s / wall if wall > 0 else 1.0, "failure_share": lost / wall if wall > 0 else 0.0}


def _walls(steps: np.ndarray, job_steps: int, step_s: float, rate_per_s: float, save_s: float,
           down_s: float) -> np.ndarray:
    """E[wall] for a commit every ``steps`` steps (an array), all at once: the search's inner loop."""
    k = np.minimum(steps, job_steps).astype(float)
    full = np.floor(job_steps / k)
    rest = (job_steps - full * k) * step_s
    w_full, w_rest = k * step_s + save_s, np.where(rest > 0, rest + save_s, 0.0)
    with np.errstate(over="ignore", invalid="ignore"):
        def seg(w):
            x = rate_per_s * w
            return w + w * _redo(x) + np.expm1(x) * down_s
        out = full * seg(w_full) + np.where(w_rest > 0, seg(w_rest), 0.0)
    return np.where(np.isfinite(out), out, np.inf)


def best_every(job_steps: int, step_s: float, rate_per_s: float, save_s: float, down_s: float) -> int:
    """The whole number of steps between commits (1..job_steps) with the least E[wall]. Every count is tried up to
    ``SCAN`` steps; a longer job's best is searched on a log-spaced grid, then at every count from half to twice
    the grid's best (``SCAN`` evenly spaced where that is more). Not a local search alone: the last segment's extra
    save makes E[wall] jagged in the count (a count that divides the job saves one commit), so its minimum need not
    sit beside the smooth optimum."""
    if job_steps <= SCAN:
        near = np.arange(1, job_steps + 1)
    else:
        grid = np.unique(np.round(np.geomspace(1, job_steps, 512)).astype(np.int64))
        k = int(grid[int(np.argmin(_walls(grid, job_steps, step_s, rate_per_s, save_s, down_s)))])
        lo, hi = max(1, k // 2), min(job_steps, 2 * k)
        near = np.arange(lo, hi + 1) if hi - lo < SCAN else np.unique(np.linspace(lo, hi, SCAN).round().astype(np.int64))
    walls = _walls(near, job_steps, step_s, rate_per_s, save_s, down_s)
    return int(near[int(np.argmin(walls))])


# ----------------------------------------------------------------------------------- the closed-form intervals


def young_interval_s(save_s: float, mtbf: float) -> float:
    """Young (1974): sqrt(2 C M)."""
    return math.inf if math.isinf(mtbf) else math.sqrt(2 * save_s * mtbf)


def daly_interval_s(save_s: float, mtbf: float) -> float:
    """Daly (2006), higher order; ``mtbf`` itself when saves cost that much."""
    if math.isinf(mtbf):
        return math.inf
    if save_s >= 2 * mtbf:
        return mtbf
    root = math.sqrt(2 * save_s * mtbf)
    return root * (1 + math.sqrt(save_s / (2 * mtbf)) / 3 + save_s / (18 * mtbf)) - save_s


def nvidia_interval_s(save_s: float, mtbf: float, down_s: float) -> float:
    """arXiv 2410.18124's availability-optimal period Tc = Ts + sqrt(2 (Tf + Tr) Ts + Ts^2), less the save
    Ts: the training between commits."""
    if math.isinf(mtbf):
        return math.inf
    return math.sqrt(2 * (mtbf + down_s) * save_s + save_s ** 2)


# ------------------------------------------------------------------------------------------------- assessing


def assess(costs: FailureCosts, workers: int, every_steps: int, job_steps: int) -> dict:
    """A job of ``job_steps`` steps at ``workers``: its failures, lost work and ETTR as configured (a commit every
    ``every_steps`` steps; 0 = no checkpoints), without checkpoints, at each interval formula's and at the exact
    model's best; and the recommendation (``recommended_every`` 0: no checkpoints needed)."""
    m = mtbf_s(workers, costs.rate_per_worker_hour)
    rate = 0.0 if math.isinf(m) else 1.0 / m
    job = job_steps * costs.step_s
    c, down = costs.save_s, costs.down_s

    def at(every: int) -> dict:
        return plan(job, rate, min(every, job_steps) * costs.step_s if every else None, c, down)

    def steps_of(interval_s: float) -> int:  # whole steps, at least one, never past the job's end
        if not math.isfinite(interval_s) or costs.step_s <= 0:
            return job_steps
        return int(min(job_steps, max(1, round(interval_s / costs.step_s))))

    formulas = {"young": young_interval_s(c, m), "daly": daly_interval_s(c, m), "nvidia": nvidia_interval_s(c, m, down)}
    candidates = {name: steps_of(s) for name, s in formulas.items()}
    candidates["exact"] = best_every(job_steps, costs.step_s, rate, c, down) if costs.step_s > 0 else job_steps
    intervals = {}
    for name, every in candidates.items():
        got = at(every)
        intervals[name] = {"every": every, "interval_s": every * costs.step_s, "ettr": got["ettr"],
                           **({"formula_s": formulas[name]} if name in formulas else {})}
    by = max(intervals, key=lambda k: (intervals[k]["ettr"], k == "exact"))  # a tie goes to the exact search
    none, mine = at(0), at(every_steps)
    needed = intervals[by]["ettr"] - none["ettr"] > NO_CHECKPOINT_MARGIN
    out = {
        "workers": workers,
        "job_steps": job_steps,
        "job_s": job,
        "mtbf_s": m,
        "failures_per_hour": 3600.0 * rate,
        "expected_failures": mine["failures"],
        "lost_s": mine["lost_s"],
        # work done again, detection and restart, per failure (its mean)
        "lost_s_per_failure": mine["lost_s"] / mine["failures"] if mine["failures"] else None,
        # the share of wall time that failures take (work done again, detection, restart): beside the other waits
        "failure_share": mine["failure_share"],
        "ettr": mine["ettr"],
        "ettr_no_checkpoints": none["ettr"],
        "interval_s": min(every_steps, job_steps) * costs.step_s if every_steps else None,
        "intervals": intervals,
        "recommended_every": intervals[by]["every"] if needed else 0,
        "recommended_interval_s": intervals[by]["interval_s"] if needed else None,
        "recommended_by": by if needed else "no checkpoints",
        "ettr_recommended": intervals[by]["ettr"] if needed else none["ettr"],
        "margin": NO_CHECKPOINT_MARGIN,
        "model": MODEL,
        "costs": asdict(costs),
    }
    return _finite(out)


def _finite(d):
    """JSON has no infinity: None in its place, nested."""
    if isinstance(d, dict):
        return {k: _finite(v) for k, v in d.items()}
    return None if isinstance(d, float) and math.isinf(d) else d


def _best_ettr(costs: FailureCosts, workers: int, job_steps: int) -> float:
    """The best ETTR any plan reaches, checkpoints or none (the recommendation may prefer none within its margin)."""
    a = assess(costs, workers, 0, job_steps)
    return max([a["ettr_no_checkpoints"], *(v["ettr"] for v in a["intervals"].values())])


def to_reach(target: float, costs: FailureCosts, workers: int, job_steps: int) -> str:
    """What would have to change for the best plan to reach ``target`` ETTR, in words: the most a save may stall
    (detection and restart as now) and, when that is not enough alone, the most detection and restart may take
    (saves as now); each found by bisection on the exact model."""
    got = _best_ettr(costs, workers, job_steps)
    if got >= target:
        return f"the recommended plan reaches {got:.1%} (target {target:.0%})"

    def largest(make) -> float | None:  # the largest x in [0, now] whose plan reaches the target, by bisection
        if _best_ettr(make(0.0), workers, job_steps) < target:
            return None
        lo, hi = 0.0, 1.0
        while _best_ettr(make(hi), workers, job_steps) >= target:
            hi *= 2
        for _ in range(40):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if _best_ettr(make(mid), workers, job_steps) >= target else (lo, mid)
        return lo

    def with_save(x):
        return replace(costs, save_s=x)

    def with_down(x):  # detection and restart together, in today's proportion
        share = costs.detect_s / costs.down_s if costs.down_s else 0.5
        return replace(costs, restart_s=x * (1 - share), detect_s=x * share)

    c_max, d_max = largest(with_save), largest(with_down)
    text = f"the best plan reaches {got:.1%} at {workers_text(workers)}, short of {target:.0%}: "
    said = []
    if c_max is not None:
        said.append(f"saves would have to stall at most {c_max:.2f} s (now {costs.save_s:.2f} s)")
    if d_max is not None:
        said.append(f"detection and restart take at most {d_max:.0f} s together (now {costs.down_s:.0f} s)")
    if not said:
        fewer = "the failure rate" + (" or the workers" if workers > 1 else "")
        return text + f"neither faster saves nor faster detection and restart alone reach it: {fewer} must come down"
    return text + " or ".join(said)


def rate_for_share(share: float, costs: FailureCosts, workers: int, every_steps: int, job_steps: int) -> float:
    """The failure rate per worker-hour at which failures take ``share`` of the job's wall time (the inverse of
    ``assess``'s ``failure_share``, which grows with the rate): bisection on a log scale. What an injected
    failures case of the accuracy benchmark sets."""
    if not 0 < share < 1:
        raise ValueError(f"share = {share} must be within (0, 1)")

    def got(rate: float) -> float:
        return assess(replace(costs, rate_per_worker_hour=rate), workers, every_steps, job_steps)["failure_share"]

    lo, hi = 1e-12, 1.0
    while got(hi) < share:  # a rate that loses more than the share: the job's failures outrun it
        lo, hi = hi, hi * 1e3
    for _ in range(100):
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if got(mid) < share else (lo, mid)
    return math.sqrt(lo * hi)
