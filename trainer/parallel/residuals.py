"""Error feedback's residuals as training state, one per parameter: saved in every checkpoint by parameter name,
restored on resume and rollback, redistributed when the world size changes.

**What a residual is.** With ``parallel.error_feedback`` each FSDP2 unit's quantized reduce-scatter
(``comm.QuantReduceScatter``) keeps what this rank's quantization lost and adds it to the next step's input. The
input of a unit's reduce-scatter is ``(W, per_rank)``: row r holds, parameter by parameter, this rank's gradient
chunk destined for rank r (fsdp_api.grad_slots). So rank q's residual of parameter p is ``(W, chunk)``, row r the
error of q's contribution to rank r's shard of p: read in the parameter's own coordinates, one full-size
(unsharded; under tensor parallelism: this rank's local part) fp32 tensor per rank and parameter, ``R_q[p]``.
Every rank holds the residuals of every parameter (a whole fp32 gradient per rank, as in ZeRO++).

**Keyed by parameter.** The buffer is laid out per parameter, and error feedback sets
``set_reduce_scatter_unused_params(True)`` on every unit: a parameter that got no gradient (a branch not taken)
is reduced with a zero gradient plus its residual. A parameter that does not require grad (frozen) is left out
of the reduce-scatter; its residual waits, untouched, until it trains again. A residual is therefore only ever
added to its own parameter's gradient, whichever parameters a step uses. (As with DDP's
``find_unused_parameters``, an unused parameter then has a gradient, its pending correction, and the optimizer
steps it: momentum and weight decay apply to it that step.)

**Saved** beside the model and optimizer in the DCP checkpoint, as ``residuals.rank<q>.<parameter name>``, the
parameter's shape (every rank writes its own: the keys differ per rank). The trainer state records the layout
(``layout``): the world size, each rank's (data-parallel, tensor-parallel) index, and per parameter its shape and
FSDP2's pre-division factor (the units the residual is in).

**Restored** by every load, a resume and a rollback alike (a rollback that kept the live residuals would send the
error of the steps it undid). At the same world size each rank reads its own residuals back bit for bit.

**Redistributed** at another world size, so that the pending correction is kept. FSDP2 applies the mean over
the D data-parallel ranks of the local gradients; each rank's input is its local gradient divided by FSDP2's
pre-division factor ``f`` (1 for fp32 and bf16 reductions, about sqrt(D) for fp64), so the correction still to be
applied to parameter p is ``C[p] = f / D * sum over ranks q of R_q[p]`` (per tensor-parallel index: each index
has its own part of p). At D' data-parallel ranks and factor f', new data-parallel rank d' takes the old ranks
``d = d' (mod D')`` of its tensor index::

    R'_d'[p] = (D' / D) * (f / f') * sum over d = d' (mod D') of R_d[p]

which keeps ``f' / D' * sum R'`` equal to ``C[p]`` (exactly when D'/D and f/f' are powers of two; otherwise up
to one fp32 rounding). Each rank reads at most ``ceil(D / D')`` old residuals. When the run grows, ranks
``d' >= D`` start from zero and the others carry the scaled correction. A one-rank run never reduce-scatters
(FSDP2 skips the collective), so it holds the redistributed residuals without sending them, and saves them for a
later run on more ranks. Residuals are dropped, with one line on rank 0 naming why, only when they cannot apply:
another tensor-parallel degree, a parameter not in this model or of another shape (that one starts from zero),
error feedback off, or a checkpoint from before this layout (one residual per unit).
"""

from __future__ import annotations

import sys

import torch

from .comm import QuantReduceScatter
from .fsdp_api import custom_reduce_scatters, predivide_factor

KEY = "residuals"
PLAN = "residuals_plan"  # beside KEY in load_targets' answer: how apply combines what was read (not a tensor)


def holders(strategy) -> list:
    """The error-feedback reduce-scatters of a parallelized model, in ``fsdp_modules`` order (empty without
    error feedback or outside FSDP2)."""
    if not getattr(strategy, "quant", None) or not strategy.quant.error_feedback or strategy.name != "fsdp2":
        return []

    return [rs for rs in custom_reduce_scatters(strategy.model) if isinstance(rs, QuantReduceScatter)]


# ---------------------------------------------------------------------------- the parameter's own coordinates


def to_param(chunks: torch.Tensor, shape: tuple[int, ...], shard_dim: int) -> torch.Tensor:
    """A ``(W, chunk)`` block of the reduce-scatter input as the parameter's full ``shape`` (a new tensor). FSDP2
    pads dim 0 to a multiple of W (the padding's residual is always zero: a zero quantizes exactly); a
    ``Shard(k)`` parameter's W chunks along k are stacked along dim 0."""
    W = chunks.shape[0]
    if shard_dim == 0:
        rows = -(-shape[0] // W)  # ceil
        return chunks.reshape(W * rows, *shape[1:])[:shape[0]].clone()
    chunk_shape = list(shape)
    chunk_shape[shard_dim] //= W
    return torch.cat(list(chunks.reshape(W, *chunk_shape).unbind(0)), dim=shard_dim)


def from_param(full: torch.Tensor, chunks: torch.Tensor, shard_dim: int) -> None:
    """Write a parameter-shaped ``full`` into its ``(W, chunk)`` block ``chunks`` (padding rows zero)."""
    W = chunks.shape[0]
    chunks.zero_()
    if shard_dim == 0:
        rows = -(-full.shape[0] // W)
        flat = torch.zeros(W * rows, *full.shape[1:], dtype=chunks.dtype, device=chunks.device)
        flat[:full.shape[0]].copy_(full)
        chunks.copy_(flat.reshape(W, -1))
        return
    parts = torch.chunk(full, W, dim=shard_dim)
    chunks.copy_(torch.stack([p.reshape(-1) for p in parts]))


# ---------------------------------------------------------------------------------------------- save


def _rank_index(strategy, rank: int) -> list[int]:
    """``[data-parallel index, tensor-parallel index]`` of a global rank."""
    dims = strategy.dims
    if dims is None or not dims.tp_enabled:
        return [rank, 0]
    d, _ = dims.data_ranks(rank)
    return [d, dims.tensor_groups()[d].index(rank)]


def layout(strategy, world_size: int) -> dict | None:
    """What the saved residuals look like (recorded in the trainer state); None without error feedback."""
    hs = holders(strategy)
    if not hs:
        return None
    params = {}
    for h in hs:
        pre = predivide_factor(h.unit)
        for s in h.slots:
            params[s.fqn] = {"shape": list(s.shape), "predivide": pre}
    return {"world_size": world_size, "ranks": [_rank_index(strategy, r) for r in range(world_size)],
            "params": params}


def state_dict(strategy, rank: int) -> dict:
    """This rank's residuals for DCP (``{}`` without error feedback), each in its parameter's shape. Copies (the buffer holds them in the reduce-scatter's layout): training may go on while an
    asynchronous save writes them."""
    out = {}
    for h in holders(strategy):
        for i, s in enumerate(h.slots):  # before the first exchange: zeros, so every saved layout is complete
            out[s.fqn] = torch.zeros(s.shape) if h.residual is None else \
                to_param(h.param_residual(i), s.shape, s.shard_dim)
    return {KEY: {f"rank{rank}": out}} if out else {}


# ---------------------------------------------------------------------------------------------- load


def sources(saved_ranks: list, here: list[int], new_dp: int) -> list[int]:
    """The old global ranks whose residuals new rank ``here`` (``[dp index, tp index]``) takes: same tensor index,
    data-parallel index congruent modulo the new data-parallel size ``new_dp``."""
    return [q for q, (d, t) in enumerate(saved_ranks) if t == here[1] and d % new_dp == here[0]]


def redistribution_scale(old_dp: int, new_dp: int, old_predivide: float, new_predivide: float) -> float:
    """What the sum of the residuals a new rank takes is multiplied by (the module docstring's rule)."""
    return (new_dp / old_dp) * (old_predivide / new_predivide)


def load_targets(strategy, saved: dict | None, rank: int, world_size: int, device=None) -> tuple[dict, str]:
    """``(targets, why_dropped)``: empty tensors to read the saved residuals this rank takes into (``{}`` when
    there are none) and, when saved residuals cannot apply here, the reason ("" otherwise). The targets carry
    the plan for ``apply`` under ``targets[PLAN]`` (not a tensor: leave it out of what DCP reads, ``tensors``)."""
    hs = holders(strategy)
    if not saved or not hs:
        return {}, ("" if not saved else "this run has no error feedback (parallel.quant_grads, "
                    "parallel.error_feedback, parallel.zero_stage)")
    if "params" not in saved:
        return {}, "they were saved in an earlier layout (one residual per sharded unit, not per parameter)"
    old_ranks = [list(x) for x in saved["ranks"]]
    here = _rank_index(strategy, rank)
    new_ranks = [_rank_index(strategy, r) for r in range(world_size)]
    old_tp, new_tp = len({t for _, t in old_ranks}), len({t for _, t in new_ranks})
    if old_tp != new_tp:
        return {}, f"they were saved with parallel.tensor = {old_tp} and this run has {new_tp}"
    old_dp, new_dp = len(old_ranks) // old_tp, world_size // new_tp
    srcs = sources(old_ranks, here, new_dp)
    mine = {s.fqn: (s, predivide_factor(h.unit)) for h in hs for s in h.slots}
    missing = sorted(f for f, (s, _) in mine.items()
                     if f not in saved["params"] or tuple(saved["params"][f]["shape"]) != s.shape)
    targets = {f"rank{q}": {f: torch.empty(s.shape, dtype=torch.float32, device=device)
                            for f, (s, _) in mine.items() if f not in missing} for q in srcs}
    targets = {q: t for q, t in targets.items() if t}
    scale = {f: redistribution_scale(old_dp, new_dp, float(saved["params"][f]["predivide"]), pre)
             for f, (_, pre) in mine.items() if f not in missing}
    why = ""
    if missing:
        why = (f"{len(missing)} of this model's parameters have none saved or one of another shape "
               f"({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''})")
    plan = {"sources": srcs, "scale": scale, "resharded": (old_dp, new_dp) if old_dp != new_dp else None}
    return ({KEY: targets, PLAN: plan} if targets else {PLAN: plan}), why


def tensors(targets: dict) -> dict:
    """What DCP reads of ``load_targets``' answer (its plan left out)."""
    return {k: v for k, v in targets.items() if k != PLAN}


def apply(strategy, loaded: dict, rank: int, why_dropped: str, where: str) -> None:
    """Install what ``load_targets`` read (after the load filled it), redistributed by its plan (without one, as
    from ``state_dict`` of this very run: this rank's own, unscaled); every residual not read starts from zero.
    Rank 0 prints one line when saved residuals were redistributed or dropped."""
    plan = loaded.get(PLAN) or {"sources": [rank], "scale": {}}
    rows = loaded.get(KEY, {})
    for h in holders(strategy):
        h.residual = None  # allocated as zeros at the next reduce-scatter, unless something is read below
        for i, s in enumerate(h.slots):
            parts = [rows[f"rank{q}"][s.fqn] for q in plan.get("sources", []) if s.fqn in rows.get(f"rank{q}", {})]
            if not parts:
                continue
            if h.residual is None:
                h.residual = h.new_residual(parts[0].device)
            total = parts[0] if len(parts) == 1 else torch.stack(parts).sum(0)
            scale = plan["scale"].get(s.fqn, 1.0)
            from_param(total if scale == 1.0 else total * scale, h.param_residual(i), s.shard_dim)
    if rank != 0:
        return
    if plan.get("resharded"):
        old, new = plan["resharded"]
        print(f"[checkpoint] error-feedback residuals in {where} were saved by {old} data-parallel ranks and are "
              f"redistributed over {new} (each new rank takes the old ranks congruent to it modulo {new}, scaled "
              f"by {new}/{old}: the pending correction is kept)", file=sys.stderr, flush=True)
    if why_dropped:
        print(f"[checkpoint] error-feedback residuals in {where} are dropped ({why_dropped}): error feedback "
              "starts from zero for them", file=sys.stderr, flush=True)


def held_bytes(model: torch.nn.Module) -> int:
    """Bytes of the residuals a model's reduce-scatters hold now (0 without error feedback)."""

    total = 0
    for rs in custom_reduce_scatters(model):
        r = getattr(rs, "residual", None)
        if r is not None:
            total += r.numel() * r.element_size()
    return total
