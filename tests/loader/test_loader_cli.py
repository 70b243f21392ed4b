"""`dutycycle plan`: the JSON lines match what the loader yields, and bad arguments exit 2 with a clear message."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from dutycycle.loader import AugmentConfig, CacheLoader, LoaderConfig
from dutycycle.trainer.app.cli import main

from ..support.cachemaker import make_cache


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    uri = str(tmp_path_factory.mktemp("cli") / "cache")
    make_cache(uri, 120, shards=3, splits={"train": 0.75, "val": 0.25})
    return uri


def loader_ids(cache, rank, world_size, epoch, seed, gbs, split="train", **kw):
    config = LoaderConfig(global_batch_size=gbs, seed=seed, mode="sync", augment=AugmentConfig(normalize=False), **kw)
    loader = CacheLoader(cache, split, rank, world_size, config)
    loader.set_epoch(epoch)
    batches = list(loader)
    return [b["sample_id"] for b in batches], [b["label"].tolist() for b in batches]


def test_plan_cli_prints_what_each_rank_sees(cache):
    cmd = [sys.executable, "-m", "dutycycle.trainer", "plan", cache, "--world-size", "2", "--rank", "1",
           "--steps", "1:4", "--epoch", "2", "--seed", "7", "--global-batch", "16"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    recs = [json.loads(line) for line in out.splitlines()]
    assert [(r["step"], r["rank"], r["epoch"]) for r in recs] == [(1, 1, 2), (2, 1, 2), (3, 1, 2)]
    ids, labels = loader_ids(cache, 1, 2, epoch=2, seed=7, gbs=16)
    assert [r["sample_ids"] for r in recs] == ids[1:4]
    assert [r["labels"] for r in recs] == labels[1:4]


def test_plan_cli_all_ranks_eval_order(cache, capsys):
    assert main(["plan", cache, "--world-size", "4", "--steps", "0:", "--global-batch", "8", "--split", "val",
                 "--keep-last", "--no-shuffle"]) == 0
    recs = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    ids = [s for r in recs for s in r["sample_ids"]]
    n = CacheLoader(cache, "val", config=LoaderConfig.for_eval(8, mode="sync")).num_samples
    assert len(ids) == len(set(ids)) == n  # every val sample exactly once across the 4 ranks
    for rank in range(4):
        want, _ = loader_ids(cache, rank, 4, 0, 0, 8, "val", drop_last=False, shuffle=False)
        assert [r["sample_ids"] for r in recs if r["rank"] == rank] == want


@pytest.mark.parametrize(
    "args,message",
    [
        (["--steps", "0:999"], "outside the epoch"),
        (["--steps", "x"], "--steps 'x' is invalid"),
        (["--world-size", "3"], "--global-batch 16 is not divisible by --world-size 3"),
        (["--world-size", "2", "--rank", "2"], "--rank 2 is outside --world-size 2"),
        (["--split", "test"], "split 'test' has no samples"),
    ],
)
def test_plan_cli_errors_exit_2(cache, capsys, args, message):
    assert main(["plan", cache, "--global-batch", "16", *args]) == 2
    assert message in capsys.readouterr().err


def test_plan_cli_missing_cache(tmp_path, capsys):
    assert main(["plan", str(tmp_path / "nope")]) == 2
    assert "manifest.json is missing" in capsys.readouterr().err


def test_plan_into_a_closed_pipe_exits_quietly(tmp_path):
    """`dutycycle plan | head -1`: the reader leaves after one line; no BrokenPipe traceback, exit 141 (SIGPIPE).
    The plan is ~400 KB of lines, far more than a pipe holds, so the writer is still writing when the reader
    leaves."""
    big = str(tmp_path / "big")
    make_cache(big, 4000, shape=(2, 2, 1), shards=2)
    proc = subprocess.Popen([sys.executable, "-m", "dutycycle.trainer", "plan", big, "--world-size", "2",
                             "--steps", "0:", "--global-batch", "2"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    first = proc.stdout.readline()
    proc.stdout.close()  # what head does after its lines
    _, err = proc.communicate(timeout=60)
    assert json.loads(first)["step"] == 0
    assert proc.returncode == 141 and b"Traceback" not in err and b"BrokenPipe" not in err, err.decode()
