"""Optimizers by name, and which of them may update a shard on its own.

ZeRO stages 1-3 hand the optimizer only this rank's shard of every parameter (FSDP2 DTensors). That is exact
for *elementwise* optimizers, whose update of one element reads only that element's gradient and state (SGD,
Adam, AdamW, RMSprop, ...). An optimizer that couples elements (Adafactor factors the second moment into row and
column statistics of each matrix) would compute them from a shard and give a different result, so it is refused
at stage >= 1 before any worker starts.

Fused kernels (``optim.fused``, on by default): torch's fused Adam, AdamW and SGD update every parameter of a
device and dtype in one kernel launch instead of one (or a few foreach launches) per tensor. ``fused_choice``
takes one where it is supported and says why not otherwise: the parameters all on CUDA (FSDP2's DTensor shards
included: torch 2.13 registers ``_fused_adam_`` / ``_fused_adamw_`` as DTensor pointwise ops, so each rank
updates its local shard; an offloaded shard lives on the CPU, and is not fused) and floating point. torch 2.13
also has fused CPU kernels; they are not taken here, since CPU runs are where parity is tested against torch's
per-tensor loop, whose last bits a fused kernel need not reproduce. ``implementation`` names what a built
optimizer runs, for the run's log and summary.
"""

from __future__ import annotations

from typing import NamedTuple

from dutycycle.engine.errors import ConfigError


class Spec(NamedTuple):
    cls: str  # the torch.optim class
    elementwise: bool
    state: int | None  # full-size state tensors per parameter (``step`` scalars aside); None: not a multiple
    momentum: bool = False  # takes optim.momentum, and then keeps one more state tensor when it is > 0
    fused: bool = False  # torch 2.13 has a fused CUDA kernel for it (``fused=True``)


OPTIMIZERS = {
    "adamw": Spec("AdamW", True, 2, fused=True),
    "adam": Spec("Adam", True, 2, fused=True),
    "sgd": Spec("SGD", True, 0, momentum=True, fused=True),
    "rmsprop": Spec("RMSprop", True, 1, momentum=True),
    "adagrad": Spec("Adagrad", True, 1),
    "adamax": Spec("Adamax", True, 2),
    "nadam": Spec("NAdam", True, 2),
    "radam": Spec("RAdam", True, 2),
    "adafactor": Spec("Adafactor", False, None),  # factored second moment
}


def check_optimizer(name: str, zero_stage: int) -> None:
    """Whether optimizer ``name`` (a registered one: the optim section checks that) can update ZeRO shards."""
    spec = OPTIMIZERS[name]
    if zero_stage >= 1 and not spec.elementwise:
        ok = ", ".join(n for n, s in OPTIMIZERS.items() if s.elementwise)
        raise ConfigError(
            f"optim.name = {name!r} ({spec.cls}) is not elementwise: its update of one element depends on others "
            f"in the same tensor, so it cannot update a ZeRO shard on its own (parallel.zero_stage = {zero_stage}). "
            f"Use parallel.zero_stage = 0, or an elementwise optimizer: {ok}"
        )


FUSED_DEVICES = ("cuda",)  # device types whose fused kernels are taken (the module docstring says why not CPU)


def fused_choice(params, optim) -> tuple[bool, str]:
    """Whether ``optim``'s optimizer runs fused over ``params`` (the trainable ones), and why (a sentence)."""
    spec = OPTIMIZERS[optim.name]
    if not optim.fused:
        return False, "optim.fused = false"
    if not spec.fused:
        return False, f"torch has no fused {spec.cls} kernel for CUDA"
    devices = sorted({p.device.type for p in params})
    if not devices:
        return False, "no trainable parameters"
    if any(d not in FUSED_DEVICES for d in devices):
        return False, (f"parameters on {', '.join(devices)}: fused kernels are taken on "
                       f"{', '.join(FUSED_DEVICES)} only")
    dtypes = sorted({str(p.dtype).removeprefix("torch.") for p in params if not p.dtype.is_floating_point})
    if dtypes:
        return False, f"parameters of dtype {', '.join(dtypes)}: fused kernels take floating point only"
    return True, f"fused {spec.cls} on {', '.join(devices)}"


def implementation(optimizer) -> str:
    """What a torch optimizer's step runs: "fused", "foreach" or "for-loop" (one update per tensor). With
    neither flag set torch decides at the step: foreach where every parameter is on CUDA, else the loop (its
    default for the two device types dutycycle trains on)."""
    group = optimizer.param_groups[0] if optimizer.param_groups else {}
    if group.get("fused"):
        return "fused"
    foreach = group.get("foreach")
    if foreach is None:
        foreach = all(p.device.type == "cuda" for g in optimizer.param_groups for p in g["params"])
    return "foreach" if foreach else "for-loop"


def make_optimizer(params, optim):
    """The optimizer named by ``optim.name`` over ``params`` (an iterable of parameters, sharded or not).

    No weight decay on 1-d parameters (norms and biases), as usual. Only the arguments a class accepts are
    passed (``betas`` to the Adam family, ``momentum`` to SGD and RMSprop); ``fused=True`` where
    ``fused_choice`` says so (``implementation`` names what runs)."""
    import inspect

    import torch

    params = [p for p in params if p.requires_grad]
    decay = [p for p in params if p.dim() > 1]
    no_decay = [p for p in params if p.dim() <= 1]
    groups = [g for g in ({"params": decay, "weight_decay": optim.weight_decay},
                          {"params": no_decay, "weight_decay": 0.0}) if g["params"]]
    spec = OPTIMIZERS[optim.name]
    cls = getattr(torch.optim, spec.cls)
    accepted = inspect.signature(cls.__init__).parameters
    kwargs = {"lr": optim.lr}
    if "betas" in accepted:
        kwargs["betas"] = (optim.beta1, optim.beta2)
    if spec.momentum:
        kwargs["momentum"] = optim.momentum
    if fused_choice(params, optim)[0]:
        kwargs["fused"] = True
    return cls(groups, **kwargs)


def optimizer_state_tensors(optim) -> int | None:
    """Full-size state tensors per parameter (the ``step`` scalars aside), for the formula; None for factored
    state (adafactor), not a multiple of the parameter count."""
    spec = OPTIMIZERS[optim.name]
    if spec.state is None:
        return None
    return spec.state + int(spec.momentum and optim.momentum > 0)
