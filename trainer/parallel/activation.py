"""Activation checkpointing per block (``parallel.activation_checkpointing``): each block of ``model.blocks``
keeps only its input through forward and recomputes its activations in backward, trading one extra forward of
the blocks for activation memory that no longer grows with depth.

Applied before DDP / ``fully_shard`` (trainer/parallel/apply.py), as torchtitan does: FSDP2 then shards the
wrapped block, so its all-gather hooks sit outside the recomputed region and backward's all-gather (stage 3)
happens before recomputation, which runs once per micro-batch on unsharded parameters. BatchNorm layers in a
block hold their running statistics during the recomputation (``context_fn``), so they are updated once per
forward, as without checkpointing.

Names. torch's ``checkpoint_wrapper`` (torchtitan's ``ptd_checkpoint_wrapper``) puts the block under a
``_checkpoint_wrapped_module`` child. Everything that is saved keeps the plain model's names: the wrapper's
state-dict hooks strip that segment from ``state_dict()`` and add it back in ``load_state_dict()``, and DCP's
``get_state_dict`` / ``set_state_dict`` (model and optimizer FQNs) strip it too, so a checkpoint or
``model.safetensors`` written with checkpointing on loads into a run with it off and back (tests check both).
The module tree itself does show the segment (``model.named_parameters()``, ``named_modules()``); nothing in the
trainer keys on those names, and we keep torch's wrapper rather than patching ``forward`` of the user's block
(which would keep even those names, but hides a closure that ``copy.deepcopy`` would share with the copy).
"""

from __future__ import annotations

import contextlib
import functools

from dutycycle.engine.errors import ConfigError
from torch import nn

from .fsdp_api import BatchNormBase, CheckpointImpl, CheckpointWrapper, checkpoint_wrapper


def checkpoint_blocks(model: nn.Module) -> list[str]:
    """Wrap every block of ``model.blocks`` in place for non-reentrant activation checkpointing; return the
    wrapped names (``blocks.0``, ...). Raises ConfigError for a model without blocks: the option would do nothing,
    and a user who asked for it would otherwise believe activation memory was saved."""
    blocks = getattr(model, "blocks", None)
    if not isinstance(blocks, (nn.Sequential, nn.ModuleList)) or len(blocks) == 0:
        raise ConfigError(f"parallel.activation_checkpointing = true checkpoints each block of `model.blocks`, and "
                          f"{type(model).__name__} has none (an nn.Sequential/ModuleList): expose its blocks or set "
                          "parallel.activation_checkpointing = false")
    names = []
    for i, block in enumerate(blocks):
        names.append(f"blocks.{i}")
        if isinstance(block, CheckpointWrapper):
            continue  # parallelize called twice on one model: wrapping again would recompute twice
        # NO_REENTRANT: works with DDP's unused-parameter search, FSDP2's hooks and keyword arguments, and
        # recomputes only what backward needs. preserve_rng_state: dropout draws the same masks on recomputation,
        # so gradients equal those without checkpointing (the RNG stream after forward is unchanged too).
        # context_fn: the recomputation runs with BatchNorm's running statistics held (below)
        blocks[i] = checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT, preserve_rng_state=True,
                                       context_fn=functools.partial(_contexts, block))
    return names


def _contexts(block: nn.Module):
    """torch.utils.checkpoint's ``context_fn``: nothing around the forward; around its recomputation in backward,
    the block's BatchNorm layers hold their running statistics, so these are updated once per forward, not again
    by the recomputation (torch updates them twice). In training mode the layers normalize with the batch's
    statistics either way, so the recomputed activations are the forward's."""
    return contextlib.nullcontext(), _running_stats_held(block)


@contextlib.contextmanager
def _running_stats_held(block: nn.Module):
    """Momentum 0 (the update becomes ``0 * batch + 1 * running``: the same bits) and the forward count put back.
    The layers still receive their running statistics, so the recomputation saves the tensors the forward saved
    (torch's checkpoint checks that); nothing the backward reads is modified in place."""
    layers = [(m, m.momentum, m.num_batches_tracked.clone()) for m in block.modules()
              if isinstance(m, BatchNormBase) and m.training and m.track_running_stats]
    for m, _, _ in layers:
        m.momentum = 0.0
    try:
        yield
    finally:
        for m, momentum, count in layers:
            m.momentum = momentum
            m.num_batches_tracked.copy_(count)
