"""`dutycycle materialize`: decode and transform a metadata table once into a transformed-sample cache."""

from __future__ import annotations

import argparse
import json

from ..limits import DEFAULT_MAX_FILE_BYTES
from ..runner import resolve
from ..transform import LAYOUTS, MODES, RESAMPLE_FILTERS, RESIZE_POLICIES, TransformSpec


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "materialize",
        help="decode + transform a metadata table into a sample cache (reused when nothing changed)",
        description="Write CACHE/<fingerprint>/ (Arrow IPC shards + manifest.json). Same table, filter and "
        "transform return the existing cache without work; a killed run resumes where it stopped.",
    )
    p.add_argument("table", metavar="TABLE", help="metadata table URI (made by `dutycycle ingest`)")
    p.add_argument(
        "cache", metavar="CACHE", help="cache root URI; each materialization is a fingerprint folder"
    )
    p.add_argument("--size", type=int, default=64, help="output side in pixels (default 64)")
    p.add_argument("--resize", choices=RESIZE_POLICIES, default="shorter_crop", help="resize policy")
    p.add_argument("--resample", choices=RESAMPLE_FILTERS, default="bilinear", help="PIL resampling filter")
    p.add_argument("--layout", choices=LAYOUTS, default="HWC", help="pixel layout of each sample")
    p.add_argument(
        "--mode", choices=MODES, default="RGB",
        help="colour mode of each sample: RGB (3 channels, default) or L (1 channel, grey; colour images are "
        "converted with PIL's luma)",
    )
    p.add_argument(
        "--background",
        choices=("black", "white"),
        default="black",
        help="colour behind transparent pixels and padding",
    )
    p.add_argument("--no-exif", action="store_true", help="ignore EXIF orientation")
    p.add_argument("--where", default=None, help="SQL filter over table columns, e.g. \"split = 'train'\"")
    p.add_argument("--rows-per-shard", type=int, default=2048, help="samples per shard (default 2048)")
    p.add_argument(
        "--max-file-bytes", type=int, default=None, help="skip larger files as 'too large' without reading them"
    )
    p.add_argument(
        "--allow-root", action="append", default=[], metavar="URI",
        help="also read rows under this folder or URI (repeatable), for a table built from several sources; by "
        "default rows outside the table's source roots are skipped unread",
    )
    p.add_argument("--runner", default=None, help="Daft runner: native (default) or ray; also DAFT_RUNNER")
    p.add_argument("--ray-address", default=None, help="address of a running Ray cluster (with --runner ray)")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.add_argument("--quiet", action="store_true", help="no per-shard progress")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from .materialize import materialize, stderr_log  # heavy: pyarrow, PIL and fsspec, not at CLI start-up

    spec = TransformSpec(
        size=args.size,
        resize=args.resize,
        resample=args.resample,
        layout=args.layout,
        mode=args.mode,
        exif=not args.no_exif,
        background=args.background,
    )
    result = materialize(
        args.table,
        args.cache,
        spec,
        where=args.where,
        runner=resolve(args.runner),
        ray_address=args.ray_address,
        rows_per_shard=args.rows_per_shard,
        max_file_bytes=DEFAULT_MAX_FILE_BYTES if args.max_file_bytes is None else args.max_file_bytes,
        allowed_roots=args.allow_root,
        log=None if args.quiet else stderr_log,
    )
    s = result.summary()
    if args.json:
        print(json.dumps(s, sort_keys=True))
        return 0
    skipped = ", ".join(f"{k}={v}" for k, v in sorted(s["skipped"].items())) or "none"
    print(f"cache:   {s['cache']}")
    print(f"samples: {s['samples']} in {s['shards']} shards")
    print(f"skipped: {skipped}")
    cs = s.get("channel_stats")
    if cs:
        print(f"pixels:  mean {_floats(cs['mean'])}, std {_floats(cs['std'])} (0..1, {cs['split']} split, "
              f"{cs['samples']} samples)")
    print(
        f"reused:  {'yes' if s['reused'] else 'no'}"
        + ("" if s["reused"] else f" (wrote {s['shards_written']} shards, resumed {s['shards_resumed']})")
        + f", {s['seconds']:.2f}s"
    )
    return 0


def _floats(values) -> str:
    return "[" + ", ".join(f"{v:.4f}" for v in values) + "]"
