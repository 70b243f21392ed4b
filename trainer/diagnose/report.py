"""What ``dutycycle diagnose`` leaves behind: ``diagnosis.json`` (every number), ``diagnosis.png`` (rates, where
the step's time goes, memory per stage against the budget) and ``diagnosis.html`` (the verdict, the experiments'
tables and the picture, one self-contained file)."""

from __future__ import annotations

import base64
import html
import io as _io
import json
import textwrap

from dutycycle.engine import formats, io
from dutycycle.engine.numbers import megabytes
from dutycycle.trainer.step.report import (
    COLORS,  # the run report's colours: a wait looks the same in both pictures
)

from .experiments import EXPERIMENTS
from .failures import duration, workers_text
from .remedies import change_text, measured_text, predicted_text


def describe(key: str, res: dict) -> str:
    """One line a person reads per experiment (the progress line and the HTML table's summary)."""
    if "error" in res:
        return f"failed: {res['error']}"
    if res.get("applicable") is False:
        return f"not applicable: {res['why']}"
    if "skipped" in res:
        return f"skipped: {res['skipped']}"
    if key == "compute":
        mfu = f", MFU {res['mfu']:.1%}" if res.get("mfu") else ""
        line = (f"{res['samples_per_s']:,.0f} samples/s ({res['samples_per_s_per_worker']:,.0f} per worker x "
                f"{res['workers']}, {res['device']}{mfu})")
        t = res.get("trainer") or {}
        flat = res.get("trainer_flat") or {}
        if "compute_s" in t:  # the trainer's own step in its layout, beside its flat one
            line += f"; the trainer's step in its layout ({t['layout']}) {t['compute_s'] * 1e3:.1f} ms"
            if "compute_s" in flat and flat != t:
                line += f", at stage 0 with nothing quantized {flat['compute_s'] * 1e3:.1f} ms"
        if res.get("bare_samples_per_s_per_worker"):  # the trainer's flat step was the faster: the ceiling
            line += (f"; the ceiling is the trainer's flat step (the bare loop's "
                     f"{res['bare_samples_per_s_per_worker']:,.0f} samples/s per worker was slower)")
        elif "error" in t:
            line += f"; the trainer's step in its layout not measured: {t['error']}"
        return line
    if key == "loader":
        names = [k for k in ("raw", "cache", "synthetic", "in_ram") if k in res]
        line = ", ".join(f"{k} {res[k]:,.0f} samples/s" for k in names)
        return line + "".join(f"; {k} not measured: {why}" for k, why in (res.get("not_measured") or {}).items())
    if key == "end_to_end":
        parts = []
        for name in ("cache", "raw", "synthetic"):
            if name in res:
                r = res[name]
                parts.append(f"{name}: {r['samples_per_s']:,.0f} samples/s, data wait {r['data_wait_share']:.0%}, "
                             f"communication {r['comm_share']:.0%}")
        return "; ".join(parts)
    if key == "contention":
        b = res.get("beside") or {}
        cores = (f"; the loader's {b['loader_threads']} threads and {b['loader_processes']} processes took "
                 f"{b['loader']:.1f} of {res['cores']} cores, the step {b['step']:.1f}, other processes "
                 f"{b['others']:.1f}") if b else ""
        return (f"the step {res['alone_step_s'] * 1e3:,.0f} ms alone, {res['beside_step_s'] * 1e3:,.0f} ms beside "
                f"the {res['source']} loader ({res['slowdown']:+.0%}){cores}")
    if key == "h2d":
        return f"{res['copy_s_per_batch'] * 1000:.2f} ms per batch ({res['gb_per_s']:.1f} GB/s)"
    if key == "scaling":
        line = (f"{res['workers']} workers {res['speedup']:.2f}x of 1 (efficiency {res['efficiency']:.0%}), "
                f"communication {res['many']['comm_share']:.0%} of the step")
        if "quantized" in res:
            q = res["quantized"]
            line += f"; quantized: {q['speedup']:.2f}x, communication {q['comm_share']:.0%}"
        return line
    if key == "checkpoint":
        return (f"stall per save {res['sync']['stall_s_per_save']:.3f} s synchronous, "
                f"{res['async']['stall_s_per_save']:.3f} s asynchronous")
    if key == "failures":
        return failures_line(res)
    if key == "memory":
        mine = res["configured"]

        offload = {True: " + offload", "nvme": " + NVMe offload"}.get(mine["offload"], "")
        return (f"stage {mine['zero_stage']}{offload}: "
                f"{megabytes(mine['device_bytes'])} of model state per rank, "
                f"budget {megabytes(res['budget_bytes'])} "
                f"({'fits' if mine['fits'] else 'does not fit'})")
    return json.dumps(res)[:200]


def failures_line(res: dict) -> str:
    """The failures experiment in one line: what it measured, the job, and its ETTR without checkpoints, as
    configured and at the recommended interval."""
    m = res["measured"]
    every, best = res["configured_every"], res["recommended_every"]
    line = (f"save stall {m['save_s']:.3f} s, restart {m['restart_s']:.1f} s (launch {m['launch_s']:.1f} s + "
            f"restore {m['restore_s']:.2f} s), detection {res['costs']['detect_s']:.1f} s; the job: "
            f"{res['job_steps']:,} steps, {duration(res['job_s'])} at {workers_text(res['workers'])}, a failure every "
            f"{duration(res['mtbf_s'])}; ETTR {res['ettr_no_checkpoints']:.1%} without checkpoints")
    if every:
        line += f", {res['ettr']:.1%} at checkpoint.every = {every}"
    if best:
        line += f", {res['ettr_recommended']:.1%} at checkpoint.every = {best} (recommended, {res['recommended_by']})"
    else:
        line += f"; no checkpoints needed for failures (they would gain under {res['margin'] * 100:g} point of ETTR)"
    return line


def _failures_table(result: dict) -> str:
    """The failures model on the page: which model, the job, and the ETTR of each plan it compared."""
    res = (result.get("findings") or {}).get("failures") or {}
    if "intervals" not in res:
        return ""
    plans = [("no checkpoints", "-", res["ettr_no_checkpoints"])]
    if res["configured_every"]:
        plans.append(("configured", f"{res['configured_every']:,}", res["ettr"]))
    names = {"young": "Young: sqrt(2 C M)", "daly": "Daly (higher order)",
             "nvidia": "NVIDIA: sqrt(2 (M + D + R) C + C^2)", "exact": "exact model's best (searched)"}
    plans += [(names[k], f"{res['intervals'][k]['every']:,}", res["intervals"][k]["ettr"]) for k in names
              if k in res["intervals"]]
    rec = ("no checkpoints" if not res["recommended_every"] else
           f"checkpoint.every = {res['recommended_every']:,} ({res['recommended_by']})")
    rows = "".join(f"<tr><td>{html.escape(n)}</td><td>{e}</td><td>{r:.2%}</td></tr>" for n, e, r in plans)
    return (f"<h2>Failures</h2><p>{html.escape(res['model'])}. The job: {res['job_steps']:,} steps, "
            f"{html.escape(duration(res['job_s']))} of training ({html.escape(res['job_from'])}) at "
            f"{workers_text(res['workers'])}, a failure every {html.escape(duration(res['mtbf_s']))}; detection "
            f"{res['costs']['detect_s']:.1f} s ({html.escape(res['detect_from'])}), restart "
            f"{res['costs']['restart_s']:.1f} s, save stall {res['costs']['save_s']:.3f} s. Recommended: "
            f"{html.escape(rec)}, ETTR {res['ettr_recommended']:.2%} (no checkpoints when they gain under "
            f"{res['margin'] * 100:g} point of ETTR).</p><table><tr><th>plan</th><th>checkpoint.every</th><th>ETTR</th></tr>"
            + rows + "</table>")


GAP_PARTS = (("data_wait", "data wait"), ("contention", "step slowed by the loader"),
             ("communication", "communication"), ("checkpoint", "checkpoint"),
             ("layout", "the layout's work beyond the model's step"),
             ("overhead", "host work outside the step's compute"), ("unexplained", "unexplained"))


def gap_text(v: dict) -> str | None:
    """The run against its compute ceiling, and the parts its gap splits into (they add up to it)."""
    gap = v.get("gap") or {}
    if not gap:
        return None
    parts = gap.get("parts") or {}
    said = ", ".join(f"{label} {parts[k]:.0%}" for k, label in GAP_PARTS if k in parts)
    line = (f"the run trains at {gap['samples_per_s']:,.0f} samples/s against a compute ceiling of "
            f"{gap['ceiling_samples_per_s']:,.0f}: a gap of {gap['share']:.0%} of its step = {said}")
    if gap["share"] < 0:  # the ceiling was measured on a busier machine than the run
        line += " (the run measured faster than its ceiling: the machine's load changed between the experiments)"
    return line


def picture(findings: dict, found: list[dict] | None = None) -> bytes:
    import matplotlib.pyplot as plt

    fig = figure(findings, found)
    buf = _io.BytesIO()
    fig.savefig(buf, format="png", dpi=90)
    plt.close(fig)
    return buf.getvalue()


def figure(findings: dict, found: list[dict] | None = None):
    """The diagnosis picture as a matplotlib figure: rates, waits per run, model state per ZeRO stage, and,
    once --verify ran a remedy, its prediction beside what it measured; a panel with nothing measured says why."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    checked = [r for r in found or [] if "measured_over_predicted" in r]
    fig, axes = plt.subplots(1, 4 if checked else 3, figsize=(20 if checked else 15, 4.2))
    a, b, c = axes[:3]
    if checked:
        _remedy_bars(axes[3], checked)
    rates = {}
    comp, load, e2e = findings.get("compute", {}), findings.get("loader", {}), findings.get("end_to_end", {})
    if "samples_per_s" in comp:
        rates["compute ceiling"] = comp["samples_per_s"]
    for k in ("raw", "cache", "synthetic", "in_ram"):
        if isinstance(load.get(k), float):
            rates[f"loader: {k}"] = load[k]
    for k in ("cache", "raw", "synthetic"):
        if isinstance(e2e.get(k), dict):
            rates[f"training: {k}"] = e2e[k]["samples_per_s"]
    if rates:
        a.barh(list(rates), list(rates.values()), color="#1f77b4")
        a.set_xscale("log")
        a.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())  # minor labels overlap on a log axis
        a.set(title="samples/s", xlabel="samples/s (log)")
    else:
        _missing(a, "samples/s", findings, ("compute", "loader", "end_to_end"))

    runs = {}
    for k in ("cache", "raw", "synthetic"):
        if isinstance(e2e.get(k), dict):
            runs[f"{k}"] = e2e[k]
    sc = findings.get("scaling", {})
    if isinstance(sc.get("many"), dict):
        runs["1 worker (synthetic)"] = sc["one"]
        runs[f"{sc['workers']} workers"] = sc["many"]
        if "quantized" in sc:
            runs[f"{sc['workers']} workers, quantized"] = sc["quantized"]
    names = list(runs)
    if not names:
        _missing(b, "waits, share of the step", findings, ("end_to_end", "scaling"))
    left = [0.0] * len(names)
    for share, color, label in (("data_wait_share", COLORS["data_wait"], "data wait"),
                                ("comm_share", COLORS["comm"], "communication"),
                                ("checkpoint_share", COLORS["checkpoint"], "checkpoint")):
        values = [runs[n].get(share, 0.0) for n in names]
        b.barh(names, values, left=left, color=color, label=label)
        left = [x + v for x, v in zip(left, values, strict=True)]
    if names:
        b.set(title="waits, share of the step", xlim=(0, 1))
        b.legend(fontsize=8)

    mem = findings.get("memory", {})
    if "rows" in mem:
        labels = [f"{r['zero_stage']}{ {True: '+off', 'nvme': '+nvme'}.get(r['offload'], '')}"
                  f"{'/h' + str(r['replicate']) if r.get('replicate', 1) > 1 else ''}"
                  f"{'/t' + str(r['tensor']) if r.get('tensor', 1) > 1 else ''}" for r in mem["rows"]]

        held = [r["device_bytes"] / 2**20 for r in mem["rows"]]
        bars = c.bar(labels, held, color=["#2ca02c" if r["fits"] else "#d62728" for r in mem["rows"]])
        c.bar_label(bars, [megabytes(r["device_bytes"]) for r in mem["rows"]], fontsize=7)
        budget = mem["budget_bytes"] / 2**20
        title = ("model state per rank by layout\n(+off: host offload, +nvme: state on disk, /hR: R replica groups, "
                 "/tT: tensor parallel over T)")
        if budget <= 20 * max(held, default=0.0):
            c.axhline(budget, color="k", ls="--", label="budget per rank")
            c.legend(fontsize=8)
        else:  # a line that far above would flatten every bar to nothing
            title += f"\n(budget per rank {megabytes(mem['budget_bytes'])}, off the scale)"
        c.set(title=title, ylabel="MB")
    else:
        _missing(c, "model state per rank by ZeRO stage", findings, ("memory",))
    fig.tight_layout()
    return fig


def _remedy_bars(ax, checked: list[dict]) -> None:
    """Each verified remedy: predicted and measured, as a ratio to the prediction (one scale for rates and
    bytes), with the figures on the bars."""
    names = [f"{r['for']}: {' '.join(r['set'])}" for r in checked]  # verified: config changes only
    ys = range(len(checked))
    ax.barh([y + 0.2 for y in ys], [1.0] * len(checked), height=0.4, color="#c7c7c7", label="predicted")
    bars = ax.barh([y - 0.2 for y in ys], [r["measured_over_predicted"] for r in checked], height=0.4,
                   color="#1f77b4", label="measured (--verify)")
    ax.bar_label(bars, [f"{r['measured_over_predicted']:.2f}x" for r in checked], fontsize=8)
    ax.set_yticks(list(ys), [_short(n) for n in names], fontsize=8)
    ax.axvspan(0.85, 1.15, color="#2ca02c", alpha=0.08)  # within 15% of the prediction
    ax.set(title="remedies: measured / predicted", xlim=(0, max(1.6, *(r["measured_over_predicted"] * 1.15
                                                                     for r in checked))))
    ax.legend(fontsize=7, loc="lower right")


def _short(text: str, width: int = 28) -> str:
    return "\n".join(textwrap.wrap(text, width)[:3])


def _missing(ax, title: str, findings: dict, keys: tuple[str, ...]) -> None:
    """A panel whose experiments gave nothing to draw says why (skipped, failed, not run), not empty axes."""
    titles = {key: t for key, t, _ in EXPERIMENTS}
    why = [f"{titles.get(k, k)}: " + (describe(k, findings[k]) if k in findings else "not run") for k in keys]
    ax.set_axis_off()
    ax.set_title(title)
    ax.text(0.5, 0.5, "\n".join(textwrap.fill(w, 48) for w in why), ha="center", va="center", fontsize=9,
            color="#555555", transform=ax.transAxes)


def _shares_table(v: dict) -> str:
    """Each wait's share of the step with its 90% interval: what the verdict compared; ``unexplained`` last, and
    the gap to the compute ceiling the step's shares add up to."""
    if not v.get("shares"):
        return ""
    iv = v.get("intervals") or {}
    order = sorted(v["shares"].items(), key=lambda kv: (kv[0] in ("overhead", "unexplained"), -kv[1]))
    rows = "".join(f"<tr><td>{html.escape(k)}</td><td>{s:.1%}</td><td>"
                   + (f"{iv[k][0]:.1%} to {iv[k][1]:.1%}" if k in iv else "one measurement") + "</td></tr>"
                   for k, s in order)
    gap = gap_text(v)
    return ("<table><tr><th>wait</th><th>share of the step</th><th>90% interval</th></tr>" + rows + "</table>"
            + (f"<p>{html.escape(gap)} (failures, modelled over wall time, stand beside)</p>" if gap else ""))


def _remedies_table(result: dict) -> str:
    """Each remedy as settings, the rate predicted from the measured components and, after --verify, measured."""
    found = result.get("remedies") or []
    if not found:
        return ""
    rows = "".join(
        f"<tr><td>{html.escape(r['for'])}</td><td><code>{html.escape(change_text(r))}"
        f"</code></td><td>{html.escape(predicted_text(r))}</td><td>"
        + html.escape(measured_text(r) or r.get("verify_error", "not run (--verify runs the first)"))
        + f"</td><td>{html.escape(r['from'])}</td></tr>" for r in found)
    return ("<h2>Remedies</h2><table><tr><th>wait</th><th>change</th><th>predicted</th>"
            "<th>measured (--verify)</th><th>predicted from</th></tr>" + rows + "</table>")


def page(result: dict, png: bytes) -> str:
    v = result["verdict"]
    titles = {key: title for key, title, _ in EXPERIMENTS}
    rows = "".join(f"<tr><td>{html.escape(titles[key])}</td><td>{html.escape(describe(key, res))}</td></tr>"
                   for key, res in result["findings"].items())
    img = base64.b64encode(png).decode()
    return (
        "<!doctype html><html><head><meta charset='utf-8'><title>dutycycle diagnose</title>"
        "<style>body{font-family:sans-serif;max-width:1100px;margin:2em auto}td{padding:4px 10px;"
        "border-bottom:1px solid #ddd;vertical-align:top}.verdict{font-size:1.2em;padding:1em;background:#f4f4f4}"
        "</style></head><body>"
        f"<h1>dutycycle diagnose</h1><p>config: <code>{html.escape(result['config_name'])}</code></p>"
        # the headline starts with the kind and ends with the fix: each said once
        f"<p class='verdict'>{html.escape(v['headline'])}</p>{_shares_table(v)}{_remedies_table(result)}"
        f"{_failures_table(result)}"
        f"<table>{rows}</table><p><img alt='diagnosis' src='data:image/png;base64,{img}' width='100%'></p>"
        "<p>Every number is in diagnosis.json beside this page.</p></body></html>"
    )


def write(out: str, result: dict) -> dict[str, str]:
    png = picture(result["findings"], result.get("remedies"))
    paths = {"json": io.join(out, "diagnosis.json"), "png": io.join(out, "diagnosis.png"),
             "html": io.join(out, "diagnosis.html")}
    io.write_bytes_atomic(paths["png"], png)
    io.write_bytes_atomic(paths["html"], page(result, png).encode())
    io.write_json_atomic(paths["json"], formats.stamp(result))
    return paths
