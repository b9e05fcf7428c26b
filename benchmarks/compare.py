"""Side by side in one run: this machine's peaks, pagedllm, HF transformers and llama.cpp.

1. Peaks: GEMM rate at the benchmark model's own linear shapes (fp32, bf16, int8; 1, 32 and
   256 rows; the fastest product torch or pagedllm has at each shape, prepacked oneDNN
   included) and memory bandwidth (read: a sum over 256 MiB; copy: read + write).
2. Batch workloads (benchmarks/throughput.py: uniform, mixed, shared-prefix; token-id prompts,
   greedy, ignore_eos): pagedllm fp32, bf16 and int8, HF transformers fp32 (best static batch,
   warmed up) and, with ``--llama-server PATH --gguf F ...``, llama.cpp's server (one slot per
   request, all requests sent at once) for every GGUF given. With ``--workload-rounds N`` the
   engines take turns N times and each keeps its fastest run (HF: of all its batch sizes).
3. One user: one request of 128 prompt + 128 output tokens, decode tok/s and time to first
   token, against ``llama-bench -p 128 -n 128`` (its tg128 and pp128) for every GGUF; the
   engines take turns for ``--batch1-rounds`` rounds and each keeps its best.

Prints output tok/s, ratios, pagedllm's matmul FLOP/s as a share of the GEMM peak and, at
batch 1, weight bytes/s as a share of the read bandwidth; writes JSON and the README chart.

    python benchmarks/compare.py --quick                   # ~15 min on 2 cores, no llama.cpp
    python benchmarks/compare.py --llama-server /work/llama-peer/bin/llama-server \\
        --gguf /work/llama-peer/gguf/llama-125m-{f32,f16,q8_0}.gguf        # full run

4. ``--real-model``: SmolLM2-135M-Instruct (its cached HF fp32 folder and GGUF files), every
   format through both engines on the same weights: pagedllm fp32 / bf16 / int8 from the
   folder and each GGUF loaded directly, llama.cpp on each GGUF (the converter's f32 / bf16 /
   q8_0 and the Q4_1 file users download). Batch 1 (pagedllm: a 128-token prompt, 128 output
   tokens; llama.cpp: ``llama-bench -p 0 -n 128 -d 128``) against the bound of read bandwidth
   / weight bytes per token (read at the run's start and end, and just before and after every
   one-user run); one user's 512-token prompt from an empty cache (pagedllm: its length / its
   time to the first token; llama.cpp: ``llama-bench -p 512 -n 0``, its pp512); and 48
   requests of real text at once through both HTTP servers
   (the same client); both taking turns for ``--batch1-rounds`` / ``--serve-rounds`` rounds,
   each engine keeping its best. Writes a markdown table, JSON and the README chart:

    python benchmarks/compare.py --real-model --llama-server /work/llama/bin/llama-server \\
        --gguf /work/llama/gguf/hf-fp32-{f32,bf16,q8_0}.gguf

Build the llama.cpp peer and the GGUF files with tools/build_llama_cpp.sh.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import random
import re
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from pagedllm.config import cpu_has_native_bf16

sys.path.insert(0, str(Path(__file__).parent))
from common import (  # noqa: E402
    BENCH_125M,
    build_bench_model,
    cpu_flags,
    cpu_model,
    default_model_dir,
    load_average,
    machine,
)
from serving import start_server, wait_healthy  # noqa: E402
from throughput import WORKLOADS, Request, make_workload, run_hf, run_pagedllm  # noqa: E402

PRECISIONS = {
    "fp32": {"dtype": "float32"},
    "bf16": {"dtype": "bfloat16"},  # what dtype "auto" picks on a CPU with AVX-512 BF16
    "int8": {"dtype": "float32", "quantization": "int8"},
}
# --real-model adds int8 with bf16 activations and LM head, and int8 with a bf16 KV cache (the
# size of llama.cpp's default f16 cache); int8 with an fp16 cache, llama.cpp's own cache type,
# runs where --precisions names it. Both paths take every name.
HF_LABELS = {"float32": "fp32", "bfloat16": "bf16"}
REAL_PRECISIONS = {
    **PRECISIONS,
    "int8-bf16": {"dtype": "bfloat16", "quantization": "int8"},
    "int8-kv-bf16": {"dtype": "float32", "quantization": "int8", "kv_cache_dtype": "bfloat16"},
}
ALL_PRECISIONS = {
    **REAL_PRECISIONS,
    "int8-kv-fp16": {"dtype": "float32", "quantization": "int8", "kv_cache_dtype": "float16"},
}


def products_of(prec: str) -> str:
    """The PRECISIONS entry whose GEMM peak and weight bytes a precision's products have (a
    KV cache's dtype or bf16 activations leave the int8 products int8)."""
    return prec.split("-")[0]


# ---- the model's shapes and costs ------------------------------------------------------------
def linear_shapes(c: dict = BENCH_125M) -> dict[str, tuple[int, int, int]]:
    """name -> (out features, in features, layers using it) of the benchmark model."""
    h, heads, kv = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"]
    hd, inter, layers = h // heads, c["intermediate_size"], c["num_hidden_layers"]
    return {
        "qkv": ((heads + 2 * kv) * hd, h, layers),
        "o": (h, heads * hd, layers),
        "gate_up": (2 * inter, h, layers),
        "down": (h, inter, layers),
        "lm_head": (c["vocab_size"], h, 1),
    }


def flops_per_token(include_head: bool) -> int:
    """Matmul FLOPs of one token through the decoder's linear layers (and the LM head)."""
    return sum(
        2 * n * k * times
        for name, (n, k, times) in linear_shapes().items()
        if include_head or name != "lm_head"
    )


def weight_bytes_per_token(bytes_per_weight: float) -> float:
    """Weights one decode step streams: every linear layer and the LM head (plus one
    embedding row, negligible)."""
    return bytes_per_weight * sum(n * k * t for n, k, t in linear_shapes().values())


# ---- peaks -----------------------------------------------------------------------------------
def _per_call(seconds: float, fn, *args: object) -> float:  # noqa: ANN001
    """Seconds per fn(*args) call, warmed up, repeated for at least `seconds`."""
    fn(*args)
    n, start = 0, time.perf_counter()
    while n < 3 or time.perf_counter() - start < seconds:
        fn(*args)
        n += 1
    return (time.perf_counter() - start) / n


def _float_gemm(seconds: float, x: torch.Tensor, w: torch.Tensor) -> float:
    """Seconds per call of the fastest float product torch offers at this shape: F.linear
    (MKL or oneDNN) or oneDNN with the weight prepacked for it (what inductor's freezing
    uses, where oneDNN prepacks this dtype on this CPU: not bf16 without AVX-512), whichever
    wins; at one row also pagedllm's C++ GEMV."""
    from pagedllm.layers import cpu_fused

    best = _per_call(seconds, F.linear, x, w)
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(w, x.shape[0])
    except RuntimeError:
        packed = None
    if packed is not None:
        pointwise = torch.ops.mkldnn._linear_pointwise
        best = min(best, _per_call(seconds, pointwise, x, packed, None, "none", [], ""))
    if x.shape[0] == 1 and cpu_fused.load():
        best = min(best, _per_call(seconds, cpu_fused.gemv, x, w, None))
    return best


def gemm_peaks(rows: list[int], seconds: float) -> dict[str, dict[int, float]]:
    """GFLOP/s of the model's linear shapes (weighted by how often a token meets each) per
    dtype and row count. int8: the fastest int8 product available (oneDNN's u8 x s8 GEMM or,
    at few rows, pagedllm's C++ kernel), activations already quantized."""
    from pagedllm.layers import cpu_int8
    from pagedllm.layers.quantization import quantize_weight

    have_cpp = cpu_int8.load()
    peaks: dict[str, dict[int, float]] = {"fp32": {}, "bf16": {}, "int8": {}}
    for m in rows:
        spent = {k: 0.0 for k in peaks}
        flops = 0
        for n, k, times in linear_shapes().values():
            w = torch.randn(n, k) * 0.02
            x = torch.randn(m, k)
            flops += 2 * m * n * k * times
            spent["fp32"] += times * _float_gemm(seconds, x, w)
            spent["bf16"] += times * _float_gemm(seconds, x.bfloat16(), w.bfloat16())
            q, scale = quantize_weight(w)
            packed = torch.ops.onednn.qlinear_prepack(q, None)
            zp = torch.zeros(n, dtype=torch.long)
            xu = torch.randint(1, 128, (m, k), dtype=torch.uint8)
            best = _per_call(
                seconds, torch.ops.onednn.qlinear_pointwise,
                xu, 1.0, 64, packed, scale, zp, None, 1.0, 0, torch.float32, "none", [], "",
            )  # fmt: skip
            if have_cpp:
                cpacked, rowsum = cpu_int8.pack(q)
                cpp = _per_call(seconds, cpu_int8.linear, x, cpacked, rowsum, scale, 63)
                best = min(best, cpp)
            spent["int8"] += times * best
        for key in peaks:
            peaks[key][m] = flops / spent[key] / 1e9
    return peaks


def _fastest_call(calls: int, fn, *args: object) -> float:  # noqa: ANN001
    """Seconds of the fastest of `calls` fn(*args) calls, after a warm-up call."""
    fn(*args)
    best = float("inf")
    for _ in range(calls):
        start = time.perf_counter()
        fn(*args)
        best = min(best, time.perf_counter() - start)
    return best


def bandwidth(mib: int = 256) -> dict[str, float]:
    """GB/s: read (sum of a buffer far larger than the caches; the mean over a second, and the
    fastest of 20 calls: what the machine can do when the neighbours let it, the figure a bound
    needs) and copy (bytes read + written)."""
    src = read_buffer(mib)
    dst = torch.empty_like(src)
    nbytes = src.numel() * 4
    read = _per_call(1.0, torch.sum, src)
    copy = _per_call(1.0, dst.copy_, src)
    return {"read_gb_s": nbytes / read / 1e9, "read_best_gb_s": fastest_read(src, 20),
            "copy_gb_s": 2 * nbytes / copy / 1e9}  # fmt: skip


def read_buffer(mib: int = 256) -> torch.Tensor:
    """fp32 ones far larger than the caches, for the read readings."""
    return torch.ones(mib * 2**18)


def fastest_read(src: torch.Tensor, calls: int) -> float:
    """GB/s of the fastest of `calls` sums of src (read_buffer)."""
    return src.numel() * 4 / _fastest_call(calls, torch.sum, src) / 1e9


# ---- pagedllm, one user ----------------------------------------------------------------------
def pagedllm_batch1(
    model: Path,
    engine_kwargs: dict,
    prompt: list[int],
    out_len: int,
    long_prompt: list[int] | None = None,
) -> dict:
    """TTFT of the prompt and decode tok/s over out_len tokens (one request); with
    long_prompt, also the rate its prompt is processed at (tok/s: its length / its TTFT, best
    of 3, from an empty cache: llama-bench's pp<n>)."""
    from pagedllm import LLM, SamplingParams

    llm = LLM(str(model), skip_tokenizer_init=True, max_num_seqs=1, **engine_kwargs)

    def run(n: int, tokens: list[int] = prompt) -> float:
        llm.llm_engine.block_manager.reset_prefix_cache()
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=False)
        start = time.perf_counter()
        llm.generate([tokens], params, use_tqdm=False)
        return time.perf_counter() - start

    run(8)  # warm-up
    ttft = min(run(1) for _ in range(3))
    total = min(run(out_len) for _ in range(2))
    result = {"ttft_s": ttft, "decode_tok_s": (out_len - 1) / (total - ttft)}
    if long_prompt is not None:
        result["prompt_tok_s"] = len(long_prompt) / min(run(1, long_prompt) for _ in range(3))
    return result


# ---- llama.cpp -------------------------------------------------------------------------------
def gguf_format(path: Path) -> str:
    """The file's format as its metadata names it (general.file_type: "q4_1", "bf16" ...),
    else as its name spells it."""
    import gguf

    from pagedllm.gguf_metadata import open_gguf

    try:
        file_type = open_gguf(path).value("general.file_type")
        if file_type is not None:
            name = gguf.LlamaFileType(int(file_type)).name
            return name.removeprefix("MOSTLY_").removeprefix("ALL_").lower()
    except ValueError:
        pass
    match = re.search(r"(f32|f16|bf16|q8_0|q4_0|q4_1|q4_k_m)", path.name.lower())
    return match[1] if match else path.stem


def llama_bench_command(
    binary: Path, gguf: Path, threads: int, prompt_len: int, out_len: int, depth: int = 0
) -> list[str]:
    cmd = [str(binary), "-m", str(gguf), "-p", str(prompt_len), "-n", str(out_len)]
    cmd += ["-d", str(depth)] if depth else []
    return cmd + ["-t", str(threads), "-r", "3", "-o", "json"]


def llama_bench(
    binary: Path, gguf: Path, threads: int, prompt_len: int, out_len: int, depth: int = 0
) -> dict:
    """llama-bench's tg<out_len> (after depth tokens of context) and, for prompt_len > 0, its
    pp<prompt_len> as a TTFT (tok/s: the mean of its repetitions). Where a context of depth
    tokens crashes it (a native build on an AMX CPU: its repacked Q4_0 / Q4_1 / Q8_0 path dies
    on any prompt of 2 or more tokens), tg<out_len> from an empty context instead, which is
    the faster figure; "command" says which ran."""
    cmd = llama_bench_command(binary, gguf, threads, prompt_len, out_len, depth)
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    except subprocess.CalledProcessError as e:
        if depth == 0 and prompt_len == 0:
            raise
        print(f"llama-bench failed ({e.returncode}) on {gguf.name} with a prompt or context; "
              "timing decode from an empty context", flush=True)  # fmt: skip
        return llama_bench(binary, gguf, threads, 0, out_len)
    rows = json.loads(out)
    tg = next(r["avg_ts"] for r in rows if r["n_gen"] > 0)
    if prompt_len == 0:
        return {"ttft_s": None, "decode_tok_s": tg, "command": " ".join(cmd)}
    pp = next(r["avg_ts"] for r in rows if r["n_prompt"] > 0)
    return {"ttft_s": prompt_len / pp, "decode_tok_s": tg, "command": " ".join(cmd)}


def llama_prompt_rate(binary: Path, gguf: Path, threads: int, prompt_len: int) -> dict:
    """llama-bench's pp<prompt_len> (tok/s, the mean of its repetitions; from an empty
    context), or None where a prompt crashes it (llama_bench's AMX case)."""
    cmd = llama_bench_command(binary, gguf, threads, prompt_len, 0)
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    except subprocess.CalledProcessError as e:
        print(f"llama-bench failed ({e.returncode}) on {gguf.name} with a prompt", flush=True)
        return {"prompt_tok_s": None, "command": " ".join(cmd)}
    pp = next(r["avg_ts"] for r in json.loads(out) if r["n_prompt"] > 0)
    return {"prompt_tok_s": pp, "command": " ".join(cmd)}


@dataclass
class LlamaServer:
    """llama-server on one GGUF with a slot per request of the largest workload."""

    binary: Path
    gguf: Path
    threads: int
    slots: int
    ctx_per_slot: int = 1024
    extra: tuple[str, ...] = ()  # more options
    proc: subprocess.Popen | None = None
    url: str = ""
    command: list[str] = field(default_factory=list)

    def __enter__(self) -> LlamaServer:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        cmd = [str(self.binary), "-m", str(self.gguf), "--host", "127.0.0.1", "--port", str(port)]
        cmd += ["-t", str(self.threads), "-tb", str(self.threads), "-np", str(self.slots)]
        cmd += ["-c", str(self.slots * self.ctx_per_slot), "-b", "2048", "-ub", "512"]
        cmd += ["--log-disable", *self.extra]
        self.command = cmd
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.url = f"http://127.0.0.1:{port}"
        wait_healthy(self.url, self.proc, timeout=300)
        return self

    def __exit__(self, *exc: object) -> None:
        assert self.proc is not None
        self.proc.terminate()
        self.proc.wait(timeout=30)


GREEDY = {"temperature": 0.0}  # a request's sampling fields where none are given


async def _llama_all(url: str, reqs: list[Request], sampling: dict | None = None) -> float:
    import httpx

    fields = sampling or GREEDY

    async def one(client: httpx.AsyncClient, r: Request) -> int:
        body = {"prompt": r.prompt, "n_predict": r.output_len, "ignore_eos": True,
                **fields, "cache_prompt": True, "stream": False}  # fmt: skip
        resp = await client.post(url + "/completion", json=body)
        resp.raise_for_status()
        return int(resp.json()["tokens_predicted"])

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=3600, limits=limits) as client:
        await one(client, Request(reqs[0].prompt[:8], 4))  # warm-up
        start = time.perf_counter()
        done = await asyncio.gather(*(one(client, r) for r in reqs))
        elapsed = time.perf_counter() - start
    if list(done) != [r.output_len for r in reqs]:
        raise RuntimeError("llama-server generated other token counts than requested")
    return elapsed


# ---- SmolLM2-135M-Instruct beside llama.cpp (--real-model) -----------------------------------
# The serving workload: requests of real text, all sent at once to each engine's HTTP server.
SERVE_REQUESTS = 48
SERVE_PROMPT_TOKENS = (96, 480)
SERVE_OUTPUT_TOKENS = (32, 192)
BATCH1_PROMPT, BATCH1_OUTPUT = 128, 128
PROMPT_RATE_TOKENS = 512  # one user's prompt processing (llama-bench's pp512)
# GGUF formats whose weights pagedllm runs in a float dtype: the file's own, so that both
# engines stream the same bytes; the block formats (q8_0, q4_1 ...) run at the default dtype.
GGUF_FLOAT_DTYPES = {"f32": "float32", "f16": "float16", "bf16": "bfloat16"}


@dataclass(frozen=True)
class Engine:
    """One row of the real-model table: an engine on one format of the weights."""

    name: str  # "pagedllm" or "llama.cpp"
    fmt: str  # "fp32" / "bf16" / "int8" (HF folder), "gguf q4_1" (pagedllm on a file), "q4_1"
    model: Path  # HF folder or GGUF file
    kwargs: dict  # pagedllm's engine arguments

    @property
    def label(self) -> str:
        return f"{self.name} {self.fmt}"

    @property
    def series(self) -> str:
        """The chart's bar series: which engine, reading which kind of file."""
        if self.name == "llama.cpp":
            return "llama.cpp (GGUF)"
        return "pagedllm (GGUF)" if self.fmt.startswith("gguf") else "pagedllm (HF folder)"

    @property
    def family(self) -> str:
        """The chart's group: formats of the same width side by side."""
        fmt = self.fmt.removeprefix("gguf ").removesuffix("-bf16").removesuffix("-kv")
        eight = "8-bit (int8 / q8_0)"
        return {"fp32": "f32", "int8": eight, "int8-bf16": eight, "q8_0": eight}.get(fmt, fmt)


def real_model_engines(folder: Path, precisions: list[str], ggufs: list[Path]) -> list[Engine]:
    engines = [Engine("pagedllm", p, folder, ALL_PRECISIONS[p]) for p in precisions]
    for path in ggufs:
        fmt = gguf_format(path)
        if fmt in GGUF_FLOAT_DTYPES:
            engines.append(
                Engine("pagedllm", f"gguf {fmt}", path, {"dtype": GGUF_FLOAT_DTYPES[fmt]})
            )
            continue
        engines.append(Engine("pagedllm", f"gguf {fmt}", path, {}))  # blocks kept, fp32 x
        if cpu_has_native_bf16():  # elsewhere bf16 runs 5-10x slower than fp32
            engines.append(Engine("pagedllm", f"gguf {fmt}-bf16", path, {"dtype": "bfloat16"}))
    return engines


def real_text_tokens(tokenizer_json: Path) -> list[int]:
    """The quantization calibration's text (pydoc's topics, shipped with Python) tokenized with
    the model's tokenizer: prompts of real text, the same on every machine."""
    from tokenizers import Tokenizer

    from pagedllm.layers.quantization import calibration_text

    tokenizer = Tokenizer.from_file(str(tokenizer_json))
    return tokenizer.encode(calibration_text(), add_special_tokens=False).ids


def real_text_workload(
    tokens: list[int],
    count: int,
    prompt_tokens: tuple[int, int],
    output_tokens: tuple[int, int],
    seed: int = 0,
) -> list[Request]:
    """count requests, each a window of the text at a random place (so prompts share no
    prefix) with a random output length; lengths inclusive."""
    rng = random.Random(seed)
    reqs = []
    for _ in range(count):
        length = rng.randint(*prompt_tokens)
        start = rng.randrange(len(tokens) - length)
        reqs.append(Request(tokens[start : start + length], rng.randint(*output_tokens)))
    return reqs


def gguf_weight_bytes(path: Path) -> int:
    """Bytes of the file's weights one decode step reads: every matrix but the token embedding
    (one row of it is read), and the embedding as well where it is also the LM head (tied:
    the file has no output.weight). Norms (vectors) are negligible."""
    from pagedllm.gguf_metadata import open_gguf

    matrices = {t.name: int(t.n_bytes) for t in open_gguf(path).reader.tensors
                if len(t.shape) == 2}  # fmt: skip
    embedding = matrices.pop("token_embd.weight")
    return sum(matrices.values()) + (embedding if "output.weight" not in matrices else 0)


def folder_weight_bytes(config: dict, engine_kwargs: dict) -> int:
    """Bytes of the weights one decode step reads when pagedllm loads the HF folder with these
    engine arguments: the linear layers and the LM head, in the run dtype or, with int8, one
    byte per weight and an fp32 scale per output row (the LM head too, as int8 has it by
    default)."""
    import torch

    dtype_bytes = getattr(torch, engine_kwargs["dtype"]).itemsize
    shapes = linear_shapes(config)
    if engine_kwargs.get("quantization") == "int8":
        return sum((n * k + 4 * n) * t for n, k, t in shapes.values())
    return dtype_bytes * sum(n * k * t for n, k, t in shapes.values())


def engine_weight_bytes(engine: Engine, config: dict) -> int:
    if engine.model.is_dir():
        return folder_weight_bytes(config, engine.kwargs)
    return gguf_weight_bytes(engine.model)


def sampling_body(temperature: float, top_p: float) -> dict:
    """A request's sampling fields, the same for both servers: greedy where temperature is 0;
    else temperature and top_p with top-k and min-p off (llama-server's defaults are 40 and
    0.05, pagedllm's and vLLM's off)."""
    if temperature == 0.0:
        return GREEDY
    return {"temperature": temperature, "top_p": top_p, "top_k": 0, "min_p": 0.0}


async def _complete_all(url: str, reqs: list[Request], sampling: dict | None = None) -> float:
    """Every request at once to an OpenAI-style /v1/completions (token-id prompts, greedy or
    `sampling`'s fields, ignore_eos, not streamed); seconds until the last one finished. One
    short warm-up request first. The same client for both servers."""
    import httpx

    fields = sampling or GREEDY

    async def one(client: httpx.AsyncClient, r: Request) -> int:
        body = {"prompt": r.prompt, "max_tokens": r.output_len, **fields,
                "ignore_eos": True, "stream": False}  # fmt: skip
        resp = await client.post(url + "/v1/completions", json=body)
        resp.raise_for_status()
        return int(resp.json()["usage"]["completion_tokens"])

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=3600, limits=limits) as client:
        await one(client, Request(reqs[0].prompt[:8], 4))
        start = time.perf_counter()
        done = await asyncio.gather(*(one(client, r) for r in reqs))
        elapsed = time.perf_counter() - start
    if list(done) != [r.output_len for r in reqs]:
        raise RuntimeError(f"{url} generated other token counts than requested")
    return elapsed


def serve_pagedllm(
    engine: Engine, reqs: list[Request], sampling: dict | None = None
) -> tuple[float, str]:
    """(seconds for all requests, command) through ``pagedllm serve``."""
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in engine.kwargs.items()]
    command = " ".join(["pagedllm serve", str(engine.model), *flags])
    proc, url = start_server(str(engine.model), flags)
    try:
        return asyncio.run(_complete_all(url, reqs, sampling)), command
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def serve_llama(
    binary: Path,
    engine: Engine,
    reqs: list[Request],
    threads: int,
    slots: int = 0,
    ctx: int = 0,
    client=None,  # noqa: ANN001
    sampling: dict | None = None,
) -> tuple[float, str]:
    """(seconds for all requests, command) through llama-server, by default a slot per request
    with room for the longest one, and the OpenAI client (_complete_all). Where the server dies
    on the workload (the repacked weights of a native build on an AMX CPU, see llama_bench),
    again with --no-repack."""
    import httpx

    ctx = ctx or max(len(r.prompt) + r.output_len for r in reqs) + 16
    client = client or _complete_all
    for extra in ((), ("--no-repack",)):
        try:
            with LlamaServer(binary, engine.model, threads, slots or len(reqs), ctx,
                             extra) as server:  # fmt: skip
                ran = client(server.url, reqs, sampling)
                return asyncio.run(ran), " ".join(server.command)
        except (OSError, RuntimeError, httpx.HTTPError) as e:
            if extra:
                raise
            print(f"llama-server failed on {engine.model.name} ({type(e).__name__}); "
                  "again with --no-repack", flush=True)  # fmt: skip
    raise AssertionError("unreachable")


def real_model_main(args: argparse.Namespace) -> None:
    """Batch 1 and serving of SmolLM2 on every format, both engines; the table, JSON, chart."""
    folder = args.model or default_smollm2_folder()
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # pagedllm serve: as many as llama.cpp's
    config = json.loads((folder / "config.json").read_text())
    ggufs = list(args.gguf)
    if not any(gguf_format(g) == "q4_1" for g in ggufs):
        from pagedllm.models.default_model import fetch_gguf

        ggufs.append(fetch_gguf())  # the file users of either engine download
    engines = real_model_engines(folder, args.precisions or list(REAL_PRECISIONS), ggufs)
    if args.llama_server:
        engines += [Engine("llama.cpp", gguf_format(g), g, {}) for g in ggufs]
    scale = 0.25 if args.quick else args.scale
    out_len = BATCH1_OUTPUT // 4 if args.quick else BATCH1_OUTPUT
    n_requests = max(1, round(SERVE_REQUESTS * scale))
    output_range = tuple(max(4, round(n * scale)) for n in SERVE_OUTPUT_TOKENS)
    rounds = 1 if args.quick else args.batch1_rounds

    results: dict = {
        "model": str(folder), "cpu": cpu_model(), "cpu_flags": cpu_flags(),
        "threads": args.threads, "load_start": load_average(), "bandwidth_start": bandwidth(),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
    }  # fmt: skip
    print(f"{results['cpu']}, {args.threads} threads\nflags: {results['cpu_flags']}\n"
          f"{results['load_start']}\nread bandwidth "
          f"{results['bandwidth_start']['read_gb_s']:.1f} GB/s")  # fmt: skip
    tokens = real_text_tokens(folder / "tokenizer.json")
    batch1_prompt = real_text_workload(tokens, 1, (BATCH1_PROMPT,) * 2, (out_len,) * 2, 1)[0]
    long_prompt = real_text_workload(tokens, 1, (PROMPT_RATE_TOKENS,) * 2, (1, 1), 2)[0].prompt
    reqs = real_text_workload(tokens, n_requests, SERVE_PROMPT_TOKENS, output_range)
    results["workload"] = {
        "batch1": f"{BATCH1_PROMPT}-token prompt, {out_len} output tokens, best of {rounds}",
        "prompt": f"one {PROMPT_RATE_TOKENS}-token prompt from an empty cache, tok/s (its "
        f"length / its time to the first token; llama.cpp: llama-bench's pp"
        f"{PROMPT_RATE_TOKENS}), best of {rounds}",
        "serving": f"{len(reqs)} requests at once, prompts {SERVE_PROMPT_TOKENS[0]}-"
        f"{SERVE_PROMPT_TOKENS[1]} tokens ({sum(len(r.prompt) for r in reqs)} in all), outputs "
        f"{output_range[0]}-{output_range[1]} ({sum(r.output_len for r in reqs)} in all), "
        + (
            f"temperature {args.temperature}, top_p {args.top_p} (top-k and min-p off)"
            if args.temperature
            else "greedy"
        )
        + ", ignore_eos",
        "serve_rounds": 1 if args.quick else args.serve_rounds,
    }
    start = time.perf_counter()
    rows = {e.label: {"engine": e.name, "format": e.fmt, "series": e.series, "family": e.family,
                      "weight_bytes": engine_weight_bytes(e, config), "commands": [],
                      "batch1_rounds": []} for e in engines}  # fmt: skip

    # Batch 1: the engines take turns, round after round; each keeps its best (see main()),
    # with a read bandwidth reading just before and just after it (the faster of the two,
    # under a second each): a shared machine's memory moves from minute to minute, so the
    # readings at the run's start and end need not describe the minutes between.
    beside = read_buffer()
    for _ in range(rounds):
        for e in engines:
            row = rows[e.label]
            before = fastest_read(beside, 10)
            if e.name == "pagedllm":
                run = pagedllm_batch1(e.model, e.kwargs, batch1_prompt.prompt, out_len, long_prompt)
                commands = [f"LLM({e.model}, {e.kwargs}), {BATCH1_PROMPT}-token prompt"]
                gc.collect()  # the engine's weights go before the next engine loads its own
            else:
                # Decode after a prompt of the same length as pagedllm's (-d, untimed).
                bench = (args.llama_bench, e.model, args.threads, 0, out_len, BATCH1_PROMPT)
                run = llama_bench(*bench)
                rate = llama_prompt_rate(
                    args.llama_bench, e.model, args.threads, PROMPT_RATE_TOKENS
                )
                run["prompt_tok_s"] = rate["prompt_tok_s"]
                commands = [run["command"], rate["command"]]
            read = max(before, fastest_read(beside, 10))
            row["batch1_rounds"].append(run["decode_tok_s"])
            row.setdefault("prompt_rounds", []).append(run["prompt_tok_s"])
            row.setdefault("batch1_read_gb_s", []).append(read)
            row["commands"] = sorted({*row["commands"], *commands})
            prompt_rate = "-" if run["prompt_tok_s"] is None else f"{run['prompt_tok_s']:.1f}"
            print(f"[batch 1] {e.label}: {run['decode_tok_s']:.1f} tok/s (read beside it "
                  f"{read:.1f} GB/s); prompt {prompt_rate} tok/s", flush=True)  # fmt: skip

    del beside  # 256 MB

    # Serving: the engines take turns too, round after round; each keeps its best.
    out_tokens = sum(r.output_len for r in reqs)
    sampling = sampling_body(args.temperature, args.top_p)
    for _ in range(results["workload"]["serve_rounds"]):
        for e in engines:
            row = rows[e.label]
            if e.name == "pagedllm":
                seconds, command = serve_pagedllm(e, reqs, sampling)
            else:
                seconds, command = serve_llama(
                    args.llama_server, e, reqs, args.threads, sampling=sampling
                )
            row.setdefault("serving_rounds", []).append(out_tokens / seconds)
            row["commands"] = sorted({*row["commands"], command})
            print(f"[serving] {e.label}: {out_tokens / seconds:.1f} out tok/s", flush=True)

    results["bandwidth_end"], results["load_end"] = bandwidth(), load_average()
    results["seconds"] = time.perf_counter() - start
    # The bound: the fastest bandwidth reading of the run's start and end (the machine can do
    # at least that), and the reading beside the engine's best round.
    read = max(results[k]["read_best_gb_s"] for k in ("bandwidth_start", "bandwidth_end")) * 1e9
    for row in rows.values():
        best = max(range(len(row["batch1_rounds"])), key=row["batch1_rounds"].__getitem__)
        row["batch1_tok_s"] = row["batch1_rounds"][best]
        rates = [r for r in row["prompt_rounds"] if r is not None]
        row["prompt_tok_s"] = max(rates) if rates else None
        served = row.get("serving_rounds")  # none with --serve-rounds 0
        row["serving_out_tok_s"] = max(served) if served else None
        row["bound_tok_s"] = read / row["weight_bytes"]
        row["of_bound"] = row["batch1_tok_s"] / row["bound_tok_s"]
        row["read_beside_gb_s"] = row["batch1_read_gb_s"][best]
        row["of_bound_beside"] = (
            row["batch1_tok_s"] * row["weight_bytes"] / (row["read_beside_gb_s"] * 1e9)
        )
    results["rows"] = rows
    markdown = real_model_markdown(results)
    print("\n" + markdown)
    for path, text in ((args.md, markdown), (args.json, json.dumps(results, indent=2))):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n")
    if args.plot:
        plot_real_model(results, Path(args.plot))


def default_smollm2_folder() -> Path:
    from pagedllm.models.default_model import cache_dir

    folder = cache_dir() / "hf-fp32"
    if not (folder / "config.json").is_file():
        raise SystemExit(
            f"no SmolLM2 folder at {folder}: pass --model, or make it from the GGUF with "
            "tests/helpers/real_model.py's smollm2_hf_folder()"
        )
    return folder


def _best(rows: dict, engine: str, key: str) -> tuple[str, float] | None:
    """(format, value) of the engine's best row by key; None where no row has the figure."""
    mine = {r["format"]: r[key] for r in rows.values() if r["engine"] == engine and r.get(key)}
    if not mine:
        return None
    fmt = max(mine, key=mine.__getitem__)
    return fmt, mine[fmt]


FAMILIES = ("f32", "bf16", "8-bit (int8 / q8_0)", "q4_1")  # the table's and chart's order
SERIES = ("pagedllm (HF folder)", "pagedllm (GGUF)", "llama.cpp (GGUF)")


def _row_order(row: dict) -> tuple[int, int, str]:
    family = FAMILIES.index(row["family"]) if row["family"] in FAMILIES else len(FAMILIES)
    return family, SERIES.index(row["series"]), row["format"]


def real_model_markdown(results: dict) -> str:
    rows = results["rows"]
    bw = [results[k] for k in ("bandwidth_start", "bandwidth_end")]
    lines = [
        "# SmolLM2-135M-Instruct: pagedllm beside llama.cpp, same weights",
        "",
        f"- CPU: {results['cpu']}; flags: {results['cpu_flags']}; {results['threads']} threads",
        f"- {results['load_start']} at the start, {results['load_end']} at the end "
        f"({results['seconds'] / 60:.1f} min)",
        "- read bandwidth (GB/s, mean over a second / fastest call): "
        f"{bw[0]['read_gb_s']:.1f} / {bw[0]['read_best_gb_s']:.1f} at the start, "
        f"{bw[1]['read_gb_s']:.1f} / {bw[1]['read_best_gb_s']:.1f} at the end",
        f"- batch 1: {results['workload']['batch1']}",
        f"- prompt: {results['workload']['prompt']}",
        f"- serving: {results['workload']['serving']}, through each engine's HTTP server "
        f"(/v1/completions), best of {results['workload']['serve_rounds']} (the engines "
        "taking turns)"
        if results["workload"]["serve_rounds"]
        else "- serving: not run (--serve-rounds 0)",
        f"- command: `{results['command']}`",
        "",
        "| engine | format | weights MB / token | batch-1 tok/s | bound tok/s | of bound "
        f"| read beside it, GB/s | of its bound | prompt {PROMPT_RATE_TOKENS} tok/s "
        "| serving out tok/s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    figure = lambda value: "-" if value is None else f"{value:.1f}"  # noqa: E731
    for row in sorted(rows.values(), key=_row_order):
        lines.append(
            f"| {row['engine']} | {row['format']} | {row['weight_bytes'] / 1e6:.1f} "
            f"| {row['batch1_tok_s']:.1f} | {row['bound_tok_s']:.1f} "
            f"| {100 * row['of_bound']:.0f}% | {row['read_beside_gb_s']:.1f} "
            f"| {100 * row['of_bound_beside']:.0f}% | {figure(row.get('prompt_tok_s'))} "
            f"| {figure(row['serving_out_tok_s'])} |"
        )
    bound = (
        "Bound: the fastest read bandwidth reading of the run's start and end / weight bytes "
        "per decoded token (linear layers and LM head as the format stores them; the tied LM "
        "head is the embedding). Of its bound: the same against the faster of the readings "
        "just before and just after the engine's best round."
    )
    lines += ["", bound]
    if any(r["engine"] == "llama.cpp" for r in rows.values()):
        for key, what in (
            ("batch1_tok_s", "batch 1"),
            ("prompt_tok_s", f"prompt {PROMPT_RATE_TOKENS}"),
            ("serving_out_tok_s", "serving"),
        ):
            ours, theirs = _best(rows, "pagedllm", key), _best(rows, "llama.cpp", key)
            if ours is None or theirs is None:
                continue
            lines.append(f"- {what}: best pagedllm ({ours[0]}) {ours[1]:.1f} / best llama.cpp "
                         f"({theirs[0]}) {theirs[1]:.1f} = {ours[1] / theirs[1]:.2f}x")  # fmt: skip
        lines += _paired_lines(rows)
    lines += ["", "Commands:", ""]
    lines += [f"- `{c}`" for row in rows.values() for c in row["commands"]]
    return "\n".join(lines)


def _paired_lines(rows: dict) -> list[str]:
    """Batch 1 format against format, round by round: each pagedllm row's rate over the
    llama.cpp row of its family in the same round, the median of those ratios and their
    range. A best of rounds compares the engines' luckiest minutes; the rounds of a shared
    machine spread by more than the engines differ, and a round's pair ran minutes apart."""
    theirs = {r["family"]: r for r in rows.values() if r["engine"] == "llama.cpp"}
    lines = []
    for row in sorted(rows.values(), key=_row_order):
        peer = theirs.get(row["family"])
        if row["engine"] != "pagedllm" or peer is None:
            continue
        ratios = [a / b for a, b in zip(row["batch1_rounds"], peer["batch1_rounds"])]
        lines.append(f"{row['format']} / {peer['format']} {statistics.median(ratios):.2f}x "
                     f"({min(ratios):.2f}-{max(ratios):.2f}x)")  # fmt: skip
    if not lines:
        return []
    rounds = len(next(iter(rows.values()))["batch1_rounds"])
    return [f"- batch 1, format against format, the median of {rounds} rounds' ratios "
            f"(their range): {'; '.join(lines)}"]  # fmt: skip


def plot_real_model(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = sorted(results["rows"].values(), key=_row_order)
    families = list(dict.fromkeys(r["family"] for r in rows))
    series = [s for s in SERIES if any(r["series"] == s for r in rows)]
    colors = dict(zip(SERIES, ("tab:blue", "tab:cyan", "tab:orange")))
    width = 0.8 / len(series)
    panels = [("batch1_tok_s", "one user: decode tok/s"),
              ("prompt_tok_s", f"one user: a {PROMPT_RATE_TOKENS}-token prompt, tok/s"),
              ("serving_out_tok_s", f"serving: {results['workload']['serving'].split(',')[0]}, "
               "out tok/s")]  # fmt: skip
    panels = [p for p in panels if any(r.get(p[0]) for r in rows)]
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4.8), squeeze=False)
    axes = axes[0]
    for ax, (key, title) in zip(axes, panels):
        for i, name in enumerate(series):
            offset = (i - (len(series) - 1) / 2) * width
            best: dict[str, float] = {}  # the faster of two settings of one format (int8)
            for r in rows:
                if r["series"] == name and r.get(key):
                    best[r["family"]] = max(best.get(r["family"], 0.0), r[key])
            if not best:
                continue
            xs, ys = zip(*[(families.index(f) + offset, v) for f, v in best.items()])
            bars = ax.bar(xs, ys, width=width, label=name, color=colors[name])
            ax.bar_label(bars, fmt="%.0f", fontsize=7)
        ax.set_xticks(range(len(families)), families, fontsize=8)
        ax.set_title(title, fontsize=10)
        ax.set_ylabel("tokens / s")
        ax.margins(y=0.1)
    fig.legend(*axes[0].get_legend_handles_labels(), loc="lower center", ncol=len(series),
               fontsize=8, frameon=False)  # fmt: skip
    loads = [results[k].removeprefix("load average ") for k in ("load_start", "load_end")]
    fig.suptitle(f"SmolLM2-135M-Instruct, same weights, on {results['cpu']} "
                 f"({results['threads']} threads)\n{results['cpu_flags']}\n"
                 f"load average (1, 5, 15 min) {loads[0]} at the start, {loads[1]} at the end",
                 fontsize=9)  # fmt: skip
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    print(f"chart: {path}")


# ---- the run ---------------------------------------------------------------------------------
def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    if args.real_model:
        real_model_main(args)
        return
    model = args.model or build_bench_model(default_model_dir())
    scale = 0.25 if args.quick else args.scale
    hf_sizes = args.hf_batch_sizes or ([8, 16] if args.quick else [8, 16, 32, 64])
    results: dict = {"machine": machine(), "cpu_flags": cpu_flags(), "load": load_average()}
    print(f"machine: {results['machine']}\nflags: {results['cpu_flags']}\nload: {results['load']}")
    start = time.perf_counter()

    results["peaks"] = {"gemm_gflops": gemm_peaks([1, 32, 256], args.peak_seconds),
                        **bandwidth()}  # fmt: skip
    print_peaks(results["peaks"])

    batch: dict = {}
    for name in args.workloads:
        reqs = make_workload(name, scale=scale)
        row = batch[name] = {
            "requests": len(reqs),
            "prompt_tokens": sum(len(r.prompt) for r in reqs),
            "output_tokens": sum(r.output_len for r in reqs),
            "load": load_average(),  # each workload's: another process's work shows here
        }
        print(f"[{name}] {row['load']}")
        # The engines take turns for --workload-rounds rounds and each keeps its fastest run
        # (HF: of every batch size and round), as the one-user rounds below do.
        runs: dict[str, list[float]] = {}
        hf: dict[str, dict[int, float]] = {}  # HF label -> batch size -> fastest run
        slots = max(len(make_workload(w, scale=scale)) for w in args.workloads)  # llama.cpp
        for _ in range(args.workload_rounds):
            for prec in args.precisions or list(PRECISIONS):
                seconds, info = run_pagedllm(model, reqs, ALL_PRECISIONS[prec])
                runs.setdefault(f"pagedllm {prec}", []).append(seconds)
                row[f"pagedllm {prec} prefix hits"] = info["prefix_hits"]
                print(f"[{name}] pagedllm {prec}: {row['output_tokens'] / seconds:.1f} out tok/s")
            for dtype in args.hf_dtypes:
                label = f"HF {HF_LABELS[dtype]}"
                for bs in hf_sizes:
                    seconds = run_hf(model, reqs, bs, dtype, warmup=True)
                    runs.setdefault(label, []).append(seconds)
                    sizes = hf.setdefault(label, {})
                    sizes[bs] = min(seconds, sizes.get(bs, seconds))
                    print(f"[{name}] {label} batch {bs}: {row['output_tokens'] / seconds:.1f}")
            for gguf in args.gguf:
                key = f"llama.cpp {gguf_format(gguf)}"
                engine = Engine("llama.cpp", gguf_format(gguf), gguf, {})
                seconds, row[f"{key} command"] = serve_llama(
                    args.llama_server, engine, reqs, args.threads, slots=slots, ctx=1024,
                    client=_llama_all)  # fmt: skip
                runs.setdefault(key, []).append(seconds)
                print(f"[{name}] {key}: {row['output_tokens'] / seconds:.1f} out tok/s")
        for key, seconds in runs.items():
            row[key] = min(seconds)
            row[f"{key} rounds s"] = seconds
        for label, sizes in hf.items():
            row[f"{label} best batch"] = min(sizes, key=sizes.get)
    results["batch"] = batch

    # One user: the engines take turns, round after round, and each keeps its best round.
    # A shared machine's memory bandwidth drifts over minutes; batch-1 decode is bound by
    # it, so runs minutes apart would compare the machine's moods, not the engines.
    rounds: dict[str, list[dict]] = {}
    for _ in range(args.batch1_rounds):
        for prec in args.precisions or list(PRECISIONS):
            prompt = make_workload("uniform", seed=1)[0].prompt[:128]
            run = pagedllm_batch1(model, ALL_PRECISIONS[prec], prompt, 128)
            rounds.setdefault(f"pagedllm {prec}", []).append(run)
        for gguf in args.gguf if args.llama_bench else []:
            run = llama_bench(args.llama_bench, gguf, args.threads, 128, 128)
            rounds.setdefault(f"llama.cpp {gguf_format(gguf)}", []).append(run)
    results["batch1"] = {
        name: {
            "decode_tok_s": max(r["decode_tok_s"] for r in runs),
            # None: llama-bench could time no prompt (see llama_bench)
            "ttft_s": min((r["ttft_s"] for r in runs if r["ttft_s"] is not None), default=None),
            "rounds_decode_tok_s": [r["decode_tok_s"] for r in runs],
        }
        for name, runs in rounds.items()
    }
    results["seconds"] = time.perf_counter() - start
    results["load_end"] = load_average()
    report(results, model)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2))
    if args.plot:
        plot(results, Path(args.plot))


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--real-model",
        action="store_true",
        help="SmolLM2-135M-Instruct instead: batch 1 and 48 requests through both servers, "
        "every format (--precisions from the HF folder, each --gguf file and the Q4_1 file)",
    )
    ap.add_argument(
        "--model",
        type=Path,
        default=None,
        help="default: the 125M bench model (--real-model: the SmolLM2 HF folder in the cache)",
    )
    ap.add_argument("--workloads", nargs="+", default=list(WORKLOADS))
    ap.add_argument(
        "--precisions",
        nargs="+",
        default=None,
        choices=list(ALL_PRECISIONS),
        help="default: fp32 bf16 int8 (--real-model: and int8-bf16, int8-kv-bf16)",
    )
    ap.add_argument("--hf-batch-sizes", nargs="+", type=int, default=None)
    ap.add_argument("--hf-dtypes", nargs="+", default=["float32"], choices=list(HF_LABELS),
                    help="HF transformers runs at each (float32; bfloat16 for equal precision "
                    "with pagedllm bf16)")  # fmt: skip
    ap.add_argument("--scale", type=float, default=1.0, help="share of each workload's requests")
    ap.add_argument(
        "--quick",
        action="store_true",
        help="--scale 0.25, HF batches 8 and 16 (--real-model: a quarter of the requests and "
        "output tokens, one batch-1 round)",
    )
    ap.add_argument(
        "--workload-rounds",
        type=int,
        default=1,
        help="batch workloads: rounds, the engines taking turns; each keeps its fastest run "
        "(HF: of every batch size and round)",
    )
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--peak-seconds", type=float, default=0.2, help="per GEMM shape")
    ap.add_argument(
        "--batch1-rounds",
        type=int,
        default=3,
        help="one-user rounds, the engines taking turns; each keeps its best (3)",
    )
    ap.add_argument(
        "--serve-rounds",
        type=int,
        default=2,
        help="--real-model: serving rounds, the engines taking turns; each keeps its best (2)",
    )
    ap.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="--real-model: the serving requests' temperature (0: greedy, the default)",
    )
    ap.add_argument(
        "--top-p",
        type=float,
        default=1.0,
        help="--real-model: the serving requests' top_p where --temperature is above 0",
    )
    ap.add_argument("--llama-server", type=Path, default=None)
    ap.add_argument("--llama-bench", type=Path, default=None, help="default: beside the server")
    ap.add_argument("--gguf", type=Path, nargs="*", default=[])
    ap.add_argument("--json", type=Path, default=None, help="default: benchmarks/results/"
                    "compare.json (--real-model: compare_smollm2.json)")  # fmt: skip
    ap.add_argument("--md", type=Path, default=Path("benchmarks/results/compare_smollm2.md"),
                    help="--real-model: the markdown table")  # fmt: skip
    ap.add_argument("--plot", default=None, help="chart PNG ('' for none; default: docs/"
                    "compare.png, --real-model: docs/compare_smollm2.png)")  # fmt: skip
    args = ap.parse_args()
    stem = "compare_smollm2" if args.real_model else "compare"
    args.json = args.json or Path(f"benchmarks/results/{stem}.json")
    args.plot = f"docs/{stem}.png" if args.plot is None else args.plot
    if args.gguf and args.llama_server is None:
        ap.error("--gguf needs --llama-server")
    if args.llama_server and args.llama_bench is None:
        bench = args.llama_server.parent / "llama-bench"
        args.llama_bench = bench if bench.exists() else None
    return args


# ---- output ----------------------------------------------------------------------------------
def print_peaks(peaks: dict) -> None:
    print("\nGEMM at the model's shapes, GFLOP/s:")
    for dtype, by_rows in peaks["gemm_gflops"].items():
        print(f"  {dtype:5s} " + "  ".join(f"{m:4d} rows {v:7.1f}" for m, v in by_rows.items()))
    print(f"memory: read {peaks['read_gb_s']:.1f} GB/s, copy {peaks['copy_gb_s']:.1f} GB/s")


def report(results: dict, model: Path) -> None:
    peaks = results["peaks"]
    print(
        f"\nmodel: {model}, run took {results['seconds'] / 60:.1f} min; "
        f"{results['load']} at the start, {results['load_end']} at the end"
    )
    for name, row in results["batch"].items():
        out = row["output_tokens"]
        engines = [k for k in row if k.startswith(("pagedllm", "HF", "llama")) and
                   isinstance(row[k], float) and "prefix" not in k]  # fmt: skip
        print(f"\n[{name}] {row['requests']} requests, {out} output tokens")
        for k in engines:
            rounds = row.get(f"{k} rounds s", [])
            runs = " / ".join(f"{x:.2f}" for x in rounds)
            runs = f"  (runs: {runs} s)" if len(rounds) > 1 else ""
            print(f"  {k:22s} {out / row[k]:8.1f} out tok/s{runs}")
        for prec in ALL_PRECISIONS:
            key = f"pagedllm {prec}"
            if key not in row:
                continue
            for ref in [k for k in engines if not k.startswith("pagedllm")]:
                print(f"  {key} / {ref}: {row[ref] / row[key]:.2f}x")
            flops = _run_flops(row, prec)
            peak = peaks["gemm_gflops"][products_of(prec)][256]
            rate = flops / row[key] / 1e9
            print(f"  {key} matmul {rate:.1f} GFLOP/s = {100 * rate / peak:.0f}% of the "
                  f"256-row GEMM rate ({peak:.1f})")  # fmt: skip
    print("\n[one user] 128 prompt + 128 output tokens")
    bytes_per = {"fp32": 4, "int8": 1, "f32": 4, "f16": 2, "bf16": 2, "q8_0": 34 / 32}
    for name, r in results["batch1"].items():
        fmt = products_of(name.split()[-1]) if name.startswith("pagedllm") else name.split()[-1]
        wbytes = weight_bytes_per_token(bytes_per.get(fmt, 4))
        bound = peaks["read_gb_s"] * 1e9 / wbytes
        tok_s = r["decode_tok_s"]
        ttft = "   none" if r["ttft_s"] is None else f"{r['ttft_s'] * 1e3:7.1f}"
        rounds = " / ".join(f"{x:.1f}" for x in r.get("rounds_decode_tok_s", []))
        print(f"  {name:22s} decode {tok_s:6.1f} tok/s  TTFT {ttft} ms  bandwidth "
              f"bound {bound:6.1f} tok/s ({100 * tok_s / bound:.0f}%)  "
              f"rounds {rounds}")  # fmt: skip


def _run_flops(row: dict, prec: str) -> float:
    """Matmul FLOPs pagedllm did: every prompt token not found in the prefix cache and every
    fed-back output token through the decoder, one LM-head row per output token."""
    computed = row["prompt_tokens"] - row.get(f"pagedllm {prec} prefix hits", 0)
    body = computed + row["output_tokens"] - row["requests"]
    head = flops_per_token(True) - flops_per_token(False)
    return body * flops_per_token(False) + row["output_tokens"] * head


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = {n: {k: r["output_tokens"] / v for k, v in r.items()
                  if isinstance(v, float) and k.startswith(("pagedllm", "HF", "llama"))
                  and "prefix" not in k}
              for n, r in results["batch"].items()}  # fmt: skip
    # the one-user rounds time pagedllm against llama-bench only: HF has no bar there
    one_user = "one user (decode):\npagedllm vs llama-bench"
    groups[one_user] = {k: v["decode_tok_s"] for k, v in results["batch1"].items()}
    engines = sorted({e for g in groups.values() for e in g}, key=_engine_order)
    width = 0.8 / max(1, len(engines))
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for i, engine in enumerate(engines):
        xs = [g + (i - (len(engines) - 1) / 2) * width for g in range(len(groups))]
        ys = [groups[n].get(engine, 0.0) for n in groups]
        ax.bar(xs, ys, width=width, label=engine)
        for x, n in zip(xs, groups):  # an absent bar says so instead of leaving a gap
            if engine not in groups[n]:
                ax.text(x, 5, "not timed", rotation=90, ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(groups)), list(groups))
    ax.set_ylabel("output tokens / s")
    ax.set_title(f"125M Llama on {results['machine'].split(',')[0]}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    print(f"chart: {path}")


def _engine_order(name: str) -> tuple[int, str]:
    return ({"H": 0, "l": 1, "p": 2}[name[0]], name)


if __name__ == "__main__":
    main()
