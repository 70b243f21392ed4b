"""Run directories are never clobbered: a second launch into a run is refused naming what is there and the ways
on; --resume continues it in an attempt folder of its own, comparing configs; --overwrite removes dutycycle's files
and nothing else; a launch that fails before training leaves the directory as it was. Real launches (``train``,
in this process: ``local=True``) on synthetic data and on a real cache written by the test."""

from __future__ import annotations

import json
import os
import time

import pytest
from dutycycle.engine.errors import ConfigError, SourceError
from dutycycle.trainer.config import load_config
from dutycycle.trainer.launch.rundir import RunExistsError
from dutycycle.trainer.launch.train import train

from ..support import ckpt_models as cm
from ..support import ckpt_worker as cw
from ..support.files import tree


def cfg_for(run_dir, *extra):
    return cw.small_cfg(str(run_dir), "run.max_steps=6", "checkpoint.every=3", "run.log_every=0", *extra)


def steps_of(run_dir) -> list[int]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["step"] for r in rows if "loss" in r]


def test_a_finished_run_is_refused_resumed_with_more_steps_and_overwritten(tmp_path, capsys):
    run = tmp_path / "run"
    first = train(cfg_for(run), local=True)
    assert first["steps"] == 6
    one = run / "attempts" / "1"
    assert {p.name for p in one.iterdir()} == {"config.json", "health.json", "attempt.json"}
    assert (run / "config.json").read_bytes() == (one / "config.json").read_bytes()  # the finished attempt's
    assert json.loads((one / "health.json").read_text())["workers"][0]["rank"] == 0
    assert not (run / "health.json").exists()  # the launch's, in its folder

    # a new run into it: refused, naming what is there and the three ways on; nothing written
    before = tree(run)
    with pytest.raises(RunExistsError) as err:
        train(cfg_for(run), local=True)
    msg = str(err.value)
    assert "holds a finished run: 6 steps, finished " in msg and "newest commit step 6" in msg
    assert "--resume" in msg and "continue it from step 6" in msg and "resume=True" in msg
    assert f"--set run.dir={run}-2" in msg and "--overwrite" in msg and "overwrite=True" in msg
    assert tree(run) == before

    # --resume with the same length: nothing left to train, said so; with more steps: continued from step 6
    with pytest.raises(ConfigError, match=r"trained 6 steps.*ends at step 6: nothing is left to train"):
        train(cfg_for(run), local=True, resume=True)
    assert tree(run) == before
    capsys.readouterr()
    second = train(cfg_for(run, "run.max_steps=9", "optim.lr=0.001"), local=True, resume=True)
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("resuming "))
    # one line: every changed key, old -> new, and why the learning rate moves at the resumed step
    assert "from step 6; changed: optim.lr 0.003 -> 0.001, run.max_steps 6 -> 9" in line
    assert "the learning-rate schedule is recomputed for the new total of 9 steps" in line
    assert second["steps"] == 9 and second["checkpoint"]["resumed"]["step"] == 6
    assert steps_of(run) == list(range(1, 10))  # every step once, across both attempts
    two = run / "attempts" / "2"
    record = json.loads((two / "attempt.json").read_text())
    assert record["attempt"] == 2 and record["resume"] and record["resumed_from"] == 6
    assert record["changes"]["keys"] == {"optim.lr": [0.003, 0.001], "run.max_steps": [6, 9]}
    # the run-level files are the finished attempt's: config, summary and model together; attempt 1's stay
    assert (run / "config.json").read_bytes() == (two / "config.json").read_bytes()
    assert json.loads((run / "summary.json").read_text())["steps"] == 9
    assert json.loads((one / "config.json").read_text())["run"]["max_steps"] == 6
    assert load_config(str(run)).run.max_steps == 9  # the run directory reads as its newest config

    # --overwrite: dutycycle's files go, a file of the user's stays, and the run starts over at attempt 1
    (run / "notes.txt").write_text("mine")
    third = train(cfg_for(run, "run.max_steps=4"), local=True, overwrite=True)
    assert third["steps"] == 4 and third["checkpoint"]["resumed"] is None
    assert (run / "notes.txt").read_text() == "mine"
    assert sorted(p.name for p in (run / "attempts").iterdir()) == ["1"]
    assert steps_of(run) == [1, 2, 3, 4]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-00000003", "step-00000004"]


def test_an_unfinished_run_is_refused_naming_the_step_a_resume_continues_from(tmp_path):
    """A run that crashed after its step-8 commit: refused, naming step 8; --resume finishes it, with the same
    weights as a run that never stopped (in the same process: the launch's own resume, not only the Trainer's)."""
    ref = train(cw.small_cfg(str(tmp_path / "ref")), local=True, quiet=True)
    run = tmp_path / "run"
    cm.FAULTS["crash_at"] = 11
    try:
        with pytest.raises(cm.InjectedCrash):
            train(cw.small_cfg(str(run)), local=True, quiet=True)
    finally:
        cm.reset()
    assert (run / "attempts" / "1").is_dir() and not (run / "summary.json").exists()  # it trained: kept
    with pytest.raises(RunExistsError, match=r"(?s)holds an unfinished run \(no summary.json\): newest commit step 8.*"
                                             r"continue it from step 8"):
        train(cw.small_cfg(str(run)), local=True, quiet=True)
    done = train(cw.small_cfg(str(run)), local=True, quiet=True, resume=True)
    assert done["checkpoint"]["resumed"]["step"] == 8 and done["steps"] == 14
    assert done["weights_sha256"] == ref["weights_sha256"]
    assert sorted(p.name for p in (run / "attempts").iterdir()) == ["1", "2"]


def test_a_launch_that_fails_before_training_leaves_the_run_directory_as_it_was(tmp_path):
    run = tmp_path / "run"
    train(cfg_for(run), local=True, quiet=True)
    before = tree(run)
    # a health check that fails (every matmul is slower than a nanosecond) on a resume: its attempt folder goes
    with pytest.raises(Exception, match="pre-flight health check failed"):
        train(cfg_for(run, "run.max_steps=8", "run.health_timeout_s=1e-9"), local=True, quiet=True, resume=True)
    assert tree(run) == before
    # missing data: refused before anything is written, in about a second (no worker, no Ray)
    t0 = time.perf_counter()
    with pytest.raises(SourceError, match=r"data\.cache = '.*nowhere'.*no committed cache.*dutycycle materialize"):
        train(cfg_for(run, "run.max_steps=8", "data.source=cache", f"data.cache={tmp_path / 'nowhere'}"),
              local=True, quiet=True, resume=True)
    assert time.perf_counter() - t0 < 5
    assert tree(run) == before
    # a directory the failed launch made is removed whole; one that was there keeps only what it held
    fresh = tmp_path / "fresh"
    with pytest.raises(Exception, match="pre-flight health check failed"):
        train(cfg_for(fresh, "run.health_timeout_s=1e-9"), local=True, quiet=True)
    assert not fresh.exists()
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    with pytest.raises(Exception, match="pre-flight health check failed"):
        train(cfg_for(mine, "run.health_timeout_s=1e-9"), local=True, quiet=True)
    assert sorted(p.name for p in mine.iterdir()) == ["notes.txt"]


def test_resume_refuses_changes_to_the_data_unless_forced_and_to_the_model_always(tmp_path):
    from ..support.cachemaker import make_cache

    cache, other = tmp_path / "cache", tmp_path / "other"
    make_cache(str(cache), 160, shape=(16, 16, 3), shards=2, splits={"train": 0.8, "val": 0.2})
    make_cache(str(other), 192, shape=(16, 16, 3), shards=2, splits={"train": 0.8, "val": 0.2})
    base = ["data.source=cache", f"data.cache={cache}", "data.loader_mode=sync"]
    run = tmp_path / "run"
    train(cfg_for(run, *base), local=True, quiet=True)
    before = tree(run)
    more = ["run.max_steps=8"]
    with pytest.raises(ConfigError, match=r"would alter the data it has trained on: data\.global_batch_size 32 -> "
                                          r"16; run\.seed 0 -> 3\. .*--force"):
        train(cfg_for(run, *base, *more, "data.global_batch_size=16", "run.seed=3"), local=True, quiet=True,
              resume=True)
    with pytest.raises(ConfigError, match=r"the cache's data \(fingerprint "):
        train(cfg_for(run, "data.source=cache", f"data.cache={other}", "data.loader_mode=sync", *more),
              local=True, quiet=True, resume=True)
    with pytest.raises(ConfigError, match=r"model\.width 8 -> 16 changes the model .*not even with --force"):
        train(cfg_for(run, *base, *more, "model.width=16"), local=True, quiet=True, resume=True, force=True)
    assert tree(run) == before
    # a cache moved elsewhere (the same fingerprint) is the same data: named, not refused
    moved = tmp_path / "moved"
    os.rename(cache, moved)
    cfg = cfg_for(run, "data.source=cache", f"data.cache={moved}", "data.loader_mode=sync", *more)
    assert train(cfg, local=True, quiet=True, resume=True)["checkpoint"]["resumed"]["step"] == 6
    # --force: the data changes are accepted (the commit's batch size too) and the loader continues this config's
    # own plan from the saved position
    forced = train(cfg_for(run, "data.source=cache", f"data.cache={moved}", "data.loader_mode=sync",
                           "run.max_steps=10", "data.window=2", "data.global_batch_size=16"), local=True, quiet=True,
                   resume=True, force=True)
    assert forced["checkpoint"]["resumed"]["step"] == 8 and forced["steps"] == 10
    assert forced["global_batch_size"] == 16
    record = json.loads((run / "attempts" / "3" / "attempt.json").read_text())
    assert record["force"] and record["changes"]["keys"]["data.window"] == [2048, 2]
    assert record["changes"]["keys"]["data.global_batch_size"] == [32, 16]
    assert json.loads((run / "attempts" / "3" / "config.json").read_text())["checkpoint"]["force_loader_state"]


def test_what_a_launch_may_be_asked(tmp_path):
    run = tmp_path / "run"
    with pytest.raises(ConfigError, match="pass one of them"):
        train(cfg_for(run), local=True, quiet=True, resume=True, overwrite=True)
    with pytest.raises(ConfigError, match="--force accepts data changes on a --resume"):
        train(cfg_for(run), local=True, quiet=True, force=True)
    assert not run.exists()
    # a run without commits cannot be resumed: it would start over and say nothing
    train(cfg_for(run, "checkpoint.every=0"), local=True, quiet=True)
    with pytest.raises(RunExistsError, match="--resume          impossible here: it has no commit"):
        train(cfg_for(run, "checkpoint.every=0"), local=True, quiet=True)
    with pytest.raises(ConfigError, match="no commit to continue from .*start over from step 0"):
        train(cfg_for(run, "checkpoint.every=0", "run.max_steps=8"), local=True, quiet=True, resume=True)
    # two launches that both saw attempt 1 as the newest: the second to claim attempt 2 is refused, and the
    # first's config stays (the claim is a create-if-absent of attempts/2/config.json)
    from dutycycle.trainer.launch import rundir

    cfg = cfg_for(run, "checkpoint.every=0")
    stale = rundir.inspect(cfg)
    first = rundir._claim(cfg, stale, {"launched": time.time()}, created=False)
    assert first.number == 2
    claimed = (run / "attempts" / "2" / "config.json").read_bytes()
    with pytest.raises(ConfigError, match="another launch took attempt 2"):
        rundir._claim(cfg_for(run, "checkpoint.every=0", "optim.lr=0.5"), stale, {"launched": time.time()},
                      created=False)
    assert (run / "attempts" / "2" / "config.json").read_bytes() == claimed


def test_commits_in_a_shared_checkpoint_dir_belong_to_the_run(tmp_path):
    """checkpoint.dir outside the run directory: a fresh run.dir whose checkpoint.dir holds another launch's
    commits would resume them silently; it is refused, and --overwrite removes those commits."""
    ckpt = tmp_path / "ckpt"
    train(cfg_for(tmp_path / "a", f"checkpoint.dir={ckpt}"), local=True, quiet=True)
    with pytest.raises(RunExistsError, match=f"newest commit step 6 in {ckpt}"):
        train(cfg_for(tmp_path / "b", f"checkpoint.dir={ckpt}"), local=True, quiet=True)
    b = train(cfg_for(tmp_path / "b", f"checkpoint.dir={ckpt}"), local=True, quiet=True, overwrite=True)
    assert b["checkpoint"]["resumed"] is None and b["steps"] == 6
    assert sorted(p.name for p in ckpt.iterdir()) == ["step-00000003", "step-00000006"]
    assert (tmp_path / "a" / "summary.json").exists()  # the other run directory itself is not touched


def test_every_config_key_has_a_resume_kind():
    """Each key a config has is classified for a resume (changes.py): a data key added later counts as data
    until it is listed as a performance setting, and the model's keys never load into another model."""
    from dutycycle.trainer.config import TrainConfig
    from dutycycle.trainer.launch.changes import compare, flatten, kind_of

    kinds = {k: kind_of(k) for k in flatten(TrainConfig().to_dict())}
    assert {k for k, v in kinds.items() if v == "model"} == {f"model.{k}" for k in TrainConfig().to_dict()["model"]} \
        | {"optim.name"}
    assert {k for k, v in kinds.items() if v == "schedule"} == {
        "run.max_steps", "run.epochs", "optim.lr", "optim.warmup_steps", "optim.schedule", "optim.min_lr_ratio"}
    for key in ("run.seed", "data.global_batch_size", "data.cache", "data.window", "data.augment.flip",
                "data.some_future_key"):
        assert kind_of(key) == "data", key
    for key in ("data.micro_batches", "data.prefetch", "data.read.verify", "parallel.num_workers", "ray.address"):
        assert kind_of(key) == "other", key
    # a key the data source does not read changes nothing trained on
    old = TrainConfig().to_dict()
    new = json.loads(json.dumps(old))
    new["data"]["table"] = "/somewhere"
    assert compare(old, new).data == [] and compare(old, new).keys == {"data.table": ("", "/somewhere")}
