"""Every private torch API dutycycle uses, in one file: what a torch upgrade may break, and nothing else does.

The module began with FSDP2's private parts (hence its name) and now holds every private torch name the package
touches: a module path or a name with a leading underscore, or a private attribute of a torch object.
tests/trainer/test_fsdp_api.py scans the package and fails when any other module touches one. Each entry says
what it is for and which torch versions it was checked against (``CHECKED_TORCH``); on an upgrade, check each
against the new version's source and add the version (the same test fails while the installed torch is not
listed).

FSDP2 (``torch.distributed.fsdp._fully_shard``), checked against 2.13.0:

- ``AllGather`` / ``ReduceScatter``: the interfaces behind ``FSDPModule.set_custom_all_gather`` and
  ``set_custom_reduce_scatter`` (public methods, private interface classes). They are called on CPU;
  ``allocate(size, *, dtype, device)`` must return a tensor (``torch.empty``); the all-gather input is a view into
  its output; gloo wants flat 1-D tensors; the reduce-scatter receives ``op`` (AVG unless
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
- ``set_unshard_async`` / ``unshard_async``: ``FSDPModule._set_unshard_async_op`` and the param groups'
  ``unshard_async_op``: pre-forward/backward unshards and prefetches ask the all-gather for ``async_op=True``
  (FSDP2 then waits on the returned ``dist.Work`` at copy-out). Without it, on CPU every unshard, prefetched or
  not, blocks where it is issued; on a GPU it would replace FSDP2's all-gather streams (apply.py sets it on CPU
  only).
- ``reshard_to_secondary``: ``FSDPParamGroup._to_sharded_post_forward``: hpZ's post-forward reshard (to the
  node-sized secondary shard) applied after a backward, so the next micro-batch's forward gathers inside the node
  instead of across nodes.
- ``local_tensor``: a DTensor's ``_local_tensor`` without ``to_local()``'s autograd view.

Elsewhere in torch, checked against 2.13.0:

- ``TorchDispatchMode`` (``torch.utils._python_dispatch``), ``functional_collectives`` (the
  ``torch.ops._c10d_functional`` ops DTensor issues) and ``group_size`` (``distributed_c10d._resolve_process_group``):
  tensor.py counts tensor parallelism's activation exchanges with them.
- ``checkpoint_wrapper`` / ``CheckpointImpl`` / ``CheckpointWrapper``
  (``torch.distributed.algorithms._checkpoint.checkpoint_wrapper``, torchtitan's ``ptd_checkpoint_wrapper``):
  activation checkpointing per block (activation.py).
- ``BatchNormBase``: ``torch.nn.modules.batchnorm._BatchNorm``, the base of every BatchNorm layer and of
  SyncBatchNorm (batchnorm.py, activation.py).
- DCP's storage seams (checkpoint/storage.py): ``FileSystem``, ``FsspecReader``, ``FsspecWriter``
  (``torch.distributed.checkpoint._fsspec_filesystem``: the stream factory the writer writes through, and the
  fsspec reader and writer, exported only from there); ``storage_info`` (``filesystem._StorageInfo``, where one
  item lies in a file: the JSON index builds DCP's metadata from it); ``set_plan_cache_key`` and
  ``drop_save_plan_cache`` (``DefaultSavePlanner._cached_plans_key`` and ``SavePlanner._cached_*``: DCP keeps
  its plan cache in class-level dicts, one per planner class unless the key is set); ``set_element``
  (``_nested_dict.set_element``: a loaded value put back into a nested state dict, as DCP's planner does).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    CheckpointWrapper,
    checkpoint_wrapper,
)
from torch.distributed.checkpoint._fsspec_filesystem import FileSystem, FsspecReader, FsspecWriter
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
from torch.nn.modules.batchnorm import _BatchNorm as BatchNormBase
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["AllGather", "BatchNormBase", "CHECKED_TORCH", "checkpoint_wrapper", "CheckpointImpl",
           "CheckpointWrapper", "custom_reduce_scatters", "drop_save_plan_cache", "FileSystem",
           "fsdp_modules", "FSDPModule", "FsspecReader", "FsspecWriter", "functional_collectives",
           "grad_slots", "GradSlot", "group_size", "held_tensors", "local_tensor", "own_reduce_scatters",
           "predivide_factor", "reduce_scatter_world", "reduced_now", "ReduceScatter", "reshard_to_secondary",
           "set_element", "set_plan_cache_key", "set_unshard_async", "storage_info", "TorchDispatchMode",
           "unshard_async"]

# the torch releases every entry here was checked against (module doc); the installed one must be among them
CHECKED_TORCH = ("2.13.0",)


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
    which is never resharded after forward either (apply.py: its parameters are needed again at once)."""
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


# ------------------------------------------------------------------------------------- tensor parallelism


def functional_collectives() -> dict:
    """The functional collectives DTensor issues (``torch.ops._c10d_functional``), each op to its kind in
    tensor.py's accounting."""
    ops = torch.ops._c10d_functional
    return {ops.all_gather_into_tensor.default: "tp_all_gather",
            ops.reduce_scatter_tensor.default: "tp_reduce_scatter",
            ops.all_reduce.default: "tp_all_reduce"}


def group_size(group_name: str) -> int:
    """The size of the process group a functional collective names (its last argument)."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(group_name).size()


# ------------------------------------------------------------------------------------------ checkpoints


def storage_info(relative_path: str, offset: int, length: int, transform_descriptors: list[str] | None):
    """DCP's record of where one saved item lies: ``length`` bytes at ``offset`` of ``relative_path``, written
    through ``transform_descriptors`` (None: none)."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    return _StorageInfo(relative_path, offset, length, transform_descriptors)


def set_plan_cache_key(planner, key: str) -> None:
    """Cache ``planner``'s (a ``DefaultSavePlanner`` with ``enable_plan_caching``) plans under ``key`` instead of
    its class name, so that two savers in one process keep separate caches."""
    planner._cached_plans_key = key


def drop_save_plan_cache(key: str) -> None:
    """Forget every plan DCP cached under ``key``."""
    from torch.distributed.checkpoint.planner import SavePlanner

    for cache in (SavePlanner._cached_save_plan, SavePlanner._cached_final_save_plan, SavePlanner._cached_all_plans,
                  SavePlanner._cached_global_plan, SavePlanner._cached_metadata):
        cache.pop(key, None)


def set_element(root: dict, path, value) -> None:
    """Put ``value`` at ``path`` (a DCP flattening mapping's object path) inside the nested ``root``."""
    from torch.distributed.checkpoint._nested_dict import set_element as _set

    _set(root, path, value)
