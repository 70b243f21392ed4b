"""State dicts of a parallelized model, in the two forms users need.

- Consolidated: full tensors with the plain module's names, on rank 0 only (``cpu_offload``: no rank holds more
  than one full copy, and only in host memory). Saved as safetensors, which loads into a plain ``nn.Module`` with
  no code execution: ``model.load_state_dict(safetensors.torch.load_file(path))``.
- Sharded: ``torch.distributed.checkpoint.state_dict.get_state_dict`` (DTensors for FSDP2, plain tensors for
  DDP), the form DCP saves and reshards on load; model and optimizer together.
"""

from __future__ import annotations

import torch


def full_state_dict(strategy) -> dict[str, torch.Tensor]:
    """The consolidated model state on rank 0 (``{}`` on other ranks). A collective: every rank calls it."""
    if strategy.name == "local":
        return {k: v.detach().cpu() for k, v in strategy.module.state_dict().items()}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(strategy.module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def sharded_state_dict(strategy, optimizer) -> tuple[dict, dict]:
    """``(model_state, optimizer_state)`` as each rank holds them, for DCP."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    return get_state_dict(strategy.module, optimizer)


def to_safetensors(state: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> bytes:
    """Serialize a consolidated state dict (tied tensors are stored once per name, contiguous copies), with
    safetensors' string ``metadata`` in its header (``step.modelfile``: what the model needs to stand alone)."""
    from safetensors.torch import save

    return save({k: v.detach().contiguous().clone() for k, v in state.items()}, metadata=metadata)
