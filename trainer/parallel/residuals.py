"""Error feedback's residuals as training state: saved in every checkpoint, restored on resume and rollback,
dropped (with one line saying so) when they cannot apply.

With ``parallel.error_feedback`` each FSDP2 unit's quantized reduce-scatter keeps what its last quantization lost
(``comm.QuantReduceScatter.residual``, fp32, the unit's whole unsharded gradient on every rank) and sends it again
with the next step's gradient. That residual changes the next step as much as the optimizer state does, so it
travels the same way:

- **Saved** beside the model and optimizer in the DCP checkpoint, under ``residuals.rank<r>.unit<i>``: every
  rank writes its own (the keys differ per rank, so DCP keeps each in its rank's file), and the trainer state
  records the layout (world size, elements per unit) it was saved with.
- **Restored** by every load: a resume and a rollback alike. A rollback that kept the live residual would send
  the error of steps it just undid.
- **Dropped** when the layout differs (another world size: the residual is per rank and per chunk of the world,
  it has no meaning at another size; another unit structure or quantization setting): the run starts error
  feedback from zero, and rank 0 prints one line saying why.
"""

from __future__ import annotations

import sys

import torch

from .comm import QuantReduceScatter
from .fsdp_api import custom_reduce_scatters

KEY = "residuals"


def holders(strategy) -> list:
    """The error-feedback reduce-scatters of a parallelized model, in ``fsdp_modules`` order (empty without
    error feedback or outside FSDP2)."""
    if not getattr(strategy, "quant", None) or not strategy.quant.error_feedback or strategy.name != "fsdp2":
        return []

    return [rs for rs in custom_reduce_scatters(strategy.model) if isinstance(rs, QuantReduceScatter)]


def layout(strategy, world_size: int) -> dict | None:
    """What the saved residuals look like (recorded in the trainer state); None without error feedback."""
    hs = holders(strategy)
    if not hs:
        return None
    return {"world_size": world_size, "numel": [0 if h.residual is None else h.residual.numel() for h in hs]}


def state_dict(strategy, rank: int) -> dict:
    """This rank's residuals for DCP (``{}`` without error feedback). The live tensors: an asynchronous save's
    stager copies them, and the next forward waits for that copy (checkpointer.py) before backward changes them."""
    units = {f"unit{i}": h.residual for i, h in enumerate(holders(strategy)) if h.residual is not None}
    return {KEY: {f"rank{rank}": units}} if units else {}


def load_targets(strategy, saved: dict | None, rank: int, world_size: int, device=None) -> tuple[dict, str]:
    """``(targets, why_dropped)``: empty tensors to read this rank's saved residuals into (``{}`` when there are
    none to read) and, when saved residuals cannot apply here, the reason ("" otherwise)."""
    hs = holders(strategy)
    if not saved or not hs:
        return {}, ("" if not saved else "this run has no error feedback (parallel.quant_grads, "
                    "parallel.error_feedback, parallel.zero_stage)")
    numel = [int(n) for n in saved.get("numel", [])]
    if int(saved.get("world_size", -1)) != world_size:
        return {}, f"they were saved by a {saved.get('world_size')}-rank run and this run has {world_size} ranks"
    if len(numel) != len(hs):
        return {}, f"they were saved for {len(numel)} sharded units and this model has {len(hs)}"
    units = {f"unit{i}": torch.empty(n, dtype=torch.float32, device=device) for i, n in enumerate(numel) if n}
    return ({KEY: {f"rank{rank}": units}} if units else {}), ""


def apply(strategy, loaded: dict, rank: int, why_dropped: str, where: str) -> None:
    """Install what ``load_targets`` read (after the load filled it); every residual not read starts from zero.
    Rank 0 prints one line when saved residuals were dropped."""
    units = loaded.get(KEY, {}).get(f"rank{rank}", {})
    for i, h in enumerate(holders(strategy)):
        h.residual = units.get(f"unit{i}")  # None: allocated as zeros at the next reduce-scatter
    if why_dropped and rank == 0:
        print(f"[checkpoint] error-feedback residuals in {where} are dropped ({why_dropped}): error feedback "
              "starts from zero", file=sys.stderr, flush=True)


def held_bytes(model: torch.nn.Module) -> int:
    """Bytes of the residuals a model's reduce-scatters hold now (0 without error feedback)."""

    total = 0
    for rs in custom_reduce_scatters(model):
        r = getattr(rs, "residual", None)
        if r is not None:
            total += r.numel() * r.element_size()
    return total
