"""CLI subcommands of the engine: ``synth``, ``ingest``, ``inspect``, ``dedupe``, ``vacuum``: their arguments. What they do is
in commands.py, which loads fsspec, pyarrow, PIL and numpy: it is imported when a command runs, so that the
``dutycycle`` command starts without them."""

from __future__ import annotations

from . import runner


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "synth", help="draw the embedded default dataset (shapes, one folder per class)"
    )
    p.add_argument("out", help="output folder or URI (local, memory://, s3://...)")
    p.add_argument("--n", type=int, default=1000, help="number of images (default 1000)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--broken-fraction", type=float, default=0.0, help="fraction of deliberately broken files")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.set_defaults(func=command("cmd_synth"))

    p = subparsers.add_parser("ingest", help="scan images into a Parquet metadata table (no pixels)")
    p.add_argument(
        "source",
        help="folder or URI of images; class = first sub-folder unless --labels, or the sub-folder below "
        "train/, val/ (validation/) and test/ when the source is laid out in split folders",
    )
    p.add_argument("table", help="table folder or URI; re-running adds only new files")
    p.add_argument("--labels", default=None, help="CSV (name,label) or JSON {name: label} mapping file")
    p.add_argument(
        "--split", default=None,
        help="train,val,test fractions of the split by content hash (default 0.8,0.1,0.1, or the table's own "
        "on a re-ingest); refused for a source in split folders",
    )
    p.add_argument(
        "--no-split-folders", action="store_true",
        help="do not take splits from top-level train/, val/ (validation/), test/ folders: split by content hash "
        "and take the class from the first folder level",
    )
    p.add_argument(
        "--no-phash", action="store_true", help="skip the perceptual hash (no pixel decode at all)"
    )
    p.add_argument(
        "--max-pixels", type=int, default=None, help="refuse images whose header claims more pixels"
    )
    p.add_argument(
        "--max-file-bytes", type=int, default=None, help="record larger files as errors without reading them"
    )
    p.add_argument("--progress-every", type=int, default=1000, help="progress line every N files (0: quiet)")
    p.add_argument(
        "--batch-files", type=int, default=None,
        help="files listed, probed and written per batch (default 10000): bounds the driver's memory",
    )
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    runner.add_arguments(p)
    p.set_defaults(func=command("cmd_ingest"))

    p = subparsers.add_parser("inspect", help="summarize a table and write an HTML contact sheet")
    p.add_argument("table", help="table folder or URI")
    p.add_argument("--where", default=None, help="SQL filter, e.g. \"label = 'star' AND width > 100\"")
    p.add_argument("--limit", type=int, default=64, help="thumbnails in the contact sheet (default 64)")
    p.add_argument(
        "--html", default=None, help="write the contact sheet here (default: TABLE/contact_sheet.html)"
    )
    p.add_argument("--size", type=int, default=128, help="thumbnail size in pixels")
    p.add_argument(
        "--sample", choices=("random", "per_class", "first"), default="random",  # inspect.SAMPLES (it loads PIL)
        help="which rows the sheet shows: a seeded random sample, up to LIMIT/classes of each class, or the "
        "first rows in path order (default random)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the random and per_class samples (default 0)")
    p.add_argument(
        "--allow-root", action="append", default=[], metavar="URI",
        help="also read rows under this folder or URI (repeatable); by default only rows inside the table's "
        "source roots are read",
    )
    p.add_argument("--json", action="store_true", help="print the stats as JSON")
    runner.add_arguments(p)
    p.set_defaults(func=command("cmd_inspect"))

    p = subparsers.add_parser(
        "dedupe", help="count and show what exact and near-duplicate removal takes out of a table; --save keeps "
        "the rest as a new table",
    )
    p.add_argument("table", help="table folder or URI")
    p.add_argument("--where", default=None, help="SQL filter applied first, e.g. \"error IS NULL\"")
    p.add_argument("--no-exact", action="store_true", help="keep exact copies (same bytes)")
    p.add_argument("--no-near", action="store_true", help="keep near duplicates (similar perceptual hash)")
    p.add_argument("--max-distance", type=int, default=4,
                   help="Hamming distance (bits of the 64-bit perceptual hash, 0-16) within which a later row is "
                   "a near duplicate of a kept one (default 4)")
    p.add_argument("--method", default="auto", choices=["auto", "pigeonhole", "lsh"],
                   help="near search: pigeonhole compares every pair within the distance, lsh samples bits for "
                   "--recall, auto takes pigeonhole while it is cheap (default)")
    p.add_argument("--recall", type=float, default=0.99,
                   help="lsh: the probability that a pair at --max-distance is compared (default 0.99)")
    p.add_argument("--bucket-cap", type=int, default=256,
                   help="rows of one bucket compared with each other in full; the rest of a larger bucket only "
                   "with those (default 256; the output says how many buckets hit it)")
    p.add_argument("--examples", type=int, default=3, help="example pairs per distance (default 3)")
    p.add_argument("--sheet", default=None,
                   help="write the example pairs as a PNG here (default: TABLE/dedupe_pairs.png)")
    p.add_argument("--no-sheet", action="store_true", help="do not draw the example pairs")
    p.add_argument("--recall-sample", type=int, default=0, metavar="N",
                   help="also measure the near search's recall: N distinct hashes compared with every hash")
    p.add_argument("--save", default=None, metavar="URI", help="commit the rows kept as a new table here")
    p.add_argument("--overwrite", action="store_true", help="with --save: add a version to an existing table")
    p.add_argument(
        "--allow-root", action="append", default=[], metavar="URI",
        help="also read rows under this folder or URI for the sheet (repeatable)",
    )
    p.add_argument("--json", action="store_true", help="print the statistics as JSON")
    runner.add_arguments(p)
    p.set_defaults(func=command("cmd_dedupe"))

    p = subparsers.add_parser(
        "vacuum", help="delete table data files that no committed version names (after a grace period)"
    )
    p.add_argument("table", help="table folder or URI")
    p.add_argument(
        "--grace-seconds", type=float, default=3600.0,
        help="leave a file alone until this long after it left the table (so readers of older versions keep "
        "their files), or, for a file no version named, after it was written (default 3600, at least 600: "
        "clocks of different machines disagree by minutes); vacuum refuses to run while a write is in progress",
    )
    p.add_argument(
        "--allow-short-grace", action="store_true",
        help="accept --grace-seconds below 600, when no one reads older versions of the table (a write in "
        "progress is still refused)",
    )
    p.add_argument("--keep-versions", type=int, default=None, help="expire all but the newest K versions first")
    p.add_argument("--dry-run", action="store_true", help="only list what would be removed")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=command("cmd_vacuum"))


def command(name: str):
    """The handler ``name`` of commands.py, imported when the command runs."""

    def run(args) -> int:
        from . import commands  # heavy: pyarrow, PIL and fsspec, not at CLI start-up

        return getattr(commands, name)(args)

    return run
