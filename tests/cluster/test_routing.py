"""Routing policies and the N-replica simulator (no Ray needed)."""

from __future__ import annotations

from radixgen import EngineConfig
from radixgen.cluster.routing import UNAVAILABLE, PrefixAffinity, RoundRobin, make_router
from radixgen.cluster.simulate import multi_tenant_trace, simulate_cluster

SYSTEM_A = list(range(100, 164))  # four 16-token blocks
SYSTEM_B = list(range(500, 564))


def test_round_robin_takes_turns_and_skips_unavailable_replicas() -> None:
    router = RoundRobin()
    assert [router.choose([1], [0, 0, 0]) for _ in range(4)] == [0, 1, 2, 0]
    assert {router.choose([1], [0, UNAVAILABLE, 0]) for _ in range(6)} == {0, 2}


def test_a_shared_prefix_goes_back_to_its_replica() -> None:
    router = PrefixAffinity(block_size=16)
    first = router.choose(SYSTEM_A + [1, 2, 3], [0, 0, 0])
    other = router.choose(SYSTEM_B + [4], [1 if r == first else 0 for r in range(3)])
    assert other != first, "an unseen prefix goes to the least loaded replica"
    loads = [1, 1, 1]
    assert router.choose(SYSTEM_A + [9, 9], loads) == first, "same system prompt, other question"
    assert router.choose(SYSTEM_B + [7] * 40, loads) == other
    assert router.matched_tokens == 2 * 64


def test_an_overloaded_replica_sheds_its_prefixes_and_a_dead_one_is_avoided() -> None:
    router = PrefixAffinity(block_size=16, balance_abs=4, balance_rel=1.5)
    home = router.choose(SYSTEM_A, [0, 0])
    other = 1 - home
    loads = [0, 0]
    loads[home] = 10
    assert router.choose(SYSTEM_A + [1], loads) == other, "10 against 0 is past the imbalance bound"
    loads = [0, 0]
    loads[other] = 3
    assert router.choose(SYSTEM_A + [2], loads) == other, "the prefix now lives there; 3 against 0 is within the bound"
    loads[other] = UNAVAILABLE
    assert router.choose(SYSTEM_A + [3], loads) == home
    router.forget_replica(home)
    assert router.choose(SYSTEM_A + [4], [5, 0]) == 1, "a forgotten prefix goes to the least loaded replica"


def test_idle_replicas_take_different_prefixes() -> None:
    router = PrefixAffinity(block_size=16)
    chosen = {router.choose([k] * 16 + [1], [0, 0, 0, 0]) for k in range(200, 240)}
    assert len(chosen) == 4, "equal loads: the tie is broken by the prefix, not always replica 0"


def test_prefix_affinity_beats_round_robin_in_simulation() -> None:
    trace = multi_tenant_trace(400, rate=6.0, seed=3)
    config = EngineConfig(kv_cache_tokens=16384)
    rr = simulate_cluster(trace, 4, make_router("round-robin"), config)
    pa = simulate_cluster(trace, 4, make_router("prefix-affinity"), config)
    assert rr.completed == pa.completed == 400
    assert pa.cache_hit_rate > rr.cache_hit_rate + 0.1, (pa.cache_hit_rate, rr.cache_hit_rate)
    assert pa.queue_delay_p95_s < rr.queue_delay_p95_s
    assert pa.max_load_share < 0.4, "bounded imbalance: no replica takes the popular tenants alone"
    single = simulate_cluster(trace, 1, make_router("prefix-affinity"), config)
    assert single.completed == 400 and single.max_load_share == 1.0
