"""Triton kernels for the decoder's small ops on CUDA (``forward_cuda`` of the CustomOps):
residual add + RMSNorm, SwiGLU's silu(gate) * up, and NeoX rotary embedding, each one launch
where the torch ops take 3 to 9.

A decode step of a small model is a chain of tiny kernels: on a GPU each costs its launch
and a round trip through memory more than its arithmetic, so fewer kernels is what makes the
step faster (with CUDA graphs, worker/cuda_graphs.py, the launches are replayed but the
kernels still run one after another). Each kernel rounds to the dtype where the torch ops
it replaces round, so results match ``forward_native`` to the last bit or two: rotary and the
residual sum exactly, the norm and SiLU up to the order of a row's sum and the exp's
implementation.

Imported on first use, only on CUDA or under TRITON_INTERPRET=1 (the tests run them on CPU).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _add_rms_norm_kernel(
    X,
    R,
    W,
    Out,
    ResOut,
    stride_x,
    stride_r,
    stride_o,
    stride_ro,
    n,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    OFFSET: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < n
    x = tl.load(X + row * stride_x + cols, mask=ok, other=0.0)
    if HAS_RESIDUAL:  # x + residual, rounded to the dtype as torch's add is
        r = tl.load(R + row * stride_r + cols, mask=ok, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(X.dtype.element_ty)
        tl.store(ResOut + row * stride_ro + cols, x, mask=ok)
    xf = x.to(tl.float32)
    y = xf * tl.rsqrt(tl.sum(xf * xf, 0) / n + eps)
    w = tl.load(W + cols, mask=ok, other=0.0).to(tl.float32)
    if OFFSET:  # Gemma: x_normed * (1 + weight) in float32, rounded once
        out = y * (1.0 + w)
    else:  # Llama: weight * x_normed, x_normed rounded to the dtype first
        out = y.to(X.dtype.element_ty).to(tl.float32) * w
    tl.store(Out + row * stride_o + cols, out.to(Out.dtype.element_ty), mask=ok)


def add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    offset: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual [T, n] (rows contiguous) -> (norm(x + residual), x + residual); without a
    residual (norm(x), x)."""
    rows, n = x.shape
    out = torch.empty_like(x)
    summed = x if residual is None else torch.empty_like(x)
    other = x if residual is None else residual
    _add_rms_norm_kernel[(rows,)](
        x, other, weight, out, summed,
        x.stride(0), other.stride(0), out.stride(0), summed.stride(0), n, eps,
        HAS_RESIDUAL=residual is not None,
        OFFSET=offset,
        BLOCK=triton.next_power_of_2(n),
        num_warps=4 if n <= 4096 else 8,
    )  # fmt: skip
    return out, summed


@triton.jit
def _silu_and_mul_kernel(X, Out, stride_x, stride_o, d, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < d
    gate = tl.load(X + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(X + row * stride_x + d + cols, mask=ok, other=0.0)
    # F.silu rounds to the dtype, then mul_ rounds the product
    silu = (gate / (1.0 + tl.exp(-gate))).to(X.dtype.element_ty).to(tl.float32)
    out = silu * up.to(tl.float32)
    tl.store(Out + row * stride_o + cols, out.to(Out.dtype.element_ty), mask=ok)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[T, 2d] (rows contiguous) -> silu(x[:, :d]) * x[:, d:], [T, d]."""
    rows, width = x.shape
    d = width // 2
    out = torch.empty(rows, d, dtype=x.dtype, device=x.device)
    block = min(1024, triton.next_power_of_2(d))
    _silu_and_mul_kernel[(rows, triton.cdiv(d, block))](
        x, out, x.stride(0), out.stride(0), d, BLOCK=block
    )
    return out


@triton.jit
def _rotary_neox_kernel(
    Q,
    K,
    QOut,
    KOut,
    Cos,
    Sin,
    Pos,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_ot,
    stride_oh,
    stride_kot,
    stride_koh,
    stride_c,
    heads,
    HALF: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One (token, head) of q or k (heads first, then the KV heads): the two halves x1, x2
    become x1 cos - x2 sin and x2 cos + x1 sin, each product and sum rounded to the dtype
    as torch's q * cos + rotate_half(q) * sin rounds them."""
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    d = tl.arange(0, BLOCK)
    ok = d < HALF
    if head < heads:
        src = Q + tok * stride_qt + head * stride_qh
        dst = QOut + tok * stride_ot + head * stride_oh
    else:
        src = K + tok * stride_kt + (head - heads) * stride_kh
        dst = KOut + tok * stride_kot + (head - heads) * stride_koh
    pos = tl.load(Pos + tok)
    table = pos * stride_c
    cos1 = tl.load(Cos + table + d, mask=ok, other=0.0).to(tl.float32)
    cos2 = tl.load(Cos + table + HALF + d, mask=ok, other=0.0).to(tl.float32)
    sin1 = tl.load(Sin + table + d, mask=ok, other=0.0).to(tl.float32)
    sin2 = tl.load(Sin + table + HALF + d, mask=ok, other=0.0).to(tl.float32)
    x1 = tl.load(src + d, mask=ok, other=0.0)
    x2 = tl.load(src + HALF + d, mask=ok, other=0.0)
    dtype = QOut.dtype.element_ty
    x1, x2 = x1.to(tl.float32), x2.to(tl.float32)
    a1 = (x1 * cos1).to(dtype).to(tl.float32)
    b1 = (-x2 * sin1).to(dtype).to(tl.float32)
    a2 = (x2 * cos2).to(dtype).to(tl.float32)
    b2 = (x1 * sin2).to(dtype).to(tl.float32)
    tl.store(dst + d, (a1 + b1).to(dtype), mask=ok)
    tl.store(dst + HALF + d, (a2 + b2).to(dtype), mask=ok)


def rotary_neox(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, heads, D], k [T, kv_heads, D] (last dim contiguous, any token / head strides)
    rotated by their positions through cos / sin [max_position, D]: new contiguous tensors."""
    tokens, heads, dim = q.shape
    kv_heads = k.shape[1]
    q_out = torch.empty(tokens, heads, dim, dtype=q.dtype, device=q.device)
    k_out = torch.empty(tokens, kv_heads, dim, dtype=k.dtype, device=k.device)
    if tokens == 0:
        return q_out, k_out
    _rotary_neox_kernel[(tokens, heads + kv_heads)](
        q, k, q_out, k_out, cos, sin, positions,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1), cos.stride(0),
        heads,
        HALF=dim // 2,
        BLOCK=max(16, triton.next_power_of_2(dim // 2)),
    )  # fmt: skip
    return q_out, k_out
