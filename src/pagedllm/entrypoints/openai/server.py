"""The OpenAI-compatible HTTP server: FastAPI app factory, routes, errors, and startup.

``build_app(engine_or_args)`` gives an ASGI app; ``run_server`` serves it with uvicorn and
prints the startup block; ``serve_in_thread`` runs one in a background thread (tests,
benchmarks, notebooks), with the engine reachable in-process.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import signal
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedllm.config import EngineArgs
from pagedllm.engine.async_engine import (
    DEFAULT_MAX_WAITING_REQUESTS,
    AsyncLLMEngine,
    EngineError,
)
from pagedllm.entrypoints.openai.chat_templates import load_chat_template
from pagedllm.entrypoints.openai.guard import DEFAULT_MAX_REQUEST_BYTES, RequestGuard
from pagedllm.entrypoints.openai.lora import LoRARegistry, add_lora_routes, parse_lora_modules
from pagedllm.entrypoints.openai.openapi import (
    CHAT_RESPONSES,
    COMPLETION_RESPONSES,
    ERRORS,
    GENERATION_ERRORS,
    HEALTH_RESPONSES,
    METRICS_RESPONSES,
    MODEL_RESPONSES,
    RESPONSE_RETRIEVE,
    RESPONSES_RESPONSES,
    HealthResponse,
    VersionResponse,
    install_openapi,
)
from pagedllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    EmbeddingRequest,
    EmbeddingResponse,
    ModelCard,
    ModelList,
    ResponsesRequest,
    TokenizeRequest,
    TokenizeResponse,
    TokenizerInfo,
)
from pagedllm.entrypoints.openai.serving import (
    ClientDisconnected,
    OpenAIServing,
    ServedModel,
    ServingError,
    model_not_found,
    warning_header,
)
from pagedllm.entrypoints.openai.serving_chat import OpenAIServingChat
from pagedllm.entrypoints.openai.serving_completion import OpenAIServingCompletion
from pagedllm.entrypoints.openai.serving_embedding import OpenAIServingEmbedding, attach_pooler
from pagedllm.entrypoints.openai.serving_responses import OpenAIServingResponses
from pagedllm.metrics.loggers import LoggingStatLogger
from pagedllm.metrics.monitor import InferenceMonitor, MonitorStatLogger
from pagedllm.metrics.prometheus import PrometheusStatLogger
from pagedllm.worker.pooler import Pooler

logger = logging.getLogger(__name__)


def build_app(
    engine: AsyncLLMEngine | EngineArgs,
    served_model_names: Sequence[str] | None = None,
    max_waiting_requests: int = DEFAULT_MAX_WAITING_REQUESTS,
    log_stats_interval: float | None = 10.0,
    api_key: str | None = None,
    metrics_need_api_key: bool = True,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    tool_call_parser: str | None = None,
    reasoning_parser: str | None = None,
    chat_template: str | None = None,
    runner: str = "generate",
    pooling_type: str = "last",
    lora_modules: Sequence[str] | None = None,
) -> FastAPI:
    """The FastAPI app serving one engine (built from EngineArgs, or given and not owned).

    With ``api_key``, every route but /health (and /metrics unless ``metrics_need_api_key``)
    wants ``Authorization: Bearer <api_key>``; bodies over ``max_request_bytes`` get a 413.
    ``app.state`` holds ``engine`` (AsyncLLMEngine), ``served_model``, ``metrics``
    (PrometheusStatLogger) and ``monitor`` (an InferenceMonitor on the same registry).
    ``chat_template`` (a file, an inline template or a built-in name, see chat_templates.py)
    replaces the tokenizer's; ``tool_call_parser`` and ``reasoning_parser`` are vLLM's names.
    ``runner="pooling"`` serves /v1/embeddings (``pooling_type`` "last" or "mean").
    ``lora_modules`` (``name=path``, an engine with enable_lora) serve adapters by name.
    """
    owned = isinstance(engine, EngineArgs)
    if isinstance(engine, EngineArgs):
        engine = AsyncLLMEngine.from_engine_args(engine, max_waiting_requests)
    model = served_model(engine, served_model_names, load_chat_template(chat_template))
    loras = LoRARegistry(model, engine.engine.config.lora)
    for name, path in parse_lora_modules(lora_modules or ()):
        try:
            loras.add(name, path)
        except ServingError as e:
            raise ValueError(f"--lora-modules {name}={path}: {e.message}") from e
    metrics = PrometheusStatLogger(
        model.name, model.max_model_len, cache_info(engine), process_metrics=True
    )
    # Stat loggers are added before the engine thread starts (the lifespan starts it).
    engine.engine.add_stat_logger(metrics)
    if log_stats_interval:
        engine.engine.add_stat_logger(LoggingStatLogger(log_stats_interval))

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        yield
        if owned:
            engine.shutdown()

    app = FastAPI(title="pagedllm OpenAI-compatible server", lifespan=lifespan)
    app.state.engine = engine
    app.state.served_model = model
    app.state.metrics = metrics
    app.state.monitor = InferenceMonitor(metrics.registry, {"model_name": model.name})
    engine.engine.add_stat_logger(MonitorStatLogger(app.state.monitor))
    _add_error_handlers(app)
    pooler = attach_pooler(engine, pooling_type) if runner == "pooling" else None
    app.state.pooler = pooler
    _add_routes(app, engine, model, metrics, tool_call_parser, reasoning_parser, pooler, loras)
    add_lora_routes(app, loras)
    open_paths = ["/health"] if metrics_need_api_key else ["/health", "/metrics"]
    vocab_size = engine.engine.config.model.hf_config.vocab_size
    install_openapi(app, vocab_size, open_paths if api_key is not None else None)
    app.add_middleware(
        RequestGuard,
        api_key=api_key,
        open_paths=open_paths,
        max_request_bytes=max_request_bytes,
    )
    return app


def served_model(
    engine: AsyncLLMEngine, names: Sequence[str] | None, chat_template: str | None = None
) -> ServedModel:
    """The served names: as given, else the model folder as given (clients that load the
    tokenizer, such as lm-evaluation-harness, find it there, as with vLLM) and its name."""
    config = engine.engine.config
    model = config.model.model
    default = [model, os.path.basename(os.path.normpath(model))]
    return ServedModel(
        names=list(dict.fromkeys(names or default)),
        path=os.path.abspath(model),
        max_model_len=config.scheduler.max_model_len,
        chat_template=chat_template,
    )


def cache_info(engine: AsyncLLMEngine) -> dict[str, str]:
    """Labels of the cache_config_info gauge, as the engine sized its cache.

    ``num_gpu_blocks`` keeps vLLM's label name (dashboards read it) for the blocks on the
    engine's device, whichever it is; ``kv_cache_memory_bytes`` is what one worker allocated.
    ``gpu_memory_utilization`` only means something, and is only present, on CUDA.
    """
    config = engine.engine.config
    kv = engine.engine.kv_cache
    info = {
        "block_size": str(kv.block_size),
        "num_gpu_blocks": str(kv.num_blocks),
        "enable_prefix_caching": str(config.cache.enable_prefix_caching),
        "device": config.device.device,
        "kv_cache_memory_bytes": str(kv.num_blocks * kv.bytes_per_block),
        "cache_dtype": config.cache.cache_dtype,  # vLLM's label: "auto" or kv_cache_dtype's
    }
    if config.device.device == "cuda":
        info["gpu_memory_utilization"] = str(config.cache.gpu_memory_utilization)
    return info


def _json(model: BaseModel, status: int = 200) -> JSONResponse:
    return JSONResponse(model.model_dump(mode="json"), status_code=status)


def _with_warnings(response: Response, raw: Request) -> Response:
    header = warning_header(raw)
    if header is not None:
        response.headers["Warning"] = header
    return response


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ServingError)
    async def serving_error(_: Request, e: ServingError) -> JSONResponse:
        return _json(e.to_response(), e.status)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, e: RequestValidationError) -> JSONResponse:
        err = validation_error_of(e.errors())
        return _json(err.to_response(), err.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        # The exception's headers matter: a 405 lists the allowed methods in Allow.
        error = ServingError(str(e.detail), status=e.status_code)
        response = _json(error.to_response(), e.status_code)
        response.headers.update(e.headers or {})
        return response

    @app.exception_handler(EngineError)
    async def engine_error(_: Request, e: EngineError) -> JSONResponse:
        return _json(ServingError(str(e), status=500).to_response(), 500)

    @app.exception_handler(ClientDisconnected)
    async def client_gone(_: Request, e: ClientDisconnected) -> Response:
        return Response(status_code=499)  # nobody reads it; nginx's code for a closed client


def validation_error_of(errors: Sequence[dict[str, Any]]) -> ServingError:
    """A 400 naming the fields pydantic rejected (or saying the body is not JSON)."""
    parts, params = [], []
    for err in errors:
        if err.get("type") == "json_invalid":
            detail = err.get("ctx", {}).get("error", err.get("msg"))
            return ServingError(f"the request body is not valid JSON: {detail}")
        path = [str(p) for p in err.get("loc", ()) if p != "body"]
        params.append(path[0] if path else None)
        parts.append(f"{'.'.join(path) or 'body'}: {err.get('msg', 'invalid')}")
    return ServingError("; ".join(parts) or "invalid request", param=params[0] if params else None)


def _add_routes(
    app: FastAPI,
    engine: AsyncLLMEngine,
    model: ServedModel,
    metrics: PrometheusStatLogger,
    tool_call_parser: str | None = None,
    reasoning_parser: str | None = None,
    pooler: Pooler | None = None,
    loras: LoRARegistry | None = None,
) -> None:
    from pagedllm import __version__

    base = OpenAIServing(engine, model)
    completion = OpenAIServingCompletion(engine, model)
    chat = OpenAIServingChat(engine, model, tool_call_parser, reasoning_parser)
    responses = OpenAIServingResponses(chat)
    embedding = OpenAIServingEmbedding(engine, model, pooler)
    app.state.responses = responses

    @app.get("/health", responses=HEALTH_RESPONSES)
    async def health() -> JSONResponse:
        """200 once the engine serves; 503 if it died (nothing listens before it is ready)."""
        if engine.errored:
            error = ServingError(f"engine is dead: {engine.dead_error}", status=503)
            return _json(error.to_response(), 503)
        return _json(HealthResponse(status="ok"))

    @app.get("/version", response_model=VersionResponse)
    async def version() -> VersionResponse:
        return VersionResponse(version=__version__)

    @app.get("/metrics", response_class=Response, responses=METRICS_RESPONSES)
    async def prometheus_metrics() -> Response:
        """The Prometheus text exposition of the engine's and the application's metrics."""
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    def card(name: str) -> ModelCard:
        return ModelCard(id=name, root=model.path, max_model_len=model.max_model_len)

    @app.get("/v1/models", response_model=ModelList, responses=ERRORS)
    async def models() -> JSONResponse:
        adapters = loras.cards() if loras is not None else []
        return _json(ModelList(data=[card(name) for name in model.names] + adapters))

    @app.get("/v1/models/{model_id:path}", response_model=ModelCard, responses=MODEL_RESPONSES)
    async def retrieve_model(model_id: str) -> JSONResponse:
        if not model.serves(model_id):
            raise model_not_found(model_id, model)
        adapter = next((c for c in (loras.cards() if loras else []) if c.id == model_id), None)
        return _json(adapter or card(model_id))

    @app.post("/v1/completions", response_model=None, responses=COMPLETION_RESPONSES)
    async def completions(req: CompletionRequest, raw: Request) -> Response:
        result = await completion.create(req, raw)
        return result if isinstance(result, Response) else _json(result)

    @app.post("/v1/chat/completions", response_model=None, responses=CHAT_RESPONSES)
    async def chat_completions(req: ChatCompletionRequest, raw: Request) -> Response:
        result = await chat.create(req, raw)
        return _with_warnings(result if isinstance(result, Response) else _json(result), raw)

    @app.post("/v1/responses", response_model=None, responses=RESPONSES_RESPONSES)
    async def create_response(req: ResponsesRequest, raw: Request) -> Response:
        """OpenAI's Responses API: one response, streamed as its events with stream: true."""
        result = await responses.create(req, raw)
        response = result if isinstance(result, Response) else JSONResponse(result)
        return _with_warnings(response, raw)

    @app.get("/v1/responses/{response_id}", response_model=None, responses=RESPONSE_RETRIEVE)
    async def retrieve_response(response_id: str) -> JSONResponse:
        return JSONResponse(responses.retrieve(response_id))

    if pooler is not None:  # --runner pooling

        @app.post("/v1/embeddings", response_model=EmbeddingResponse, responses=GENERATION_ERRORS)
        async def embeddings(req: EmbeddingRequest, raw: Request) -> JSONResponse:
            """Pooled final hidden states of each input."""
            return _json(await embedding.create(req, raw))

    @app.post("/tokenize", response_model=TokenizeResponse, responses=MODEL_RESPONSES)
    async def tokenize(req: TokenizeRequest) -> JSONResponse:
        return _json(base.tokenize(req))

    @app.post("/detokenize", response_model=DetokenizeResponse, responses=MODEL_RESPONSES)
    async def detokenize(req: DetokenizeRequest) -> JSONResponse:
        return _json(base.detokenize(req))

    @app.get("/tokenizer_info", response_model=TokenizerInfo, responses=ERRORS)
    async def tokenizer_info() -> JSONResponse:
        """The tokenizer's special tokens, chat template and folder (vLLM's route)."""
        return _json(base.tokenizer_info())


# ---- running ------------------------------------------------------------------------------
def bind_socket(host: str, port: int, listen: bool = True) -> socket.socket:
    """A TCP socket bound to host:port (port 0: a free one), listening unless told not to.

    ``run_server`` binds before the model loads (a taken port fails at once) and listens
    once the engine is ready: until then a connection is refused, so that a health probe
    fails fast instead of waiting on a server that cannot answer yet.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror}") from e
    if listen:
        sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def startup_banner(app: FastAPI, host: str, port: int) -> str:
    """The block printed at start: where to connect and what the engine can hold."""
    engine: AsyncLLMEngine = app.state.engine
    model: ServedModel = app.state.served_model
    config = engine.engine.config
    kv = engine.engine.kv_cache
    blocks, block_size = kv.num_blocks, kv.block_size
    per_request = kv.blocks_for(model.max_model_len)
    shown_host = f"[{host}]" if ":" in host else host
    url = f"http://{shown_host}:{port}"
    routes = "completions, chat/completions, responses, models"
    if app.state.pooler is not None:
        routes += ", embeddings"
    lines = [
        "pagedllm OpenAI-compatible server",
        f"  URL          {url}/v1   ({routes})",
        f"  model        {model.name}" + (f"  ({model.path})" if model.path != model.name else ""),
        f"  dtype        {config.model.dtype}",
        f"  device       {config.device.device}",
        f"  KV cache     {blocks} blocks x {block_size} tokens = {kv.num_slots} tokens",
        f"  concurrency  {blocks / per_request:.2f}x  (requests of max_model_len "
        f"{model.max_model_len} tokens the KV cache holds at once)",
        f"  metrics      {url}/metrics",
    ]
    width = max(len(line) for line in lines)
    rule = "=" * width
    return "\n".join([rule, *lines, rule])


def run_server(
    engine_args: EngineArgs,
    host: str = "127.0.0.1",
    port: int = 8000,
    uvicorn_log_level: str = "info",
    graceful_shutdown_timeout: float = 30.0,
    **app_options: Any,
) -> int:
    """Load the model, print the startup block and serve until stopped; app_options go to
    ``build_app``. Returns the exit status.

    Ctrl-C or SIGTERM stop accepting connections, let in-flight requests finish for up to
    ``graceful_shutdown_timeout`` seconds, then exit with 0. If the engine dies (its state is
    unknown after a failure), /health answers 503, requests are refused, and the server
    stops with 1 rather than serve wrong results.
    """
    sock = bind_socket(host, port, listen=False)
    died: list[BaseException] = []
    previous = _stop_on_sigterm()
    try:
        app = build_app(engine_args, **app_options)
        _freeze_startup_heap()
        sock.listen(2048)  # the engine is ready: from now on /health answers
        print(startup_banner(app, host, sock.getsockname()[1]), flush=True)
        config = uvicorn.Config(
            app, log_level=uvicorn_log_level, timeout_graceful_shutdown=graceful_shutdown_timeout
        )
        server = uvicorn.Server(config)

        def on_dead(error: BaseException) -> None:
            died.append(error)
            server.should_exit = True  # uvicorn polls it: drain, lifespan shutdown, return

        app.state.engine.on_dead = on_dead
        server.run(sockets=[sock])
    except KeyboardInterrupt:
        pass  # uvicorn has shut down gracefully and re-raised Ctrl-C / SIGTERM: a normal stop
    finally:
        sock.close()
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    if died:
        logger.critical("the engine died (%r); exiting with status 1", died[0])
        return 1
    return 0


def _freeze_startup_heap() -> None:
    """Move what start-up made (the model, the tokenizer, the app) out of the collector's
    generations, as vLLM's engine core does: a full collection no longer walks those ~190,000
    objects (on SmolLM2 they were 4.6% of a 48-row decode step's time, in gc_collect_main).
    Only in the server's own process (on the main thread): objects frozen there are never
    collected as cycles, which a process that makes and drops engines (tests) cannot afford."""
    if threading.current_thread() is threading.main_thread():
        gc.collect()
        gc.freeze()


def _stop_on_sigterm() -> Any:
    """Make SIGTERM stop the server as Ctrl-C does (uvicorn drains, then re-raises the signal
    once it is done; it then lands here); the previous handler, or None off the main thread."""
    if threading.current_thread() is not threading.main_thread():
        return None

    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    return signal.signal(signal.SIGTERM, interrupt)


@contextlib.contextmanager
def serve_in_thread(app: FastAPI, host: str = "127.0.0.1", port: int = 0) -> Iterator[str]:
    """Serve app from a background thread; yields the base URL, stops the server on exit."""
    sock = bind_socket(host, port)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2))
    thread = threading.Thread(
        target=server.run, kwargs={"sockets": [sock]}, name="pagedllm-http", daemon=True
    )
    thread.start()
    try:
        while not server.started:
            if not thread.is_alive():
                raise RuntimeError("the server thread ended during startup; see the log.")
            time.sleep(0.01)
        yield f"http://{host}:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()
