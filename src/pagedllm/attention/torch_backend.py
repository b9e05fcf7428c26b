"""Vectorised torch attention over the paged KV cache: the reference and portable backend.

Decode (one query per sequence) is two batched matmuls over [B, kv_heads, group, head_dim]
rather than scaled_dot_product_attention, which is many times slower for one query on CPU.
Prefill sequences go one by one through scaled_dot_product_attention; a prompt with no
cached prefix attends to its own new keys directly, without reading the cache back.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedllm.attention.backend import AttentionBackend, PagedAttentionCall
from pagedllm.attention.metadata import AttentionMetadata


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


def prefill_attention(
    query: torch.Tensor,  # [n, num_heads, head_dim]
    key: torch.Tensor,  # [L, num_kv_heads, head_dim]
    value: torch.Tensor,
    scale: float,
    window_left: int,
) -> torch.Tensor:
    """Causal attention of the last n positions of an L-long sequence (bottom-right aligned)."""
    n, length = query.shape[0], key.shape[0]
    q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (query, key, value))
    if n == length and window_left < 0:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    else:
        query_pos = torch.arange(length - n, length, device=query.device)[:, None]
        key_pos = torch.arange(length, device=query.device)[None, :]
        mask = key_mask(query_pos, key_pos, window_left)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    return out.squeeze(0).transpose(0, 1)


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def attend(self, call: PagedAttentionCall, metadata: AttentionMetadata) -> torch.Tensor:
        query, key_cache, value_cache = call.query, call.key_cache, call.value_cache
        scale, window_left, batch = call.scale, call.window_left, metadata.batch
        if metadata.is_decode_only:
            return decode_attention(
                query,
                key_cache,
                value_cache,
                metadata.block_table,
                batch.seq_lens_k,
                batch.max_seqlen_k,
                scale,
                window_left,
            )
        out = torch.empty_like(query)
        decode_rows: list[int] = []
        starts = batch.cu_seqlens_q.tolist()
        for i, (n, length) in enumerate(zip(metadata.query_lens_cpu, metadata.seq_lens_cpu)):
            start = starts[i]
            if n == 1:
                decode_rows.append(i)
                continue
            if n == length:  # nothing cached: the new keys are the whole sequence
                k, v = call.key[start : start + n], call.value[start : start + n]
            else:
                table = metadata.block_table[i]
                k = gather_kv(key_cache, table, length)
                v = gather_kv(value_cache, table, length)
            out[start : start + n] = prefill_attention(
                query[start : start + n], k, v, scale, window_left
            )
        if decode_rows:
            rows = torch.tensor(decode_rows, device=query.device)
            token_idx = batch.cu_seqlens_q[rows].long()
            max_len = max(metadata.seq_lens_cpu[i] for i in decode_rows)
            out[token_idx] = decode_attention(
                query[token_idx],
                key_cache,
                value_cache,
                metadata.block_table[rows],
                batch.seq_lens_k[rows],
                max_len,
                scale,
                window_left,
            )
        return out
