"""CLI subcommands after training: ``dutycycle predict`` and ``dutycycle export``: their arguments. What they do
is in predict.py and export.py, imported when a command runs (they load torch)."""

from __future__ import annotations

import argparse
import json
import sys

from dutycycle.engine.errors import ConfigError


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "predict",
        help="top-k classes of image files, folders or a metadata table with a trained run's model",
        description="Classify INPUTs with RUN's model.safetensors, decoding and transforming each image as the "
        "run's cache did. Image files and folders (searched recursively for image files) give CSV: path, "
        "label_1, probability_1, ..., error. One metadata table gives Parquet (--out required): the table's "
        "sample_id, uri, label and split beside prediction, probability, top_labels, top_probs and error. A file "
        "that cannot be decoded gets a row with its error and is counted.",
    )
    p.add_argument("run", metavar="RUN", help="a run directory (or the path of its model.safetensors)")
    p.add_argument("inputs", metavar="INPUT", nargs="+",
                   help="image files, folders of them, or one metadata table (made by `dutycycle ingest`)")
    p.add_argument("--top-k", type=int, default=5, help="classes per image, most probable first (default 5)")
    p.add_argument("--out", default=None,
                   help="output file: CSV for files (default: standard output), Parquet for a table (required)")
    p.add_argument("--where", default=None, help="with a table: SQL filter over its columns, e.g. \"split = 'test'\"")
    p.add_argument("--batch-size", type=int, default=None, help="images per forward pass (default 64)")
    p.add_argument("--allow-root", action="append", default=[], metavar="URI",
                   help="with a table: also read rows under this folder or URI (repeatable)")
    p.add_argument("--trust-plugin", action="store_true",
                   help="build a plug-in model (model.name = 'package.module:factory') by importing its module")
    p.add_argument("--runner", default=None, help="with a table: Daft runner, native (default) or ray")
    p.add_argument("--ray-address", default=None, help="address of a running Ray cluster (with --runner ray)")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.set_defaults(func=_predict)

    e = subparsers.add_parser(
        "export",
        help="write a run's model as a torch.export program (.pt2) and ONNX, checked against the model",
        description="Export RUN's model.safetensors with the training normalization folded in: input 'image', "
        "uint8 [batch, C, H, W] as the transform makes it; output 'logits' [batch, classes]. Writes model.pt2 "
        "(torch.export), model.onnx (where the onnx and onnxscript packages are installed) and "
        "preprocessing.json (the decode and resize a consumer applies, the classes, the checks). Each file is "
        "read back and compared with the model on random batches before anything is written.",
    )
    e.add_argument("run", metavar="RUN", help="a run directory (or the path of its model.safetensors)")
    e.add_argument("--out", default=None, help="output folder (default: RUN/export)")
    onnx = e.add_mutually_exclusive_group()
    onnx.add_argument("--onnx", dest="onnx", action="store_const", const=True, default=None,
                      help="require the ONNX file (fail when onnx or onnxscript is missing)")
    onnx.add_argument("--no-onnx", dest="onnx", action="store_const", const=False, help="write no ONNX file")
    e.add_argument("--trust-plugin", action="store_true",
                   help="build a plug-in model (model.name = 'package.module:factory') by importing its module")
    e.add_argument("--json", action="store_true", help="print the result as JSON")
    e.set_defaults(func=_export)


def _predict(args: argparse.Namespace) -> int:
    from . import predict  # heavy: torch, PIL and pyarrow, which `dutycycle --help` does without

    if args.top_k < 1:
        raise ConfigError(f"--top-k {args.top_k} must be at least 1, e.g. 5")
    batch_size = predict.DEFAULT_BATCH if args.batch_size is None else args.batch_size
    tables = [i for i in args.inputs if predict.is_table(i)]
    if tables:
        if len(args.inputs) != 1:
            raise ConfigError(f"{tables[0]!r} is a metadata table: predict one table at a time, without other inputs")
        s = predict.predict_table(args.run, tables[0], args.out, where=args.where, top_k=args.top_k,
                                  batch_size=batch_size, trust_plugin=args.trust_plugin,
                                  allowed_roots=args.allow_root, runner=args.runner, ray_address=args.ray_address)
    else:
        if args.where:
            raise ConfigError("--where filters a metadata table; the inputs are files and folders")
        s = predict.predict_files(args.run, args.inputs, top_k=args.top_k, out=args.out,
                                  batch_size=batch_size, trust_plugin=args.trust_plugin)
    # the CSV may be on standard output: the summary goes to standard error then
    stream = sys.stdout if s["out"] else sys.stderr
    if args.json:
        print(json.dumps(s, sort_keys=True), file=stream)
        return 0
    errors = ", ".join(f"{k}: {v}" for k, v in s["errors"].items()) or "none"
    where = f" -> {s['out']}" if s["out"] else ""
    print(f"predicted {s['predicted']} of {s['inputs']} images (top {s['top_k']}) in {s['seconds']:.1f}s{where}; "
          f"errors: {errors}", file=stream)
    return 0


def _export(args: argparse.Namespace) -> int:
    from .export import export_model  # heavy: torch, and onnx when installed

    r = export_model(args.run, args.out, onnx=args.onnx, trust_plugin=args.trust_plugin)
    if args.json:
        print(json.dumps(r, sort_keys=True))
        return 0
    print(f"exported {r['model']['name']!r} to {r['out']} in {r['seconds']:.1f}s "
          f"(input uint8 {r['input']['shape']}, output logits {r['output']['shape']})")
    for kind, check in r["checks"].items():
        runtime = f" in {check['runtime']}" if "runtime" in check else ""
        print(f"  {r['files'][kind]}: max |difference| from the model {check['max_abs_diff']:.3g}{runtime} "
              f"(tolerance {check['tolerance']:.3g}, batches of {' and '.join(map(str, check['batch_sizes']))})")
    if r["files"]["onnx"] is None:
        print("  no ONNX file (--no-onnx)" if args.onnx is False else
              "  no ONNX file: install onnx and onnxscript to write one")
    print(f"  {r['out']}/preprocessing.json: the decode and resize a consumer applies, the classes")
    return 0
