"""``report.png``: loss and validation-accuracy curves, and a stacked bar of where the time went."""

from __future__ import annotations

from dutycycle.engine import io

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
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(run_dir)
    summary = read_summary(run_dir)
    steps = [r for r in rows if "loss" in r]
    evals = [r for r in rows if "val_accuracy" in r]

    fig, (ax_loss, ax_acc, ax_time) = plt.subplots(1, 3, figsize=(15, 4.2), gridspec_kw={"width_ratios": [3, 3, 2]})
    ax_loss.plot([r["step"] for r in steps], [r["loss"] for r in steps], lw=1, label="train loss")
    if evals:
        ax_loss.plot([r["step"] for r in evals], [r["val_loss"] for r in evals], "o-", ms=3, label="val loss")
    for r in rows:  # where the run resumed or rolled back: the steps after it were trained again
        if r.get("event") in ("resume", "nonfinite"):
            ax_loss.axvline(r["step"], color="#9467bd", lw=0.8, ls="--")
    ax_loss.set(xlabel="step", ylabel="loss", title="loss")
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
             + checkpoint_line(summary.get("checkpoint") or {}))
    fig.suptitle(title)
    fig.tight_layout()
    import io as _io

    buf = _io.BytesIO()
    # the titles as text too (PNG tEXt): what the picture says, readable without looking at it
    fig.savefig(buf, format="png", dpi=100,
                metadata={"Title": title.replace("\n", "; "), "Description": ax_time.get_title()})
    plt.close(fig)
    uri = io.join(run_dir, "report.png")
    io.write_bytes_atomic(uri, buf.getvalue())
    return uri


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
