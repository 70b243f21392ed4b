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
  residuals from them); ``own_reduce_scatters``: one module's (the parity check wraps them for its step).
- ``grad_slots`` / ``reduced_now`` / ``predivide_factor`` / ``reduce_scatter_world``: where each parameter's
  gradient sits in its unit's reduce-scatter input, which parameters a reduce-scatter carries, and what FSDP2
  divides the gradients by before it (error feedback's per-parameter residuals, residuals.py). Read from torch
  2.13's ``FSDPParamGroup.post_backward`` and ``_fsdp_collectives.foreach_reduce``: the input is ``(W, per_rank)``,
  row r the concatenation, parameter by parameter in the group's order, of each parameter's chunk for rank r
  (dim-0 chunks padded to ``ceil(rows / W)`` rows; a ``Shard(k)`` parameter, k > 0, chunked along k and the
  chunks stacked along dim 0), so a parameter's chunk has its padded shard's size on every row. The parameters
  in it: those that got a gradient this backward, plus, with ``set_reduce_scatter_unused_params(True)``, every
  one whose unsharded parameter requires grad (a zero gradient for the unused ones).
- ``set_unshard_async``: ``FSDPModule._set_unshard_async_op`` (private): pre-forward/backward unshards and
  prefetches ask the all-gather for ``async_op=True`` (FSDP2 then waits on the returned ``dist.Work`` at
  copy-out). Without it, on CPU every unshard, prefetched or not, blocks where it is issued.
- ``reshard_to_secondary``: ``FSDPParamGroup._to_sharded_post_forward`` (private): hpZ's post-forward reshard
  (to the node-sized secondary shard) applied after a backward, so the next micro-batch's forward gathers inside
  the node instead of across nodes.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

__all__ = ["AllGather", "ReduceScatter", "FSDPModule", "GradSlot", "custom_reduce_scatters", "fsdp_modules",
           "grad_slots", "held_tensors", "own_reduce_scatters", "predivide_factor", "reduce_scatter_world", "reduced_now",
           "reshard_to_secondary", "set_unshard_async"]


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


@dataclass(frozen=True)
class GradSlot:
    """One parameter's place in its unit's reduce-scatter input (checked on torch 2.13)."""

    fqn: str  # the parameter's name in the model (activation-checkpoint and compile wrappers left out)
    numel: int  # elements of its chunk on every row of the input (its padded shard)
    shape: tuple[int, ...]  # its unsharded shape (under tensor parallelism: this rank's local part)
    shard_dim: int  # the dimension FSDP2 chunks


def clean_fqn(name: str) -> str:
    """A parameter name without the wrappers' path components, as DCP's ``get_state_dict`` names it."""
    return name.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")


def _param_group(module: FSDPModule):
    groups = module._get_fsdp_state()._fsdp_param_groups
    assert len(groups) == 1, f"one FSDP2 parameter group per fully_shard call (apply.py), got {len(groups)}"
    return groups[0]


def grad_slots(module: FSDPModule, root: torch.nn.Module) -> list[GradSlot]:
    """Every parameter of ``module``'s unit in reduce-scatter order, named as in ``root`` (call right after
    ``fully_shard``, while the registered parameters are the sharded ones). A unit without parameters of its own
    (a root whose blocks hold them all) has none and never reduce-scatters."""
    if not module._get_fsdp_state()._fsdp_param_groups:
        return []
    names: dict[int, str] = {}
    for n, p in root.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), clean_fqn(n))  # a tied parameter: its first name, as named_parameters() gives it
    return [GradSlot(names[id(fp.sharded_param)], int(torch.Size(fp.padded_sharded_param_size).numel()),
                     tuple(fp._orig_size), fp.fsdp_placement.dim) for fp in _param_group(module).fsdp_params]


def reduced_now(module: FSDPModule) -> list[bool]:
    """Per ``grad_slots`` entry: whether the reduce-scatter being issued carries it. Called from the custom
    reduce-scatter, when FSDP2 has already taken the gradients: this is ``post_backward``'s rule with
    ``reduce_scatter_unused_params`` on (error feedback sets it), where a parameter is in the input iff its unsharded
    parameter exists and requires grad (FSDP2 syncs that flag from the sharded parameter at every unshard). A
    parameter frozen in the middle of an accumulation (a gradient kept from an earlier micro-step) breaks it: the
    caller checks the input's size against the slots and stops."""
    group = _param_group(module)
    assert group.reduce_scatter_unused_params, "error feedback sets set_reduce_scatter_unused_params(True)"
    return [hasattr(fp, "_unsharded_param") and fp._unsharded_param.requires_grad for fp in group.fsdp_params]


def reduce_scatter_world(module: FSDPModule) -> int:
    """The size of the group ``module``'s gradients are reduce-scattered over (the shard group)."""
    return _param_group(module).mesh_info.shard_mesh_size


def predivide_factor(module: FSDPModule) -> float:
    """What FSDP2 divides the reduce-scatter input by before the collective (torch 2.13
    ``_get_gradient_divide_factors``: 1 for fp32/bf16 reductions, which reduce with AVG; about sqrt(W) for fp64 and
    fp16, which pre- and post-divide around a SUM)."""
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import _get_gradient_divide_factors
    from torch.distributed.fsdp._fully_shard._fsdp_common import DDPMeshInfo

    group = _param_group(module)
    mp = group.mp_policy
    reduce_dtype = mp.reduce_dtype or mp.param_dtype or group.fsdp_params[0].sharded_param.dtype
    replicate = group.mesh_info.replicate_process_group if isinstance(group.mesh_info, DDPMeshInfo) else None
    pre, _, _, _ = _get_gradient_divide_factors(group.mesh_info.shard_process_group, replicate, reduce_dtype,
                                                group.device.type, group.gradient_divide_factor,
                                                group.force_sum_reduction_for_comms)
    return float(pre or 1.0)


def own_reduce_scatters(module: FSDPModule) -> list[ReduceScatter]:
    """The reduce-scatter objects of ``module``'s own parameter groups (none for a unit without parameters), not
    its children's: what the parity check (check.py) wraps for one step and puts back."""
    return [group._reduce_scatter_comm for group in module._get_fsdp_state()._fsdp_param_groups]


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
