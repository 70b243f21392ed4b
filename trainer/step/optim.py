"""Optimizers by name, and which of them may update a shard on its own.

ZeRO stages 1-3 hand the optimizer only this rank's shard of every parameter (FSDP2 DTensors). That is exact
for *elementwise* optimizers, whose update of one element reads only that element's gradient and state (SGD,
Adam, AdamW, RMSprop, ...). An optimizer that couples elements (Adafactor factors the second moment into row and
column statistics of each matrix) would compute them from a shard and give a different result, so it is refused
at stage >= 1 before any worker starts.
"""

from __future__ import annotations

from typing import NamedTuple

from dutycycle.engine.errors import ConfigError


class Spec(NamedTuple):
    cls: str  # the torch.optim class
    elementwise: bool
    state: int | None  # full-size state tensors per parameter (``step`` scalars aside); None: not a multiple
    momentum: bool = False  # takes optim.momentum, and then keeps one more state tensor when it is > 0


OPTIMIZERS = {
    "adamw": Spec("AdamW", True, 2),
    "adam": Spec("Adam", True, 2),
    "sgd": Spec("SGD", True, 0, momentum=True),
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


def make_optimizer(params, optim):
    """The optimizer named by ``optim.name`` over ``params`` (an iterable of parameters, sharded or not).

    No weight decay on 1-d parameters (norms and biases), as usual. Only the arguments a class accepts are
    passed (``betas`` to the Adam family, ``momentum`` to SGD and RMSprop)."""
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
    return cls(groups, **kwargs)


def optimizer_state_tensors(optim) -> int | None:
    """Full-size state tensors per parameter (the ``step`` scalars aside), for the formula; None for factored
    state (adafactor), not a multiple of the parameter count."""
    spec = OPTIMIZERS[optim.name]
    if spec.state is None:
        return None
    return spec.state + int(spec.momentum and optim.momentum > 0)
