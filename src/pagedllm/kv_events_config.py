"""KVEventsConfig: the frozen form of EngineArgs.kv_events_config (vLLM's JSON and names).

``{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557",
"replay_endpoint": "tcp://*:5558", "topic": "kv-events"}`` publishes the block manager's
cache changes as vLLM does; see metrics/kv_events.py for the wire format.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from pagedllm.json_config import config_dict

PUBLISHERS = ("null", "zmq")


@dataclass(frozen=True)
class KVEventsConfig:
    enable_kv_cache_events: bool = False
    publisher: str = "zmq"  # "zmq": a PUB socket; "null": events off
    endpoint: str = "tcp://*:5557"  # PUB address; "*" (or ipc://, inproc://) binds, else connects
    replay_endpoint: str | None = None  # ROUTER address serving buffered batches from a seq
    buffer_steps: int = 10_000  # batches kept for replay
    hwm: int = 100_000  # the PUB socket's send high-water mark
    max_queue_size: int = 100_000  # batches waiting for the publisher thread
    topic: str = ""  # first frame of every message

    @property
    def enabled(self) -> bool:
        return self.enable_kv_cache_events and self.publisher != "null"


_TYPES: dict[str, tuple[type, ...]] = {
    "enable_kv_cache_events": (bool,),
    "publisher": (str,),
    "endpoint": (str,),
    "replay_endpoint": (str, type(None)),
    "buffer_steps": (int,),
    "hwm": (int,),
    "max_queue_size": (int,),
    "topic": (str,),
}


def parse_kv_events_config(raw: dict[str, Any] | str | None) -> KVEventsConfig | None:
    """Validate the user's dict (or its JSON text); None when events are off. ValueError
    names the bad field."""
    known = {f.name for f in fields(KVEventsConfig)}
    raw = config_dict(raw, "kv_events_config", known)
    if raw is None:
        return None
    for name, value in raw.items():
        wanted = _TYPES[name]
        if not isinstance(value, wanted) or (isinstance(value, bool) and bool not in wanted):
            names = " or ".join("null" if t is type(None) else t.__name__ for t in wanted)
            raise ValueError(f"kv_events_config.{name} must be {names}, got {value!r}.")
    config = KVEventsConfig(**raw)
    if config.publisher not in PUBLISHERS:
        raise ValueError(
            f"kv_events_config.publisher must be one of {PUBLISHERS}, got {config.publisher!r}."
        )
    for name in ("buffer_steps", "hwm", "max_queue_size"):
        if getattr(config, name) <= 0:
            raise ValueError(f"kv_events_config.{name} must be positive.")
    return config if config.enabled else None
