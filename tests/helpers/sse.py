"""A parser of server-sent event streams, as the OpenAI-compatible server frames them."""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any


def sse_events(stream: str | Iterable[str]) -> list[Any]:
    """The complete events of a stream: a whole body, or its lines (httpx's ``iter_lines``).

    Each event is one or more ``data:`` lines ended by a blank line; its data is decoded as
    JSON, except the final ``[DONE]``. As the SSE specification says, an event that is not
    ended by a blank line (a stream cut short) is not an event, so a body missing its last
    blank line loses its last event. A field other than ``data`` fails the assertion: the
    server sends no other.
    """
    lines = stream.split("\n") if isinstance(stream, str) else stream
    events: list[Any] = []
    data: list[str] = []
    for line in lines:
        line = line.removesuffix("\r")
        if not line:
            if data:
                body = "\n".join(data)
                events.append(body if body == "[DONE]" else json.loads(body))
                data = []
            continue
        if line.startswith(":"):
            continue  # a comment line (keep-alive)
        name, _, value = line.partition(":")
        assert name == "data", f"unexpected SSE field in {line!r}"
        data.append(value.removeprefix(" "))
    return events
