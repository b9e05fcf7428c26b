"""The torch reference implementation of attention: the "torch" backend, and the path of the
flash-attn functions that covers what the kernels leave out (autograd, dropout, ALiBi, softcap,
head dims that are not a multiple of 16).

One function, :func:`varlen_attention` (the signature of attention.backend.VarlenKernel), over
contiguous or paged K/V: one sequence at a time, materialising its scores ([heads, query_len,
key_len] fp32). A batch of decode rows over a paged cache (one query per sequence, nothing
to differentiate) takes two batched matmuls over [B, kv_heads, group, head_dim] instead, many
times faster than a loop for one query each.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedllm.attention.backend import VarlenKernelBackend
from pagedllm.attention.metadata import VarlenBatch


def gather_kv(
    cache: torch.Tensor, block_table: torch.Tensor, num_keys: int
) -> torch.Tensor:  # [num_keys, num_kv_heads, head_dim]
    block_size = cache.shape[1]
    num_blocks = -(-num_keys // block_size)
    return cache[block_table[:num_blocks].long()].flatten(0, 1)[:num_keys]


def key_mask(
    query_pos: torch.Tensor, key_pos: torch.Tensor, window_left: int
) -> torch.Tensor:  # [..., num_queries, num_keys] bool, True where attention is allowed
    allowed = key_pos <= query_pos
    if window_left >= 0:
        allowed &= key_pos >= query_pos - window_left
    return allowed


def decode_attention(
    query: torch.Tensor,  # [B, num_heads, head_dim], one query per sequence
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks]
    seq_lens: torch.Tensor,  # [B]
    max_seq_len: int,
    scale: float,
    window_left: int,
) -> torch.Tensor:
    batch, num_heads, head_dim = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    num_blocks = -(-max_seq_len // block_size)
    blocks = block_tables[:, :num_blocks].long()
    # [B, kv_heads, L, head_dim], L = num_blocks * block_size (padding masked below)
    keys = key_cache[blocks].flatten(1, 2).transpose(1, 2)
    values = value_cache[blocks].flatten(1, 2).transpose(1, 2)
    q = query.view(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)
    scores = torch.matmul(q, keys.transpose(-1, -2)).float() * scale  # [B, kvh, group, L]
    key_pos = torch.arange(keys.shape[2], device=query.device)
    query_pos = (seq_lens.long() - 1)[:, None]
    allowed = key_mask(query_pos, key_pos[None, :], window_left)  # [B, L]
    scores.masked_fill_(~allowed[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(values.dtype)
    return torch.matmul(probs, values).view(batch, num_heads, head_dim)


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


def _batched_decode(
    query: torch.Tensor, batch: VarlenBatch, needs_more: bool, return_lse: bool
) -> bool:
    """Whether a call is decode rows over a paged cache that the batched path computes."""
    return (
        batch.block_table is not None
        and batch.max_seqlen_q == 1
        and query.shape[0] == batch.seq_lens_k.shape[0]
        and not needs_more
        and not return_lse
        and not (torch.is_grad_enabled() and query.requires_grad)
    )


def varlen_attention(
    query: torch.Tensor,  # [total_q, heads, head_dim]
    key: torch.Tensor,  # [total_k, kv_heads, head_dim] or paged [blocks, block_size, ...]
    value: torch.Tensor,
    batch: VarlenBatch,
    scale: float,
    window_left: int,
    window_right: int,
    return_lse: bool = False,
    *,
    dropout_p: float = 0.0,
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,  # [heads] or [B, heads] fp32
) -> tuple[torch.Tensor, torch.Tensor | None]:  # out like query, lse [heads, total_q] fp32
    needs_more = dropout_p > 0 or softcap > 0 or alibi_slopes is not None
    if _batched_decode(query, batch, needs_more, return_lse):
        out = decode_attention(
            query, key, value, batch.block_table, batch.seq_lens_k, batch.max_seqlen_k, scale,
            window_left,
        )  # fmt: skip
        return out, None
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


class TorchAttentionBackend(VarlenKernelBackend):
    """Portable: any device, dtype and head size."""

    name = "torch"
    kernel = staticmethod(varlen_attention)
    tuned = False
