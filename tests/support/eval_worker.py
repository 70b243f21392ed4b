"""Worker code for the evaluation tests on spawned gloo ranks (harness.run_distributed): short training runs, one
per parallel layout, each leaving a run directory (config.json, checkpoints, model.safetensors, summary.json)."""

from __future__ import annotations

# name -> the layout's config overrides (2 ranks; hybrid sharding needs 4: test_hybrid.py's round trip checks it)
LAYOUTS = {
    "ddp": ["parallel.zero_stage=0"],
    "stage 1, optimizer offloaded": ["parallel.zero_stage=1", "parallel.offload=optimizer"],
    "stage 2": ["parallel.zero_stage=2"],
    "stage 3, activation checkpointing": ["parallel.zero_stage=3", "parallel.activation_checkpointing=true"],
    "stage 3, optimizer offloaded": ["parallel.zero_stage=3", "parallel.offload=optimizer"],
    "tensor 2": ["parallel.zero_stage=3", "parallel.tensor=2", "model.name=vit", "model.width=16",
                          "model.depth=1", "model.patch=4"],
}
STEPS = 2


def run_dir(root: str, name: str) -> str:
    return f"{root}/{name.replace(' ', '-').replace(',', '')}"


def config(root: str, name: str, world: int):
    from dutycycle.trainer.config import load_config

    return load_config(None, [
        "data.source=synthetic", "data.size=8", "data.global_batch_size=16", "data.synthetic_samples=64",
        "data.eval_batch_size=8", "model.width=8", "model.depth=2", f"run.max_steps={STEPS}", "run.eval_every=0",
        "run.log_every=0", "run.report=false", "run.precision=fp64", f"checkpoint.every={STEPS}",
        "parallel.threads_per_worker=1", f"parallel.num_workers={world}", f"run.dir={run_dir(root, name)}",
        *LAYOUTS[name]])


def train_layouts(rank: int, world: int, root: str, names: list[str]) -> dict:
    """Train each layout for a few steps; rank 0 writes the run's config.json first, as `dutycycle train` does.
    Returns each run's summary figures the evaluation is checked against."""
    import torch
    from dutycycle.trainer.launch.train import prepare_run
    from dutycycle.trainer.step.loop import WorkerContext
    from dutycycle.trainer.step.trainer import Trainer

    torch.set_num_threads(1)
    out = {}
    for name in names:
        cfg = config(root, name, world)
        if rank == 0:
            prepare_run(cfg, quiet=True)
        with Trainer(cfg, WorkerContext(rank=rank, world_size=world, run_dir=cfg.run.dir)) as trainer:
            s = trainer.train()
        out[name] = {k: s[k] for k in ("val_loss", "val_accuracy", "val_samples", "weights_sha256", "steps")}
        out[name]["layout"] = {k: s["parallel"][k] for k in ("strategy", "zero_stage", "tensor", "replicate",
                                                              "offload")}
    return out
