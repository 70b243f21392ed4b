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
