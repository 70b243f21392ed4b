"""The Daft side of materialization: fetch file bytes and run ``decode_and_transform`` in a batch UDF.

Imported only by ``engine.cache.materialize`` when it runs, so ``import dutycycle.engine`` stays free of Daft.
"""

from __future__ import annotations

import numpy as np

from .. import io
from ..transform import DecodeError, TransformSpec, decode_and_transform

# URI schemes Daft's own readers understand; others (memory://, ...) are read through fsspec in-process.
DAFT_SCHEMES = ("file", "s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "http", "https", "hf")
# Object stores are fetched by Daft's async downloader. Local files are read in the UDF: cheaper per file, and
# Daft's downloader pays a one-off start-up of several seconds per process (measured here: 8-10 s).
DAFT_DOWNLOAD_SCHEMES = tuple(s for s in DAFT_SCHEMES if s != "file")


def _fsspec_download_udf():
    """Bytes for local and memory:// URIs, read through fsspec in the worker (memory:// is per process)."""
    import daft

    @daft.func.batch(return_dtype=daft.DataType.binary())
    def fetch(uris: daft.Series):
        import pyarrow as pa

        out = []
        for uri in uris.to_pylist():
            try:
                fs, path = io.filesystem(uri)
                with fs.open(path, "rb") as f:
                    out.append(f.read())
            except (OSError, ValueError):
                out.append(None)
        return pa.array(out, pa.binary())

    return fetch


def _transform_udf(spec: TransformSpec, batch_size: int):
    """A Daft batch UDF: file bytes -> struct{image: fixed_size_binary, error: reason}."""
    import daft

    out_type = daft.DataType.struct(
        {"image": daft.DataType.fixed_size_binary(spec.sample_bytes), "error": daft.DataType.string()}
    )

    @daft.func.batch(return_dtype=out_type, batch_size=batch_size)
    def transform(data: daft.Series, spec_json: str):
        import pyarrow as pa

        s = TransformSpec.from_json(spec_json)
        images, errors = [], []
        for blob in data.to_pylist():
            if blob is None:
                images.append(None)
                errors.append("download_failed")
                continue
            try:
                images.append(decode_and_transform(blob, s).tobytes())
                errors.append(None)
            except DecodeError as e:
                images.append(None)
                errors.append(e.reason)
            except Exception as e:  # noqa: BLE001 - a hostile file must be a counted skip, not a crashed worker
                images.append(None)
                errors.append(f"decode_error:{type(e).__name__}")
        return pa.StructArray.from_arrays(
            [pa.array(images, pa.binary(s.sample_bytes)), pa.array(errors, pa.string())],
            names=["image", "error"],
        )

    return transform


def transform_rows(uris: list[str], spec: TransformSpec, batch_size: int, scheme: str):
    """Decode + transform ``uris`` with Daft; returns (images [n, *shape] or None per row, errors)."""
    import daft
    from daft import col
    from daft.functions import download

    df = daft.from_pydict({"row": list(range(len(uris))), "uri": uris})
    if daft.get_or_infer_runner_type() == "ray":
        # Give the Ray runner parallel work inside one shard.
        df = df.into_partitions(max(1, min(8, len(uris) // max(1, batch_size))))
    if scheme in DAFT_DOWNLOAD_SCHEMES:
        df = df.with_column("data", download(col("uri"), on_error="null", io_config=io.daft_io_config()))
    else:
        df = df.with_column("data", _fsspec_download_udf()(col("uri")))
    df = df.with_column("out", _transform_udf(spec, batch_size)(col("data"), spec.to_json()))
    t = df.select(
        "row", col("out").get("image").alias("image"), col("out").get("error").alias("error")
    ).to_arrow()
    order = np.argsort(t.column("row").to_numpy())
    images, errors = t.column("image").to_pylist(), t.column("error").to_pylist()
    return [images[i] for i in order], [errors[i] for i in order]
