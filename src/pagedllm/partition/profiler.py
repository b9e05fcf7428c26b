"""Measuring the profiles of pagedllm.partition.profiles: a device by short probes, and
per-layer timings of a model on this machine (which refine the roofline estimates).

``profile_device`` times large matmuls (compute throughput per dtype), a large copy
(memory bandwidth) and tiny ops (per-op dispatch cost). ``measure_layer_timings`` runs the
real model through the engine's scheduler and model runner and times every graph node
with forward hooks, plus the parts of a step outside the model (schedule, prepare, sample).
"""

from __future__ import annotations

import dataclasses
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from pagedllm.partition.profiles import (
    DecodePoint,
    DeviceProfile,
    LayerTimings,
    LinkProfile,
    PrefillPoint,
)

__all__ = [
    "DeviceProfile",
    "LayerTimings",
    "LinkProfile",
    "measure_layer_timings",
    "profile_device",
]


# ---- probes --------------------------------------------------------------------------------
def _timeit(fn: Any, sync: Any, budget_s: float, min_reps: int = 3) -> float:
    """Median seconds of fn over about budget_s (one warm-up call first)."""
    fn()
    sync()
    samples: list[float] = []
    start = time.perf_counter()
    while len(samples) < min_reps or time.perf_counter() - start < budget_s:
        t = time.perf_counter()
        fn()
        sync()
        samples.append(time.perf_counter() - t)
    return sorted(samples)[len(samples) // 2]


def profile_device(
    name: str,
    device: str = "cpu",
    dtypes: tuple[str, ...] = ("float32", "bfloat16"),
    threads: int | None = None,
    matmul_size: int = 1024,
    copy_mib: int = 128,
    budget_s: float = 0.5,
) -> DeviceProfile:
    """Measure this machine: matmul FLOP/s per dtype, copy bandwidth, per-op overhead."""
    import torch

    from pagedllm.dtypes import torch_dtype

    if threads is not None:
        torch.set_num_threads(threads)
    dev = torch.device(device)
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    flops: dict[str, float] = {}
    n = matmul_size
    for dtype in dtypes:
        a = torch.randn(n, n, device=dev).to(torch_dtype(dtype))
        b = torch.randn(n, n, device=dev).to(torch_dtype(dtype))
        flops[dtype] = 2.0 * n**3 / _timeit(lambda a=a, b=b: a @ b, sync, budget_s)
    src = torch.ones(copy_mib << 18, device=dev)  # float32: copy_mib MiB
    dst = torch.empty_like(src)
    bandwidth = 2.0 * src.numel() * 4 / _timeit(lambda: dst.copy_(src), sync, budget_s)
    tiny = torch.ones(8, device=dev)
    op = _timeit(lambda: [tiny.add(1.0) for _ in range(100)], sync, budget_s / 2) / 100
    if dev.type == "cuda":
        capacity = torch.cuda.get_device_properties(dev).total_memory
    else:
        capacity = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return DeviceProfile(name, flops, bandwidth, capacity, op, torch.get_num_threads())


ROUNDS = 3  # the short profile visits every setting this many times, in turn


# ---- measured per-layer timings ------------------------------------------------------------
class _NodeTimer:
    """Forward hooks that add each graph node's wall time to totals[node]."""

    def __init__(self, node_modules: list[list[Any]], sync: Any) -> None:
        self.totals = [0.0] * len(node_modules)
        self._sync = sync
        self._start = 0.0
        self._handles = []
        for i, modules in enumerate(node_modules):
            for m in modules:
                self._handles.append(m.register_forward_pre_hook(self._pre))
                self._handles.append(m.register_forward_hook(lambda *_, i=i: self._post(i)))

    def _pre(self, *_: Any) -> None:
        self._sync()
        self._start = time.perf_counter()

    def _post(self, node: int) -> None:
        self._sync()
        self.totals[node] += time.perf_counter() - self._start

    def reset(self) -> None:
        self.totals = [0.0] * len(self.totals)

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


@dataclass
class _StepTimes:
    nodes: list[float]
    prepare: float
    sample: float


def _timed_step(engine: Any, timer: _NodeTimer, sync: Any) -> _StepTimes:
    """One engine step, driven piece by piece so that each piece can be timed."""
    runner = engine.executor.local_runner
    out = engine.scheduler.schedule()
    t1 = time.perf_counter()
    inp = runner.prepare_input(out)
    sync()
    t2 = time.perf_counter()
    timer.reset()
    hidden = runner.forward(inp, layer_by_layer=True)  # the hooks time each layer
    sync()
    t3 = time.perf_counter()
    in_forward = list(timer.totals)
    runner.release(out.finished_seq_ids)
    model_out = runner.compute_output(inp, hidden)
    t4 = time.perf_counter()
    engine.scheduler.update(out, model_out.sampled)
    head_after = timer.totals[-1] - in_forward[-1]  # the LM head, inside compute_output
    return _StepTimes(
        nodes=list(timer.totals),
        prepare=(t2 - t1) + (t3 - t2 - sum(in_forward)),  # tensors + the forward's glue
        sample=t4 - t3 - head_after,
    )


def _lower_quartile(rows: list[list[float]]) -> tuple[float, ...]:
    """Per column, the lower quartile over the rows (steps).

    On a loaded machine the OS preempts the process inside many steps, and the preemptions
    lock to the step period: they land on the same node step after step, so even a node's
    median can be a time slice of another process. The lower quartile is the node's own cost.
    """
    return tuple(sorted(col)[len(col) // 4] for col in zip(*rows))


def _profiling_engine(engine_args: Any, batch: int, context: int, prompt: int, steps: int) -> Any:
    """An engine sized for the measurement: no prefix caching, a small KV cache."""
    import dataclasses

    from pagedllm.config import kv_bytes_per_token
    from pagedllm.engine.llm_engine import LLMEngine

    m = engine_args.create_engine_config().model
    tokens = batch * (context + 2 * steps + 4) + prompt
    per_token = kv_bytes_per_token(m.hf_config, elem_bytes=4)  # float32: an upper bound
    args = dataclasses.replace(
        engine_args,
        enable_prefix_caching=False,
        max_num_seqs=max(batch, 1),
        max_num_batched_tokens=max(prompt, context, batch),
        kv_cache_memory_bytes=2 * tokens * per_token + (1 << 20),
    )
    try:  # detokenizing is part of a step where the model has a tokenizer
        return LLMEngine.from_engine_args(args)
    except (OSError, ValueError):
        return LLMEngine.from_engine_args(args, skip_tokenizer_init=True)


def _random_prompt(engine: Any, length: int, gen: Any) -> list[int]:
    import torch

    return torch.randint(
        3, engine.config.model.hf_config.vocab_size, (length,), generator=gen
    ).tolist()


def _decode_steps(
    engine: Any, timer: _NodeTimer, sync: Any, batch: int, context: int, steps: int, gen: Any
) -> tuple[list[_StepTimes], list[float]]:
    """Timed decode steps, then whole engine steps' time outside the model's nodes."""
    from pagedllm.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=2 * steps + 4, ignore_eos=True)
    ids = [f"decode-{batch}-{context}-{i}-{time.perf_counter_ns()}" for i in range(batch)]
    for rid in ids:
        engine.add_request(rid, _random_prompt(engine, context, gen), params)
    scheduler = engine.scheduler
    while scheduler.waiting or any(s.num_output_tokens == 0 for s in scheduler.running):
        _timed_step(engine, timer, sync)
    _timed_step(engine, timer, sync)  # warm-up decode step
    decode = [_timed_step(engine, timer, sync) for _ in range(steps)]
    outside = []
    for _ in range(steps):
        timer.reset()
        start = time.perf_counter()
        engine.step()
        outside.append(time.perf_counter() - start - sum(timer.totals))
    engine.abort_request(ids)
    return decode, outside


WAKE_GAPS_S = (0.002, 0.02, 0.08)  # idle gaps probed: the RTTs of fast, medium, slow links


def _wake_penalties(
    engine: Any, batch: int, context: int, gen: Any, repeats: int = 6
) -> tuple[tuple[float, float], ...]:
    """(gap, extra seconds) for each of WAKE_GAPS_S: the median decode step after sleeping
    the gap, less the median of back-to-back steps (both whole engine steps)."""
    import statistics

    from pagedllm.sampling_params import SamplingParams

    steps = (len(WAKE_GAPS_S) + 1) * repeats + 8
    params = SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True)
    ids = [f"wake-{i}-{time.perf_counter_ns()}" for i in range(batch)]
    for rid in ids:
        engine.add_request(rid, _random_prompt(engine, context, gen), params)
    scheduler = engine.scheduler
    while scheduler.waiting or any(s.num_output_tokens == 0 for s in scheduler.running):
        engine.step()

    def timed(gap: float) -> float:
        if gap:
            time.sleep(gap)
        start = time.perf_counter()
        engine.step()
        return time.perf_counter() - start

    timed(0.0)  # warm-up
    hot = statistics.median(timed(0.0) for _ in range(repeats))
    out = []
    for gap in WAKE_GAPS_S:
        after = statistics.median(timed(gap) for _ in range(repeats))
        out.append((gap, max(0.0, after - hot)))
    engine.abort_request(ids)
    return tuple(out)


def _prefill_steps(
    engine: Any, timer: _NodeTimer, sync: Any, prompt: int, gen: Any, repeats: int = 4
) -> list[list[float]]:
    from pagedllm.sampling_params import SamplingParams

    nodes = []
    for i in range(repeats):
        params = SamplingParams(temperature=0.0, max_tokens=1)
        rid = f"prefill-{prompt}-{i}-{len(engine.requests)}-{time.perf_counter_ns()}"
        engine.add_request(rid, _random_prompt(engine, prompt, gen), params)
        nodes.append(_timed_step(engine, timer, sync).nodes)
        engine.abort_request(rid)
    return nodes


def default_settings(
    batch: int, context: int, prompt: int
) -> tuple[list[int], list[int], list[int]]:
    """The short profile's settings around the planned one: two batch sizes and two
    context lengths for decode (enough to fit fixed + per-token + attention costs), three
    prompt lengths for prefill."""
    batches = sorted({batch, 2 * batch + 2})
    contexts = sorted({max(4, context // 4), context})
    prompts = sorted({max(4, prompt // 4), max(4, prompt // 2), prompt})
    return batches, contexts, prompts


def measure_layer_timings(
    engine_args: Any,
    device_name: str,
    batch_size: int = 1,
    context_len: int = 128,
    prompt_len: int = 128,
    steps: int = 8,
    threads: int | None = None,
    settings: tuple[list[int], list[int], list[int]] | None = None,
) -> LayerTimings:
    """Run the model on this machine and time every graph node, decode and prefill, at the
    planned setting and the short profile's others (``settings``: batches, contexts and
    prompt lengths; default ``default_settings``).

    The model runs on a thread of its own, as in a deployment (the server's engine thread,
    the cloud worker's RPC thread): on a busy machine, intra-op threads started from the
    main thread were measured several times slower than the same work started elsewhere.
    """
    import torch

    if threads is not None:
        torch.set_num_threads(threads)
    settings = settings or default_settings(batch_size, context_len, prompt_len)
    with ThreadPoolExecutor(1) as pool:
        timings = pool.submit(
            _measure, engine_args, device_name, batch_size, context_len, prompt_len, steps,
            settings,
        ).result()  # fmt: skip
    return dataclasses.replace(timings, threads=torch.get_num_threads())


def _decode_point(decode: list[_StepTimes], outside: list[float], b: int, c: int) -> DecodePoint:
    prepare = _lower_quartile([[s.prepare] for s in decode])[0]
    sample = _lower_quartile([[s.sample] for s in decode])[0]
    engine = max(0.0, _lower_quartile([[x] for x in outside])[0] - prepare - sample)
    return DecodePoint(b, c, _lower_quartile([s.nodes for s in decode]), prepare, sample, engine)


def _measure(
    engine_args: Any,
    device_name: str,
    batch_size: int,
    context_len: int,
    prompt_len: int,
    steps: int,
    settings: tuple[list[int], list[int], list[int]],
) -> LayerTimings:
    import torch

    batches, contexts, prompts = settings
    batches = sorted({*batches, batch_size})
    contexts = sorted({*contexts, context_len})
    prompts = sorted({*prompts, prompt_len})
    engine = _profiling_engine(engine_args, max(batches), max(contexts), max(prompts), steps)
    runner = engine.executor.local_runner
    model, dev = runner.model, runner.device
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    nodes = [[model.model.embed_tokens], *[[x] for x in model.model.layers]]
    timer = _NodeTimer([*nodes, [model.model.norm, model.lm_head]], sync)
    gen = torch.Generator().manual_seed(0)
    settings_bc = [(b, c) for b in batches for c in contexts]
    decode_runs: dict[tuple[int, int], tuple[list, list]] = {s: ([], []) for s in settings_bc}
    prefill_runs: dict[int, list] = {p: [] for p in prompts}
    per_round = max(3, -(-steps // ROUNDS))
    try:
        # Round robin over the settings: a busy spell of the machine then lands on every
        # setting alike instead of on whichever was being measured, so the fit's shape (how
        # time grows with batch and context) is the model's, not the neighbours'.
        for _ in range(ROUNDS):
            for b, c in settings_bc:
                decode, outside = _decode_steps(engine, timer, sync, b, c, per_round, gen)
                decode_runs[(b, c)][0].extend(decode)
                decode_runs[(b, c)][1].extend(outside)
            for p in prompts:
                prefill_runs[p].extend(_prefill_steps(engine, timer, sync, p, gen, repeats=2))
        timer.remove()  # the wake-up cost is measured on the runtime's own path
        wake = _wake_penalties(engine, batch_size, context_len, gen)
    finally:
        timer.remove()
        engine.shutdown()
    points = [_decode_point(*decode_runs[s], *s) for s in settings_bc]
    prefills = [PrefillPoint(p, _lower_quartile(prefill_runs[p])) for p in prompts]
    ref = next(p for p in points if (p.batch, p.context) == (batch_size, context_len))
    ref_prefill = next(p for p in prefills if p.prompt == prompt_len)
    return LayerTimings(
        device=device_name,
        batch_size=batch_size,
        context_len=context_len,
        prompt_len=prompt_len,
        decode_s=ref.nodes,
        prefill_s=ref_prefill.nodes,
        prepare_s=ref.prepare,
        sample_s=ref.sample,
        engine_s=ref.engine,
        decode_points=tuple(points),
        prefill_points=tuple(prefills),
        wake_s=wake,
    )
