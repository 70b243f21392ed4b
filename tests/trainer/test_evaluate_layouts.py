"""``dutycycle evaluate`` on checkpoints saved by every parallel layout the trainer supports, on real gloo ranks:
each run is trained at 2 ranks (float64) and evaluated here, in one process, unsharded.

Checked per layout against what the run itself recorded: the commit's model tensors are bit-identical to the
consolidated weights the run gathered (``summary.json``'s ``weights_sha256``); the evaluation's logits equal, bit
for bit, the plain model loaded from the run's ``model.safetensors`` applied to the same batches (the same
weights evaluated directly); its loss and accuracy are the run's own last validation pass under the layout. That
pass summed per-rank partial losses in another order: float64, a few dozen additions of values ~1, so the sums
agree to ~1e-15 relative; 1e-12 leaves room and would still catch one wrong sample (~1e-2 of the mean).

Hybrid sharding needs 4 ranks (2 groups of at least 2): its commit is loaded the same way in test_hybrid.py's
round trip, and tensor 2 x data 2 in test_tensor.py's; what follows the load does not depend on the layout.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from dutycycle.trainer.checkpoint.weights import model_state_dict, select_commit
from dutycycle.trainer.serve.evaldata import open_split
from dutycycle.trainer.serve.evaluate import data_info, evaluate, run_config
from dutycycle.trainer.step.models import build_model
from dutycycle.trainer.step.summary import weights_digest

from ..support import eval_worker as ew
from ..support.harness import run_distributed


def direct_logits(run_dir: str) -> np.ndarray:
    """The plain model with the run's final ``model.safetensors``, applied to the run's validation batches."""
    from safetensors.torch import load_file

    cfg = run_config(run_dir)
    info, _ = data_info(run_dir, cfg)
    model = build_model(cfg.model, info.channels, info.num_classes, info.size).double()
    model.load_state_dict(load_file(f"{run_dir}/model.safetensors"))
    model.eval()
    split = open_split(cfg, info, "val", batch_size=cfg.data.eval_batch_size)
    with torch.no_grad():
        return np.concatenate([model(x.double()).numpy() for x, _, _ in split.batches()])


@pytest.mark.timeout(300)
def test_every_layout_evaluates_its_commit_as_the_run_evaluated_it(tmp_path):
    runs = run_distributed(ew.train_layouts, 2, str(tmp_path), list(ew.LAYOUTS), timeout=280)[0]
    assert {r["layout"]["strategy"] for r in runs.values()} == {"ddp", "fsdp2"}
    assert {r["layout"]["zero_stage"] for r in runs.values()} == {0, 1, 2, 3}
    assert any(r["layout"]["tensor"] == 2 for r in runs.values())
    assert any(r["layout"]["offload"] == "optimizer" for r in runs.values())
    for name, run in runs.items():
        run_dir = ew.run_dir(str(tmp_path), name)
        selected = select_commit(f"{run_dir}/checkpoints")
        assert selected.step == ew.STEPS, name
        state = model_state_dict(selected)
        assert weights_digest(state) == run["weights_sha256"], f"{name}: the commit's weights differ"
        assert all(t.dtype == torch.float64 for t in state.values() if t.is_floating_point()), name

        ev = evaluate(run_dir, "val", write=False)
        assert ev.metrics["weights"]["kind"] == "checkpoint" and ev.metrics["step"] == ew.STEPS, name
        assert ev.logits.dtype == np.float64
        assert np.array_equal(ev.logits, direct_logits(run_dir)), name
        assert ev.metrics["samples"] == run["val_samples"] == 16, name
        assert ev.accuracy == run["val_accuracy"], name
        assert ev.loss == pytest.approx(run["val_loss"], rel=1e-12), name
