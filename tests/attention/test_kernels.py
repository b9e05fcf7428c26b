"""Every CPU implementation against the plain reference over random varlen / paged batches."""

from __future__ import annotations

import random

import pytest
import torch
from helpers.attention_reference import (
    cpu_has_amx,
    cpu_has_bf16_dot,
    cu_seqlens,
    make_tensors,
    paginate,
    random_case,
    reference,
)
from helpers.ci import unavailable

from pagedllm.attention import cpu_kernels
from pagedllm.attention.api import attention_varlen
from pagedllm.attention.metadata import VarlenBatch
from pagedllm.attention.tuning import get_tuning

TOL = {torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 3e-2}
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@pytest.fixture(scope="module", params=["cpu", "cpu-vector", "torch"])
def impl(request):
    """cpu: the C++ kernel as it runs here (bf16 on vdpbf16ps where the CPU has AVX512-BF16);
    cpu-vector: the same kernel with that path off (every dtype on the vector-extension code)."""
    if request.param == "torch":
        yield "torch"
        return
    if not cpu_kernels.load():
        unavailable("the C++ attention kernel did not build (no C++ toolchain?)")
    before = cpu_kernels.bf16_dot()
    cpu_kernels.bf16_dot(before and request.param == "cpu")
    yield request.param
    cpu_kernels.bf16_dot(before)


def run_case(impl: str, case, seed: int, block_size: int | None):
    impl = "torch" if impl == "torch" else "cpu"
    q, k, v = make_tensors(case, seed)
    batch = VarlenBatch(
        cu_seqlens_q=cu_seqlens(case.q_lens),
        seq_lens_k=torch.tensor(case.k_lens, dtype=torch.int32),
        cu_seqlens_k=cu_seqlens(case.k_lens),
        block_table=None,
        max_seqlen_q=max(case.q_lens),
        max_seqlen_k=max(case.k_lens),
    )
    key, value = torch.cat(k), torch.cat(v)
    if block_size is not None:
        key, batch.block_table = paginate(k, block_size, seed)
        value, _ = paginate(v, block_size, seed)  # same seed: same block ids
        batch.cu_seqlens_k = None
    scale = case.head_dim**-0.5
    window = (case.window[0], 0 if case.causal else case.window[1])
    out, lse = attention_varlen(
        torch.cat(q), key, value, batch, scale, window, return_lse=True, impl=impl
    )
    want, want_lse = reference(q, k, v, scale, case.causal, case.window)
    return out, lse, want, want_lse


@pytest.mark.parametrize("seed", range(12))
def test_varlen_matches_reference(impl, seed):
    case = random_case(random.Random(seed), DTYPES, (16, 32, 64))
    out, lse, want, want_lse = run_case(impl, case, seed, block_size=None)
    assert out.dtype == case.dtype
    torch.testing.assert_close(out.float(), want, atol=TOL[case.dtype], rtol=TOL[case.dtype])
    torch.testing.assert_close(lse, want_lse, atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_paged_matches_reference(impl, seed, block_size):
    case = random_case(random.Random(100 + seed), DTYPES, (16, 64, 128))
    out, lse, want, _ = run_case(impl, case, seed, block_size)
    torch.testing.assert_close(out.float(), want, atol=TOL[case.dtype], rtol=TOL[case.dtype])


def test_long_sequences_cross_many_tiles(impl):
    """Several query and key tiles per sequence, a window, GQA, bf16 (tiles of the CPU rule)."""
    rng = random.Random(7)
    case = random_case(rng, (torch.bfloat16,), (64,), max_len=40)
    case.q_lens, case.k_lens = [300, 1, 77], [300, 400, 200]
    case.heads, case.kv_heads, case.causal, case.window = 8, 2, True, (150, -1)
    out, _, want, _ = run_case(impl, case, 3, block_size=16)
    torch.testing.assert_close(out.float(), want, atol=3e-2, rtol=3e-2)


def test_rows_that_see_no_key_are_zero(impl):
    """More queries than keys, causal: the first rows see nothing (flash-attn: out 0, lse inf)."""
    rng = random.Random(0)
    case = random_case(rng, (torch.float32,), (16,))
    case.q_lens, case.k_lens, case.causal, case.window = [6], [3], True, (-1, -1)
    out, lse, want, _ = run_case(impl, case, 0, block_size=None)
    assert torch.all(out[:3] == 0) and torch.isinf(lse[:, :3]).all()
    torch.testing.assert_close(out, want)


def test_threads_split_work_without_changing_results(impl):
    """Items handed out through the shared counter: 2 threads give the 1-thread result."""
    if impl == "torch":
        pytest.skip("the C++ kernel's own threading")
    case = random_case(random.Random(5), (torch.bfloat16,), (64,))
    case.q_lens, case.k_lens, case.heads, case.kv_heads = [1] * 9 + [40], [50] * 9 + [60], 4, 2
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = run_case(impl, case, 1, block_size=4)[0]
        torch.set_num_threads(2)
        two = run_case(impl, case, 1, block_size=4)[0]
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("threads", [1, 2])
def test_few_decode_sequences_split_their_keys_into_merged_chunks(impl, dtype, threads):
    """One or two decoding sequences (fewer than 4 items a thread): each (sequence, kv head)'s
    keys in chunks, merged by the last to finish; out and lse as the reference's, including a
    window that leaves the early chunks no key to see (weight 0 in the merge). Two sequences
    on one thread make 6 items: not split. Fewer sequences than threads: one split group a
    sequence, all its kv heads in each chunk."""
    if impl == "torch":
        pytest.skip("the C++ kernel's own work split")
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for seed, (k_lens, window) in enumerate(
            [([1000], (-1, -1)), ([700, 130], (-1, -1)), ([900], (100, -1))]
        ):
            case = random_case(random.Random(seed), (dtype,), (64,))
            case.q_lens, case.k_lens, case.window = [1] * len(k_lens), k_lens, window
            case.heads, case.kv_heads, case.causal = 9, 3, True
            before = cpu_kernels.split_merges()
            out, lse, want, want_lse = run_case(impl, case, seed, block_size=16)
            # (sequence, kv head) items: split when fewer than 4 a thread, every one of them;
            # (sequence, all kv heads) when sequences are fewer than threads
            items = 3 * len(k_lens)
            groups = items if items < 4 * threads else 0
            if len(k_lens) < threads:
                groups = len(k_lens)
            assert cpu_kernels.split_merges() - before == groups
            torch.testing.assert_close(out.float(), want, atol=TOL[dtype], rtol=TOL[dtype])
            torch.testing.assert_close(lse, want_lse, atol=1e-3, rtol=1e-3)
    finally:
        torch.set_num_threads(saved)


@pytest.fixture(params=["amx", "vdpbf16ps"])
def many_row_products(request):
    """The bf16 path's many-row products on AMX tiles (where the CPU has them) or on
    vdpbf16ps GEMM micro-kernels."""
    if not cpu_kernels.load():
        unavailable("the C++ attention kernel did not build (no C++ toolchain?)")
    if not cpu_has_bf16_dot():
        pytest.skip("no AVX512-BF16 on this CPU: bf16 takes the vector path")
    if request.param == "amx" and not cpu_has_amx():
        pytest.skip("no AMX-BF16 on this CPU")
    before = cpu_kernels.amx()
    cpu_kernels.amx(request.param == "amx")
    assert cpu_kernels.amx() == (request.param == "amx")
    yield request.param
    cpu_kernels.amx(before)


@pytest.mark.parametrize("head_dim", [32, 64, 96, 128])
def test_bf16_prefill_tiles_score_as_a_gemm_within_tolerance(head_dim, many_row_products):
    """Many query rows a tile (prefill chunks, GQA groups): keys transposed once, scores and
    P @ V as small GEMMs (AMX tiles of 16 rows, or 6 rows x 32 keys and 6 rows x 64 features
    on vdpbf16ps); against the reference and the vector path over causal and windowed chunks,
    row counts that are no multiple of 16, key counts that leave a half group of 16 and chunks
    that end short of their keys, paged and contiguous."""
    rng = random.Random(head_dim)
    for seed, window in enumerate([(-1, -1), (-1, -1), (37, -1), (50, 5)]):
        case = random_case(rng, (torch.bfloat16,), (head_dim,))
        case.kv_heads = rng.choice([1, 2, 3])
        case.heads = case.kv_heads * rng.choice([1, 3, 4])
        case.k_lens = [rng.randint(40, 300) for _ in range(3)]
        case.q_lens = [k if i == 0 else rng.randint(17, k) for i, k in enumerate(case.k_lens)]
        case.causal, case.window = True, window
        before, amx_before = cpu_kernels.gemm_tiles(), cpu_kernels.amx_tiles()
        out, lse, want, want_lse = run_case("cpu", case, seed, 16 if seed % 2 else None)
        assert cpu_kernels.gemm_tiles() > before
        amx_tiles = cpu_kernels.amx_tiles() - amx_before
        if many_row_products == "amx":
            assert amx_tiles == cpu_kernels.gemm_tiles() - before
        else:
            assert amx_tiles == 0
        try:
            cpu_kernels.bf16_dot(False)
            vector = run_case("cpu", case, seed, 16 if seed % 2 else None)[0]
        finally:
            cpu_kernels.bf16_dot(True)
        torch.testing.assert_close(out.float(), want, atol=3e-2, rtol=3e-2)
        torch.testing.assert_close(out.float(), vector.float(), atol=3e-2, rtol=3e-2)
        torch.testing.assert_close(lse, want_lse, atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_tiles_score_as_a_gemm_on_the_vector_path(dtype):
    """The vector-extension path (every dtype; bf16 too with vdpbf16ps off): a tile of more than
    8 query rows scores as a small GEMM (keys transposed into fp32 once, 6 rows x 16 keys a
    pass), a decode tile of a few rows as dot products. Against the reference over head dims
    of 1-8 vectors, GQA groups of 1-4 (row counts of every remainder of 6), key counts that
    leave a last group of 8, windows, paged and contiguous; decode-only batches count no GEMM
    tile."""
    if not cpu_kernels.load():
        unavailable("the C++ attention kernel did not build (no C++ toolchain?)")
    before_dot = cpu_kernels.bf16_dot()
    cpu_kernels.bf16_dot(False)
    try:
        rng = random.Random(11)
        for seed, head_dim in enumerate([16, 48, 64, 128, 64, 80]):
            case = random_case(rng, (dtype,), (head_dim,))
            case.kv_heads = rng.choice([1, 2, 3])
            case.heads = case.kv_heads * (seed % 4 + 1)
            case.k_lens = [rng.randint(9, 150) for _ in range(3)]
            case.k_lens[0] = 64 + 8 * rng.randint(1, 7) + rng.randint(-7, 0)  # a last 8 group
            case.q_lens = [rng.randint(3, k) for k in case.k_lens]
            case.causal = True
            case.window = [(-1, -1), (29, -1), (40, 3)][seed % 3]
            before = cpu_kernels.gemm_tiles()
            out, lse, want, want_lse = run_case("cpu", case, seed, 16 if seed % 2 else None)
            assert cpu_kernels.gemm_tiles() > before
            torch.testing.assert_close(out.float(), want, atol=TOL[dtype], rtol=TOL[dtype])
            torch.testing.assert_close(lse, want_lse, atol=1e-3, rtol=1e-3)

            case.q_lens = [1] * len(case.k_lens)  # decode: at most 4 rows a tile
            before = cpu_kernels.gemm_tiles()
            out, _, want, _ = run_case("cpu", case, seed, 16)
            assert cpu_kernels.gemm_tiles() == before
            torch.testing.assert_close(out.float(), want, atol=TOL[dtype], rtol=TOL[dtype])
    finally:
        cpu_kernels.bf16_dot(before_dot)


def test_amx_tiles_are_on_by_default_where_the_cpu_has_them():
    """The kernel asks Linux for the tile state once; on a CPU with AMX-BF16 the many-row
    products take the tiles unless PAGEDLLM_CPU_AMX_ATTENTION=0."""
    if not cpu_kernels.load():
        unavailable("the C++ attention kernel did not build (no C++ toolchain?)")
    if not cpu_has_amx():
        assert not cpu_kernels.amx(True)  # nothing to turn on
        return
    assert cpu_kernels.amx()


@pytest.mark.parametrize("head_dim", [32, 64, 96, 128])
@pytest.mark.parametrize("block_size", [None, 16])
def test_bf16_dot_path_matches_reference_and_the_vector_path(head_dim, block_size):
    """bf16 on vdpbf16ps (P rounded to bf16 pairs of keys, V rows of two keys interleaved):
    within bf16 tolerance of the reference and of the vector path, over decode rows (one
    query a sequence, GQA groups of 1-4), odd key counts (padded pairs), windows and tiles."""
    if not cpu_kernels.load():
        unavailable("the C++ attention kernel did not build (no C++ toolchain?)")
    if not cpu_has_bf16_dot():
        pytest.skip("no AVX512-BF16 on this CPU: bf16 takes the vector path")
    assert cpu_kernels.bf16_dot()  # on by default where the CPU has it
    rng = random.Random(head_dim)
    differ = 0
    for seed in range(4):
        case = random_case(rng, (torch.bfloat16,), (head_dim,), max_len=40)
        if seed % 2 == 0:  # decode: one query a sequence over 1-300 keys, 12 sequences (on
            # 2 threads each claims its next item ahead and prefetches its first keys)
            case.q_lens = [1] * 12
            case.k_lens = [rng.randint(1, 300) for _ in case.q_lens]
        out, _, want, _ = run_case("cpu", case, seed, block_size)
        try:
            cpu_kernels.bf16_dot(False)
            vector = run_case("cpu", case, seed, block_size)[0]
        finally:
            cpu_kernels.bf16_dot(True)
        torch.testing.assert_close(out.float(), want, atol=3e-2, rtol=3e-2)
        torch.testing.assert_close(out.float(), vector.float(), atol=3e-2, rtol=3e-2)
        differ += not torch.equal(out, vector)
    assert differ  # two paths, not one taken twice (one key a row gives V on both)


def _decode_tiles(dtype, keys: int) -> tuple[int, int]:
    """One decoding sequence of `keys` keys on one thread (3 kv heads: 3 items, too few keys
    to split), checked against the reference: the key tiles it ran and their padded keys."""
    if not cpu_kernels.load():
        unavailable("the C++ attention kernel did not build (no C++ toolchain?)")
    if get_tuning("cpu", 64, 3, dtype).block_n != 64:
        pytest.skip("this L1 cache gives key tiles of other than 64")
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        case = random_case(random.Random(keys), (dtype,), (64,))
        case.q_lens, case.k_lens, case.window = [1], [keys], (-1, -1)
        case.heads, case.kv_heads, case.causal = 9, 3, True
        tiles, padded = cpu_kernels.key_tiles(), cpu_kernels.tile_keys()
        merges = cpu_kernels.split_merges()
        out, lse, want, want_lse = run_case("cpu", case, 0, block_size=16)
        assert cpu_kernels.split_merges() == merges
        torch.testing.assert_close(out.float(), want, atol=TOL[dtype], rtol=TOL[dtype])
        torch.testing.assert_close(lse, want_lse, atol=1e-3, rtol=1e-3)
        return cpu_kernels.key_tiles() - tiles, cpu_kernels.tile_keys() - padded
    finally:
        torch.set_num_threads(saved)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_short_last_tile_computes_its_keys_padded_not_a_whole_tile(dtype):
    """120 keys: a tile of 64 and one of the 56 left (more than half a tile: a tile of their
    own). The vdpbf16ps path (bf16 with AVX512-BF16) pads the short one to 16 keys (64 + 64
    an item), the vector path to 8 (64 + 56); fp32 a few rows on tiles of 32 (and a last of
    up to 48): 32 + 32 + 32 + 24."""
    dot = dtype == torch.bfloat16 and cpu_has_bf16_dot()
    tiles, padded = _decode_tiles(dtype, 120)
    assert (tiles, padded) == (3 * (2 if dtype != torch.float32 else 4), 3 * (128 if dot else 120))


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_last_tile_of_half_a_tile_or_less_joins_the_one_before(dtype):
    """70 keys: the 6 past the first 64 would be a tile of their own that costs what a whole
    one does; they join it (up to block_n / 2 more keys), one tile of 70 an item, padded to
    80 on the vdpbf16ps path and 72 on the vector path. fp32's tiles of 32 take the last 38
    with the 32 before them (up to 16 more): 32 + 38."""
    dot = dtype == torch.bfloat16 and cpu_has_bf16_dot()
    tiles, padded = _decode_tiles(dtype, 70)
    assert (tiles, padded) == (3 * (1 if dtype != torch.float32 else 2), 3 * (80 if dot else 72))


def test_many_row_tiles_on_the_bf16_dot_path_take_twice_the_keys():
    """Four 32-token prefill chunks at the end of 256 keys, GQA groups of 3 (96 rows a tile),
    one thread: an item a sequence with its 3 kv heads, none split. On the vdpbf16ps path the
    many-row tiles take 2 x 64 keys (their transposed keys and interleaved values are bf16,
    the bytes of the L1 rule's fp32 tile): 2 tiles an item; the vector path keeps 64: 4."""
    if not cpu_kernels.load():
        unavailable("the C++ attention kernel did not build (no C++ toolchain?)")
    if not cpu_has_bf16_dot():
        pytest.skip("no AVX512-BF16 on this CPU: bf16 takes the vector path")
    if get_tuning("cpu", 64, 3, torch.bfloat16).block_n != 64:
        pytest.skip("this L1 cache gives key tiles of other than 64")
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        case = random_case(random.Random(256), (torch.bfloat16,), (64,))
        case.q_lens, case.k_lens, case.window = [32] * 4, [256] * 4, (-1, -1)
        case.heads, case.kv_heads, case.causal = 9, 3, True
        counts = []
        for dot in (True, False):
            cpu_kernels.bf16_dot(dot)
            tiles, gemm = cpu_kernels.key_tiles(), cpu_kernels.gemm_tiles()
            out, _, want, _ = run_case("cpu", case, 0, block_size=16)
            torch.testing.assert_close(out.float(), want, atol=3e-2, rtol=3e-2)
            counts.append((cpu_kernels.key_tiles() - tiles, cpu_kernels.gemm_tiles() - gemm))
        assert counts == [(8, 8), (16, 16)]
    finally:
        cpu_kernels.bf16_dot(True)
        torch.set_num_threads(saved)


def _shared_prefix_batch(rng, members, prefix_blocks, others, q_lens, window, block_size=16):
    """`members` sequences whose tables start with the same `prefix_blocks` blocks, then their
    own blocks; `others` with blocks of their own. Returns the kernel's and the reference's
    (out, lse) and the shared-prefix items the kernel ran."""
    heads, kv_heads, dim = 9, 3, 64
    count = members + others
    own = [rng.randint(1, 90) for _ in range(count)]
    k_lens = [(prefix_blocks * block_size if i < members else 0) + own[i] for i in range(count)]
    k_lens = [max(k, q) for k, q in zip(k_lens, q_lens)]
    blocks = 1 + prefix_blocks + sum(-(-k // block_size) for k in k_lens)
    key = torch.randn(blocks, block_size, kv_heads, dim).bfloat16()
    value = torch.randn(blocks, block_size, kv_heads, dim).bfloat16()
    tables, free = [], 1 + prefix_blocks
    for i, length in enumerate(k_lens):
        row = list(range(1, 1 + prefix_blocks)) if i < members else []
        extra = -(-length // block_size) - len(row)
        tables.append(row + list(range(free, free + extra)))
        free += extra
    width = max(len(r) for r in tables)
    batch = VarlenBatch(
        cu_seqlens_q=cu_seqlens(q_lens),
        seq_lens_k=torch.tensor(k_lens, dtype=torch.int32),
        cu_seqlens_k=None,
        block_table=torch.tensor([r + [0] * (width - len(r)) for r in tables], dtype=torch.int32),
        max_seqlen_q=max(q_lens),
        max_seqlen_k=max(k_lens),
    )
    qs = [torch.randn(n, heads, dim).bfloat16() for n in q_lens]
    ks = [key[r].reshape(-1, kv_heads, dim)[:n] for r, n in zip(tables, k_lens)]
    vs = [value[r].reshape(-1, kv_heads, dim)[:n] for r, n in zip(tables, k_lens)]
    before = cpu_kernels.shared_prefix_items()
    out, lse = attention_varlen(
        torch.cat(qs), key, value, batch, dim**-0.5, (window, 0), return_lse=True, impl="cpu"
    )
    ran = cpu_kernels.shared_prefix_items() - before
    want, want_lse = reference(qs, ks, vs, dim**-0.5, True, (window, -1))
    return out, lse, want, want_lse, ran


@pytest.mark.parametrize("threads", [1, 2])
def test_sequences_sharing_a_prefix_attend_it_once_for_all_of_them(threads, many_row_products):
    """Decoding sequences whose tables begin with the same blocks (prefix caching's shared
    prompt): the prefix is attended by one item per set and kv group, merged with each
    sequence's own keys; out and lse as the reference's. Sets: as many as 48 rows a kv head
    need, a multiple of the threads where each keeps 16 rows. 16 sequences of 3 rows: one set
    on 1 thread, two of 8 sequences on 2 (whole-head items: 1 or 2 items); 5 of them among 7
    (15 rows, one set; on 2 threads an item per kv head: 3); 40: sets of 14, 14, 12 on 1
    thread (3), of 10 on 2 (4); a prefill chunk among 6 members (9 query rows, one tile; 42
    rows): one set on 1 thread, two on 2 (items per kv head: 6)."""
    if not cpu_kernels.load():
        unavailable("the C++ attention kernel did not build (no C++ toolchain?)")
    if not cpu_has_bf16_dot():
        pytest.skip("no AVX512-BF16 on this CPU: bf16 takes the vector path, without sets")
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    rng = random.Random(threads)
    try:
        two = threads == 2
        per_head = 3 if two else 1  # 7 tiles: items per kv head on 2 threads
        cases = [(16, 16, 0, None, 2 if two else 1), (5, 5, 2, None, per_head)]
        cases.append((40, 10, 3, None, 4 if two else 3))
        cases.append((6, 8, 1, [1, 1, 9, 1, 1, 1, 1], 2 * per_head if two else 1))
        for members, prefix_blocks, others, q_lens, items in cases:
            q_lens = q_lens or [1] * (members + others)
            amx_before = cpu_kernels.amx_tiles()
            out, lse, want, want_lse, ran = _shared_prefix_batch(
                rng, members, prefix_blocks, others, q_lens, -1
            )
            assert ran == items
            # sets of 16 rows or more multiply the prefix on AMX tiles where they are on
            many_rows = 3 * members + (8 if q_lens[2] == 9 else 0) >= 16
            amx_tiles = cpu_kernels.amx_tiles() - amx_before
            assert (amx_tiles > 0) == (many_rows and many_row_products == "amx")
            torch.testing.assert_close(out.float(), want, atol=3e-2, rtol=3e-2)
            torch.testing.assert_close(lse, want_lse, atol=1e-3, rtol=1e-3)
    finally:
        torch.set_num_threads(saved)


def test_shared_prefix_merges_give_two_threads_the_bits_of_one(many_row_products):
    """Each decoding member's prefix chunk (its set's item) and its own keys merge in the item
    that ends last, from their records or straight from that item's scratch when the other is
    done: on two threads, call after call, out and lse are one thread's bit for bit, and each
    call merges every member's group (40 members, whole-head items: one group each)."""
    saved = torch.get_num_threads()
    results = []
    try:
        for threads in (1, 2, 2, 2):
            torch.set_num_threads(threads)
            torch.manual_seed(0)
            before = cpu_kernels.split_merges()
            out, lse, _, _, ran = _shared_prefix_batch(random.Random(3), 40, 16, 0, [1] * 40, -1)
            assert ran > 0
            assert cpu_kernels.split_merges() - before == 40
            results.append((out, lse))
    finally:
        torch.set_num_threads(saved)
    for out, lse in results[1:]:
        assert torch.equal(out, results[0][0])
        assert torch.equal(lse, results[0][1])


def test_shared_prefix_needs_four_sequences_64_keys_48_rows_each_and_no_left_window():
    """Three sharing sequences, a prefix of 3 blocks (48 keys), chunks of 17 query tokens (51
    rows a kv head: each would fill a set alone) or a sliding window: no set, each sequence on
    its own, the same results. Chunks of 16 tokens (48 rows) still share the prefix."""
    if not cpu_kernels.load():
        unavailable("the C++ attention kernel did not build (no C++ toolchain?)")
    rng = random.Random(3)
    cases = [(3, 8, 1, -1), (8, 3, 1, -1), (6, 8, 17, -1), (8, 8, 1, 40), (6, 8, 16, -1)]
    for members, prefix_blocks, q_len, window in cases:
        q_lens = [q_len] * (members + 1)
        out, _, want, _, ran = _shared_prefix_batch(rng, members, prefix_blocks, 1, q_lens, window)
        sharing = q_len == 16 and cpu_has_bf16_dot()
        assert (ran > 0) == sharing
        torch.testing.assert_close(out.float(), want, atol=3e-2, rtol=3e-2)
