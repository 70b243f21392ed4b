"""``RUN_DIR/report.html``: a run on one page: the summary's figures, where the time went, the workers it trained
at when its size changed (an elastic resize or a resume at another size: step/sizes.py), ``report.png``, and a
section per evaluated split (``dutycycle evaluate``: its scores, per-class table and confusion matrix).

``write_run_page(run_dir)`` draws it from the files in the run directory alone (``summary.json``, ``report.png``,
``evaluation/*.json`` and their PNGs), so it can be drawn again at any time: the training driver draws it at the
end of a run, ``evaluate`` after writing its files. Pictures are embedded (the page stands alone); the JSON and
Parquet files are linked relative to the page. Everything taken from data (class names are folder names, paths,
split names, notes) is escaped.
"""

from __future__ import annotations

import base64
import html

from dutycycle.engine import formats, io
from dutycycle.engine.errors import DutycycleError
from dutycycle.engine.numbers import figure, seconds_plain
from dutycycle.trainer.config import run_config_uri
from dutycycle.trainer.step import sizes as S
from dutycycle.trainer.step.metrics import read_metrics, read_summary

from .account import NAMES

PAGE = "report.html"
EVAL_DIR = "evaluation"  # evaluate's folder (serve/evalfiles.py)
SPLIT_ORDER = {"test": 0, "val": 1, "validation": 1, "train": 2}
STYLE = ("body{font-family:sans-serif;max-width:1100px;margin:2em auto;padding:0 1em}td,th{padding:3px 10px;"
         "border-bottom:1px solid #ddd;text-align:left}td.n,th.n{text-align:right}h2{margin-top:1.6em}"
         ".note{color:#555}code{background:#f4f4f4;padding:0 3px}")

e = html.escape


def write_run_page(run_dir: str) -> str:
    """Draw ``RUN_DIR/report.html`` from what the run directory holds; returns its URI."""
    try:
        summary = read_summary(run_dir)
    except DutycycleError:
        summary = None
    name = _run_name(run_dir)
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>dutycycle run {e(name)}</title>"
             f"<style>{STYLE}</style></head><body><h1>Run {e(name)}</h1><p>Run directory <code>{e(run_dir)}</code></p>"]
    if summary is None:
        parts.append("<p class='note'>No summary yet: the run has not finished (or did not write summary.json).</p>")
    else:
        rows = _metrics(run_dir)
        parts.append(training(summary, S.path(rows), _elastic_range(run_dir)))
        parts.append(time_table(summary))
        parts.append(workers(rows))
    parts.append(_img(io.join(run_dir, "report.png"), "training report"))
    for split, record in evaluations(run_dir):
        parts.append(evaluation(split, record, run_dir))
    parts.append("</body></html>")
    uri = io.join(run_dir, PAGE)
    io.write_bytes_atomic(uri, "".join(parts).encode())
    return uri


def _metrics(run_dir: str) -> list[dict]:
    """The run's metrics rows; none when they cannot be read (the page is drawn from what is there)."""
    try:
        return read_metrics(run_dir)
    except (DutycycleError, FileNotFoundError):
        return []


def _elastic_range(run_dir: str) -> tuple[int, int] | None:
    """``(min, max)`` workers of an elastic run (``parallel.num_workers = [min, max]``) by its config; None for a
    fixed size."""
    par = _config(run_dir).get("parallel")
    if not isinstance(par, dict):
        return None
    try:
        low, high = int(par.get("min_workers") or 0), int(par.get("num_workers") or 0)
    except (TypeError, ValueError):
        return None
    return (low, high) if 0 < low < high else None


def _config(run_dir: str) -> dict:
    """The config the run trains with: its newest attempt's ``config.json`` (it becomes ``RUN_DIR/config.json``
    only after the page is drawn at the end of a run); empty when there is none to read."""
    uri = run_config_uri(run_dir)
    try:
        tree = io.read_json(uri) if uri else {}
    except DutycycleError:
        return {}
    return tree if isinstance(tree, dict) else {}


def _run_name(run_dir: str) -> str:
    """``run.name`` from the run's config, else the directory's name."""
    run = _config(run_dir).get("run")
    name = run.get("name") if isinstance(run, dict) else None
    return str(name) if name else run_dir.rstrip("/").rsplit("/", 1)[-1]


# --------------------------------------------------------------------------------------------------- training


def _rows(pairs) -> str:
    """Table rows of (label, already escaped value)."""
    return "".join(f"<tr><td>{e(str(k))}</td><td>{v}</td></tr>" for k, v in pairs if v is not None)


def _pct(x) -> str | None:
    return None if x is None else f"{x:.1%}"


def _num(x) -> str | None:
    return None if x is None else f"{x:.4g}"


def training(s: dict, path: list[int] | None = None, elastic: tuple[int, int] | None = None) -> str:
    """The summary's figures. ``path``: the sizes the run trained at (step/sizes.py), shown when it changed;
    ``elastic``: its ``(min, max)`` workers when elastic."""
    par, data, ck = s.get("parallel") or {}, s.get("data") or {}, s.get("checkpoint") or {}
    layout = [par.get("strategy", "local"), f"ZeRO stage {par.get('zero_stage', 0)}"]
    if par.get("tensor", 1) > 1:
        layout.append(f"tensor parallel {par['tensor']}")
    if par.get("replicate", 1) > 1:
        layout.append(f"{par['replicate']} replica groups")
    if par.get("offload", "none") != "none":
        layout.append(f"offload {par['offload']}")
    committed = ck.get("committed") or []
    first, final = s.get("first_loss"), s.get("final_loss")
    rows = [
        ("steps", f"{s.get('steps', 0):,}" + (f" ({s['epochs']} epoch{'s' if s['epochs'] != 1 else ''})"
                                                if s.get("epochs") is not None else "")),
        ("train loss, first to final", f"{_num(first)} to {_num(final)}" if first is not None and final is not None
         else None),
        ("validation accuracy", _pct(s.get("val_accuracy"))),
        ("validation loss", _num(s.get("val_loss"))),
        ("samples per second", figure(s["samples_per_s"]) if s.get("samples_per_s") else None),
        ("workers, layout", e(f"{_workers_text(s, path or [], elastic)}, " + ", ".join(map(str, layout)))),
        ("precision", e(str(par.get("precision"))) if par.get("precision") else None),
        ("parameters", f"{s['num_params']:,}" if s.get("num_params") else None),
        ("classes", _classes(data.get("classes") or [])),
        ("samples, train and validation", f"{data['train_samples']:,} and {data['val_samples']:,}"
         if data.get("train_samples") is not None else None),
        ("data", _data_line(data)),
        ("checkpoints committed", f"{len(committed)}, the last at step {committed[-1]}" if committed else "none"),
        ("goodput", _pct((s.get("launch") or {}).get("goodput", s.get("goodput")))),
        ("training loop wall time", seconds_plain(s["wall_s"]) if s.get("wall_s") else None),
    ]
    return f"<h2>Training</h2><table>{_rows(rows)}</table>"


def _workers_text(s: dict, path: list[int], elastic: tuple[int, int] | None) -> str:
    """``"2"``; a run whose size changed: ``"3 -> 2 -> 3"``; an elastic run adds its range."""
    text = S.path_text(path) if len(path) > 1 else str(s.get("world_size", 1))
    return text + (f" (elastic, {elastic[0]} to {elastic[1]})" if elastic else "")


def workers(rows: list[dict]) -> str:
    """The run's size over time when it changed: each attempt's size and steps, each change with what it cost
    (an elastic resize's parts, as its ``resize`` row has them); empty for a run trained at one size."""
    changes = S.changes(rows)
    if not changes:
        return ""
    runs = S.attempts(rows)
    t0 = min(a["started"] for a in runs)
    head = ("<tr><th>attempt</th><th class='n'>workers</th><th class='n'>from step</th><th class='n'>"
            "last step kept</th><th class='n'>began</th><th class='n'>trained</th></tr>")
    body = "".join(
        f"<tr><td>{a['attempt']}</td><td class='n'>{_opt(a['world_size'])}</td><td class='n'>{a['step']:,}</td>"
        f"<td class='n'>{_opt(a['last_step'])}</td><td class='n'>{a['started'] - t0:.1f} s</td>"
        f"<td class='n'>{max(0.0, a['end'] - a['loop_started']):.1f} s</td></tr>" for a in runs)
    items = "".join(f"<li>{e(change_text(c))}</li>" for c in changes)
    return (f"<h3>Workers over time: {e(S.path_text(S.path(rows)))}</h3><table>{head}{body}</table>"
            f"<ul>{items}</ul><p class='note'>An attempt's last kept step: a failed attempt's steps after the "
            "commit the next one resumed from were trained again and are counted there.</p>")


def change_text(c: dict) -> str:
    """One size change in words: ``"step 40: 3 -> 2 workers (shrink), 18.2 s from the last step at 3 to the
    first at 2: detect 2.1 s, ...; 6 steps trained again"``; a change only the attempts say: ``"... (grow)"``."""
    text = f"step {c['step']:,}: {c['from']} \u2192 {c['to']} workers ({c['kind']})"
    if c["total_s"] is not None:
        text += f", {c['total_s']:.1f} s from the last step at {c['from']} to the first at {c['to']}"
        parts = [f"{k.replace('_', ' ')} {v:.1f} s" for k, v in (c["seconds"] or {}).items() if v >= 0.05]
        text += (": " + ", ".join(parts)) if parts else ""
    if c["steps_redone"]:
        text += f"; {c['steps_redone']} step{'s' if c['steps_redone'] != 1 else ''} trained again"
    return text


def _opt(v) -> str:
    return "-" if v is None else f"{v:,}"


def _classes(names: list) -> str | None:
    if not names:
        return None
    shown = ", ".join(str(n) for n in names[:20])
    return e(f"{len(names)}: {shown}" + (f" and {len(names) - 20} more" if len(names) > 20 else ""))


def _data_line(data: dict) -> str | None:
    lineage = data.get("lineage") or {}
    bits = []
    if lineage.get("cache"):
        bits.append(f"cache <code>{e(str(lineage['cache']))}</code>")
    if lineage.get("table"):
        bits.append(f"table <code>{e(str(lineage['table']))}</code>")
    if data.get("fingerprint"):
        bits.append(f"fingerprint <code>{e(str(data['fingerprint']))}</code>")
    return ", ".join(bits) or None


def time_table(s: dict) -> str:
    """Where the time went: the job's account when the driver closed it, else the training loop's."""
    launch = s.get("launch")
    if launch:
        seconds, fractions = launch["seconds"], launch["fractions"]
        head = f"Where the time went: {seconds_plain(launch['wall_s'])} from launch to exit"
    elif s.get("time_breakdown"):
        seconds, fractions = s["time_breakdown"]["seconds"], s["time_breakdown"]["fractions"]
        head = "Where the training loop's time went (mean per rank)"
    else:
        return ""
    # the phases that took a hundredth of a second or more, longest first
    rows = _rows((NAMES.get(k, k.replace("_", " ")), f"{v:.2f} s ({fractions.get(k, 0.0):.0%})")
                 for k, v in sorted(seconds.items(), key=lambda kv: -kv[1]) if v >= 0.005)
    return f"<h3>{e(head)}</h3><table>{rows}</table>"


def _img(uri: str, alt: str) -> str:
    if not io.exists(uri):
        return ""
    fs, path = io.filesystem(uri)
    with fs.open(path, "rb") as f:
        data = base64.b64encode(f.read()).decode()
    return f"<p><img alt='{e(alt)}' src='data:image/png;base64,{data}' style='max-width:100%'></p>"


# ------------------------------------------------------------------------------------------------ evaluation


def evaluations(run_dir: str) -> list[tuple[str, dict | str]]:
    """Each evaluated split's record (``evaluation/<split>.json``), test first; a record that cannot be read
    comes as the reason, for the page to say so."""
    folder = io.join(run_dir, EVAL_DIR)
    fs, path = io.filesystem(folder)
    try:
        names = [p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(path, detail=False)]
    except (FileNotFoundError, NotADirectoryError):
        return []
    out = []
    for name in sorted(n for n in names if n.endswith(".json")):
        split, uri = name[:-len(".json")], io.join(folder, name)
        try:
            record = io.read_json(uri)
            formats.check(record, uri)
            out.append((split, record))
        except DutycycleError as err:
            out.append((split, str(err)))
    return sorted(out, key=lambda item: (SPLIT_ORDER.get(item[0], 3), item[0]))


def evaluation(split: str, r: dict | str, run_dir: str) -> str:
    """One split's section: headline figures, notes, the per-class table, the confusion matrix and links."""
    if isinstance(r, str):
        return f"<h2>Evaluation: {e(split)}</h2><p class='note'>This evaluation could not be read: {e(r)}</p>"
    try:
        return _evaluation(split, r, run_dir)
    except (KeyError, TypeError, ValueError, AttributeError) as err:  # a record of another shape: say so
        return (f"<h2>Evaluation: {e(split)}</h2><p class='note'>This evaluation's record is malformed "
                f"({e(type(err).__name__)}: {e(str(err))})</p>")


def _evaluation(split: str, r: dict, run_dir: str) -> str:
    w, d = r.get("weights") or {}, r.get("data") or {}
    step = "the final model file" if r.get("step") is None else f"step {r['step']:,}"
    where = f"{e(d.get('source', ''))}"
    if d.get("table"):
        version = f" version {d['table_version']}" if d.get("table_version") is not None else ""
        where += f", table <code>{e(str(d['table']))}</code>{e(version)}"
    if d.get("cache"):
        where += f", cache <code>{e(str(d['cache']))}</code>"
    skipped = r.get("skipped") or {}
    skipped_text = ", ".join(f"{e(str(k))} {int(v):,}" for k, v in skipped.items()) or "none"
    macro, weighted = r["macro"], r["weighted"]
    head = _rows([
        ("weights", f"{e(step)} (<code>{e(str(w.get('from', '')))}</code>)"),
        ("samples evaluated", f"{int(r['samples']):,} of {int(r.get('rows', r['samples'])):,} rows"),
        ("rows left out", skipped_text),
        ("accuracy", f"{r['accuracy']:.2%}"),
        ("loss (mean cross-entropy)", f"{r['loss']:.4f}"),
        ("macro precision, recall, F1", f"{macro['precision']:.3f}, {macro['recall']:.3f}, {macro['f1']:.3f}"),
        ("weighted F1", f"{weighted['f1']:.3f}"),
        ("data", where),
    ])
    notes = "".join(f"<li>{e(str(n))}</li>" for n in [*(r.get("notes") or []), *(r.get("skipped_examples") or [])])
    per_class = "".join(
        f"<tr><td>{e(str(c['class']))}</td><td class='n'>{c['precision']:.3f}</td><td class='n'>{c['recall']:.3f}"
        f"</td><td class='n'>{c['f1']:.3f}</td><td class='n'>{int(c['support']):,}</td></tr>" for c in r["per_class"])
    # the split's own files by their fixed names (a name read from the record would be data, not a path)
    folder = io.join(run_dir, EVAL_DIR)
    links = [(f"{split}.json", "scores (JSON)"), (f"{split}.png", "confusion matrix (PNG)"),
             (f"{split}.parquet", "per-sample predictions (Parquet)")]
    links = " &middot; ".join(f"<a href='{e(EVAL_DIR + '/' + name, quote=True)}'>{e(text)}</a>"
                              for name, text in links if io.exists(io.join(folder, name)))
    png = _img(io.join(folder, f"{split}.png"), f"confusion matrix, {split}")
    return (f"<h2>Evaluation: {e(split)}</h2><table>{head}</table>"
            + (f"<ul class='note'>{notes}</ul>" if notes else "")
            + "<h3>Per class</h3><table><tr><th>class</th><th class='n'>precision</th><th class='n'>recall</th>"
              f"<th class='n'>F1</th><th class='n'>support</th></tr>{per_class}</table>{png}<p>{links}</p>")
