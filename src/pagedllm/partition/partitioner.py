"""GraphPartitioner: where to cut a model across a chain of tiers (device -> edge -> cloud).

Every placement (one cut between each pair of neighbouring tiers, each tier at least one
decoder layer) is costed and the best one that meets the constraints is chosen:

- a node's time on a device is a roofline, max(FLOPs / FLOP/s, bytes / bandwidth), plus a
  per-op dispatch floor; where the graph carries timings measured on that device they are
  used instead, scaled by the roofline's ratio when the batch or context differs;
- a link costs its RTT, the bytes over its bandwidth and a software overhead per exchange;
- one decode step runs the tiers in turn, so the per-token latency is the sum of the tiers
  and links, and tokens/s is batch / that sum; ``pipelined_tokens_per_s`` is batch / the
  slowest stage, the bound when tiers work on different steps at once;
- each tier idles while the others and the links work, and a core that sat idle runs its
  next step slower (clock, caches, a descheduled virtual CPU, sleeping worker threads): a
  tier's measured ``wake_s`` (step cost after idle gaps) adds the extra for its idle time.

Strategies: ``latency_aware`` minimises the per-token decode latency; ``throughput_aware``
maximises the pipelined tokens/s. Constraints: ``max_edge_latency`` (ms per token, end to
end, as the edge's clients see it), ``min_cloud_throughput`` (tokens/s the last tier
sustains: batch / its share of a step) and ``max_edge_memory`` (bytes on the first tier).
Every tier's memory must also fit its device's capacity.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from pagedllm.partition.graph import GraphNode, ModelGraph
from pagedllm.partition.plan import (
    ConstraintCheck,
    CutEstimate,
    LinkEstimate,
    PartitionPlan,
    TierEstimate,
    wire_bytes_per_token,
)
from pagedllm.partition.profiles import DeviceProfile, LinkProfile, TimingModel

STRATEGIES = ("latency_aware", "throughput_aware")
CONSTRAINTS = ("max_edge_latency", "min_cloud_throughput", "max_edge_memory")
REPLY_BYTES_PER_TOKEN = 16  # sampled token id and its framing, back over the link
LAYOUT_BYTES_PER_SEQ = 96  # per sequence per step: ids, positions, block table entries


class Work(NamedTuple):
    """What one call of a node processes."""

    tokens: int  # query tokens
    pairs: int  # (query, key) pairs attended
    samples: int  # tokens whose logits are computed
    kv_tokens: int  # cached tokens whose K/V are read or written


def decode_work(batch: int, context: int) -> Work:
    return Work(batch, batch * context, batch, batch * context)


def prefill_work(prompt: int) -> Work:
    return Work(prompt, prompt * (prompt + 1) // 2, 1, prompt)


def _roofline(node: GraphNode, dev: DeviceProfile, dtype: str, work: Work) -> float:
    """Seconds of node on dev for work."""
    flops = (
        work.tokens * node.flops_per_token
        + work.pairs * node.attn_flops_per_pair
        + work.samples * node.flops_per_sample
    )
    moved = node.streamed_bytes + work.tokens * node.read_bytes_per_token
    moved += work.kv_tokens * node.kv_bytes_per_token
    compute = max(flops / dev.flops_for(dtype), moved / dev.mem_bandwidth)
    return compute + node.num_ops * dev.op_overhead_s


class CostModel:
    """Predicted seconds of graph nodes and links for one batch/context/prompt setting."""

    def __init__(self, graph: ModelGraph, batch: int, context: int, prompt: int) -> None:
        self.graph = graph
        self.batch, self.context, self.prompt = batch, context, prompt
        self.decode_work = decode_work(batch, context)
        self.prefill_work = prefill_work(prompt)
        self._fits: dict[str, TimingModel | None] = {}

    def _fitted(self, dev: DeviceProfile) -> TimingModel | None:
        if dev.name not in self._fits:
            timings = self.graph.measured.get(dev.name)
            self._fits[dev.name] = timings.fitted() if timings is not None else None
        return self._fits[dev.name]

    def _scaled(self, i: int, dev: DeviceProfile, decode: bool) -> float:
        fit = self._fitted(dev)
        if fit is not None:
            if decode:
                return fit.decode_s(i, self.batch, self.context)
            return fit.prefill_s(i, self.prompt)
        node = self.graph.nodes[i]
        work = self.decode_work if decode else self.prefill_work
        predicted = _roofline(node, dev, self.graph.dtype, work)
        timings = self.graph.measured.get(dev.name)
        if timings is None:
            return predicted
        if decode:
            at = decode_work(timings.batch_size, timings.context_len)
            measured = timings.decode_s[i]
        else:
            at, measured = prefill_work(timings.prompt_len), timings.prefill_s[i]
        reference = _roofline(node, dev, self.graph.dtype, at)
        return measured * predicted / reference if reference > 0 else measured

    def tier_decode_s(self, nodes: list[int], dev: DeviceProfile, first: bool, last: bool) -> float:
        total = sum(self._scaled(i, dev, True) for i in nodes)
        fit = self._fitted(dev)
        timings = self.graph.measured.get(dev.name)
        if fit is not None:  # the parts of a step outside the model
            total += fit.linear(fit.prepare, self.batch)
            total += fit.linear(fit.engine, self.batch) if first else 0.0
            total += fit.linear(fit.sample, self.batch) if last else 0.0
        elif timings is not None:
            scale = self.batch / timings.batch_size
            total += timings.prepare_s + (timings.engine_s if first else 0.0)
            total += timings.sample_s * scale if last else 0.0
        return total

    def wake_s(self, dev: DeviceProfile, idle_s: float) -> float:
        """Extra seconds of a decode step on dev after idle_s of idling (0 unmeasured)."""
        timings = self.graph.measured.get(dev.name)
        return timings.wake_penalty_s(idle_s) if timings is not None else 0.0

    def tier_prefill_s(self, nodes: list[int], dev: DeviceProfile) -> float:
        return sum(self._scaled(i, dev, False) for i in nodes)

    def tier_memory(self, nodes: list[int]) -> int:
        kv_tokens = self.batch * max(self.context, self.prompt)
        return sum(
            self.graph.nodes[i].weight_bytes + kv_tokens * self.graph.nodes[i].kv_bytes_per_token
            for i in nodes
        )

    def link(self, link: LinkProfile, wire_dtype: str) -> tuple[LinkEstimate, float]:
        """The link's estimate and its pipelined stage time (transfer only, no RTT)."""
        up = wire_bytes_per_token(self.graph.hidden_size, wire_dtype)
        per_token = up + REPLY_BYTES_PER_TOKEN + LAYOUT_BYTES_PER_SEQ
        transfer = link.transfer_s(self.batch * per_token)
        fixed = (link.rtt_ms + link.overhead_ms) / 1e3
        prefill = fixed + link.transfer_s(self.prompt * up + LAYOUT_BYTES_PER_SEQ)
        estimate = LinkEstimate(
            bytes_per_token=per_token,
            decode_ms=(fixed + transfer) * 1e3,
            prefill_ms_per_token=prefill * 1e3 / self.prompt,
        )
        return estimate, transfer


DEFAULT_LINK = LinkProfile(bandwidth_mbps=100.0, rtt_ms=20.0)


class GraphPartitioner:
    def __init__(
        self,
        strategy: str = "latency_aware",
        constraints: Mapping[str, float] | None = None,
        batch_size: int = 1,
        context_len: int = 512,
        prompt_len: int = 128,
        wire_dtype: str = "bfloat16",
        margin: float = 0.05,
        previous: Sequence[int] | None = None,
    ) -> None:
        """margin: candidates whose objective is within this fraction of the best are
        treated as tied (profiles of one machine differ by a few percent between runs);
        among tied ones the previous plan's cuts are kept if given, else the placement with
        the fewest layers on the first tiers. previous: the cuts of the plan in use."""
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}.")
        constraints = dict(constraints or {})
        unknown = set(constraints) - set(CONSTRAINTS)
        if unknown:
            raise ValueError(
                f"unknown constraint(s) {sorted(unknown)}; known: {', '.join(CONSTRAINTS)}."
            )
        for name, value in constraints.items():
            if not isinstance(value, int | float) or value <= 0:
                raise ValueError(f"constraint {name} must be a positive number, got {value!r}.")
        for name, value in (("batch_size", batch_size), ("context_len", context_len)):
            if value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}.")
        wire_bytes_per_token(1, wire_dtype)  # validates the name
        self.strategy = strategy
        self.constraints = constraints
        self.batch_size, self.context_len, self.prompt_len = batch_size, context_len, prompt_len
        self.wire_dtype = wire_dtype
        if not 0 <= margin < 1:
            raise ValueError(f"margin must be in [0, 1), got {margin!r}.")
        self.margin = margin
        self.previous = tuple(previous) if previous is not None else None

    def analyze(
        self,
        model_graph: ModelGraph,
        device_profiles: Sequence[DeviceProfile] | Mapping[str, DeviceProfile],
        link: LinkProfile | Sequence[LinkProfile] | None = None,
        *,
        cuts: Sequence[int] | None = None,
    ) -> PartitionPlan:
        """Cost every placement on the chain of devices (first = edge, last = cloud) and
        choose one; with cuts, cost and report that placement only. Without a link, every
        hop is taken as DEFAULT_LINK (a typical edge uplink)."""
        link = DEFAULT_LINK if link is None else link
        devices = list(
            device_profiles.values() if isinstance(device_profiles, Mapping) else device_profiles
        )
        links = [link] * (len(devices) - 1) if isinstance(link, LinkProfile) else list(link)
        if len(devices) < 2 or len(links) != len(devices) - 1:
            raise ValueError("give two or more device profiles and one link between each pair.")
        if model_graph.num_layers < len(devices):
            raise ValueError(
                f"{model_graph.num_layers} layers cannot give each of {len(devices)} tiers one."
            )
        cost = CostModel(model_graph, self.batch_size, self.context_len, self.prompt_len)
        cut_sets = itertools.combinations(range(1, model_graph.num_layers), len(devices) - 1)
        if cuts is not None:
            if len(cuts) != len(devices) - 1 or list(cuts) != sorted(set(cuts)):
                raise ValueError(f"cuts must be {len(devices) - 1} increasing layer indices.")
            if not 0 < cuts[0] <= cuts[-1] < model_graph.num_layers:
                raise ValueError(f"cuts must lie in [1, {model_graph.num_layers - 1}].")
            cut_sets = iter([tuple(cuts)])
        candidates = tuple(self.estimate(cost, devices, links, cuts) for cuts in cut_sets)
        feasible = [c for c in candidates if c.feasible]
        if feasible:
            chosen, message = self._choose(feasible), ""
        else:
            chosen, message = _closest(candidates), _why_infeasible(candidates)
        return PartitionPlan(
            model=model_graph.name,
            num_layers=model_graph.num_layers,
            hidden_size=model_graph.hidden_size,
            strategy=self.strategy,
            batch_size=self.batch_size,
            context_len=self.context_len,
            prompt_len=self.prompt_len,
            wire_dtype=self.wire_dtype,
            chosen=chosen,
            feasible=bool(feasible),
            message=message,
            candidates=candidates,
            margin=self.margin,
            basis=self.basis(model_graph, devices, links),
        )

    def basis(
        self, graph: ModelGraph, devices: Sequence[DeviceProfile], links: Sequence[LinkProfile]
    ) -> dict[str, Any]:
        """What a plan is computed from, for planning again later (adapt.Replanner)."""
        settings = {
            "strategy": self.strategy,
            "constraints": self.constraints,
            "batch_size": self.batch_size,
            "context_len": self.context_len,
            "prompt_len": self.prompt_len,
            "wire_dtype": self.wire_dtype,
            "margin": self.margin,
        }
        return {
            "settings": settings,
            "graph": graph.to_dict(),
            "devices": [dataclasses.asdict(d) for d in devices],
            "links": [dataclasses.asdict(lp) for lp in links],
        }

    def _score(self, c: CutEstimate) -> float:
        """The strategy's figure to minimise (ms per token, or s per token pipelined)."""
        if self.strategy == "latency_aware":
            return c.decode_latency_ms
        return 1.0 / c.pipelined_tokens_per_s

    def tied(self, candidates: Sequence[CutEstimate]) -> list[CutEstimate]:
        """The candidates within the margin of the best score."""
        best = min(self._score(c) for c in candidates)
        return [c for c in candidates if self._score(c) <= best * (1 + self.margin)]

    def _choose(self, feasible: list[CutEstimate]) -> CutEstimate:
        tied = self.tied(feasible)
        for c in tied:
            if c.cuts == self.previous:
                return c
        return min(tied, key=lambda c: c.cuts)

    def estimate(
        self,
        cost: CostModel,
        devices: list[DeviceProfile],
        links: list[LinkProfile],
        cuts: tuple[int, ...],
    ) -> CutEstimate:
        """The predicted cost of one placement."""
        bounds = (0, *cuts, cost.graph.num_layers)
        tiers, stages, memory = [], [], []
        for t, dev in enumerate(devices):
            nodes = cost.graph.tier_nodes(bounds[t], bounds[t + 1])
            decode = cost.tier_decode_s(nodes, dev, t == 0, t == len(devices) - 1)
            prefill = cost.tier_prefill_s(nodes, dev)
            memory.append(cost.tier_memory(nodes))
            stages.append(decode)
            tiers.append(
                TierEstimate(
                    dev.name,
                    (bounds[t], bounds[t + 1]),
                    decode * 1e3,
                    prefill * 1e3 / cost.prompt,
                    memory[-1],
                )
            )
        link_estimates = []
        for lp in links:
            estimate, transfer = cost.link(lp, self.wire_dtype)
            link_estimates.append(estimate)
            stages.append(transfer)
        step_ms = sum(t.decode_ms for t in tiers) + sum(e.decode_ms for e in link_estimates)
        # Run one step at a time, each tier idles while the others and the links work; a
        # tier's profile says what a step costs after such a pause (wake_s).
        wake_ms = [cost.wake_s(dev, (step_ms - t.decode_ms) / 1e3) * 1e3 for dev, t in
                   zip(devices, tiers)]  # fmt: skip
        tiers = [dataclasses.replace(t, decode_ms=t.decode_ms + w) for t, w in zip(tiers, wake_ms)]
        step_ms += sum(wake_ms)
        prefill_ms = sum(t.prefill_ms_per_token for t in tiers)
        prefill_ms += sum(e.prefill_ms_per_token for e in link_estimates)
        batch = cost.batch
        estimate = CutEstimate(
            cuts=cuts,
            tiers=tuple(tiers),
            links=tuple(link_estimates),
            decode_latency_ms=step_ms,
            prefill_ms_per_token=prefill_ms,
            tokens_per_s=batch * 1e3 / step_ms,
            pipelined_tokens_per_s=batch / max(stages),
            cloud_tokens_per_s=batch * 1e3 / tiers[-1].decode_ms,
            checks=(),
        )
        return dataclasses.replace(estimate, checks=self._checks(estimate, devices, memory))

    def _checks(
        self, c: CutEstimate, devices: list[DeviceProfile], memory: list[int]
    ) -> tuple[ConstraintCheck, ...]:
        k = self.constraints
        checks = []
        if "max_edge_latency" in k:
            checks.append(
                ConstraintCheck(
                    "max_edge_latency", k["max_edge_latency"], c.decode_latency_ms, "ms", True
                )
            )
        if "min_cloud_throughput" in k:
            checks.append(
                ConstraintCheck(
                    "min_cloud_throughput",
                    k["min_cloud_throughput"],
                    c.cloud_tokens_per_s,
                    "tok/s",
                    False,
                )
            )
        mib = float(1 << 20)
        if "max_edge_memory" in k:
            limit = k["max_edge_memory"] / mib
            checks.append(ConstraintCheck("max_edge_memory", limit, memory[0] / mib, "MiB", True))
        for dev, used in zip(devices, memory):
            checks.append(
                ConstraintCheck(
                    f"memory[{dev.name}]", dev.mem_capacity / mib, used / mib, "MiB", True
                )
            )
        return tuple(checks)


def _relative_shortfall(c: CutEstimate) -> float:
    return sum(k.shortfall / k.limit for k in c.checks)


def _closest(candidates: tuple[CutEstimate, ...]) -> CutEstimate:
    return min(candidates, key=_relative_shortfall)


def _why_infeasible(candidates: tuple[CutEstimate, ...]) -> str:
    """Which constraint fails and by how much: alone at its best cut, or only together."""
    reasons = []
    for j, check in enumerate(candidates[0].checks):
        best = min(candidates, key=lambda c: c.checks[j].shortfall)
        if not best.checks[j].holds:
            reasons.append(
                f"{check.name} fails at every cut; at its best (cut {_cut_text(best.cuts)}) "
                + best.checks[j].describe().split(": ", 1)[1]
            )
    if reasons:
        return "; ".join(reasons)
    closest = _closest(candidates)
    failing = "; ".join(k.describe() for k in closest.checks if not k.holds)
    where = ", ".join(
        f"{check.name} at {_where(candidates, j)}"
        for j, check in enumerate(candidates[0].checks)
        if not all(c.checks[j].holds for c in candidates)
    )
    return (
        f"each constraint holds at some cut but no cut meets them all ({where} only); "
        f"the closest (cut {_cut_text(closest.cuts)}): {failing}"
    )


def _where(candidates: tuple[CutEstimate, ...], j: int) -> str:
    """The cuts where check j holds: "cuts 1-3" for one cut per plan, else a count."""
    holding = [c.cuts for c in candidates if c.checks[j].holds]
    if len(candidates[0].cuts) > 1:
        return f"{len(holding)} of {len(candidates)} placements"
    ks = [cuts[0] for cuts in holding]
    if ks == list(range(ks[0], ks[-1] + 1)):
        return f"cut {ks[0]}" if len(ks) == 1 else f"cuts {ks[0]}-{ks[-1]}"
    return "cuts " + ", ".join(map(str, ks))


def _cut_text(cuts: tuple[int, ...]) -> str:
    return ", ".join(str(k) for k in cuts)
