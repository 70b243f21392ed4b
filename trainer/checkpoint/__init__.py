"""Checkpoints: snapshot in memory, write in the background, commit with a checksummed manifest, resume at any
world size, and roll back from non-finite losses.

Modules, in the order a save and a resume go through them:

- ``checkpointer.py``: what the step loop calls (when to save, resume, non-finite recovery, the summary);
- ``saver.py``: the async policy (at most one save in flight), the commit protocol and retention;
- ``storage.py``: DCP save/load through fsspec, checksums while writing, loads that run no pickle;
- ``manifest.py``: the commit record (sizes and BLAKE3 checksums of every file), step directories, removal;
- ``state.py``: the trainer state saved beside the tensors (step, loader, RNG, config, lineage), JSON;
- ``resume.py``: which checkpoint to continue from (newest that verifies, loudly falling back) and loading it;
- ``raytrain.py``: commits reported to Ray Train as pointer checkpoints;
- ``peer.py``: peer memory (``checkpoint.memory_every``): copies in Ray actors on this node and another,
  restored from on a restart or resize when at least as new as the newest commit;
- ``weights.py``: a commit's model weights, unsharded, in one process with no process group (inference,
  ``dutycycle evaluate``): ``model_state_dict(select_commit(root, step))``.

Heavy imports (torch, DCP, Ray) stay inside the modules that need them.
"""

from __future__ import annotations

__all__ = ["checkpoint_root", "checkpoint_uri", "find_latest", "make_checkpointer"]


def checkpoint_root(cfg, run_dir: str) -> str:
    """Where a run's checkpoints go: ``checkpoint.dir``, else ``RUN_DIR/checkpoints`` ("" without either)."""
    from .manifest import checkpoint_root as root  # heavy: fsspec, not at package import

    return root(cfg, run_dir)


def make_checkpointer(cfg, ctx, *, total_steps: int, data_info=None, writer=None):
    from .checkpointer import make_checkpointer as make  # imports torch: not at package import

    return make(cfg, ctx, total_steps=total_steps, data_info=data_info, writer=writer)


def find_latest(root: str):
    """The newest checkpoint under ``root`` whose manifest verifies, in this process (no process group):
    ``resume.Selected`` (step, uri, manifest, fallbacks) or None."""
    from .resume import select  # imports torch: not at package import

    return select(root, rank=0, world=1)


def checkpoint_uri(ray_checkpoint):
    """The dutycycle checkpoint a Ray Train ``Checkpoint`` (e.g. ``Result.checkpoint``) points to."""
    from .raytrain import checkpoint_uri as resolve  # heavy: fsspec, not at package import

    return resolve(ray_checkpoint)
