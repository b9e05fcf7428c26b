"""A CPU model's weights on huge pages.

A decode step reads all of a model's weights. On 4 KB pages that is a new page every 4 KB of
each stream: a TLB miss, and a hardware prefetcher that stops at the page's end and starts
again on the next. Linux backs anonymous memory with 2 MB pages where it is asked to
(``madvise(MADV_HUGEPAGE)``; many distributions' default policy waits for that ask), but the
allocator that torch's tensors come from never asks, and a model's weights are hundreds of
small tensors (SmolLM2's largest layer weight is 1.1 MB). So the runner moves them, once they
are final, into one private anonymous mapping that asks, starting on a 2 MB boundary.

SmolLM2-135M at batch 1 on a 2-core Xeon guest (4 KB pages unless asked), five rounds taking
turns, weights left / moved (benchmarks/batch1.py; BENCHMARKS.md, round twelve): Q4_1
1.01-1.28x (median 1.06x), bf16 1.00-1.14x (1.06x), fp32 1.02-1.12x (1.09x), the same tokens.
The KV cache keeps its own mapping (model_runner._zeroed): on huge pages too, half of the runs
were slower (167-176 tok/s against 222-230), as each new 2 MB of cache is faulted in, zeroed
and compacted in the middle of a step.

The move costs start-up time: the first touch of fresh 2 MB pages. On that Xeon guest it was
2.6-5.3 s for 512 MiB (0.12 s on 4 KB pages, 0.07-0.11 s for 2 MB pages freed moments before
in the same process), so the host seems to back each new 2 MB block on first use: SmolLM2's
fp32 folder loads in 3.4-4.7 s rather than 0.5, and `pagedllm generate` on its Q4_1 file
starts 0.8 s later (benchmarks/startup.py). The runner logs the time the move took.
"""

from __future__ import annotations

import ctypes
import mmap
from collections.abc import Iterable

import torch
from torch import nn

HUGE_PAGE = 2 << 20
_ALIGN = 64  # each storage's start in an arena: a cache line
_ARENA_FLAG = "_pagedllm_arena"  # set on an arena's storage (torch keeps its Python object)
_TRIM_EVERY = 256 << 20  # bytes copied between returns of freed heap: the move's peak stays low


def private_memory(nbytes: int) -> mmap.mmap:
    """nbytes of anonymous memory private to this process, zero until written (``mmap``'s
    default mapping is shared: shared memory in the kernel, dearer to fault in)."""
    if not hasattr(mmap, "MAP_PRIVATE"):  # Windows: anonymous memory, private to the process
        return mmap.mmap(-1, nbytes)
    return mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)


def _arena_memory(nbytes: int) -> mmap.mmap:
    """A private anonymous mapping of nbytes, advised for huge pages where the OS has them."""
    buf = private_memory(nbytes)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            buf.madvise(mmap.MADV_HUGEPAGE)
        except OSError:  # a kernel built without transparent huge pages
            pass
    return buf


def _return_freed_memory() -> None:
    """glibc keeps freed heap memory for its next allocations; the weights' old copies (a
    float32 model's are most of the heap) go back to the OS. Elsewhere a no-op."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (AttributeError, OSError):
        pass


def _held_tensors(model: nn.Module) -> list[torch.Tensor]:
    """Every CPU tensor the model's modules hold: parameters, buffers, plain attributes, and
    the tensors of objects held as attributes (a quantized linear's kernel), each once."""
    found: dict[int, torch.Tensor] = {}

    def add(value: object) -> None:
        if (
            isinstance(value, torch.Tensor)
            and value.device.type == "cpu"
            and value.layout == torch.strided
            and not value.is_quantized
            and value.numel() > 0
        ):
            found[id(value)] = value
            if value._base is not None:  # a view keeps its base (and its storage) alive
                add(value._base)

    for module in model.modules():
        for value in [*module._parameters.values(), *module._buffers.values()]:
            add(value)
        for name, value in vars(module).items():
            if name.startswith("_") or isinstance(value, nn.Module):
                continue
            add(value)
            if hasattr(value, "__dict__") and not isinstance(value, torch.Tensor):
                for inner in vars(value).values():
                    add(inner)
    return list(found.values())


def in_arena(tensor: torch.Tensor) -> bool:
    """Whether the tensor's bytes are in an arena gather_weights made."""
    return getattr(tensor.untyped_storage(), _ARENA_FLAG, False)


def gather_weights(model: nn.Module, leave: Iterable[torch.Tensor] = ()) -> int:
    """Moves the storages of the model's tensors (all but those of `leave`, the KV cache) into
    one huge-page arena; returns the bytes moved (0 when all were there already). Every tensor
    object viewing a moved storage is re-pointed (``Tensor.set_``) to the same bytes in the
    arena, so modules, kernels and fused-decoder plans that hold those objects read the new
    copy. The arena lives as long as a tensor views it."""
    left = {t.untyped_storage().data_ptr() for t in leave}
    storages: dict[int, tuple[torch.UntypedStorage, list[torch.Tensor]]] = {}
    for tensor in _held_tensors(model):
        storage = tensor.untyped_storage()
        if storage.data_ptr() in left or in_arena(tensor):
            continue
        storages.setdefault(storage.data_ptr(), (storage, []))[1].append(tensor)
    if not storages:
        return 0
    sizes = {ptr: -(-storage.nbytes() // _ALIGN) * _ALIGN for ptr, (storage, _) in storages.items()}
    flat = torch.frombuffer(_arena_memory(sum(sizes.values()) + HUGE_PAGE), dtype=torch.uint8)
    start = -flat.data_ptr() % HUGE_PAGE  # the arena's first byte on a 2 MB boundary
    arena = flat.untyped_storage()
    setattr(arena, _ARENA_FLAG, True)
    offset, since_trim = start, 0
    with torch.no_grad():
        for ptr in list(storages):  # in the model's order; each old storage goes once copied
            storage, tensors = storages.pop(ptr)
            nbytes = storage.nbytes()
            flat[offset : offset + nbytes].copy_(torch.empty(0, dtype=torch.uint8).set_(storage))
            for tensor in tensors:
                tensor.set_(
                    arena,
                    offset // tensor.element_size() + tensor.storage_offset(),
                    tensor.size(),
                    tensor.stride(),
                )
            offset += sizes[ptr]
            del storage, tensors
            since_trim += nbytes
            if since_trim >= _TRIM_EVERY:  # small tensors' old copies sit in glibc's heap
                _return_freed_memory()
                since_trim = 0
    _return_freed_memory()
    return offset - start
