"""What a checkpoint holds besides model and optimizer tensors: ``trainer_state.json``, plain JSON.

- ``step`` (optimizer steps done) and ``epoch``; the learning-rate schedule is a pure function of the step
  (``loop.lr_at``), recorded with its inputs so a person can see what the run was doing;
- the loader's state (epoch, next global batch, seed, plan inputs): loads at any world size;
- RNG states of every rank (torch CPU, CUDA, numpy, Python's ``random``): bytes as base64, numbers as lists;
- global batches left out after non-finite losses (``skipped``), so a resumed run leaves them out too;
- the resolved config, the data fingerprint and lineage (the cache and the table it came from).

Nothing here runs code on load: it is JSON, decoded field by field.
"""

from __future__ import annotations

import base64
import random
from dataclasses import asdict, dataclass, field

from dutycycle.engine.errors import CorruptArtifactError


@dataclass
class TrainerState:
    step: int
    epoch: int
    loader: dict
    rng: list[dict]  # one per rank of the saving run, in rank order
    world_size: int
    skipped: list[list[int]] = field(default_factory=list)  # [[epoch, global batch index], ...]
    schedule: dict = field(default_factory=dict)
    config: dict = field(default_factory=dict)
    data: dict = field(default_factory=dict)  # fingerprint and lineage
    strategy: dict = field(default_factory=dict)  # zero stage and wrapper the state was saved from

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d, where: str) -> TrainerState:
        try:
            return cls(step=int(d["step"]), epoch=int(d["epoch"]), loader=dict(d["loader"]),
                       rng=[dict(r) for r in d["rng"]], world_size=int(d["world_size"]),
                       skipped=[[int(e), int(b)] for e, b in d["skipped"]], schedule=dict(d["schedule"]),
                       config=dict(d["config"]), data=dict(d["data"]), strategy=dict(d["strategy"]))
        except (KeyError, TypeError, ValueError) as e:
            raise CorruptArtifactError(f"{where} is malformed ({type(e).__name__}: {e})") from None

    def rng_for(self, rank: int) -> dict:
        """This rank's saved RNG state; at a larger world size than the saving run, new ranks take rank 0's."""
        return self.rng[rank] if rank < len(self.rng) else self.rng[0]


# ------------------------------------------------------------------------------------------------------ RNG


def capture_rng(device=None) -> dict:
    import numpy as np
    import torch

    version, mt, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    out = {
        "torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode(),
        "numpy": {"kind": kind, "keys": keys.tolist(), "pos": int(pos), "has_gauss": int(has_gauss),
                  "cached_gaussian": float(cached)},
        "python": {"version": version, "state": list(mt), "gauss": gauss},
    }
    if device is not None and getattr(device, "type", "cpu") == "cuda":
        out["cuda"] = base64.b64encode(torch.cuda.get_rng_state(device).numpy().tobytes()).decode()
    return out


def restore_rng(state: dict, device=None) -> None:
    import numpy as np
    import torch

    def tensor(b64: str):
        return torch.frombuffer(bytearray(base64.b64decode(b64)), dtype=torch.uint8)

    torch.set_rng_state(tensor(state["torch"]))
    n = state["numpy"]
    np.random.set_state((n["kind"], np.asarray(n["keys"], dtype=np.uint32), n["pos"], n["has_gauss"],
                         n["cached_gaussian"]))
    p = state["python"]
    random.setstate((p["version"], tuple(p["state"]), p["gauss"]))
    if "cuda" in state and device is not None and getattr(device, "type", "cpu") == "cuda":
        torch.cuda.set_rng_state(tensor(state["cuda"]), device)
