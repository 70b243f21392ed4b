"""What the engine's subcommands do (``synth``, ``ingest``, ``inspect``, ``dedupe``, ``vacuum``; their arguments are in
cli.py). This module loads fsspec, pyarrow, PIL and numpy: cli.py imports it only when one of its commands runs."""

from __future__ import annotations

import json
import sys
import warnings

from . import io
from .dupes import pair_sheet
from .errors import ConfigError
from .inspect import contact_sheet
from .limits import DEFAULT_MAX_FILE_BYTES, DEFAULT_MAX_PIXELS
from .synth import synthesize
from .table.catalog import ingest
from .table.curate import format_stats
from .table.dedupe_stats import dedupe_stats, format_dedupe
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
    r = vacuum(args.table, grace_seconds=args.grace_seconds, keep_versions=args.keep_versions, dry_run=args.dry_run,
               allow_short_grace=args.allow_short_grace)
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
    table = _filtered(open_table(args.table, runner=args.runner, ray_address=args.ray_address), args.where)
    s = table.stats()
    text = format_stats(s)
    out = args.html or io.join(args.table, "contact_sheet.html")
    grid = contact_sheet(table, out, limit=args.limit, size=args.size, summary=text.splitlines(),
                         allowed_roots=args.allow_root, sample=args.sample, seed=args.seed)
    if args.json:
        print(json.dumps({**s, "html": out, "thumbnails": len(grid), "outside_roots": grid.refused}, indent=2))
    else:
        print(text)
        print(f"contact sheet: {out} ({len(grid)} thumbnails)", file=sys.stdout)
        if grid.refused:
            print(grid.summary[-1], file=sys.stdout)
    return 0


def _filtered(table, where: str | None):
    """``table`` filtered by ``--where``, a bad expression surfaced here as one line."""
    if not where:
        return table
    try:
        table = table.where(where)
        table.df.limit(1).collect()  # surface a bad expression here, as one line
    except Exception as e:
        if isinstance(e, (ConfigError, OSError)):  # storage errors are not a bad filter
            raise
        raise ConfigError(
            f"--where {where!r} is not a valid filter ({str(e).splitlines()[0]}); "
            "write SQL over the table's columns, e.g. \"label = 'star'\""
        ) from e
    return table


def cmd_dedupe(args) -> int:
    if args.examples < 0:
        raise ConfigError(f"--examples {args.examples} must be >= 0")
    if args.recall_sample < 0:
        raise ConfigError(f"--recall-sample {args.recall_sample} must be >= 0 (0: not measured)")
    table = _filtered(open_table(args.table, runner=args.runner, ray_address=args.ray_address), args.where)
    options = {"method": args.method, "recall": args.recall, "bucket_cap": args.bucket_cap}
    with warnings.catch_warnings():  # a capped near search warns; the summary below says the same
        warnings.simplefilter("ignore", UserWarning)
        view = table.dedupe(exact=not args.no_exact, near=not args.no_near, max_distance=args.max_distance,
                            **options)
    run = view.dedupe_run
    cfg = run.config
    stats = dedupe_stats(run.source, cfg, examples=args.examples, run=run)
    out = stats.to_dict()
    lines = format_dedupe(stats).splitlines()
    if not args.no_sheet:
        sheet = pair_sheet(table, stats, args.sheet or io.join(args.table, "dedupe_pairs.png"),
                           allowed_roots=args.allow_root)
        out["sheet"] = {"uri": sheet.uri, "pairs": sheet.pairs, "outside_roots": sheet.refused}
        lines.append(f"pair sheet: {sheet.uri} ({sheet.pairs} pairs)")
        if sheet.refused:
            lines.append(f"{len(sheet.refused)} files outside the table's source roots were not read, e.g. "
                         f"{sheet.refused[0]!r}; name extra roots with --allow-root")
    if args.recall_sample and cfg.near:
        r = table.near_recall(cfg.max_distance, sample=args.recall_sample, **options)
        out["near_recall"] = r
        recall = "no pairs in the sample" if r["recall"] is None else f"{r['recall']:.4f}"
        lines.append(f"near recall against exhaustive comparison of {r['sample']} distinct hashes: {recall} "
                     f"({r['found']} of {r['pairs']} pairs found)")
    if args.save:
        saved = view.save(args.save, overwrite=args.overwrite)
        out["saved"] = {"uri": args.save, "version": saved.manifest.version, "rows": saved.manifest.num_rows}
        lines.append(f"saved {saved.manifest.num_rows} rows to {args.save} (version {saved.manifest.version})")
    print(json.dumps(out, indent=2) if args.json else "\n".join(lines))
    return 0
