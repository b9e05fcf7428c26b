"""Linear layers that own their tensor-parallel sharding and their collective.

Each parameter carries a ``weight_loader(param, loaded[, shard_id])`` that copies this rank's
slice of a full checkpoint tensor, so the loader never materialises a full weight per rank
beyond the tensor being read.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.distributed.communicator import Communicator
from pagedllm.distributed.parallel_state import get_tp_group
from pagedllm.layers import cpu_fused, panel_gemm
from pagedllm.layers.custom_op import current_target


def _param(*shape: int, dtype: torch.dtype, loader) -> nn.Parameter:  # noqa: ANN001
    p = nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)
    p.weight_loader = loader
    return p


class LinearBase(nn.Module):
    """y = x W^T + b with W of shape [out_local, in_local]; subclasses say how they shard."""

    def __init__(
        self, in_local: int, out_local: int, bias: bool, dtype: torch.dtype, comm: Communicator
    ) -> None:
        super().__init__()
        self.comm = comm
        self.in_features, self.out_features = in_local, out_local
        self.weight = _param(out_local, in_local, dtype=dtype, loader=self.weight_loader)
        self.bias = _param(out_local, dtype=dtype, loader=self.weight_loader) if bias else None
        # chosen once: decode rows on a CPU take the C++ GEMV (a float weight of this dtype)
        self.cpu_gemv = current_target().uses_cpu_kernels(dtype)
        # after loading, a CPU float weight may move into panels (panel_gemm.pack_model)
        self.register_buffer("weight_panels", None, persistent=False)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        param.data.copy_(loaded)

    def packs_into_panels(self) -> bool:
        """A float layer (no quantized matmul) whose loaded CPU weight splits into panels."""
        plain = type(self).matmul is LinearBase.matmul and self.weight_panels is None
        return plain and panel_gemm.packable(self.weight)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x W^T + bias; a quantized layer overrides this and nothing else. A weight in panels
        runs the C++ panel GEMM; else a few rows on the CPU (decode) take the C++ GEMV, which
        streams the weight at memory speed, and more rows cpu_fused.float_linear (F.linear's
        product but for bf16 on a CPU without bf16 instructions)."""
        if self.weight_panels is not None:
            return panel_gemm.linear(x, self.weight_panels, bias)
        if self.cpu_gemv and cpu_fused.gemv_takes(x):
            return cpu_fused.gemv(x, self.weight, bias)
        if self.cpu_gemv:
            return cpu_fused.float_linear(x, self.weight, bias)
        return F.linear(x, self.weight, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)

    def fused_operands(self) -> tuple[list[torch.Tensor | None], int] | None:
        """How the runner's fused CPU decoder (worker/cpu_decoder.py) computes this layer's
        product: ([weight, rowsum, scale, bias], activation levels), or None where it cannot:
        under tensor parallelism, or where a subclass overrides matmul without saying. A float
        weight has no rowsum; a weight in panels is its 3-D panels tensor. A linear class with
        its own product overrides this too."""
        if self.comm.world_size != 1 or type(self).matmul is not LinearBase.matmul:
            return None
        weight = self.weight if self.weight_panels is None else self.weight_panels
        return [weight, None, None, self.bias], 0


class ReplicatedLinear(LinearBase):
    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        dtype: torch.dtype = torch.float32,
        comm: Communicator | None = None,
    ) -> None:
        comm = comm or get_tp_group()
        super().__init__(in_features, out_features, bias, dtype, comm)


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks; the output stays split."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        dtype: torch.dtype = torch.float32,
        comm: Communicator | None = None,
    ) -> None:
        comm = comm or get_tp_group()
        super().__init__(
            in_features, comm.shard(out_features, "output features"), bias, dtype, comm
        )

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        size = param.shape[0]
        param.data.copy_(loaded.narrow(0, self.comm.rank * size, size))


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs in one matmul (gate and up projections)."""

    def __init__(
        self,
        in_features: int,
        output_sizes: list[int],
        bias: bool = False,
        dtype: torch.dtype = torch.float32,
        comm: Communicator | None = None,
    ) -> None:
        comm = comm or get_tp_group()
        self.output_sizes = output_sizes
        super().__init__(in_features, sum(output_sizes), bias, dtype, comm)

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | None = None
    ) -> None:
        if shard_id is None:
            return super().weight_loader(param, loaded)
        world = self.comm.world_size
        offset = sum(self.output_sizes[:shard_id]) // world
        size = self.output_sizes[shard_id] // world
        param.data.narrow(0, offset, size).copy_(loaded.narrow(0, self.comm.rank * size, size))


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q, k, v projections; heads split across ranks, KV heads replicated when fewer."""

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool = False,
        dtype: torch.dtype = torch.float32,
        comm: Communicator | None = None,
    ) -> None:
        comm = comm or get_tp_group()
        world = comm.world_size
        self.head_dim = head_dim
        self.num_heads = comm.shard(num_heads, "num_attention_heads")
        if num_kv_heads >= world:
            self.num_kv_heads = comm.shard(num_kv_heads, "num_key_value_heads")
            self.kv_replicas = 1
        else:
            if world % num_kv_heads:
                raise ValueError(
                    f"tensor_parallel_size ({world}) must be a multiple of "
                    f"num_key_value_heads ({num_kv_heads}) when it is larger."
                )
            self.num_kv_heads, self.kv_replicas = 1, world // num_kv_heads
        out_total = (self.num_heads + 2 * self.num_kv_heads) * head_dim * world
        super().__init__(hidden_size, out_total, bias, dtype, comm)

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | None = None
    ) -> None:
        if shard_id is None:
            return super().weight_loader(param, loaded)
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        if shard_id == "q":
            offset, size, rank = 0, q_size, self.comm.rank
        else:
            offset = q_size if shard_id == "k" else q_size + kv_size
            size, rank = kv_size, self.comm.rank // self.kv_replicas
        param.data.narrow(0, offset, size).copy_(loaded.narrow(0, rank * size, size))


class RowParallelLinear(LinearBase):
    """Input features split across ranks; partial outputs are summed by an all-reduce."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        dtype: torch.dtype = torch.float32,
        comm: Communicator | None = None,
    ) -> None:
        comm = comm or get_tp_group()
        super().__init__(comm.shard(in_features, "input features"), out_features, bias, dtype, comm)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        if param.dim() == 1:  # the bias is added once, after the reduction
            return param.data.copy_(loaded)
        size = param.shape[1]
        param.data.copy_(loaded.narrow(1, self.comm.rank * size, size))

    def forward(self, x: torch.Tensor, reduce: bool = True) -> torch.Tensor:
        """reduce=False returns this rank's partial sums for the caller to all-reduce (overlap);
        rank 0's carry the bias so that the sum adds it once."""
        if self.comm.world_size == 1:
            return self.matmul(x, self.bias)
        if not reduce:
            return self.matmul(x, self.bias if self.comm.rank == 0 else None)
        y = self.comm.all_reduce(self.matmul(x, None))
        return y if self.bias is None else y + self.bias
