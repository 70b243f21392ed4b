"""Models. Normalization never uses batch statistics (GroupNorm / LayerNorm), so a model's output for a
sample does not depend on how the global batch is split across ranks: 1 and N workers train the same weights.
A plug-in with BatchNorm gets that with ``model.sync_batchnorm = true`` (trainer/parallel/batchnorm.py).

A model exposes its repeated blocks as ``model.blocks`` (``nn.Sequential`` or ``nn.ModuleList``): the sharded
trainer wraps each block as its own FSDP2 unit, so parameters are gathered one block at a time
(trainer/parallel/apply.py). A model without ``blocks`` is sharded as one unit, with a warning.

A model factory has the signature ``factory(cfg: ModelSection, in_channels, num_classes, image_size)`` and
returns an ``nn.Module`` mapping float images [B, C, H, W] to logits [B, num_classes]. Register one in
``MODELS`` or point ``model.name`` at ``"package.module:factory"``.
"""

from __future__ import annotations

import importlib
import math
import os
import sys
from collections.abc import Callable

import torch
from dutycycle.engine.errors import ConfigError
from torch import nn


class ConvBlock(nn.Sequential):
    """Conv 3x3, GroupNorm, ReLU, 2x2 max-pool."""

    def __init__(self, c_in: int, c_out: int, groups: int):
        super().__init__(nn.Conv2d(c_in, c_out, 3, padding=1, bias=False), nn.GroupNorm(min(groups, c_out), c_out),
                         nn.ReLU(inplace=True), nn.MaxPool2d(2))


class SmallCNN(nn.Module):
    """``depth`` conv blocks, channels doubling, then a linear head. ``blocks`` are the units the sharded
    trainer wraps one by one (FSDP2)."""

    def __init__(self, in_channels: int, num_classes: int, width: int = 32, depth: int = 3, groups: int = 8):
        super().__init__()
        chans = [in_channels] + [width * 2**i for i in range(depth)]
        self.blocks = nn.Sequential(*[ConvBlock(chans[i], chans[i + 1], groups) for i in range(depth)])
        self.head = nn.Linear(chans[-1], num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.blocks(x)
        return self.head(x.mean(dim=(2, 3)))  # global average pool: any input size works


class Attention(nn.Module):
    """Multi-head self-attention with separate query, key, value and output projections (``q``, ``k``, ``v``,
    ``proj``): tensor parallelism splits q, k and v by output features (whole heads per rank) and ``proj`` by input
    features, which a packed qkv weight (``nn.MultiheadAttention``'s) would not allow. The head count is read from
    the projection's width at run time, so a rank holding half the heads computes exactly those."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        if dim % heads:
            raise ConfigError(f"model.heads = {heads} must divide model.width = {dim}")
        self.head_dim = dim // heads
        self.q, self.k, self.v = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.proj = nn.Linear(dim, dim)
        # nn.MultiheadAttention's initialization, which this model used before: its packed [3d, d] projection
        # Xavier-uniform (bound sqrt(6 / 4d)), every bias zero
        bound = math.sqrt(6.0 / (4 * dim))
        for layer in (self.q, self.k, self.v):
            nn.init.uniform_(layer.weight, -bound, bound)
            nn.init.zeros_(layer.bias)
        nn.init.zeros_(self.proj.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import torch.nn.functional as F

        b, n, _ = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:  # [b, n, h * d] -> [b, h, n, d]; h = this rank's heads
            return t.view(b, n, -1, self.head_dim).transpose(1, 2)

        out = F.scaled_dot_product_attention(heads(self.q(x)), heads(self.k(x)), heads(self.v(x)))
        return self.proj(out.transpose(1, 2).reshape(b, n, -1))


class Block(nn.Module):
    """Pre-norm transformer block."""

    def __init__(self, dim: int, heads: int, mlp_ratio: int = 4):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, dim * mlp_ratio), nn.GELU(), nn.Linear(dim * mlp_ratio, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class TinyViT(nn.Module):
    """A small vision transformer: more parameters per FLOP than the CNN, for the sharding work ahead."""

    def __init__(self, in_channels: int, num_classes: int, image_size: int, dim: int = 128, depth: int = 4,
                 heads: int = 4, patch: int = 4):
        super().__init__()
        if image_size % patch:
            raise ConfigError(f"model.patch = {patch} must divide the image size {image_size}")
        n = (image_size // patch) ** 2
        self.patch = nn.Conv2d(in_channels, dim, patch, stride=patch)
        self.cls = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos = nn.Parameter(torch.randn(1, n + 1, dim) * 0.02)
        self.blocks = nn.Sequential(*[Block(dim, heads) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, num_classes)

    def tensor_parallel_plan(self, tensor: int, sequence_parallel: bool) -> dict:
        """``torch.distributed.tensor.parallel`` styles by module name for ``tensor`` ranks per group (Megatron's
        split, as torchtitan plans its transformer): q, k, v and the MLP's first layer column-wise (each rank
        whole heads and a slice of the hidden features), the output projection and the MLP's second layer row-wise
        (partial sums, combined once per sub-layer). With ``sequence_parallel`` the residual stream between the
        sub-layers stays split along the tokens, so the norms run on a 1/T slice and each all-reduce becomes a
        reduce-scatter plus an all-gather of the same bytes. The patch embedding, the class token and the head
        stay replicated (small, and outside the blocks). Checked: the heads and the MLP width divide by ``tensor``."""
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            PrepareModuleInput,
            PrepareModuleInputOutput,
            RowwiseParallel,
            SequenceParallel,
        )

        attn, hidden = self.blocks[0].attn, self.blocks[0].mlp[0].out_features
        heads = attn.q.out_features // attn.head_dim
        if heads % tensor or hidden % tensor:
            raise ConfigError(f"parallel.tensor = {tensor} must divide the ViT's heads (model.heads = {heads}) and its "
                              f"MLP width ({hidden}): each rank takes whole heads; choose a divisor of {heads}")
        split = Shard(1) if sequence_parallel else Replicate()  # the residual stream's layout between sub-layers
        plan: dict = {}
        if sequence_parallel:  # into the blocks: each rank keeps its slice of the tokens; out: gathered again
            plan["blocks"] = PrepareModuleInputOutput(
                input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),), use_local_input=False,
                output_layouts=(Shard(1),), desired_output_layouts=(Replicate(),), use_local_output=True)
        for i in range(len(self.blocks)):
            b = f"blocks.{i}"
            if sequence_parallel:
                plan[f"{b}.norm1"] = SequenceParallel()
                plan[f"{b}.norm2"] = SequenceParallel()
            # each sub-layer's input as one replicated DTensor (gathered from the token slices under sequence
            # parallelism): q, k and v then share it, and backward sums their partial input gradients before one
            # reduce-scatter (or all-reduce), instead of one all-reduce per projection
            for name in ("attn", "mlp"):
                plan[f"{b}.{name}"] = PrepareModuleInput(input_layouts=(split,), desired_input_layouts=(Replicate(),),
                                                         use_local_output=False)
            for name in ("attn.q", "attn.k", "attn.v", "mlp.0"):
                plan[f"{b}.{name}"] = ColwiseParallel()
            for name in ("attn.proj", "mlp.2"):
                plan[f"{b}.{name}"] = RowwiseParallel(output_layouts=split, use_local_output=not sequence_parallel)
        return plan

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1) + self.pos
        x = self.blocks(x)
        return self.head(self.norm(x[:, 0]))


def cnn(cfg, in_channels: int, num_classes: int, image_size: int) -> nn.Module:
    return SmallCNN(in_channels, num_classes, width=cfg.width, depth=cfg.depth, groups=cfg.groups)


def vit(cfg, in_channels: int, num_classes: int, image_size: int) -> nn.Module:
    return TinyViT(in_channels, num_classes, image_size, dim=cfg.width, depth=cfg.depth, heads=cfg.heads,
                   patch=cfg.patch)


MODELS: dict[str, Callable[..., nn.Module]] = {"cnn": cnn, "vit": vit}


def resolve_factory(name: str) -> Callable[..., nn.Module]:
    """The factory ``model.name`` names: a registered one, or ``"package.module:factory"`` imported (the working
    directory is importable: the driver adds it to ``sys.path``, Ray workers get the module through Ray's
    runtime environment, trainer/launch/usermodule.py; so do ``evaluate``, ``predict`` and ``export``, run from
    the folder that holds the module, through ``import_user_module``)."""
    if name in MODELS:
        return MODELS[name]
    module_name, _, attr = name.partition(":")
    if not attr:
        raise ConfigError(f"model.name = {name!r} is not registered ({', '.join(sorted(MODELS))})")
    try:
        module = import_user_module(module_name)
    except ImportError as e:
        raise ConfigError(import_hint(name, module_name, e)) from e
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise ConfigError(f"model.name = {name!r}: {module_name} has no callable {attr!r}")
    return factory


def import_user_module(module_name: str):
    """Import ``module_name``; when its top-level package is not found and the working directory holds it (the
    ``dutycycle`` console script, unlike ``python -m``, leaves the working directory off ``sys.path``), with the
    working directory appended to ``sys.path``, so an installed package of the same name still wins."""
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        top, cwd = module_name.split(".")[0], os.getcwd()
        here = os.path.isdir(os.path.join(cwd, top)) or os.path.isfile(os.path.join(cwd, top + ".py"))
        if e.name != top or not here or cwd in sys.path or "" in sys.path:
            raise
        sys.path.append(cwd)
        importlib.invalidate_caches()
        return importlib.import_module(module_name)


def import_hint(name: str, module_name: str, err: ImportError) -> str:
    """Why ``model.name``'s module did not import and what to do: run from the folder that holds it, or install
    it; a module it imports that is missing is named as such."""
    missing = getattr(err, "name", None) or ""
    top = module_name.split(".")[0]
    where = f"working directory {os.getcwd()}"
    if isinstance(err, ModuleNotFoundError) and missing and not module_name.startswith(missing) \
            and not missing.startswith(top):
        return (f"model.name = {name!r}: {module_name} imports {missing!r}, which is not installed here ({err}); "
                f"install it (pip install {missing.split('.')[0]})")
    return (f"model.name = {name!r}: cannot import {module_name!r} ({type(err).__name__}: {err}) from the {where}. "
            f"Run from the folder that holds {top}/ (or {top}.py), or install it (pip install -e . in its project)")


def build_model(cfg, in_channels: int, num_classes: int, image_size: int) -> nn.Module:
    """Build the model named by ``cfg.name`` (a ModelSection); plug-ins get the same arguments."""
    model = resolve_factory(cfg.name)(cfg, in_channels, num_classes, image_size)
    if not isinstance(model, nn.Module):
        raise ConfigError(f"model.name = {cfg.name!r} returned {type(model).__name__}, not a torch.nn.Module")
    return model


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
