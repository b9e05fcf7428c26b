"""Running a partition plan: the edge's SplitExecutor and the cloud's CloudWorker.

The edge process runs the whole engine (scheduler, block manager, detokenizer, server)
with a SplitExecutor: its model runner holds the embedding and layers [0, k) on its own
paged cache. Each step it runs them and sends, for the whole batch, the hidden states
plus what the cloud needs to lay the step out itself: per scheduled sequence its id,
num_computed_tokens, num_new_tokens, block table and the tokens the cloud has not seen.

The cloud keeps a mirror Sequence per sequence id, rebuilds the same SchedulerOutput and
runs its model runner over it: layers [k, L), norm, LM head and the sampler, on a paged
cache of the same block count, so the edge's block ids index both caches and prefix-cache
hits, preemption and chunked prefill need no extra protocol. Sampling (seeds, penalties,
logprobs) happens on the cloud, so only token ids and logprobs come back, not logits.

The cut can move while the split runs: every ``replan_interval`` steps the edge plans
again from what it measured (adapt.Replanner); when the cut moves, the engine recomputes
its running sequences (their KV is laid out for the old cut), the edge loads the layers
of the new cut and opens a new session whose hello names the new cut, and the worker
loads its own new layers before it answers.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from typing import Any, NoReturn

import torch

from pagedllm import envs
from pagedllm.config import EngineConfig, PartitionConfig
from pagedllm.core.kv_cache import KVCacheSpec
from pagedllm.core.outputs import Logprob, TokenLogprobs
from pagedllm.core.scheduler import ScheduledSequence, SchedulerOutput
from pagedllm.core.sequence import Sequence
from pagedllm.dtypes import torch_dtype
from pagedllm.partition.adapt import LinkMonitor, Replanner
from pagedllm.partition.plan import PartitionPlan, TierSetting, load_tier
from pagedllm.partition.profiles import LinkProfile
from pagedllm.partition.transport import (
    Message,
    PeerLostError,
    RemoteError,
    TierClient,
    TierServer,
    link_ready,
)
from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.executor import Executor, ExecutorLostError
from pagedllm.worker.model_runner import ModelOutput, ModelRunner

logger = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 30.0  # at start-up the cloud worker may still be loading
LINK_PROBE_S = 1.0  # running locally after a lost link: how often to look for the worker
RECONNECT_TIMEOUT_S = 2.0  # later, each step that finds the cloud gone fails this fast


# ---- hidden states on the wire -------------------------------------------------------------
def encode_hidden(hidden: torch.Tensor, wire_dtype: str) -> dict[str, torch.Tensor]:
    """[T, hidden] -> tensors to send; int8 is symmetric per token with a float32 scale."""
    hidden = hidden.detach().cpu()
    if wire_dtype != "int8":
        return {"hidden": hidden.to(torch_dtype(wire_dtype))}
    scale = hidden.float().abs().amax(dim=-1, keepdim=True).clamp_min(1e-8) / 127.0
    q = torch.round(hidden.float() / scale).clamp(-127, 127).to(torch.int8)
    return {"hidden_q": q, "hidden_scale": scale}


def decode_hidden(
    tensors: dict[str, torch.Tensor], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    if "hidden_q" in tensors:
        hidden = tensors["hidden_q"].float() * tensors["hidden_scale"]
    else:
        hidden = tensors["hidden"]
    return hidden.to(device=device, dtype=dtype)


# ---- model output on the wire --------------------------------------------------------------
def _lp_to_wire(lp: TokenLogprobs | None) -> list[list[float]] | None:
    if lp is None:
        return None
    return [[tok, v.logprob, v.rank] for tok, v in lp.items()]


def _lp_from_wire(rows: list[list[float]] | None) -> TokenLogprobs | None:
    if rows is None:
        return None
    return {int(tok): Logprob(lp, int(rank)) for tok, lp, rank in rows}


def output_to_wire(out: ModelOutput) -> dict[str, Any]:
    return {
        "sampled": [[sid, toks] for sid, toks in out.sampled.items()],
        "logprobs": [[sid, _lp_to_wire(lp)] for sid, lp in out.logprobs.items()],
        "prompt_logprobs": [
            [sid, [_lp_to_wire(lp) for lp in lps]] for sid, lps in out.prompt_logprobs.items()
        ],
    }


def output_from_wire(meta: dict[str, Any]) -> ModelOutput:
    return ModelOutput(
        sampled={int(sid): [int(t) for t in toks] for sid, toks in meta["sampled"]},
        logprobs={int(sid): _lp_from_wire(lp) for sid, lp in meta["logprobs"]},
        prompt_logprobs={
            int(sid): [_lp_from_wire(lp) for lp in lps] for sid, lps in meta["prompt_logprobs"]
        },
    )


def _params_to_wire(params: SamplingParams) -> dict[str, Any]:
    return {f.name: getattr(params, f.name) for f in dataclasses.fields(params) if f.init}


def tier_runner(
    config: EngineConfig, role: str, tier: TierSetting | None = None
) -> tuple[PartitionConfig, TierSetting, ModelRunner]:
    """This process's tier (read from the plan unless given) and a model runner for its
    layers."""
    partition = config.partition
    assert partition is not None and (partition.role == role or role == "receiver")
    if tier is None:
        tier = load_tier(partition.plan, partition.role, config.model.num_layers)
    model = dataclasses.replace(config.model, layer_range=tier.layers)
    return partition, tier, ModelRunner(model, config.cache, config.scheduler, config.device)


# ---- the edge ------------------------------------------------------------------------------
class SplitExecutor(Executor):
    """Runs the first tier here and the rest on a cloud worker, one exchange per step."""

    def __init__(self, config: EngineConfig) -> None:
        assert config.partition is not None and config.partition.address is not None, (
            "an edge needs partition_address: the cloud worker's host:port"
        )
        self.config = config
        self.partition, self.tier, self.runner = tier_runner(config, "edge")
        self.client: TierClient | None = None
        self.num_blocks = 0
        self._synced: dict[int, int] = {}  # seq_id -> tokens of it the cloud holds
        self.monitor = LinkMonitor()  # per-step edge / remote / link times, for re-planning
        self.outstanding = 0  # steps sent and not yet answered
        self.max_outstanding = 0  # the most at once: > 1 when the tiers pipelined
        self.replanner = self._replanner()  # None: the cut stays where the plan put it
        self._steps_since_plan = 0
        self.pending_cut: int | None = None  # a re-plan moved the cut here; not yet applied
        self.moves: list[tuple[int, int]] = []  # (from, to) of every cut moved while running
        # fallback "local": while the link is lost, a runner of every layer runs the steps
        self.local: ModelRunner | None = None
        self._go_local = False  # the link was just lost: switch at the next step boundary
        self._link_back = threading.Event()  # set by the probe while running locally
        self.fallbacks = 0  # times the link was lost and every layer ran here
        self.returns = 0  # times the split resumed after that
        self.probes = 0  # tries of the lost link's address that found nothing

    def _replanner(self) -> Replanner | None:
        if self.partition.replan_interval <= 0:
            return None
        plan = PartitionPlan.load(self.partition.plan)
        try:
            return Replanner.from_plan(plan)
        except ValueError as e:
            logger.info("the cut stays at layer %d: %s", self.tier.cut, e)
            return None

    def _hello(self, num_blocks: int, connect_timeout_s: float) -> int:
        """Open a session: the cloud sizes its cache to at most num_blocks; returns its count."""
        self._drop_session()
        self.client = TierClient(
            self.partition.address, connect_timeout_s, envs.PAGEDLLM_SPLIT_REPLY_TIMEOUT()
        )
        reply, _ = self.client.exchange(
            {
                "kind": "hello",
                "cut": self.tier.cut,
                "block_size": self.runner.block_size,
                "num_blocks": num_blocks,
                "hidden_size": self.runner.model_config.hf_config.hidden_size,
            },
            {},
        )
        return int(reply["num_blocks"])

    def initialize_cache(self) -> KVCacheSpec:
        spec = self.runner.plan_kv_cache()
        try:
            self.num_blocks = self._hello(spec.num_blocks, CONNECT_TIMEOUT_S)
        except (PeerLostError, RemoteError) as e:
            self._drop_session()
            raise ValueError(str(e)) from None
        self.runner.allocate_kv_cache(self.num_blocks)
        logger.info(
            "edge tier: layers [0, %d), %d KV blocks shared with the cloud worker at %s",
            self.tier.cut,
            self.num_blocks,
            self.partition.address,
        )
        return dataclasses.replace(spec, num_blocks=self.num_blocks)

    def _reconnect(self) -> None:
        try:
            got = self._hello_retrying()
            if got != self.num_blocks:
                raise RemoteError(
                    f"the cloud worker at {self.partition.address} now has room for {got} KV "
                    f"blocks, the edge needs {self.num_blocks}"
                )
        except (PeerLostError, RemoteError) as e:
            self._drop_session()
            raise ExecutorLostError(str(e)) from None

    def _hello_retrying(self) -> int:
        """Hello again; a worker still closing the session a lost link cut answers busy
        for a moment, so that answer is retried until RECONNECT_TIMEOUT_S."""
        deadline = time.monotonic() + RECONNECT_TIMEOUT_S
        while True:
            try:
                return self._hello(self.num_blocks, RECONNECT_TIMEOUT_S)
            except PeerLostError as e:
                if "RESOURCE_EXHAUSTED" not in str(e) or time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def _drop_session(self) -> None:
        self.outstanding = 0
        self.monitor.reset()
        if self.client is not None:
            self.client.close()
        self.client = None
        self._synced.clear()

    def _layout(self, out: SchedulerOutput) -> list[list[Any]]:
        """Per scheduled sequence what the cloud needs to lay out the same step."""
        rows = []
        for item in out.scheduled:
            seq = item.seq
            synced = self._synced.get(seq.seq_id)
            first = None
            if synced is None:
                first = {
                    "prompt_len": seq.num_prompt_tokens,
                    "eos": seq.eos_token_id,
                    "params": _params_to_wire(seq.sampling_params),
                }
                synced = 0
            rows.append(
                [
                    seq.seq_id,
                    seq.num_computed_tokens,
                    item.num_new_tokens,
                    seq.block_table,
                    seq.token_ids[synced:],
                    first,
                ]
            )
            self._synced[seq.seq_id] = seq.num_tokens
        return rows

    def execute_model(self, out: SchedulerOutput) -> ModelOutput:
        if self.local is not None:  # the link is lost: every layer runs here
            return self.local.execute(out)
        return self.collect(self.submit(out))

    @property
    def pipeline_depth(self) -> int:
        return 1 if self.local is not None else self.partition.pipeline_depth

    def submit(self, out: SchedulerOutput) -> object:
        """Run this tier's layers for the step and send it on without waiting: with
        pipeline_depth > 1 the engine submits the next micro-batch while the cloud works."""
        if self.client is None:
            self._reconnect()
        assert self.client is not None
        released = [sid for sid in out.finished_seq_ids if self._synced.pop(sid, None) is not None]
        start = time.perf_counter()
        inp = self.runner.prepare_input(out)
        tensors = encode_hidden(self.runner.forward(inp), self.tier.wire_dtype)
        meta = {"kind": "step", "seqs": self._layout(out), "release": released}
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        self.monitor.sent(time.perf_counter() - start, nbytes)
        try:
            self.client.send(meta, tensors)
        except (PeerLostError, RemoteError) as e:
            self._lost(e)
        self.outstanding += 1
        self.max_outstanding = max(self.max_outstanding, self.outstanding)
        return self.client

    def collect(self, handle: object) -> ModelOutput:
        if handle is not self.client or self.client is None:
            raise ExecutorLostError("the session this step was sent on is gone")
        self.outstanding -= 1
        try:
            reply, _ = self.client.receive()
        except (PeerLostError, RemoteError) as e:
            self._lost(e)
        self.monitor.received(float(reply.get("compute_ms", 0.0)), 8 * len(reply["sampled"]))
        self._maybe_replan()
        return output_from_wire(reply)

    # ---- re-planning, and changing the layout between steps ------------------------------
    def _maybe_replan(self) -> None:
        """Every replan_interval steps, once a full window was measured at this cut, plan
        again; a move is left in pending_cut for the engine to carry out between steps."""
        if self.replanner is None or self.pending_cut is not None:
            return
        self._steps_since_plan += 1
        seen = self.monitor.snapshot()
        if self._steps_since_plan < self.partition.replan_interval or seen is None:
            return
        if seen.steps < self.monitor.window:  # a full window measured at this cut
            return
        self._steps_since_plan = 0
        plan = self.replanner.replan(seen)
        if plan.cuts[0] != self.tier.cut:
            logger.info(
                "re-planned from %d steps (edge %.2f ms, cloud %.2f ms, link %.2f ms): the cut "
                "moves from layer %d to %d, predicted %.2f ms/token",
                seen.steps,
                seen.edge_ms,
                seen.remote_ms,
                seen.link_ms,
                self.tier.cut,
                plan.cuts[0],
                plan.chosen.decode_latency_ms,
            )
            self.pending_cut = plan.cuts[0]

    @property
    def repartition_pending(self) -> bool:
        if self.local is not None:
            return self._link_back.is_set()
        return self._go_local or self.pending_cut is not None

    def repartition(self) -> None:
        """Switch to running every layer here (the link was lost), back to the split (it
        returned), or move the cut to pending_cut."""
        if self._go_local:
            self._run_locally()
        elif self.local is not None:
            self._resume_split()
        else:
            self._move_cut()

    # ---- a lost link -----------------------------------------------------------------------
    def _lost(self, e: Exception) -> NoReturn:
        """The session is gone. With fallback "local" the engine is told it may go on: the
        running sequences are recomputed on a runner of every layer here until the link
        returns; otherwise it fails the running requests."""
        self._drop_session()
        if self.partition.fallback == "local" and isinstance(e, PeerLostError):
            self._go_local = True
        raise ExecutorLostError(str(e)) from None

    def _run_locally(self) -> None:
        self._go_local = False
        try:
            local = ModelRunner.from_engine_config(self.config)  # every layer
            local.allocate_kv_cache(self.num_blocks)
        except Exception as e:  # noqa: BLE001 - e.g. no memory for the whole model here
            logger.error("cannot run every layer here (%s): requests fail until the link "
                         "returns", e)  # fmt: skip
            return
        self.runner.kv_caches = []  # the split's cache is recomputed later anyway
        self.local = local
        self.fallbacks += 1
        self._start_probe()
        logger.warning(
            "the link to the cloud worker at %s is lost: every layer runs here until it "
            "returns (running sequences are recomputed)",
            self.partition.address,
        )

    def _start_probe(self) -> None:
        self._link_back.clear()
        threading.Thread(target=self._probe_link, daemon=True).start()

    def _probe_link(self) -> None:
        """While running locally: look for the cloud worker's address every LINK_PROBE_S
        (each try waits that long for the connection) until it answers."""
        while self.local is not None:
            if link_ready(self.partition.address, LINK_PROBE_S):
                self._link_back.set()
                return
            self.probes += 1

    def _resume_split(self) -> None:
        """The worker answers again: a new session at the split's cut; until it is open,
        the steps stay here."""
        try:
            self._reconnect()
        except ExecutorLostError as e:
            logger.info("the cloud worker is not back yet (%s)", e)
            self._start_probe()
            return
        self.local = None
        self.runner.allocate_kv_cache(self.num_blocks)
        self.returns += 1
        logger.info("the link to the cloud worker is back: layers [%d, ...) run there again",
                    self.tier.cut)  # fmt: skip

    # ---- moving the cut --------------------------------------------------------------------
    def _move_cut(self) -> None:
        """Move the cut to pending_cut. The engine calls this with no step in flight and its
        sequences preempted: their KV was laid out for the old cut. The edge loads the new
        layers on the same KV block count, and its hello makes the worker load its own; a
        worker that refuses the new cut keeps the old one, and re-planning stops."""
        assert self.pending_cut is not None and self.outstanding == 0
        old, cut = self.tier, self.pending_cut
        self.pending_cut = None
        self._load(old.moved(cut))
        try:
            self._reconnect()
        except ExecutorLostError as e:
            logger.warning("the cut stays at layer %d: moving it failed: %s", old.cut, e)
            self.replanner = None
            self._load(old)
            self._reconnect()
            return
        self.moves.append((old.cut, cut))
        self.monitor = LinkMonitor(self.monitor.window)  # figures of the old cut are done
        if self.replanner is not None:
            self.replanner.cuts = (cut,)
        self._steps_since_plan = 0
        logger.info("edge tier: layers [0, %d) (was [0, %d))", cut, old.cut)

    def _load(self, tier: TierSetting) -> None:
        self._drop_session()
        self.runner.kv_caches = []  # the old layers and their cache go before the new load
        _, self.tier, self.runner = tier_runner(self.config, "edge", tier)
        self.runner.allocate_kv_cache(self.num_blocks)

    def ping_ms(self, repeats: int = 20, payload_bytes: int = 0) -> list[float]:
        """Round trips of an empty step to the cloud over the real path (RTT plus the
        transport's own cost per exchange), in ms, sorted."""
        if self.client is None:
            self._reconnect()
        assert self.client is not None
        payload = {}
        if payload_bytes:
            payload = {"hidden": torch.zeros(max(1, payload_bytes // 4), dtype=torch.float32)}
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            self.client.exchange({"kind": "ping"}, payload)
            times.append((time.perf_counter() - start) * 1e3)
        return sorted(times)

    @property
    def local_runner(self) -> ModelRunner:
        return self.runner

    def shutdown(self) -> None:
        self.local = None  # also ends a probe of a lost link
        self._drop_session()


# ---- the cloud -----------------------------------------------------------------------------
class CloudWorker:
    """A tier after the edge, served to one edge (or the tier before it) at a time: layers
    [k, L) + head over mirrored sequences when it is the last tier; layers [k1, k2) when
    it is a tier in between, which hands each step on to ``next_address`` and returns
    that tier's reply (a chain edge -> gateway -> cloud)."""

    def __init__(self, config: EngineConfig, next_address: str | None = None) -> None:
        self.config = config
        self.partition, self.tier, self.runner = tier_runner(config, "receiver")
        if self.tier.index == 0:
            raise ValueError("the edge tier runs the engine (SplitExecutor), not a worker.")
        if not self.tier.is_last and next_address is None:
            raise ValueError(
                f"tier {self.tier.index} of {self.tier.num_tiers} hands its steps on: give "
                "the next tier's address (--next-address)."
            )
        self.next_address = next_address
        self.next: TierClient | None = None
        self.in_flight = 0  # a tier in between: steps handed on, their replies not yet back
        self.max_in_flight = 0  # the most at once: > 1 when the steps pipelined through here
        self.max_blocks = self.runner.plan_kv_cache().num_blocks
        self.seqs: dict[int, Sequence] = {}  # seq_id -> mirror of the edge's sequence
        self._lock = threading.Lock()

    def handle(self, meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> Any:
        with self._lock:
            if meta["kind"] == "hello":
                return self._hello(meta), {}
            if meta["kind"] == "ping":  # the edge measuring the link: answer at once
                return {}, {}
            start = time.perf_counter()
            if not self.tier.is_last:
                return self._forward_step(meta, tensors, start)
            reply = output_to_wire(self._step(meta, tensors))
            reply["compute_ms"] = (time.perf_counter() - start) * 1e3
            return reply, {}

    def _hello(self, meta: dict[str, Any]) -> dict[str, Any]:
        hf = self.runner.model_config.hf_config
        expected = {"block_size": self.runner.block_size, "hidden_size": hf.hidden_size}
        for key, value in expected.items():
            if meta[key] != value:
                raise ValueError(f"the edge has {key}={meta[key]}, this worker {value}")
        num_blocks = min(int(meta["num_blocks"]), self.max_blocks)
        self.close()
        if meta["cut"] != self.tier.cut:  # the tier before moved the cut: load its layers
            self._move(int(meta["cut"]))
        if not self.tier.is_last:  # the tiers after this one agree on the count too
            assert self.next_address is not None
            self.next = TierClient(
                self.next_address, RECONNECT_TIMEOUT_S, envs.PAGEDLLM_SPLIT_REPLY_TIMEOUT()
            )
            reply, _ = self.next.exchange(
                {**meta, "cut": self.tier.layers[1], "num_blocks": num_blocks}, {}
            )
            num_blocks = int(reply["num_blocks"])
        self.runner.ensure_kv_cache(num_blocks)
        logger.info("session open: layers [%d, %d), %d KV blocks", *self._range(), num_blocks)
        return {"num_blocks": num_blocks}

    def _move(self, cut: int) -> None:
        """Start this tier's layers at cut (the same KV block count, so the same block ids
        work; max_blocks stays the one sized at start)."""
        tier = self.tier.moved(cut)  # ValueError: no layers would be left here
        was = self.tier.layers
        self.runner.kv_caches = []
        _, self.tier, self.runner = tier_runner(self.config, "receiver", tier)
        logger.info("the cut moved: layers [%d, %d) (was [%d, %d))", *tier.layers, *was)

    def _forward_step(
        self, meta: dict[str, Any], tensors: dict[str, torch.Tensor], start: float
    ) -> Callable[[], Message]:
        """A tier in between: run its layers and hand the step on; the reply is the next
        tier's, deferred, so this tier runs the next step while the later ones work on this
        one (its compute_ms then covers this tier, the link after it and the tiers after)."""
        if self.next is None:
            raise ValueError("no session with the next tier (hello first)")
        inp = self._prepare(meta)
        hidden = decode_hidden(tensors, self.runner.dtype, self.runner.device)
        out = encode_hidden(self.runner.forward(inp, hidden), self.tier.wire_dtype)
        client = self.next
        client.send(meta, out)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)

        def relayed() -> Message:
            try:
                meta, tensors = client.receive()
            finally:
                self.in_flight -= 1
            meta["compute_ms"] = (time.perf_counter() - start) * 1e3
            return meta, tensors

        return relayed

    def _range(self) -> tuple[int, int]:
        return self.tier.layers

    def _mirror(self, row: list[Any]) -> ScheduledSequence:
        seq_id, computed, num_new, table, new_tokens, first = row
        seq = self.seqs.get(seq_id)
        if seq is None:
            if first is None:
                raise ValueError(f"sequence {seq_id} is unknown to this session")
            prompt = new_tokens[: first["prompt_len"]]
            params = SamplingParams(**first["params"])
            seq = Sequence(seq_id, "", 0, prompt, params, first["eos"])
            new_tokens = new_tokens[len(prompt) :]
            self.seqs[seq_id] = seq
        for token in new_tokens:
            seq.append_token(token)
        seq.num_computed_tokens = computed
        seq.block_table = table
        return ScheduledSequence(seq, num_new)

    def _prepare(self, meta: dict[str, Any]) -> Any:
        for seq_id in meta["release"]:
            self._forget(seq_id)
        scheduled = [self._mirror(row) for row in meta["seqs"]]
        out = SchedulerOutput(scheduled, sum(s.num_new_tokens for s in scheduled))
        return self.runner.prepare_input(out)

    def _step(self, meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> ModelOutput:
        runner = self.runner
        inp = self._prepare(meta)
        hidden = decode_hidden(tensors, runner.dtype, runner.device)
        return runner.compute_output(inp, runner.forward(inp, hidden))

    def _forget(self, seq_id: int) -> None:
        if self.seqs.pop(seq_id, None) is not None:
            self.runner.release([seq_id])

    def close(self) -> None:
        """The edge went away: forget its sequences (the KV blocks are the edge's to reuse)
        and end the session with the next tier, which then forgets them too."""
        for seq_id in list(self.seqs):
            self._forget(seq_id)
        if self.next is not None:
            self.next.close()
            self.next = None
        self.in_flight = 0

    def serve(self, emulate: LinkProfile | None = None) -> TierServer:
        """A started server for this worker at the partition's address."""
        address = self.partition.address or "127.0.0.1:0"
        server = TierServer(self.handle, self._closed, address, emulate)
        server.start()
        return server

    def _closed(self) -> None:
        with self._lock:
            self.close()
