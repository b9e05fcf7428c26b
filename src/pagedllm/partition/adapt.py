"""Adaptation: what the split runtime measures while it runs, and re-planning from it.

Each step the edge records its own compute time, the time from sending the step to its
reply, and the tiers' compute time the reply reports; the link's share is the round trip
minus the remote compute. ``LinkMonitor.snapshot()`` gives medians over a recent window,
so one preempted step moves nothing. ``Replanner`` feeds those figures to the partitioner:
each tier's measured step time rescales that device's timings (the profile's shape, the
running machine's level), the measured round trip replaces the link's RTT, and the plan in
use is kept unless another cut beats it by more than the margin (hysteresis), and a plan
is made only from a full window of steps measured at the cut in use.

A re-plan that moves the cut is carried out by the running split (runtime.SplitExecutor):
between two steps the engine recomputes its running sequences, both tiers load the layers
of the new cut and start a new session on the same KV block ids.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from pagedllm.partition.graph import ModelGraph
from pagedllm.partition.partitioner import GraphPartitioner
from pagedllm.partition.plan import PartitionPlan
from pagedllm.partition.profiles import DeviceProfile, LayerTimings, LinkProfile


@dataclass(frozen=True)
class LinkSnapshot:
    steps: int  # steps the medians are over
    edge_ms: float  # the edge's compute per step
    remote_ms: float  # the later tiers' compute per step, as they report it
    link_ms: float  # round trip minus remote compute: RTT + transfer + transport overhead
    bytes_per_step: float  # both directions


class LinkMonitor:
    """Per-step figures of a running split, over the last ``window`` steps."""

    def __init__(self, window: int = 16) -> None:
        self.window = window
        self._rows: deque[tuple[float, float, float, float]] = deque(maxlen=window)
        self._sent: deque[tuple[float, float, float]] = deque()

    def sent(self, edge_s: float, nbytes: int) -> None:
        self._sent.append((time.perf_counter(), edge_s, nbytes))

    def received(self, remote_ms: float, nbytes: int) -> None:
        if not self._sent:
            return
        at, edge_s, sent_bytes = self._sent.popleft()
        round_trip = (time.perf_counter() - at) * 1e3
        self._rows.append((edge_s * 1e3, remote_ms, round_trip - remote_ms, sent_bytes + nbytes))

    def reset(self) -> None:
        """A new session: steps in flight on the old one are not coming back."""
        self._sent.clear()

    def snapshot(self) -> LinkSnapshot | None:
        if not self._rows:
            return None
        cols = list(zip(*self._rows))
        return LinkSnapshot(len(self._rows), *(statistics.median(c) for c in cols))


def _rescaled(timings: LayerTimings, factor: float) -> LayerTimings:
    """Timings of the same shape at another level (a busier or idler machine)."""

    def scale(values: Sequence[float]) -> tuple[float, ...]:
        return tuple(v * factor for v in values)

    return dataclasses.replace(
        timings,
        decode_s=scale(timings.decode_s),
        prefill_s=scale(timings.prefill_s),
        engine_s=timings.engine_s * factor,
        prepare_s=timings.prepare_s * factor,
        sample_s=timings.sample_s * factor,
        decode_points=tuple(
            dataclasses.replace(
                p,
                nodes=scale(p.nodes),
                prepare=p.prepare * factor,
                sample=p.sample * factor,
                engine=p.engine * factor,
            )
            for p in timings.decode_points
        ),
        prefill_points=tuple(
            dataclasses.replace(p, nodes=scale(p.nodes)) for p in timings.prefill_points
        ),
    )


class Replanner:
    """Re-plans a two-tier split from what the runtime measured, with hysteresis."""

    @classmethod
    def from_plan(cls, plan: PartitionPlan) -> Replanner:
        """A replanner from what the plan was computed from (its ``basis``)."""
        basis = plan.basis
        if not basis:
            raise ValueError(
                "the partition plan does not record what it was computed from; make it again "
                "with `pagedllm partition -o` to re-plan as the split runs."
            )
        devices = [DeviceProfile(**d) for d in basis["devices"]]
        if len(devices) != 2:
            raise ValueError(f"re-planning is for two tiers; this plan has {len(devices)}.")
        partitioner = GraphPartitioner(**basis["settings"])
        graph = ModelGraph.from_dict(basis["graph"])
        unmeasured = [d.name for d in devices if d.name not in graph.measured]
        if unmeasured:
            raise ValueError(
                f"the plan has no layer timings measured on {', '.join(unmeasured)}; "
                "re-planning rescales them (pagedllm profile-device --model)."
            )
        link = LinkProfile(**basis["links"][0])
        return cls(partitioner, graph, devices, link, plan.cuts)

    def __init__(
        self,
        partitioner: GraphPartitioner,
        graph: ModelGraph,
        devices: Sequence[DeviceProfile],
        link: LinkProfile,
        cuts: Sequence[int],
    ) -> None:
        self.partitioner, self.graph = partitioner, graph
        self.devices, self.link = list(devices), link
        self.cuts = tuple(cuts)
        self.moves = 0  # times the cut moved

    def replan(self, seen: LinkSnapshot) -> PartitionPlan:
        """The plan for what was measured; ``self.cuts`` follows it when it moves."""
        current = self.partitioner.analyze(self.graph, self.devices, self.link, cuts=self.cuts)
        tiers = current.chosen.tiers
        graph = self.graph
        for dev, tier, measured in zip(self.devices, tiers, (seen.edge_ms, seen.remote_ms)):
            timings = graph.measured.get(dev.name)
            if timings is not None and tier.decode_ms > 0:
                graph = graph.with_timings(_rescaled(timings, measured / tier.decode_ms))
        # the measured link time holds the transfer the link profile adds back
        transfer_ms = self.link.transfer_s(seen.bytes_per_step) * 1e3
        rtt = max(0.0, seen.link_ms - transfer_ms)
        link = dataclasses.replace(self.link, rtt_ms=rtt, overhead_ms=0.0)
        self.partitioner.previous = self.cuts
        plan = self.partitioner.analyze(graph, self.devices, link)
        if plan.cuts != self.cuts:
            self.moves += 1
            self.cuts = plan.cuts
        return plan
