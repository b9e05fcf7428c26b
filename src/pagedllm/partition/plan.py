"""A partition plan: where the model is cut, what each tier and link is predicted to cost.

Torch-free, so that reading a plan (the split executor and the cloud worker do, to know
their layer range) never loads the model stack. ``cuts`` name decoder-layer indices: with
cuts (k1, k2) the first tier runs the embedding and layers [0, k1), the second [k1, k2),
the last [k2, L), the final norm and the LM head. Hidden states cross each link once per step.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from pagedllm.dtypes import DTYPE_BYTES


def wire_bytes_per_token(hidden_size: int, wire_dtype: str) -> int:
    """Bytes of one token's hidden state on the wire (int8 adds a float32 scale)."""
    if wire_dtype not in DTYPE_BYTES:
        raise ValueError(f"wire dtype must be one of {sorted(DTYPE_BYTES)}, got {wire_dtype!r}.")
    return hidden_size * DTYPE_BYTES[wire_dtype] + (4 if wire_dtype == "int8" else 0)


@dataclass(frozen=True)
class TierEstimate:
    device: str  # the DeviceProfile's name
    layers: tuple[int, int]  # decoder layers [start, end)
    decode_ms: float  # one decode step of the planned batch, including step overhead
    prefill_ms_per_token: float  # a prompt of the planned length, per token
    memory_bytes: int  # weights held plus the KV cache of the planned batch and context


@dataclass(frozen=True)
class LinkEstimate:
    bytes_per_token: float  # both directions, per generated token
    decode_ms: float  # one decode step of the planned batch: RTT + transfer + overhead
    prefill_ms_per_token: float


@dataclass(frozen=True)
class ConstraintCheck:
    name: str  # max_edge_latency | min_cloud_throughput | max_edge_memory | memory[tier]
    limit: float
    value: float  # the predicted value the limit is checked against
    unit: str
    upper: bool  # True: value must be <= limit; False: value must be >= limit

    @property
    def holds(self) -> bool:
        return self.value <= self.limit if self.upper else self.value >= self.limit

    @property
    def shortfall(self) -> float:
        """How far the value is on the wrong side of the limit (0 when it holds)."""
        return max(0.0, self.value - self.limit if self.upper else self.limit - self.value)

    def describe(self) -> str:
        if self.holds:
            return f"{self.name} holds: {self.value:.4g} {self.unit} (limit {self.limit:.4g})"
        side = "over" if self.upper else "under"
        pct = 100.0 * self.shortfall / self.limit if self.limit else float("inf")
        return (
            f"{self.name} fails: {self.value:.4g} {self.unit} is {self.shortfall:.4g} "
            f"{self.unit} {side} the limit of {self.limit:.4g} ({pct:.0f}%)"
        )


@dataclass(frozen=True)
class CutEstimate:
    """The predicted cost of one placement of the layers on the chain of tiers."""

    cuts: tuple[int, ...]
    tiers: tuple[TierEstimate, ...]
    links: tuple[LinkEstimate, ...]
    decode_latency_ms: float  # per generated token, end to end (one step, tiers in turn)
    prefill_ms_per_token: float  # end to end
    tokens_per_s: float  # batch / decode step time, tiers running one step at a time
    pipelined_tokens_per_s: float  # batch / slowest stage, tiers busy on different steps
    cloud_tokens_per_s: float  # batch / the last tier's share of a step
    checks: tuple[ConstraintCheck, ...]

    @property
    def feasible(self) -> bool:
        return all(c.holds for c in self.checks)


@dataclass(frozen=True)
class PartitionPlan:
    model: str
    num_layers: int
    hidden_size: int
    strategy: str  # latency_aware | throughput_aware
    batch_size: int  # the batch the estimates are for
    context_len: int  # tokens in context per sequence during decode
    prompt_len: int  # prompt length of the prefill estimate
    wire_dtype: str  # bfloat16 | float16 | float32 | int8
    chosen: CutEstimate
    feasible: bool
    message: str  # why no plan meets the constraints ("" when one does)
    candidates: tuple[CutEstimate, ...] = field(default=(), compare=False, repr=False)
    margin: float = 0.0  # scores within this fraction of the best are ties
    # What the plan was computed from (the partitioner's settings, the device and link
    # profiles, the measured layer timings), so that a running split can plan again from
    # what it measures (pagedllm.partition.adapt.Replanner.from_plan); None: not recorded.
    basis: dict[str, Any] | None = field(default=None, compare=False, repr=False)

    def why_not(self) -> list[str]:
        """Per candidate other than the chosen one, why it lost."""
        c = self.chosen
        lines = []
        for other in self.candidates:
            if other.cuts == c.cuts:
                continue
            cut = f"cut {', '.join(map(str, other.cuts))}"
            failing = [k.describe() for k in other.checks if not k.holds]
            if failing:
                lines.append(f"{cut}: {'; '.join(failing)}")
                continue
            if self.strategy == "latency_aware":
                delta = other.decode_latency_ms / c.decode_latency_ms - 1
                what = f"{other.decode_latency_ms:.2f} ms/token ({delta:+.1%})"
            else:
                delta = c.pipelined_tokens_per_s / other.pipelined_tokens_per_s - 1
                what = f"{other.pipelined_tokens_per_s:.1f} tok/s pipelined ({-delta:+.1%})"
            if delta <= self.margin:
                lines.append(
                    f"{cut}: {what}, within the {self.margin:.0%} margin: a tie, "
                    "broken toward the plan in use or the fewest layers on the edge"
                )
            else:
                slowest = max(other.tiers, key=lambda t: t.decode_ms)
                lines.append(
                    f"{cut}: {what}; its slowest tier {slowest.device} "
                    f"{slowest.decode_ms:.2f} ms/step"
                )
        return lines

    @property
    def cuts(self) -> tuple[int, ...]:
        return self.chosen.cuts

    def layer_range(self, tier: int) -> tuple[int, int]:
        """Decoder layers [start, end) of tier (0 = edge, -1 = cloud)."""
        bounds = (0, *self.cuts, self.num_layers)
        tier = tier % (len(bounds) - 1)
        return bounds[tier], bounds[tier + 1]

    # ---- files ---------------------------------------------------------------------------
    def to_dict(self, with_candidates: bool = False) -> dict[str, Any]:
        data = asdict(self)
        if not with_candidates:
            data.pop("candidates")
        return data

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PartitionPlan:
        data = dict(data)
        data["chosen"] = _cut_from_dict(data["chosen"])
        data["candidates"] = tuple(_cut_from_dict(c) for c in data.get("candidates", ()))
        return cls(**data)

    @classmethod
    def load(cls, path: str | Path) -> PartitionPlan:
        try:
            return cls.from_dict(json.loads(Path(path).read_text()))
        except (OSError, KeyError, TypeError, json.JSONDecodeError) as e:
            raise ValueError(f"cannot read partition plan {str(path)!r}: {e}") from e

    # ---- reading -------------------------------------------------------------------------
    def table(self) -> str:
        """A readable summary: per tier and link, then totals and constraint checks."""
        c = self.chosen
        lines = [
            f"Partition plan for {self.model} ({self.num_layers} layers, {self.strategy}, "
            f"batch {self.batch_size}, context {self.context_len}, wire {self.wire_dtype})",
            f"cut: {', '.join(f'layer {k} starts the next tier' for k in c.cuts)}",
            "",
            f"{'part':<22}{'layers':>10}{'decode ms/step':>16}{'prefill ms/tok':>16}"
            f"{'memory MiB':>12}{'wire B/tok':>12}",
        ]
        for i, tier in enumerate(c.tiers):
            extra = (" +embed" if i == 0 else "") + (" +head" if i == len(c.tiers) - 1 else "")
            lines.append(
                f"{tier.device + extra:<22}{f'[{tier.layers[0]}, {tier.layers[1]})':>10}"
                f"{tier.decode_ms:>16.3f}{tier.prefill_ms_per_token:>16.3f}"
                f"{tier.memory_bytes / 2**20:>12.1f}{'':>12}"
            )
            if i < len(c.links):
                link = c.links[i]
                lines.append(
                    f"{'  link':<22}{'':>10}{link.decode_ms:>16.3f}"
                    f"{link.prefill_ms_per_token:>16.3f}{'':>12}{link.bytes_per_token:>12.0f}"
                )
        lines += [
            "",
            f"decode latency: {c.decode_latency_ms:.2f} ms/token   "
            f"prefill: {c.prefill_ms_per_token:.3f} ms/token",
            f"throughput: {c.tokens_per_s:.1f} tok/s (pipelined {c.pipelined_tokens_per_s:.1f}); "
            f"cloud tier alone: {c.cloud_tokens_per_s:.1f} tok/s",
        ]
        lines += [("  ok    " if k.holds else "  FAIL  ") + k.describe() for k in c.checks]
        if not self.feasible:
            lines += ["", f"no plan meets the constraints: {self.message}"]
        others = self.why_not()
        if others:
            lines += ["", "other placements:"] + [f"  {line}" for line in others]
        return "\n".join(lines)


@dataclass(frozen=True)
class TierSetting:
    """What one process of a split runs, read from its plan."""

    role: str  # "edge" | "cloud" | "tierN" (a tier in between, N = its index in the chain)
    cut: int  # edge: the first layer the next tier runs; others: this tier's first layer
    layers: tuple[int, int]  # this tier's decoder layers [start, end)
    wire_dtype: str  # hidden states on the wire
    index: int = 0  # position in the chain (0 = edge)
    num_tiers: int = 2

    @property
    def is_last(self) -> bool:
        return self.index == self.num_tiers - 1

    def moved(self, cut: int) -> TierSetting:
        """This tier after the cut before it (a later tier) or after it (the edge) moved:
        the edge ends its layers at cut, a later tier starts them there."""
        layers = (0, cut) if self.index == 0 else (cut, self.layers[1])
        if not layers[0] < layers[1]:
            raise ValueError(f"a cut at layer {cut} leaves tier {self.role} no layers {layers}.")
        return replace(self, cut=cut, layers=layers)


def tier_index(role: str, num_tiers: int) -> int:
    """The chain position of a role: edge 0, cloud the last, tierN N."""
    if role == "edge":
        return 0
    if role == "cloud":
        return num_tiers - 1
    if role.startswith("tier") and role[4:].isdigit() and 0 < int(role[4:]) < num_tiers:
        return int(role[4:])
    raise ValueError(f"partition role {role!r} is not a tier of a {num_tiers}-tier plan.")


def load_tier(plan_path: str, role: str, num_layers: int) -> TierSetting:
    """The tier `role` of the plan at plan_path, checked against the model."""
    plan = PartitionPlan.load(plan_path)
    cuts = list(plan.cuts)
    if not cuts or cuts != sorted(set(cuts)) or not 0 < cuts[0] <= cuts[-1] < num_layers:
        raise ValueError(
            f"partition plan {plan_path!r} has cuts {cuts}; each must lie in "
            f"[1, {num_layers - 1}], increasing."
        )
    if plan.num_layers != num_layers:
        raise ValueError(
            f"partition plan {plan_path!r} is for {plan.num_layers} layers, the model "
            f"has {num_layers}."
        )
    index = tier_index(role, len(cuts) + 1)
    layers = plan.layer_range(index)
    cut = layers[1] if index == 0 else layers[0]
    return TierSetting(role, cut, layers, plan.wire_dtype, index, len(cuts) + 1)


def _cut_from_dict(data: dict[str, Any]) -> CutEstimate:
    return CutEstimate(
        cuts=tuple(data["cuts"]),
        tiers=tuple(TierEstimate(**{**t, "layers": tuple(t["layers"])}) for t in data["tiers"]),
        links=tuple(LinkEstimate(**link) for link in data["links"]),
        decode_latency_ms=data["decode_latency_ms"],
        prefill_ms_per_token=data["prefill_ms_per_token"],
        tokens_per_s=data["tokens_per_s"],
        pipelined_tokens_per_s=data["pipelined_tokens_per_s"],
        cloud_tokens_per_s=data["cloud_tokens_per_s"],
        checks=tuple(ConstraintCheck(**k) for k in data["checks"]),
    )
