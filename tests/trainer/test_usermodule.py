"""``model.name`` from the working directory: a model package the test writes into a temporary folder, trained
from there in this process (``local``), on Ray Train (the session's cluster, started elsewhere without it: the
workers get the package only through Ray's runtime environment), and with the installed ``dutycycle`` console
script, which does not put the working directory on ``sys.path``. Also: what is checked before Ray starts."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import uuid
import zipfile

import pytest
from dutycycle.engine.errors import ConfigError
from dutycycle.trainer.config import load_config
from dutycycle.trainer.launch import usermodule
from dutycycle.trainer.launch.train import train

from ..support.files import tree

# a LeNet-sized net: nothing of dutycycle's, only torch
NETS = '''
from torch import nn


def tiny(cfg, in_channels, num_classes, image_size):
    return nn.Sequential(nn.Conv2d(in_channels, 4, 3, padding=1), nn.ReLU(), nn.Flatten(),
                         nn.Linear(4 * image_size * image_size, num_classes))
'''


def write_package(folder, name: str) -> None:
    (folder / name).mkdir(parents=True)
    (folder / name / "__init__.py").write_text("")
    (folder / name / "nets.py").write_text(NETS)
    (folder / name / "__pycache__").mkdir()
    (folder / name / "__pycache__" / "junk.pyc").write_bytes(b"not shipped")


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """A working directory holding a model package of a fresh name (nothing cached in ``sys.modules``); the
    test runs there. ``sys.path`` is restored afterwards (the driver appends the working directory)."""
    name = f"mymods_{uuid.uuid4().hex[:8]}"
    work = tmp_path / "work"
    write_package(work, name)
    monkeypatch.chdir(work)
    monkeypatch.setattr(sys, "path", list(sys.path))
    yield work, name
    for module in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
        del sys.modules[module]


def small(run_dir, name: str, *extra: str):
    return load_config(None, ["data.source=synthetic", "data.size=8", "data.global_batch_size=16",
                              "data.synthetic_samples=64", f"model.name={name}.nets:tiny", "run.max_steps=3",
                              "run.eval_every=0", "run.log_every=0", "run.report=false", f"run.dir={run_dir}",
                              "checkpoint.every=3", "parallel.threads_per_worker=1", *extra])


@pytest.mark.slow
def test_a_model_package_in_the_working_directory_trains_locally_and_on_ray_train(ray_cluster, workdir, tmp_path):
    work, name = workdir
    assert importlib.util.find_spec(name) is None  # not importable without the working directory
    local = train(small(tmp_path / "local", name), local=True, quiet=True)
    run = tmp_path / "ray"
    on_ray = train(small(run, name), quiet=True)
    assert on_ray["launcher"] == "ray" and on_ray["steps"] == 3
    # the same module on both: one Ray worker trains the weights the local launch trains, bit for bit
    assert on_ray["weights_sha256"] == local["weights_sha256"]
    # what travelled: the package, content-addressed, in Ray Train's storage, without compiled files
    zips = list((run / "ray" / "py_modules").iterdir())
    assert len(zips) == 1 and zips[0].name.startswith(f"{name}-") and zips[0].suffix == ".zip"
    with zipfile.ZipFile(zips[0]) as z:
        assert sorted(z.namelist()) == [f"{usermodule.WRAPPER}/{name}/__init__.py",
                                        f"{usermodule.WRAPPER}/{name}/nets.py"]
    assert usermodule.package_zip(str(work / name)) == zips[0].read_bytes()  # the same files, the same bytes

    # a resume that fails before training on Ray (a worker group that can never be placed) leaves the run as it was
    before = tree(run)
    with pytest.raises(ConfigError, match="cannot be placed"):
        train(small(run, name, "run.max_steps=5", "parallel.cpus_per_worker=64"), quiet=True, resume=True)
    assert tree(run) == before


def test_an_import_failure_names_the_module_the_working_directory_and_the_fix(workdir, tmp_path):
    work, name = workdir
    with pytest.raises(ConfigError) as err:
        train(small(tmp_path / "a", "nosuch_models"), local=True, quiet=True)
    msg = str(err.value)
    assert "cannot import 'nosuch_models.nets'" in msg and f"working directory {work}" in msg
    assert "Run from the folder that holds nosuch_models/ (or nosuch_models.py), or install it" in msg
    (work / name / "needs.py").write_text("import surely_not_installed_pkg\n")
    with pytest.raises(ConfigError, match=rf"{name}\.needs imports 'surely_not_installed_pkg', which is not "
                                          r"installed here .*\(pip install surely_not_installed_pkg\)"):
        train(small(tmp_path / "b", name, f"model.name={name}.needs:tiny"), local=True, quiet=True)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()  # refused before anything was written


def test_the_console_script_trains_a_working_directory_model_and_refuses_a_second_run(tmp_path):
    """``dutycycle train`` as a user types it, from the folder that holds the model (no PYTHONPATH): it trains,
    a second run into the same directory exits 2 naming the ways on, and the run's own config.json resumes it."""
    dutycycle = os.path.join(os.path.dirname(sys.executable), "dutycycle")
    name = f"mymods_{uuid.uuid4().hex[:8]}"
    work = tmp_path / "work"
    write_package(work, name)
    (work / "train.toml").write_text(
        f'[data]\nsource = "synthetic"\nsize = 8\nglobal_batch_size = 16\nsynthetic_samples = 64\n'
        f'[model]\nname = "{name}.nets:tiny"\n[run]\ndir = "runs/x"\nmax_steps = 3\neval_every = 0\nlog_every = 0\n'
        f'report = false\n[checkpoint]\nevery = 3\n[parallel]\nthreads_per_worker = 1\n')
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([dutycycle, "train", *args], cwd=work, env=env, capture_output=True, text=True,
                              timeout=300)

    first = run("train.toml", "--local")
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-3000:]
    assert "done: 3 steps" in first.stdout
    again = run("train.toml", "--local")
    assert again.returncode == 2, again.stderr
    assert "holds a finished run: 3 steps" in again.stderr and "--resume" in again.stderr
    assert "--overwrite" in again.stderr and "a fresh run.dir" in again.stderr
    more = run("runs/x/config.json", "--local", "--resume", "--set", "run.max_steps=5")
    assert more.returncode == 0, more.stdout[-2000:] + more.stderr[-3000:]
    assert "resuming" in more.stdout and "changed: run.max_steps 3 -> 5" in more.stdout
    assert json.loads((work / "runs" / "x" / "summary.json").read_text())["steps"] == 5


def test_missing_data_and_a_model_that_does_not_import_fail_before_ray_starts(tmp_path):
    """In a process of its own (no Ray yet): ``train(cfg)`` on Ray fails within seconds, Ray never started."""
    code = f"""
import json, sys, time
import ray
from dutycycle.trainer.config import load_config
from dutycycle.trainer.launch.train import train
out = []
for extra in (["data.source=cache", "data.cache={tmp_path / 'nowhere'}"], ["model.name=nosuch_models.nets:tiny"]):
    cfg = load_config(None, ["data.source=synthetic", "run.dir={tmp_path / 'run'}", *extra])
    t0 = time.perf_counter()
    try:
        train(cfg, quiet=True)
    except Exception as e:
        out.append([type(e).__name__, str(e), time.perf_counter() - t0, ray.is_initialized()])
print(json.dumps(out))
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (cache_kind, cache_msg, cache_s, cache_ray), (model_kind, model_msg, model_s, model_ray) = \
        json.loads(proc.stdout.splitlines()[-1])
    assert cache_kind == "SourceError" and "data.cache" in cache_msg and "no committed cache" in cache_msg
    assert model_kind == "ConfigError" and "cannot import 'nosuch_models.nets'" in model_msg
    assert not cache_ray and not model_ray
    assert cache_s < 5 and model_s < 5, (cache_s, model_s)  # about a second; generous for a busy machine
    assert not (tmp_path / "run").exists()
