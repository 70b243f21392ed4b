"""MosaicML Streaming (MDS) and LitData rows of benchmarks/loader.py, run in their own virtual environment.

Both packages change torch when installed next to the project, so the benchmark makes a separate venv for them
(``ensure_venv``: ``torch==2.13.0``, the same CPU wheel as the project, pinned in the same pip command, plus
``mosaicml-streaming``, ``litdata``, ``psutil``) and runs this file with that venv's Python; it imports nothing
from dutycycle. Both accept torch 2.13.0. Both also pull in ``torchvision``, and PyPI's torchvision 0.28.0 (the
one for torch 2.13) is built against the CUDA torch, so it cannot load next to the CPU wheel; LitData imports it
lazily and never needs it here, but ``import streaming`` imports ``streaming.vision``, which imports
``torchvision.datasets.VisionDataset`` and ``torchvision.transforms.functional.to_tensor`` at import time.
When that import fails, ``import_streaming`` registers a minimal stand-in module for those two names before
importing ``streaming``; ``MDSWriter`` and ``StreamingDataset``, what is measured, never touch them.

Each dataset holds the benchmark's pre-transformed samples (from ``raw.npz``): pixels as raw bytes, the label
and the sample id, written once per data folder. Rows read with shuffling on, 2 DataLoader workers, batch 256.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np

if __name__ == "__main__":  # run as `python benchmarks/loader_peers.py`: the siblings import as `benchmarks.*`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import PeakRSS, emit, measure  # noqa: E402
from benchmarks.loader_rows import check_batch  # noqa: E402  (numpy-only imports at module level, as here)

BATCH = 256
SEED = 0
PACKAGES = ["mosaicml-streaming", "litdata", "psutil", "numpy"]
TORCH = "torch==2.13.0"


def ensure_venv(path: Path) -> Path:
    """The peers' venv at ``path`` (made on first use, about 2 minutes); returns its Python."""
    python = path / "bin" / "python"
    probe = "import torch, litdata, psutil; print(torch.__version__)"
    if python.exists():
        ok = subprocess.run([str(python), "-c", probe], capture_output=True, text=True)
        if ok.returncode == 0 and ok.stdout.strip().startswith("2.13.0"):
            return python
    subprocess.run([sys.executable, "-m", "venv", str(path)], check=True)
    # torch first, alone: the CPU wheel on this machine kind's disk; then the peers with torch named again, so
    # pip's resolver cannot swap it for a CUDA build while resolving their requirements.
    subprocess.run([str(python), "-m", "pip", "install", "-q", TORCH], check=True)
    subprocess.run([str(python), "-m", "pip", "install", "-q", *PACKAGES, TORCH], check=True)
    return python


def import_streaming():
    """``import streaming``, with a stand-in for torchvision when the installed one cannot load (module doc)."""
    try:
        import torchvision.datasets  # noqa: F401
        import torchvision.transforms.functional  # noqa: F401
    except Exception:  # a torchvision built for another torch raises RuntimeError/ImportError/OSError
        import types

        for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
            del sys.modules[name]
        import importlib.machinery

        stub = {n: types.ModuleType(n) for n in ("torchvision", "torchvision.datasets", "torchvision.transforms",
                                                 "torchvision.transforms.functional")}
        for name, module in stub.items():  # other packages probe for torchvision with importlib.util.find_spec
            module.__spec__ = importlib.machinery.ModuleSpec(name, None)

        class VisionDataset:  # streaming.vision subclasses it; the benchmark never builds one
            pass

        def to_tensor(*_a, **_k):
            raise NotImplementedError("torchvision is not usable in this environment")

        stub["torchvision.datasets"].VisionDataset = VisionDataset
        stub["torchvision.transforms.functional"].to_tensor = to_tensor
        sys.modules.update(stub)
    import streaming

    return streaming


def raw(data: Path):
    arrays = np.load(data / "raw.npz", allow_pickle=False)
    return arrays["images"], arrays["labels"], arrays["ids"]


def sample_shape(data: Path) -> tuple[int, ...]:
    """One sample's shape, from the header of ``images`` in ``raw.npz``: loading the array to learn it would put
    the whole dataset in this process's memory, and its kernel high-water mark into the row's peak RSS."""
    import zipfile

    with zipfile.ZipFile(data / "raw.npz") as z, z.open("images.npy") as f:
        major, _ = np.lib.format.read_magic(f)
        header = np.lib.format.read_array_header_1_0 if major == 1 else np.lib.format.read_array_header_2_0
        return tuple(header(f)[0][1:])


def collate(items: list[tuple[bytes, int, str]], shape: tuple[int, ...]):
    import torch

    # bytearray: one copy into memory torch may write (a bytes object would give a read-only tensor)
    pixels = np.frombuffer(bytearray().join(x[0] for x in items), np.uint8).reshape(len(items), *shape)
    return {"image": torch.from_numpy(pixels).permute(0, 3, 1, 2),
            "label": torch.tensor([x[1] for x in items]), "sample_id": [x[2] for x in items]}


class DictCollate:
    """Both peers hand out samples as dicts {"image": bytes, "label": int, "id": str} (picklable for workers)."""

    def __init__(self, shape):
        self.shape = shape

    def __call__(self, samples):
        return collate([(s["image"], s["label"], s["id"]) for s in samples], self.shape)


# ------------------------------------------------------------------------------------------------ MDS


def write_mds(data: Path) -> Path:
    out = data / "mds"
    if (out / "index.json").exists():
        return out
    streaming = import_streaming()
    images, labels, ids = raw(data)
    columns = {"image": "bytes", "label": "int", "id": "str"}
    with streaming.MDSWriter(out=str(out), columns=columns, compression=None, size_limit=1 << 26) as w:
        for img, label, sid in zip(images, labels, ids, strict=True):
            w.write({"image": img.tobytes(), "label": int(label), "id": str(sid)})
    return out


def row_mds(data: Path, min_seconds: float, shape: tuple[int, ...]) -> dict[str, Any]:
    import torch

    out = data / "mds"
    streaming = import_streaming()

    def open_loader():
        ds = streaming.StreamingDataset(local=str(out), remote=None, shuffle=True, shuffle_seed=SEED,
                                        batch_size=BATCH)
        return torch.utils.data.DataLoader(ds, batch_size=BATCH, num_workers=2, collate_fn=DictCollate(shape),
                                           persistent_workers=True, drop_last=True)

    return measure(open_loader, lambda dl, e: dl, min_seconds=min_seconds, check=check_batch)


# ------------------------------------------------------------------------------------------------ LitData

_RAW: dict[str, Any] = {}


def _litdata_sample(i: int) -> dict[str, Any]:
    """One sample for ``litdata.optimize`` (a module-level function: its workers import it)."""
    if "images" not in _RAW:
        _RAW["images"], _RAW["labels"], _RAW["ids"] = raw(Path(os.environ["DC_BENCH_DATA"]))
    return {"image": _RAW["images"][i].tobytes(), "label": int(_RAW["labels"][i]), "id": str(_RAW["ids"][i])}


def write_litdata(data: Path) -> Path:
    out = data / "litdata"
    if (out / "index.json").exists():
        return out
    import litdata

    os.environ["DC_BENCH_DATA"] = str(data)
    n = len(raw(data)[1])
    litdata.optimize(fn=_litdata_sample, inputs=list(range(n)), output_dir=str(out), chunk_bytes="64MB",
                     num_workers=1, mode="overwrite")
    return out


def row_litdata(data: Path, min_seconds: float, shape: tuple[int, ...]) -> dict[str, Any]:
    import litdata

    out = data / "litdata"

    def open_loader():
        ds = litdata.StreamingDataset(str(out), shuffle=True, seed=SEED, drop_last=True)
        return litdata.StreamingDataLoader(ds, batch_size=BATCH, num_workers=2, collate_fn=DictCollate(shape),
                                           persistent_workers=True, drop_last=True)

    return measure(open_loader, lambda dl, e: dl, min_seconds=min_seconds, check=check_batch)


ROWS = {"mds": (write_mds, row_mds), "litdata": (write_litdata, row_litdata)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--row", required=True, choices=sorted(ROWS))
    p.add_argument("--data", required=True)
    p.add_argument("--min-seconds", type=float, default=4.0)
    args = p.parse_args(argv)
    # The driver's environment disables tqdm progress bars; LitData's optimize() then fails in its worker on a
    # disabled tqdm_asyncio (no `nrows`) and waits forever for it. Its bars go to stderr, which nobody reads.
    os.environ.pop("TQDM_DISABLE", None)
    import torch

    data = Path(args.data)
    write, row = ROWS[args.row]
    write(data)  # once per data folder, before the row's memory is watched
    shape = sample_shape(data)
    with PeakRSS() as rss:
        result = row(data, args.min_seconds, shape)
    emit({args.row: {**result, **rss.result(), "torch": torch.__version__}})
    return 0


if __name__ == "__main__":
    sys.exit(main())
