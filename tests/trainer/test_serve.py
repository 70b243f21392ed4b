"""A trained model on its own: the metadata ``model.safetensors`` carries, ``load_model`` in a fresh process without
the cache or the table, ``dutycycle export`` (torch.export and ONNX, checked), ``dutycycle predict`` on files, a
folder with broken files and a metadata table.

One short local run serves every test: real PNG and EXIF-rotated JPEG files written here, ingested, materialized
at 16x16 and trained for 8 steps with per-channel normalization. The reference everywhere is what training saw:
the cache's pixels, normalized by the validation loader, through the weights loaded into a plain module.
"""

from __future__ import annotations

import csv
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import fsspec
import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from dutycycle.engine import io, sealed
from dutycycle.engine.cache.format import read_manifest
from dutycycle.engine.cache.materialize import materialize
from dutycycle.engine.errors import ConfigError, CorruptArtifactError, SourceError
from dutycycle.engine.table.catalog import ingest
from dutycycle.engine.table.table import open_table
from dutycycle.engine.transform import TransformSpec
from dutycycle.loader import CacheLoader
from dutycycle.trainer.app.cli import main
from dutycycle.trainer.config import load_config
from dutycycle.trainer.configtree import as_tree
from dutycycle.trainer.launch.train import train
from dutycycle.trainer.serve.export import ExportError, export_model, tolerance
from dutycycle.trainer.serve.load import TrainedModel, load_model
from dutycycle.trainer.step.modelfile import METADATA_KEY, read_metadata
from dutycycle.trainer.step.models import build_model
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from ..support import REPO
from ..support.tablemaker import jpeg_bytes, png_bytes, shape_image

MEAN, STD = [0.4, 0.5, 0.6], [0.2, 0.25, 0.3]
CLASSES = ["circle", "square", "star", "triangle"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A finished local run and its inputs: ``{"root", "images", "table", "cache", "run", "cfg", "summary"}``."""
    root = tmp_path_factory.mktemp("serve")
    images = root / "images"
    rng = np.random.default_rng(0)
    for i in range(48):
        w, h = (int(v) for v in rng.integers(18, 40, 2))  # not square: the transform's resize and crop matter
        img, kind = shape_image(i, w, h)
        (images / kind).mkdir(parents=True, exist_ok=True)
        if i % 3:
            (images / kind / f"{i:02d}.png").write_bytes(png_bytes(img))
        else:  # a JPEG whose EXIF says "rotate 90": the transform turns it upright
            (images / kind / f"{i:02d}.jpg").write_bytes(jpeg_bytes(img, orientation=6))
    (images / "circle" / "cut.png").write_bytes(png_bytes(shape_image(99, 30, 30)[0])[:200])  # an error row
    store = root / "store"  # moved away while the fresh process loads the model
    ingest(str(images), str(store / "table"), split="0.6,0.4,0", progress_every=0, runner="native")
    cache = materialize(str(store / "table"), str(store / "cache"), TransformSpec(size=16), runner="native").uri
    cfg = load_config(None, [
        f"data.cache={cache}", "data.global_batch_size=16", "data.eval_batch_size=64", "model.width=8",
        "model.depth=2", "model.groups=4", "run.max_steps=8", "run.eval_every=0", "run.log_every=0",
        f"data.augment.mean={MEAN}", f"data.augment.std={STD}", f"run.dir={root / 'run'}", "run.health_check=false"])
    summary = train(cfg, local=True, quiet=True)
    return {"root": root, "images": images, "table": str(store / "table"), "cache": cache, "run": root / "run",
            "cfg": cfg, "summary": summary, "store": store}


def reference(run) -> dict:
    """What training saw for the validation split: the logits of the weights, loaded into a plain module, on the
    validation loader's normalized batch; the samples' ids, labels, files and table rows."""
    cfg = run["cfg"]
    _, val_cfg = cfg.data.loader_configs(cfg.run.seed, world_size=1)
    loader = CacheLoader(run["cache"], "val", 0, 1, config=val_cfg)
    batches = list(loader)
    x = torch.cat([b["image"] for b in batches])
    ids = [s for b in batches for s in b["sample_id"]]
    plain = build_model(cfg.model, 3, 4, 16)
    plain.load_state_dict(load_file(run["run"] / "model.safetensors"))
    with torch.no_grad():
        logits = plain.eval()(x)
    rows = {r["sample_id"]: r for r in open_table(run["table"]).to_arrow().to_pylist()}
    return {"ids": ids, "logits": logits, "labels": torch.cat([b["label"] for b in batches]),
            "files": [rows[s]["uri"] for s in ids], "module": plain, "rows": rows}


def cache_pixels(cache: str, ids: list[str]) -> np.ndarray:
    """The cache's uint8 samples of ``ids``, channels first, read with plain pyarrow."""
    import pyarrow as pa

    m = read_manifest(cache)
    found = {}
    for shard in m.shards:
        with pa.memory_map(io.join(cache, shard.path)) as f:
            t = pa.ipc.open_file(f).read_all()
        for sid, img in zip(t.column("sample_id").to_pylist(), t.column("image").to_pylist(), strict=True):
            found[sid] = np.frombuffer(img, np.uint8).reshape(m.shape).transpose(2, 0, 1)
    return np.stack([found[s] for s in ids])


# ---------------------------------------------------------------------------------------------- the file


def test_model_file_records_what_the_model_needs(run):
    meta = read_metadata(str(run["run"] / "model.safetensors"))
    cache = read_manifest(run["cache"])
    s = run["summary"]
    assert meta.classes == CLASSES == cache.classes
    assert meta.input == {"channels": 3, "height": 16, "width": 16, "mode": "RGB", "layout": "NCHW",
                          "dtype": "float32"}
    assert meta.normalize == {"mean": MEAN, "std": STD} == s["data"]["normalize"]
    assert meta.transform == cache.spec == TransformSpec(size=16).to_dict()
    assert meta.model == {"name": "cnn", "args": as_tree(run["cfg"].model)}
    assert meta.weights["sha256"] == s["weights_sha256"] and meta.weights["dtype"] == "float32"
    assert meta.data == {"source": "cache", "table": run["table"], "table_version": 1, "cache": run["cache"],
                         "fingerprint": cache.fingerprint}
    from importlib.metadata import version

    assert meta.code["dutycycle"] == version("dutycycle") and meta.code["torch"] == torch.__version__
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True)
    assert meta.code["git"] == (head.stdout.strip() if head.returncode == 0 else None)
    # plain safetensors sees the conventional "format" entry and the JSON beside the tensors
    with safe_open(str(run["run"] / "model.safetensors"), "pt") as f:
        assert f.metadata()["format"] == "pt" and json.loads(f.metadata()[METADATA_KEY])["format"] == 1


# ----------------------------------------------------------------------------------------- load_model

FRESH = """
import json, sys
import numpy as np
import dutycycle

model = dutycycle.load_model(sys.argv[1])
files = json.loads(open(sys.argv[2]).read())
pixels = np.stack([model.preprocess.pixels(f) for f in files])
logits = model(model.preprocess.normalize_pixels(pixels)).detach().numpy()
preds = model.predict(files, top_k=2, batch_size=4)
np.savez(sys.argv[3], pixels=pixels, logits=logits)
json.dump({"classes": model.classes, "training": model.training, "top": [[p.labels, p.probabilities] for p in preds],
           "modules": sorted(m for m in ("daft", "ray") if m in sys.modules)}, open(sys.argv[4], "w"))
"""


def test_load_model_in_a_fresh_process_predicts_what_training_saw(run, tmp_path):
    ref = reference(run)
    (tmp_path / "files.json").write_text(json.dumps(ref["files"]))
    out, facts = tmp_path / "out.npz", tmp_path / "facts.json"
    moved = run["root"] / "moved"
    run["store"].rename(moved)  # no cache, no table: the model file alone
    try:
        proc = subprocess.run([sys.executable, "-c", FRESH, str(run["run"]), str(tmp_path / "files.json"), str(out),
                               str(facts)], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    finally:
        moved.rename(run["store"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    got, facts = np.load(out), json.loads(facts.read_text())
    assert facts["classes"] == CLASSES and facts["training"] is False
    assert facts["modules"] == []  # neither Daft nor Ray: the model file and torch
    # the same decode and transform as the cache, bit for bit (EXIF-rotated JPEGs included)
    assert np.array_equal(got["pixels"], cache_pixels(run["cache"], ref["ids"]))
    # the same logits as the trained weights on the validation loader's batch: the inputs are identical, so only
    # the summation order of another process's kernels may differ (serve/export.py: tolerance)
    want = ref["logits"].numpy()
    assert np.abs(got["logits"] - want).max() <= tolerance(ref["module"], [ref["logits"]])
    predicted = got["logits"].argmax(1)
    assert np.array_equal(predicted, want.argmax(1))
    accuracy = float((torch.from_numpy(predicted) == ref["labels"]).float().mean())
    assert accuracy == pytest.approx(run["summary"]["val_accuracy"], abs=1e-12)
    top = facts["top"]
    assert [t[0][0] for t in top] == [CLASSES[i] for i in predicted]
    # predict() ran batches of 4: its logits may sit within the tolerance of the whole batch's; a softmax output
    # moves by at most half the largest logit change (sum_j |dp_i/dz_j| = 2 p_i (1 - p_i) <= 1/2)
    probs = torch.softmax(torch.from_numpy(got["logits"]), 1).topk(2).values.numpy()
    assert np.abs(np.array([t[1] for t in top]) - probs).max() <= tolerance(ref["module"], [ref["logits"]]) / 2 + 1e-7


def test_load_model_refuses_damaged_or_foreign_files(run, tmp_path):
    src = run["run"] / "model.safetensors"
    with pytest.raises(SourceError, match="no model file"):
        load_model(str(tmp_path / "nowhere"))
    state = load_file(src)
    with safe_open(str(src), "pt") as f:
        meta = f.metadata()

    def write(name, tensors=state, metadata=meta):
        path = tmp_path / name
        save_file(tensors, path, metadata=metadata)
        return str(path)

    with pytest.raises(CorruptArtifactError, match="carries no dutycycle metadata"):
        load_model(write("plain.safetensors", metadata={"format": "pt"}))
    changed = json.loads(meta[METADATA_KEY])
    changed["classes"][0] = "ellipse"  # a class renamed after the run wrote it
    with pytest.raises(CorruptArtifactError, match="fails its own checksum"):
        load_model(write("renamed.safetensors", metadata={**meta, METADATA_KEY: json.dumps(changed)}))
    flipped = dict(state)
    flipped["head.bias"] = state["head.bias"].clone()
    flipped["head.bias"][0] += 1.0
    with pytest.raises(CorruptArtifactError, match="do not match the sha256"):
        load_model(write("flipped.safetensors", tensors=flipped))
    (tmp_path / "junk.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(CorruptArtifactError, match="not a safetensors file"):
        load_model(str(tmp_path / "junk.safetensors"))
    # a plug-in name comes from the file: imported only when the caller trusts it
    plugin = json.loads(meta[METADATA_KEY])
    plugin["model"]["name"] = plugin["model"]["args"]["name"] = "dutycycle.trainer.step.models:cnn"
    path = write("plugin.safetensors", metadata={**meta, METADATA_KEY: json.dumps(sealed.seal(plugin))})
    with pytest.raises(ConfigError, match="trust_plugin=True"):
        load_model(path)
    x = torch.zeros(1, 3, 16, 16)
    assert torch.equal(load_model(path, trust_plugin=True)(x), load_model(str(src))(x))


# --------------------------------------------------------------------------------------------- export


def test_export_writes_checked_torch_and_onnx_programs(run, tmp_path, capsys):
    import onnx
    from onnx.reference import ReferenceEvaluator

    out = tmp_path / "export"
    assert main(["export", str(run["run"]), "--out", str(out), "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert sorted(p.name for p in out.iterdir()) == ["model.onnx", "model.pt2", "preprocessing.json"]
    facts = json.loads((out / "preprocessing.json").read_text())
    assert facts["input"] == {"name": "image", "dtype": "uint8", "layout": "NCHW", "shape": ["batch", 3, 16, 16],
                              "mode": "RGB", "range": [0, 255]}
    assert facts["normalize"] == {"mean": MEAN, "std": STD} and facts["transform"] == TransformSpec(size=16).to_dict()
    assert facts["classes"] == CLASSES and facts["files"]["onnx"] == "model.onnx"
    for kind in ("torch_export", "onnx"):
        assert 0 <= r["checks"][kind]["max_abs_diff"] <= r["checks"][kind]["tolerance"]
    assert r["checks"]["onnx"]["runtime"] in ("onnxruntime", "onnx.reference")

    # read back here, on the cache's own uint8 pixels: the logits training's weights give on the normalized batch
    ref = reference(run)
    pixels = torch.from_numpy(cache_pixels(run["cache"], ref["ids"]))
    tol = tolerance(ref["module"], [ref["logits"]])
    program = torch.export.load(str(out / "model.pt2")).module()
    assert (program(pixels) - ref["logits"]).abs().max() <= tol
    assert (program(pixels[:1]) - ref["logits"][:1]).abs().max() <= tol  # another batch size: dynamic
    proto = onnx.load(str(out / "model.onnx"))
    assert proto.graph.input[0].type.tensor_type.shape.dim[0].dim_param == "batch"
    got = ReferenceEvaluator(proto).run(None, {"image": pixels.numpy()})[0]
    assert np.abs(got - ref["logits"].numpy()).max() <= tol


class _Branchy(torch.nn.Module):
    """Data-dependent Python control flow: torch.export cannot trace it."""

    def forward(self, x):
        return x.mean((2, 3))[:, :1].repeat(1, 4) if x.mean() > 0 else x.sum((2, 3))[:, :1].repeat(1, 4)


def test_export_names_the_step_a_model_fails_and_writes_nothing(run, tmp_path):
    good = load_model(str(run["run"]))
    bad = TrainedModel(_Branchy(), good.metadata, good.preprocess, good.source)
    with pytest.raises(ExportError, match=r"failed at torch\.export \(trace\).*traceable"):
        export_model(bad, str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def test_synthetic_fp64_model_keeps_its_dtype_and_asks_for_a_transform(tmp_path, capsys):
    cfg = load_config(None, ["data.source=synthetic", "data.size=16", "data.global_batch_size=16",
                             "data.synthetic_samples=32", "model.width=8", "model.depth=1", "model.groups=4",
                             "run.max_steps=1", "run.eval_every=0", "run.log_every=0", "run.precision=fp64",
                             f"run.dir={tmp_path / 'run'}", "run.health_check=false"])
    train(cfg, local=True, quiet=True)
    model = load_model(str(tmp_path / "run"))
    assert model.input_dtype == torch.float64 and model.metadata.transform is None
    image = tmp_path / "x.png"
    image.write_bytes(png_bytes(shape_image(0, 20, 20)[0]))
    with pytest.raises(ConfigError, match="transform=TransformSpec"):
        model.preprocess(str(image))
    assert main(["predict", str(tmp_path / "run"), str(image)]) == 2  # one error for the run, not one per file
    assert "records no image transform" in capsys.readouterr().err
    chosen = load_model(str(tmp_path / "run"), transform=TransformSpec(size=16, resize="stretch"))
    (p,) = chosen.predict([str(image)], top_k=4)
    assert sorted(p.labels) == sorted(chosen.classes) and sum(p.probabilities) == pytest.approx(1.0, abs=1e-12)
    r = export_model(chosen, str(tmp_path / "export"), onnx=False)
    assert r["files"] == {"torch_export": "model.pt2", "onnx": None}
    assert r["checks"]["torch_export"]["tolerance"] < 1e-12  # float64 all through


# -------------------------------------------------------------------------------------------- predict


def test_predict_files_and_a_folder_with_broken_files(run, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "new" / "a").mkdir(parents=True)
    files = sorted(p for p in run["images"].rglob("*") if p.suffix in (".png", ".jpg") and p.name != "cut.png")[:5]
    names = []
    for i, f in enumerate(files):  # every other one a folder down; one suffix in capitals
        names.append(f"new/{'a/' if i % 2 else ''}img{i}{f.suffix.upper() if i == 1 else f.suffix}")
        shutil.copy(f, names[-1])
    Path("new/a/broken.png").write_bytes(png_bytes(shape_image(7, 20, 20)[0])[:150])  # cut short
    Path("new/notes.txt").write_text("not an image")  # no image suffix: not listed
    Path("new/.hidden.png").write_bytes(b"x")  # hidden: not listed
    shutil.copy(files[0], "single.jpg")
    assert main(["predict", str(run["run"]), "new", "single.jpg", "missing.png", "--top-k", "2", "--out", "p.csv",
                 "--batch-size", "3"]) == 0
    summary = capsys.readouterr().out
    assert "predicted 6 of 8 images" in summary and "truncated: 1" in summary and "unreadable: 1" in summary
    rows = list(csv.DictReader(open("p.csv")))
    # a folder's files in sorted order, every path as the user would type it
    assert [r["path"] for r in rows] == sorted(names + ["new/a/broken.png"]) + ["single.jpg", "missing.png"]
    assert list(rows[0]) == ["path", "label_1", "probability_1", "label_2", "probability_2", "error"]
    broken, missing = rows[0], rows[-1]
    assert broken["error"].startswith("truncated") and broken["label_1"] == ""
    assert missing["error"].startswith("unreadable") and "missing.png" in missing["error"]
    # the CSV's classes and probabilities are the model's own (floats written in full); batches of 3 around the
    # broken files: another batch composition, so within the tolerance (halved: see the fresh-process test)
    model = load_model(str(run["run"]))
    good = [r for r in rows if not r["error"]]
    with torch.no_grad():
        logits = model(model.preprocess.batch([r["path"] for r in good]))
    top = torch.softmax(logits, 1).topk(2)
    assert [(r["label_1"], r["label_2"]) for r in good] == [tuple(CLASSES[j] for j in i) for i in top.indices]
    got = np.array([[float(r["probability_1"]), float(r["probability_2"])] for r in good])
    assert np.abs(got - top.values.numpy()).max() <= tolerance(model.module, [logits]) / 2 + 1e-7

    # a folder on any fsspec location: its URIs as the listing gives them under the folder as typed
    memory = fsspec.filesystem("memory")
    for i, name in enumerate(names[:3]):
        memory.pipe(f"/serve-test/{'sub/' if i % 2 else ''}{Path(name).name}", Path(name).read_bytes())
    assert main(["predict", str(run["run"]), "memory://serve-test/", "--out", "m.csv"]) == 0
    assert [r["path"] for r in csv.DictReader(open("m.csv"))] == sorted(
        f"memory://serve-test/{'sub/' if i % 2 else ''}{Path(n).name}" for i, n in enumerate(names[:3]))
    memory.rm("/serve-test", recursive=True)
    capsys.readouterr()

    # no --out: the CSV on standard output, the summary on standard error
    assert main(["predict", str(run["run"]), "single.jpg", "--top-k", "1"]) == 0
    out, err = capsys.readouterr()
    assert out.splitlines()[0] == "path,label_1,probability_1,error" and out.splitlines()[1].startswith("single.jpg,")
    assert "predicted 1 of 1 images" in err
    assert main(["predict", str(run["run"]), "single.jpg", "--top-k", "0"]) == 2
    assert "--top-k 0 must be at least 1" in capsys.readouterr().err
    assert main(["predict", str(run["run"]), "single.jpg", "--where", "split = 'val'"]) == 2
    assert "--where filters a metadata table" in capsys.readouterr().err


def test_predict_a_table_writes_parquet_beside_its_rows(run, tmp_path, capsys):
    ref = reference(run)
    out = tmp_path / "preds.parquet"
    assert main(["predict", str(run["run"]), run["table"], "--where", "split = 'val' OR error IS NOT NULL",
                 "--top-k", "3", "--out", str(out)]) == 0
    assert "errors: truncated: 1" in capsys.readouterr().out
    t = pq.read_table(out)
    assert t.schema.names == ["sample_id", "uri", "label", "split", "prediction", "probability", "top_labels",
                              "top_probs", "error"]
    rows = {r["sample_id"]: r for r in t.to_pylist()}
    assert set(rows) == set(ref["ids"]) | {s for s, r in ref["rows"].items() if r["error"]}
    for s, r in rows.items():
        assert (r["uri"], r["label"], r["split"]) == tuple(ref["rows"][s][k] for k in ("uri", "label", "split"))
    (cut,) = [r for r in rows.values() if r["error"]]
    assert cut["uri"].endswith("cut.png") and cut["error"].startswith("truncated") and cut["top_labels"] is None
    # the predictions are the trained weights' on the cache's pixels
    probs = torch.softmax(ref["logits"], 1)
    tol = tolerance(ref["module"], [ref["logits"]]) / 2 + 1e-7  # Daft's batches: see the fresh-process test
    for i, s in enumerate(ref["ids"]):
        p, idx = probs[i].topk(3)
        assert rows[s]["top_labels"] == [CLASSES[j] for j in idx]
        assert np.abs(np.array(rows[s]["top_probs"]) - p.numpy()).max() <= tol
        assert (rows[s]["prediction"], rows[s]["probability"]) == (rows[s]["top_labels"][0], rows[s]["top_probs"][0])
    assert main(["predict", str(run["run"]), run["table"]]) == 2
    assert "pass --out FILE.parquet" in capsys.readouterr().err
    assert main(["predict", str(run["run"]), run["table"], "--where", "split = = 1", "--out", str(out)]) == 2
    assert "is not a valid filter" in capsys.readouterr().err
    assert main(["predict", str(run["run"]), run["table"], "new.png", "--out", str(out)]) == 2
    assert "one table at a time" in capsys.readouterr().err
    # a file whose name is not UTF-8 text is read by its exact bytes (``uri_bytes``), as its text-named copy is
    data = Path(ref["rows"][ref["ids"][0]]["uri"]).read_bytes()
    names = Path(tmp_path / "names" / "star")
    names.mkdir(parents=True)
    for name in (b"caf\xe9.png", b"cafe.png"):
        (names / os.fsdecode(name)).write_bytes(data)
    ingest(str(tmp_path / "names"), str(tmp_path / "names_table"), progress_every=0)
    assert main(["predict", str(run["run"]), str(tmp_path / "names_table"), "--out", str(out)]) == 0
    a, b = sorted(pq.read_table(out).to_pylist(), key=lambda r: r["uri"])  # ("\\" sorts before "e")
    assert a["uri"].endswith("/caf\\xe9.png") and a["error"] is None and b["error"] is None
    assert (a["top_labels"], a["top_probs"]) == (b["top_labels"], b["top_probs"])
