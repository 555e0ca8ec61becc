"""The embedding table's id index (model/embedding/id_index.py) against a dict, batch by batch."""

from __future__ import annotations

import os

import numpy as np
import pytest

from elasticdl.model.embedding import id_index as id_index_module
from elasticdl.model.embedding.id_index import MAX_LOAD, TOMBSTONE, IdIndex
from elasticdl.model.embedding.memory import MappedArray


class Model:
    """An IdIndex and the dict it must agree with; positions handed out like the table does."""

    def __init__(self, capacity: int = 1024):
        self.index = IdIndex(capacity)
        self.expected: dict[int, int] = {}
        self.free: list[int] = []
        self.end = 0

    def add(self, keys: np.ndarray) -> np.ndarray:
        keys = np.array([k for k in dict.fromkeys(keys.tolist()) if k not in self.expected], np.int64)
        reused = [self.free.pop() for _ in range(min(len(self.free), keys.size))]
        fresh = list(range(self.end, self.end + keys.size - len(reused)))
        self.end += len(fresh)
        positions = np.array(reused + fresh, np.int64)
        if self.end > self.index.capacity:
            self.index.resize(max(self.end, 2 * self.index.capacity))
        self.index.add(keys, positions)
        self.expected.update(zip(keys.tolist(), positions.tolist()))
        return positions

    def remove(self, keys: list[int]) -> None:
        positions = np.array([self.expected.pop(k) for k in keys], np.int64)
        self.index.remove(positions)
        self.free.extend(positions.tolist())

    def check(self, probe: np.ndarray) -> None:
        got = self.index.find(probe)
        np.testing.assert_array_equal(got, [self.expected.get(k, -1) for k in probe.tolist()])
        assert len(self.index) == len(self.expected)
        assert set(self.index) == set(self.expected)


def test_it_finds_what_a_dict_finds_through_adds_removals_and_rebuilds():
    rng = np.random.default_rng(0)
    model = Model()
    for round_ in range(60):
        batch = rng.integers(0, 50_000, rng.integers(1, 3000))  # duplicates and ids held already
        model.add(batch)
        if model.expected and round_ % 3:
            held = np.array(list(model.expected))
            model.remove(rng.choice(held, size=min(held.size, int(rng.integers(1, 2000))), replace=False).tolist())
        model.check(np.concatenate([batch, rng.integers(0, 60_000, 500)]))
    # Churn leaves tombstones, and rebuilds keep them (and the load) bounded.
    index = model.index
    assert index._live + index._tombstones <= MAX_LOAD * index._slots.size


def test_ids_that_share_a_home_slot_are_all_found(monkeypatch):
    # Every id hashes to one slot: one cluster as long as the batch, probed in windows.
    monkeypatch.setattr(IdIndex, "_home", lambda self, keys: np.zeros(np.asarray(keys).size, np.intp))
    model = Model()
    model.add(np.arange(0, 700, 7, dtype=np.int64))
    model.remove([0, 49, 350])  # tombstones inside the cluster: lookups go past them
    model.add(np.array([1000, 1001], np.int64))  # reuse them
    model.check(np.arange(0, 1100, dtype=np.int64))
    assert model.index._tombstones == 1


@pytest.mark.parametrize("keys", [
    np.arange(1, 200_001, dtype=np.int64) << 40,  # ids that differ in their high bits only
    np.arange(200_000, dtype=np.int64) * 4 + 3,  # the ids of PS 3 of 4
    np.random.default_rng(1).integers(0, 2**63 - 1, 200_000),  # hashed crosses
], ids=["high-bits", "one-shard", "random"])
def test_probes_stay_short_for_structured_ids(keys):
    model = Model()
    for start in range(0, keys.size, 8192):
        model.add(keys[start:start + 8192])
    index = model.index
    home = index._home(keys)
    slots = index._locate(keys)
    distance = (slots - home) & (index._slots.size - 1)
    assert distance.mean() < 2 and distance.max() < 64  # linear probing at a load <= 0.5
    model.check(keys[::97])


def test_a_removed_id_reads_as_missing_and_its_slot_is_reused():
    index = IdIndex(1024)
    index.add(np.array([5, 6, 7], np.int64), np.array([0, 1, 2]))
    index.remove(np.array([1]))
    np.testing.assert_array_equal(index.find(np.array([5, 6, 7], np.int64)), [0, -1, 2])
    assert (index._slots == TOMBSTONE).sum() == 1 and 6 not in index and 7 in index
    index.add(np.array([6], np.int64), np.array([1]))
    assert index._tombstones <= 1 and index.find(np.array([6], np.int64))[0] == 1


def test_removing_a_position_that_is_not_indexed_is_an_error_not_a_silent_miss():
    index = IdIndex(1024)
    index.add(np.array([5], np.int64), np.array([0]))
    index.ids[3] = 99  # a position the index never mapped
    with pytest.raises(RuntimeError, match="out of step"):
        index.remove(np.array([3]))


def test_a_copy_does_not_change_with_the_original():
    index = IdIndex(1024)
    index.add(np.arange(100, dtype=np.int64), np.arange(100))
    snapshot = index.copy()
    index.remove(np.arange(50))
    index.add(np.arange(1000, 1050, dtype=np.int64), np.arange(50))
    np.testing.assert_array_equal(snapshot.find(np.arange(100, dtype=np.int64)), np.arange(100))
    assert (snapshot.find(np.arange(1000, 1050, dtype=np.int64)) == -1).all()


def test_churn_rebuilds_are_amortized(monkeypatch):
    # A max_rows table under an endless stream: each batch evicts as many rows as it adds.
    rebuilds = []
    original = IdIndex._rebuild
    monkeypatch.setattr(IdIndex, "_rebuild", lambda self, live: (rebuilds.append(live), original(self, live)))
    model = Model()
    model.add(np.arange(10_000, dtype=np.int64))
    before = len(rebuilds)
    for batch in range(1, 200):
        model.remove(list(range((batch - 1) * 500, batch * 500)))
        model.add(np.arange(10_000 + (batch - 1) * 500, 10_000 + batch * 500, dtype=np.int64))
    # 99,500 inserts into a ~10,000-id index: a rebuild at most every 0.15 x slots inserts.
    slots = model.index._slots.size
    assert len(rebuilds) - before <= 99_500 // int((MAX_LOAD - id_index_module.REBUILT_LOAD) * slots) + 1
    model.check(np.arange(0, 120_000, 37, dtype=np.int64))


def test_a_mapped_array_grows_in_place_and_copies_only_when_a_view_is_alive():
    store = MappedArray(1000, (3,), np.float32)
    rows = store.array()
    rows[:] = np.arange(3000, dtype=np.float32).reshape(1000, 3)
    rows = None
    grown = store.resized(5000)  # mremap: no view alive
    np.testing.assert_array_equal(grown[:1000].ravel(), np.arange(3000))
    grown[4990:] = 7  # the new rows are writable
    store.prefault(1000, 5000)
    kept = grown[:10]  # a live view: the mapping cannot move, so the rows are copied
    grown = None
    again = store.resized(20_000)
    np.testing.assert_array_equal(again[:1000].ravel(), np.arange(3000))
    assert (again[4990:5000] == 7).all() and again.shape == (20_000, 3)
    np.testing.assert_array_equal(kept.ravel(), np.arange(30))  # the old view still reads its rows


def _vm_flags(array: np.ndarray) -> list[str]:
    """The kernel's VmFlags of the mapping that holds ``array`` (/proc/self/smaps)."""
    address = array.__array_interface__["data"][0]
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(x, 16) for x in head.split("-"))
                inside = start <= address < end
            elif inside and head == "VmFlags:":
                return line.split()[1:]
    raise AssertionError("no mapping holds the array")


@pytest.mark.skipif(not os.path.exists("/sys/kernel/mm/transparent_hugepage"), reason="no transparent huge pages")
def test_a_mapped_array_asks_for_huge_pages_once_it_holds_one_even_after_growing():
    """Rows are read at random: 4 KiB pages cost a TLB miss per row on top of the cache miss."""
    store = MappedArray(1000, (48,), np.float32)  # 192 KB: 4 KiB pages
    small = store.array()
    assert "hg" not in _vm_flags(small)
    small = None
    assert "hg" in _vm_flags(store.resized(100_000))  # 19 MB, grown by mremap
    assert "hg" in _vm_flags(MappedArray(100_000, (48,), np.float32).array())


def test_a_mapped_array_without_huge_pages_works_in_small_pages(monkeypatch):
    """A Python or kernel without MADV_HUGEPAGE: the same array, in 4 KiB pages."""
    import mmap

    monkeypatch.delattr(mmap, "MADV_HUGEPAGE", raising=False)
    store = MappedArray(100_000, (48,), np.float32)
    rows = store.array()
    rows[-1] = 3
    assert "hg" not in _vm_flags(rows)
    rows = None
    assert (store.resized(200_000)[99_999] == 3).all()
