"""Device, link and per-layer timing profiles: the partitioner's inputs (torch-free).

Measured by pagedllm.partition.profiler, or written by hand as JSON.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class DeviceProfile:
    name: str
    flops: dict[str, float]  # dtype name -> FLOP/s of a large matmul
    mem_bandwidth: float  # bytes/s of a streaming copy
    mem_capacity: int  # bytes the tier may use
    op_overhead_s: float = 0.0  # dispatch cost of one small op (a layer's time floor)
    threads: int | None = None  # torch threads the probes ran with

    def flops_for(self, dtype: str) -> float:
        if dtype in self.flops:
            return self.flops[dtype]
        return self.flops.get("float32") or max(self.flops.values())

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(asdict(self), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> DeviceProfile:
        try:
            return cls(**json.loads(Path(path).read_text()))
        except (OSError, TypeError, json.JSONDecodeError) as e:
            raise ValueError(f"cannot read device profile {str(path)!r}: {e}") from e


@dataclass(frozen=True)
class LinkProfile:
    bandwidth_mbps: float  # megabits per second, each direction
    rtt_ms: float  # round-trip latency
    overhead_ms: float = 0.0  # software cost of one exchange (encode, RPC, decode)

    @property
    def bytes_per_s(self) -> float:
        return self.bandwidth_mbps * 1e6 / 8

    def transfer_s(self, num_bytes: float) -> float:
        return num_bytes / self.bytes_per_s

    @classmethod
    def parse(cls, text: str) -> LinkProfile:
        """A JSON file, or "100mbit,20ms[,0.5ms]" (bandwidth, RTT, optional overhead)."""
        if Path(text).is_file():
            try:
                return cls(**json.loads(Path(text).read_text()))
            except (TypeError, json.JSONDecodeError) as e:
                raise ValueError(f"cannot read link profile {text!r}: {e}") from e
        rates = {"kbit": 1e-3, "mbit": 1.0, "gbit": 1e3}
        times = {"us": 1e-3, "ms": 1.0, "s": 1e3}
        bandwidth, delays = None, []
        for part in text.lower().replace("/s", "").split(","):
            m = re.fullmatch(r"\s*([0-9.]+)\s*([a-z]+)\s*", part)
            if m and m.group(2) in rates:
                bandwidth = float(m.group(1)) * rates[m.group(2)]
            elif m and m.group(2) in times:
                delays.append(float(m.group(1)) * times[m.group(2)])
            else:
                raise ValueError(f"cannot read link part {part!r} (e.g. 100mbit,20ms).")
        if bandwidth is None or not delays or len(delays) > 2:
            raise ValueError(
                f"a link is 'BANDWIDTH,RTT[,OVERHEAD]', e.g. 100mbit,20ms; got {text!r}."
            )
        return cls(bandwidth, delays[0], delays[1] if len(delays) > 1 else 0.0)


@dataclass(frozen=True)
class LayerTimings:
    """Measured seconds per graph node (embed, layer.0 .., head) on one device."""

    device: str  # the DeviceProfile name these apply to
    batch_size: int
    context_len: int
    prompt_len: int
    decode_s: tuple[float, ...]  # per node, one decode step of batch_size sequences
    prefill_s: tuple[float, ...]  # per node, one prompt of prompt_len tokens
    engine_s: float  # per decode step: the engine around the runner (first tier only)
    prepare_s: float  # per decode step: building the batch tensors (every tier)
    sample_s: float  # per decode step: sampling after the logits (the last tier)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(asdict(self), indent=2) + "\n")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LayerTimings:
        data = {**data, "decode_s": tuple(data["decode_s"]), "prefill_s": tuple(data["prefill_s"])}
        return cls(**data)

    @classmethod
    def load(cls, path: str | Path) -> LayerTimings:
        return cls.from_dict(json.loads(Path(path).read_text()))
