"""``pagedllm serve [MODEL]``: the OpenAI-compatible server's command line (vLLM's flags)."""

from __future__ import annotations

import argparse

from pagedllm.engine.async_engine import DEFAULT_MAX_WAITING_REQUESTS
from pagedllm.entrypoints.cli import SUBCOMMANDS, add_engine_args, engine_args_from
from pagedllm.entrypoints.openai.guard import DEFAULT_MAX_REQUEST_BYTES
from pagedllm.entrypoints.openai.reasoning_parsers import reasoning_parser_names
from pagedllm.entrypoints.openai.tool_parsers import tool_parser_names


def add_parser(subparsers: argparse._SubParsersAction, name: str) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        name,
        help=SUBCOMMANDS[name][1],
        description="Serve a model over an OpenAI-compatible HTTP API "
        "(/v1/completions, /v1/chat/completions, /v1/models, /metrics ...).",
    )
    add_engine_args(p, model_positional=True)
    server = p.add_argument_group("server")
    server.add_argument("--host", default="127.0.0.1", help="address to listen on")
    server.add_argument("--port", type=int, default=8000, help="port (0: a free one)")
    server.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="name(s) clients use for the model; the first is reported "
        "(default: the model folder as given, so that clients find its tokenizer there, "
        "and the folder's name)",
    )
    server.add_argument(
        "--max-waiting-requests",
        type=int,
        default=DEFAULT_MAX_WAITING_REQUESTS,
        help="answer 503 once this many requests wait to be scheduled",
    )
    server.add_argument(
        "--disable-log-stats", action="store_true", help="no periodic statistics line"
    )
    server.add_argument(
        "--log-stats-interval", type=float, default=10.0, help="seconds between statistics lines"
    )
    server.add_argument(
        "--uvicorn-log-level",
        default="info",
        choices=["critical", "error", "warning", "info", "debug", "trace"],
        help="uvicorn's own log level",
    )
    server.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer <key>' on every route but /health",
    )
    server.add_argument(
        "--disable-metrics-auth",
        action="store_true",
        help="serve /metrics without the API key (for a Prometheus scraper)",
    )
    server.add_argument(
        "--max-request-bytes",
        type=int,
        default=DEFAULT_MAX_REQUEST_BYTES,
        help="larger request bodies are refused with HTTP 413",
    )
    server.add_argument(
        "--graceful-shutdown-timeout",
        type=float,
        default=30.0,
        help="seconds SIGTERM / Ctrl-C wait for in-flight requests before cancelling them",
    )
    server.add_argument(
        "--role",
        dest="partition_role",
        choices=["edge", "cloud"],
        default=None,
        help="with --partition: edge serves this API and runs the first layers; cloud runs "
        "the rest for one edge, listening on --partition-address (same as --partition-role; "
        "default: edge)",
    )
    server.add_argument(
        "--tool-call-parser",
        choices=tool_parser_names(),
        default=None,
        help='how tool calls are read from the output for tool_choice "auto" (vLLM\'s names)',
    )
    server.add_argument(
        "--reasoning-parser",
        choices=reasoning_parser_names(),
        default=None,
        help="split <think> text from the answer into reasoning_content (vLLM's names)",
    )
    server.add_argument(
        "--chat-template",
        default=None,
        help="the chat template: a file, an inline Jinja template, or chatml_tools (ChatML "
        "with tools and Hermes <tool_call> blocks) (default: the tokenizer's)",
    )
    server.add_argument(
        "--runner",
        choices=["generate", "pooling"],
        default="generate",
        help="pooling: also serve /v1/embeddings (pooled hidden states of a decoder model)",
    )
    server.add_argument(
        "--pooling-type",
        choices=["last", "mean"],
        default="last",
        help="with --runner pooling: the last prompt token's hidden state, or the mean of all "
        "(mean needs --no-enable-prefix-caching)",
    )
    server.add_argument(
        "--lora-modules",
        nargs="+",
        default=None,
        metavar="NAME=PATH",
        help="LoRA adapters (PEFT folders) served as model NAME (with --enable-lora)",
    )
    server.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='accepted for vLLM compatibility: --tool-call-parser alone enables "auto"',
    )
    from pagedllm.entrypoints.data_parallel import add_data_parallel_args

    add_data_parallel_args(server)
    p.set_defaults(func=_serve)
    return p


def _serve(ns: argparse.Namespace) -> int:
    if ns.data_parallel_size != 1:  # N replicas behind a router, each a `serve` of its own
        from pagedllm.entrypoints.data_parallel import run_data_parallel

        return run_data_parallel(ns, ns.raw_argv[ns.raw_argv.index("serve") + 1 :])
    from pagedllm.entrypoints.openai.server import run_server

    args = engine_args_from(ns)
    if args.partition_config is not None and args.partition_config.get("role") == "cloud":
        from pagedllm.entrypoints.partition_cli import run_cloud_worker

        return run_cloud_worker(args)
    return run_server(
        args,
        host=ns.host,
        port=ns.port,
        uvicorn_log_level=ns.uvicorn_log_level,
        graceful_shutdown_timeout=ns.graceful_shutdown_timeout,
        served_model_names=ns.served_model_name,
        max_waiting_requests=ns.max_waiting_requests,
        log_stats_interval=None if ns.disable_log_stats else ns.log_stats_interval,
        api_key=ns.api_key,
        metrics_need_api_key=not ns.disable_metrics_auth,
        max_request_bytes=ns.max_request_bytes,
        tool_call_parser=ns.tool_call_parser,
        reasoning_parser=ns.reasoning_parser,
        chat_template=ns.chat_template,
        runner=ns.runner,
        pooling_type=ns.pooling_type,
        lora_modules=ns.lora_modules,
    )
