"""An evaluation's files under ``RUN_DIR/evaluation/``, each written atomically, the JSON last (it names the
others, so a reader that finds it finds them):

- ``<split>.png``: the confusion matrix, class names on both axes, counts in the cells, shaded by the share of
  the true class (recall along the diagonal);
- ``<split>.parquet``: one row per evaluated sample, in evaluation order: ``sample_id``, ``label`` and
  ``predicted`` (class names) with their indices, ``probability`` (softmax of the predicted class) and ``loss``;
- ``<split>.json``: the scores and where they came from (evaluate.py's ``metrics``), with ``files``.
"""

from __future__ import annotations

import io as _io

import numpy as np
from dutycycle.engine import io

EVAL_DIR = "evaluation"


def paths(run_dir: str, split: str) -> dict[str, str]:
    folder = io.join(run_dir, EVAL_DIR)
    return {"json": io.join(folder, f"{split}.json"), "png": io.join(folder, f"{split}.png"),
            "predictions": io.join(folder, f"{split}.parquet")}


def write(run_dir: str, ev, per_sample: np.ndarray) -> dict[str, str]:
    """Write the PNG and the predictions, then the JSON; returns their URIs."""
    files = paths(run_dir, ev.split)
    io.write_bytes_atomic(files["png"], confusion_png(ev.metrics))
    io.write_bytes_atomic(files["predictions"], predictions(ev, per_sample))
    ev.metrics["files"] = {k: v.rsplit("/", 1)[-1] for k, v in files.items() if k != "json"}  # beside the JSON
    io.write_json_atomic(files["json"], ev.metrics)
    return files


def predictions(ev, per_sample: np.ndarray) -> bytes:
    """The per-sample table as Parquet bytes."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    classes = np.asarray(ev.metrics["classes"], dtype=object)
    z = ev.logits.astype(np.float64)
    z = z - z.max(1, keepdims=True)
    probs = np.exp(z) / np.exp(z).sum(1, keepdims=True)
    table = pa.table({
        "sample_id": pa.array(ev.sample_ids, pa.string()),
        "label": pa.array(classes[ev.labels].tolist(), pa.string()),
        "label_index": pa.array(ev.labels, pa.int64()),
        "predicted": pa.array(classes[ev.predicted].tolist(), pa.string()),
        "predicted_index": pa.array(ev.predicted, pa.int64()),
        "probability": pa.array(probs[np.arange(len(probs)), ev.predicted], pa.float64()),
        "loss": pa.array(per_sample, pa.float64()),
    })
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink)
    return sink.getvalue().to_pybytes()


def plain(name: str, limit: int = 28) -> str:
    """A class name as matplotlib draws it literally (``$`` would start math mode), shortened for an axis."""
    name = name if len(name) <= limit else name[:limit - 1] + "\u2026"
    return name.replace("$", r"\$")


def confusion_png(m: dict) -> bytes:
    """The confusion matrix of an evaluation's ``metrics`` as PNG bytes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    counts = np.asarray(m["confusion"], np.int64)
    k = len(counts)
    support = counts.sum(1, keepdims=True)
    share = np.divide(counts, support, out=np.zeros(counts.shape), where=support > 0)
    side = min(22.0, max(5.0, 0.45 * k + 3.0))
    fig, ax = plt.subplots(figsize=(side + 1.5, side))
    image = ax.imshow(share, cmap="Blues", vmin=0.0, vmax=1.0)
    fig.colorbar(image, ax=ax, fraction=0.046, pad=0.04, label="share of the true class")
    if k <= 60:  # beyond that the names would overlap: the JSON holds them
        font = 9 if k <= 12 else 7 if k <= 30 else 5
        names = [plain(c) for c in m["classes"]]
        ax.set_xticks(range(k), names, rotation=60, ha="right", rotation_mode="anchor", fontsize=font)
        ax.set_yticks(range(k), names, fontsize=font)
        if k <= 30:
            for i in range(k):
                for j in range(k):
                    if counts[i, j]:
                        ax.text(j, i, str(counts[i, j]), ha="center", va="center", fontsize=font,
                                color="white" if share[i, j] > 0.5 else "black")
    ax.set(xlabel="predicted class", ylabel="true class")
    step = "final model" if m["step"] is None else f"step {m['step']}"
    title = f"{plain(m['split'])}: accuracy {m['accuracy']:.1%}, loss {m['loss']:.4f}\n{m['samples']:,} samples, {step}"
    ax.set_title(title)
    fig.tight_layout()
    buf = _io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, metadata={"Title": title.replace("\n", "; ")})
    plt.close(fig)
    return buf.getvalue()
