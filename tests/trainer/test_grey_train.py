"""Training on a grey (mode L, one channel) cache with the built-in models, normalized with the dataset's
statistics by default or the config's values: what the summary records is what the batches got."""

from __future__ import annotations

import json

import pytest
import torch
from dutycycle.engine.cache.materialize import materialize
from dutycycle.engine.transform import TransformSpec
from dutycycle.trainer.cluster.world import World
from dutycycle.trainer.config import load_config
from dutycycle.trainer.launch.train import train
from dutycycle.trainer.step.data import make_sources
from dutycycle.trainer.step.models import build_model

from ..support.tablemaker import make_shapes_table


@pytest.fixture(scope="module")
def grey_cache(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("grey"))
    table, _ = make_shapes_table(root, n=48, size=(20, 40))  # colour JPEGs, converted to grey by the cache
    return materialize(table, root + "/cache", TransformSpec(size=16, mode="L"), rows_per_shard=16)


def cfg_for(cache, run_dir, *extra):
    return load_config(None, [f"data.cache={cache}", "data.global_batch_size=8", "data.eval_batch_size=8",
                              "model.width=8", "model.depth=2", "run.max_steps=3", "run.eval_every=3",
                              "run.log_every=0", f"run.dir={run_dir}", "run.report=false", *extra])


def test_built_in_models_train_on_a_grey_cache_with_its_statistics(grey_cache, tmp_path):
    stats = grey_cache.manifest.channel_stats
    assert grey_cache.manifest.shape == [16, 16, 1] and stats["split"] == "train"

    summary = train(cfg_for(grey_cache.uri, tmp_path / "cnn"), local=True, quiet=True)
    data = json.loads((tmp_path / "cnn" / "summary.json").read_text())["data"]
    assert data == summary["data"] and data["channels"] == 1 and data["spec"]["mode"] == "L"
    assert data["normalize"] == {"mean": stats["mean"], "std": stats["std"]}  # the manifest's, as applied
    assert summary["steps"] == 3 and summary["val_samples"] > 0

    # the first convolution of the CNN takes the one channel; GroupNorm normalizes its output channels
    model = build_model(cfg_for(grey_cache.uri, tmp_path / "m").model, 1, 4, 16)
    assert model.blocks[0][0].weight.shape == (8, 1, 3, 3)
    assert model(torch.rand(2, 1, 16, 16)).shape == (2, 4)

    # a config's mean and std win, for the ViT too, and validation normalizes exactly as training
    override = ["model.name=vit", "model.heads=2", "data.augment.mean=[0.25]", "data.augment.std=[0.5]"]
    cfg = cfg_for(grey_cache.uri, tmp_path / "vit", *override)
    summary = train(cfg, local=True, quiet=True)
    assert summary["data"]["normalize"] == {"mean": [0.25], "std": [0.5]} and summary["steps"] == 3
    train_src, val_src, info = make_sources(cfg, World())
    assert val_src.loader.config.augment.mean == train_src.loader.config.augment.mean == (0.25,)
    train_src, val_src, info = make_sources(cfg_for(grey_cache.uri, tmp_path / "x"), World())
    a, v = train_src.loader.config.augment, val_src.loader.config.augment
    assert (v.mean, v.std) == (a.mean, a.std) == (tuple(stats["mean"]), tuple(stats["std"])) and not v.random
