"""``demo.html``: one page tying the demo together: the data stages, the training result and where its time went,
the failure and the recovery, and the diagnosis, with links to the artifacts each stage left."""

from __future__ import annotations

import base64
import html
import os

from dutycycle.engine import io


def _img(uri: str | None) -> str:
    if not uri or not io.exists(uri):
        return ""
    fs, path = io.filesystem(uri)
    with fs.open(path, "rb") as f:
        data = base64.b64encode(f.read()).decode()
    return f"<p><img alt='{html.escape(os.path.basename(uri))}' src='data:image/png;base64,{data}' width='100%'></p>"


def _link(uri: str | None, text: str) -> str:
    if not uri:
        return html.escape(text)
    return f"<a href='{html.escape(uri)}'>{html.escape(text)}</a>"


def wire_formats(q: dict) -> str:
    """A run's collective wire formats as a phrase ("int8 gradients in blocks of 256, no error feedback")."""
    names = {32: "fp32", 8: "int8", 4: "int4"}
    grads, weights = q.get("grads_bits", 32), q.get("weights_bits", 32)
    parts = [f"{names.get(grads, grads)} gradients" + (f" in blocks of {q.get('block')}" if grads < 32 else "")]
    if weights < 32:
        parts.append(f"{names.get(weights, weights)} weight gathers")
    if grads < 32:
        parts.append("error feedback" if q.get("error_feedback") else "no error feedback")
        if q.get("two_hop"):
            parts.append("two hops (inside the node, then across)")
    elif q.get("grads_all_to_all"):
        parts.append("exchanged by all-to-all")
    return ", ".join(parts)


def readable(key: str, value) -> str:
    """A recorded value as a person reads it: seconds with units, no None, no float or dict reprs."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        if key.endswith("_s"):
            return f"{value:.1f} s" if value >= 10 else f"{value:.3g} s"
        return f"{value:,.3g}"
    if isinstance(value, dict):
        return ", ".join(f"{label(k)} {readable(k, v)}" for k, v in value.items())
    return str(value)


def label(key: str) -> str:
    """A recorded key as words: ``recovery_s`` -> "recovery" (its value carries the unit)."""
    return (key[:-2] if key.endswith("_s") else key).replace("_", " ")


def _lost(job: dict) -> str:
    if job.get("attempts", 1) < 2:
        return "nothing: one attempt"
    return (f"{job['failures_s']:.1f} s ({job['failures_fraction']:.0%} of the job's "
            f"{job['wall_s']:.0f} s): {job['steps_redone']} steps trained again ({job['redone_s']:.1f} s) and "
            f"{job['down_s']:.1f} s from the failed attempt's last step to the restarted one")


def _top_remedy(found: list[dict]) -> str:
    if not found:
        return ""
    r = found[0]
    return (f"<p>Top remedy: <code>{html.escape(' '.join('--set ' + x for x in r['set']))}</code>, predicted "
            f"{r['predicted_samples_per_s']:,.0f} samples/s ({html.escape(r['from'])}).</p>")


def _rows(pairs) -> str:
    return "".join(f"<tr><td>{html.escape(str(k))}</td><td>{v}</td></tr>" for k, v in pairs)


def write(out: str, result: dict) -> str:
    s, rec, dg = result["summary"], result.get("recovery") or {}, result.get("diagnosis") or {}
    e = html.escape
    stages = _rows((k, f"{v:.1f} s") for k, v in result["stages"].items())
    bd = s["time_breakdown"]
    time_rows = _rows((k, f"{bd['seconds'][k]:.1f} s ({bd['fractions'][k]:.0%})") for k in bd["seconds"]
                      if bd["seconds"][k] > 0)
    par, ck = s.get("parallel", {}), s.get("checkpoint") or {}
    train_rows = _rows([
        ("validation accuracy", f"{s['val_accuracy']:.1%}"),
        ("steps, samples/s", f"{s['steps']}, {s['samples_per_s']:.0f}"),
        ("workers, ZeRO stage", f"{s['world_size']}, {par.get('zero_stage')}"),
        ("gradient exchange", e(wire_formats(par.get("quantization", {})))),
        ("bytes sent per step per rank", f"{sum(par.get('traffic_per_step', {}).values()) / 2**20:.2f} MB"),
        ("checkpoints committed", e(readable("committed", ck.get("committed")))),
        ("stall per save (mean)", f"{ck.get('stall_s', {}).get('mean', 0) * 1000:.0f} ms" if ck else "-"),
        ("goodput (the whole job, every attempt)", f"{s['goodput']:.0%}"),
        ("lost to failures", _lost(s.get("job") or {})),
    ])
    rec_rows = _rows((label(k), e(readable(k, v))) for k, v in rec.items()) if rec else \
        "<tr><td colspan=2>no failure was injected</td></tr>"
    verdict = dg.get("verdict", {})
    body = (
        "<!doctype html><html><head><meta charset='utf-8'><title>dutycycle demo</title><style>"
        "body{font-family:sans-serif;max-width:1100px;margin:2em auto}td{padding:4px 10px;border-bottom:1px solid "
        "#ddd}h2{margin-top:1.6em}.verdict{font-size:1.15em;padding:1em;background:#f4f4f4}</style></head><body>"
        "<h1>dutycycle demo</h1>"
        f"<p>total {result['total_s']:.0f} s. Artifacts under <code>{e(out)}</code>.</p>"
        f"<h2>Data</h2><table>{stages}</table>"
        f"<p>{_link(result.get('contact_sheet'), 'contact sheet of the curated table')} &middot; cache "
        f"<code>{e(result.get('cache', ''))}</code></p>"
        f"<h2>Training</h2><table>{train_rows}</table><h3>Where the time went (mean per rank)</h3>"
        f"<table>{time_rows}</table>{_img(s.get('report'))}"
        f"<h2>Failure and recovery</h2><table>{rec_rows}</table>"
        # the headline starts with the kind ("data-bound: ...") and ends with the fix: said once
        f"<h2>Diagnosis</h2><p class='verdict'>{e(verdict.get('headline', 'not run'))}</p>"
        f"{_top_remedy(dg.get('remedies') or [])}"
        f"<p>{_link((dg.get('files') or {}).get('html'), 'the full diagnosis')}</p>"
        f"{_img((dg.get('files') or {}).get('png'))}</body></html>"
    )
    uri = io.join(out, "demo.html")
    io.write_bytes_atomic(uri, body.encode())
    return uri
