"""The KeysManager's pure eviction rule: LRU, stages with live replicas last, protected stages never."""

from __future__ import annotations

import pytest

from keysmanager.eviction import CacheEntry, eviction_order, plan_eviction

MB = 1 << 20


def test_lru_order_evicts_oldest_first_and_stops_when_it_fits():
    entries = [CacheEntry("a", 100 * MB, last_used=3.0), CacheEntry("b", 100 * MB, last_used=1.0),
               CacheEntry("c", 100 * MB, last_used=2.0)]
    plan = plan_eviction(entries, memory_used=300 * MB, memory_limit=350 * MB, incoming_bytes=100 * MB)
    assert plan.evict == ("b",)
    assert plan.satisfied and plan.freed_bytes == 100 * MB
    plan = plan_eviction(entries, memory_used=300 * MB, memory_limit=250 * MB, incoming_bytes=100 * MB)
    assert plan.evict == ("b", "c")


def test_stage_with_live_replicas_goes_last_even_if_least_recent():
    entries = [CacheEntry("busy", 100 * MB, last_used=0.0, live_replicas=2),
               CacheEntry("idle-new", 100 * MB, last_used=9.0), CacheEntry("idle-old", 100 * MB, last_used=5.0)]
    assert [e.function for e in eviction_order(entries)] == ["idle-old", "idle-new", "busy"]
    plan = plan_eviction(entries, 300 * MB, 100 * MB)
    assert plan.evict == ("idle-old", "idle-new")
    assert plan.satisfied


def test_nothing_to_do_under_the_limit_and_protected_never_chosen():
    entries = [CacheEntry("a", 10, 1.0), CacheEntry("b", 10, 2.0)]
    assert plan_eviction(entries, 20, 100).evict == ()
    plan = plan_eviction(entries, 20, 0, incoming_bytes=10, protect={"a"})
    assert plan.evict == ("b",)
    assert not plan.satisfied  # a is protected: only 10 of the 30 bytes can go


def test_negative_figures_are_rejected():
    with pytest.raises(ValueError):
        plan_eviction([], -1, 10)


def test_an_entry_that_frees_nothing_is_not_evicted():
    entries = [CacheEntry("shared", 0, last_used=0.0, live_replicas=3), CacheEntry("idle", 50, last_used=1.0)]
    plan = plan_eviction(entries, 150, 50)
    assert plan.evict == ("idle",) and not plan.satisfied


def test_pinned_zygotes_go_last_and_never_for_an_opportunistic_cache():
    entries = [CacheEntry("key", 100 * MB, last_used=0.0, pinned=True),
               CacheEntry("busy", 100 * MB, last_used=1.0, live_replicas=1),
               CacheEntry("idle", 100 * MB, last_used=5.0)]
    assert [e.function for e in eviction_order(entries)] == ["idle", "busy", "key"]
    # the oldest zygote is pinned: the unpinned ones go first, even one with live replicas
    plan = plan_eviction(entries, 300 * MB, 200 * MB, incoming_bytes=100 * MB)
    assert plan.evict == ("idle", "busy") and plan.satisfied
    # a host over its limit still gets under it: a pin is evicted last, not never
    plan = plan_eviction(entries, 300 * MB, 50 * MB)
    assert plan.evict == ("idle", "busy", "key") and plan.satisfied
    # caching another stage may not displace a pinned zygote
    plan = plan_eviction(entries, 300 * MB, 50 * MB, evict_pinned=False)
    assert plan.evict == ("idle", "busy") and not plan.satisfied


def test_duplicates_go_before_sole_copies_of_the_cluster():
    """One cached copy per cluster is enough (the others fetch from it): an older sole copy outlives a newer
    duplicate; pins still rank above both."""
    entries = [CacheEntry("sole-old", 10, last_used=1.0, sole_copy=True),
               CacheEntry("dup-new", 10, last_used=5.0),
               CacheEntry("pinned-dup", 10, last_used=0.5, pinned=True)]
    assert [e.function for e in eviction_order(entries)] == ["dup-new", "sole-old", "pinned-dup"]
    plan = plan_eviction(entries, memory_used=30, memory_limit=25)
    assert plan.evict == ("dup-new",) and plan.satisfied
