"""A CPU model's weights moved into one huge-page arena (worker/huge_pages.py): every tensor
object that views a weight re-pointed to the same bytes, the KV cache left where it is, the
mapping advised for 2 MB pages, and a model's tokens unchanged."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from pagedllm import LLM, SamplingParams
from pagedllm.worker.huge_pages import HUGE_PAGE, gather_weights, in_arena


class _Holder(nn.Module):
    """Weights held every way the layers hold them: a parameter, a buffer that is a view of
    a flat tensor, a kernel object's attributes (one of them the buffer itself), and a cache
    to leave alone."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(24, 40)
        flat = torch.arange(3000, dtype=torch.uint8)
        self.register_buffer("codes", flat.view(30, 100))
        self.kernel = SimpleNamespace(codes=self.codes, scale=torch.rand(30, dtype=torch.float16))
        self.cache = torch.randn(64, 8)


def test_gather_weights_repoints_every_view_of_a_weight_into_one_aligned_arena():
    m = _Holder()
    before = {name: t.clone() for name, t in m.state_dict().items()}
    scale, cache_ptr = m.kernel.scale.clone(), m.cache.data_ptr()
    base = m.codes._base
    tensors = [m.linear.weight, m.linear.bias, m.codes, base, m.kernel.scale]
    nbytes = sum(t.untyped_storage().nbytes() for t in tensors if t is not base)  # codes: base's
    moved = gather_weights(m, leave=[m.cache])
    assert nbytes <= moved < nbytes + 64 * len(tensors)  # each storage once, 64-byte aligned
    assert all(in_arena(t) for t in tensors)
    assert len({t.untyped_storage().data_ptr() for t in tensors}) == 1  # one arena
    assert min(t.data_ptr() for t in tensors) % HUGE_PAGE == 0  # it starts on a 2 MB page
    # the flat base the buffer is a view of moved with it: the old bytes have no holder left
    assert m.codes.data_ptr() == base.data_ptr() and m.kernel.codes is m.codes
    for name, t in m.state_dict().items():
        assert torch.equal(t, before[name]), name
    assert torch.equal(m.kernel.scale, scale)
    assert m.cache.data_ptr() == cache_ptr and not in_arena(m.cache)
    with torch.no_grad():  # in-place updates reach every holder
        m.codes[0, 0] = 77
    assert m.kernel.codes[0, 0] == 77 and base[0] == 77
    assert gather_weights(m, leave=[m.cache]) == 0  # all there already
    m.extra = nn.Linear(4, 4)  # a weight added later gets an arena of its own
    assert gather_weights(m, leave=[m.cache]) > 0 and in_arena(m.extra.weight)


def _mapping_flags(address: int) -> list[str]:
    """The VmFlags of the mapping of this process holding address."""
    lines = Path("/proc/self/smaps").read_text().splitlines()
    inside = False
    for line in lines:
        head = line.split()[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and line.startswith("VmFlags:"):
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.skipif(
    not sys.platform.startswith("linux")
    or not Path("/sys/kernel/mm/transparent_hugepage/enabled").exists(),
    reason="needs Linux with transparent huge pages",
)
def test_the_arena_is_advised_for_huge_pages():
    m = nn.Linear(256, 256)
    gather_weights(m)
    assert "hg" in _mapping_flags(m.weight.data_ptr())  # MADV_HUGEPAGE on its mapping


def test_an_engine_moves_its_weights_not_its_cache_and_decodes_the_same_tokens(
    tiny_llama, monkeypatch
):
    prompts = [[5, 9, 13, 2, 7], [3, 1, 4, 1, 5, 9, 2, 6]]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    tokens, held = {}, {}
    for switch in ("0", "1"):
        monkeypatch.setenv("PAGEDLLM_CPU_HUGE_PAGES", switch)
        llm = LLM(str(tiny_llama), dtype="float32", skip_tokenizer_init=True)
        runner = llm.llm_engine.executor.runner
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        tokens[switch] = [o.outputs[0].token_ids for o in outs]
        weights = [*runner.model.named_parameters(), *runner.model.named_buffers()]
        # (a weight in panel form leaves an empty one; rotary tables are shared by live models
        # of one shape, layers/rotary._TABLES, so another test's engine may have moved them)
        held[switch] = [in_arena(w) for n, w in weights if w.numel() and "rotary" not in n]
        assert not any(in_arena(k) or in_arena(v) for k, v in runner.kv_caches)
    assert held["1"] and not any(held["0"]) and all(held["1"])
    assert tokens["1"] == tokens["0"]
