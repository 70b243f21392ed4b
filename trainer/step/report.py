"""``report.png``: loss and validation-accuracy curves, and a stacked bar of where the time went."""

from __future__ import annotations

from dutycycle.engine import io

from .metrics import read_metrics
from .timing import ACCOUNT

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
}


def write_report(run_dir: str) -> str:
    """Draw the report from ``metrics.jsonl`` and ``summary.json`` and write ``report.png``; return its URI."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(run_dir)
    summary = io.read_json(io.join(run_dir, "summary.json"))
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

    seconds = summary["time_breakdown"]["seconds"]
    bottom = 0.0
    for phase in ACCOUNT:
        v = seconds.get(phase, 0.0)
        if v <= 0:
            continue
        ax_time.bar([0], [v], bottom=[bottom], color=COLORS[phase], label=f"{phase} {v:.1f}s")
        bottom += v
    ax_time.set_xticks([0], [f"{summary['world_size']} worker(s), mean per rank"])
    ax_time.set(ylabel="seconds", title=f"time (goodput {summary['goodput']:.0%})")
    ax_time.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))

    acc = summary.get("val_accuracy")
    fig.suptitle(
        f"{summary['steps']} steps, {summary['samples_per_s']:.0f} samples/s"
        + (f", final val accuracy {acc:.1%}" if acc is not None else "")
        + checkpoint_line(summary.get("checkpoint") or {})
    )
    fig.tight_layout()
    import io as _io

    buf = _io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    plt.close(fig)
    uri = io.join(run_dir, "report.png")
    io.write_bytes_atomic(uri, buf.getvalue())
    return uri


def checkpoint_line(ck: dict) -> str:
    """Checkpoint figures for the title: stall per save, write throughput, recovery."""
    parts = []
    if ck.get("saves"):
        mbps = ck.get("write_mb_per_s")
        parts.append(f"{ck['saves']} checkpoints, stall {ck['stall_s']['mean'] * 1000:.0f} ms/save"
                     + (f", write {mbps:.0f} MB/s" if mbps else ""))
    resumed = ck.get("resumed")
    if resumed:
        parts.append(f"resumed at step {resumed['step']} in {resumed['restore_s']:.1f} s "
                     f"({resumed['steps_lost']} steps lost)")
    if ck.get("nonfinite"):
        parts.append(f"{len(ck['nonfinite'])} rollback(s)")
    return "\n" + "; ".join(parts) if parts else ""
