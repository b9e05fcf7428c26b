"""RequestGuard: the checks every HTTP request passes before routing.

An optional API key (``Authorization: Bearer KEY``, compared in constant time) on every path
but the open ones (``/health``, and ``/metrics`` when configured), and a limit on the request
body's size (HTTP 413). Both answer with the OpenAI-style error body the routes use.
A plain ASGI middleware rather than Starlette's BaseHTTPMiddleware, which would buffer
streamed responses and hide client disconnects from the routes.
"""

from __future__ import annotations

import hmac
from collections import deque
from collections.abc import Iterable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pagedllm.entrypoints.openai.serving import ServingError

# Default request-body limit: a max_model_len prompt as text or token ids is far below it.
DEFAULT_MAX_REQUEST_BYTES = 16 << 20


class RequestGuard:
    """ASGI middleware: API key, then body size; the route reads the body as buffered here.

    The body is read in full before the route runs (FastAPI reads it whole anyway), so that a
    chunked body without Content-Length is held to the limit too; later ``receive()`` calls
    (disconnect detection) go straight to the client.
    """

    def __init__(
        self,
        app: ASGIApp,
        api_key: str | None = None,
        open_paths: Iterable[str] = ("/health",),
        max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    ) -> None:
        if api_key is not None and not api_key:
            raise ValueError("api_key must not be empty.")
        if max_request_bytes < 1:
            raise ValueError(f"max_request_bytes must be >= 1, got {max_request_bytes}.")
        self.app = app
        self._key = None if api_key is None else api_key.encode()
        self.open_paths = frozenset(open_paths)
        self.max_request_bytes = max_request_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])  # lower-case names; a repeated header keeps its last
        if self._key is not None and scope["path"] not in self.open_paths:
            scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self._key):
                error = ServingError(
                    "Missing or incorrect API key: send 'Authorization: Bearer <key>'.",
                    status=401,
                    code="invalid_api_key",
                )
                await send_error(send, error, [(b"www-authenticate", b"Bearer")])
                return
        declared = headers.get(b"content-length", b"0")
        too_large = not declared.isdigit() or int(declared) > self.max_request_bytes
        messages = None if too_large else await self._read_body(receive)
        if messages is None:
            limit = self.max_request_bytes
            error = ServingError(
                f"the request body is larger than the server's limit of {limit} bytes.",
                status=413,
                code="request_too_large",
            )
            await send_error(send, error, [(b"connection", b"close")])
            return
        await self.app(scope, _replay(messages, receive), send)

    async def _read_body(self, receive: Receive) -> list[Message] | None:
        """The messages of the body, or None once it passes the limit."""
        messages, size = [], 0
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                return messages  # a disconnect: the route sees it
            size += len(message.get("body", b""))
            if size > self.max_request_bytes:
                return None
            if not message.get("more_body", False):
                return messages


def _replay(messages: list[Message], receive: Receive) -> Receive:
    pending = deque(messages)

    async def replay() -> Message:
        return pending.popleft() if pending else await receive()

    return replay


async def send_error(send: Send, error: ServingError, headers: list[tuple[bytes, bytes]]) -> None:
    body = error.to_response().model_dump_json().encode()
    start = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": error.status, "headers": start + headers})
    await send({"type": "http.response.body", "body": body})
