"""The emulated network: namespaces + veth + tbf + the delaying proxy, and a split engine
across it losing its link mid-stream."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import pytest
from helpers.ci import unavailable as ci_unavailable
from helpers.oracle import hf_greedy
from helpers.partition import emulated_link, make_plan

from pagedllm.config import EngineArgs
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.partition import netem
from pagedllm.partition.netem import DelayProxy, EmulatedNetwork
from pagedllm.sampling_params import SamplingParams

ENGINE = dict(dtype="float32", block_size=4, kv_cache_memory_bytes=1 << 20)
ECHO = """
import socket, sys
s = socket.socket(); s.bind((sys.argv[1], 0)); s.listen(); print(s.getsockname()[1], flush=True)
c, _ = s.accept()
while d := c.recv(1 << 16):
    c.sendall(d)
"""


@pytest.fixture
def network():
    reason = netem.unavailable()
    if reason is not None:
        ci_unavailable(f"emulated network: {reason}")
    with EmulatedNetwork(rate_mbit=50) as net:
        yield net
    assert (
        net.edge_ns
        not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    )


def _round_trip_ms(conn: socket.socket, size: int) -> float:
    start = time.perf_counter()
    conn.sendall(b"x" * size)
    got = 0
    while got < size:
        got += len(conn.recv(1 << 16))
    return (time.perf_counter() - start) * 1e3


def test_rate_and_delay_are_those_asked_for_and_change_at_run_time(network):
    echo = subprocess.Popen(
        [*network.exec_prefix(), sys.executable, "-c", ECHO, network.cloud_ip],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        port = int(echo.stdout.readline())
        with DelayProxy(f"{network.cloud_ip}:{port}", network.edge_ns, rtt_ms=20) as proxy:
            host, p = proxy.address.rsplit(":", 1)
            conn = socket.create_connection((host, int(p)))
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            slow = [_round_trip_ms(conn, 16) for _ in range(7)]
            assert "rtt_ms=20.0" in proxy.command("show")
            proxy.set(rtt_ms=2)
            assert "rtt_ms=2.0" in proxy.command("show")  # taken at run time
            fast = [_round_trip_ms(conn, 16) for _ in range(7)]
            # 1 MB each way through a 50 Mbit/s bucket: at least 160 ms of serialisation
            bulk = _round_trip_ms(conn, 1_000_000)
            conn.close()
        shaped = [_qdisc(network, ns) for ns in (network.edge_ns, network.cloud_ns)]
        network.set_rate(100)
        reshaped = [_qdisc(network, ns) for ns in (network.edge_ns, network.cloud_ns)]
    finally:
        echo.kill()
        echo.wait()
    # Lower bounds only: a busy machine makes a round trip longer, never shorter than the
    # delay and serialisation the emulation adds (what it adds on top is the machine's).
    assert min(slow) >= 20, slow
    assert min(fast) >= 2, fast
    assert bulk >= 0.9 * 1e6 * 8 / 50e6 * 1e3, bulk
    assert all("tbf" in q and "rate 50Mbit" in q for q in shaped), shaped
    assert all("rate 100Mbit" in q for q in reshaped), reshaped


def _qdisc(network: EmulatedNetwork, ns: str) -> str:
    """The root qdisc of the namespace's veth end, as tc reports it."""
    out = subprocess.run(
        ["ip", "netns", "exec", ns, "tc", "qdisc", "show"], capture_output=True, text=True
    )
    return out.stdout


def test_link_lost_mid_stream_fails_in_flight_requests_and_recovers(
    model_factory, tmp_path, monkeypatch
):
    monkeypatch.setenv("PAGEDLLM_SPLIT_REPLY_TIMEOUT", "3")
    model = model_factory("llama", num_hidden_layers=4)
    plan = make_plan(model, 2, tmp_path / "plan.json")
    with emulated_link(model, plan, rtt_ms=1) as link:
        args = EngineArgs(
            model=str(model),
            partition_config={"plan": str(plan), "address": link.address},
            **ENGINE,
        )
        engine = LLMEngine.from_engine_args(args)
        long = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)
        for i in range(3):
            engine.add_request(str(i), [5 + i, 6, 7, 8], long)
        for _ in range(3):
            assert not any(o.finished for o in engine.step())
        link.proxy.down()  # every byte from now on is dropped, the sockets stay open
        outputs = engine.step()  # the reply timeout (3 s) ends the step, not a hang
        assert sorted(o.request_id for o in outputs) == ["0", "1", "2"]
        for out in outputs:
            assert out.finished and out.outputs[0].finish_reason == "error"
            assert "no reply from the cloud worker" in out.error
            assert len(out.outputs[0].token_ids) >= 3  # what was generated is kept
        assert not engine.has_unfinished_requests()
        engine.check_integrity()
        assert engine.block_manager.usage == 0.0
        # While the link is down a new request fails too (no silent loss) ...
        engine.add_request("during", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=4))
        assert engine.step()[0].outputs[0].finish_reason == "error"
        link.proxy.up()  # ... and once it is back, requests complete again
        engine.add_request(
            "after", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        )
        while engine.has_unfinished_requests():
            outs = engine.step()
        engine.shutdown()
    assert outs[0].outputs[0].finish_reason == "length"
    assert outs[0].outputs[0].token_ids == hf_greedy(model, [[5, 6, 7]], 8)[0]


def test_link_lost_mid_stream_with_local_fallback_finishes_every_request(
    model_factory, tmp_path, monkeypatch
):
    """partition_config={"fallback": "local": when the proxy drops everything}, the edge loads every
    layer, recomputes the running sequences and goes on; when the link returns it opens a
    new session and the split resumes. No request fails, and the tokens are HF's."""
    monkeypatch.setenv("PAGEDLLM_SPLIT_REPLY_TIMEOUT", "3")
    model = model_factory("llama", num_hidden_layers=4)
    plan = make_plan(model, 2, tmp_path / "plan.json")
    prompts = [[5 + i, 6, 7, 8] for i in range(3)]
    long = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    with emulated_link(model, plan, rtt_ms=1) as link:
        args = EngineArgs(
            model=str(model),
            partition_config={"plan": str(plan), "address": link.address, "fallback": "local"},
            **ENGINE,
        )
        engine = LLMEngine.from_engine_args(args)
        executor = engine.executor
        for i, prompt in enumerate(prompts):
            engine.add_request(str(i), prompt, long)
        done = {}

        def step() -> None:
            for out in engine.step():
                assert out.outputs[0].finish_reason != "error", out.error
                if out.finished:
                    done[out.request_id] = out.outputs[0].token_ids

        for _ in range(3):
            step()
        link.proxy.down()  # every byte from now on is dropped, the sockets stay open
        step()  # the lost step: nothing fails, the sequences are recomputed here
        assert executor.local is not None and executor.fallbacks == 1
        assert engine.scheduler.num_preemptions >= 3
        deadline = time.monotonic() + 60  # two probes of the address find nothing
        while executor.probes < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert executor.probes >= 2 and not executor.repartition_pending
        for _ in range(10):  # the requests go on while the link is down
            step()
        assert executor.local is not None and not done
        link.proxy.up()
        deadline = time.monotonic() + 30
        while executor.local is not None and time.monotonic() < deadline:
            if not engine.has_unfinished_requests():  # keep work coming until the split is back
                engine.add_request(f"x{len(done)}", [9, 10, 11], long)
            step()
            time.sleep(0.01)
        assert executor.local is None and executor.returns == 1
        while engine.has_unfinished_requests():
            step()
        engine.check_integrity()
        engine.shutdown()
    assert [done[str(i)] for i in range(3)] == hf_greedy(model, prompts, 40)
