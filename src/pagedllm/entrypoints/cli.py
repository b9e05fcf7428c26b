"""The ``pagedllm`` command: generate, chat, serve and the other tools, as subcommands."""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import logging
import sys
from collections.abc import Callable

from pagedllm import envs
from pagedllm.config import EngineArgs
from pagedllm.sampling_params import SamplingParams

# subcommand -> (module, help); each module has add_parser(subparsers) -> parser whose
# defaults carry func=handler. Imported lazily so `pagedllm generate` never loads the server.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "generate": ("pagedllm.entrypoints.cli", "generate text for one or more prompts"),
    "chat": ("pagedllm.entrypoints.cli", "chat with a model in the terminal"),
    "serve": ("pagedllm.entrypoints.openai.cli_args", "run the OpenAI-compatible HTTP server"),
    "partition": ("pagedllm.entrypoints.partition_cli", "plan where to cut a model across tiers"),
    "profile-device": ("pagedllm.entrypoints.partition_cli", "measure this machine as a tier"),
    "split-worker": ("pagedllm.entrypoints.partition_cli", "run the cloud tier of a plan"),
    "quantize": ("pagedllm.entrypoints.quantize_cli", "write an int8 copy of a model folder"),
    "quantize-eval": ("pagedllm.entrypoints.quantize_cli", "compare int8 with full precision"),
}

_ENGINE_FLAG_HELP = {
    "model": "local Hugging Face model folder (default: the bundled demo model)",
    "tokenizer": "tokenizer folder (default: the model's)",
    "dtype": "auto | float32 | bfloat16 | float16",
    "seed": "random seed",
    "max_model_len": "longest prompt + output, in tokens (default: the model's)",
    "block_size": "tokens per KV-cache block",
    "max_num_seqs": "most sequences in one batch",
    "max_num_batched_tokens": "most tokens computed in one step (below max_num_seqs, also the "
    "most sequences in one batch)",
    "gpu_memory_utilization": "share of GPU memory to use (CUDA)",
    "kv_cache_memory_bytes": "KV-cache budget in bytes (CPU default: 4 GiB, at most 40%% of "
    "free RAM)",
    "enable_prefix_caching": "reuse the KV blocks of shared prompt prefixes",
    "enable_chunked_prefill": "split long prompts into chunks that share steps with decode",
    "tensor_parallel_size": "number of tensor-parallel workers",
    "enforce_eager": "never capture CUDA graphs",
    "quantization": "None | int8 (int8 x int8 products, down_proj int8 weight-only, LM head "
    "and embedding kept) | int4 (weight-only, group scales; vLLM's rtn at 4 bits)",
    "device": "auto | cpu | cuda",
    "attention_backend": "torch | cpu | triton (default: chosen for the device)",
    "disable_comm_overlap": "do not overlap tensor-parallel all-reduce with compute",
    "nnodes": "machines the tensor-parallel ranks span (each runs this command)",
    "node_rank": "this machine's index among --nnodes; node 0 runs the engine",
    "master_addr": "rendezvous host, node 0's address (default: MASTER_ADDR or 127.0.0.1)",
    "master_port": "rendezvous port (default: MASTER_PORT, else a free port on one node)",
    "partition": "partition plan JSON (pagedllm partition -o): run one tier of a split",
    "partition_role": "edge (the engine, embedding and layers [0, cut)) | cloud (the rest)",
    "partition_address": "edge: the cloud worker's HOST:PORT; cloud: HOST:PORT to listen on",
    "partition_pipeline_depth": "edge: micro-batches in flight across the tiers (1: none)",
    "partition_replan_interval": "edge: steps between re-planning the cut from what the split "
    "measures, moving it when the optimum moves (0: never)",
    "partition_fallback": "edge, when the link to the cloud is lost: fail (the running "
    "requests end with an error) | local (every layer runs here until the link returns)",
    "quant_exclude": "int8: module name or pattern kept in full precision, e.g. lm_head, "
    "'*.self_attn.*' (repeatable)",
    "quant_granularity": "int8 weight scales: per_channel | per_tensor",
    "quant_observer": "int8 activation scales: minmax (per token) | moving_average",
    "quant_activation": "int8: quantize activations too (int8 x int8 matmuls); "
    "--no-quant-activation: weight-only",
    "quant_smoothing": "int8: migrate activation outliers into the weights (SmoothQuant) from a "
    "calibration pass over pydoc text; --no-quant-smoothing: none (as saved checkpoints)",
    "speculative_config": "speculative decoding as JSON, e.g. "
    '\'{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 5}\'',
}


def add_engine_args(parser: argparse.ArgumentParser, model_positional: bool = False) -> None:
    """Every EngineArgs field as a vLLM-style flag (--max-num-seqs ...)."""
    group = parser.add_argument_group("engine")
    for f in dataclasses.fields(EngineArgs):
        flag = "--" + f.name.replace("_", "-")
        help_text = _ENGINE_FLAG_HELP.get(f.name, "")
        default = f.default if f.default is not dataclasses.MISSING else None
        if f.name == "model":
            group.add_argument(flag, default=None, help=help_text)
            continue
        if isinstance(default, bool):
            group.add_argument(
                flag, action=argparse.BooleanOptionalAction, default=default, help=help_text
            )
            continue
        if str(f.type).startswith("list["):  # a repeatable flag
            group.add_argument(flag, action="append", default=None, help=help_text)
            continue
        kind = {int: int, float: float}.get(type(default), None)
        if f.name in ("max_model_len", "max_num_batched_tokens", "kv_cache_memory_bytes"):
            kind = int
        group.add_argument(flag, type=kind or str, default=default, help=help_text)
    if model_positional:
        parser.add_argument(
            "model_pos", nargs="?", metavar="MODEL", help="model folder (same as --model)"
        )


def engine_args_from(ns: argparse.Namespace) -> EngineArgs:
    kwargs = {
        f.name: getattr(ns, f.name) for f in dataclasses.fields(EngineArgs) if hasattr(ns, f.name)
    }
    model = getattr(ns, "model_pos", None) or kwargs.pop("model", None)
    kwargs.pop("model", None)
    return EngineArgs(**kwargs) if model is None else EngineArgs(model=model, **kwargs)


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "sampling",
        "Unset values come from the model's generation_config.json (as in vLLM), else the "
        "SamplingParams defaults; the temperature then defaults to 0 (greedy).",
    )
    group.add_argument("--max-tokens", type=int, default=64, help="tokens to generate")
    group.add_argument("--temperature", type=float, default=None, help="0 = greedy")
    group.add_argument("--top-p", type=float, default=None)
    group.add_argument("--top-k", type=int, default=None, help="0 = off")
    group.add_argument("--min-p", type=float, default=None)
    group.add_argument("--repetition-penalty", type=float, default=None)
    group.add_argument("--presence-penalty", type=float, default=0.0)
    group.add_argument("--frequency-penalty", type=float, default=0.0)
    group.add_argument("--n", type=int, default=1, help="samples per prompt")
    group.add_argument("--sampling-seed", type=int, default=None, help="per-request seed")
    group.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    group.add_argument("--ignore-eos", action="store_true")


# Without a flag or a generation_config.json value the command line decodes greedily.
CLI_DEFAULTS: dict[str, float | int] = {"temperature": 0.0}


def sampling_params_from(
    ns: argparse.Namespace, defaults: dict[str, float | int] | None = None
) -> SamplingParams:
    """The flags given, over the model's defaults (generation_config.json), over CLI_DEFAULTS."""
    from pagedllm.generation_config import with_defaults

    names = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
    chosen = with_defaults(CLI_DEFAULTS | (defaults or {}), {n: getattr(ns, n) for n in names})
    chosen.pop("max_tokens", None)  # --max-tokens always has a value
    return SamplingParams(
        n=ns.n,
        **chosen,
        presence_penalty=ns.presence_penalty,
        frequency_penalty=ns.frequency_penalty,
        seed=ns.sampling_seed,
        stop=ns.stop,
        max_tokens=ns.max_tokens,
        ignore_eos=ns.ignore_eos,
    )


def _generate(ns: argparse.Namespace) -> int:
    from pagedllm.entrypoints.llm import LLM

    prompts = ns.prompt or [line.rstrip("\n") for line in sys.stdin if line.strip()]
    if not prompts:
        print("error: give a prompt (or pipe prompts on stdin, one per line)", file=sys.stderr)
        return 2
    llm = LLM.from_engine_args(engine_args_from(ns))
    params = sampling_params_from(ns, llm.llm_engine.sampling_defaults)
    outputs = llm.generate(prompts, params, use_tqdm=len(prompts) > 1)
    for out in outputs:
        for comp in out.outputs:
            if len(prompts) > 1 or len(out.outputs) > 1:
                print(f"--- prompt {out.request_id} sample {comp.index} ({comp.finish_reason}) ---")
            print(f"{out.prompt or ''}{comp.text}")
    return 0


def _chat(ns: argparse.Namespace) -> int:
    from pagedllm.entrypoints.llm import LLM

    llm = LLM.from_engine_args(engine_args_from(ns))
    params = sampling_params_from(ns, llm.llm_engine.sampling_defaults)
    messages: list[dict[str, str]] = []
    print("Chat: type a message, empty line or Ctrl-D to quit.")
    while True:
        try:
            user = input("you> ").strip()
        except EOFError:
            break
        if not user:
            break
        messages.append({"role": "user", "content": user})
        reply = llm.chat(messages, params, use_tqdm=False)[0].outputs[0].text
        print(f"assistant> {reply.strip()}")
        messages.append({"role": "assistant", "content": reply})
    return 0


def add_parser(subparsers: argparse._SubParsersAction, name: str) -> argparse.ArgumentParser:
    if name == "generate":
        p = subparsers.add_parser(
            name, help=SUBCOMMANDS[name][1], description="Generate completions offline."
        )
        p.add_argument("prompt", nargs="*", help="prompt text (several for a batch)")
        add_engine_args(p)
        add_sampling_args(p)
        p.set_defaults(func=_generate)
        return p
    p = subparsers.add_parser(
        name,
        help=SUBCOMMANDS[name][1],
        description="Interactive chat using the model's chat template.",
    )
    add_engine_args(p)
    add_sampling_args(p)
    p.set_defaults(func=_chat, max_tokens=128)
    return p


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The parser; with `only`, the other subcommands' modules are not imported (start-up)."""
    parser = argparse.ArgumentParser(
        prog="pagedllm", description="pagedllm: LLM inference and serving engine."
    )
    parser.add_argument("--version", action="version", version=_version())
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, _help) in SUBCOMMANDS.items():
        if only is not None and name != only:
            subparsers.add_parser(name, help=_help)
            continue
        try:
            mod = importlib.import_module(module)
        except ImportError as e:  # a dependency is missing: say which, whatever the flags
            _add_unavailable(subparsers, name, _help, (e.name or str(e)).split(".")[0])
            continue
        adder: Callable = mod.add_parser
        adder(subparsers, name)
    return parser


def _add_unavailable(
    subparsers: argparse._SubParsersAction, name: str, help_text: str, missing: str
) -> None:
    """A subcommand whose module cannot be imported: it takes any arguments and explains."""
    p = subparsers.add_parser(name, help=f"{help_text} (unavailable: {missing} missing)")

    def explain(ns: argparse.Namespace) -> int:
        print(
            f"error: `pagedllm {name}` needs the Python package {missing!r}, which is not "
            f"installed. Install it with `pip install {missing}` (or reinstall pagedllm: "
            "`pip install -c constraints.txt -e .` installs every dependency).",
            file=sys.stderr,
        )
        return 1

    p.set_defaults(func=explain, takes_any_args=True)  # its flags are unknown here


def _version() -> str:
    from pagedllm import __version__

    return f"pagedllm {__version__}"


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(
        level=envs.PAGEDLLM_LOG_LEVEL(), format="%(levelname)s %(asctime)s %(name)s: %(message)s"
    )
    args = sys.argv[1:] if argv is None else argv
    chosen = next((a for a in args if not a.startswith("-")), None)
    parser = build_parser(chosen if chosen in SUBCOMMANDS else None)
    ns, unknown = parser.parse_known_args(argv)
    if unknown and not getattr(ns, "takes_any_args", False):
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if not getattr(ns, "func", None):
        parser.print_help()
        return 2
    try:
        return int(ns.func(ns) or 0)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
