"""``dutycycle predict RUN INPUT...``: the top-k classes of images, with the decode and transform the cache used.

Inputs are image files, folders (searched recursively for files with an image suffix, in sorted order) or one
metadata table (a folder holding ``_manifest.json``, optionally filtered with ``--where``):

- files and folders -> CSV, one row per file: ``path`` (as given, or the folder as given joined with the file's
  path below it), ``label_1, probability_1, ..., label_k, probability_k``, ``error``.
- a table -> Parquet, one row per table row: the table's ``sample_id``, ``uri``, ``label`` and ``split`` beside
  ``prediction`` and ``probability`` (the top class), ``top_labels`` and ``top_probs`` (lists, most probable
  first) and ``error``. The inference runs as a Daft query (a class UDF that loads the model once per worker and
  classifies a batch per call), so ``--runner ray`` spreads it over a Ray cluster; only the prediction columns come
  back to write the file. Rows outside the table's source roots are refused unread (``engine.roots``).

A file that cannot be read or decoded gets a row with its error (whose text starts with the reason ingest uses:
``corrupt``, ``not an image``, ``truncated``, ...) and is counted; it never stops the run. Outputs are written
whole (atomic) or not at all. Decoding runs on a thread pool (PIL releases the GIL), a batch ahead of the model.
"""

from __future__ import annotations

import csv
import io as _io
import os
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
from dutycycle.engine import io
from dutycycle.engine.errors import ConfigError, DecodeError, SourceError
from dutycycle.engine.imageinfo import UNREADABLE, describe_error, error_reason
from dutycycle.engine.roots import OUTSIDE_ROOTS, RootCheck, refusal, table_roots
from dutycycle.engine.table import format as tf
from dutycycle.engine.table.table import open_table
from dutycycle.trainer.step.modelfile import read_metadata

from .load import TrainedModel, load_model, model_file

# the suffixes of the formats the safe open decodes (limits.ALLOWED_FORMATS), matched without regard to case
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".jpe", ".jfif", ".png", ".webp", ".gif", ".bmp", ".dib", ".tif", ".tiff")
DEFAULT_BATCH = 64  # images per forward pass (`dutycycle predict --batch-size`)
DECODE_THREADS = min(8, os.cpu_count() or 1)


@dataclass
class Row:
    """One input's outcome: its top-k classes, or the error that kept it from being classified."""

    path: str
    labels: tuple[str, ...] = ()
    probabilities: tuple[float, ...] = ()
    error: str | None = None


# ----------------------------------------------------------------------------------------------- inputs


def is_table(uri: str) -> bool:
    """Whether ``uri`` is a metadata table (a folder with a committed ``_manifest.json``)."""
    try:
        return io.exists(io.join(uri, tf.MANIFEST))
    except (OSError, ValueError):
        return False


def expand_inputs(inputs: list[str]) -> list[str]:
    """Files as given; each folder replaced by the image files below it (sorted, hidden entries left out). A
    path that does not exist stays: its row will say so."""
    out: list[str] = []
    for given in inputs:
        fs, path = io.filesystem(given)
        if not fs.isdir(path):
            out.append(given)
            continue
        found = _images_under(given, fs, path)
        if not found:
            print(f"dutycycle predict: no image files under {given!r} (suffixes: {' '.join(IMAGE_SUFFIXES)})",
                  file=sys.stderr)
        out += found
    return out


def _images_under(given: str, fs, path: str) -> list[str]:
    def wanted(name: str) -> bool:
        return not name.startswith(".") and name.lower().endswith(IMAGE_SUFFIXES)

    if io.protocol(given) == "file":  # relative paths stay relative: printed as the user would type them
        found = []
        for folder, dirs, names in os.walk(given):  # symlinked folders are not followed (os.walk's default)
            dirs[:] = [d for d in dirs if not d.startswith(".")]
            found += [os.path.join(folder, n) for n in names if wanted(n)]
        return sorted(found)
    root = given.rstrip("/")
    prefix = path.rstrip("/") + "/"
    return sorted(f"{root}/{p[len(prefix):]}" for p in fs.find(path) if p.startswith(prefix)
                  and not any(part.startswith(".") for part in p[len(prefix):].split("/")) and wanted(p))


# ------------------------------------------------------------------------------------------- classifying


def _decode(model: TrainedModel, path: str, roots: RootCheck | None) -> np.ndarray | str:
    """The sample's pixels, or the error text for its row (never raises for a bad file)."""
    if roots is not None and roots.outside(path):
        return refusal(path, roots.roots)
    try:
        return model.preprocess.pixels(path)
    except DecodeError as e:
        return str(e)
    except Exception as e:  # noqa: BLE001 - any decoder failure is this file's error, not the run's
        return f"{UNREADABLE}: {type(e).__name__}: {describe_error(e)}"


def classify(model: TrainedModel, paths: list[str], top_k: int, batch_size: int = DEFAULT_BATCH,
             roots: RootCheck | None = None, threads: int = DECODE_THREADS) -> Iterator[Row]:
    """One ``Row`` per path, in order. Decoding runs on ``threads`` threads, one batch ahead of the model."""
    if batch_size < 1:
        raise ConfigError(f"--batch-size {batch_size} must be at least 1")
    model.preprocess.require_spec()  # a model with no usable transform is one error, not one per file
    chunks = [paths[i:i + batch_size] for i in range(0, len(paths), batch_size)]
    with ThreadPoolExecutor(max(1, threads), thread_name_prefix="dutycycle-predict") as pool:
        pending = [pool.submit(_decode, model, p, roots) for p in chunks[0]] if chunks else []
        for n, chunk in enumerate(chunks):
            decoded = [f.result() for f in pending]
            if n + 1 < len(chunks):
                pending = [pool.submit(_decode, model, p, roots) for p in chunks[n + 1]]
            good = [i for i, d in enumerate(decoded) if not isinstance(d, str)]
            preds = model.top_k(model.preprocess.normalize_pixels(np.stack([decoded[i] for i in good])), top_k) \
                if good else []
            by_index = dict(zip(good, preds, strict=True))
            for i, path in enumerate(chunk):
                p = by_index.get(i)
                yield Row(path, p.labels, p.probabilities) if p else Row(path, error=decoded[i])


def error_counts(errors) -> dict[str, int]:
    return dict(sorted(Counter(error_reason(e) for e in errors if e is not None).items()))


# ------------------------------------------------------------------------------------------------ files


def predict_files(run: str, inputs: list[str], *, top_k: int = 5, out: str | None = None,
                  batch_size: int = DEFAULT_BATCH, trust_plugin: bool = False, model: TrainedModel | None = None
                  ) -> dict:
    """Classify image files and folders; write the CSV to ``out`` (None: standard output). Returns a summary."""
    t0 = time.perf_counter()
    model = model or load_model(run, trust_plugin=trust_plugin)
    paths = expand_inputs(inputs)
    if not paths:
        raise SourceError(f"no image files in {', '.join(map(repr, inputs))}; pass image files or folders holding "
                          f"them ({' '.join(IMAGE_SUFFIXES)})")
    rows = list(classify(model, paths, top_k, batch_size))
    k = min(top_k, len(model.classes))
    text = to_csv(rows, k)
    if out:
        io.write_bytes_atomic(out, text.encode("utf-8"))
    else:
        sys.stdout.write(text)
        sys.stdout.flush()
    return {"inputs": len(rows), "predicted": sum(r.error is None for r in rows),
            "errors": error_counts(r.error for r in rows), "top_k": k, "out": out,
            "seconds": round(time.perf_counter() - t0, 3)}


def to_csv(rows: list[Row], k: int) -> str:
    buf = _io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(["path", *[f"{name}_{i}" for i in range(1, k + 1) for name in ("label", "probability")], "error"])
    for r in rows:
        cells = [v for pair in zip(r.labels, r.probabilities, strict=True) for v in (pair[0], repr(pair[1]))]
        w.writerow([r.path, *cells, *[""] * (2 * k - len(cells)), r.error or ""])
    return buf.getvalue()


# ------------------------------------------------------------------------------------------------ table


def predict_table(run: str, table: str, out: str, *, where: str | None = None, top_k: int = 5,
                  batch_size: int = DEFAULT_BATCH, trust_plugin: bool = False, allowed_roots: list[str] | None = None,
                  runner: str | None = None, ray_address: str | None = None) -> dict:
    """Classify a metadata table's rows (those ``where`` keeps) as a Daft query; write ``out`` as Parquet."""
    import daft
    import pyarrow.parquet as pq

    t0 = time.perf_counter()
    if not out:
        raise ConfigError("predicting a table writes Parquet: pass --out FILE.parquet")
    model = shared_model(run, trust_plugin)  # here first: a bad model fails before the query starts
    k = min(top_k, len(model.classes))
    t = open_table(table, runner=runner, ray_address=ray_address)
    df = t.df
    if where:
        try:
            df = df.where(daft.sql_expr(where))
            df.limit(1).collect()  # a bad expression surfaces here, as one line
        except Exception as e:
            if isinstance(e, (ConfigError, OSError)):  # storage errors are not a bad filter
                raise
            raise ConfigError(f"--where {where!r} is not a valid filter ({str(e).splitlines()[0]}); write SQL over "
                              "the table's columns, e.g. \"split = 'test'\"") from e
    roots = table_roots(t.manifest, allowed_roots)
    udf = _predictor(run, k, batch_size, trust_plugin, roots)
    predicted = udf(daft.col("uri"), daft.col("uri_bytes")).alias("p")
    result = df.select("sample_id", "uri", "label", "split", predicted).select(
        "sample_id", "uri", "label", "split", daft.col("p").unnest()).to_arrow()
    schema = output_schema()
    arrow = pa.Table.from_arrays([result.column(f.name).cast(f.type) for f in schema], schema=schema)
    buf = pa.BufferOutputStream()
    pq.write_table(arrow, buf)
    io.write_bytes_atomic(out, buf.getvalue().to_pybytes())
    errors = arrow.column("error").to_pylist()
    return {"inputs": arrow.num_rows, "predicted": sum(e is None for e in errors), "errors": error_counts(errors),
            "outside_roots": sum(1 for e in errors if e and e.startswith(OUTSIDE_ROOTS)), "top_k": k, "out": out,
            "table": table, "table_version": t.manifest.version, "seconds": round(time.perf_counter() - t0, 3)}


def output_schema() -> pa.Schema:
    """The columns of a table's predictions."""
    return pa.schema([("sample_id", pa.string()), ("uri", pa.string()), ("label", pa.string()),
                      ("split", pa.string()), ("prediction", pa.string()), ("probability", pa.float64()),
                      ("top_labels", pa.list_(pa.string())), ("top_probs", pa.list_(pa.float64())),
                      ("error", pa.string())])


_models: dict[tuple[str, bool], TrainedModel] = {}
_models_lock = threading.Lock()


def shared_model(run: str, trust_plugin: bool) -> TrainedModel:
    """``load_model(run)`` once per process: the driver and every UDF instance in it use one copy (inference
    only reads the weights, so threads may share it). A model file rewritten since (another run into the same
    directory) has other weights, so it is loaded again: the weights' sha256 is read from its header each time."""
    uri = model_file(run)
    sha = read_metadata(uri).weights["sha256"]
    with _models_lock:
        model = _models.get((uri, trust_plugin))
        if model is None or model.metadata.weights["sha256"] != sha:
            model = _models[(uri, trust_plugin)] = load_model(uri, trust_plugin=trust_plugin)
        return model


def _predictor(run: str, k: int, batch_size: int, trust_plugin: bool, roots: list[str]):
    """A Daft class UDF: the model loaded once per worker, each call a batch of rows (uri, uri_bytes) ->
    prediction structs."""
    import daft

    fields = output_schema()
    struct = pa.struct([fields.field(n) for n in ("prediction", "probability", "top_labels", "top_probs", "error")])

    # in the worker's own process (a process pool would start Python, torch and the model again per query); its
    # instances, one per Daft thread, share the process's one copy of the model
    @daft.cls(use_process=False)
    class Predictor:
        def __init__(self):
            self.model = shared_model(run, trust_plugin)
            self.roots = RootCheck(roots)

        @daft.method.batch(return_dtype=daft.DataType.from_arrow_type(struct), batch_size=batch_size)
        def __call__(self, uris, uri_bytes):
            # a name that is not text is opened by its exact bytes (``uri`` is its readable form)
            paths = [io.open_path(u, b) for u, b in zip(uris.to_pylist(), uri_bytes.to_pylist(), strict=True)]
            rows = classify(self.model, paths, k, batch_size, self.roots)
            return pa.array([{"prediction": r.labels[0] if r.labels else None,
                              "probability": r.probabilities[0] if r.labels else None,
                              "top_labels": list(r.labels) if r.error is None else None,
                              "top_probs": list(r.probabilities) if r.error is None else None,
                              "error": r.error} for r in rows], type=struct)

    return Predictor()
