"""The embedded default dataset: deterministic, varied, learnable shapes on any fsspec location."""

from __future__ import annotations

import hashlib
import io
import os

import numpy as np
import pytest
from dutycycle.engine.errors import ConfigError
from dutycycle.engine.synth import (
    CLASSES,
    MAX_SIDE,
    MIN_SIDE,
    PARALLEL_THRESHOLD,
    draw_shapes,
    render,
    synthesize,
)
from dutycycle.trainer.app.cli import main
from PIL import Image


def _digest(root) -> dict[str, str]:
    out = {}
    for dirpath, _, files in os.walk(root):
        for f in files:
            p = os.path.join(dirpath, f)
            out[os.path.relpath(p, root)] = hashlib.sha256(open(p, "rb").read()).hexdigest()
    return out


def test_same_seed_same_bytes_other_seed_differs(tmp_path):
    synthesize(str(tmp_path / "a"), 24, seed=7)
    synthesize(str(tmp_path / "b"), 24, seed=7)
    synthesize(str(tmp_path / "c"), 24, seed=8)
    a, b, c = (_digest(tmp_path / x) for x in "abc")
    assert len(a) == 24 and a == b
    assert a != c


def test_worker_processes_do_not_change_the_output(tmp_path):
    n = PARALLEL_THRESHOLD
    synthesize(str(tmp_path / "serial"), n, seed=3, workers=1)
    synthesize(str(tmp_path / "parallel"), n, seed=3, workers=2)
    assert _digest(tmp_path / "serial") == _digest(tmp_path / "parallel")


def test_draw_shapes_is_a_pure_function_of_seed_and_index():
    images, labels = draw_shapes(8, 16, seed=4)
    assert images.shape == (8, 16, 16, 3) and images.dtype == np.uint8
    assert labels.tolist() == [i % len(CLASSES) for i in range(8)]
    tail, tail_labels = draw_shapes(3, 16, seed=4, start=5)  # any slice of the dataset, drawn on its own
    assert np.array_equal(tail, images[5:]) and np.array_equal(tail_labels, labels[5:])
    assert not np.array_equal(draw_shapes(8, 16, seed=5)[0], images)
    assert draw_shapes(2, (12, 20), seed=4)[0].shape == (2, 12, 20, 3)  # (height, width)


def test_files_hold_the_drawn_shapes():
    """The file writer encodes the array generator's pixels: a PNG holds them exactly."""
    index = next(i for i in range(100) if render(9, i)[1].lower().endswith(".png"))
    label, _, data = render(9, index)
    pixels = np.asarray(Image.open(io.BytesIO(data)))
    expected, labels = draw_shapes(1, pixels.shape[0], seed=9, start=index)
    assert np.array_equal(pixels, expected[0]) and label == CLASSES[labels[0]]


def test_classes_formats_and_sizes(tmp_path):
    s = synthesize(str(tmp_path), 200, seed=1)
    assert sorted(os.listdir(tmp_path)) == sorted(CLASSES)
    assert s["classes"] == dict.fromkeys(CLASSES, 50)
    exts = {}
    for c in CLASSES:
        for f in os.listdir(tmp_path / c):
            ext = f.rsplit(".", 1)[1]
            exts[ext] = exts.get(ext, 0) + 1
            with Image.open(tmp_path / c / f) as im:
                assert {"jpg": "JPEG", "png": "PNG", "webp": "WEBP"}[ext.lower()] == im.format
                assert MIN_SIDE <= im.width <= MAX_SIDE and im.width == im.height
    lower = {}
    for e, k in exts.items():
        lower[e.lower()] = lower.get(e.lower(), 0) + k
    assert lower["jpg"] > lower["png"] > 0 and lower["webp"] > 0  # mostly JPEG, some PNG and WebP
    assert any(e.isupper() for e in exts)  # some upper-case extensions
    assert s["formats"] == lower


def test_shapes_contrast_with_background_and_are_large(tmp_path):
    """What makes the classes learnable: two luminance clusters far apart, the shape a sizeable part."""
    synthesize(str(tmp_path), 40, seed=5)
    for c in CLASSES:
        for f in os.listdir(tmp_path / c):
            lum = np.asarray(Image.open(tmp_path / c / f).convert("L"), dtype=np.float64)
            dark, light = lum[lum < 128], lum[lum >= 128]
            assert light.mean() - dark.mean() > 100, f
            border = np.concatenate([lum[0], lum[-1], lum[:, 0], lum[:, -1]])
            bg_is_light = np.median(border) >= 128
            shape_fraction = (dark.size if bg_is_light else light.size) / lum.size
            assert 0.04 < shape_fraction < 0.7, (f, shape_fraction)


def test_broken_fraction_writes_unreadable_files(tmp_path):
    s = synthesize(str(tmp_path), 40, seed=2, broken_fraction=0.25)
    assert s["broken"] == 10 and sum(s["broken_kinds"].values()) == 10
    bad = 0
    for c in CLASSES:
        for f in os.listdir(tmp_path / c):
            try:
                with Image.open(tmp_path / c / f) as im:
                    im.load()
            except Exception:
                bad += 1
    assert bad == 10


def test_writes_to_memory_filesystem():
    import fsspec

    s = synthesize("memory://synth-test/out", 8, seed=0)
    fs = fsspec.filesystem("memory")
    files = fs.find("/synth-test/out")
    assert len(files) == 8 == s["n"]
    with fs.open(files[0], "rb") as f:
        Image.open(io.BytesIO(f.read())).load()


def test_cli_synth_and_bad_arguments(tmp_path, capsys):
    assert main(["synth", str(tmp_path / "out"), "--n", "8", "--seed", "1"]) == 0
    assert "wrote 8 images" in capsys.readouterr().out
    assert main(["synth", str(tmp_path / "out2"), "--n", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--n 0" in err and len(err.splitlines()) == 1
    with pytest.raises(ConfigError, match="broken-fraction"):
        synthesize(str(tmp_path / "x"), 4, broken_fraction=1.5)
    blocker = tmp_path / "file.txt"
    blocker.write_text("x")
    assert main(["synth", str(blocker / "out"), "--n", "4"]) == 2
    assert "file.txt" in capsys.readouterr().err
