"""Triton kernels for varlen and paged attention (CUDA; Triton's interpreter runs them on CPU).

One kernel covers prefill (with or without a cached prefix), chunked prefill and decode:
a program owns BLOCK_M rows of one sequence and one KV head, a row being a (query token,
query head of the KV head's group) pair, so every K/V tile loaded serves the whole GQA group.
It walks the visible keys in BLOCK_N tiles with an online softmax (exp2 domain, fp32
accumulators); ``tl.range(..., num_stages)`` software-pipelines the K/V loads across tiles.
Keys are addressed through the block table when paged. Split-K for long decode contexts: a
third grid axis cuts each sequence's keys into that many chunks of whole key tiles, partial
results (out, lse) are merged afterwards, so a small decode batch still fills the GPU. The
chunks follow each sequence's own length: a launch sized for the longest context (a CUDA
graph's, worker/cuda_graphs.py) spreads a short context over every split as well.

Imported lazily, only on CUDA or under TRITON_INTERPRET=1; a CPU install never loads Triton.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm.attention.metadata import VarlenBatch
from pagedllm.attention.tuning import AttentionTuning, env_tiles, get_tuning

_UNBOUNDED = 1 << 30  # a window side of -1 becomes this: no branch in the kernel
_LOG2E = 1.4426950408889634


@triton.jit
def _attention_kernel(
    Q,
    K,
    V,
    Out,
    Lse,
    cu_q,
    seq_lens_k,
    cu_k,
    block_table,
    stride_qt,
    stride_qh,
    stride_os,
    stride_ot,
    stride_oh,
    stride_ls,
    stride_lh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_bt,
    kv_heads,
    page_size,
    scale_log2,
    window_left,
    window_right,
    num_splits,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    PAGED: tl.constexpr,
    SPLIT: tl.constexpr,
    WRITE_LSE: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    seq = tl.program_id(1) // kv_heads
    kvh = tl.program_id(1) % kv_heads
    q_start = tl.load(cu_q + seq)
    len_q = tl.load(cu_q + seq + 1) - q_start
    len_k = tl.load(seq_lens_k + seq)
    row0 = tl.program_id(0) * BLOCK_M
    if row0 >= len_q * GROUP:
        return
    rows = row0 + tl.arange(0, BLOCK_M)
    tok = rows // GROUP
    head = kvh * GROUP + rows % GROUP
    row_ok = tok < len_q
    pos = tok + len_k - len_q  # queries sit at the end of their keys (bottom-right)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    q_rows = (q_start + tok).to(tl.int64)
    q = tl.load(
        Q + q_rows[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    if UPCAST:  # the interpreter's tl.dot mishandles bf16 operands
        q = q.to(tl.float32)
    # Keys any row of the tile may see, then this program's split of them: num_splits
    # chunks of whole key tiles over this sequence's own range, so that a launch sized for
    # the longest context (a CUDA graph's) still spreads a short one over every split.
    last_tok = tl.minimum(row0 + BLOCK_M, len_q * GROUP) - 1
    lo = tl.maximum(row0 // GROUP + len_k - len_q - window_left, 0)
    hi = tl.minimum(last_tok // GROUP + len_k - len_q + window_right + 1, len_k)
    if SPLIT:
        chunk = tl.cdiv(tl.cdiv(tl.maximum(hi - lo, 0), num_splits), BLOCK_N) * BLOCK_N
        lo = lo + tl.program_id(2) * chunk
        hi = tl.minimum(hi, lo + chunk)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    k_head = K + kvh.to(tl.int64) * stride_kh
    v_head = V + kvh.to(tl.int64) * stride_vh
    for start in tl.range(lo, hi, BLOCK_N, num_stages=NUM_STAGES):
        keys = start + tl.arange(0, BLOCK_N)
        k_ok = keys < hi
        if PAGED:
            blk = tl.load(block_table + seq * stride_bt + keys // page_size, mask=k_ok, other=0)
            blk = blk.to(tl.int64)
            k_off = blk * stride_kb + (keys % page_size) * stride_ks
            v_off = blk * stride_vb + (keys % page_size) * stride_vs
        else:
            tok_k = (tl.load(cu_k + seq) + keys).to(tl.int64)
            k_off = tok_k * stride_ks
            v_off = tok_k * stride_vs
        kt = tl.load(  # [BLOCK_D, BLOCK_N]
            k_head + k_off[None, :] + d[:, None], mask=k_ok[None, :] & d_ok[:, None], other=0.0
        )
        if UPCAST:
            kt = kt.to(tl.float32)
        s = tl.dot(q, kt, input_precision=PRECISION) * scale_log2
        visible = (k_ok[None, :] & row_ok[:, None]) & (keys[None, :] >= pos[:, None] - window_left)
        visible = visible & (keys[None, :] <= pos[:, None] + window_right)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that saw nothing yet
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            v_head + v_off[:, None] + d[None, :], mask=k_ok[:, None] & d_ok[None, :], other=0.0
        )
        if UPCAST:
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    seen = l_i > 0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    split = tl.program_id(2).to(tl.int64)
    o_ptr = Out + split * stride_os + q_rows[:, None] * stride_ot + head[:, None] * stride_oh
    tl.store(o_ptr + d[None, :], out.to(Out.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    if WRITE_LSE:
        # An empty row: -inf for a split (weight 0 when merged), +inf as flash-attn reports.
        empty = float("-inf") if SPLIT else float("inf")
        lse = tl.where(seen, (m_i + tl.log2(tl.where(seen, l_i, 1.0))) * 0.6931471805599453, empty)
        tl.store(Lse + split * stride_ls + head * stride_lh + q_start + tok, lse, mask=row_ok)


def _num_splits(batch: VarlenBatch, programs: int, tuning: AttentionTuning) -> int:
    """Split-K when the (sequence, KV head, row tile) programs cannot fill the device."""
    if tuning.split_keys <= 0 or programs >= tuning.caches.num_units:
        return 1
    if batch.max_seqlen_k <= tuning.split_keys:
        return 1
    want = -(-2 * tuning.caches.num_units // programs)
    return max(1, min(want, -(-batch.max_seqlen_k // tuning.split_keys)))


@triton.jit
def _merge_kernel(
    Out,
    Lse,
    Merged,
    MergedLse,
    num_splits,
    stride_os,
    stride_ot,
    stride_oh,
    stride_ls,
    stride_lh,
    stride_mt,
    stride_mh,
    stride_mlh,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    """One (token, head) program: the splits' partial outputs, each weighted by
    exp(lse - the largest lse); an empty split (lse -inf) weighs 0, a row no split saw
    gets 0 and lse +inf, as the unsplit kernel reports it."""
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    split = tl.arange(0, BLOCK_S)
    split_ok = split < num_splits
    lse = tl.load(
        Lse + split * stride_ls + head * stride_lh + tok, mask=split_ok, other=float("-inf")
    )
    top = tl.max(lse, 0)
    weight = tl.exp(lse - tl.where(top == float("-inf"), 0.0, top))
    total = tl.sum(weight, 0)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    part = tl.load(
        Out + split[:, None] * stride_os + tok * stride_ot + head * stride_oh + d[None, :],
        mask=split_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    seen = total > 0
    merged = tl.sum(part * weight[:, None], 0) / tl.where(seen, total, 1.0)
    m_ptr = Merged + tok * stride_mt + head * stride_mh + d
    tl.store(m_ptr, merged.to(Merged.dtype.element_ty), mask=d_ok)
    lse_out = tl.where(seen, top + tl.log(tl.where(seen, total, 1.0)), float("inf"))
    tl.store(MergedLse + head * stride_mlh + tok, lse_out)


def _merge_splits(
    out: torch.Tensor, lse: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:  # [S, T, H, D], [S, H, T] -> [T, H, D], [H, T]
    """The split-K partial results merged in one launch, the output in dtype."""
    splits, total_q, heads, head_dim = out.shape
    merged = torch.empty(total_q, heads, head_dim, dtype=dtype, device=out.device)
    merged_lse = torch.empty(heads, total_q, dtype=torch.float32, device=out.device)
    _merge_kernel[(total_q, heads)](
        out, lse, merged, merged_lse, splits,
        out.stride(0), out.stride(1), out.stride(2), lse.stride(0), lse.stride(1),
        merged.stride(0), merged.stride(1), merged_lse.stride(0),
        HEAD_DIM=head_dim,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_S=max(2, triton.next_power_of_2(splits)),
    )  # fmt: skip
    return merged, merged_lse


def varlen_attention(
    query: torch.Tensor,  # [total_q, heads, head_dim]
    key: torch.Tensor,  # [total_k, kv_heads, head_dim] or paged [blocks, block_size, ...]
    value: torch.Tensor,
    batch: VarlenBatch,
    scale: float,
    window_left: int,
    window_right: int,
    return_lse: bool = False,
    tuning: AttentionTuning | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    total_q, heads, head_dim = query.shape
    kv_heads = key.shape[-2]
    group = heads // kv_heads
    tuning = tuning or get_tuning(query.device, head_dim, group, query.dtype, env_tiles())
    paged = batch.block_table is not None
    # Rows are (token, group head) pairs: a decode tile needs only `group` of them.
    block_m = max(16, min(tuning.block_m, triton.next_power_of_2(batch.max_seqlen_q * group)))
    row_tiles = triton.cdiv(batch.max_seqlen_q * group, block_m)
    splits = _num_splits(batch, row_tiles * batch.num_seqs * kv_heads, tuning)
    dev = query.device
    if splits > 1:
        out = torch.empty(splits, total_q, heads, head_dim, dtype=torch.float32, device=dev)
        lse = torch.empty(splits, heads, total_q, dtype=torch.float32, device=dev)
    else:
        out = torch.empty_like(query).unsqueeze(0)
        lse = torch.empty(1, heads, total_q, dtype=torch.float32, device=dev)
    table = batch.block_table if paged else batch.seq_lens_k  # any int32 tensor when unused
    cu_k = batch.cu_seqlens_k if not paged else batch.seq_lens_k
    grid = (row_tiles, batch.num_seqs * kv_heads, splits)
    _attention_kernel[grid](
        query,
        key,
        value,
        out,
        lse,
        batch.cu_seqlens_q,
        batch.seq_lens_k,
        cu_k,
        table,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        out.stride(2),
        lse.stride(0),
        lse.stride(1),
        key.stride(0) if paged else 0,
        key.stride(-3),
        key.stride(-2),
        value.stride(0) if paged else 0,
        value.stride(-3),
        value.stride(-2),
        table.stride(0),
        kv_heads,
        key.shape[1] if paged else 1,
        scale * _LOG2E,
        window_left if window_left >= 0 else _UNBOUNDED,
        window_right if window_right >= 0 else _UNBOUNDED,
        splits,
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_M=block_m,
        BLOCK_N=tuning.block_n,
        NUM_STAGES=tuning.num_stages,
        PAGED=paged,
        SPLIT=splits > 1,
        WRITE_LSE=return_lse or splits > 1,
        PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        UPCAST=query.device.type == "cpu",
        num_warps=8 if block_m >= 128 else 4,
    )
    if splits > 1:
        merged, merged_lse = _merge_splits(out, lse, query.dtype)
        return merged, (merged_lse if return_lse else None)
    return out[0], (lse[0] if return_lse else None)
