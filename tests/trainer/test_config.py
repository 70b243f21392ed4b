"""Training config: TOML + overrides resolve to typed dataclasses; bad keys and values fail fast, naming the key."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from dutycycle.engine.errors import ConfigError
from dutycycle.trainer.config import TrainConfig, from_dict, load_config


def write(tmp_path, text: str) -> str:
    p = tmp_path / "c.toml"
    p.write_text(text)
    return str(p)


def test_toml_and_overrides_resolve_with_types(tmp_path):
    path = write(tmp_path, '[data]\ncache = "/x"\nglobal_batch_size = 64\n[optim]\nlr = 0.01\n')
    cfg = load_config(path, ["optim.lr=2e-3", "run.epochs=4", "data.augment.flip=true",
                             'ray.label_selector={zone = "us-east-1a"}', "parallel.num_workers=2"])
    assert isinstance(cfg, TrainConfig)
    assert cfg.data.global_batch_size == 64 and cfg.data.cache == "/x"
    assert cfg.optim.lr == 2e-3 and isinstance(cfg.optim.lr, float)
    assert cfg.run.epochs == 4.0 and cfg.data.augment.flip is True
    assert cfg.ray.label_selector == {"zone": "us-east-1a"}
    assert cfg.parallel.num_workers == 2
    # the resolved tree round-trips through JSON
    assert from_dict(json.loads(cfg.to_json())) == cfg


@pytest.mark.parametrize(
    "text, overrides, key",
    [
        ('[data]\ncache = "/x"\nbatch = 3\n', [], "data.batch"),
        ('[dataa]\ncache = "/x"\n', [], "dataa"),
        ('[data]\ncache = "/x"\n', ["optim.lrr=1"], "optim.lrr"),
        ('[data]\ncache = "/x"\n', ["optim.lr=fast"], "optim.lr"),
        ('[data]\ncache = "/x"\nglobal_batch_size = "big"\n', [], "data.global_batch_size"),
        ('[data]\ncache = "/x"\n', ["data.augment.flip=maybe"], "data.augment.flip"),
        ('[data]\ncache = "/x"\n', ["optim.name=lamb"], "optim.name"),
        ('[data]\ncache = "/x"\n', ["model.name=resnet9000"], "model.name"),
        ('[data]\ncache = "/x"\n', ["data.global_batch_size=0"], "data.global_batch_size"),
        ('[data]\ncache = "/x"\n', ["data.global_batch_size=100", "parallel.num_workers=3"], "data.global_batch_size"),
        ('[data]\ncache = "/x"\n', ["optim.lr=-1"], "optim.lr"),
        ("[data]\n", [], "data.cache"),
        ('[data]\ncache = "/x"\n', ["ray.placement_strategy=ANYWHERE"], "ray.placement_strategy"),
        ('[data]\ncache = "/x"\n', ["data.drop_last=false", "parallel.num_workers=2"], "data.drop_last"),
    ],
)
def test_bad_config_names_the_key(tmp_path, text, overrides, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(write(tmp_path, text), overrides)


def test_missing_file_and_bad_toml(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(str(tmp_path / "nope.toml"))
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(write(tmp_path, "[data\n"))
    with pytest.raises(ConfigError, match="key=value"):
        load_config(write(tmp_path, '[data]\ncache="/x"\n'), ["optim.lr"])


def test_cli_bad_config_exits_2_before_any_worker(tmp_path):
    """The CLI fails fast: exit code 2, one line naming the key, and no run directory created."""
    run_dir = tmp_path / "run"
    path = write(tmp_path, f'[data]\nsource = "synthetic"\n[run]\ndir = "{run_dir}"\n[optim]\nlr = "x"\n')
    proc = subprocess.run([sys.executable, "-m", "dutycycle.trainer", "train", path], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "optim.lr" in proc.stderr
    assert not run_dir.exists()


def test_plugin_model_factory_is_validated(tmp_path):
    cfg = load_config(write(tmp_path, '[data]\nsource = "synthetic"\n[model]\nname = "torch.nn:Identity"\n'))
    assert cfg.model.name == "torch.nn:Identity"
    with pytest.raises(ConfigError, match="model.name"):
        load_config(write(tmp_path, '[data]\nsource = "synthetic"\n[model]\nname = ":nothing"\n'))


def test_every_loader_option_is_reachable_from_a_config_key():
    """Each field of the loader's config (and of its augmentation and read options) is set from a config key, or
    listed in LOADER_SET_BY_TRAINER with the reason: a loader option added later fails here until it is."""
    import dataclasses

    from dutycycle.loader import AugmentConfig, LoaderConfig
    from dutycycle.trainer.config import LOADER_SET_BY_TRAINER

    keys = {  # a value other than the loader's default for every key that reaches it
        "run.seed": 7, "data.global_batch_size": 64, "data.drop_last": "false", "data.loader_mode": "thread",
        "data.prefetch": 3, "data.block_size": 16, "data.window": 512, "data.partitions": 4, "data.ray_max_retries": 5,
        "data.raw_threads": 2, "data.memory_fraction": 0.25, "data.normalize_on": "device",
        "data.augment.crop_padding": 4, "data.augment.flip": "true", "data.augment.normalize": "false",
        "data.augment.mean": "[0.4, 0.5, 0.6]", "data.augment.std": "[0.2, 0.3, 0.4]",
        "data.read.verify": "always", "data.read.remote": "range", "data.read.node_dir": "/tmp/node",
        "data.read.disk_cache_bytes": 1000, "data.read.range_chunk_bytes": 4096, "data.read.range_cache_bytes": 8192,
        "data.read.max_open_shards": 8,
    }
    cfg = load_config(None, ["data.source=synthetic", *(f"{k}={v}" for k, v in keys.items())])
    train, val = cfg.data.loader_configs(cfg.run.seed, world_size=2)
    default = LoaderConfig()
    assert LOADER_SET_BY_TRAINER.keys() <= {f.name for f in dataclasses.fields(LoaderConfig)}
    for f in dataclasses.fields(LoaderConfig):
        if f.name in LOADER_SET_BY_TRAINER:
            continue
        got, untouched = getattr(train, f.name), getattr(default, f.name)
        if dataclasses.is_dataclass(got):
            for g in dataclasses.fields(got):
                assert getattr(got, g.name) != getattr(untouched, g.name), f"LoaderConfig.{f.name}.{g.name}"
        else:
            assert got != untouched, f"LoaderConfig.{f.name} is set by no config key"
    assert train.augment == cfg.data.augment and train.read == cfg.data.read and train.shuffle
    # validation: every sample once in cache order, no random augmentation, the same normalization
    assert val.global_batch_size == 2 * cfg.data.eval_batch_size and not val.shuffle and not val.drop_last
    assert val.augment == AugmentConfig.eval(False, (0.4, 0.5, 0.6), (0.2, 0.3, 0.4))
    assert val.read == train.read and val.prefetch == 3 and val.mode == "thread"


@pytest.mark.parametrize("override, key", [
    ("data.augment.crop_padding=-1", "data.augment.crop_padding"),
    ("data.augment.std=[1, 1]", "data.augment"),
    ("data.read.verify=sometimes", "data.read.verify"),
    ("data.prefetch=0", "data.prefetch"),
    ("data.memory_fraction=2", "data.memory_fraction"),
    ("run.health_timeout_s=0", "run.health_timeout_s"),
    ("checkpoint.keep=1", "checkpoint.keep"),
])
def test_the_loaders_own_checks_name_the_key(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(None, ["data.source=synthetic", override])


def test_the_data_section_holds_the_loaders_config_under_the_keys_users_write():
    """``[data]`` takes the training LoaderConfig's fields as its own keys: the config tree (printed, saved as
    config.json, sent to workers) stays flat, and the loader's hidden fields are no keys."""
    from dutycycle.loader import LoaderConfig

    cfg = load_config(None, ["data.source=synthetic", "data.prefetch=3", "data.global_batch_size=64",
                             "data.augment.flip=true"])
    assert isinstance(cfg.data.loader, LoaderConfig)
    assert (cfg.data.loader.prefetch, cfg.data.prefetch, cfg.data.global_batch_size) == (3, 3, 64)
    tree = cfg.to_dict()["data"]
    assert "loader" not in tree and tree["prefetch"] == 3 and tree["augment"]["flip"] is True
    assert not {"mode", "seed", "shuffle", "pin_memory", "device"} & set(tree)
    assert from_dict(cfg.to_dict()) == cfg
    for key in ("data.loader.prefetch", "data.seed", "data.mode", "data.shuffle"):
        with pytest.raises(ConfigError, match=f"unknown config key {key.rsplit('.', 1)[0]!r}|unknown config key "
                                              f"{key!r}"):
            load_config(None, ["data.source=synthetic", f"{key}=1"])


def test_the_built_in_model_names_a_config_accepts_are_the_models_built():
    """config.py checks a model name without importing torch, from its own list: it must be the registry's."""
    from dutycycle.trainer.config import BUILT_IN_MODELS
    from dutycycle.trainer.step.models import MODELS

    assert tuple(MODELS) == BUILT_IN_MODELS


@pytest.mark.parametrize(
    "line, said",
    [
        ('[data]\nglobal_batch_size = "64"', 'data.global_batch_size = "64" is a string; an integer is expected '
                                             "(write it without quotes: global_batch_size = 64)"),
        ("[data]\nglobal_batch_size = 64.0", "data.global_batch_size = 64.0 is a float; an integer is expected "
                                            "(write 64)"),
        ("[run]\nmax_steps = true", "run.max_steps = true is a boolean; an integer is expected"),
        ('[optim]\nlr = "0.01"', 'optim.lr = "0.01" is a string; a number is expected'),
        ('[data.augment]\nflip = "true"', 'data.augment.flip = "true" is a string; a boolean is expected'),
        ("[data.augment]\nflip = 1", "data.augment.flip = 1 is an integer; a boolean is expected"),
        ("[model]\nname = 5", 'model.name = 5 is an integer; a string is expected (write it in quotes: name = "5")'),
        ("[run]\ndir = [1]", "run.dir = [1] is an array; a string is expected"),
        ("[ray]\nlabel_selector = {zone = 1}", "ray.label_selector.zone = 1 is an integer; a string is expected"),
        ('[data.augment]\nmean = [0.5, "x"]', 'data.augment.mean = "x" is a string; a number is expected'),
        ('[parallel]\nuse_gpu = "maybe"', 'parallel.use_gpu = "maybe" is not one of "auto", "true", "false"'),
    ],
)
def test_a_toml_value_of_the_wrong_type_is_refused_naming_the_key_and_both_types(tmp_path, line, said):
    path = write(tmp_path, f'{line}\n[run]\nmax_steps = 3\n' if "[run]" not in line else line + "\n")
    with pytest.raises(ConfigError) as err:
        load_config(path, ["data.source=synthetic"])
    assert said in str(err.value)


def test_toml_types_that_are_the_fields_own_are_kept_and_set_values_are_parsed(tmp_path):
    """An integer is a float's value (``lr = 1``: TOML writes whole numbers without a point); TOML's true/false
    are the words of a key that takes "true"/"false"; ``--set`` values are text, parsed as their key's type."""
    path = write(tmp_path, '[data]\nsource = "synthetic"\n[optim]\nlr = 1\n[parallel]\nuse_gpu = false\n'
                           '[data.augment]\nmean = [1, 0.5, 0]\nstd = [1, 1, 1]\n')
    cfg = load_config(path)
    assert cfg.optim.lr == 1.0 and isinstance(cfg.optim.lr, float) and cfg.parallel.use_gpu == "false"
    assert cfg.data.augment.mean == (1.0, 0.5, 0.0)
    cfg = load_config(path, ["data.global_batch_size=64", "optim.lr=2e-3", "data.augment.flip=true",
                             "parallel.use_gpu=true", "run.epochs=2"])
    assert (cfg.data.global_batch_size, cfg.optim.lr, cfg.data.augment.flip) == (64, 2e-3, True)
    assert cfg.parallel.use_gpu == "true" and cfg.run.epochs == 2.0


def test_load_config_reads_a_runs_config_json_and_a_run_directory(tmp_path):
    """A run saves its resolved config as stamped JSON (``format`` first); ``load_config`` reads it back, and a
    run directory as its newest attempt's config (``--resume`` continues that one)."""
    from dutycycle.engine import formats
    from dutycycle.engine.errors import FormatError

    run = tmp_path / "run"
    (run / "attempts" / "1").mkdir(parents=True)
    (run / "attempts" / "2").mkdir(parents=True)
    first = load_config(None, ["data.source=synthetic", f"run.dir={run}", "run.max_steps=5", "data.augment.mean=[1]",
                                "data.augment.std=[2]"])
    second = load_config(None, ["data.source=synthetic", f"run.dir={run}", "run.max_steps=9"])
    for where, cfg in ((run / "config.json", first), (run / "attempts" / "1" / "config.json", first),
                       (run / "attempts" / "2" / "config.json", second)):
        where.write_text(json.dumps(formats.stamp(cfg.to_dict()), indent=2))
    assert load_config(str(run / "config.json")) == first
    assert load_config(str(run)) == second  # the newest attempt's
    assert load_config(str(run), ["run.max_steps=12"]).run.max_steps == 12
    (run / "attempts" / "2" / "config.json").write_text(json.dumps({**formats.stamp(second.to_dict()), "format": 2}))
    with pytest.raises(FormatError, match="has format 2"):
        load_config(str(run))
    with pytest.raises(ConfigError, match="without a run's config"):
        load_config(str(tmp_path))
    (tmp_path / "bad.json").write_text('{"run": {"max_steps": "9"}}')
    with pytest.raises(ConfigError, match='run.max_steps = "9" is a string'):
        load_config(str(tmp_path / "bad.json"), ["data.source=synthetic"])
