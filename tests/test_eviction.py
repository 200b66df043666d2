import pytest

from radixtier.storage.nvmeof.eviction import LEAVES_FIRST, PLAIN_LRU, EvictionOrder


def test_leaves_first_never_drops_a_parent_before_its_children():
    o = EvictionOrder()
    o.add("x")
    o.add("a")
    o.add("b", "a")
    o.add("c", "b")
    o.touch("a")  # 'a' is the most recent, but it has a child: not evictable
    assert o.victims(10) == ["x", "c"]
    o.remove("c")
    assert o.victims(10) == ["x", "b"]
    o.remove("b")
    assert o.victims(10) == ["x", "a"]


def test_lru_mode_ignores_children():
    o = EvictionOrder("lru")
    o.add("a")
    o.add("b", "a")
    assert o.peek_victim() == "a"


def test_pinned_keys_are_not_victims():
    o = EvictionOrder()
    o.add("a")
    o.add("b")
    o.pin("a")
    assert o.victims(5) == ["b"]
    o.unpin("a")
    assert set(o.victims(5)) == {"a", "b"}
    with pytest.raises(RuntimeError):
        o.unpin("a")


def test_removed_parent_does_not_corrupt_child_counts():
    o = EvictionOrder()
    o.add("p")
    o.add("c", "p")
    o.remove("p")  # forced removal (e.g. a corrupt page) while the child stays
    o.add("p")  # the parent comes back: it does not count the old child
    o.remove("c")
    assert o.children_of("p") == 0
    assert o.peek_victim() == "p"


def test_bad_mode_is_named():
    with pytest.raises(ValueError, match="eviction mode"):
        EvictionOrder("fifo")


def test_held_key_goes_first_even_with_children():
    o = EvictionOrder(LEAVES_FIRST)
    o.add("a")
    o.add("b", "a")
    o.add("c", "b")
    assert o.peek_victim() == "c"
    o.hold("a")
    assert o.peek_victim() == "a" and o.is_evictable("a")
    o.hold("a", False)
    assert o.peek_victim() == "c" and not o.is_evictable("a")


def test_held_parent_evicted_then_back_rejoins_its_children():
    o = EvictionOrder(LEAVES_FIRST)
    o.add("a")
    o.add("b", "a")
    o.add("c", "a")
    o.hold("a")
    o.remove("a")  # a faster tier holds it; tier 3 let it go first
    assert "a" not in o and o.parent_of("b") is None
    o.add("a")  # written back down when the faster tier let go
    assert o.children_of("a") == 2 and not o.is_evictable("a")
    assert o.parent_of("b") == "a"
    o.remove("b")
    o.remove("c")
    assert o.is_evictable("a")


def test_children_leaving_while_parent_is_away():
    o = EvictionOrder(LEAVES_FIRST)
    o.add("a")
    o.add("b", "a")
    o.remove("a")
    o.remove("b")
    o.add("a")
    assert o.children_of("a") == 0 and o.peek_victim() == "a"


def test_plain_lru_ignores_hold():
    o = EvictionOrder(PLAIN_LRU)
    o.add("a")
    o.add("b", "a")
    o.hold("b")
    assert o.peek_victim() == "a"


def test_child_added_while_parent_is_away_joins_it_on_return():
    o = EvictionOrder(LEAVES_FIRST)
    o.add("a")
    o.add("b", "a")
    o.remove("a")
    o.add("c", "a")
    o.add("a")
    assert o.children_of("a") == 2 and o.parent_of("c") == "a"
