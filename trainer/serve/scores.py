"""Classification scores from true and predicted labels: accuracy, the confusion matrix, and per class precision,
recall, F1 and support, with their macro and support-weighted averages.

The conventions are scikit-learn's (``classification_report`` with ``labels=range(K)``, ``zero_division=0``), so
the figures compare with what users already compute: a class never predicted has precision 0, a class absent
from the split has recall 0 and support 0 (it still counts in the macro average, as scikit-learn counts it), and
F1 is 0 where precision + recall is 0. Pure numpy.
"""

from __future__ import annotations

import numpy as np


def confusion(labels: np.ndarray, predicted: np.ndarray, num_classes: int) -> np.ndarray:
    """``[K, K]`` counts: row = true class, column = predicted class."""
    labels, predicted = np.asarray(labels, np.int64), np.asarray(predicted, np.int64)
    assert labels.shape == predicted.shape and (labels.size == 0 or (labels.min() >= 0 and labels.max() < num_classes))
    return np.bincount(labels * num_classes + predicted, minlength=num_classes * num_classes).reshape(
        num_classes, num_classes)


def _ratio(num: np.ndarray, den: np.ndarray) -> np.ndarray:
    return np.divide(num, den, out=np.zeros(len(num), np.float64), where=den > 0)


def scores(matrix: np.ndarray, classes: list[str]) -> dict:
    """Accuracy, per-class precision / recall / F1 / support and their averages from a confusion ``matrix``."""
    m = np.asarray(matrix, np.int64)
    hits, support, predicted = np.diag(m).astype(np.float64), m.sum(1), m.sum(0)
    precision, recall = _ratio(hits, predicted.astype(np.float64)), _ratio(hits, support.astype(np.float64))
    f1 = _ratio(2 * precision * recall, precision + recall)
    total = int(m.sum())
    weights = support / total if total else np.zeros(len(support))
    per_class = [{"class": name, "precision": float(p), "recall": float(r), "f1": float(f), "support": int(s),
                  "predicted": int(n)}
                 for name, p, r, f, s, n in zip(classes, precision, recall, f1, support, predicted, strict=True)]
    return {
        "accuracy": float(hits.sum() / total) if total else float("nan"),
        "macro": {"precision": float(precision.mean()), "recall": float(recall.mean()), "f1": float(f1.mean())},
        "weighted": {"precision": float(weights @ precision), "recall": float(weights @ recall),
                     "f1": float(weights @ f1)},
        "per_class": per_class,
        "confusion": m.tolist(),
    }
