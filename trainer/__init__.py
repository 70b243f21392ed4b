"""dutycycle.trainer: the step loop, launch on Ray Train, sharding, checkpoints, metrics and the CLI.

Python API (the same as ``dutycycle train`` / ``dutycycle demo``)::

    from dutycycle.trainer import load_config, train, run_demo
    cfg = load_config("configs/demo.toml", ["data.cache=...", "optim.lr=0.005"])
    summary = train(cfg)               # on Ray Train; train(cfg, local=True) runs in this process

Importing this package is cheap: torch and ray load only when training starts.
"""

from __future__ import annotations

from dutycycle.engine._lazy import lazy_exports

_LAZY = {
    "TrainConfig": ".config",
    "load_config": ".config",
    "train": ".launch",
    "train_local": ".launch",
    "train_ray": ".launch",
    "run_demo": ".demo",
    "TrainingDiverged": ".steplog",
    "build_model": ".models",
    "MODELS": ".models",
}

__all__ = list(_LAZY)

__getattr__ = lazy_exports(__name__, _LAZY)
