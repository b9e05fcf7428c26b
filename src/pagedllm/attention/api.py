"""flash-attn compatible functions: code written for flash_attn runs unchanged.

Same names, arguments, shapes and semantics as flash-attn 2 (causal masks aligned
bottom-right, ``window_size=(left, right)`` with -1 unbounded, GQA/MQA through fewer K/V heads,
``block_table`` for a paged K/V cache), on CPU as well as CUDA and in fp32 as well as fp16 /
bf16 (always fp32 accumulation). Each call goes to the kernel the attention backend registry
picks (attention/backend.py): the C++ kernel on CPU, the Triton kernels on CUDA, or the torch
reference (training with autograd, dropout, ALiBi, softcap, odd head dims).
``return_attn_probs=True`` returns ``(out, softmax_lse, None)``: the log-sum-exp is exact, the
probability matrix (flash-attn's test-only ``S_dmask``) is not materialised.
"""

from __future__ import annotations

import torch

from pagedllm.attention.backend import available_backends, backend_class, select_kernel
from pagedllm.attention.metadata import VarlenBatch

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

Output = torch.Tensor | tuple[torch.Tensor, torch.Tensor, None]


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise ValueError(message)


def _validate(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, paged: bool, dropout_p: float
) -> None:
    _check(q.dim() == 3, f"q must be [total_q, num_heads, head_dim], got shape {tuple(q.shape)}")
    kv_rank, kv_shape = (4, "[num_blocks, block_size, ") if paged else (3, "[total_k, ")
    _check(
        k.dim() == kv_rank and k.shape == v.shape,
        f"k and v must both be {kv_shape}num_kv_heads, head_dim], got {tuple(k.shape)} and "
        f"{tuple(v.shape)}",
    )
    _check(
        q.dtype in _DTYPES and k.dtype == q.dtype and v.dtype == q.dtype,
        f"q, k, v must share one dtype of float16 / bfloat16 / float32, got {q.dtype}, "
        f"{k.dtype}, {v.dtype}",
    )
    _check(q.device == k.device == v.device, "q, k, v must be on one device")
    _check(
        q.shape[-1] == k.shape[-1],
        f"q and k/v head_dim differ: {q.shape[-1]} vs {k.shape[-1]}",
    )
    _check(
        q.shape[1] % k.shape[-2] == 0,
        f"num_heads ({q.shape[1]}) must be a multiple of num_kv_heads ({k.shape[-2]})",
    )
    _check(all(t.stride(-1) == 1 for t in (q, k, v)), "the last dim of q, k, v must be contiguous")
    _check(0.0 <= dropout_p < 1.0, f"dropout_p must be in [0, 1), got {dropout_p}")


def _check_lengths(cu: torch.Tensor, name: str, device: torch.device) -> None:
    _check(
        cu.dim() == 1 and cu.dtype == torch.int32 and cu.device == device,
        f"{name} must be a 1-D int32 tensor on {device}, got {cu.dtype} {tuple(cu.shape)} "
        f"on {cu.device}",
    )


def _window(causal: bool, window_size: tuple[int, int]) -> tuple[int, int]:
    _check(len(window_size) == 2, f"window_size must be (left, right), got {window_size}")
    left, right = (int(w) for w in window_size)
    return left, (0 if causal else right)


def attention_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    batch: VarlenBatch,
    scale: float,
    window: tuple[int, int],
    dropout_p: float = 0.0,
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    return_lse: bool = False,
    impl: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Every flash-attn entry point lands here. The kernel comes from the attention backend
    registry (attention/backend.py), as the engine's does; impl forces a backend by name."""
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    extras = dropout_p > 0 or softcap > 0 or alibi_slopes is not None
    if impl is None:
        impl, kernel = select_kernel(q, k, reference=needs_grad or extras)
    else:
        _check(impl in available_backends(), f"impl must be one of {available_backends()}")
        kernel = backend_class(impl).kernel
    if impl == "torch":
        return kernel(
            q, k, v, batch, scale, *window, return_lse,
            dropout_p=dropout_p, softcap=softcap, alibi_slopes=alibi_slopes,
        )  # fmt: skip
    return kernel(q, k, v, batch, scale, *window, return_lse)


def _reject_unsupported(deterministic: bool, alibi_slopes: torch.Tensor | None, heads: int) -> None:
    del deterministic  # every path here is deterministic in the forward pass
    if alibi_slopes is not None:
        _check(
            alibi_slopes.dtype == torch.float32 and alibi_slopes.shape[-1] == heads,
            f"alibi_slopes must be float32 [num_heads] or [batch, num_heads], "
            f"got {alibi_slopes.dtype} {tuple(alibi_slopes.shape)}",
        )


def flash_attn_varlen_func(
    q: torch.Tensor,  # [total_q, num_heads, head_dim]
    k: torch.Tensor,  # [total_k, num_kv_heads, head_dim], or paged with block_table
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,  # [batch + 1] int32
    cu_seqlens_k: torch.Tensor | None,  # [batch + 1] int32
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    block_table: torch.Tensor | None = None,  # [batch, max_blocks] int32: k/v are a paged cache
    seqused_k: torch.Tensor | None = None,  # [batch] int32 keys per sequence (paged)
) -> Output:
    """flash_attn.flash_attn_varlen_func. Paged K/V: k/v [num_blocks, block_size, kv_heads,
    head_dim], key lengths from seqused_k or the differences of cu_seqlens_k."""
    paged = block_table is not None
    _validate(q, k, v, paged, dropout_p)
    _reject_unsupported(deterministic, alibi_slopes, q.shape[1])
    _check_lengths(cu_seqlens_q, "cu_seqlens_q", q.device)
    if seqused_k is not None:
        _check_lengths(seqused_k, "seqused_k", q.device)
        seq_lens_k = seqused_k
    else:
        _check(cu_seqlens_k is not None, "cu_seqlens_k (or seqused_k with block_table) is needed")
        _check_lengths(cu_seqlens_k, "cu_seqlens_k", q.device)
        seq_lens_k = (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).to(torch.int32)
    _check(
        seq_lens_k.shape[0] == cu_seqlens_q.shape[0] - 1,
        f"cu_seqlens_q has {cu_seqlens_q.shape[0] - 1} sequences, keys have {seq_lens_k.shape[0]}",
    )
    if paged:
        _check(
            block_table.dtype == torch.int32 and block_table.shape[0] == seq_lens_k.shape[0],
            f"block_table must be int32 [batch, max_blocks], got {block_table.dtype} "
            f"{tuple(block_table.shape)}",
        )
    batch = VarlenBatch(
        cu_seqlens_q=cu_seqlens_q,
        seq_lens_k=seq_lens_k,
        cu_seqlens_k=None if paged else cu_seqlens_k,
        block_table=block_table,
        max_seqlen_q=int(max_seqlen_q),
        max_seqlen_k=int(max_seqlen_k),
    )
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    out, lse = attention_varlen(
        q,
        k,
        v,
        batch,
        scale,
        _window(causal, window_size),
        dropout_p,
        softcap,
        alibi_slopes,
        return_attn_probs,
    )
    return (out, lse, None) if return_attn_probs else out


def flash_attn_varlen_kvpacked_func(
    q: torch.Tensor,
    kv: torch.Tensor,  # [total_k, 2, num_kv_heads, head_dim]
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *args: object,
    **kwargs: object,
) -> Output:
    _check(kv.dim() == 4 and kv.shape[1] == 2, f"kv must be [total_k, 2, h, d], got {kv.shape}")
    return flash_attn_varlen_func(
        q,
        kv[:, 0],
        kv[:, 1],
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        *args,
        **kwargs,
    )


def flash_attn_varlen_qkvpacked_func(
    qkv: torch.Tensor,  # [total, 3, num_heads, head_dim]
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    *args: object,
    **kwargs: object,
) -> Output:
    _check(qkv.dim() == 4 and qkv.shape[1] == 3, f"qkv must be [total, 3, h, d], got {qkv.shape}")
    return flash_attn_varlen_func(
        qkv[:, 0],
        qkv[:, 1],
        qkv[:, 2],
        cu_seqlens,
        cu_seqlens,
        max_seqlen,
        max_seqlen,
        *args,
        **kwargs,
    )


def flash_attn_func(
    q: torch.Tensor,  # [batch, seqlen_q, num_heads, head_dim]
    k: torch.Tensor,  # [batch, seqlen_k, num_kv_heads, head_dim]
    v: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
) -> Output:
    """flash_attn.flash_attn_func: equal-length sequences, as a varlen batch."""
    _check(
        q.dim() == 4 and k.dim() == 4,
        f"q, k must be [batch, seqlen, heads, head_dim], got {tuple(q.shape)} and {tuple(k.shape)}",
    )
    _check(k.shape[0] == q.shape[0], "q and k/v batch sizes differ")
    batch, len_q, heads = q.shape[:3]
    len_k = k.shape[1]
    cu_q = torch.arange(0, (batch + 1) * len_q, len_q, dtype=torch.int32, device=q.device)
    cu_k = torch.arange(0, (batch + 1) * len_k, len_k, dtype=torch.int32, device=q.device)
    result = flash_attn_varlen_func(
        q.reshape(batch * len_q, heads, -1),
        k.reshape(batch * len_k, k.shape[2], -1),
        v.reshape(batch * len_k, v.shape[2], -1),
        cu_q,
        cu_k,
        len_q,
        len_k,
        dropout_p,
        softmax_scale,
        causal,
        window_size,
        softcap,
        alibi_slopes,
        deterministic,
        return_attn_probs,
    )
    if not return_attn_probs:
        return result.view(q.shape)
    out, lse, _ = result
    return out.view(q.shape), lse.view(heads, batch, len_q).transpose(0, 1), None


def flash_attn_kvpacked_func(
    q: torch.Tensor, kv: torch.Tensor, *args: object, **kwargs: object
) -> Output:
    _check(kv.dim() == 5 and kv.shape[2] == 2, f"kv must be [b, s, 2, h, d], got {kv.shape}")
    return flash_attn_func(q, kv[:, :, 0], kv[:, :, 1], *args, **kwargs)


def flash_attn_qkvpacked_func(qkv: torch.Tensor, *args: object, **kwargs: object) -> Output:
    _check(qkv.dim() == 5 and qkv.shape[2] == 3, f"qkv must be [b, s, 3, h, d], got {qkv.shape}")
    return flash_attn_func(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], *args, **kwargs)
