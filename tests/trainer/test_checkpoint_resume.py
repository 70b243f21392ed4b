"""Resume, resharding, non-finite recovery and the health check, through the real step loop and DCP on real gloo
ranks.

Bit-identical means equal sha256 of the consolidated fp32 weights: the resumed run continues with the same
weights, optimizer state, loader position and RNG (the model has dropout, so an RNG not restored would train
other weights) as the run that never stopped. Resharded continuations compare in float64 with tolerance 1e-10,
as test_zero.py derives: a different world size only reorders sums (~1e-16 relative per operation).
"""

from __future__ import annotations

import json

import pytest
import torch

from ..support import ckpt_models as cm
from ..support import ckpt_worker as cw
from ..support.harness import run_distributed


@pytest.fixture(autouse=True)
def _no_faults():
    cm.reset()
    yield
    cm.reset()


def rows(run_dir) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_resume_after_a_crash_is_bit_identical_in_one_process(tmp_path, monkeypatch):
    a = cw.train(cw.small_cfg(tmp_path / "a"))
    cm.FAULTS["crash_at"] = 11  # step 11: the commit of step 8 exists, steps 9-10 are lost
    with pytest.raises(cm.InjectedCrash):
        cw.train(cw.small_cfg(tmp_path / "b"))
    cm.reset()
    b = cw.train(cw.small_cfg(tmp_path / "b"))
    assert b["checkpoint"]["resumed"]["step"] == 8
    assert b["checkpoint"]["resumed"]["steps_lost"] == 2  # log_every = 1: steps 9 and 10 had reached the log
    assert b["weights_sha256"] == a["weights_sha256"]
    # the job's account covers both attempts: the two steps trained again and the downtime are their own figure,
    # and goodput divides by the whole job's time (one attempt: its own figures)
    job = b["job"]
    assert job["attempts"] == 2 and job["steps_redone"] == 2 and job["redone_s"] > 0 and job["down_s"] >= 0
    assert job["failures_s"] == pytest.approx(job["redone_s"] + job["down_s"])
    assert job["wall_s"] > b["wall_s"] + job["failures_s"]  # and the first attempt's 8 kept steps
    assert b["goodput"] == job["goodput"] and job["failures_fraction"] == pytest.approx(job["failures_s"] / job["wall_s"])
    assert a["job"]["attempts"] == 1 and a["goodput"] == pytest.approx(a["goodput_attempt"])
    # the continued steps' losses are the uninterrupted run's, bit for bit; the lost steps' rows were replaced
    la = {r["step"]: r["loss"] for r in rows(tmp_path / "a") if "loss" in r}
    lb = [(r["step"], r["loss"]) for r in rows(tmp_path / "b") if "loss" in r]
    assert [s for s, _ in lb] == list(range(1, 15))
    assert all(loss == la[s] for s, loss in lb)
    # without restoring the RNG the dropout masks differ and so do the weights: the comparison can fail
    from dutycycle.trainer.checkpoint import resume

    monkeypatch.setattr(resume, "restore_rng", lambda *a, **k: None)
    cm.FAULTS["crash_at"] = 11
    with pytest.raises(cm.InjectedCrash):
        cw.train(cw.small_cfg(tmp_path / "c"))
    cm.reset()
    c = cw.train(cw.small_cfg(tmp_path / "c"))
    assert c["checkpoint"]["resumed"]["step"] == 8 and c["weights_sha256"] != a["weights_sha256"]


class PeerLost(RuntimeError):
    pass


@pytest.mark.parametrize("async_save", ["true", "false"])
def test_a_commit_lands_only_after_its_steps_metrics_row(tmp_path, monkeypatch, async_save):
    """A step's metrics row comes from a collective across the ranks. When it was written after the step's save
    started, rank 1 killed in between left rank 0 without the row while its saver thread committed the step anyway,
    and the resumed run, which keeps the rows up to its step, never wrote that row (seen under Ray: rows 1-11 and
    13-40). Stood in for in one process: the flush that would write step 12's row raises, as rank 0's does when
    its peer is gone. The commit of step 12 must not land: the resume is from step 8, every step has one row, and
    the weights are the uninterrupted run's."""
    from dutycycle.trainer.step.steplog import StepLog

    extra = [f"checkpoint.async_save={async_save}", "run.log_every=5"]  # step 12's row: in the flush after its save
    a = cw.train(cw.small_cfg(tmp_path / "a", *extra))
    real = StepLog.flush

    def flush(self):
        if any(p.step == 12 for p in self.pending):
            raise PeerLost("the other rank is gone")
        real(self)

    monkeypatch.setattr(StepLog, "flush", flush)
    with pytest.raises(PeerLost):
        cw.train(cw.small_cfg(tmp_path / "b", *extra))
    monkeypatch.setattr(StepLog, "flush", real)
    assert not (tmp_path / "b/checkpoints/step-00000012/manifest.json").exists()
    b = cw.train(cw.small_cfg(tmp_path / "b", *extra))
    assert b["checkpoint"]["resumed"]["step"] == 8
    assert [r["step"] for r in rows(tmp_path / "b") if "loss" in r] == list(range(1, 15))
    assert b["weights_sha256"] == a["weights_sha256"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_rank_killed_before_the_saved_steps_row_leaves_no_commit_of_that_step(tmp_path):
    """The same at 2 real ranks: rank 1 SIGKILLs itself at the collective that makes step 12's row. Rank 0 loses
    its peer; the commit of step 12 never lands, and the run started again resumes from step 8 with one row per
    step."""
    run = tmp_path / "run"
    extra = ["run.log_every=5", "run.max_steps=16"]
    codes = cw.run_with_rank_1_killed(str(run), extra, step=12)
    assert codes[1] == -9 and codes[0] != 0, codes
    assert not (run / "checkpoints" / "step-00000012" / "manifest.json").exists()
    again = run_distributed(cw.train_at, 2, str(run), extra, timeout=200)[0]
    assert again["resumed"]["step"] == 8
    assert [r["step"] for r in rows(run) if "loss" in r] == list(range(1, 17))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_resume_after_a_crash_is_bit_identical_at_two_ranks_stages_0_2_3(tmp_path):
    results = run_distributed(cw.resume_runs, 2, str(tmp_path), [0, 2, 3], timeout=280)
    for stage, want in (("0", "ddp"), ("2", "fsdp2"), ("3", "fsdp2")):
        r = results[0][stage]
        assert r["crashed"] and r["strategy"] == want
        assert r["resumed"]["step"] == 8, r
        assert r["b"] == r["a"], f"stage {stage}: resumed weights differ"
        assert r["loss_b"] == r["loss_a"]


@pytest.fixture(scope="module")
def resharded(tmp_path_factory):
    root = tmp_path_factory.mktemp("reshard")
    w1, w2, w4 = (f"{root}/w{n}" for n in (1, 2, 4))
    saved = run_distributed(cw.reshard_save, 2, w2, timeout=280)[0]
    at1 = run_distributed(cw.reshard_load, 1, [w2], w1, timeout=280)[0]
    at4 = run_distributed(cw.reshard_load, 4, [w2], w4, timeout=280)[0]
    back = run_distributed(cw.reshard_load, 2, [w1, w4], None, timeout=280)[0]
    return saved, {"2 to 1": (at1, w2), "2 to 4": (at4, w2), "1 back to 2": (back, w1), "4 back to 2": (back, w4)}


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("stage", ["0", "1", "2", "3"])
def test_resharding_round_trips_load_exactly(resharded, stage):
    """Saved at 2 ranks, loaded at 1 and at 4, saved there and loaded at 2 again: model and optimizer state are
    bit-identical every time, and one more step from the loaded state matches the step taken at 2 ranks."""
    saved, loads = resharded
    for name, (got, src) in loads.items():
        r = got[f"{src}/{stage}"]
        assert r["step"] == 4, name
        assert r["digest"] == saved[stage]["digest"], f"stage {stage}, {name}: loaded state differs"
        ref = saved[stage]["after"]
        worst = max(float((torch.tensor(r["after"][k]) - torch.tensor(ref[k])).abs().max()) for k in ref)
        assert worst < 1e-10, (name, worst)


def _skip_reference(tmp_path, cfg):
    """The run a skip should equal: the same steps with global batch 5 of epoch 0 left out from the start."""
    from dutycycle.trainer.checkpoint.checkpointer import Checkpointer
    from dutycycle.trainer.cluster.world import World
    from dutycycle.trainer.step.data import make_sources
    from dutycycle.trainer.step.loop import WorkerContext
    from dutycycle.trainer.step.trainer import Trainer

    cfg.checkpoint.every = 0
    ctx = WorkerContext(run_dir=str(tmp_path / "ref"))
    ck = Checkpointer(cfg, ctx, total_steps=cfg.run.max_steps, data_info=make_sources(cfg, World())[2])
    ck.skipped = {(0, 5)}
    torch.set_num_threads(1)
    with Trainer(cfg, ctx, checkpointer=ck) as trainer:
        return trainer.train()


def test_nonfinite_loss_rolls_back_and_skips_the_batch(tmp_path):
    """A bad sample in global batch 5 (step 6) makes the loss NaN: the run uncommits the checkpoint of step 6,
    rolls back to step 4, leaves the batch out and ends bit-identical to a run that never had it; the event names
    the batch's sample ids, which are the plan's."""
    from dutycycle.trainer.cluster.world import World
    from dutycycle.trainer.step.data import make_sources

    cfg = cw.small_cfg(tmp_path / "run", "checkpoint.every=2", "run.max_steps=7", "data.synthetic_samples=256")
    train_src = make_sources(cfg, World())[0]
    it = iter(train_src)
    batches = [next(it) for _ in range(6)]
    cm.FAULTS["poison"] = batches[5]["image"][3]  # one sample of global batch 5, first seen at step 6
    got = cw.train(cfg)
    cm.reset()
    events = got["checkpoint"]["nonfinite"]
    assert len(events) == 1 and events[0]["step"] == 6 and events[0]["batch"] == 5 and events[0]["action"] == "skip"
    assert events[0]["rolled_back_to"] == 4
    assert events[0]["sample_ids"] == batches[5]["sample_id"]  # the plan's global batch (one rank: all of it)
    assert got["checkpoint"]["skipped_batches"] == [[0, 5]] and got["steps"] == 7
    assert got["weights_sha256"] == _skip_reference(tmp_path, cw.small_cfg(
        tmp_path / "ref", "run.max_steps=7", "data.synthetic_samples=256"))["weights_sha256"]
    # the last commit is step 7, and a resume of it would leave the batch out too
    state = json.loads((tmp_path / "run/checkpoints/step-00000007/trainer_state.json").read_text())
    assert state["skipped"] == [[0, 5]]


def test_transient_nonfinite_loss_rolls_back_and_trains_the_same_batches(tmp_path):
    """``rollback``: a NaN that happens once (the 6th forward) is rolled back and the same batches are trained
    again; the result equals a run that never saw it."""
    a = cw.train(cw.small_cfg(tmp_path / "a", "checkpoint.every=2", "run.max_steps=8"))
    cm.FAULTS["nan_at"] = 6
    b = cw.train(cw.small_cfg(tmp_path / "b", "checkpoint.every=2", "run.max_steps=8",
                              "checkpoint.on_nonfinite=rollback"))
    assert [e["action"] for e in b["checkpoint"]["nonfinite"]] == ["rollback"]
    assert b["checkpoint"]["skipped_batches"] == []
    assert b["weights_sha256"] == a["weights_sha256"]


def test_nonfinite_loss_stops_when_asked_naming_the_samples(tmp_path):
    from dutycycle.trainer.cluster.world import World
    from dutycycle.trainer.step.data import make_sources
    from dutycycle.trainer.step.loop import TrainingDiverged

    cfg = cw.small_cfg(tmp_path / "run", "checkpoint.every=2", "checkpoint.on_nonfinite=stop")
    batches = [b for _, b in zip(range(4), make_sources(cfg, World())[0], strict=False)]
    cm.FAULTS["poison"] = batches[3]["image"][0]
    with pytest.raises(TrainingDiverged, match=r"loss became nan at step 4 .*global batch 3 of epoch 0") as err:
        cw.train(cfg)
    assert err.value.sample_ids == batches[3]["sample_id"]
    assert str(batches[3]["sample_id"][0]) in str(err.value)


def test_health_check_refuses_a_bad_worker(tmp_path):
    results = run_distributed(cw.health_with_bad_worker, 2, str(tmp_path / "run"), timeout=120)
    for r in results:
        assert r["error"] and "rank 1" in r["error"] and "rank 0" not in r["error"], r
        assert "matmul wrong" in r["error"]
    health = json.loads((tmp_path / "run" / "health.json").read_text())
    assert [w["rank"] for w in health["workers"]] == [0, 1]
    assert health["workers"][0]["problems"] == [] and health["workers"][1]["problems"]
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # refused before the first step


def test_a_resume_with_other_loader_plan_inputs_is_refused_unless_forced(tmp_path):
    """The loader position in a checkpoint indexes one sequence of batches: resuming it under another plan
    (here data.window) would silently train on a different order, so it is refused naming the field and the
    trainer key that accepts it; with the key set, the run continues from the saved step."""
    from dutycycle.engine.errors import ConfigError

    from ..support.cachemaker import make_cache

    cache = str(tmp_path / "cache")
    make_cache(cache, 160, shape=(16, 16, 3), shards=2, splits={"train": 0.8, "val": 0.2})
    base = ["data.source=cache", f"data.cache={cache}", "data.loader_mode=sync", "run.max_steps=8"]
    cw.train(cw.small_cfg(str(tmp_path / "run"), *base))
    more = [*base[:-1], "run.max_steps=10", "data.window=2"]
    with pytest.raises(ConfigError, match=r"window.*checkpoint\.force_loader_state = true"):
        cw.train(cw.small_cfg(str(tmp_path / "run"), *more))
    summary = cw.train(cw.small_cfg(str(tmp_path / "run"), *more, "checkpoint.force_loader_state=true"))
    assert summary["checkpoint"]["resumed"]["step"] == 8 and summary["steps"] == 10
