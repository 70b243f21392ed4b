"""``report.png``: loss and validation-accuracy curves, and a stacked bar of where the time went. A run whose
size changed (an elastic resize, or a resume at another size: step/sizes.py) also gets the workers it trained at
over time, each change marked on the loss curve with its sizes, and its path of sizes in the title."""

from __future__ import annotations

from dutycycle.engine import io

from . import sizes as S
from .metrics import read_metrics, read_summary
from .timing import ACCOUNT, JOB_ONE_TIME, PHASES

COLORS = {
    "data_wait": "#d62728",
    "h2d": "#ff7f0e",
    "forward_backward": "#2ca02c",
    "comm": "#1f77b4",
    "optimizer": "#98df8a",
    "checkpoint": "#9467bd",
    "eval": "#8c564b",
    "restore": "#e377c2",
    "loader_start": "#ff9896",
    "final_save": "#c5b0d5",
    "other": "#c7c7c7",
    # the job's one-time phases (launch/account.py)
    "ray_start": "#393b79", "worker_start": "#5254a3", "health_check": "#6b6ecf", "data_open": "#9c9ede",
    "model_build": "#637939", "warmup": "#8c6d31", "failures": "#843c39", "results": "#bd9e39", "teardown": "#e7ba52",
}


def write_report(run_dir: str) -> str:
    """Draw the report from ``metrics.jsonl`` and ``summary.json`` and write ``report.png``; return its URI."""
    import matplotlib.pyplot as plt

    fig = draw(read_metrics(run_dir), read_summary(run_dir))
    import io as _io

    buf = _io.BytesIO()
    # the titles as text too (PNG tEXt): what the picture says, readable without looking at it
    fig.savefig(buf, format="png", dpi=100,
                metadata={"Title": fig.get_suptitle().replace("\n", "; "),
                          "Description": fig.axes[-1].get_title()})
    plt.close(fig)
    uri = io.join(run_dir, "report.png")
    io.write_bytes_atomic(uri, buf.getvalue())
    return uri


def draw(rows: list[dict], summary: dict):
    """The report's figure (matplotlib, Agg) from a run's metrics rows and summary: the loss with the run's
    resumes and size changes marked, the workers over time when the size changed, the validation accuracy, and
    where the time went (the last panel)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r for r in rows if "loss" in r]
    evals = [r for r in rows if "val_accuracy" in r]

    changes, path = S.changes(rows), S.path(rows)
    resized = bool(changes)
    if resized:  # a fourth panel: the workers over time
        fig, (ax_loss, ax_size, ax_acc, ax_time) = plt.subplots(
            1, 4, figsize=(19, 4.2), gridspec_kw={"width_ratios": [3, 2.4, 2.4, 2]})
        _sizes_panel(ax_size, S.attempts(rows), changes)
    else:
        fig, (ax_loss, ax_acc, ax_time) = plt.subplots(1, 3, figsize=(15, 4.2),
                                                       gridspec_kw={"width_ratios": [3, 3, 2]})
    ax_loss.plot([r["step"] for r in steps], [r["loss"] for r in steps], lw=1, label="train loss")
    if evals:
        ax_loss.plot([r["step"] for r in evals], [r["val_loss"] for r in evals], "o-", ms=3, label="val loss")
    changed_at = {c["step"] for c in changes}
    for r in rows:  # where the run resumed or rolled back: the steps after it were trained again
        if r.get("event") in ("resume", "nonfinite") and r["step"] not in changed_at:
            ax_loss.axvline(r["step"], color="#9467bd", lw=0.8, ls="--")
    _mark_changes(ax_loss, changes)
    ax_loss.set(xlabel="step", ylabel="loss", title="loss" + (" (size changes marked)" if resized else ""))
    ax_loss.set_yscale("log")
    ax_loss.legend()

    if evals:
        ax_acc.plot([r["step"] for r in evals], [r["val_accuracy"] for r in evals], "o-", ms=3, color="#2ca02c")
    ax_acc.set(xlabel="step", ylabel="accuracy", title="validation accuracy", ylim=(0, 1.02))
    ax_acc.grid(alpha=0.3)

    _time_panel(ax_time, summary)

    acc = summary.get("val_accuracy")
    title = (f"{summary['steps']} steps, {summary['samples_per_s']:.0f} samples/s"
             + (f", final val accuracy {acc:.1%}" if acc is not None else "")
             + checkpoint_line(summary.get("checkpoint") or {})
             + (f"\n{sizes_line(path, changes)}" if resized else ""))
    fig.suptitle(title)
    fig.tight_layout()
    return fig


CHANGE = {"shrink": "#d62728", "grow": "#2ca02c"}  # a size change's mark on the loss curve


def sizes_line(path: list[int], changes: list[dict]) -> str:
    """The title's line for a run whose size changed: ``"workers 3 -> 2 -> 3: shrink at step 40 in 18.2 s, grow
    at step 64 in 12.0 s"`` (each change's time from the last step at the old size to the first at the new one,
    when its resize row says it)."""
    said = [f"{c['kind']} at step {c['step']}" + (f" in {c['total_s']:.1f} s" if c["total_s"] is not None else "")
            for c in changes]
    return f"workers {S.path_text(path)}: " + ", ".join(said)


def _mark_changes(ax, changes: list[dict]) -> None:
    """Each size change on the loss curve: a line at the step training continued from at the new size,
    labelled with the sizes (``3→2``); labels go down a line each so that close changes stay readable."""
    for i, c in enumerate(changes):
        ax.axvline(c["step"], color=CHANGE[c["kind"]], lw=1.2)
        ax.annotate(f"{c['from']}\u2192{c['to']}", xy=(c["step"], 1.0), xycoords=("data", "axes fraction"),
                    xytext=(2, -10 - 10 * (i % 3)), textcoords="offset points", fontsize=8, color=CHANGE[c["kind"]])


def _sizes_panel(ax, attempts: list[dict], changes: list[dict]) -> None:
    """Workers training over the run's wall time (from the first attempt's start): each attempt's size from its
    loop's start to its last row; zero between attempts (nobody trains while a group restarts, shaded)."""
    t0 = min(a["started"] for a in attempts)
    xs, ys = [], []
    for i, a in enumerate(attempts):
        w = a["world_size"] or 0
        xs += [a["loop_started"] - t0, a["end"] - t0]
        ys += [w, w]
        if i + 1 < len(attempts):
            nxt = attempts[i + 1]
            ax.axvspan(a["end"] - t0, nxt["loop_started"] - t0, color="#d62728", alpha=0.12, lw=0)
            xs += [a["end"] - t0, nxt["loop_started"] - t0]
            ys += [0, 0]
    ax.plot(xs, ys, color="#1f77b4", lw=1.5)
    for a, nxt in zip(attempts, attempts[1:], strict=False):
        if a["world_size"] != nxt["world_size"]:
            ax.annotate(f"{a['world_size']}\u2192{nxt['world_size']} at step {nxt['step']}",
                        xy=(nxt["loop_started"] - t0, nxt["world_size"] or 0), xytext=(3, 4),
                        textcoords="offset points", fontsize=8)
    top = max((a["world_size"] or 0) for a in attempts)
    ax.set(xlabel="seconds since the first attempt started", ylabel="workers training",
           title=f"workers over time ({len(changes)} size change{'s' if len(changes) != 1 else ''})",
           ylim=(0, top + 0.8))
    ax.set_yticks(range(0, top + 1))
    ax.grid(alpha=0.3)


def _time_panel(ax, summary: dict) -> None:
    """Stacked bars of where the time went: with the job's account (``summary["launch"]``), per step apart from
    once (launch to exit); without it, the training loop's account. Every figure is the summary's."""
    launch = summary.get("launch")
    if launch:
        seconds = launch["seconds"]
        bars = [("per step", [*PHASES, "other"]), ("once", list(JOB_ONE_TIME))]
        title = f"{launch['wall_s']:.0f} s launch to exit (goodput {launch['goodput']:.0%})"
    else:
        seconds = summary["time_breakdown"]["seconds"]
        bars = [(f"{summary['world_size']} worker(s), mean per rank", list(ACCOUNT))]
        title = f"training loop (goodput {summary['goodput']:.0%})"
    for x, (_, names) in enumerate(bars):
        bottom = 0.0
        for phase in names:
            v = seconds.get(phase, 0.0)
            if v <= 0:
                continue
            ax.bar([x], [v], bottom=[bottom], color=COLORS.get(phase, "#7f7f7f"), label=f"{phase} {v:.1f}s")
            bottom += v
    ax.set_xticks(range(len(bars)), [name for name, _ in bars])
    ax.set(ylabel="seconds", title=title)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))


def checkpoint_line(ck: dict) -> str:
    """Checkpoint figures for the title: stall per save, write throughput, recovery."""
    parts = []
    if ck.get("saves"):
        mbps = ck.get("write_mb_per_s")
        parts.append(f"{ck['saves']} checkpoints, loop stall {ck['stall_s']['mean'] * 1000:.0f} ms/save (rank 0)"
                     + (f", write {mbps:.0f} MB/s" if mbps else ""))
    resumed = ck.get("resumed")
    if resumed:
        parts.append(f"resumed at step {resumed['step']} in {resumed['restore_s']:.1f} s "
                     f"({resumed['steps_lost']} steps lost)")
    if ck.get("nonfinite"):
        parts.append(f"{len(ck['nonfinite'])} rollback(s)")
    return "\n" + "; ".join(parts) if parts else ""
