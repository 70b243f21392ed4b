"""CLI subcommands of the engine: ``synth``, ``ingest``, ``inspect``, ``vacuum``. The modules that load fsspec,
pyarrow, PIL or numpy are imported inside the commands, so that the ``dutycycle`` command starts without them."""

from __future__ import annotations

import json
import sys

from . import runner
from .errors import ConfigError
from .limits import DEFAULT_MAX_FILE_BYTES, DEFAULT_MAX_PIXELS


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "synth", help="draw the embedded default dataset (shapes, one folder per class)"
    )
    p.add_argument("out", help="output folder or URI (local, memory://, s3://...)")
    p.add_argument("--n", type=int, default=1000, help="number of images (default 1000)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--broken-fraction", type=float, default=0.0, help="fraction of deliberately broken files")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.set_defaults(func=cmd_synth)

    p = subparsers.add_parser("ingest", help="scan images into a Parquet metadata table (no pixels)")
    p.add_argument("source", help="folder or URI of images; class = first sub-folder unless --labels")
    p.add_argument("table", help="table folder or URI; re-running adds only new files")
    p.add_argument("--labels", default=None, help="CSV (name,label) or JSON {name: label} mapping file")
    p.add_argument("--split", default="0.8,0.1,0.1", help="train,val,test fractions (default 0.8,0.1,0.1)")
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
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    runner.add_arguments(p)
    p.set_defaults(func=cmd_ingest)

    p = subparsers.add_parser("inspect", help="summarize a table and write an HTML contact sheet")
    p.add_argument("table", help="table folder or URI")
    p.add_argument("--where", default=None, help="SQL filter, e.g. \"label = 'star' AND width > 100\"")
    p.add_argument("--limit", type=int, default=64, help="thumbnails in the contact sheet (default 64)")
    p.add_argument(
        "--html", default=None, help="write the contact sheet here (default: TABLE/contact_sheet.html)"
    )
    p.add_argument("--size", type=int, default=128, help="thumbnail size in pixels")
    p.add_argument(
        "--allow-root", action="append", default=[], metavar="URI",
        help="also read rows under this folder or URI (repeatable); by default only rows inside the table's "
        "source roots are read",
    )
    p.add_argument("--json", action="store_true", help="print the stats as JSON")
    runner.add_arguments(p)
    p.set_defaults(func=cmd_inspect)

    p = subparsers.add_parser(
        "vacuum", help="delete table data files that no committed version names (after a grace period)"
    )
    p.add_argument("table", help="table folder or URI")
    p.add_argument(
        "--grace-seconds", type=float, default=3600.0,
        help="leave a file alone until this long after it left the table (so readers of older versions keep "
        "their files), or, for a file no version named, after it was written: an ingest still running owns "
        "it (default 3600)",
    )
    p.add_argument("--keep-versions", type=int, default=None, help="expire all but the newest K versions first")
    p.add_argument("--dry-run", action="store_true", help="only list what would be removed")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=cmd_vacuum)


def cmd_synth(args) -> int:
    from .synth import synthesize  # numpy and fsspec: not at CLI start-up

    s = synthesize(args.out, args.n, seed=args.seed, broken_fraction=args.broken_fraction)
    if args.json:
        print(json.dumps(s, indent=2))
    else:
        classes = ", ".join(f"{k}: {v}" for k, v in s["classes"].items())
        formats = ", ".join(f"{k}: {v}" for k, v in sorted(s["formats"].items()))
        print(f"wrote {s['n']} images to {s['out']} in {s['seconds']:.1f}s")
        print(f"classes: {classes}\nformats: {formats}\nbroken: {s['broken']}")
    return 0


def cmd_ingest(args) -> int:
    from .table.catalog import ingest  # pyarrow, PIL and fsspec: not at CLI start-up

    if args.progress_every < 0:
        raise ConfigError(f"--progress-every {args.progress_every} must be >= 0 (0 turns progress off)")
    s = ingest(
        args.source,
        args.table,
        labels=args.labels,
        split=args.split,
        phash=not args.no_phash,
        max_pixels=DEFAULT_MAX_PIXELS if args.max_pixels is None else args.max_pixels,
        max_file_bytes=DEFAULT_MAX_FILE_BYTES if args.max_file_bytes is None else args.max_file_bytes,
        progress_every=args.progress_every,
        runner=args.runner,
        ray_address=args.ray_address,
    )
    if args.json:
        print(json.dumps(s, indent=2))
        return 0
    print(
        f"table {s['table']} version {s['version']}{'' if s['committed'] else ' (unchanged)'}: {s['rows']} rows "
        f"({s['new_rows']} new or modified, {s['unchanged']} unchanged, {s['deleted']} deleted) "
        f"in {s['seconds']:.1f}s on {s['runner']}"
    )
    print("classes: " + (", ".join(f"{k}: {v}" for k, v in s["classes"].items()) or "none"))
    print("splits: " + (", ".join(f"{k}: {v}" for k, v in sorted(s["splits"].items())) or "none"))
    print("errors: " + (", ".join(f"{k}: {v}" for k, v in s["errors"].items()) or "none"))
    return 0


def cmd_vacuum(args) -> int:
    from .table.vacuum import vacuum  # pyarrow and fsspec: not at CLI start-up

    r = vacuum(args.table, grace_seconds=args.grace_seconds, keep_versions=args.keep_versions, dry_run=args.dry_run)
    if args.json:
        print(json.dumps(r, indent=2))
        return 0
    verb = "would remove" if r["dry_run"] else "removed"
    print(
        f"table {r['table']}: {verb} {len(r['removed_files'])} unreferenced files ({r['removed_bytes']} bytes); "
        f"{r['kept_recent']} younger than the grace period kept; {r['versions']} versions"
        + (f", expired {len(r['expired_versions'])}" if r["expired_versions"] else "")
    )
    return 0


def cmd_inspect(args) -> int:
    # pyarrow, PIL and fsspec: not at CLI start-up
    from . import io
    from .inspect import contact_sheet
    from .table.curate import format_stats
    from .table.table import open_table

    if args.limit < 0:
        raise ConfigError(f"--limit {args.limit} must be >= 0")
    if args.size < 8:
        raise ConfigError(f"--size {args.size} is too small; use at least 8 pixels, e.g. 128")
    table = open_table(args.table, runner=args.runner, ray_address=args.ray_address)
    if args.where:
        try:
            table = table.where(args.where)
            table.df.limit(1).collect()  # surface a bad expression here, as one line
        except Exception as e:
            if isinstance(e, (ConfigError, OSError)):  # storage errors are not a bad filter
                raise
            raise ConfigError(
                f"--where {args.where!r} is not a valid filter ({str(e).splitlines()[0]}); "
                "write SQL over the table's columns, e.g. \"label = 'star'\""
            ) from e
    s = table.stats()
    text = format_stats(s)
    out = args.html or io.join(args.table, "contact_sheet.html")
    grid = contact_sheet(table, out, limit=args.limit, size=args.size, summary=text.splitlines(),
                         allowed_roots=args.allow_root)
    if args.json:
        print(json.dumps({**s, "html": out, "thumbnails": len(grid), "outside_roots": grid.refused}, indent=2))
    else:
        print(text)
        print(f"contact sheet: {out} ({len(grid)} thumbnails)", file=sys.stdout)
        if grid.refused:
            print(grid.summary[-1], file=sys.stdout)
    return 0
