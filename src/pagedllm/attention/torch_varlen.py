"""Varlen attention in plain torch ops, one sequence at a time.

The portable path of the flash-attn functions, and the one that covers what the kernels leave
out: autograd (training), dropout, ALiBi, softcap, head dims that are not a multiple of 16.
It materialises one sequence's scores ([heads, query_len, key_len] fp32) at a time.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedllm.attention.metadata import VarlenBatch
from pagedllm.attention.torch_backend import gather_kv


def visible_keys(
    query_len: int, key_len: int, window_left: int, window_right: int, device: torch.device
) -> torch.Tensor:  # [query_len, key_len] bool
    """Which keys each query sees; queries are the last query_len positions (bottom-right)."""
    pos = torch.arange(key_len - query_len, key_len, device=device)[:, None]
    key = torch.arange(key_len, device=device)[None, :]
    visible = torch.ones(query_len, key_len, dtype=torch.bool, device=device)
    if window_left >= 0:
        visible &= key >= pos - window_left
    if window_right >= 0:
        visible &= key <= pos + window_right
    return visible


def sequence_kv(
    cache: torch.Tensor, batch: VarlenBatch, index: int, key_len: int
) -> torch.Tensor:  # [key_len, kv_heads, head_dim]
    if batch.block_table is not None:
        return gather_kv(cache, batch.block_table[index], key_len)
    start = int(batch.cu_seqlens_k[index])
    return cache[start : start + key_len]


def attend_sequence(
    q: torch.Tensor,  # [n, heads, head_dim]
    k: torch.Tensor,  # [L, kv_heads, head_dim]
    v: torch.Tensor,
    visible: torch.Tensor,  # [n, L]
    scale: float,
    dropout_p: float,
    softcap: float,
    alibi: torch.Tensor | None,  # [heads] slopes
) -> tuple[torch.Tensor, torch.Tensor]:  # out [n, heads, head_dim], lse [heads, n] fp32
    n, heads, head_dim = q.shape
    length, kv_heads = k.shape[:2]
    group = heads // kv_heads
    qg = q.float().view(n, kv_heads, group, head_dim)
    scores = torch.einsum("nhgd,lhd->hgnl", qg, k.float()) * scale  # [kvh, group, n, L]
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    if alibi is not None:
        pos = torch.arange(length - n, length, device=q.device)[:, None]
        dist = (pos - torch.arange(length, device=q.device)[None, :]).abs()
        scores = scores - alibi.float().view(kv_heads, group, 1, 1) * dist
    # A row that sees no key gets finite scores here (so gradients stay finite), then zero
    # probabilities, and lse +inf as in flash-attn.
    empty = ~visible.any(dim=-1, keepdim=True)  # [n, 1]
    scores = scores.masked_fill(~visible, float("-inf")).masked_fill(empty, 0.0)
    lse = torch.logsumexp(scores, dim=-1)  # [kvh, group, n]
    probs = torch.exp(scores - lse[..., None]).masked_fill(empty, 0.0)
    if dropout_p > 0:
        probs = F.dropout(probs, dropout_p, training=True)
    out = torch.einsum("hgnl,lhd->nhgd", probs, v.float()).reshape(n, heads, head_dim)
    lse = lse.masked_fill(empty[:, 0], float("inf"))
    return out.to(q.dtype), lse.reshape(heads, n)


def varlen_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    batch: VarlenBatch,
    scale: float,
    window_left: int,
    window_right: int,
    return_lse: bool = False,
    dropout_p: float = 0.0,
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,  # [heads] or [B, heads] fp32
) -> tuple[torch.Tensor, torch.Tensor | None]:
    outs, lses = [], []
    starts = batch.cu_seqlens_q.tolist()
    key_lens = batch.seq_lens_k.tolist()
    for i, key_len in enumerate(key_lens):
        q = query[starts[i] : starts[i + 1]]
        k = sequence_kv(key, batch, i, key_len)
        v = sequence_kv(value, batch, i, key_len)
        visible = visible_keys(q.shape[0], key_len, window_left, window_right, query.device)
        alibi = None
        if alibi_slopes is not None:
            alibi = alibi_slopes[i] if alibi_slopes.dim() == 2 else alibi_slopes
        out, lse = attend_sequence(q, k, v, visible, scale, dropout_p, softcap, alibi)
        outs.append(out)
        lses.append(lse)
    out = torch.cat(outs) if outs else torch.empty_like(query)
    lse = torch.cat(lses, dim=1) if return_lse and lses else None
    return out, lse
