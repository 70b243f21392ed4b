"""Moving finished batches to the accelerator: optional pinned memory, a copy that overlaps compute, and the
normalization done on the device after the copy.

On CUDA the copy runs on a side stream with ``non_blocking=True`` from pinned memory, so the host thread (the
loader's producer) returns at once and the copy overlaps the previous step's kernels; the consumer makes its
stream wait for the copy stream before it uses the batch (``DeviceMover.wait``). On CPU every call here is a
cheap no-op, so the same loader code runs on a laptop and a GPU node.

With ``LoaderConfig.normalize_on = "device"`` the batch crosses as uint8 (a quarter of float32's bytes) and
``Normalizer`` turns it into ``(x / 255 - mean) / std`` on the consumer's stream, with the same two float32
operations as the host path (``augment.to_tensor``), so the values are bit for bit the same.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .augment import normalize_constants
from .config import AugmentConfig


def batch_bytes(batch: dict[str, Any]) -> int:
    """Bytes of the tensors in ``batch``: what a copy of it to a device sends."""
    import torch

    return sum(v.numel() * v.element_size() for v in batch.values() if isinstance(v, torch.Tensor))


class Normalizer:
    """``(x / 255 - mean) / std`` of a uint8 ``[B, C, H, W]`` tensor, on the tensor's own device: one float32
    multiply and one float32 add with ``augment.normalize_constants`` (each rounded once, as NumPy does on the
    host), into a contiguous float32 tensor as the host path returns. The constants are copied to a device once."""

    def __init__(self, mean: Sequence[float], std: Sequence[float], channels: int):
        scale, shift = normalize_constants(AugmentConfig(mean=tuple(mean), std=tuple(std)), channels)
        self.channels = channels
        self._host = (scale, shift)
        self._on: dict[Any, tuple] = {}  # device -> (scale, shift) tensors there

    def _constants(self, device):
        if device not in self._on:
            import torch

            self._on[device] = tuple(torch.from_numpy(a).to(device) for a in self._host)
        return self._on[device]

    def __call__(self, x):
        import torch

        assert x.dtype == torch.uint8 and x.dim() == 4, (x.dtype, x.shape)  # the loader's own collate made it
        scale, shift = self._constants(x.device)
        out = torch.empty(x.shape, dtype=torch.float32, device=x.device)  # contiguous NCHW, as on the host
        torch.mul(x, scale, out=out)  # uint8 promoted to float32 exactly, then one rounded multiply
        return out.add_(shift)


class DeviceMover:
    """Pins and/or copies the tensors of a batch dict; one per loader."""

    def __init__(self, pin_memory: bool = False, device: Any = None):
        import torch

        self.device = torch.device(device) if device is not None else None
        self.cuda = self.device is not None and self.device.type == "cuda" and torch.cuda.is_available()
        # Pinning needs a CUDA runtime; without one it is skipped rather than failing on a CPU-only machine.
        self.pin = bool(pin_memory) and torch.cuda.is_available()
        self.stream = torch.cuda.Stream(device=self.device) if self.cuda else None

    @property
    def active(self) -> bool:
        return self.pin or (self.device is not None and self.device.type != "cpu")

    def move(self, batch: dict[str, Any]) -> dict[str, Any]:
        """Return ``batch`` with its tensors pinned and/or on the target device (copies queued, not waited)."""
        if not self.active:
            return batch
        import torch

        out = dict(batch)
        tensors = {k: v for k, v in batch.items() if isinstance(v, torch.Tensor)}
        if self.pin or self.cuda:
            tensors = {k: v if v.is_pinned() else v.pin_memory() for k, v in tensors.items()}
        if self.device is None:
            out.update(tensors)
            return out
        if self.stream is not None:
            with torch.cuda.stream(self.stream):
                moved = {k: v.to(self.device, non_blocking=True) for k, v in tensors.items()}
            event = torch.cuda.Event()
            event.record(self.stream)
            out["_ready"] = event
        else:
            moved = {k: v.to(self.device) for k, v in tensors.items()}
        out.update(moved)
        return out

    def wait(self, batch: dict[str, Any]) -> dict[str, Any]:
        """Called on the consumer's thread: make its current stream wait for this batch's copy."""
        event = batch.pop("_ready", None)
        if event is None:
            return batch
        import torch

        current = torch.cuda.current_stream(self.device)
        current.wait_event(event)
        for v in batch.values():
            # The caching allocator must not reuse these blocks until the consumer's stream is done with them.
            if isinstance(v, torch.Tensor) and v.is_cuda:
                v.record_stream(current)
        return batch
