"""``dutycycle demo``: the whole pipeline on generated data, as one command.

    synth (with a few broken files) -> ingest (bad files counted) -> curate (filter, dedupe, save)
    -> materialize (transformed-sample cache) -> train on a local Ray cluster -> accuracy, time, report

Every stage is the public API a user would call, and every artifact lands under ``--out`` so a person can
look at it afterwards (``images/``, ``table/``, ``curated/``, ``cache/``, ``run/``). Running the demo again in
the same folder reuses what is already there (ingest adds only new files, the cache is found by fingerprint).
"""

from __future__ import annotations

import os
import time

# The demo's training config. configs/demo.toml is the same settings for `dutycycle train` (a test keeps
# them in step). Tuned on a 2-core machine: 32x32 samples, a 3-block GroupNorm CNN; see the README.
DEMO = {
    "images": 8000,
    "size": 32,
    "train": {
        "data": {"global_batch_size": 128, "eval_batch_size": 256, "augment": {"flip": True}},
        "model": {"name": "cnn", "width": 32, "depth": 3},
        "optim": {"lr": 0.005, "warmup_steps": 30, "weight_decay": 0.05},
        "run": {"epochs": 6, "eval_every": 100, "log_every": 25},
    },
}
SMALL = {
    "images": 300,
    "size": 32,
    "train": {
        "data": {"global_batch_size": 32, "eval_batch_size": 64},
        "model": {"name": "cnn", "width": 8, "depth": 3},
        "optim": {"lr": 0.003, "warmup_steps": 2},
        "run": {"max_steps": 6, "eval_every": 3, "log_every": 1},
    },
}


def _say(msg: str) -> None:
    print(f"[demo] {msg}", flush=True)


def run_demo(out: str = "dutycycle-demo", workers: int = 2, small: bool = False,
             overrides: list[str] | None = None) -> dict:
    from dutycycle.engine import io
    from dutycycle.engine.cache.materialize import materialize
    from dutycycle.engine.inspect import contact_sheet
    from dutycycle.engine.synth import synthesize
    from dutycycle.engine.table.catalog import ingest
    from dutycycle.engine.table.table import open_table
    from dutycycle.engine.transform import TransformSpec

    from .config import load_config
    from .launch import train
    from .metrics import format_breakdown

    plan = SMALL if small else DEMO
    if io.protocol(out) == "file":
        out = os.path.abspath(out)
    images, table, curated = io.join(out, "images"), io.join(out, "table"), io.join(out, "curated")
    cache_root, run_dir = io.join(out, "cache"), io.join(out, "run")
    # Validate the training config first: a bad --set fails before minutes of data preparation.
    base = dict(plan["train"])
    base["data"] = {**base["data"], "source": "cache", "cache": "(set after materialize)"}
    base["parallel"] = {"num_workers": workers}
    base["run"] = {**base["run"], "dir": run_dir, "name": "demo"}
    load_config(None, overrides, base=base)
    t_start = time.perf_counter()
    stages: dict[str, float] = {}

    t = time.perf_counter()
    s = synthesize(images, plan["images"], seed=0, broken_fraction=0.02)
    stages["synth"] = time.perf_counter() - t
    _say(f"synth: {s['n']} images ({s['broken']} deliberately broken) in {images} [{stages['synth']:.1f}s]")

    t = time.perf_counter()
    s = ingest(images, table)
    stages["ingest"] = time.perf_counter() - t
    errors = s.get("errors") or {}
    n_err = sum(errors.values()) if isinstance(errors, dict) else errors
    _say(f"ingest: {s.get('rows')} rows, classes {s.get('classes')}, {n_err} bad files counted"
         + (f" {errors}" if isinstance(errors, dict) and errors else "") + f" [{stages['ingest']:.1f}s]")

    t = time.perf_counter()
    tab = open_table(table)
    view = tab.where("error IS NULL AND width >= 48 AND height >= 48").dedupe(exact=True, near=False)
    saved = view.save(curated, overwrite=True)
    sheet = io.join(out, "contact_sheet.html")
    contact_sheet(open_table(curated), sheet, limit=48, size=96)
    stages["curate"] = time.perf_counter() - t
    _say(f"curate: {len(saved)} of {len(tab)} rows kept (readable, at least 48x48, exact duplicates removed) "
         f"-> {curated} [{stages['curate']:.1f}s]")
    _say(f"inspect: contact sheet of the curated table -> {sheet}")

    t = time.perf_counter()
    res = materialize(curated, cache_root, TransformSpec(size=plan["size"]))
    stages["materialize"] = time.perf_counter() - t
    m = res.manifest
    _say(f"materialize: {m.num_samples} samples of {m.shape} in {len(m.shards)} shards"
         f"{' (reused)' if res.reused else ''}, splits {m.split_counts} -> {res.uri} [{stages['materialize']:.1f}s]")

    base["data"]["cache"] = res.uri
    cfg = load_config(None, overrides, base=base)
    t = time.perf_counter()
    _say(f"train: {cfg.parallel.num_workers} workers on a local Ray cluster, run directory {run_dir}")
    summary = train(cfg, local=False, quiet=True)
    stages["train"] = time.perf_counter() - t
    total = time.perf_counter() - t_start

    acc = summary["val_accuracy"]
    _say(f"final validation accuracy: {acc:.1%} ({summary['steps']} steps, {summary['samples_per_s']:.0f} samples/s, "
         f"world size {summary['world_size']})")
    _say(format_breakdown(summary))
    _say(f"goodput {summary['goodput']:.0%}, data wait {summary['data_wait_fraction']:.1%}, "
         f"communication {summary['comm_fraction']:.1%}")
    _say("stages: " + ", ".join(f"{k} {v:.0f}s" for k, v in stages.items()) + f"; total {total:.0f}s")
    _say(f"report: {summary.get('report')}")
    result = {"val_accuracy": acc, "total_s": total, "stages": stages, "run_dir": run_dir,
              "report": summary.get("report"), "cache": res.uri, "contact_sheet": sheet, "summary": summary}
    io.write_json_atomic(io.join(out, "demo.json"), {k: v for k, v in result.items() if k != "summary"})
    return result
