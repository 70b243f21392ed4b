"""Every use of FSDP2's private modules, in one file: what a torch upgrade may break, and nothing else does.

- ``AllGather`` / ``ReduceScatter``: the interfaces behind ``FSDPModule.set_custom_all_gather`` and
  ``set_custom_reduce_scatter`` (public methods, private interface classes). Checked on torch 2.13: they are
  called on CPU; ``allocate(size, *, dtype, device)`` must return a tensor (``torch.empty``); the all-gather
  input is a view into its output; gloo wants flat 1-D tensors; the reduce-scatter receives ``op`` (AVG unless
  ``set_force_sum_reduction_for_comms``). Returning ``None`` means the collective already finished.
- ``held_tensors``: the parameter and gradient tensors FSDP2 holds beside the module's registered (sharded)
  parameters: the unsharded parameters between all-gather and reshard, the unsharded gradients it keeps while
  gradient sync is off (accumulation), and the padded flat shard behind each sharded parameter. Memory
  accounting (memory.py) reads them; nothing writes them.
- ``custom_reduce_scatters``: the reduce-scatter object each module calls (the tests read error feedback's
  residuals from them).
- ``set_unshard_async``: ``FSDPModule._set_unshard_async_op`` (private): pre-forward/backward unshards and
  prefetches ask the all-gather for ``async_op=True`` (FSDP2 then waits on the returned ``dist.Work`` at
  copy-out). Without it, on CPU every unshard, prefetched or not, blocks where it is issued.
- ``reshard_to_secondary``: ``FSDPParamGroup._to_sharded_post_forward`` (private): hpZ's post-forward reshard
  (to the node-sized secondary shard) applied after a backward, so the next micro-batch's forward gathers inside
  the node instead of across nodes.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

__all__ = ["AllGather", "ReduceScatter", "FSDPModule", "custom_reduce_scatters", "fsdp_modules",
           "held_tensors", "reshard_to_secondary", "set_unshard_async"]


def fsdp_modules(model: torch.nn.Module) -> list[FSDPModule]:
    """Every module ``fully_shard`` was applied to, children before parents (the order they were sharded)."""
    return [m for m in reversed(list(model.modules())) if isinstance(m, FSDPModule)]


def _fsdp_params(module: FSDPModule):
    state = module._get_fsdp_state()
    for group in state._fsdp_param_groups:
        yield from group.fsdp_params


def held_tensors(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(kind, tensor)`` for the parameter/gradient memory FSDP2 holds, kind in ``sharded_param``,
    ``unsharded_param``, ``sharded_grad``, ``unsharded_grad``. Freed unsharded storage has size 0."""
    for module in fsdp_modules(model):
        for fp in _fsdp_params(module):
            yield "sharded_param", fp._sharded_param_data  # padded: includes FSDP's padding to W rows
            grad = fp.sharded_param.grad
            if grad is not None:
                yield "sharded_grad", local_tensor(grad)
            unsharded = getattr(fp, "_unsharded_param", None)
            if unsharded is not None:
                yield "unsharded_param", unsharded
                if unsharded.grad is not None:
                    yield "unsharded_grad", unsharded.grad
            if fp.unsharded_accumulated_grad is not None:
                yield "unsharded_grad", fp.unsharded_accumulated_grad


def custom_reduce_scatters(model: torch.nn.Module) -> list[ReduceScatter]:
    """The reduce-scatter each FSDP module calls (``set_custom_reduce_scatter``'s, or FSDP2's default), in
    ``fsdp_modules`` order."""
    return [group._reduce_scatter_comm for module in fsdp_modules(model)
            for group in module._get_fsdp_state()._fsdp_param_groups]


def set_unshard_async(model: torch.nn.Module) -> None:
    """Every FSDP module's unshards (pre-forward, pre-backward, prefetches) ask for ``async_op=True``."""
    for module in fsdp_modules(model):
        module._set_unshard_async_op(True)


def reshard_to_secondary(model: torch.nn.Module) -> None:
    """After a backward that kept parameters unsharded: free them down to hpZ's secondary shard (the post-forward
    mesh), as FSDP2 does after forward. Units without one stay unsharded until the step's last backward: the root,
    which FSDP2 never reshards after forward either (its parameters are needed again at once)."""
    for module in fsdp_modules(model):
        for group in module._get_fsdp_state()._fsdp_param_groups:
            if group.is_unsharded and group._use_post_forward_mesh:
                group._to_sharded_post_forward()


def local_tensor(t):
    """A DTensor's shard on this rank (its private ``_local_tensor``, without ``to_local()``'s autograd view); any
    other tensor itself."""
    return getattr(t, "_local_tensor", t)


def unshard_async(model: torch.nn.Module) -> list[bool]:
    """Whether each FSDP module's unshards ask for ``async_op=True`` (what ``set_unshard_async`` sets), in
    ``fsdp_modules`` order."""
    return [group.unshard_async_op for module in fsdp_modules(model)
            for group in module._get_fsdp_state()._fsdp_param_groups]
