"""int8 quantization of layers: error bounds from the scales, kernels, exclusion, sharding."""

from __future__ import annotations

import pytest
import torch

from pagedllm.config import EngineArgs, QuantConfig
from pagedllm.distributed.communicator import Communicator
from pagedllm.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from pagedllm.layers.linear import (
    ColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from pagedllm.layers.quantization import (
    KERNELS,
    DynamicQuantConfig,
    MovingAverageObserver,
    batch_dependent,
    dequantize_weight,
    quantize_weight,
    weight_bytes,
)


def _linear(k: int, n: int, seed: int = 0, bias: bool = False) -> ReplicatedLinear:
    torch.manual_seed(seed)
    layer = ReplicatedLinear(k, n, bias=bias)
    layer.weight.data.normal_(0.0, 0.2)
    layer.weight.data[3] *= 10  # rows of very different ranges: per-channel scales matter
    if bias:
        layer.bias.data.normal_()
    return layer


@pytest.mark.parametrize("granularity", ["per_channel", "per_tensor"])
def test_quantize_dequantize_error_is_half_a_step(granularity):
    torch.manual_seed(0)
    w = torch.randn(48, 96) * torch.logspace(-3, 1, 48)[:, None]
    w[5] = 0.0
    q, scale = quantize_weight(w, granularity)
    assert q.dtype == torch.int8 and scale.shape == (48,)
    assert q.abs().max() <= 127
    err = (dequantize_weight(q, scale) - w).abs()
    assert torch.all(err <= scale[:, None] / 2 * (1 + 1e-5))
    assert torch.all(q[5] == 0)
    if granularity == "per_channel":  # every non-zero row uses its full range
        rows = torch.arange(48) != 5
        assert torch.all(q[rows].abs().amax(dim=1) == 127)
        assert torch.allclose(scale[rows], w[rows].abs().amax(dim=1) / 127)
    else:
        assert torch.all(scale == scale[0]) and q.abs().max() == 127


def _bound(
    x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, levels: int | None
) -> torch.Tensor:
    """|x W^T - xq Wq^T| <= sum |x| dw + dx sum |w| + K dx dw, with dw = scale / 2 per output
    and dx = absmax(token) / levels / 2 per token (0 when activations stay in float)."""
    dw = scale[None, :] / 2
    if levels is None:
        return x.abs().sum(1, keepdim=True) * dw
    dx = x.abs().amax(1, keepdim=True) / levels / 2
    return x.abs().sum(1, keepdim=True) * dw + dx * w.abs().sum(1)[None, :] + x.shape[1] * dx * dw


@pytest.mark.parametrize("kernel", sorted(KERNELS))
@pytest.mark.parametrize("k", [64, 768])
def test_int8_linear_within_scale_derived_tolerance(kernel, k):
    layer = _linear(k, 40, bias=True)
    w = layer.weight.detach().clone()
    x = torch.randn(21, k) * torch.logspace(-2, 1, 21)[:, None]  # tokens of different ranges
    want = layer(x)
    config = DynamicQuantConfig(kernel=kernel, enable_activation=kernel != "weight_only")
    assert config.apply(layer) == [""]
    assert layer.quant_kernel.name == kernel
    got = layer(x)
    levels = None if kernel == "weight_only" else layer.quant_kernel.levels
    bound = _bound(x, w, layer.weight_scale, levels)
    err = (got - want).abs()
    assert torch.all(err <= bound * 1.0001 + 1e-4), (err / bound).max()
    assert err.max() > 0  # really quantized
    # the int8 weight kept by the kernel dequantizes to the original within half a step
    deq = dequantize_weight(layer.quant_kernel.weight_int8(), layer.weight_scale)
    assert torch.all((deq - w).abs() <= layer.weight_scale[:, None] / 2 * 1.0001)


@pytest.mark.parametrize("kernel", ["cpu_int8", "onednn", "int_mm"])
def test_per_token_activations_are_batch_invariant(kernel):
    """A token's output does not depend on the tokens beside it (prefix caching relies on it)."""
    layer = _linear(64, 32)
    DynamicQuantConfig(kernel=kernel).apply(layer)
    x = torch.randn(24, 64) * torch.logspace(-2, 2, 24)[:, None]
    batch = layer(x)
    for i in (0, 11, 23):
        assert torch.equal(layer(x[i : i + 1])[0], batch[i])


def test_moving_average_observer_follows_the_batches():
    obs = MovingAverageObserver(torch.device("cpu"), averaging_constant=0.5)
    assert torch.equal(obs(torch.tensor([[1.0, -4.0]])), torch.tensor([[4.0]]))
    assert torch.equal(obs(torch.tensor([[2.0], [0.0]])), torch.tensor([[3.0], [3.0]]))
    layer = _linear(16, 8)
    DynamicQuantConfig(observer_type="moving_average", kernel="int_mm").apply(layer)
    x = torch.randn(4, 16)
    first = layer(x)
    layer(x * 100)  # raises the range: the same input now quantizes more coarsely
    assert not torch.equal(layer(x), first)
    assert batch_dependent(layer)  # so decode steps of this model run without CUDA graphs


@pytest.mark.parametrize("quant_dtype", ["int8", "int4"])
def test_lm_head_weight_only_and_embedding_take_int8_rows_by_default(quant_dtype):
    """With int8 and with int4 alike (whose linear layers take 4 bits), the LM head gets int8
    weights with full-precision inputs and the embedding int8 rows."""
    torch.manual_seed(0)
    head, emb = ParallelLMHead(64, 32, torch.float32), VocabParallelEmbedding(64, 32, torch.float32)
    for m in (head, emb):
        m.weight.data.normal_()
    ids, hidden = torch.tensor([0, 7, 63, 7]), torch.randn(4, 32)
    w, want_logits, want_rows = head.weight.clone(), head(hidden), emb(ids)
    # quantize_embeddings=False keeps them in full precision (as vLLM does).
    kept = DynamicQuantConfig(quant_dtype=quant_dtype, quantize_embeddings=False)
    assert kept.apply(head) == [] and kept.apply(emb) == []
    config = DynamicQuantConfig(quant_dtype=quant_dtype)
    assert config.apply(head) == [""] and config.apply(emb) == [""]
    assert emb.weight.dtype == torch.int8
    rows_err = (emb(ids) - want_rows).abs()
    assert torch.all(rows_err <= emb.weight_scale[ids, None] / 2 * 1.0001)
    # The head's inputs stay in fp32 (the logits pick the token): only the weight's rounding.
    assert head.quant_method == "int8 weight-only" and head.quant_kernel.observer is None
    bound = _bound(hidden, w, head.weight_scale, None)
    assert torch.all((head(hidden) - want_logits).abs() <= bound * 1.0001 + 1e-4)


def test_tied_embedding_reads_the_int8_lm_heads_codes(model_factory):
    from pagedllm.models.loader import load_model

    config = EngineArgs(model=str(model_factory("qwen2")), dtype="float32").create_engine_config()
    model = load_model(config.model, torch.device("cpu"))
    head, emb = model.lm_head, model.model.embed_tokens
    assert head.weight is emb.weight  # tied (in float panels: the rows come from a lookup)
    ids = torch.tensor([0, 5, 17, 5])
    want, full = emb(ids), weight_bytes(model)
    DynamicQuantConfig().apply(model)
    int8_rows = head.quant_kernel.weight_int8()
    rows = int8_rows[ids].float() * head.weight_scale[ids, None]
    assert torch.equal(emb(ids), rows)  # the rows of the head's int8 weight
    assert torch.all((rows - want).abs() <= head.weight_scale[ids, None] / 2 * 1.0001)
    packed = head.quant_kernel.packed
    if packed is not None and packed.panels:  # one copy of the codes: the head's panels
        assert emb.packed is packed and emb.weight.numel() == 0
    vocab, hidden = int8_rows.shape
    assert full - weight_bytes(model) >= vocab * hidden * 3  # fp32 -> int8, stored once


def test_exclude_layers_leaves_modules_untouched(model_factory):
    from pagedllm.models.loader import load_model

    config = EngineArgs(model=str(model_factory("llama")), dtype="float32").create_engine_config()
    model = load_model(config.model, torch.device("cpu"))
    modules = dict(model.named_modules())
    kept = ["lm_head", "model.layers.0.self_attn.qkv_proj", "model.layers.1.self_attn.qkv_proj"]
    before = {name: modules[name].weight for name in kept}
    x = torch.randn(3, 64)
    ref = modules["model.layers.0.self_attn.qkv_proj"](x)
    full = weight_bytes(model)
    quantizer = DynamicQuantConfig(quantize_embeddings=True)
    done = quantizer.apply(model, exclude_layers=["lm_head", "*.self_attn.qkv_proj"])
    assert set(done) == {
        "model.embed_tokens",
        *(
            f"model.layers.{i}.{p}"
            for i in (0, 1)
            for p in ("self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
        ),
    }
    for name in kept:
        module = modules[name]
        assert module.weight is before[name] and module.weight.dtype == torch.float32
        assert not hasattr(module, "quant_kernel") and "matmul" not in vars(module)
        assert "forward" not in vars(module)
    assert torch.equal(modules["model.layers.0.self_attn.qkv_proj"](x), ref)
    assert all(hasattr(modules[name], "quant_kernel") for name in done)
    assert weight_bytes(model) < full
    assert quantizer.apply(model, exclude_layers=["lm_head", "*.qkv_proj"]) == []


def test_tied_weight_excluded_on_one_side_stays_full_precision(model_factory):
    from pagedllm.models.loader import load_model

    config = EngineArgs(model=str(model_factory("qwen2")), dtype="float32").create_engine_config()
    model = load_model(config.model, torch.device("cpu"))
    done = DynamicQuantConfig(quantize_embeddings=True).apply(model, exclude_layers=["lm_head"])
    assert "model.embed_tokens" not in done and "lm_head" not in done
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.lm_head.weight.dtype == torch.float32


@pytest.mark.parametrize("cls", [ColumnParallelLinear, RowParallelLinear])
def test_scales_shard_with_the_weight(cls):
    """Each rank quantizes its own shard after loading: column-parallel rows keep exactly the
    full layer's scales; row-parallel shards are scaled over their own input features."""
    torch.manual_seed(0)
    full = torch.randn(16, 32)
    q_full, s_full = quantize_weight(full)
    for rank in (0, 1):
        layer = cls(32, 16, comm=Communicator(rank=rank, world_size=2))
        layer.weight.weight_loader(layer.weight, full)
        DynamicQuantConfig(kernel="int_mm").apply(layer)
        if cls is ColumnParallelLinear:
            assert torch.equal(layer.weight_scale, s_full[rank * 8 : rank * 8 + 8])
            assert torch.equal(layer.weight, q_full[rank * 8 : rank * 8 + 8])
        else:
            shard = full[:, rank * 16 : rank * 16 + 16]
            assert torch.equal(layer.weight_scale, quantize_weight(shard)[1])


def test_prequantized_scales_load_through_the_layer_weight_loader():
    """A saved checkpoint's q/k/v scales land in the fused layer's rows, per rank."""
    torch.manual_seed(0)
    parts = {"q": torch.randn(32, 16), "k": torch.randn(16, 16), "v": torch.randn(16, 16)}
    for rank in (0, 1):
        layer = QKVParallelLinear(16, 8, 4, 2, comm=Communicator(rank=rank, world_size=2))
        config = DynamicQuantConfig(prequantized=True)
        config.prepare_checkpoint(layer)
        for sid, w in parts.items():
            q, s = quantize_weight(w)
            layer.weight.weight_loader(layer.weight, q, sid)
            layer.weight_scale.weight_loader(layer.weight_scale, s, sid)
        config.finish_loading(layer)
        scales = layer.weight_scale
        want = torch.cat([quantize_weight(w)[1].view(2, -1)[rank] for w in parts.values()])
        assert torch.equal(scales, want)


def test_config_validation():
    with pytest.raises(ValueError, match="granularity"):
        DynamicQuantConfig(granularity="per_block")
    with pytest.raises(ValueError, match="observer_type"):
        QuantConfig(observer_type="histogram")
    with pytest.raises(ValueError, match="kernel"):
        DynamicQuantConfig(kernel="cutlass")
    with pytest.raises(ValueError, match="quant_dtype"):
        DynamicQuantConfig(quant_dtype="int2")
    with pytest.raises(ValueError, match="group_size"):
        DynamicQuantConfig(quant_dtype="int4", group_size=48)
    with pytest.raises(ValueError, match="smoothquant_alpha"):
        DynamicQuantConfig(smoothquant_alpha=1.5)
    with pytest.raises(ValueError, match="quantization"):
        EngineArgs(model="/nonexistent", quantization="int3")._verify()
    with pytest.raises(ValueError, match="granularity"):
        EngineArgs(model="/nonexistent", quantization="int8", quant_granularity="row")._verify()


def _llama(model_factory):
    """The tiny model loaded, its weights plain: these tests edit and smooth them."""
    from pagedllm.layers.panel_gemm import unpack_layers
    from pagedllm.models.loader import load_model

    config = EngineArgs(model=str(model_factory("llama")), dtype="float32").create_engine_config()
    model = load_model(config.model, torch.device("cpu"))
    unpack_layers(model.modules())
    return model


def _logits(model, ids: list[int]) -> torch.Tensor:
    from pagedllm.layers.calibration import _calibration_attention

    with torch.no_grad(), _calibration_attention(model):
        hidden = model(torch.tensor(ids), torch.arange(len(ids)))
        return model.compute_logits(hidden)


def test_smoothing_keeps_the_float_model_and_flattens_input_ranges(model_factory):
    from pagedllm.layers.calibration import collect_ranges, smooth

    model = _llama(model_factory)
    torch.manual_seed(0)
    windows = [torch.randint(0, 320, (48,)).tolist() for _ in range(3)]
    suffixes = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
    linears = {n: m for n, m in model.named_modules() if n.endswith(suffixes)}
    for m in linears.values():  # input features of very different ranges: outliers to migrate
        m.weight.data[:, :4] *= 0.02
    model.model.layers[0].input_layernorm.weight.data[:4] = 40.0
    before = _logits(model, windows[0])
    ranges = collect_ranges(model, linears, windows)
    assert all(len(r) == 3 and r[0].shape == (m.weight.shape[1],) for r, m in
               zip(ranges.values(), linears.values()))  # fmt: skip
    spread = {
        n: (lambda a: a.max() / a.median())(torch.stack(r).amax(0)) for n, r in ranges.items()
    }
    done = smooth(model, ranges, 0.5, set(linears))
    assert sorted(done) == sorted(linears)  # every projection had an op to fold into
    assert torch.allclose(_logits(model, windows[0]), before, atol=1e-4, rtol=1e-4)
    after = collect_ranges(model, linears, windows)
    name = "model.layers.0.self_attn.qkv_proj"
    flat = torch.stack(after[name]).amax(0)
    assert flat.max() / flat.median() < spread[name] / 5  # the outlier features shrank
    assert torch.allclose(torch.stack(after[name]), torch.stack(ranges[name]), rtol=1e-4)


def test_default_int8_keeps_lm_head_and_down_proj_inputs_in_full_precision(model_factory):
    model = _llama(model_factory)
    torch.manual_seed(1)
    windows = [torch.randint(0, 320, (32,)).tolist() for _ in range(2)]
    ids = windows[0]
    before = _logits(model, ids)
    done = DynamicQuantConfig().apply(model, calibration=windows)
    modules = dict(model.named_modules())
    assert "lm_head" in done and "model.embed_tokens" in done
    for name in done:
        if name == "model.embed_tokens":
            continue
        kernel = modules[name].quant_kernel
        want = "weight_only" if name.endswith(("down_proj", "lm_head")) else "cpu_int8"
        assert kernel.name == want, name
    assert len(done) == 10
    from pagedllm.layers.quantization import describe

    assert describe(model) == "6 int8 W8A8 (cpu_int8), 1 int8 embedding, 3 int8 weight-only"
    after = _logits(model, ids)
    assert (after.argmax(-1) == before.argmax(-1)).float().mean() > 0.9


def test_calibrated_moving_average_observer_is_static(model_factory):
    model = _llama(model_factory)
    torch.manual_seed(2)
    windows = [torch.randint(0, 320, (32,)).tolist() for _ in range(2)]
    DynamicQuantConfig(observer_type="moving_average").apply(model, calibration=windows)
    layer = model.model.layers[0].self_attn.qkv_proj
    observer = layer.quant_kernel.observer
    assert isinstance(observer, MovingAverageObserver) and observer.calibrated
    scale = observer.absmax.clone()
    assert scale > 0
    x = torch.randn(4, 64)
    first = layer(x)
    layer(x * 100)  # a calibrated range does not follow the batches served
    assert torch.equal(layer(x), first) and torch.equal(observer.absmax, scale)
    assert not batch_dependent(model)
