"""What a decoder layer is, declared by the layer: the fused CPU decoder executes this.

A model file builds one :class:`DecoderLayerSpec` per layer from its config; the layer's
modules follow it, and the runner's fused decoder (worker/cpu_decoder.py, one C++ call for
every layer of a step) runs the same kernels in the same order from it. A variant a new
architecture brings is a field here and a branch in csrc/fused_ops.cpp, not a second forward
in the model file.
"""

from __future__ import annotations

from dataclasses import dataclass

ACTIVATIONS = ("silu", "gelu_tanh")


@dataclass(frozen=True)
class DecoderLayerSpec:
    eps: float  # of every RMSNorm in the layer
    scale: float  # attention's query scale (1/sqrt(head_dim) unless the config says otherwise)
    window_left: int = -1  # keys a query may look back (flash-attn's window_size[0]); -1: all
    rope_theta: float = 10000.0  # this layer's rotary base (Gemma 3: per layer type)
    norm_offset: bool = False  # RMSNorm scales by (1 + weight) (Gemma) instead of weight
    qk_norm: bool = False  # per-head RMSNorm on q and k before the rotary embedding
    post_attention_norm: bool = False  # an RMSNorm on attention's output before the residual
    post_mlp_norm: bool = False  # an RMSNorm on the MLP's output before the residual
    activation: str = "silu"  # of the gated MLP: SiLU (SwiGLU) | "gelu_tanh" (GeGLU)

    def __post_init__(self) -> None:
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {ACTIVATIONS}, got {self.activation!r}.")
