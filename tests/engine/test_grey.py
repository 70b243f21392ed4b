"""Grayscale caches and the dataset's statistics: ``TransformSpec(mode="L")`` from real grey and colour files,
materialized end to end (Python API and ``dutycycle materialize --mode L``), and the manifest's exact per-channel
mean and standard deviation of the training split against numpy over the decoded cache."""

from __future__ import annotations

import base64
import io as _io
import json
from dataclasses import replace
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
from dutycycle.engine import io, sealed
from dutycycle.engine.cache import format as cf
from dutycycle.engine.cache.materialize import materialize, open_cache
from dutycycle.engine.cache.view import view
from dutycycle.engine.errors import CorruptArtifactError
from dutycycle.engine.inspect import contact_sheet
from dutycycle.engine.table.catalog import ingest
from dutycycle.engine.table.table import open_table, read_arrow
from dutycycle.engine.transform import TransformSpec, decode_and_transform
from dutycycle.loader import CacheLoader, LoaderConfig
from PIL import Image

from ..support.tablemaker import photo_image


def png(img: Image.Image) -> bytes:
    buf = _io.BytesIO()
    img.save(buf, "PNG")
    return buf.getvalue()


def grey_images(rng: np.random.Generator, w: int, h: int) -> dict[str, Image.Image]:
    """One image per source kind a grey cache meets: 8-bit, 16-bit and bilevel grey, grey with alpha, colour,
    colour with alpha, a palette."""
    photo = photo_image(rng, w, h)
    grey = photo.convert("L")
    wide = Image.fromarray((np.asarray(grey, np.uint16) * 257).astype(np.uint16))  # I;16, the full 16-bit range
    alpha = Image.fromarray(rng.integers(0, 256, (h, w), dtype=np.uint8), "L")
    la = grey.copy()
    la.putalpha(alpha)
    rgba = photo.copy()
    rgba.putalpha(alpha)
    return {"L": grey, "I16": wide, "1": grey.point(lambda v: 255 if v > 128 else 0).convert("1"), "LA": la,
            "RGB": photo, "RGBA": rgba, "P": photo.convert("P", palette=Image.Palette.ADAPTIVE, colors=16)}


def test_grey_mode_converts_each_source_kind_as_pil_does():
    rng = np.random.default_rng(0)
    images = grey_images(rng, 40, 24)
    assert images["I16"].mode.startswith("I;16") and images["LA"].mode == "LA" and images["1"].mode == "1"
    stretch = TransformSpec(size=12, resize="stretch", mode="L")
    for kind, img in images.items():
        out = decode_and_transform(png(img), stretch)
        assert out.shape == (12, 12, 1) == stretch.shape and out.dtype == np.uint8, kind
        # the same file as RGB: grey sources stay grey there too (R = G = B), with the very pixels of L
        rgb = decode_and_transform(png(img), replace(stretch, mode="RGB"))
        if kind in ("L", "I16", "1", "LA"):
            assert (rgb == out).all(), kind
    # colour: PIL's luma of the resized RGB image
    ref = images["RGB"].resize((12, 12), Image.BILINEAR).convert("L")
    assert np.array_equal(decode_and_transform(png(images["RGB"]), stretch)[..., 0], np.asarray(ref))
    # grey: resized as grey, nothing else
    ref = images["L"].resize((12, 12), Image.BILINEAR)
    assert np.array_equal(decode_and_transform(png(images["L"]), stretch)[..., 0], np.asarray(ref))
    # alpha composited over the background first (white here), then luma
    white = Image.alpha_composite(Image.new("RGBA", images["RGBA"].size, (255, 255, 255, 255)), images["RGBA"])
    ref = white.convert("RGB").resize((12, 12), Image.BILINEAR).convert("L")
    got = decode_and_transform(png(images["RGBA"]), replace(stretch, background="white"))
    assert np.array_equal(got[..., 0], np.asarray(ref))
    # pad letterboxes a 40x24 image on a grey canvas of the background's value; CHW is the same pixels
    pad = decode_and_transform(png(images["RGB"]), TransformSpec(size=20, resize="pad", mode="L", background="white"))
    assert pad.shape == (20, 20, 1) and (pad[:3] == 255).all() and (pad[-3:] == 255).all() and pad[8:12].std() > 5
    chw = decode_and_transform(png(images["RGB"]), TransformSpec(size=20, resize="pad", mode="L", background="white",
                                                                 layout="CHW"))
    assert chw.shape == (1, 20, 20) and np.array_equal(chw[0], pad[..., 0])
    crop = decode_and_transform(png(images["P"]), TransformSpec(size=16, mode="L"))
    assert crop.shape == (16, 16, 1) and crop.std() > 5
    # the mode is part of the spec's JSON, and so of every cache fingerprint
    assert TransformSpec(mode="L").to_json() != TransformSpec().to_json()
    assert TransformSpec(mode="L").sample_bytes * 3 == TransformSpec().sample_bytes


def write_source(root: Path) -> None:
    """A small collection in split folders: grey and colour files of every kind, in two classes."""
    rng = np.random.default_rng(1)
    for i in range(4):
        for kind, img in grey_images(rng, int(rng.integers(16, 30)), int(rng.integers(16, 30))).items():
            split = "val" if i == 3 else "train"
            path = root / split / ("cat" if (i + len(kind)) % 2 else "dog") / f"{kind}-{i}.png"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(png(img))


def all_pixels(reader):
    """Every sample of a cache with its split, in cache order."""
    images = np.concatenate([reader.images(i) for i in range(reader.num_shards)])
    splits = np.concatenate([reader.column(i, "split") for i in range(reader.num_shards)])
    uris = {r["sample_id"]: r["uri"] for r in read_arrow(reader.manifest.source).to_pylist()}
    ids = np.concatenate([reader.column(i, "sample_id") for i in range(reader.num_shards)])
    return images, splits, [uris[s] for s in ids]


def check_stats(reader, split: str) -> None:
    """The manifest's statistics against numpy over the decoded cache: the integer sums exactly, the float
    results to within a few ulps."""
    m = reader.manifest
    images, splits, _ = all_pixels(reader)
    chosen = images[splits == split] if split != "all" else images
    c = m.channels
    px = (chosen.reshape(-1, c) if m.layout == "HWC" else chosen.transpose(0, 2, 3, 1).reshape(-1, c))
    cs = m.channel_stats
    assert cs["split"] == split and cs["samples"] == len(chosen) and len(cs["mean"]) == len(cs["std"]) == c
    # numpy in float64: pairwise sums of up to ~10^5 values in [0, 1] carry a relative error of about
    # log2(n) * 2^-53 ~ 2e-15, and the standard deviation's subtraction of two such sums a few times more; the
    # manifest's values are exact rationals rounded once. 1e-12 is far above the first and far below any real
    # difference (one pixel changed by one level moves a mean by more than 1e-7 here).
    x = px.astype(np.float64) / 255.0
    np.testing.assert_allclose(cs["mean"], x.mean(0), rtol=0, atol=1e-12)
    np.testing.assert_allclose(cs["std"], x.std(0), rtol=0, atol=1e-12)
    # and exactly: the integer sums give the same mean when divided in rationals
    s = px.astype(np.int64).sum(0)
    assert cs["mean"] == [float(Fraction(int(v), 255 * len(px))) for v in s]


@pytest.fixture(scope="module")
def grey_table(tmp_path_factory):
    """The collection above, ingested: a table of 28 grey and colour PNGs (21 train, 7 val)."""
    root = tmp_path_factory.mktemp("grey")
    write_source(root / "src")
    summary = ingest(str(root / "src"), str(root / "table"), progress_every=0)
    assert summary["splits"] == {"train": 21, "val": 7} and summary["split_assignment"]["by"] == "folders"
    return str(root / "table")


def test_grey_cache_end_to_end_with_exact_statistics(grey_table, tmp_path, capsys):
    table = grey_table

    spec = TransformSpec(size=10, mode="L")
    grey = materialize(table, str(tmp_path / "cache"), spec, rows_per_shard=5)  # 6 shards, split across them
    m = grey.manifest
    assert m.shape == [10, 10, 1] and m.channels == 1 and m.spec["mode"] == "L" and len(m.shards) == 6
    assert m.split_counts == {"train": 21, "val": 7} and grey.summary()["channel_stats"] == m.channel_stats
    reader = open_cache(grey.uri)
    images, _, uris = all_pixels(reader)
    for img, uri in zip(images, uris, strict=True):  # every cached sample is the transform of its file, exactly
        assert np.array_equal(img, decode_and_transform(Path(uri).read_bytes(), spec))
    check_stats(reader, "train")
    # integer sums per shard, added: the same figures bit for bit whatever the shard size
    resharded = materialize(table, str(tmp_path / "other"), spec, rows_per_shard=3)
    assert len(resharded.manifest.shards) == 10 and resharded.manifest.channel_stats == m.channel_stats

    # RGB of the same table: another fingerprint, three channels, its own statistics
    rgb = materialize(table, str(tmp_path / "cache"), TransformSpec(size=10, layout="CHW"), rows_per_shard=4)
    assert rgb.manifest.fingerprint != m.fingerprint and rgb.manifest.shape == [3, 10, 10]
    check_stats(open_cache(rgb.uri), "train")
    assert len(set(rgb.manifest.channel_stats["mean"])) == 3  # colour: each channel its own statistics
    # no train split in the cache: the statistics cover every row, and say so
    val = materialize(table, str(tmp_path / "cache"), spec, where="split = 'val'")
    check_stats(open_cache(val.uri), "all")

    # the command line: --mode L is the same cache (reused), and the statistics are printed
    from dutycycle.trainer.app.cli import main

    assert main(["materialize", table, str(tmp_path / "cache"), "--size", "10", "--mode", "L",
                 "--rows-per-shard", "5", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert f"cache:   {grey.uri}" in out and "reused:  yes" in out
    assert f"pixels:  mean [{m.channel_stats['mean'][0]:.4f}]" in out and "(0..1, train split, 21 samples)" in out

    # the cache view shows grey as grey and reports the exact statistics
    v = view(grey.uri)
    thumbs = v.thumbnails(4, split="train")
    assert thumbs.images.shape[-1] == 1 and "data:image/png;base64," in thumbs._repr_html_()
    stats = v.stats()
    assert stats["channel_mean"] == [round(m.channel_stats["mean"][0], 4)]
    assert stats["channel_stats_from"].startswith("manifest: exact, train split")
    assert json.loads(json.dumps(stats))  # plain JSON for notebooks

    # the table's contact sheet previews every kind of grey file (16-bit, bilevel, with alpha) as grey
    sheet = contact_sheet(open_table(table), str(tmp_path / "sheet.html"), limit=50, size=32)
    assert len(sheet) == 28 and all(t.jpeg_b64 for t in sheet.thumbs)
    for t in sheet.thumbs:
        if t.meta["mode"] in ("L", "I;16", "1", "LA"):
            px = np.asarray(Image.open(_io.BytesIO(base64.b64decode(t.jpeg_b64))).convert("RGB"), np.int16)
            assert np.abs(px[..., 0] - px[..., 1]).max() <= 2 and px.std() > 5, t.meta["uri"]  # grey, not blank


def test_a_cache_without_statistics_still_reads_and_materialize_adds_them(grey_table, tmp_path):
    table = grey_table
    first = materialize(table, str(tmp_path / "cache"), TransformSpec(size=8, mode="L"), rows_per_shard=8)
    expected = first.manifest.channel_stats

    # the manifest as a dutycycle before this field wrote it: no key, sealed without it
    uri = io.join(first.uri, cf.MANIFEST)
    d = json.loads(Path(uri).read_text())
    old = sealed.seal({k: v for k, v in d.items() if k != "channel_stats"})
    Path(uri).write_text(json.dumps(old))
    assert cf.read_manifest(first.uri).channel_stats is None
    assert cf.read_manifest(first.uri).to_json() == old  # read and written back unchanged
    loader = CacheLoader(first.uri, "train", config=LoaderConfig(global_batch_size=4, mode="sync"))
    assert loader.config.augment.mean == (0.5,) and loader.config.augment.std == (0.5,)
    assert "written before dutycycle recorded them" in loader.normalize_from

    logged = []
    again = materialize(table, str(tmp_path / "cache"), TransformSpec(size=8, mode="L"), rows_per_shard=8,
                        log=logged.append)
    assert again.reused and again.manifest.channel_stats == expected == cf.read_manifest(first.uri).channel_stats
    assert any("computing them from its 28 samples once" in line for line in logged)

    # statistics that do not describe the cache are refused, even sealed
    bad = sealed.seal({**d, "channel_stats": {**expected, "mean": [0.1, 0.2, 0.3]}})
    Path(uri).write_text(json.dumps(bad))
    with pytest.raises(CorruptArtifactError, match="channel_stats.mean` has 3 values for 1 channels"):
        cf.read_manifest(first.uri)
