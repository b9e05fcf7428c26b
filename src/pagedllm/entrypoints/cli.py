"""The ``pagedllm`` command: generate, chat, serve and the other tools, as subcommands."""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import logging
import sys
from collections.abc import Callable
from typing import Any

from pagedllm import envs
from pagedllm.config import DEPRECATED_PARTITION_FIELDS, EngineArgs, partition_config_dict
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
    "bench": ("pagedllm.entrypoints.bench_cli", "measure latency or throughput offline"),
}


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """Help that ends with each flag's default, unless it has none (None, False) or the help
    already says it."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if not action.option_strings or "default:" in text:
            return action.help
        if default is None or default is False or default is argparse.SUPPRESS:
            return action.help
        return f"{text} (default: %(default)s)" if text else "default: %(default)s"


class ArgumentParser(argparse.ArgumentParser):
    """The command's parser: subcommand parsers (made through add_subparsers) show defaults."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", DefaultsHelpFormatter)
        super().__init__(*args, **kwargs)


def add_engine_args(parser: argparse.ArgumentParser, model_positional: bool = False) -> None:
    """Every EngineArgs field as a vLLM-style flag (--max-num-seqs ...)."""
    group = parser.add_argument_group("engine")
    for f in dataclasses.fields(EngineArgs):
        flag = "--" + f.name.replace("_", "-")
        help_text = f.metadata.get("help", "")
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
        if "int |" in str(f.type):  # int | None: an integer when given
            kind = int
        group.add_argument(flag, type=kind or str, default=default, help=help_text)
    if model_positional:
        parser.add_argument(
            "model_pos",
            nargs="?",
            metavar="MODEL",
            help="model folder, GGUF file or hub id (same as --model)",
        )


# Without --model these run SmolLM2-135M-Instruct (fetched on first use); the other tools
# and the Python API keep the bundled demo model as their default.
FIRST_RUN_COMMANDS = ("generate", "chat", "serve", "bench")


def engine_args_from(ns: argparse.Namespace) -> EngineArgs:
    kwargs = {
        f.name: getattr(ns, f.name) for f in dataclasses.fields(EngineArgs) if hasattr(ns, f.name)
    }
    # The --partition-* flags are keys of partition_config (their EngineArgs fields are
    # deprecated); flags given win over the same keys of --partition-config.
    flags = {
        key: kwargs.pop(name)
        for name, key in DEPRECATED_PARTITION_FIELDS.items()
        if kwargs.get(name) is not None
    }
    for name in DEPRECATED_PARTITION_FIELDS:
        kwargs.pop(name, None)
    if flags:
        kwargs["partition_config"] = (
            partition_config_dict(kwargs.get("partition_config")) or {}
        ) | flags
    model = getattr(ns, "model_pos", None) or kwargs.pop("model", None)
    kwargs.pop("model", None)
    if model is None and getattr(ns, "command", None) in FIRST_RUN_COMMANDS:
        from pagedllm.config import default_model_path
        from pagedllm.models.default_model import first_run_model

        model = first_run_model(default_model_path())
    return EngineArgs(**kwargs) if model is None else EngineArgs(model=model, **kwargs)


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "sampling",
        "Unset values come from the model's generation_config.json (as in vLLM), else the "
        "SamplingParams defaults; the temperature then defaults to 0 (greedy).",
    )
    group.add_argument("--max-tokens", type=int, default=64, help="tokens to generate")
    group.add_argument("--temperature", type=float, default=None, help="0 = greedy")
    group.add_argument("--top-p", type=float, default=None, help="nucleus mass kept, in (0, 1]")
    group.add_argument("--top-k", type=int, default=None, help="0 = off")
    group.add_argument(
        "--min-p", type=float, default=None, help="drop tokens below min-p x the top probability"
    )
    group.add_argument(
        "--repetition-penalty", type=float, default=None, help="1 = off; > 1 repeats less"
    )
    group.add_argument(
        "--presence-penalty", type=float, default=0.0, help="> 0 favours tokens not seen yet"
    )
    group.add_argument(
        "--frequency-penalty", type=float, default=0.0, help="> 0 penalises frequent tokens"
    )
    group.add_argument("--n", type=int, default=1, help="samples per prompt")
    group.add_argument("--sampling-seed", type=int, default=None, help="per-request seed")
    group.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    group.add_argument("--ignore-eos", action="store_true", help="go on past the EOS token")


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


# Lines of `pagedllm chat` that end it instead of being sent to the model.
CHAT_EXIT_COMMANDS = ("/exit", "/quit")


def _chat(ns: argparse.Namespace) -> int:
    from pagedllm.entrypoints.llm import LLM

    llm = LLM.from_engine_args(engine_args_from(ns))
    params = sampling_params_from(ns, llm.llm_engine.sampling_defaults)
    _warm_up(llm)
    messages: list[dict[str, str]] = []
    print(f"Chat: type a message; {', '.join(CHAT_EXIT_COMMANDS)}, an empty line or Ctrl-D quit.")
    while True:
        try:
            user = input("you> ").strip()
        except EOFError:
            break
        if not user or user.lower() in CHAT_EXIT_COMMANDS:
            break
        messages.append({"role": "user", "content": user})
        reply = llm.chat(messages, params, use_tqdm=False)[0].outputs[0].text
        print(f"assistant> {reply.strip()}", flush=True)
        messages.append({"role": "assistant", "content": reply})
    return 0


def _warm_up(llm: Any) -> None:
    """A prefill and a decode step before the first prompt: what loads on first use (C++
    kernels, tuned tiles) loads and logs now, not between the user's line and the reply."""
    from pagedllm.sampling_params import SamplingParams

    llm.generate([[0]], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)


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
    """The parser; with `only`, the other subcommands' modules are not imported (start-up):
    only="" imports none of them (the command's own help lists them by name)."""
    parser = ArgumentParser(
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
    # `pagedllm --help` (no subcommand) needs no subcommand's module: none loads torch.
    parser = build_parser(chosen if chosen in SUBCOMMANDS else "")
    ns, unknown = parser.parse_known_args(argv)
    ns.raw_argv = list(args)  # what a command that starts others of itself passes on
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
    except ImportError as e:  # an optional dependency (e.g. grpcio for the split)
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
