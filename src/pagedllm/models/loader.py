"""Build a model and stream its weights in from its source (a Hugging Face folder's
safetensors or a GGUF file's tensors: pagedllm.models.sources)."""

from __future__ import annotations

import logging
from collections.abc import Collection, Iterable

import torch
from torch import nn

from pagedllm.config import ModelConfig
from pagedllm.distributed.communicator import SINGLE, Communicator
from pagedllm.distributed.parallel_state import model_parallel
from pagedllm.dtypes import torch_dtype
from pagedllm.layers.custom_op import OpTarget, build_target
from pagedllm.models.registry import get_model_class
from pagedllm.models.sources import open_source

logger = logging.getLogger(__name__)

_TIED_HEAD = ("lm_head.weight", "lm_head.weight_scale")  # the embedding's, when tied


class MissingLayer(nn.Module):
    """Stands in for a module another partition tier runs: holds nothing, keeps indices."""

    def forward(self, *args: object) -> torch.Tensor:
        raise RuntimeError("this module belongs to another partition tier")


class PassThroughLayer(MissingLayer):
    """A decoder layer of another tier: (hidden, residual) go through unchanged."""

    def forward(  # type: ignore[override]
        self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        return hidden, residual


class ResidualStreamOut(MissingLayer):
    """The final norm of a tier that does not end the model: it hands the residual stream on.
    The next tier starts with residual None, which its first input_layernorm treats exactly
    as this hidden + residual."""

    def forward(  # type: ignore[override]
        self, hidden: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, None]:
        return (hidden if residual is None else hidden + residual), None


def keep_layers(model: nn.Module, layer_range: tuple[int, int]) -> None:
    """Cut a model of pagedllm's layout (model.embed_tokens / layers / norm, lm_head) down to
    decoder layers [start, end): the embedding stays only on the tier that starts at 0, the
    norm and LM head only on the tier that ends at the last layer. Absent layers keep their
    index, so parameter names still match the checkpoint's."""
    inner, (start, end) = model.model, layer_range
    first, last = start == 0, end == len(inner.layers)
    for i in range(len(inner.layers)):
        if not start <= i < end:
            inner.layers[i] = PassThroughLayer()
    if not last:
        inner.norm = ResidualStreamOut()
        model.lm_head = MissingLayer()
    if not first:
        inner.embed_tokens = MissingLayer()
        if getattr(model, "tie_word_embeddings", False) and last:
            # A last tier without the embedding loads the tied matrix as its own head.
            model.tie_word_embeddings = False
            model.weight_aliases = {"model.embed_tokens.weight": "lm_head.weight"}


def materialize(model: nn.Module, device: torch.device) -> None:
    """Give a model built on the meta device uninitialised storage on ``device``. Each
    parameter keeps its identity (ties between modules) and its weight_loader; buffers are
    recomputed by their modules' reset_buffers()."""
    for param in model.parameters():  # a shared parameter once
        # torch.empty, not empty_like: empty_like of a meta tensor runs torch's Python
        # reference op, whose first use imports torch._dynamo and sympy (seconds)
        storage = torch.empty(param.shape, dtype=param.dtype, device=device)
        real = nn.Parameter(storage, requires_grad=False)
        loader = getattr(param, "weight_loader", None)
        if loader is not None:  # swap_tensors swaps the Python attributes too
            real.weight_loader = loader
        torch.utils.swap_tensors(param, real)
    with torch.device(device):
        for module in model.modules():
            if hasattr(module, "reset_buffers"):
                module.reset_buffers()


def build_model(
    config: ModelConfig,
    device: torch.device,
    comm: Communicator = SINGLE,
    cpu_fused_ops: bool = True,
    cuda_fused_ops: bool = False,
) -> nn.Module:
    """The model, uninitialised, sharded over comm; only layer_range's layers when it is set
    (built on the meta device first, so that another tier's layers never take memory). Its
    ops pick their implementation for ``device`` as they are built (layers/custom_op.py)."""
    cls = get_model_class(config.architecture)
    target = OpTarget(device.type, cpu_fused_ops, cuda_fused_ops)
    with torch.device("meta"), model_parallel(comm), build_target(target):
        model = cls(config.hf_config, torch_dtype(config.dtype))
    if config.layer_range is not None:
        keep_layers(model, config.layer_range)
    materialize(model, device)
    return model


def resolve_name(model: nn.Module, name: str) -> tuple[str, int | str | None]:
    """A checkpoint tensor's parameter name in the model, and its shard in a fused parameter."""
    name = getattr(model, "weight_aliases", {}).get(name, name)
    packed: dict[str, tuple[str, int | str]] = getattr(model, "packed_modules", {})
    for ckpt_part, (param_part, sid) in packed.items():
        if f".{ckpt_part}." in name:
            return name.replace(f".{ckpt_part}.", f".{param_part}."), sid
    return name, None


def load_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    installed: Collection[str] = (),
) -> None:
    """Copy checkpoint tensors into the model, each through its parameter's weight_loader.
    installed: parameters already in place (a GGUF file's blocks kept as they are)."""
    params = dict(model.named_parameters(remove_duplicate=False))
    tied = getattr(model, "tie_word_embeddings", False)
    absent = tuple(n + "." for n, m in model.named_modules() if isinstance(m, MissingLayer))
    loaded: set[str] = set()
    for name, tensor in weights:
        name, shard_id = resolve_name(model, name)
        if "rotary_emb.inv_freq" in name or (tied and name in _TIED_HEAD):
            continue
        if name.startswith(absent):
            continue  # a layer of another partition tier
        if name not in params:
            raise ValueError(f"checkpoint tensor {name!r} matches no parameter of the model.")
        param = params[name]
        loader = getattr(param, "weight_loader", None)
        if loader is None:
            param.data.copy_(tensor)
        elif shard_id is None:
            loader(param, tensor)
        else:
            loader(param, tensor, shard_id)
        loaded.add(name)
    loaded.update(installed)
    missing = [n for n in params if n not in loaded and not (tied and n in _TIED_HEAD)]
    if missing:
        raise ValueError(
            f"checkpoint is missing weights: {', '.join(missing[:5])}"
            f"{' ...' if len(missing) > 5 else ''}"
        )


def load_model(
    config: ModelConfig,
    device: torch.device,
    comm: Communicator = SINGLE,
    cpu_fused_ops: bool = True,
    cuda_fused_ops: bool = False,
) -> nn.Module:
    model = build_model(config, device, comm, cpu_fused_ops, cuda_fused_ops)
    model.calibration_folder = config.tokenizer  # the text of a later quantization pass
    quant = None
    if config.quant_config is not None:
        from pagedllm.layers.quantization import DynamicQuantConfig

        quant = DynamicQuantConfig.from_config(config.quant_config)
        quant.prepare_checkpoint(model)  # int8 parameters, when the checkpoint holds int8
    source, dtype = open_source(config.model), torch_dtype(config.dtype)
    method = None  # what the startup log names the quantization
    if config.gguf_blocks and config.layer_range is None and comm.world_size == 1:
        from pagedllm.models.gguf_blocks import install_gguf_blocks

        tensors = source.iterate_tensors()  # type: ignore[attr-defined]
        rest, installed = install_gguf_blocks(model, tensors, dtype, resolve_name)
        load_weights(model, rest, installed)
        method = "gguf blocks"
    else:
        load_weights(model, source.iterate_weights(dtype))
    if quant is not None:
        quant.finish_loading(model)  # calibrated on model.calibration_folder's tokenizer
        method = quant.quant_dtype
    if method is not None:
        from pagedllm.layers.quantization import describe

        logger.info("quantization (%s): %s", method, describe(model))
    if device.type == "cpu":
        from pagedllm.layers.panel_gemm import pack_model

        pack_model(model)  # float linear weights into panels where the CPU runs the kernel
    return model.eval()
