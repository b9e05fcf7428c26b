"""A short calibration pass for int8: activation ranges per linear layer, and SmoothQuant.

:func:`collect_ranges` runs the loaded model over a few token windows (each one sequence,
causal attention computed here, no KV cache, so it works before or after the engine binds
its cache) and records, for each watched linear layer, the absolute maximum of each input
feature per window.

:func:`smooth` migrates activation outliers into the weights (SmoothQuant, Xiao et al.
2023): for a linear layer with input ranges a_j and weight column ranges w_j it divides input
feature j by s_j = a_j^alpha / w_j^(1 - alpha) and multiplies weight column j by s_j, so the
product is unchanged in exact arithmetic while the activations' range shrinks. The division
is folded into the op that makes the input, so it costs nothing at run time:

* qkv_proj <- the input RMSNorm's weight
* gate_up_proj <- the RMSNorm before the MLP (pre_feedforward_layernorm where a model has one)
* down_proj <- the up half of gate_up_proj (silu(gate) * up is linear in up)
* o_proj <- the v rows of qkv_proj (attention mixes v rows linearly per head; heads sharing
  a KV head share one s)

A fold is made only where the layer is built that way (RMSNorm without Gemma's offset, an
*AndMul activation, a merged qkv) and never into a layer kept in full precision; other layers
keep their inputs as they are.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.attention.metadata import ForwardContext
from pagedllm.layers.attention import Attention
from pagedllm.layers.linear import LinearBase, MergedColumnParallelLinear, QKVParallelLinear
from pagedllm.layers.norm import RMSNorm

logger = logging.getLogger(__name__)


class _CausalAttention:
    """Stands in for the model's attention backend during calibration: one sequence, the
    step's own keys and values, causal (and windowed) softmax attention in fp32."""

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        metadata: Any,
        scale: float,
        window_left: int,
    ) -> torch.Tensor:
        tokens, heads, _ = query.shape
        repeat = heads // key.shape[1]
        q = query.transpose(0, 1).float()
        k = key.repeat_interleave(repeat, dim=1).transpose(0, 1).float()
        v = value.repeat_interleave(repeat, dim=1).transpose(0, 1).float()
        pos = torch.arange(tokens, device=query.device)
        allowed = pos[None, :] <= pos[:, None]
        if window_left >= 0:
            allowed &= pos[None, :] >= pos[:, None] - window_left
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale)
        return out.transpose(0, 1).to(query.dtype)

    def cpu_kernel_tiles(self, *args: object) -> None:
        return None  # the fused decoder layers cannot run this backend


@contextlib.contextmanager
def _calibration_attention(model: nn.Module) -> Iterator[None]:
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    saved = [m.backend for m in layers]
    backend = _CausalAttention()
    try:
        for m in layers:
            m.backend = backend  # type: ignore[assignment]
        # The stand-in backend reads no metadata; the context only has to exist (every KV
        # cache group's metadata is that one stand-in).
        metadata = SimpleNamespace()
        metadata.for_group = lambda group: metadata
        with ForwardContext(metadata):  # type: ignore[arg-type]
            yield
    finally:
        for m, b in zip(layers, saved):
            m.backend = b


@torch.no_grad()
def collect_ranges(
    model: nn.Module, modules: dict[str, nn.Module], windows: list[list[int]]
) -> dict[str, list[torch.Tensor]]:
    """Per watched module, one fp32 [in_features] tensor per window: |input| max per feature."""
    ranges: dict[str, list[torch.Tensor]] = {name: [] for name in modules}

    def hook(name: str):  # noqa: ANN202
        def record(module: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
            x = args[0]
            ranges[name].append(x.reshape(-1, x.shape[-1]).abs().amax(0).float())

        return record

    handles = [m.register_forward_pre_hook(hook(n)) for n, m in modules.items()]
    device = next(model.parameters()).device
    try:
        with _calibration_attention(model):
            for window in windows:
                ids = torch.tensor(window, device=device)
                model(ids, torch.arange(len(window), device=device))
    finally:
        for h in handles:
            h.remove()
    return ranges


def _smoothing(act: torch.Tensor, weight: torch.Tensor, alpha: float) -> torch.Tensor:
    a = act.clamp_min(1e-5)
    w = weight.float().abs().amax(0).clamp_min(1e-5)
    return (a.pow(alpha) / w.pow(1 - alpha)).clamp(1e-2, 1e2)


def _scale_columns(linear: LinearBase, s: torch.Tensor) -> None:
    linear.weight.data.mul_(s.to(linear.weight.dtype))


def _fold_into_norm(norm: nn.Module, s: torch.Tensor) -> bool:
    # Only Llama's weight * x_normed: an offset norm (Gemma's (1 + weight) * x_normed) is left.
    if type(norm) is not RMSNorm or getattr(norm, "offset", False):
        return False
    norm.weight.data.div_(s.to(norm.weight.dtype))
    return True


def _fold_into_up(gate_up: nn.Module, act_fn: nn.Module, s: torch.Tensor) -> bool:
    if not isinstance(gate_up, MergedColumnParallelLinear) or not type(act_fn).__name__.endswith(
        "AndMul"
    ):
        return False
    half = gate_up.weight.shape[0] // 2
    gate_up.weight.data[half:].div_(s[:, None].to(gate_up.weight.dtype))
    if gate_up.bias is not None:
        gate_up.bias.data[half:].div_(s.to(gate_up.bias.dtype))
    return True


def _fold_into_v(qkv: nn.Module, s: torch.Tensor) -> tuple[bool, torch.Tensor]:
    """Divide qkv's v rows by s (one value per KV head and dim: the max over the q heads that
    share it); returns the s the o_proj columns must take."""
    if not isinstance(qkv, QKVParallelLinear):
        return False, s
    heads, kv_heads, dim = qkv.num_heads, qkv.num_kv_heads, qkv.head_dim
    if s.numel() != heads * dim or heads % kv_heads:
        return False, s
    shared = s.view(kv_heads, heads // kv_heads, dim).amax(1)  # [kv, dim]
    start = (heads + kv_heads) * dim
    qkv.weight.data[start : start + kv_heads * dim].div_(shared.reshape(-1, 1).to(qkv.weight.dtype))
    if qkv.bias is not None:
        qkv.bias.data[start : start + kv_heads * dim].div_(shared.reshape(-1).to(qkv.bias.dtype))
    return True, shared.repeat_interleave(heads // kv_heads, dim=0).reshape(-1)


def _folds(
    layer: nn.Module,
) -> list[tuple[str, nn.Module, Callable[[torch.Tensor], bool], str | None]]:
    """(name suffix, linear, fold of 1/s into the op making its input, the linear layer that
    fold changes or None for a norm) of a decoder layer."""
    attn, mlp = layer.self_attn, layer.mlp
    mlp_norm = getattr(layer, "pre_feedforward_layernorm", None)
    if mlp_norm is None:
        mlp_norm = getattr(layer, "post_attention_layernorm", None)
    return [
        ("self_attn.qkv_proj", attn.qkv_proj,
         lambda s: _fold_into_norm(layer.input_layernorm, s), None),
        ("mlp.gate_up_proj", mlp.gate_up_proj, lambda s: _fold_into_norm(mlp_norm, s), None),
        ("mlp.down_proj", mlp.down_proj,
         lambda s: _fold_into_up(mlp.gate_up_proj, mlp.act_fn, s), "mlp.gate_up_proj"),
    ]  # fmt: skip


def smooth(
    model: nn.Module,
    ranges: dict[str, list[torch.Tensor]],
    alpha: float,
    names: set[str],
    mutable: set[str] | None = None,
) -> list[str]:
    """Fold SmoothQuant scales into the decoder layers for the linear layers in names whose
    ranges were collected; returns the layers smoothed. A fold into another linear layer
    (down_proj's into gate_up, o_proj's into qkv) is made only where that layer is in mutable
    (default: names): a layer kept in full precision is never touched. Ranges are rescaled in
    place so that calibrated static scales computed from them afterwards see the smoothed
    inputs."""
    done: list[str] = []
    mutable = names if mutable is None else mutable

    def wanted(name: str, linear: nn.Module, source: str | None = None) -> bool:
        return (
            name in names
            and bool(ranges.get(name))
            and linear.weight.dtype.is_floating_point
            and (source is None or source in mutable)
        )

    def record(name: str, s: torch.Tensor) -> None:
        ranges[name] = [r / s for r in ranges[name]]
        done.append(name)

    for prefix, layer in model.named_modules():
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if attn is None or mlp is None or not hasattr(attn, "qkv_proj"):
            continue
        base = f"{prefix}." if prefix else ""
        for suffix, linear, fold, source in _folds(layer):
            if wanted(base + suffix, linear, source and base + source):
                s = _smoothing(torch.stack(ranges[base + suffix]).amax(0), linear.weight, alpha)
                if fold(s):
                    _scale_columns(linear, s)
                    record(base + suffix, s)
        name = base + "self_attn.o_proj"
        if wanted(name, attn.o_proj, base + "self_attn.qkv_proj") and not hasattr(attn, "v_norm"):
            s = _smoothing(torch.stack(ranges[name]).amax(0), attn.o_proj.weight, alpha)
            folded, s = _fold_into_v(attn.qkv_proj, s)
            if folded:
                _scale_columns(attn.o_proj, s)
                record(name, s)
    logger.info("SmoothQuant (alpha %.2f) folded into %d linear layers", alpha, len(done))
    return done
