"""A run's model card: ``MODEL_CARD.md`` (for a person) and ``model_card.json`` (for a program) in the run
directory, written when the run finishes (``train.finish_run``, every launcher); ``dutycycle evaluate`` writes
its ``evaluation`` section again with the new scores and keeps the rest as the training wrote it. The same facts become MLflow tags when the run is tracked
(``card_tags``: ``dutycycle.card.*``, and the Markdown as the run's description, ``mlflow.note.content``).

What it holds (``model_card.json``, ``"format": 1``):

    run          name, directory, the model file and its weights' sha256, the model and its size, the classes
    data         the table (URI, version), the curation that selected the rows, split sizes, class counts per
                 split, the cache (URI, fingerprint, transform, channel statistics): card_data.py
    code         dutycycle's version and how it is installed; from a git checkout (an editable install) its
                 revision and whether tracked files differ from it; the working directory's repository (where a
                 plug-in model's code lives) and the plug-in module's file and sha256
    environment  Python, the platform, the versions of torch, Ray, Daft, pyarrow and numpy, the hardware: this
                 machine (the driver) and the workers (world size, device, hosts, nodes, accelerators)
    training     the resolved config, steps, epochs, samples, wall time, goodput, the failures survived and the
                 resizes (world size changes, each with its step), every (re)start of the workers: card_training.py
    evaluation   the run's last validation pass, and each split ``dutycycle evaluate`` scored

An installed wheel has no git checkout beside it: the card records its version and what pip recorded of where
it came from (PEP 610's ``direct_url.json``: a VCS install's commit, an archive's URL; nothing for an index),
and ``git`` is null. Versions are the driver's environment's; Ray Train's workers run in the environment the
driver hands them (launch/results.py), so they match unless a cluster's nodes were set up otherwise.

Both files are written atomically, the Markdown first and the JSON last: a reader that finds the JSON finds the
Markdown of the same card.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import sys
import time
from importlib import metadata
from pathlib import Path

from dutycycle.engine import formats, io
from dutycycle.engine.errors import DutycycleError
from dutycycle.trainer.config import load_config
from dutycycle.trainer.step.metrics import read_metrics, read_summary

from .card_data import data_facts
from .card_md import markdown
from .card_training import launches, timeline, training_facts
from .runpage import evaluations
from .tracking import code_revision, dutycycle_version

CARD_JSON = "model_card.json"
CARD_MD = "MODEL_CARD.md"
PACKAGES = ("torch", "ray", "daft", "pyarrow", "numpy", "safetensors", "mlflow")  # versions the card records
TAG_PREFIX = "dutycycle.card."
TAG_VALUE_MAX = 8000  # MLflow's limit on a tag value's length (mlflow.utils.validation.MAX_TAG_VAL_LENGTH)


def write_card(run_dir: str, cfg=None, summary: dict | None = None) -> dict:
    """Build the card of the finished run at ``run_dir`` and write both files; returns the card. ``cfg``: the
    run's config (default: its ``config.json``); ``summary``: its summary (default: ``summary.json``)."""
    card = build_card(run_dir, cfg, summary)
    io.write_bytes_atomic(io.join(run_dir, CARD_MD), markdown(card).encode())
    io.write_json_atomic(io.join(run_dir, CARD_JSON), card)
    return card


def update_card(run_dir: str, cfg=None, summary: dict | None = None) -> dict:
    """After an evaluation: the card's ``evaluation`` section written again (and ``updated_at``), every other
    section kept as the training's end wrote it (the code and environment that made the model, not the
    evaluating process's). A run without a readable card (finished before dutycycle wrote cards) gets a whole
    one, ``written_by: "evaluate"``: its code and environment are then this process's, and it says so."""
    try:
        card = read_card(run_dir)
    except (DutycycleError, OSError):
        card = None
    if card is None:
        card = build_card(run_dir, cfg, summary, written_by="evaluate")
    else:
        summary = read_summary(run_dir) if summary is None else summary
        card = {**card, "evaluation": evaluation_facts(run_dir, summary), "updated_at": time.time()}
    io.write_bytes_atomic(io.join(run_dir, CARD_MD), markdown(card).encode())
    io.write_json_atomic(io.join(run_dir, CARD_JSON), card)
    return card


def refresh_card(run_dir: str, cfg=None, summary: dict | None = None, *,
                 evaluation: bool = False) -> dict[str, str] | None:
    """Write the card of the finished run at ``run_dir`` (``write_card``; ``evaluation``: ``update_card``) and
    return its MLflow tags (with the Markdown as the run's description); None, with a warning, when it cannot be
    written: the card describes a run, it never fails one (the training's end, an evaluation)."""
    import warnings

    try:
        card = (update_card if evaluation else write_card)(run_dir, cfg, summary)
        return card_tags(card, note=markdown(card))
    except Exception as e:  # noqa: BLE001 - what the card would describe is written already
        warnings.warn(f"the model card of {run_dir} could not be written ({type(e).__name__}: {e})", RuntimeWarning,
                      stacklevel=2)
        return None


def read_card(run_dir: str) -> dict:
    """``model_card.json`` of ``run_dir``, checked for its format."""
    uri = io.join(run_dir, CARD_JSON)
    card = io.read_json(uri, fix="write it again: dutycycle evaluate RUN, or finish the run")
    formats.check(card, uri)
    return card


def build_card(run_dir: str, cfg=None, summary: dict | None = None, *, written_by: str = "training") -> dict:
    """The card as a JSON-ready dict (the module doc's sections). ``written_by``: the process whose code and
    environment the card records ("training": the driver at the run's end; "evaluate")."""
    if cfg is None:
        cfg = load_config(io.join(run_dir, "config.json"))
    summary = read_summary(run_dir) if summary is None else summary
    rows = _rows(run_dir)
    runs = launches(run_dir)
    restarts = timeline(runs, rows, summary)
    started = restarts[0]["started"] if restarts else None
    return formats.stamp({
        "run": run_facts(run_dir, cfg, summary),
        "data": data_facts(cfg, summary, started),
        "code": code_facts(cfg),
        "environment": environment_facts(cfg, summary),
        "training": training_facts(cfg, summary, restarts, rows, runs),
        "evaluation": evaluation_facts(run_dir, summary),
        "written_by": written_by,
        "created_at": time.time(),
    })


def _rows(run_dir: str) -> list[dict]:
    try:
        return read_metrics(run_dir)
    except (DutycycleError, OSError, ValueError):
        return []


# ------------------------------------------------------------------------------------------------- sections


def run_facts(run_dir: str, cfg, summary: dict) -> dict:
    data = summary.get("data") or {}
    model = summary.get("model")
    return {"name": cfg.run.name, "dir": run_dir, "model_file": model if isinstance(model, str) else None,
            "weights_sha256": summary.get("weights_sha256"),
            "model": {"name": cfg.model.name, "args": cfg.to_dict().get("model", {})},
            "num_params": summary.get("num_params"), "classes": list(data.get("classes") or []),
            "input": {"channels": data.get("channels"), "size": data.get("size"), "normalize": data.get("normalize")}}


def code_facts(cfg, cwd: str | None = None) -> dict:
    """dutycycle's version, install and revision; the working directory's repository; a plug-in model's
    module (file and sha256)."""
    root = Path(__file__).resolve().parents[2]  # the folder holding engine/, loader/, trainer/ (a checkout)
    # only a checkout has .git right there: asking git from an installed copy would walk up to whatever
    # repository the environment sits in (a virtualenv inside a project) and report that project's revision
    own = code_revision(str(root)) if (root / ".git").exists() else None
    project = code_revision(cwd)
    if project is not None and own is not None and project["root"] == own["root"]:
        project = None  # the same repository: said once
    return {"package": "dutycycle", "version": dutycycle_version(), "install": install_origin(),
            "git": own, "project_git": project, "model_module": _plugin(cfg.model.name)}


def install_origin() -> dict:
    """How dutycycle is installed, as pip recorded it (PEP 610 ``direct_url.json``): ``{"kind": "editable" |
    "vcs" | "archive" | "directory" | "index" | "not installed", ...}``."""
    # A source checkout holds the egg-info its editable install's build left (setuptools writes it there), and
    # the working directory on sys.path finds that one first: the record pip wrote (direct_url.json) is the
    # installed distribution's, so a distribution that has it is preferred
    dists = list(metadata.distributions(name="dutycycle"))
    if not dists:
        return {"kind": "not installed"}  # imported from a source tree on sys.path
    direct = None
    for dist in dists:
        try:
            direct = json.loads(dist.read_text("direct_url.json") or "null")
        except (ValueError, OSError):
            direct = None
        if isinstance(direct, dict):
            break
    if not isinstance(direct, dict):
        return {"kind": "index"}  # a wheel from a package index: its version is all pip keeps
    url = direct.get("url")
    if isinstance(direct.get("vcs_info"), dict):
        vcs = direct["vcs_info"]
        return {"kind": "vcs", "url": url, "vcs": vcs.get("vcs"), "commit": vcs.get("commit_id")}
    if isinstance(direct.get("archive_info"), dict):
        return {"kind": "archive", "url": url, "hash": direct["archive_info"].get("hash")}
    editable = bool((direct.get("dir_info") or {}).get("editable"))
    return {"kind": "editable" if editable else "directory", "url": url}


def _plugin(name: str) -> dict | None:
    """A plug-in model ``package.module:factory``: its module's file and the sha256 of its source."""
    import importlib.util

    if ":" not in name:
        return None
    module = name.split(":", 1)[0]
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        spec = None
    origin = spec.origin if spec is not None else None
    if not origin or not os.path.isfile(origin):
        return {"module": module, "file": None, "sha256": None}
    with open(origin, "rb") as f:
        return {"module": module, "file": origin, "sha256": hashlib.sha256(f.read()).hexdigest()}


def environment_facts(cfg, summary: dict) -> dict:
    packages = {}
    for name in PACKAGES:
        try:
            packages[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            packages[name] = None
    return {"python": platform.python_version(), "implementation": platform.python_implementation(),
            "platform": platform.platform(), "packages": packages,
            "hardware": {"driver": _this_machine(), "workers": _workers(cfg, summary)}}


def _this_machine() -> dict:
    memory = None
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        pass
    return {"host": platform.node(), "machine": platform.machine(), "cpu": _cpu_model(), "cpus": os.cpu_count(),
            "memory_bytes": memory}


def _cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def _workers(cfg, summary: dict) -> dict:
    """The workers as the run saw them: world size, device kind, hosts (from the health check), nodes (the
    observed topology), CPUs reserved per worker, and the accelerators' names where this process can see them
    (Ray's accelerator_type resources; torch's device names when torch is already loaded here)."""
    health = [r for r in summary.get("health") or [] if isinstance(r, dict)]
    nodes = (summary.get("parallel") or {}).get("node_ids") or []
    accelerators: list[str] = []
    ray = sys.modules.get("ray")  # never imported for this: a --local run has no Ray
    if ray is not None and ray.is_initialized():
        try:
            accelerators = sorted(k.split(":", 1)[1] for k in ray.cluster_resources() if k.startswith("accelerator_type:"))
        except Exception:  # noqa: BLE001 - a cluster gone at the end costs this fact, not the card
            accelerators = []
    torch = sys.modules.get("torch")
    if not accelerators and torch is not None and summary.get("device") == "cuda" and torch.cuda.is_available():
        accelerators = sorted({torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())})
    return {"world_size": summary.get("world_size"), "device": summary.get("device"),
            "hosts": sorted({str(r.get("host")) for r in health if r.get("host")}),
            "nodes": len(set(nodes)) or None, "cpus_per_worker": cfg.parallel.cpus_per_worker,
            "accelerators": accelerators}


# ----------------------------------------------------------------------------------------------- evaluation


def evaluation_facts(run_dir: str, summary: dict) -> dict:
    """The run's own last validation pass, and each split ``dutycycle evaluate`` scored (its scores, the step
    it loaded, per class)."""
    splits = {}
    for split, record in evaluations(run_dir):
        if not isinstance(record, dict):
            splits[split] = {"error": str(record)}
            continue
        keep = ("accuracy", "loss", "samples", "step", "macro", "per_class", "created_at")
        splits[split] = {k: record.get(k) for k in keep}
        splits[split]["source"] = (record.get("data") or {}).get("source")
    validation = {"accuracy": summary.get("val_accuracy"), "loss": summary.get("val_loss"),
                  "samples": summary.get("val_samples"), "step": summary.get("steps")}
    return {"validation": validation, "splits": splits}


# ------------------------------------------------------------------------------------------------ MLflow


def card_tags(card: dict, note: str | None = None) -> dict[str, str]:
    """The card as MLflow tags (``dutycycle.card.<section>.<fact>``; lists and tables as compact JSON, each
    within MLflow's length limit) and, with ``note`` (the Markdown), the run's description. The config is not
    repeated: it is the run's params."""
    d, c, e, t, v = card["data"], card["code"], card["environment"], card["training"], card["evaluation"]
    table, cache = d.get("table") or {}, d.get("cache") or {}
    git, project = c.get("git") or {}, c.get("project_git") or {}
    tags = {
        "run.model": card["run"]["model"]["name"], "run.weights_sha256": card["run"].get("weights_sha256"),
        "run.num_params": card["run"].get("num_params"),
        "data.source": d["source"], "data.table": table.get("uri"), "data.table_version": table.get("version"),
        "data.curation": d["curation"], "data.splits": d["splits"], "data.classes": d["classes"],
        "data.cache": cache.get("uri"), "data.cache_fingerprint": d.get("fingerprint"),
        "data.transform": d.get("transform"),
        "code.version": c["version"], "code.install": c["install"].get("kind"),
        "code.git_commit": git.get("commit"), "code.git_dirty": git.get("dirty"),
        "code.project_git_commit": project.get("commit"), "code.project_git_dirty": project.get("dirty"),
        "code.model_module_sha256": (c.get("model_module") or {}).get("sha256"),
        "env.python": e["python"], "env.platform": e["platform"],
        **{f"env.{k}": ver for k, ver in e["packages"].items()},
        "env.hardware": e["hardware"],
        "training.steps": t["steps"], "training.epochs": t["epochs"], "training.wall_s": t["wall_s"],
        "training.goodput": t["goodput"], "training.failures_survived": t["failures_survived"],
        "training.resizes": t["resizes"], "training.world_sizes": t["world_sizes"],
        "eval.validation.accuracy": v["validation"]["accuracy"], "eval.validation.loss": v["validation"]["loss"],
    }
    for split, r in v["splits"].items():
        tags[f"eval.{split}.accuracy"], tags[f"eval.{split}.loss"] = r.get("accuracy"), r.get("loss")
        tags[f"eval.{split}.step"] = r.get("step")
    out = {TAG_PREFIX + k: _text(val) for k, val in tags.items() if val is not None}
    if note is not None:
        out["mlflow.note.content"] = _note(note)
    return out


def _note(text: str) -> str:
    """The Markdown as MLflow's run description, within its tag limit: cut at a line, saying where the rest is."""
    if len(text) <= TAG_VALUE_MAX:
        return text
    tail = f"\n\n(cut here for MLflow's {TAG_VALUE_MAX:,}-character limit: the whole card is the artifact {CARD_MD})\n"
    return text[:text.rfind("\n", 0, TAG_VALUE_MAX - len(tail))] + tail


def _text(v) -> str:
    if isinstance(v, bool):
        text = str(v).lower()
    elif isinstance(v, (str, int, float)):
        text = str(v)
    else:
        text = json.dumps(v, sort_keys=True, separators=(",", ":"))
    return text if len(text) <= TAG_VALUE_MAX else text[:TAG_VALUE_MAX - 1] + "\u2026"
