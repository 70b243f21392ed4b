"""What the engine's subcommands do (``synth``, ``ingest``, ``inspect``, ``vacuum``; their arguments are in
cli.py). This module loads fsspec, pyarrow, PIL and numpy: cli.py imports it only when one of its commands runs."""

from __future__ import annotations

import json
import sys

from . import io
from .errors import ConfigError
from .inspect import contact_sheet
from .limits import DEFAULT_MAX_FILE_BYTES, DEFAULT_MAX_PIXELS
from .synth import synthesize
from .table.catalog import ingest
from .table.curate import format_stats
from .table.split import describe_assignment
from .table.table import open_table
from .table.vacuum import vacuum


def cmd_synth(args) -> int:
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
    if args.progress_every < 0:
        raise ConfigError(f"--progress-every {args.progress_every} must be >= 0 (0 turns progress off)")
    s = ingest(
        args.source,
        args.table,
        labels=args.labels,
        split=args.split,
        split_folders=not args.no_split_folders,
        phash=not args.no_phash,
        max_pixels=DEFAULT_MAX_PIXELS if args.max_pixels is None else args.max_pixels,
        max_file_bytes=DEFAULT_MAX_FILE_BYTES if args.max_file_bytes is None else args.max_file_bytes,
        progress_every=args.progress_every,
        runner=args.runner,
        ray_address=args.ray_address,
        **({} if args.batch_files is None else {"batch_files": args.batch_files}),
    )
    if args.json:
        print(json.dumps(s, indent=2))
        return 0
    print(
        f"table {shown(s['table'])} version {s['version']}{'' if s['committed'] else ' (unchanged)'}: {s['rows']} rows "
        f"({s['new_rows']} new or modified, {s['unchanged']} unchanged, {s['deleted']} deleted) "
        f"in {s['seconds']:.1f}s on {s['runner']}"
    )
    print("classes: " + (", ".join(f"{shown(k)}: {v}" for k, v in s["classes"].items()) or "none"))
    for label, spellings in s.get("merged_labels", {}).items():
        print(f"merged into class {shown(label)} (Unicode NFC): folders " + ", ".join(map(ascii, spellings)))
    by = describe_assignment(s["split_assignment"])
    print("splits: " + (", ".join(f"{k}: {v}" for k, v in sorted(s["splits"].items())) or "none") + f" ({by})")
    print("errors: " + (", ".join(f"{k}: {v}" for k, v in s["errors"].items()) or "none"))
    return 0


def shown(text: str) -> str:
    """``text`` for a terminal: as is when printable, else with its control characters escaped (a file or folder
    name may hold newlines or escape sequences that would rewrite the screen)."""
    return text if text.isprintable() else repr(text)[1:-1]


def cmd_vacuum(args) -> int:
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
