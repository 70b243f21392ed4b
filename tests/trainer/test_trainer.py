"""The Trainer's own calls: a run stopped after some steps and continued in another Trainer through
``state_dict`` / ``load_state_dict`` (in memory, no checkpoint files) takes the same steps, bit for bit, as one
uninterrupted run."""

from __future__ import annotations

import copy
import itertools
import json

import pytest
import torch
from dutycycle.trainer.config import load_config
from dutycycle.trainer.step.loop import WorkerContext
from dutycycle.trainer.step.trainer import Trainer


def _cfg(run_dir):
    # 192 samples in batches of 32: 6 steps per epoch, so the 10 steps cross an epoch boundary after the stop at 4
    return load_config(None, [
        "data.source=synthetic", "data.size=16", "data.global_batch_size=32", "data.synthetic_samples=192",
        "data.micro_batches=2", "data.augment.flip=true", "model.width=8", "run.max_steps=10", "run.eval_every=0",
        "run.log_every=1", "run.precision=fp64", f"run.dir={run_dir}", "checkpoint.every=0",
        "parallel.threads_per_worker=1"])


def _losses(run_dir) -> dict[int, float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


@pytest.mark.parametrize("stop, epoch", [(4, 0), (6, 1)])  # mid-epoch, and after the epoch's last batch
def test_state_dict_round_trip_resumes_bit_identically(tmp_path, stop, epoch):
    torch.set_num_threads(1)
    with Trainer(_cfg(tmp_path / "a"), WorkerContext(run_dir=str(tmp_path / "a"))) as whole:
        reference = whole.train()
    want = _losses(tmp_path / "a")
    assert sorted(want) == list(range(1, 11))

    with Trainer(_cfg(tmp_path / "b"), WorkerContext(run_dir=str(tmp_path / "b"))) as first:
        losses = [float(first.train_step(batch, index)) for batch, index in itertools.islice(first.batches(), stop)]
        assert first.step == stop
        saved = copy.deepcopy(first.state_dict())
    assert losses == [want[s] for s in range(1, stop + 1)]
    assert saved["trainer"]["step"] == stop and set(saved) >= {"model", "optim", "trainer", "rng"}

    with Trainer(_cfg(tmp_path / "c"), WorkerContext(run_dir=str(tmp_path / "c"))) as second:
        second.load_state_dict(saved)
        assert (second.step, second.epoch) == (stop, epoch)  # after the epoch's last batch: the next epoch
        resumed = second.train()
    got = _losses(tmp_path / "c")
    assert got == {s: want[s] for s in range(stop + 1, 11)}
    assert resumed["weights_sha256"] == reference["weights_sha256"]
    assert resumed["val_loss"] == reference["val_loss"]
