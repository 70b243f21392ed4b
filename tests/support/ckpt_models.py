"""A plug-in model for the checkpoint tests (``model.name = "tests.support.ckpt_models:risky_cnn"``): the demo CNN with
dropout (so a resume that does not restore the RNG trains other weights) and three injected faults, set per
process through ``FAULTS``:

- ``crash_at``: the n-th training forward raises ``InjectedCrash`` (a worker dying mid-run, after its last commit);
- ``nan_at``: the n-th training forward returns NaN once (a transient fault);
- ``poison``: any batch holding this image returns NaN (a bad sample: every batch that contains it diverges).
"""

from __future__ import annotations

import torch.nn.functional as F
from dutycycle.trainer.step.models import SmallCNN

FAULTS: dict = {"crash_at": None, "nan_at": None, "poison": None}


class InjectedCrash(RuntimeError):
    pass


class RiskyCNN(SmallCNN):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.forwards = 0

    def forward(self, x):
        if self.training:
            self.forwards += 1
            if FAULTS["crash_at"] == self.forwards:
                raise InjectedCrash(f"injected crash at training forward {self.forwards}")
        h = self.blocks(x).mean(dim=(2, 3))
        out = self.head(F.dropout(h, p=0.25, training=self.training))
        poison = FAULTS["poison"]
        if self.training and (FAULTS["nan_at"] == self.forwards or (
                poison is not None and bool((x == poison.to(x.dtype)).flatten(1).all(1).any()))):
            out = out * float("nan")
        return out


def risky_cnn(cfg, in_channels, num_classes, image_size):
    return RiskyCNN(in_channels, num_classes, width=cfg.width, depth=cfg.depth, groups=cfg.groups)


def reset() -> None:
    FAULTS.update(crash_at=None, nan_at=None, poison=None)
