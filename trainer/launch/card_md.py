"""``MODEL_CARD.md``: the model card (card.py) as a person reads it, in the sections of Hugging Face's model
cards (the model, its training data, the training procedure, evaluation) plus the code and the environment.
Every value comes from ``model_card.json``; text from the data (class names, URIs, a curation filter) is
escaped so it cannot break a table or start markup."""

from __future__ import annotations

import json
import time

MAX_CLASS_ROWS = 100  # classes listed in the Markdown's table; the JSON holds every one


def markdown(card: dict) -> str:
    r, d, c, e, t, v = (card[k] for k in ("run", "data", "code", "environment", "training", "evaluation"))
    out = [f"# Model card: {_e(r['name'])}", "",
           f"Written {_when(card['created_at'])} by dutycycle {_e(c['version'])} from the run directory "
           f"`{_code(r['dir'])}`; every fact below is also in `model_card.json`."
           + (f" Evaluations added {_when(card['updated_at'])}." if card.get("updated_at") else "")
           + (" Written after the training by `dutycycle evaluate`: the code and environment below are the "
              "evaluating process's." if card.get("written_by") == "evaluate" else ""), ""]
    out += ["## Model", "", *_table([
        ("model", f"`{_code(r['model']['name'])}` {_code(json.dumps(r['model']['args'], sort_keys=True))}"),
        ("parameters", _num(r.get("num_params"))),
        ("classes", ", ".join(_e(x) for x in r["classes"]) or None),
        ("input", _input(r["input"])),
        ("weights", f"`{_code(r['model_file'])}`, sha256 `{r.get('weights_sha256')}`" if r.get("model_file") else None),
    ]), ""]
    out += _data(d)
    out += _training(t)
    out += _evaluation(v)
    out += _code_env(c, e)
    return "\n".join(out) + "\n"


def _data(d: dict) -> list[str]:
    table, cache = d.get("table") or {}, d.get("cache") or {}
    rows = [("source", d["source"]),
            ("table", f"`{_code(table.get('uri'))}` version {table.get('version')}" if table else None),
            ("cache", f"`{_code(cache.get('uri'))}`" if cache.get("uri") else None),
            ("fingerprint", f"`{_code(d.get('fingerprint'))}`" if d.get("fingerprint") else None),
            ("transform", f"`{_code(json.dumps(d.get('transform'), sort_keys=True))}`" if d.get("transform") else None),
            ("splits", ", ".join(f"{_e(k)} {d['splits'][k]:,}" for k in _ordered(d["splits"])) or None)]
    if cache.get("left_out"):
        rows.append(("left out of the cache", ", ".join(f"{_e(k)} {n:,}" for k, n in sorted(cache["left_out"].items()))))
    out = ["## Training data", "", *_table(rows), ""]
    if d["curation"]:
        out += ["Curation, nearest the model first:", ""]
        for step in d["curation"]:
            out.append(f"- {_curation(step)}")
        out.append("")
    if d["classes"]:
        splits = _ordered(d["classes"])
        names = list(dict.fromkeys([*(d.get("class_names") or []), *(n for s in splits for n in d["classes"][s])]))
        names = [n for n in names if any(n in d["classes"][s] for s in splits)]
        out += ["Samples per class:", "", "| class | " + " | ".join(_e(s) for s in splits) + " |",
                "|---|" + "---:|" * len(splits)]
        for name in names[:MAX_CLASS_ROWS]:
            out.append(f"| {_e(name)} | " + " | ".join(f"{d['classes'][s].get(name, 0):,}" for s in splits) + " |")
        if len(names) > MAX_CLASS_ROWS:
            out.append(f"| ... {len(names) - MAX_CLASS_ROWS:,} more classes in `model_card.json` |"
                       + " |" * len(splits))
        out.append("")
    for note in d.get("notes") or []:
        out += [f"> Note: {_e(note)}", ""]
    return out


def _curation(step: dict) -> str:
    kind = step.get("step")
    if kind == "materialize":
        where = step.get("where")
        return "cache materialized from the table" + (f" where `{_code(where)}`" if where else " (every row)")
    if kind == "curate":
        ops = "; ".join(step.get("operations") or []) or "a subset"
        return (f"table `{_code(step['table'])}` v{step.get('version')} ({_num(step.get('rows'))} rows) curated from "
                f"`{_code(step.get('parent'))}` v{step.get('parent_version')}: `{_code(ops)}`")
    if kind == "ingest":
        split = step.get("split_assignment") or {}
        how = ("" if not split else f", split by hash {split.get('fractions')}" if split.get("by") == "hash"
               else f", split by {_e(str(split.get('by')))}")
        return (f"table `{_code(step['table'])}` v{step.get('version')} ({_num(step.get('rows'))} rows) ingested "
                f"from `{_code(step.get('source'))}`{how}")
    if kind == "synthesize":
        return (f"synthetic shapes: {_num(step.get('samples'))} training images of {step.get('size')} px, "
                f"seed {step.get('seed')}")
    return _e(json.dumps(step, sort_keys=True))


def _training(t: dict) -> list[str]:
    goodput = t.get("goodput")
    rows = [("steps", _num(t["steps"])), ("epochs", _num(t["epochs"])), ("samples", _num(t["samples"])),
            ("global batch", _num(t["global_batch_size"])), ("micro-batches", _num(t["micro_batches"])),
            ("world size", " -> ".join(str(w) for w in _runs(t["world_sizes"])) or _num(t["world_size"])),
            ("layout", f"ZeRO stage {t['zero_stage']} ({t['strategy']}), {t['precision']}" if t.get("strategy") else None),
            ("loss", f"{_f(t['first_loss'])} -> {_f(t['final_loss'])}" if t.get("final_loss") is not None else None),
            ("wall time", f"{t['wall_s']:.1f} s" + (f" (the last attempt's training loop {t['loop_s']:.1f} s)"
                                                    if t.get("loop_s") is not None else "") if t.get("wall_s") else None),
            ("goodput", f"{goodput:.1%}" if isinstance(goodput, (int, float)) else None),
            ("failures survived", f"{t['failures_survived']}" + (
                f" (at steps {', '.join(map(str, t['failures']['at_steps']))}; {_f(t['failures']['lost_s'])} s lost: "
                f"{_num(t['failures']['steps_redone'])} steps redone, {_f(t['failures']['down_s'])} s down)"
                if t["failures_survived"] else "")),
            ("resizes", "; ".join(_resize(z) for z in t["resizes"]) or "none"),
            ("checkpoints", ", ".join(map(str, t["checkpoints"])) or "none kept")]
    out = ["## Training", "", *_table(rows), ""]
    if len(t["restarts"]) > 1:
        out += ["| start | step | world size | launch | cause |", "|---:|---:|---:|---:|---|"]
        for i, r in enumerate(t["restarts"], 1):
            out.append(f"| {i} | {r['step']} | {r['world_size']} | {r['launch']} | {r['cause']} |")
        out.append("")
    out += ["The resolved config is `training.config` in `model_card.json` (and `config.json`).", ""]
    return out


def _resize(z: dict) -> str:
    """``step 120: 3 -> 2 workers (resize: shrink, 21.4 s from the last step to the first at 2)``."""
    took = (f", {z['total_s']:.1f} s from the last step to the first at {z['to']}"
            if isinstance(z.get("total_s"), (int, float)) else "")
    return f"step {z['step']}: {z['from']} -> {z['to']} workers ({z['cause']}{took})"


SPLIT_ORDER = {"train": 0, "val": 1, "test": 2}


def _ordered(by_split: dict) -> list[str]:
    """Split names train, val, test, then others by name: the same order however the JSON was written."""
    return sorted(by_split, key=lambda s: (SPLIT_ORDER.get(s, 3), s))


def _runs(sizes: list) -> list:
    """Consecutive equal sizes said once: [2, 2, 3] -> [2, 3]."""
    out: list = []
    for s in sizes:
        if not out or out[-1] != s:
            out.append(s)
    return out


def _evaluation(v: dict) -> list[str]:
    out = ["## Evaluation", "", "| split | accuracy | loss | samples | model | macro F1 |", "|---|---:|---:|---:|---|---:|"]
    val = v["validation"]
    if val.get("accuracy") is not None:
        out.append(f"| val (the run's last validation) | {_pct(val['accuracy'])} | {_f(val['loss'])} | "
                   f"{_num(val['samples'])} | step {val['step']} | |")
    for split in _ordered(v["splits"]):
        r = v["splits"][split]
        if "error" in r:
            out.append(f"| {_e(split)} | unreadable: {_e(r['error'])} | | | | |")
            continue
        macro = (r.get("macro") or {}).get("f1")
        step = "final model" if r.get("step") is None else f"step {r['step']}"
        out.append(f"| {_e(split)} (dutycycle evaluate) | {_pct(r.get('accuracy'))} | {_f(r.get('loss'))} | "
                   f"{_num(r.get('samples'))} | {step} | {_f(macro)} |")
    if len(out) == 4:
        out.append("| (none) | | | | | |")
    return out + [""]


def _code_env(c: dict, e: dict) -> list[str]:
    git, project, install = c.get("git"), c.get("project_git"), c["install"]
    plugin = c.get("model_module")
    rows = [("dutycycle", f"{_e(c['version'])}, installed: {_e(install.get('kind'))}"
             + (f" ({_code(install.get('url'))})" if install.get("url") else "")),
            ("dutycycle's revision", _rev(git) if git else "no git checkout (an installed package): its version is "
                                                           "the record" + (f", pip's commit {install['commit']}"
                                                                           if install.get("commit") else "")),
            ("working directory's repository", _rev(project) if project else None),
            ("model module", f"`{_code(plugin['file'])}` sha256 `{plugin['sha256']}`" if plugin else None),
            ("Python", f"{e['python']} ({e['implementation']})"), ("platform", _e(e["platform"])),
            *((name, e["packages"][name] or "not installed") for name in sorted(e["packages"]))]
    hw = e["hardware"]
    drv, wk = hw["driver"], hw["workers"]
    mem = f", {drv['memory_bytes'] / 2**30:.0f} GiB" if drv.get("memory_bytes") else ""
    rows += [("this machine", f"{_e(drv['host'])}: {_e(drv.get('cpu') or drv['machine'])}, {drv['cpus']} CPUs{mem}"),
             ("workers", f"{wk['world_size']} on {wk['device']}" + (f", {wk['nodes']} node(s)" if wk.get("nodes") else "")
              + (f", hosts {', '.join(_e(h) for h in wk['hosts'])}" if wk["hosts"] else "")
              + (f", {', '.join(_e(a) for a in wk['accelerators'])}" if wk["accelerators"] else "")
              + f", {wk['cpus_per_worker']} CPU(s) each")]
    return ["## Code and environment", "", *_table(rows), ""]


def _rev(g: dict) -> str:
    return f"`{g['commit']}`" + (" with uncommitted changes (dirty)" if g.get("dirty") else " (clean)") + \
        f" in `{_code(g['root'])}`"


def _input(i: dict) -> str | None:
    if not i.get("channels"):
        return None
    norm = i.get("normalize")
    how = f", normalized with mean {_fl(norm['mean'])} and std {_fl(norm['std'])}" if norm else ", scaled to 0..1"
    return f"{i['channels']} x {i['size']} x {i['size']}{how}"


def _table(rows) -> list[str]:
    kept = [(k, v) for k, v in rows if v not in (None, "")]
    return ["| | |", "|---|---|", *(f"| {k} | {v} |" for k, v in kept)]


def _e(text) -> str:
    """Text from data, safe in a Markdown table cell: markup and pipes escaped, on one line."""
    s = str(text).replace("\\", "\\\\").replace("\n", " ").replace("\r", " ")
    for ch in "|`*_[]<>#":
        s = s.replace(ch, "\\" + ch)
    return s.replace("&", "&amp;") if "&" in s else s


def _code(text) -> str:
    """Text inside an inline code span: backticks and pipes cannot end it or the cell."""
    return str(text).replace("`", "'").replace("|", "\\|").replace("\n", " ")


def _num(x) -> str | None:
    return None if x is None else f"{x:,}" if isinstance(x, int) else str(x)


def _f(x) -> str:
    return "" if x is None else f"{x:.4g}" if isinstance(x, float) else str(x)


def _fl(xs) -> str:
    return "[" + ", ".join(f"{x:.3f}" for x in xs) + "]"


def _pct(x) -> str:
    return "" if x is None else f"{x:.2%}"


def _when(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(t))
