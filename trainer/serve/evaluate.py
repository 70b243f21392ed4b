"""``dutycycle evaluate RUN``: a trained run's model scored on a split, in one process.

    ev = dutycycle.evaluate("runs/digits", split="test")     # or: dutycycle evaluate runs/digits --split test
    ev.accuracy, ev.loss, ev.metrics["per_class"], ev.logits

What it does, in order:

1. The run: its ``config.json`` (the model and data settings) and ``summary.json["data"]`` (class names, sample
   shape, the normalization the training batches had, the transform spec, the cache and table).
2. The weights: the newest checkpoint commit whose manifest verifies (``step``: another commit), loaded into one
   process unsharded whatever layout saved it (``checkpoint.weights``); a run that kept no checkpoints is
   scored from its final ``model.safetensors``.
3. The model, built as the run built it (``model.name`` and its arguments, the data's channels, classes and
   size), in the dtype its weights were saved in, in eval mode.
4. The split (``evaldata``): from the run's cache when it holds the split, else from the table the cache was
   made from, decoded with the cache's recorded transform; undecodable rows counted, not fatal. Fixed order;
   ``data.eval_batch_size`` samples per forward.
5. Scores (``scores``): loss, accuracy, per-class precision, recall, F1 and support, the confusion matrix.
6. Files (``evalfiles``), ``RUN_DIR/evaluation/``: ``<split>.png`` (the confusion matrix), ``<split>.parquet``
   (one row per sample: id, true and predicted class, probability, loss), then ``<split>.json`` (the scores, the
   commit's step, the data's provenance: written last, it names the other two), then the run's page
   ``report.html`` is drawn again with an evaluation section per evaluated split, and a finished run's model
   card (``MODEL_CARD.md``, ``model_card.json``: launch/card.py) is written again with these scores.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from dataclasses import dataclass, field

import numpy as np
from dutycycle.engine import formats, io
from dutycycle.engine.errors import ConfigError, SourceError
from dutycycle.trainer.checkpoint.manifest import checkpoint_root
from dutycycle.trainer.checkpoint.weights import model_state_dict, select_commit
from dutycycle.trainer.cluster.world import World
from dutycycle.trainer.config import load_config
from dutycycle.trainer.launch.card import CARD_JSON, CARD_MD, refresh_card
from dutycycle.trainer.launch.runpage import write_run_page
from dutycycle.trainer.launch.tracking import log_run_files
from dutycycle.trainer.step.data import DataInfo, make_sources
from dutycycle.trainer.step.metrics import read_summary
from dutycycle.trainer.step.models import build_model

from . import evalfiles
from .evaldata import Split, open_split
from .scores import confusion, scores

CONFIG = "config.json"
MODEL_FILE = "model.safetensors"


@dataclass
class Evaluation:
    """One split scored. ``metrics`` is what ``evaluation/<split>.json`` holds; ``logits`` ``[N, K]``,
    ``labels`` and ``predicted`` ``[N]`` and ``sample_ids`` are per evaluated sample, in evaluation order."""

    split: str
    metrics: dict
    logits: np.ndarray
    labels: np.ndarray
    predicted: np.ndarray
    sample_ids: list[str]
    files: dict[str, str] = field(default_factory=dict)

    @property
    def accuracy(self) -> float:
        return self.metrics["accuracy"]

    @property
    def loss(self) -> float:
        return self.metrics["loss"]


def evaluate(run_dir: str, split: str = "test", *, table: str | None = None, step: int | None = None,
             batch_size: int | None = None, device: str = "auto", write: bool = True) -> Evaluation:
    """Score the run at ``run_dir`` on ``split`` (module doc). ``table``: read the split from this metadata
    table instead of the run's data; ``step``: the checkpoint commit to load (default: the newest that
    verifies); ``batch_size``: samples per forward (default ``data.eval_batch_size``); ``device``: where the
    forward passes run (``"auto"``: the first GPU when there is one, else the CPU; or a torch device name);
    ``write``: the files and the page (False: only the returned ``Evaluation``)."""
    t0 = time.perf_counter()
    cfg = run_config(run_dir)
    size = batch_size or cfg.data.eval_batch_size
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ConfigError(f"batch_size = {size!r} must be a positive integer")
    info, notes = data_info(run_dir, cfg)
    data = open_split(cfg, info, split, batch_size=size, table=table)  # a missing split fails before any load
    state, weights = load_weights(cfg, run_dir, step)
    model = model_for(cfg, info, state, weights["from"]).to(torch_device(device))
    logits, labels, ids = forward(model, data)
    if not len(labels):
        raise SourceError(f"no sample of split {split!r} could be evaluated ({data.rows} "
                          f"rows, skipped: {dict(data.skipped)}{'; ' + data.examples[0] if data.examples else ''})")
    predicted = logits.argmax(1)
    per_sample = sample_losses(logits, labels)
    metrics = formats.stamp({
        "run": run_dir, "split": split, "step": weights["step"], "weights": weights,
        "data": {"source": data.source, **data.provenance, "normalize": info.normalize},
        "rows": data.rows, "samples": int(len(labels)), "skipped": dict(sorted(data.skipped.items())),
        "skipped_examples": list(data.examples), "notes": [*notes, *data.notes],
        "classes": list(info.classes), "batch_size": size, "device": str(next(model.parameters()).device),
        "loss": float(per_sample.mean()),
        **scores(confusion(labels, predicted, len(info.classes)), list(info.classes)),
        "seconds": time.perf_counter() - t0, "created_at": time.time(),
    })
    for note in metrics["notes"]:
        print(f"[evaluate] {note}", file=sys.stderr, flush=True)
    ev = Evaluation(split, metrics, logits, labels, predicted, ids)
    if write:
        ev.files = evalfiles.write(run_dir, ev, per_sample)
        ev.files["page"] = write_run_page(run_dir)
        # a tracked run's MLflow run gets the evaluation beside its training (a no-op for an untracked run)
        log_run_files(run_dir, [ev.files["json"], ev.files["png"]], step=weights["step"],
                      metrics={f"{split}_accuracy": metrics["accuracy"], f"{split}_loss": metrics["loss"]})
        card_again(run_dir, cfg, ev.files)
    return ev


def card_again(run_dir: str, cfg, files: dict) -> None:
    """The finished run's model card with this evaluation (launch/card.py: its other sections as the training
    wrote them), and given to its
    MLflow run (files and tags) when it is tracked. A run that has not finished (no summary.json) has no card
    yet: the training writes it when it ends."""
    try:
        summary = read_summary(run_dir)
    except SourceError:
        return
    tags = refresh_card(run_dir, cfg, summary, evaluation=True)
    if tags is not None:
        files["card"] = io.join(run_dir, CARD_MD)
        log_run_files(run_dir, [io.join(run_dir, CARD_MD), io.join(run_dir, CARD_JSON)], artifact_path=None,
                      tags=tags)


# ------------------------------------------------------------------------------------------------- the run


def run_config(run_dir: str):
    """The run's resolved config: ``RUN_DIR/config.json`` (the config of the newest attempt that finished, the
    one its model was trained with), else, for a run that has not finished yet, its newest attempt's
    (``RUN_DIR/attempts/<k>/config.json``): a resume may change only the run's length, never the model."""
    uri = io.join(run_dir, CONFIG)
    try:
        return load_config(uri if io.exists(uri) else run_dir)
    except ConfigError as e:
        if io.exists(uri) or io.exists(io.join(run_dir, "attempts")):
            raise
        raise SourceError(f"{run_dir!r} is not a run directory: it has no {CONFIG} (`dutycycle train` writes one "
                          "when a run starts); pass the run's directory (run.dir)") from e


def data_info(run_dir: str, cfg) -> tuple[DataInfo, list[str]]:
    """The data the model was trained on (``summary.json["data"]``); for a run that has not finished (no
    summary yet), read from its data again as the trainer reads it."""
    try:
        summary = read_summary(run_dir)
    except SourceError:
        summary = None
    recorded = (summary or {}).get("data")
    if isinstance(recorded, dict) and recorded.get("classes"):
        names = {f.name for f in dataclasses.fields(DataInfo)}
        return DataInfo(**{k: v for k, v in recorded.items() if k in names}), []
    _, _, info = make_sources(cfg, World(0, 1))
    return info, ["the run has no summary.json with its data facts (it has not finished): class names, shape and "
                  "normalization were read from its data again"]


def load_weights(cfg, run_dir: str, step: int | None) -> tuple[dict, dict]:
    """The full model state and where it came from: the newest verified commit (or ``step``'s); without any
    commit, the run's final ``model.safetensors``."""
    root = checkpoint_root(cfg, run_dir)
    try:
        selected = select_commit(root, step)
    except SourceError:
        model_file = io.join(run_dir, MODEL_FILE)
        if step is not None or not io.exists(model_file):
            raise
        from safetensors.torch import load  # heavy: torch

        fs, path = io.filesystem(model_file)
        with fs.open(path, "rb") as f:
            state = load(f.read())
        try:
            steps = read_summary(run_dir).get("steps")
        except SourceError:
            steps = None
        return state, {"from": model_file, "kind": "model file", "step": steps, "fallbacks": []}
    return model_state_dict(selected), {"from": selected.uri, "kind": "checkpoint", "step": selected.step,
                                        "fallbacks": selected.fallbacks}


def model_for(cfg, info: DataInfo, state: dict, where: str):
    """The run's model with ``state`` loaded, in the weights' dtype, in eval mode."""
    import torch

    model = build_model(cfg.model, info.channels, info.num_classes, info.size)
    floats = {t.dtype for t in state.values() if t.is_floating_point()}
    dtype = torch.float64 if torch.float64 in floats else torch.float32
    model = model.to(dtype)
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as e:
        raise ConfigError(f"the weights in {where} do not fit model.name = {cfg.model.name!r} as the run's config "
                          f"builds it ({str(e).splitlines()[0]}); was config.json edited after training?") from None
    return model.eval()


def torch_device(name: str):
    """``"auto"``: the first GPU when torch sees one, else the CPU; any other name as torch reads it."""
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        return torch.device(name)
    except RuntimeError as e:
        raise ConfigError(f"device {name!r} is not a torch device ({e}); use auto, cpu or cuda:0") from None


# ------------------------------------------------------------------------------------------------- scoring


def forward(model, data: Split) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """The model's logits over the split, in its order; rows without a label are counted and left out."""
    import torch

    first = next(model.parameters())
    dtype, device = first.dtype, first.device
    logits, labels, ids = [], [], []
    with torch.no_grad():
        for x, y, sample_ids in data.batches():
            keep = y >= 0
            if not bool(keep.all()):
                data.skipped["unlabeled"] += int((~keep).sum())
                x, y, sample_ids = x[keep], y[keep], [s for s, k in zip(sample_ids, keep.tolist(), strict=True) if k]
            if not len(y):
                continue
            out = model(x.to(device, dtype))
            logits.append(out.to("cpu", torch.float64 if dtype == torch.float64 else torch.float32).numpy())
            labels.append(y.numpy())
            ids.extend(sample_ids)
    if not logits:
        return np.zeros((0, 0), np.float32), np.zeros(0, np.int64), []
    return np.concatenate(logits), np.concatenate(labels).astype(np.int64), ids


def sample_losses(logits: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """Cross-entropy per sample, in at least float32 as the trainer computes it, returned as float64."""
    import torch
    import torch.nn.functional as F

    return F.cross_entropy(torch.from_numpy(logits), torch.from_numpy(labels), reduction="none").double().numpy()
