import pytest

from radixtier.eviction import EvictionOrder


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
