"""Plug-in models for the checkpoint tests (``model.name = "tests.support.ckpt_models:risky_cnn"``, or
``risky_vit`` for tensor parallelism): the demo CNN with
dropout (so a resume that does not restore the RNG trains other weights) and three injected faults, set per
process through ``FAULTS``:

- ``crash_at``: the n-th training forward raises ``InjectedCrash`` (a worker dying mid-run, after its last commit);
- ``nan_at``: the n-th training forward returns NaN once (a transient fault);
- ``poison``: any batch holding this image returns NaN (a bad sample: every batch that contains it diverges);
- ``kill_at``: the n-th training forward's output gets a hook that SIGKILLs the process during the backward (a
  rank dying mid-step, its peers inside the step's collectives; tests/support/kill_launch.py), after calling
  ``on_kill`` if set.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from dutycycle.trainer.step.models import SmallCNN, TinyViT

FAULTS: dict = {"crash_at": None, "nan_at": None, "poison": None, "kill_at": None, "on_kill": None}


class InjectedCrash(RuntimeError):
    pass


def _count_forward(model) -> None:
    """Count a training forward; the ``crash_at``-th raises ``InjectedCrash``."""
    if model.training:
        model.forwards += 1
        if FAULTS["crash_at"] == model.forwards:
            raise InjectedCrash(f"injected crash at training forward {model.forwards}")


def _maybe_kill(model, out):
    """At the ``kill_at``-th training forward: SIGKILL this process when the backward reaches the output."""
    if model.training and FAULTS["kill_at"] == model.forwards and out.requires_grad:
        import os
        import signal

        def kill(grad):
            if FAULTS["on_kill"] is not None:
                FAULTS["on_kill"]()
            os.kill(os.getpid(), signal.SIGKILL)

        out.register_hook(kill)
    return out


class RiskyCNN(SmallCNN):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.forwards = 0

    def forward(self, x):
        _count_forward(self)
        h = self.blocks(x).mean(dim=(2, 3))
        out = self.head(F.dropout(h, p=0.25, training=self.training))
        poison = FAULTS["poison"]
        if self.training and (FAULTS["nan_at"] == self.forwards or (
                poison is not None and bool((x == poison.to(x.dtype)).flatten(1).all(1).any()))):
            out = out * float("nan")
        return _maybe_kill(self, out)


def risky_cnn(cfg, in_channels, num_classes, image_size):
    return RiskyCNN(in_channels, num_classes, width=cfg.width, depth=cfg.depth, groups=cfg.groups)


def reset() -> None:
    FAULTS.update(crash_at=None, nan_at=None, poison=None, kill_at=None, on_kill=None)


class RiskyViT(TinyViT):
    """The ViT with the same injected crash and a dropout before the head (the RNG a resume must restore; under
    tensor parallelism every rank of a group draws the same mask, or the replicated head would diverge)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.forwards = 0

    def forward(self, x):
        _count_forward(self)
        x = self.patch(x).flatten(2).transpose(1, 2)
        x = self.blocks(torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1) + self.pos)
        return self.head(F.dropout(self.norm(x[:, 0]), p=0.25, training=self.training))


def risky_vit(cfg, in_channels, num_classes, image_size):
    return RiskyViT(in_channels, num_classes, image_size, dim=cfg.width, depth=cfg.depth, heads=cfg.heads,
                    patch=cfg.patch)
