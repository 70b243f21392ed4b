"""Work lost to failures, from measured costs: the fourth wait ("is the accelerator redoing work lost to
failures?") as a model a person can check by hand.

A job of N workers fails at rate N * lambda (independent worker failures; lambda per worker-hour). With a commit
every tau seconds of training, a save that stalls the step C seconds, and a failure costing R seconds to come
back (restart the worker group, restore the newest commit) plus the work since that commit (tau / 2 on average),
the first-order effective training time ratio is

    ETTR = 1 - C / tau - (tau / 2 + R) / M,        M = 1 / (N * lambda), the job's mean time between failures

(valid while tau and R are small against M). The interval that maximises it is Young's sqrt(2 C M); Daly's
higher-order form, used here, is sqrt(2 C M) * (1 + sqrt(C / (2 M)) / 3 + C / (18 M)) - C for C < 2 M.

The default lambda is the Llama 3 report's: 419 unexpected interruptions in 54 days of training on 16,384 GPUs
(Meta, "The Llama 3 Herd of Models", 2024, section 3.3.4), that is 419 / (54 * 24 * 16384) = 1.97e-5 per GPU-hour.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

LLAMA3_RATE_PER_WORKER_HOUR = 419 / (54 * 24 * 16384)
MODEL = ("first order: ETTR = 1 - C/tau - (tau/2 + R)/M with M = 1/(N lambda); interval by Daly's formula "
         "(Young's sqrt(2 C M) to first order)")


@dataclass
class FailureCosts:
    save_s: float  # C: the step's stall per save (the configured mode, synchronous or asynchronous)
    restart_s: float  # R: from a failure to the resumed step (worker group start, restore)
    step_s: float  # one optimizer step
    rate_per_worker_hour: float = LLAMA3_RATE_PER_WORKER_HOUR


def mtbf_s(workers: int, rate_per_worker_hour: float) -> float:
    """The job's mean time between failures, in seconds."""
    return math.inf if rate_per_worker_hour <= 0 else 3600.0 / (workers * rate_per_worker_hour)


def ettr(interval_s: float, save_s: float, restart_s: float, mtbf: float) -> float:
    """Effective training time ratio at a commit every ``interval_s`` seconds of training (first order)."""
    if interval_s <= 0:
        return 0.0
    return max(0.0, 1.0 - save_s / interval_s - (interval_s / 2 + restart_s) / mtbf)


def daly_interval_s(save_s: float, mtbf: float) -> float:
    """The commit interval that maximises ETTR (Daly 2006); ``mtbf`` itself when saves cost that much."""
    if math.isinf(mtbf):
        return math.inf
    if save_s >= 2 * mtbf:
        return mtbf
    root = math.sqrt(2 * save_s * mtbf)
    return root * (1 + math.sqrt(save_s / (2 * mtbf)) / 3 + save_s / (18 * mtbf)) - save_s


def assess(costs: FailureCosts, workers: int, every_steps: int) -> dict:
    """Lost work per hour, ETTR at the configured interval (``every_steps``; 0 = no checkpoints: a failure loses
    the run so far, counted as the whole MTBF), the recommended interval and its ETTR, at ``workers``."""
    m = mtbf_s(workers, costs.rate_per_worker_hour)
    interval = every_steps * costs.step_s if every_steps else math.inf
    best = daly_interval_s(costs.save_s, m)
    best_steps = max(1, round(best / costs.step_s)) if math.isfinite(best) and costs.step_s > 0 else None
    best_interval = best_steps * costs.step_s if best_steps else math.inf
    per_failure = (interval / 2 if math.isfinite(interval) else m) + costs.restart_s
    failures_per_hour = 3600.0 / m if math.isfinite(m) else 0.0
    out = {
        "workers": workers,
        "mtbf_s": m,
        "failures_per_hour": failures_per_hour,
        "lost_s_per_failure": per_failure,
        "lost_s_per_hour": min(3600.0, failures_per_hour * per_failure),
        # the share of wall time a failure's redo and restart take: the "failures" wait beside the others
        "failure_share": min(1.0, per_failure / m) if math.isfinite(m) else 0.0,
        "ettr": ettr(interval, costs.save_s, costs.restart_s, m) if math.isfinite(interval) else
        max(0.0, 1.0 - per_failure / m),
        "interval_s": interval,
        "recommended_every": best_steps,
        "recommended_interval_s": best_interval,
        "ettr_recommended": ettr(best_interval, costs.save_s, costs.restart_s, m) if best_steps else 1.0,
        "model": MODEL,
        "costs": asdict(costs),
    }
    return {k: (None if isinstance(v, float) and math.isinf(v) else v) for k, v in out.items()}


def to_reach(target: float, costs: FailureCosts, workers: int) -> str:
    """What would have to change for the best interval to reach ``target`` ETTR, in words."""
    m = mtbf_s(workers, costs.rate_per_worker_hour)
    best = daly_interval_s(costs.save_s, m)
    got = ettr(best, costs.save_s, costs.restart_s, m)
    if got >= target:
        return f"the recommended interval reaches {got:.1%} (target {target:.0%})"
    # at the optimum, loss ~ sqrt(2C/M) + R/M: solve each for the target with the other fixed
    room = 1.0 - target
    r_part = costs.restart_s / m
    c_max = max(0.0, room - r_part) ** 2 * m / 2 if room > r_part else 0.0
    return (f"the recommended interval reaches {got:.1%} at {workers:,} workers, short of {target:.0%}: saves "
            f"would have to stall at most {c_max:.2f} s (now {costs.save_s:.2f} s)"
            + (f" and a restart take under {room * m:.0f} s (now {costs.restart_s:.0f} s)" if r_part >= room else ""))
