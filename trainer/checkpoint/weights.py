"""A commit's model weights in one process, unsharded, for inference: no optimizer, no process group.

Whatever layout saved the commit (DDP, FSDP2 at any ZeRO stage, with or without offload, hybrid sharding, tensor
parallelism), DCP wrote each rank's pieces of every model tensor with their offsets in the full tensor, and its
index (``metadata.json``, storage.py) records each tensor's full size and dtype. So the full state dict is
allocated from the index alone, before any model exists, and ``dcp.load`` fills it from the pieces: the same
resharding a resume at another world size does (saved at 2 ranks, loaded at 1: exact). Tensor-parallel DTensor
shards (and FSDP2's shards of them) are pieces like any other.

Only the files the (verified) manifest lists are read, and no pickle runs (storage.py's reader). The names are
the plain module's (``torch.distributed.checkpoint.state_dict`` saved them without DDP's ``module.``, FSDP2's or
activation checkpointing's wrapper prefixes), so ``model.load_state_dict(state)`` takes them as they are.
"""

from __future__ import annotations

from dutycycle.engine import io
from dutycycle.engine.errors import CorruptArtifactError, SourceError

from . import manifest as mf
from .resume import Selected, select
from .storage import metadata_from_json, read_state

PREFIX = "model."  # the trainer saves {"model": ..., "optim": ..., ...}; DCP flattens the keys with dots


def select_commit(root: str, step: int | None = None) -> Selected:
    """The commit to load from the checkpoint ``root``: the newest whose manifest verifies (a newer one that
    fails verification is passed over loudly, as a resume passes it over), or the one of ``step``, which must
    verify. Raises ``SourceError`` naming the steps there are when there is none to load."""
    steps = mf.list_steps(root) if root else []
    committed = [s for s, uri in steps if mf.is_committed(uri)]
    if step is not None:
        if step not in committed:
            have = ", ".join(map(str, committed[:12])) or "none"
            raise SourceError(f"no committed checkpoint of step {step} under {root!r} (committed steps: {have}); "
                              "pick one of those, or leave the step out for the newest")
        return select(io.join(root, mf.step_name(step)), rank=0, world=1)
    selected = select(root, rank=0, world=1) if root else None
    if selected is None:
        raise SourceError(f"no committed checkpoint under {root!r}" + (
            f" ({len(steps)} step folders, none committed: their saves never finished)" if steps else "")
            + "; train with checkpoint.every > 0, or point at the run that holds it")
    return selected


def model_state_dict(selected: Selected) -> dict:
    """The full model tensors of a verified commit (``select_commit``), by parameter name, on the CPU, in the
    dtype they were saved in (float64 for an fp64 run; fp32 master weights for a bf16 one)."""
    import torch
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata


    where = io.join(selected.uri, mf.METADATA_JSON)
    index = metadata_from_json(mf.read_json_bounded(where), where)
    state, extra = {}, []
    for fqn, entry in index.state_dict_metadata.items():
        if not fqn.startswith(PREFIX):
            continue
        if isinstance(entry, BytesStorageMetadata):  # a module's get_extra_state(): not a tensor to load here
            extra.append(fqn)
            continue
        state[fqn[len(PREFIX):]] = torch.empty(entry.size, dtype=entry.properties.dtype)
    if not state:
        raise CorruptArtifactError(f"{where} indexes no model tensors (no {PREFIX}* entries); the checkpoint is "
                                   "refused")
    if extra:
        raise CorruptArtifactError(f"checkpoint {selected.uri} holds non-tensor model state ({', '.join(extra[:4])}); "
                                   "it cannot be loaded for inference")
    read_state({"model": state}, selected.uri, set(selected.manifest.files))
    return state
