"""The model card (``MODEL_CARD.md``, ``model_card.json``) from a real run, read back against independent sources:

one run, in this process (``--local``), of a plug-in model from a working directory that is its own git repository,
on a cache materialized (``where split != 'test'``) from a curated table (``where label != 'star'``) of PNGs written
here (one class named with Markdown's and HTML's special characters), tracked in a local MLflow store. Its first
launch dies at step 6 (the model raises), after the commit of step 4; a ``--resume`` launch finishes it at step 8.
Then ``dutycycle evaluate`` scores the validation split with the final model and writes the card again.

The card's facts are compared with where they come from: the rows the test wrote (class counts per split, counted
here), the table and cache manifests (versions, fingerprint, transform, curation), ``git`` run here (revisions,
dirty or not), the installed packages, the run's summary (steps, wall time, goodput) and the evaluation's scores;
the MLflow run holds the same facts as tags and the card's files as artifacts. The causes of restarts (a resize:
shrink and grow, a Ray Train restart) are read from metrics rows as the launch slice writes them."""

from __future__ import annotations

import copy
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import uuid
from collections import Counter
from importlib import metadata

import pytest
from dutycycle.engine.cache import format as cache_format
from dutycycle.engine.cache.materialize import materialize
from dutycycle.engine.table.table import open_table
from dutycycle.engine.transform import TransformSpec
from dutycycle.trainer.config import load_config
from dutycycle.trainer.launch import card as card_mod
from dutycycle.trainer.launch.card import CARD_JSON, CARD_MD, card_tags, read_card
from dutycycle.trainer.launch.card_data import data_facts
from dutycycle.trainer.launch.card_md import markdown
from dutycycle.trainer.launch.card_training import launches, timeline, training_facts
from dutycycle.trainer.launch.train import train
from dutycycle.trainer.serve.evaluate import evaluate

from ..support.tablemaker import add_file, png_bytes, shape_image, write_table

mlflow = pytest.importorskip("mlflow", reason="the `tracking` extra is not installed")

HOSTILE = "tri|angle <b>_x_</b>"  # a class name: a table cell's pipe, HTML, Markdown emphasis
NAMES = {"circle": "circle", "square": "square", "triangle": HOSTILE, "star": "star"}
CLASSES = sorted(NAMES.values())
# the model: a LeNet-sized net that raises at its FAIL_AT-th training forward while the flag file exists
MODEL = '''
import os

from torch import nn

FLAG = os.path.join(os.path.dirname(__file__), "fail-at-6")
calls = 0


class Net(nn.Sequential):
    def forward(self, x):
        global calls
        if self.training:
            calls += 1
            if calls == 6 and os.path.exists(FLAG):
                raise RuntimeError("the device fell over at step 6")
        return super().forward(x)


def tiny(cfg, in_channels, num_classes, image_size):
    return Net(nn.Conv2d(in_channels, 4, 3, padding=1), nn.ReLU(), nn.Flatten(),
               nn.Linear(4 * image_size * image_size, num_classes))
'''


def _git(path, *args) -> str:
    return subprocess.run(["git", "-C", str(path), *args], check=True, capture_output=True, text=True).stdout.strip()


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("card")
    rows = []
    for i in range(72):
        img, shape = shape_image(i, 12, 12, seed=4)
        row = add_file(str(root / "images"), f"{shape}/{i:04d}.png", png_bytes(img), NAMES[shape])
        row["split"] = {0: "test", 1: "val"}.get(i // 4 % 6, "train")  # every class in every split
        rows.append(row)
    table = write_table(str(root / "table"), rows, classes=CLASSES)
    curated = str(root / "curated")
    open_table(table).where("label != 'star'").save(curated)
    spec = TransformSpec(size=8)
    materialize(curated, str(root / "cache"), spec, where="split != 'test'", runner="native")

    work = root / "work"  # the working directory: the model's package, in a git repository with a change
    package = f"cardnets_{uuid.uuid4().hex[:8]}"
    (work / package).mkdir(parents=True)
    (work / package / "__init__.py").write_text("")
    module = work / package / "nets.py"
    module.write_text(MODEL)
    _git(work, "init", "-q")
    _git(work, "add", ".")
    _git(work, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "nets")
    (work / package / "__init__.py").write_text("# changed after the commit\n")
    (work / package / "fail-at-6").write_text("")

    run_dir, store = root / "run", root / "mlruns"
    overrides = [f"data.cache={root / 'cache'}", "data.global_batch_size=8", "data.eval_batch_size=16",
                 f"model.name={package}.nets:tiny", "run.max_steps=8", "run.eval_every=4", "run.log_every=0",
                 "run.report=false", "run.precision=fp64", "checkpoint.every=4", f"run.dir={run_dir}",
                 "run.name=cards", f"tracking.mlflow_uri={store}"]
    cwd, path = os.getcwd(), list(sys.path)
    os.chdir(work)
    try:
        with pytest.raises(RuntimeError, match="fell over at step 6"):
            train(load_config(None, overrides), local=True, quiet=True)
        (work / package / "fail-at-6").unlink()
        summary = train(load_config(None, overrides), local=True, quiet=True, resume=True)
        trained = read_card(str(run_dir))
        ev = evaluate(str(run_dir), "val")
    finally:
        os.chdir(cwd)
        sys.path[:] = path
        for name in [m for m in sys.modules if m == package or m.startswith(package + ".")]:
            del sys.modules[name]
    return {"root": root, "dir": run_dir, "rows": rows, "table": table, "curated": curated, "spec": spec,
            "work": work, "module": module, "summary": summary, "trained": trained, "ev": ev, "store": store,
            "card": read_card(str(run_dir))}


def test_the_card_says_what_data_made_the_model(run):
    d = run["card"]["data"]
    cache = cache_format.read_manifest(cache_format.resolve(str(run["root"] / "cache")))
    # the rows the cache holds, counted from what the test wrote: readable, not a star, not test
    expected: dict[str, Counter] = {}
    for r in run["rows"]:
        if r["label"] != "star" and r["split"] != "test":
            expected.setdefault(r["split"], Counter())[r["label"]] += 1
    assert d["classes"] == {s: {c: expected[s][c] for c in CLASSES if expected[s][c]} for s in sorted(expected)}
    assert d["splits"] == {s: sum(c.values()) for s, c in sorted(expected.items())} == cache.split_counts
    assert d["source"] == "cache" and d["table"] == {"uri": run["curated"], "version": 1}
    assert d["fingerprint"] == cache.fingerprint == d["cache"]["fingerprint"]
    assert d["transform"] == run["spec"].to_dict() == d["cache"]["transform"]
    assert d["cache"]["uri"] == cache_format.resolve(str(run["root"] / "cache"))
    materialized, curated, ingested = d["curation"]
    assert materialized == {"step": "materialize", "cache": d["cache"]["uri"], "where": "split != 'test'"}
    assert curated["step"] == "curate" and curated["table"] == run["curated"] and curated["filter"] == "(label != 'star')"
    assert curated["operations"] == ["where label != 'star'"] and curated["parent"] == run["table"]
    assert curated["parent_version"] == 1 and curated["rows"] == sum(r["label"] != "star" for r in run["rows"])
    assert ingested["step"] == "ingest" and ingested["table"] == run["table"] and ingested["rows"] == len(run["rows"])
    assert d["notes"] == []

    # a raw run reads the table itself: every split of its selected rows, the same lineage without the cache
    raw = data_facts(load_config(None, ["data.source=raw", f"data.table={run['curated']}", "data.size=8"]),
                     {"data": {"classes": CLASSES}}, started=None)
    counted: dict[str, Counter] = {}
    for r in run["rows"]:
        if r["label"] != "star":
            counted.setdefault(r["split"], Counter())[r["label"]] += 1
    assert raw["classes"] == {s: {c: counted[s][c] for c in CLASSES if counted[s][c]} for s in sorted(counted)}
    assert raw["table"] == {"uri": run["curated"], "version": 1} and raw["curation"] == [curated, ingested]
    assert raw["cache"] is None and raw["notes"] == []


def test_the_card_says_what_code_environment_and_training_made_it(run):
    import daft
    import ray
    import torch

    card, s = run["card"], run["summary"]
    c, e, t = card["code"], card["environment"], card["training"]
    repo = os.path.dirname(os.path.dirname(card_mod.__file__))
    assert c["version"] == metadata.version("dutycycle") and c["install"]["kind"] == "editable"
    assert c["git"] == {"commit": _git(repo, "rev-parse", "HEAD"), "root": _git(repo, "rev-parse", "--show-toplevel"),
                        "dirty": bool(_git(repo, "status", "--porcelain", "--untracked-files=no"))}
    assert c["project_git"] == {"commit": _git(run["work"], "rev-parse", "HEAD"), "dirty": True,
                                "root": _git(run["work"], "rev-parse", "--show-toplevel")}
    assert c["model_module"]["sha256"] == hashlib.sha256(run["module"].read_bytes()).hexdigest()
    assert e["python"] == platform.python_version()
    assert (e["packages"]["torch"], e["packages"]["ray"], e["packages"]["daft"]) == (
        torch.__version__, ray.__version__, metadata.version("daft")) and daft is not None
    assert e["hardware"]["driver"]["cpus"] == os.cpu_count()
    assert e["hardware"]["workers"] | {"hosts": None} == {"world_size": 1, "device": "cpu", "nodes": 1, "hosts": None,
                                                         "cpus_per_worker": 1.0, "accelerators": []}
    assert e["hardware"]["workers"]["hosts"] == [platform.node()]

    config = json.loads((run["dir"] / "config.json").read_text())
    assert t["config"] == {k: v for k, v in config.items() if k != "format"}
    assert (t["steps"], t["epochs"], t["samples"]) == (8, s["epochs"], s["samples"])
    # two launches: the first from its launch to its last row (it never finished), the second to its finish
    rows = [json.loads(x) for x in (run["dir"] / "metrics.jsonl").read_text().splitlines()]
    launches = [json.loads((run["dir"] / "attempts" / str(n) / "attempt.json").read_text()) for n in (1, 2)]
    first_end = max(r["time"] for r in rows if launches[0]["launched"] <= r["time"] < launches[1]["launched"])
    walls = [first_end - launches[0]["launched"], launches[1]["finished_at"] - launches[1]["launched"]]
    assert [w["wall_s"] for w in t["launches"]] == walls and t["wall_s"] == sum(walls)
    assert abs(walls[1] - s["launch"]["wall_s"]) < 0.5  # the second launch's own account, closed a moment earlier
    useful = sum(r["forward_backward"] + r["optimizer"] for r in rows if "loss" in r)
    # summed in another order than the card's: equal to a few ulps of a sum of ~20 positive terms (1e-12 allowed)
    assert t["goodput"] == pytest.approx(useful / sum(walls), rel=1e-12) and 0 < t["goodput"] < 1
    # the first launch died at step 6 after the commit of step 4; the resume continued from there
    assert [(r["step"], r["launch"], r["cause"]) for r in t["restarts"]] == [(0, 1, "start"),
                                                                          (4, 2, "resume after failure")]
    assert t["failures_survived"] == 1 and t["failures"]["at_steps"] == [4] and t["resizes"] == []
    job = s["job"]  # the Trainer's account of the failure: the downtime from the dead launch's last row
    assert t["failures"] == {"at_steps": [4], "lost_s": job["failures_s"], "redone_s": job["redone_s"],
                             "down_s": job["down_s"], "steps_redone": job["steps_redone"]} and job["down_s"] > 0
    assert t["world_sizes"] == [1, 1] and t["checkpoints"] == s["checkpoint"]["committed"]
    # evaluate wrote the evaluation again and kept every other fact as the training's end wrote it
    assert card == {**run["trained"], "evaluation": card["evaluation"], "updated_at": card["updated_at"]}
    assert card["written_by"] == "training" and card["updated_at"] > card["created_at"]


def test_evaluate_writes_the_card_again_and_mlflow_holds_the_same_facts(run):
    from mlflow import MlflowClient

    before, card, ev, s = run["trained"], run["card"], run["ev"], run["summary"]
    assert before["evaluation"]["splits"] == {}
    assert before["evaluation"]["validation"] == {"accuracy": s["val_accuracy"], "loss": s["val_loss"],
                                                  "samples": s["val_samples"], "step": 8}
    val = card["evaluation"]["splits"]["val"]
    assert (val["accuracy"], val["loss"], val["samples"], val["step"]) == (ev.accuracy, ev.loss, len(ev.labels), 8)
    assert val["samples"] == card["data"]["splits"]["val"] and val["source"] == "cache"

    md = (run["dir"] / CARD_MD).read_text()
    assert md == markdown(card)
    for fact in (run["curated"], card["data"]["fingerprint"], card["code"]["git"]["commit"],
                 "| failures survived | 1 (at steps 4;", f"{ev.accuracy:.2%}", card["environment"]["packages"]["torch"]):
        assert fact in md, fact
    # the hostile class name cannot break its table: every row of the class table has the header's cells
    lines = md.splitlines()
    head = lines.index("| class | train | val |")
    table = lines[head:lines.index("", head)]
    assert len(table) == 2 + 3 and all(row.replace("\\|", "").count("|") == 4 for row in table)
    assert "<b>" not in md and "tri\\|angle \\<b\\>\\_x\\_\\</b\\>" in md

    record = json.loads((run["dir"] / "mlflow.json").read_text())
    client = MlflowClient(tracking_uri=record["tracking_uri"])
    tags = client.get_run(record["run_id"]).data.tags
    assert {k: v for k, v in tags.items() if k.startswith("dutycycle.card.")} == \
        {k: v for k, v in card_tags(card).items()}
    assert tags["mlflow.note.content"] == md
    assert tags["dutycycle.card.eval.val.accuracy"] == str(ev.accuracy)  # the evaluation, beside the run's own:
    assert tags["dutycycle.card.eval.validation.accuracy"] == str(s["val_accuracy"])
    assert tags["dutycycle.card.training.failures_survived"] == "1"
    assert json.loads(tags["dutycycle.card.data.classes"]) == card["data"]["classes"]
    artifacts = {a.path for a in client.list_artifacts(record["run_id"])}
    assert {CARD_MD, CARD_JSON} <= artifacts
    assert json.loads(open(client.download_artifacts(record["run_id"], CARD_JSON)).read()) == card


def test_restarts_are_told_apart_by_their_cause(run, tmp_path):
    """Metrics rows as an elastic run writes them (the launch slice's ``resize`` rows, each attempt's world
    size): a node lost (shrink), the node back (grow), a worker restart at the same size; then a --resume."""
    for n, launched in ((1, 100.0), (2, 500.0)):
        folder = tmp_path / "attempts" / str(n)
        folder.mkdir(parents=True)
        (folder / "config.json").write_text(json.dumps({"parallel": {"num_workers": [2, 3]}}))
        (folder / "attempt.json").write_text(json.dumps({"format": 1, "launched": launched}))
    rows = [{"event": "attempt", "step": 0, "started": 101.0, "world_size": 3, "time": 102.0},
            # the node lost at step 12, the run restored at step 10 (its commit) at two workers
            {"event": "resize", "step": 12, "from": 3, "to": 2, "total_s": 21.25, "restore_s": 1.5, "time": 150.0},
            {"event": "attempt", "step": 10, "started": 200.0, "world_size": 2, "time": 201.0},
            {"event": "attempt", "step": 20, "started": 300.0, "time": 301.0},  # no size of its own: the row's
            {"event": "resize", "step": 20, "from": 2, "to": 3, "time": 302.0},
            {"event": "attempt", "step": 30, "started": 400.0, "world_size": 3, "time": 401.0},
            {"event": "attempt", "step": 40, "started": 501.0, "time": 502.0}]
    runs = launches(str(tmp_path))
    restarts = timeline(runs, rows, {"world_size": 2})
    assert [(r["step"], r["world_size"], r["launch"], r["cause"]) for r in restarts] == [
        (0, 3, 1, "start"), (10, 2, 1, "resize: shrink"), (20, 3, 1, "resize: grow"),
        (30, 3, 1, "restart after failure"), (40, 2, 2, "resume after failure")]
    cfg = load_config(None, ["data.source=synthetic"])
    t = training_facts(cfg, {}, restarts, rows, runs)
    assert t["failures_survived"] == 3 and t["failures"]["at_steps"] == [10, 30, 40]
    assert t["resizes"] == [
        {"step": 10, "from": 3, "to": 2, "cause": "resize: shrink", "total_s": 21.25, "restore_s": 1.5},
        {"step": 20, "from": 2, "to": 3, "cause": "resize: grow"},
        {"step": 40, "from": 3, "to": 2, "cause": "resume after failure"}]
    card = {**run["card"], "training": t}  # the Markdown of these restarts
    assert ("| resizes | step 10: 3 -> 2 workers (resize: shrink, 21.2 s from the last step to the first at 2); "
            "step 20: 2 -> 3 workers (resize: grow); step 40: 3 -> 2 workers (resume after failure) |") in markdown(card)
    # one launch: its job account's wall time and goodput (launch/account.py), the page's figures
    one = training_facts(cfg, {"launch": {"wall_s": 12.5, "goodput": 0.25}}, restarts[:4], rows, runs[:1])
    assert (one["wall_s"], one["goodput"]) == (12.5, 0.25)
    # a launch that finished before the next one resumed it: a resume, not a failure
    (tmp_path / "attempts" / "1" / "attempt.json").write_text(json.dumps({"launched": 100.0, "finished_at": 450.0}))
    assert timeline(launches(str(tmp_path)), rows, {"world_size": 2})[-1]["cause"] == "resume"


def test_a_card_of_many_classes_stays_readable_and_within_mlflows_limit(run):
    card = copy.deepcopy(run["card"])
    names = [f"c{i:03d}" for i in range(150)]
    card["data"]["class_names"] = names
    card["data"]["classes"] = {"train": {n: i + 1 for i, n in enumerate(names)}}
    md = markdown(card)
    listed = [line for line in md.splitlines() if line.startswith("| c0") or line.startswith("| c1")]
    assert listed == [f"| c{i:03d} | {i + 1} |" for i in range(100)]
    assert "| ... 50 more classes in `model_card.json` | |" in md
    card["data"]["curation"] *= 40  # a long chain of curated tables: the Markdown passes MLflow's 8,000 characters
    md = markdown(card)
    note = card_tags(card, note=md)["mlflow.note.content"]
    assert len(md) > 8000 >= len(note) and md.startswith(note[:note.index("\n\n(cut here")])
    assert note.endswith("the whole card is the artifact MODEL_CARD.md)\n")


def test_evaluate_gives_a_run_from_before_cards_a_whole_one_saying_whose_environment_it_records(run, tmp_path):
    old = tmp_path / "old-run"
    shutil.copytree(run["dir"], old, ignore=shutil.ignore_patterns("checkpoints", "model_card.json", "MODEL_CARD.md"))
    card = card_mod.update_card(str(old))
    assert card["written_by"] == "evaluate" and "updated_at" not in card
    assert card["evaluation"]["splits"]["val"]["accuracy"] == run["ev"].accuracy
    assert card["data"]["classes"] == run["card"]["data"]["classes"]
    assert "Written after the training by `dutycycle evaluate`" in (old / CARD_MD).read_text()
