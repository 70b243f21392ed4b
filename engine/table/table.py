"""The notebook-facing metadata table: a committed table opened as an object backed by a Daft DataFrame.

Every operation returns a new :class:`Table` view over the same committed files, carrying the list of
operations that produced it; :meth:`Table.save` writes the view as a new table whose manifest records that
lineage. Nothing is read until a result is asked for (Daft is lazy).
"""

from __future__ import annotations

from typing import Any

from .. import io
from .. import runner as runner_mod
from ..errors import CorruptArtifactError
from . import curate
from . import format as tf
from .dedupe import DedupeConfig, near_recall
from .dedupe import dedupe as dedupe_rows
from .dedupe_stats import EXAMPLES, DedupeStats, dedupe_stats


def read_arrow(table_uri: str, manifest: tf.TableManifest | None = None, columns: list[str] | None = None):
    """The committed rows with plain pyarrow (no Daft), in manifest file order."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    m = manifest or tf.read_manifest(table_uri)
    parts = []
    for rel, uri in zip(m.files, tf.file_uris(table_uri, m), strict=True):
        fs, path = io.filesystem(uri)
        try:
            with fs.open(path, "rb") as f:
                # (a file from before a column existed lacks it: conform adds it as nulls)
                pf = pq.ParquetFile(f)
                present = None if columns is None else [c for c in columns if c in pf.schema_arrow.names]
                parts.append(pf.read(columns=present))
        except FileNotFoundError:
            # data files are immutable and vacuum leaves a version's files for its grace period: a missing one
            # is a damaged manifest or a file deleted by hand (or a version held open past that grace)
            raise CorruptArtifactError(
                f"table {table_uri!r} version {m.version} names the data file {rel!r}, which does not exist "
                f"({uri!r}); read the newest version again, or ingest the source again"
            ) from None
        except pa.ArrowInvalid as e:
            raise CorruptArtifactError(
                f"table {table_uri!r} version {m.version}: the data file {rel!r} cannot be read as Parquet ({e}); "
                "ingest the source again"
            ) from None
    schema = tf.SCHEMA if columns is None else pa.schema([tf.SCHEMA.field(c) for c in columns])
    return pa.concat_tables([tf.conform(p, schema) for p in parts]) if parts else schema.empty_table()


def read_dataframe(table_uri: str, manifest: tf.TableManifest | None = None):
    """A lazy Daft DataFrame over the manifest's files (only committed files, never leftovers)."""
    import daft

    m = manifest or tf.read_manifest(table_uri)
    files = tf.file_uris(table_uri, m)
    if io.protocol(table_uri) in io.DAFT_SCHEMES and files:
        # the schema given, not inferred from the first file: a file from before a column existed lacks it
        schema = {f.name: daft.DataType.from_arrow_type(f.type) for f in tf.SCHEMA}
        return daft.read_parquet(files, io_config=io.daft_io_config(), schema=schema, infer_schema=False)
    return daft.from_arrow(read_arrow(table_uri, m))


class Table:
    """A view of a committed metadata table. ``df`` is the Daft DataFrame; operations return new views."""

    def __init__(self, uri: str, manifest: tf.TableManifest, df=None, operations: tuple[str, ...] = ()):
        self.uri = uri
        self.manifest = manifest
        self.df = df if df is not None else read_dataframe(uri, manifest)
        self.operations = tuple(operations)
        self.near_search = None  # set by dedupe: how its near-duplicate pairs were found
        self.dedupe_run = None  # set by dedupe: its dedupe.DedupeRun

    # -- views ---------------------------------------------------------------------------------------
    def _derive(self, df, operation: str) -> Table:
        return Table(self.uri, self.manifest, df, self.operations + (operation,))

    def where(self, predicate) -> Table:
        """Filter with a Daft expression (``col("width") > 100``) or a SQL string (``"label = 'star'"``)."""
        import daft

        expr = daft.sql_expr(predicate) if isinstance(predicate, str) else predicate
        return self._derive(self.df.where(expr), f"where {predicate}")

    def dedupe(self, exact: bool = True, near: bool = True, max_distance: int = 4, **options) -> Table:
        """Drop exact duplicates (same content hash) and near duplicates (perceptual-hash Hamming distance).
        ``options``: the other fields of ``dedupe.DedupeConfig`` (method, recall, bucket_cap, lsh_seed). The near
        search runs now (its pairs decide the rows); how it went is the view's ``near_search`` (a
        ``dedupe.NearSearch``: exact or LSH, buckets over the cap), None without ``near``."""
        cfg = DedupeConfig(exact=exact, near=near, max_distance=max_distance, **options)
        df, run = dedupe_rows(self.df, cfg)
        extra = "".join(f", {k}={v!r}" for k, v in options.items())
        view = self._derive(df, f"dedupe(exact={exact}, near={near}, max_distance={max_distance}{extra})")
        view.near_search = run.near.search if run.near is not None else None
        view.dedupe_run = run  # what dedupe_stats(..., run=) counts from without a new search
        return view

    def dedupe_stats(self, exact: bool = True, near: bool = True, max_distance: int = 4,
                     examples: int = EXAMPLES, **options) -> DedupeStats:
        """What ``dedupe`` with these settings removes: exact and near removals (per distance), ``examples``
        pairs per distance, and the near search (``dupes.DedupeStats``; ``dupes.pair_sheet`` draws the pairs)."""
        cfg = DedupeConfig(exact=exact, near=near, max_distance=max_distance, **options)
        return dedupe_stats(self.df, cfg, examples=examples)

    def near_recall(self, max_distance: int = 4, sample: int = 1000, seed: int = 0, **options) -> dict:
        """The share of near-duplicate pairs the search finds, against exhaustive comparison of ``sample``
        distinct hashes with all (``dedupe.near_recall``)."""
        return near_recall(self.df, max_distance=max_distance, sample=sample, seed=seed, **options)

    def sample(
        self,
        n: int | None = None,
        fraction: float | None = None,
        stratify_by: str | None = "label",
        seed: int = 0,
    ) -> Table:
        """A deterministic sample of ``n`` rows or a ``fraction``, kept in proportion per ``stratify_by``."""
        df = curate.sample(self.df, n=n, fraction=fraction, stratify_by=stratify_by, seed=seed)
        what = f"n={n}" if n is not None else f"fraction={fraction}"
        return self._derive(df, f"sample({what}, stratify_by={stratify_by!r}, seed={seed})")

    def resplit(self, fractions="0.8,0.1,0.1", seed: int = 0, stratify_by: str | None = "label") -> Table:
        """Reassign train/val/test so each stratum is split in the given fractions."""
        df = curate.resplit(self.df, fractions=fractions, seed=seed, stratify_by=stratify_by)
        return self._derive(df, f"resplit({fractions!r}, seed={seed}, stratify_by={stratify_by!r})")

    # -- results -------------------------------------------------------------------------------------
    @property
    def classes(self) -> list[str]:
        return list(self.manifest.classes)

    def stats(self) -> dict[str, Any]:
        """Rows, class balance, splits, formats, a size histogram and errors per reason."""
        return curate.stats(self.df)

    def count(self) -> int:
        return self.df.count_rows()

    def __len__(self) -> int:
        return self.count()

    def to_arrow(self):
        return self.df.to_arrow().select(tf.SCHEMA.names).cast(tf.SCHEMA)

    def to_pandas(self):
        try:
            import pandas  # noqa: F401
        except ImportError as e:
            raise ImportError("to_pandas needs pandas; install it or use to_arrow()") from e
        return self.to_arrow().to_pandas()

    def show_thumbnails(self, n: int = 16, size: int = 96, sample: str = "random", seed: int = 0):
        """An inline grid of ``n`` rows' thumbnails for Jupyter (decoded at reduced scale), chosen by ``sample``:
        "random" (seeded), "per_class" or "first" (``inspect.sample_rows``)."""
        from ..inspect import thumbnail_grid  # heavy: PIL and numpy, only when a notebook asks for pictures

        return thumbnail_grid(self, limit=n, size=size, sample=sample, seed=seed)

    def save(self, uri: str, overwrite: bool = False) -> Table:
        """Commit this view as a new table at ``uri``; its manifest records the parent and the operations."""
        return Table(uri, curate.save(self, uri, overwrite=overwrite))

    def __repr__(self) -> str:
        ops = "; ".join(self.operations) or "all rows"
        return f"Table({self.uri!r}, version {self.manifest.version}, classes {self.classes}, {ops})"


def open_table(uri: str, runner: str | None = None, ray_address: str | None = None) -> Table:
    """Open the committed table at ``uri``. ``runner``: "native" or "ray" (default: DAFT_RUNNER or native)."""
    if runner or ray_address:
        runner_mod.configure(runner, ray_address)
    return Table(uri, tf.read_manifest(uri))
