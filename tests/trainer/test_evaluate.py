"""``dutycycle evaluate``: a user's path on real files. PNG class folders written here (one class named with HTML
and matplotlib's special characters, as a folder may be named), ingested with a test split, curated into a
training cache that keeps the test split out (``where = "split != 'test'"``), trained in this process with a
per-channel normalization, then scored:

- the test split, which the cache does not hold: read from the table, decoded with the cache's transform, one
  file damaged after ingest counted and left out; every logit equal to the model file applied to the files
  decoded here by hand;
- the validation split, which the cache holds: the run's own last validation pass, figure for figure;
- an older commit (``--step``), through the CLI; the run's page with both splits, escaped;
- refusals that name the fix; the scores' conventions on a hand-made confusion matrix; a synthetic run that kept
  no checkpoints, scored from its model file.

Float64 throughout (run.precision = fp64): the reference decodes and normalizes with the same functions, so the
logits agree to summation order (a forward pass of a few layers: ~1e-15 relative; 1e-12 allowed).
"""

from __future__ import annotations

import html
import json
import os

import numpy as np
import pytest
import torch
from dutycycle.engine.cache.materialize import materialize, plan_rows
from dutycycle.engine.errors import SourceError
from dutycycle.engine.table.catalog import ingest
from dutycycle.engine.table.table import open_table
from dutycycle.engine.transform import TransformSpec, decode_and_transform
from dutycycle.loader.augment import to_tensor
from dutycycle.trainer.app.cli import main
from dutycycle.trainer.config import load_config
from dutycycle.trainer.launch.train import train
from dutycycle.trainer.serve.evaldata import augment_for
from dutycycle.trainer.serve.evaluate import evaluate
from dutycycle.trainer.serve.scores import confusion, scores
from dutycycle.trainer.step.models import build_model

from ..support.pages import raw_values, unresolved
from ..support.tablemaker import png_bytes, shape_image

HOSTILE = "<i>\"tri&'angle $x$"  # a folder name: markup, quotes, an ampersand, matplotlib's math mode
FOLDERS = {"circle": "circle", "square": "square", "triangle": HOSTILE}
SPEC = TransformSpec(size=16)
MEAN, STD = [0.4, 0.5, 0.6], [0.2, 0.25, 0.3]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("evaluate")
    images = root / "images"
    for i in range(160):
        img, shape = shape_image(i, 16, 16, seed=3)
        if shape in FOLDERS:
            folder = images / FOLDERS[shape]
            folder.mkdir(parents=True, exist_ok=True)
            (folder / f"{i:04d}.png").write_bytes(png_bytes(img))
    table = str(root / "table")
    ingest(str(images), table, split="0.6,0.2,0.2", phash=False, progress_every=0)
    cache = materialize(table, str(root / "cache"), SPEC, where="split != 'test'", runner="native")
    assert "test" not in cache.manifest.split_counts
    test_rows = plan_rows(table, SPEC, "split = 'test'")
    damaged = test_rows.uris[3]  # a file that changed after ingest: decodes no more
    with open(damaged, "r+b") as f:
        f.truncate(120)
    cfg = load_config(None, [
        "data.source=cache", f"data.cache={root / 'cache'}", "data.global_batch_size=16", "data.eval_batch_size=8",
        "model.width=8", "model.depth=2", "run.max_steps=12", "run.eval_every=0", "run.log_every=0",
        "run.precision=fp64", "checkpoint.every=5", "checkpoint.keep=2", f"run.dir={root / 'run'}",
        f"data.augment.mean={MEAN}", f"data.augment.std={STD}"])
    summary = train(cfg, local=True, quiet=True)
    return {"dir": str(root / "run"), "table": table, "summary": summary, "test": test_rows, "damaged": damaged,
            "cache": cache}


def reference_logits(run, uris: list[str]) -> dict[str, np.ndarray]:
    """The run's model file applied to ``uris`` decoded and normalized here, by sample id."""
    from safetensors.torch import load_file

    s = run["summary"]
    data = s["data"]
    model = build_model(load_config(None, ["data.cache=x", "model.width=8", "model.depth=2"]).model, data["channels"],
                        data["num_classes"], data["size"]).double()
    model.load_state_dict(load_file(os.path.join(run["dir"], "model.safetensors")))
    model.eval()
    images = np.stack([decode_and_transform(open(u, "rb").read(), SPEC) for u in uris])
    x = to_tensor(images, augment_for(data["normalize"]), SPEC.layout)
    with torch.no_grad():
        out = model(x.double()).numpy()
    ids = {u: i for u, i in zip(run["test"].uris, run["test"].sample_ids, strict=True)}
    return {ids[u]: row for u, row in zip(uris, out, strict=True)}


def test_a_test_split_kept_out_of_the_cache_is_read_from_its_table(run):
    s = run["summary"]
    assert s["data"]["normalize"] == {"mean": MEAN, "std": STD}  # what the training batches had
    ev = evaluate(run["dir"], "test")
    m = ev.metrics
    rows = len(run["test"].uris)
    assert m["data"]["source"] == "table" and m["data"]["table"] == run["table"]
    assert m["data"]["fingerprint"] == run["cache"].manifest.fingerprint == s["data"]["fingerprint"]
    assert m["data"]["table_version"] == m["data"]["table_version_trained"] == 1
    assert m["rows"] == rows and m["samples"] == rows - 1 > 8
    assert m["skipped"] == {"truncated": 1}
    assert os.path.basename(run["damaged"]) in m["skipped_examples"][0]
    assert any("holds no 'test' split" in n for n in m["notes"])
    assert any("materialized with where = \"split != 'test'\"" in n for n in m["notes"])
    assert m["step"] == 12 and m["weights"]["kind"] == "checkpoint"
    # every sample's logits: the final weights applied to the files decoded and normalized here
    good = [u for u in run["test"].uris if u != run["damaged"]]
    expected = reference_logits(run, good)
    assert sorted(ev.sample_ids) == sorted(expected)
    assert ev.sample_ids == sorted(ev.sample_ids)  # the cache's order: by sample id
    for sid, logits in zip(ev.sample_ids, ev.logits, strict=True):
        np.testing.assert_allclose(logits, expected[sid], rtol=1e-12, atol=1e-12)
    # the scores follow from the logits and the folder names
    classes = s["data"]["classes"]
    assert m["classes"] == classes and HOSTILE in classes
    truth = {i: classes.index(os.path.basename(os.path.dirname(u)))  # the class is the file's folder
             for u, i in zip(run["test"].uris, run["test"].sample_ids, strict=True)}
    assert ev.labels.tolist() == [truth[i] for i in ev.sample_ids]
    assert m["accuracy"] == pytest.approx(float(np.mean(ev.logits.argmax(1) == ev.labels)))
    assert sum(c["support"] for c in m["per_class"]) == m["samples"] == int(np.sum(m["confusion"]))
    # the files: JSON (as returned), the confusion PNG, one Parquet row per sample
    on_disk = json.loads(open(ev.files["json"]).read())
    assert on_disk["accuracy"] == m["accuracy"] and on_disk["files"] == {"png": "test.png",
                                                                          "predictions": "test.parquet"}
    from PIL import Image

    with Image.open(ev.files["png"]) as png:  # what the picture says, in its text chunk
        assert png.text["Title"] == f"test: accuracy {m['accuracy']:.1%}, loss {m['loss']:.4f}; {m['samples']} samples, step 12"
    import pyarrow.parquet as pq

    table = pq.read_table(ev.files["predictions"]).to_pydict()
    assert table["sample_id"] == ev.sample_ids and table["predicted_index"] == ev.predicted.tolist()
    assert table["label"] == [classes[i] for i in ev.labels]
    assert np.mean(table["loss"]) == pytest.approx(m["loss"], rel=1e-12)


def test_a_split_the_cache_holds_scores_as_the_runs_own_validation(run):
    s = run["summary"]
    ev = evaluate(run["dir"], "val")
    assert ev.metrics["data"]["source"] == "cache" and ev.metrics["data"]["cache"] == s["data"]["lineage"]["cache"]
    assert ev.metrics["samples"] == s["val_samples"] and ev.metrics["skipped"] == {}
    assert ev.accuracy == s["val_accuracy"]
    assert ev.loss == pytest.approx(s["val_loss"], rel=1e-12)  # per-batch sums against per-sample: ~1e-16 apart


def test_the_cli_scores_an_older_commit_and_the_page_shows_every_split(run, capsys):
    assert os.path.exists(os.path.join(run["dir"], "report.html"))  # drawn by the training driver at the end
    assert main(["evaluate", run["dir"], "--split", "val"]) == 0
    assert main(["evaluate", run["dir"], "--split", "test", "--step", "10"]) == 0
    out = capsys.readouterr().out.split("\ntest: ", 1)[1]
    assert out.startswith("accuracy ") and "step 10" in out and HOSTILE[:12] in out
    m = json.loads(open(os.path.join(run["dir"], "evaluation", "test.json")).read())
    assert m["step"] == 10 and m["weights"]["from"].endswith("step-00000010")
    latest = evaluate(run["dir"], "test", write=False)
    assert latest.metrics["step"] == 12 and latest.loss != m["loss"]  # other weights, another loss
    page = open(os.path.join(run["dir"], "report.html")).read()
    assert "<h2>Evaluation: test</h2>" in page and "<h2>Evaluation: val</h2>" in page
    assert page.index("Evaluation: test") < page.index("Evaluation: val")
    assert html.escape(HOSTILE) in page and HOSTILE not in page and "<i>" not in page
    assert "step 10" in page and "truncated 1" in page
    assert raw_values(page) == [] and unresolved(page, run["dir"]) == []
    assert page.count("src='data:image/png;base64,") == 3  # report.png and two confusion matrices


def test_refusals_name_the_fix(run, tmp_path, capsys):
    with pytest.raises(SourceError, match=r"no committed checkpoint of step 5 .*committed steps: 12, 10"):
        evaluate(run["dir"], "test", step=5, write=False)
    with pytest.raises(SourceError, match="not a run directory"):
        evaluate(str(tmp_path), "test")
    with pytest.raises(SourceError, match="holds no rows of split 'train'"):
        evaluate(run["dir"], "train", table=_empty_split_table(tmp_path), write=False)
    subset = str(tmp_path / "subset")  # a curation that saved the training rows as a table of their own
    open_table(run["table"]).where("split != 'test'").save(subset)
    with pytest.raises(SourceError, match=f"curated from '{run['table']}'.*pass --table {run['table']} to read"):
        evaluate(run["dir"], "test", table=subset, write=False)
    assert main(["evaluate", str(tmp_path / "nothing")]) == 2
    assert "not a run directory" in capsys.readouterr().err
    import dutycycle

    assert dutycycle.evaluate is evaluate  # the notebook's name for it


def _empty_split_table(tmp_path) -> str:
    """A table of the same classes whose rows are all in the test split."""
    src = tmp_path / "only-test"
    for cls in FOLDERS.values():
        (src / cls).mkdir(parents=True)
    img, _ = shape_image(0, 16, 16, seed=4)
    (src / "circle" / "a.png").write_bytes(png_bytes(img))
    table = str(tmp_path / "only-test-table")
    ingest(str(src), table, split="0,0,1", phash=False, progress_every=0)
    return table


def test_scores_follow_scikit_learns_conventions():
    labels = np.array([0, 0, 0, 1, 1, 2, 2, 2, 2])
    predicted = np.array([0, 0, 1, 1, 0, 2, 2, 0, 0])
    m = confusion(labels, predicted, 4)  # class 3: absent and never predicted
    assert m.tolist() == [[2, 1, 0, 0], [1, 1, 0, 0], [2, 0, 2, 0], [0, 0, 0, 0]]
    s = scores(m, ["a", "b", "c", "d"])
    a, b, c, d = s["per_class"]
    assert (a["precision"], a["recall"], a["support"], a["predicted"]) == (2 / 5, 2 / 3, 3, 5)
    assert a["f1"] == pytest.approx(2 * (2 / 5) * (2 / 3) / (2 / 5 + 2 / 3))
    assert (b["precision"], b["recall"]) == (1 / 2, 1 / 2) and (c["precision"], c["recall"]) == (1.0, 1 / 2)
    assert (d["precision"], d["recall"], d["f1"], d["support"]) == (0.0, 0.0, 0.0, 0)
    assert s["accuracy"] == 5 / 9
    assert s["macro"]["recall"] == pytest.approx((2 / 3 + 1 / 2 + 1 / 2 + 0) / 4)
    assert s["weighted"]["recall"] == pytest.approx(3 / 9 * 2 / 3 + 2 / 9 * 1 / 2 + 4 / 9 * 1 / 2)
    assert s["weighted"]["recall"] == pytest.approx(s["accuracy"])  # support-weighted recall is accuracy


def test_a_run_without_checkpoints_or_summary_is_scored_from_what_it_left(tmp_path):
    """A synthetic run scored from its commit; with its checkpoints gone, from its final model file (the same
    weights: the last commit is the last step); with its summary gone too (a run that has not finished), from
    the data facts read again. The same logits each time."""
    import shutil

    run_dir = tmp_path / "run"
    cfg = load_config(None, ["data.source=synthetic", "data.size=8", "data.global_batch_size=16",
                             "data.synthetic_samples=48", "model.width=8", "model.depth=1", "run.max_steps=3",
                             "run.eval_every=0", "run.log_every=0", "run.report=false", "checkpoint.every=3",
                             f"run.dir={run_dir}"])
    s = train(cfg, local=True, quiet=True)
    ev = evaluate(str(run_dir), "val")
    assert ev.metrics["weights"]["kind"] == "checkpoint" and ev.metrics["step"] == 3
    assert ev.metrics["samples"] == s["val_samples"] == 12 and ev.accuracy == s["val_accuracy"]
    assert ev.loss == pytest.approx(s["val_loss"], rel=1e-6)  # float32 sums of 12 losses: ~1e-7 apart
    shutil.rmtree(run_dir / "checkpoints")
    from_file = evaluate(str(run_dir), "val")
    assert from_file.metrics["weights"]["kind"] == "model file" and from_file.metrics["step"] == 3
    assert np.array_equal(from_file.logits, ev.logits)
    (run_dir / "summary.json").unlink()
    unfinished = evaluate(str(run_dir), "val")
    assert np.array_equal(unfinished.logits, ev.logits) and unfinished.metrics["step"] is None
    assert any("has not finished" in n for n in unfinished.metrics["notes"])
    assert "No summary yet" in (run_dir / "report.html").read_text()
    with pytest.raises(SourceError, match="has the splits train and val, not 'test'"):
        evaluate(str(run_dir), "test")


def test_a_run_on_object_storage_is_evaluated_where_it_lies(s3):
    """Run directory, checkpoints and the evaluation's files on S3 (the local server): the page lists them."""
    import s3fs

    run_dir = f"{s3}/runs/r1"
    cfg = load_config(None, ["data.source=synthetic", "data.size=8", "data.global_batch_size=16",
                             "data.synthetic_samples=32", "model.width=8", "model.depth=1", "run.max_steps=2",
                             "run.eval_every=0", "run.log_every=0", "checkpoint.every=2", f"run.dir={run_dir}"])
    s = train(cfg, local=True, quiet=True)
    ev = evaluate(run_dir, "val")
    assert ev.metrics["weights"]["from"] == f"{run_dir}/checkpoints/step-00000002"
    assert ev.metrics["samples"] == s["val_samples"] and ev.accuracy == s["val_accuracy"]
    fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": os.environ["AWS_ENDPOINT_URL"]})
    base = run_dir.removeprefix("s3://")
    assert {p.rsplit("/", 1)[-1] for p in fs.ls(f"{base}/evaluation")} == {"val.json", "val.png", "val.parquet"}
    page = fs.cat(f"{base}/report.html").decode()
    assert "<h2>Evaluation: val</h2>" in page and page.count("src='data:image/png;base64,") == 2
