"""Data-parallel replicas behind existing routers, all on loopback: two `pagedllm serve`
replicas of the demo model, vllm-router and sglang-router in front of them.

- vllm-router's kv_aware policy reads the replicas' KV-cache events: a prefix cached on one
  replica (warmed there directly, behind the router's back) draws every later request that
  shares it, so every such request is a full prefix hit; round_robin on the same workload
  also sends them to the replica without the prefix, which computes it again.
- sglang-router's cache_aware policy (its own tree of what it routed) keeps a shared prefix on
  one replica, where round_robin spreads it.
- a replica killed mid-run loses at most its in-flight requests; every later request is
  answered by the other replica.
"""

from __future__ import annotations

import threading

import pytest
from helpers.replicas import Replica, Router, start_replica, start_router, stop, wait_until

PREFIXES = [
    "Deep in the northern forest a small fox searched every morning for berries and " * 4,
    "In the laboratory the engineers calibrated each sensor twice before the test run " * 4,
    "The old lighthouse keeper wrote down every passing ship in a leather notebook and " * 4,
    "Our quarterly report shows that the new warehouse cut the delivery times for most " * 4,
]
ROUNDS = 4


@pytest.fixture(scope="module")
def replicas():
    pair = [start_replica(), start_replica()]
    yield pair
    for r in pair:
        stop(r.proc)


@pytest.fixture()
def routers(tmp_path):
    started: list[Router] = []

    def start(kind: str, policy: str, reps: list[Replica]) -> Router:
        router = start_router(kind, policy, reps, tmp_path)
        started.append(router)
        return router

    yield start
    for router in started:
        stop(router.proc)


def warm_and_route(router: Router, replicas: list[Replica], a: str, b: str) -> tuple[list, float]:
    """Cache prefix a on replica 0 and b on replica 1 directly (behind the router's back), then
    send ROUNDS x (a, a, b, b) through the router; (replica per request, prefix-hit tokens)."""
    for replica, prefix in zip(replicas, (a, b)):
        assert replica.complete(prefix).status_code == 200
    hits = sum(r.prefix_hits for r in replicas)
    routes = []
    for k in range(ROUNDS):
        for name, prefix in (("a", a), ("a", a), ("b", b), ("b", b)):
            routes.append((name, router.route(prefix + f" question {k} {len(routes)}")))
    return routes, sum(r.prefix_hits for r in replicas) - hits


def test_vllm_router_kv_aware_follows_the_replicas_kv_events(replicas, routers) -> None:
    kv = routers("vllm", "kv_aware", replicas)
    routes, kv_hits = warm_and_route(kv, replicas, PREFIXES[0], PREFIXES[1])
    assert routes == [("a", 0), ("a", 0), ("b", 1), ("b", 1)] * ROUNDS, routes
    stop(kv.proc)
    rr = routers("vllm", "round_robin", replicas)
    routes, rr_hits = warm_and_route(rr, replicas, PREFIXES[2], PREFIXES[3])
    assert {i for name, i in routes if name == "a"} == {0, 1}  # a reached the other replica
    # The same workload: under kv_aware every request found its whole prefix (4 blocks of 16
    # at least); round_robin computed each prefix once more on the replica without it.
    assert kv_hits >= 4 * ROUNDS * 64
    assert kv_hits >= rr_hits + 2 * 64, (kv_hits, rr_hits)


def shared_prefix_run(router: Router, prefix: str) -> list[int]:
    return [router.route(prefix + f" item {k}") for k in range(2 * ROUNDS)]


def test_sglang_router_cache_aware_keeps_a_prefix_on_one_replica(replicas, routers) -> None:
    aware = routers("sglang", "cache_aware", replicas)
    before = sum(r.prefix_hits for r in replicas)
    routes = shared_prefix_run(aware, PREFIXES[0] + "sglang ")
    aware_hits = sum(r.prefix_hits for r in replicas) - before
    assert len(set(routes)) == 1, routes  # all on the replica that computed it first
    stop(aware.proc)
    rr = routers("sglang", "round_robin", replicas)
    before = sum(r.prefix_hits for r in replicas)
    routes = shared_prefix_run(rr, PREFIXES[1] + "sglang ")
    rr_hits = sum(r.prefix_hits for r in replicas) - before
    assert sorted(set(routes)) == [0, 1]
    assert aware_hits > rr_hits, (aware_hits, rr_hits)  # round_robin computes it twice


def test_a_killed_replica_loses_only_its_in_flight_requests(routers) -> None:
    # Requests of 500 tokens each, whatever the model says (ignore_eos): the victim is still
    # decoding its two when it is killed.
    pair = [start_replica(("--max-model-len=512",)), start_replica(("--max-model-len=512",))]
    try:
        router = routers("vllm", "round_robin", pair)
        results: list[tuple[int, str]] = []

        def long_request(i: int) -> None:
            r = router.complete(f"story number {i}:", max_tokens=500, ignore_eos=True)
            results.append((r.status_code, r.text))

        threads = [threading.Thread(target=long_request, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        victim = pair[1]
        wait_until(lambda: victim.metric("num_requests_running") >= 1, 60, "work on replica 1")
        served_before = pair[0].requests
        victim.kill()
        for t in threads:
            t.join(180)
        assert len(results) == 4
        for status, text in results:  # answered, or failed with an error body
            assert status == 200 or (status >= 500 and text), (status, text)
        assert sum(status == 200 for status, _ in results) >= 2  # the survivor's two
        later = [router.complete(f"later {k}", max_tokens=4) for k in range(6)]
        assert [r.status_code for r in later] == [200] * 6, [r.text for r in later]
        assert pair[0].requests >= served_before + 6  # all answered by the survivor
    finally:
        for r in pair:
            stop(r.proc)
