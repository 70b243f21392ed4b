"""dutycycle.trainer: the step loop, launch on Ray Train, sharding, checkpoints, metrics, diagnosis and the CLI.

Layout, bottom of the import graph first (each imports only from those above it):

    config.py     every section of a training config, validated where it is defined
    cluster/      who is training (World), object collectives, the pre-flight health check
    parallel/     DDP / FSDP2 per ZeRO stage, quantized collectives in FSDP2's comm seams, traffic and memory
    checkpoint/   DCP save and load in the background, a checksummed manifest written last, resume, retention
    step/         the step loop and its time account, batch sources, models, optimizers, metrics, the run report
    launch/       in this process, on Ray Train, or under torchrun; results back to the driver
    diagnose/     short measured experiments and a verdict on what a run waits for
    serve/        after training: load_model, preprocessing, ``dutycycle predict`` and ``dutycycle export``
    app/          the ``dutycycle`` command for every package, the demo and its fault injection

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
    "train": ".launch.train",
    "train_local": ".launch.train",
    "train_ray": ".launch.train",
    "run_demo": ".app.demo",
    "TrainingDiverged": "dutycycle.engine.errors",
    "build_model": ".step.models",
    "MODELS": ".step.models",
}

__all__ = list(_LAZY)

__getattr__ = lazy_exports(__name__, _LAZY)
