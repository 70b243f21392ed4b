"""``demo.html``: one page tying the demo together: the data stages, the training result and where its time went,
the failure and the recovery (``--elastic``: the node lost and added back, and the sizes the run trained at), and
the diagnosis, with links to the artifacts each stage left."""

from __future__ import annotations

import base64
import html
import os

from dutycycle.engine import io
from dutycycle.engine.numbers import figure, seconds_plain
from dutycycle.trainer.diagnose.remedies import predicted_text
from dutycycle.trainer.launch.account import NAMES
from dutycycle.trainer.launch.runpage import change_text
from dutycycle.trainer.step.sizes import path_text
from dutycycle.trainer.step.timing import JOB_ONE_TIME, PHASES

e = html.escape


def _img(uri: str | None) -> str:
    if not uri or not io.exists(uri):
        return ""
    fs, path = io.filesystem(uri)
    with fs.open(path, "rb") as f:
        data = base64.b64encode(f.read()).decode()
    return f"<p><img alt='{html.escape(os.path.basename(uri))}' src='data:image/png;base64,{data}' width='100%'></p>"


def _link(uri: str | None, text: str, base: str = "") -> str:
    """A link; a local file under ``base`` (the page's folder) is linked relative to it, so the folder can move."""
    if not uri:
        return html.escape(text)
    if base and io.protocol(uri) == "file" and io.protocol(base) == "file":
        uri = os.path.relpath(uri, base)
    return f"<a href='{html.escape(uri)}'>{html.escape(text)}</a>"


def wire_formats(q: dict, precision: str = "fp32") -> str:
    """A run's collective wire formats as a phrase ("int8 gradients in blocks of 256, no error feedback").
    ``precision``: the run's; unquantized collectives send its reduction dtype (fp64 runs float64, fp32 and bf16
    runs float32: FSDP2 reduces bf16 gradients in fp32)."""
    names = {32: "fp64" if precision == "fp64" else "fp32", 8: "int8", 4: "int4"}
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
        return seconds_plain(value) if key.endswith("_s") else figure(value)
    if isinstance(value, dict):
        return ", ".join(f"{label(k)} {readable(k, v)}" for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return ", ".join(readable(key, v) for v in value) or "none"
    return str(value)


def label(key: str) -> str:
    """A recorded key as words: ``recovery_s`` -> "recovery" (its value carries the unit)."""
    return (key[:-2] if key.endswith("_s") else key).replace("_", " ")


def _lost(launch: dict) -> str:
    if launch.get("attempts", 1) < 2:
        return "nothing: one attempt"
    f = launch["failures"]
    return (f"{launch['seconds']['failures']:.1f} s: {f['redone_s']:.1f} s of steps trained again, "
            f"{f['restart_s']:.1f} s to notice the failure and restart")


def checkpoint_rows(s: dict) -> list[tuple[str, str]]:
    """A checkpoint's three costs, each under its own name: the loop's stall (rank 0's, as the summary's
    ``checkpoint.stall_s``), the writes in the background, and the wait for the last save at the end."""
    ck = s.get("checkpoint") or {}
    if not ck.get("saves"):
        return [("checkpoints", "none")]
    st = ck["stall_s"]
    final = s["time_breakdown"]["seconds"].get("final_save", 0.0)  # the job's account carries the same figure
    return [("checkpoint stall in the loop (rank 0)",
             f"{st['total']:.2f} s over {ck['saves']} saves, {st['mean'] * 1000:.0f} ms each"),
            ("checkpoint writes in the background", f"{ck.get('write_s_total', 0.0):.2f} s"),
            ("final save and its wait", f"{final:.2f} s")]


def parity_line(pc: dict) -> str:
    """The run's parity checks in words (trainer/parallel/check.py's summary)."""
    if not pc.get("checks"):
        return f"every {pc['every']} steps: no step reached it"
    verdict = "passed" if pc["passed"] else "FAILED"
    return (f"{verdict} at step{'s' if pc['checks'] > 1 else ''} {', '.join(map(str, pc['steps']))}: largest error "
            f"{pc['max_rel_error']:.2%} of the gradient against a bound of {pc['bound']:.2%}, "
            f"{pc['seconds_per_check']:.2f} s per check")


def time_tables(s: dict) -> str:
    """Where the time went: from launch to exit when the job's account is there (per step apart from once),
    else the training loop's (mean per rank)."""

    if not s.get("launch"):
        bd = s["time_breakdown"]
        rows = _rows((NAMES.get(k, k), f"{v:.1f} s ({bd['fractions'][k]:.0%})") for k, v in bd["seconds"].items()
                     if v > 0)
        return f"<h3>Where the training loop's time went (mean per rank)</h3><table>{rows}</table>"
    a = s["launch"]
    sec, fr = a["seconds"], a["fractions"]

    def rows(names) -> str:
        return _rows((NAMES[k], f"{sec[k]:.2f} s ({fr[k]:.1%})") for k in names if sec[k] > 0)

    return (f"<h3>Where the time went: {a['wall_s']:.1f} s from launch to exit</h3>"
            f"<table><tr><th colspan=2>per step ({a['per_step_s']:.1f} s: what a longer run pays more of; "
            f"mean per rank)</th></tr>{rows(PHASES)}"
            f"<tr><th colspan=2>once ({a['one_time_s']:.1f} s: what a short run pays)</th></tr>"
            f"{rows(JOB_ONE_TIME)}<tr><th colspan=2>the rest</th></tr>{rows(['other'])}</table>")


def _top_remedy(found: list[dict]) -> str:

    if not found:
        return ""
    r = found[0]
    return (f"<p>Top remedy: <code>{html.escape(' '.join('--set ' + x for x in r['set']))}</code>, predicted "
            f"{html.escape(predicted_text(r))} ({html.escape(r['from'])}).</p>")


def _rows(pairs) -> str:
    return "".join(f"<tr><td>{html.escape(str(k))}</td><td>{v}</td></tr>" for k, v in pairs)


def elastic_section(el: dict) -> str:
    """``--elastic``: what the demo did to the cluster and when, what the run did about it, and each change of
    size with what it cost (the run's resize rows, launch/account.py)."""
    def at(seconds, step) -> str:
        return "-" if seconds is None else f"{seconds:.1f} s after launch, at step {step}"

    rows = [
        ("workers over time", e(path_text(el["sizes"])) if el.get("sizes") else "-"),
        ("node removed (raylet and its worker killed)", e(at(el["removed_at_s"], el["removed_at_step"]))),
        ("training on fewer workers", e(f"{el['shrunk_to']} workers from step {el['shrunk_at_step']}, the first "
                                        f"step {el['loss_to_step_s']:.1f} s after the node was lost")
         if el.get("loss_to_step_s") is not None else "-"),
        ("node added back", e(at(el["added_at_s"], el["added_at_step"]))),
        ("training on more workers again", e(f"{el['grown_to']} workers from step {el['grown_at_step']}, the first "
                                             f"step {el['add_to_step_s']:.1f} s after the node came back")
         if el.get("add_to_step_s") is not None else "-"),
    ]
    changes = "".join(f"<li>{e(change_text(c))}</li>" for c in el.get("resizes") or [])
    stopped = (f"<p class='note'>The demo's cluster changes stopped short: {e(el['error'])}</p>"
               if el.get("error") else "")
    return (f"<h2>Elastic training</h2><table>{_rows(rows)}</table>{stopped}"
            + (f"<h3>Each change of size</h3><ul>{changes}</ul>" if changes else ""))


def write(out: str, result: dict) -> str:
    s, rec, dg = result["summary"], result.get("recovery") or {}, result.get("diagnosis") or {}
    sizes = (result.get("elastic") or {}).get("sizes") or []
    stages = _rows((k, f"{v:.1f} s") for k, v in result["stages"].items())
    time_html = time_tables(s)
    par, ck = s.get("parallel", {}), s.get("checkpoint") or {}
    train_rows = _rows([
        ("validation accuracy", f"{s['val_accuracy']:.1%}"),
        ("steps, samples/s", f"{s['steps']}, {s['samples_per_s']:.0f}"),
        ("workers, ZeRO stage", f"{e(path_text(sizes)) if len(sizes) > 1 else s['world_size']}, "
                                f"{par.get('zero_stage')}"),
        ("gradient exchange", e(wire_formats(par.get("quantization", {}), par.get("precision", "fp32")))),
        ("bytes sent per step per rank", f"{sum(par.get('traffic_per_step', {}).values()) / 2**20:.2f} MB"),
        ("checkpoints committed", e(readable("committed", ck.get("committed")))),
        *checkpoint_rows(s),
        *([("parity check (parallel.check_every)", e(parity_line(s["parity_check"])))] if s.get("parity_check") else []),
        *(([("goodput, launch to exit", f"{s['launch']['goodput']:.0%}"),
            ("lost to failures", e(_lost(s["launch"])))]) if s.get("launch") else []),
    ])
    rec_rows = _rows((label(k), e(readable(k, v))) for k, v in rec.items() if v is not None) if rec else \
        "<tr><td colspan=2>no failure was injected</td></tr>"
    failure = (elastic_section(result["elastic"]) if result.get("elastic")
               else f"<h2>Failure and recovery</h2><table>{rec_rows}</table>")
    verdict = dg.get("verdict", {})
    # the headline starts with the kind ("data-bound: ...") and ends with the fix: said once
    diagnosis = (
        f"<h2>Diagnosis</h2><p class='verdict'>{e(verdict.get('headline', 'not run'))}</p>"
        f"{_top_remedy(dg.get('remedies') or [])}"
        f"<p>{_link((dg.get('files') or {}).get('html'), 'the full diagnosis', out)}</p>"
        f"{_img((dg.get('files') or {}).get('png'))}") if result.get("diagnosis") is not None else ""
    body = (
        "<!doctype html><html><head><meta charset='utf-8'><title>dutycycle demo</title><style>"
        "body{font-family:sans-serif;max-width:1100px;margin:2em auto}td{padding:4px 10px;border-bottom:1px solid "
        "#ddd}h2{margin-top:1.6em}.verdict{font-size:1.15em;padding:1em;background:#f4f4f4}</style></head><body>"
        "<h1>dutycycle demo</h1>"
        f"<p>total {result['total_s']:.0f} s. Artifacts under <code>{e(out)}</code>.</p>"
        f"<h2>Data</h2><table>{stages}</table>"
        f"<p>{_link(result.get('contact_sheet'), 'contact sheet of the curated table', out)} &middot; cache "
        f"<code>{e(result.get('cache', ''))}</code></p>"
        f"<h2>Training</h2><table>{train_rows}</table>{time_html}{_img(s.get('report'))}"
        f"{failure}{diagnosis}</body></html>"
    )
    uri = io.join(out, "demo.html")
    io.write_bytes_atomic(uri, body.encode())
    return uri
