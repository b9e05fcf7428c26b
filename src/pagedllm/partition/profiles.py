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
class DecodePoint:
    """One measured decode setting: seconds per graph node and outside the model."""

    batch: int
    context: int
    nodes: tuple[float, ...]  # per node (embed, layer.0 .., head), one step
    prepare: float  # building the batch tensors
    sample: float  # sampling after the logits
    engine: float  # the engine around the runner


@dataclass(frozen=True)
class PrefillPoint:
    prompt: int
    nodes: tuple[float, ...]  # per node, one prompt of this length


@dataclass(frozen=True)
class LayerTimings:
    """Measured seconds per graph node (embed, layer.0 .., head) on one device.

    The scalar fields are the reference setting (batch_size, context_len, prompt_len);
    ``decode_points`` / ``prefill_points`` are the short profile's several settings, from
    which ``fitted()`` gives a per-node model in batch, context and prompt length.
    """

    device: str  # the DeviceProfile name these apply to
    batch_size: int
    context_len: int
    prompt_len: int
    decode_s: tuple[float, ...]  # per node, one decode step of batch_size sequences
    prefill_s: tuple[float, ...]  # per node, one prompt of prompt_len tokens
    engine_s: float  # per decode step: the engine around the runner (first tier only)
    prepare_s: float  # per decode step: building the batch tensors (every tier)
    sample_s: float  # per decode step: sampling after the logits (the last tier)
    threads: int | None = None  # torch threads the timings were taken with
    decode_points: tuple[DecodePoint, ...] = ()
    prefill_points: tuple[PrefillPoint, ...] = ()
    # (seconds idle before a decode step, its extra seconds over a back-to-back step): in a
    # split each tier idles while the others and the link work, and a core that sat idle
    # (frequency, caches, a virtual CPU descheduled) runs the next step slower.
    wake_s: tuple[tuple[float, float], ...] = ()

    def wake_penalty_s(self, idle_s: float) -> float:
        """Extra seconds of a decode step after idle_s of idling: linear between the
        measured gaps (and zero idle, zero extra), the last gap's figure beyond it."""
        points = [(0.0, 0.0), *sorted(self.wake_s)]
        if len(points) == 1 or idle_s <= 0:
            return 0.0
        for (g0, e0), (g1, e1) in zip(points, points[1:]):
            if idle_s <= g1:
                return e0 + (e1 - e0) * (idle_s - g0) / (g1 - g0) if g1 > g0 else e1
        return points[-1][1]

    def fitted(self) -> TimingModel | None:
        """The least-squares model over the points (None with too few distinct settings)."""
        return TimingModel.fit(self) if len(self.decode_points) >= 3 else None

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(asdict(self), indent=2) + "\n")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LayerTimings:
        data = {**data, "decode_s": tuple(data["decode_s"]), "prefill_s": tuple(data["prefill_s"])}
        data["decode_points"] = tuple(
            DecodePoint(**{**p, "nodes": tuple(p["nodes"])}) for p in data.get("decode_points", ())
        )
        data["prefill_points"] = tuple(
            PrefillPoint(p["prompt"], tuple(p["nodes"])) for p in data.get("prefill_points", ())
        )
        data["wake_s"] = tuple(tuple(p) for p in data.get("wake_s", ()))
        return cls(**data)

    @classmethod
    def load(cls, path: str | Path) -> LayerTimings:
        try:
            return cls.from_dict(json.loads(Path(path).read_text()))
        except (OSError, KeyError, TypeError, json.JSONDecodeError) as e:
            raise ValueError(f"cannot read layer timings {str(path)!r}: {e}") from e


def _lstsq(rows: list[list[float]], y: list[float]) -> tuple[float, ...]:
    """Non-negative least squares by elimination: a column whose coefficient comes out
    negative (noise on a term too small to see) is dropped and the rest refitted."""
    import numpy as np

    a, b = np.asarray(rows, dtype=float), np.asarray(y, dtype=float)
    keep = list(range(a.shape[1]))
    while keep:
        coef, *_ = np.linalg.lstsq(a[:, keep], b, rcond=None)
        if (coef >= 0).all():
            out = [0.0] * a.shape[1]
            for j, c in zip(keep, coef):
                out[j] = float(c)
            return tuple(out)
        keep.pop(int(np.argmin(coef)))
    return (0.0,) * a.shape[1]


@dataclass(frozen=True)
class TimingModel:
    """Per node: decode seconds = c0 + c1 * batch + c2 * batch * context (a fixed cost,
    the per-token matmuls, attention over the cache); prefill seconds = p0 + p1 * prompt +
    p2 * prompt^2. Outside the model, prepare / sample / engine = a + b * batch."""

    decode: tuple[tuple[float, float, float], ...]
    prefill: tuple[tuple[float, float, float], ...]
    prepare: tuple[float, float]
    sample: tuple[float, float]
    engine: tuple[float, float]

    @classmethod
    def fit(cls, t: LayerTimings) -> TimingModel:
        pts = t.decode_points
        rows = [[1.0, p.batch, p.batch * p.context] for p in pts]
        decode = tuple(_lstsq(rows, [p.nodes[i] for p in pts]) for i in range(len(pts[0].nodes)))
        pre = t.prefill_points
        if len({p.prompt for p in pre}) >= 3:
            prows = [[1.0, p.prompt, p.prompt**2] for p in pre]
            prefill = tuple(
                _lstsq(prows, [p.nodes[i] for p in pre]) for i in range(len(pre[0].nodes))
            )
        else:  # one prompt length: proportional to it
            prefill = tuple((0.0, s / t.prompt_len, 0.0) for s in t.prefill_s)
        brows = [[1.0, p.batch] for p in pts]

        def two(name: str) -> tuple[float, float]:
            c = _lstsq(brows, [getattr(p, name) for p in pts])
            return c[0], c[1]

        return cls(decode, prefill, two("prepare"), two("sample"), two("engine"))

    def decode_s(self, node: int, batch: int, context: int) -> float:
        c0, c1, c2 = self.decode[node]
        return c0 + c1 * batch + c2 * batch * context

    def prefill_s(self, node: int, prompt: int) -> float:
        p0, p1, p2 = self.prefill[node]
        return p0 + p1 * prompt + p2 * prompt * prompt

    @staticmethod
    def linear(coef: tuple[float, float], batch: int) -> float:
        return coef[0] + coef[1] * batch
