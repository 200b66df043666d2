import pytest

from radixtier.eviction import LEAVES_FIRST, PLAIN_LRU, EvictionOrder, smallest_live


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


# ---------------------------------------------------------------- against a reference model
from hypothesis import given, settings, strategies as st  # noqa: E402

KEYS = "abcdef"
OPS = st.lists(st.tuples(st.sampled_from(("add", "add_pinned", "remove", "touch", "touch_40", "pin", "unpin", "hold",
                                          "unhold", "set_parent", "insert_above", "insert_above_pinned")),
                         st.sampled_from(KEYS), st.sampled_from(KEYS + "-")), max_size=60)


class _Model:
    """The order's rules written as plainly as possible: a present key's link to its parent (kept
    while the parent is away, as long as some present key still links to it), pins, the held mark,
    and a stamp per add or touch; the victims are the held ones, then the childless ones, oldest first."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.link, self.stamp, self.pins, self.held = {}, {}, {}, {}
        self.clock = 0

    def _tick(self) -> int:
        self.clock += 1
        return self.clock

    def _children(self, key: str) -> int:
        return sum(1 for k, p in self.link.items() if p == key)

    def add(self, key: str, parent, pinned: bool) -> None:
        if key in self.stamp:
            self.stamp[key] = self._tick()
            return
        self.stamp[key], self.pins[key], self.held[key] = self._tick(), int(pinned), False
        # a parent present, or away with a present key still linked to it, is kept
        self.link[key] = parent if parent is not None and (parent in self.stamp or self._children(parent)) else None

    def remove(self, key: str) -> None:
        for d in (self.stamp, self.pins, self.held, self.link):
            d.pop(key, None)

    def evictable(self, key: str) -> bool:
        if self.pins[key]:
            return False
        if self.held[key] and self.mode != PLAIN_LRU:
            return True
        return self.mode == PLAIN_LRU or self._children(key) == 0

    def victims(self) -> list:
        first = lambda k: (not (self.held[k] and self.mode != PLAIN_LRU), self.stamp[k])  # noqa: E731
        return sorted((k for k in self.stamp if self.evictable(k)), key=first)


@settings(max_examples=300, deadline=None)
@given(ops=OPS, mode=st.sampled_from((LEAVES_FIRST, PLAIN_LRU)))
def test_the_order_matches_a_plain_model_of_its_rules(ops, mode):
    o, m = EvictionOrder(mode), _Model(mode)
    for op, key, other in ops:
        parent = None if other in ("-", key) else other  # a key is never its own parent
        present = key in m.stamp
        if op in ("add", "add_pinned"):
            o.add(key, parent, pinned=op == "add_pinned")
            m.add(key, parent, op == "add_pinned")
        elif op == "remove":
            o.remove(key)
            m.remove(key)
        elif op == "touch":
            o.touch(key)
            if present:
                m.stamp[key] = m._tick()
        elif op == "touch_40":  # a store's batch of reads: 40 touches leave stale entries, the heaps compact
            batch = [key, other] * 20
            o.touch_many(batch)
            for k in batch:
                if k in m.stamp:
                    m.stamp[k] = m._tick()
        elif op == "pin" and present:
            o.pin(key)
            m.pins[key] += 1
        elif op == "unpin" and present and m.pins[key]:
            o.unpin(key)
            m.pins[key] -= 1
        elif op in ("hold", "unhold"):
            o.hold(key, op == "hold")
            if present and mode != PLAIN_LRU:
                m.held[key] = op == "hold"
        elif op.startswith("insert_above") and present and parent is not None and parent not in m.stamp \
                and not m._children(parent):  # a tree split's head: a key the order has never seen
            o.insert_above(key, parent, pinned=op.endswith("pinned"))
            m.link[parent], m.link[key] = m.link[key], parent
            m.stamp[parent], m.pins[parent], m.held[parent] = m._tick(), int(op.endswith("pinned")), False
        elif op == "set_parent" and present:
            o.set_parent(key, parent)
            m.link[key] = parent if parent in m.stamp else None
        want = m.victims()
        assert o.victims(len(KEYS)) == want
        assert o.peek_victim() == (want[0] if want else None)
        assert o.num_evictable() == len(want)
        for k in KEYS:
            assert o.is_evictable(k) == (k in want)
            if k in m.stamp:
                assert o.children_of(k) == m._children(k)


def test_touching_keys_over_and_over_does_not_grow_the_order():
    """A touch leaves a stale entry behind in the heap; they must be dropped, not pile up."""
    import tracemalloc

    o = EvictionOrder()
    for k in range(1000):
        o.add(k)
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for i in range(100_000):
        o.touch(i % 1000)
    grown = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    assert grown < 1_000_000, f"{grown} bytes kept for 1,000 keys touched 100,000 times"
    assert o.num_evictable() == 1000 and o.peek_victim() == 0


@pytest.mark.parametrize("mode", [LEAVES_FIRST, PLAIN_LRU])
def test_asking_for_a_few_victims_gives_the_oldest_despite_stale_entries(mode):
    o = EvictionOrder(mode)
    for k in range(20_000):
        o.add(k)
    for k in range(0, 5_000, 2):  # stale entries near the top of the heap
        o.touch(k)
    assert o.victims(64) == list(range(1, 5_000, 2))[:64]


def test_the_smallest_live_items_of_a_heap_are_found_without_walking_it():
    """The write-back cleaner asks for 64 victims under the cache lock: the answer must not walk
    the whole heap (100k entries took 12 ms), stale entries and all."""
    import heapq

    heap = [(stamp, stamp, stamp) for stamp in range(20_000)]
    heapq.heapify(heap)
    stale = set(range(0, 5_000, 2))
    examined = []

    def is_live(item):
        examined.append(item)
        return item[1] not in stale

    got = smallest_live(heap, 64, is_live)
    assert [item[0] for item in got] == list(range(1, 5_000, 2))[:64]
    assert len(examined) < 2_000, f"{len(examined)} items examined for 64 live ones"


@pytest.mark.parametrize("mode", [LEAVES_FIRST, PLAIN_LRU])
def test_keys_add_no_objects_the_garbage_collector_walks(mode):
    """A store holds an order entry per page for as long as the page lives: an object per key
    made every full collection walk a million of them (125 ms against 11 ms, every thread paused)."""
    import gc

    keys = [i.to_bytes(16, "little") for i in range(10_000)]
    o = EvictionOrder(mode)
    gc.collect()
    before = len(gc.get_objects())
    for i, k in enumerate(keys):
        o.add(k, keys[i - 1] if i % 64 else None)
    o.touch_many(keys[::3])
    o.hold(keys[5])
    o.pin(keys[7])
    gc.collect()  # tuples of plain values are untracked by a collection; objects of ours are not
    grown = len(gc.get_objects()) - before
    assert grown < 100, f"{grown} objects tracked by the garbage collector for 10,000 keys"
