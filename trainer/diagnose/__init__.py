"""``dutycycle diagnose``: short, measured experiments on the user's own config and data, then a verdict naming the
run's dominant wait (memory, data, communication, checkpoints, or none: compute-bound) and the setting that
addresses it. experiments.py measures (each experiment in a process of its own, worker.py, its result typed by
findings.py), verdict.py decides, report.py writes, run.py orchestrates; tuning.py applies the remedies one by one,
each verified by measurement (``dutycycle tune``)."""

from __future__ import annotations

from dutycycle.engine._lazy import lazy_exports

_LAZY = {"diagnose": ".run", "decide": ".verdict", "Verdict": ".verdict", "tune": ".tuning"}
__all__ = list(_LAZY)
__getattr__ = lazy_exports(__name__, _LAZY)
