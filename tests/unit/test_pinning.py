"""Page-locking shared memory for the GPU (kvps.pinning), with a host stand-in for
cudaHostRegister: steps locked once as copies reach them, only where pages are reserved,
unlocked before the mapping goes, and a failed lock is a logged fallback, never an error."""

import gc
import logging

import numpy as np
import pytest
from page_locking import HostLocker

from kvps import pinning
from kvps.wire import shm
from kvps.wire.shm import HEADER_BYTES, Heap, Mapping, Segment

KB = 1 << 10


class Memory:
    """Stands for a mapping's memory object (and its owner, whose collection removes it)."""


def region(registry, start=1 << 20, size=10 * KB, step=4 * KB, writable=True):
    owner = Memory()
    return owner, registry.add(owner, Memory(), start, size, step, writable, 'test memory')


def test_steps_are_locked_once_each_as_copies_reach_them():
    locker = HostLocker()
    registry = pinning.Registry(locker)
    _, r = region(registry)
    base = r.start
    assert locker.log == []                                   # nothing locked before a copy
    assert registry.spans(base + 100, 200) == [(0, 200)]
    assert locker.log == [('lock', base, 4 * KB, True)]
    # a range across two steps: cut where it crosses, the second step locked now
    assert registry.spans(base + 3 * KB, 2 * KB) == [(0, KB), (KB, KB)]
    assert registry.spans(base + 8 * KB, 2 * KB) == [(0, 2 * KB)]     # the last, short step
    assert locker.log[1:] == [('lock', base + 4 * KB, 4 * KB, True),
                              ('lock', base + 8 * KB, 2 * KB, True)]
    assert registry.spans(base, 10 * KB) == [(0, 4 * KB), (4 * KB, 4 * KB), (8 * KB, 2 * KB)]
    assert len(locker.log) == 3                               # each step once
    assert registry.spans(base, 0) == []


def test_ranges_outside_every_region_and_a_registry_without_locker_lock_nothing():
    locker = HostLocker()
    registry = pinning.Registry(locker)
    _, r = region(registry)
    assert registry.spans(r.start - 1, 8) is None             # starts before it
    assert registry.spans(r.start + 10 * KB - 4, 8) is None   # runs past its end
    assert registry.spans(12345, 8) is None and locker.log == []
    idle = pinning.Registry()
    _, r = region(idle)
    assert idle.spans(r.start, 8) is None and not idle.working
    idle.use(locker)
    idle.use(HostLocker())                                    # the first locker stays
    assert idle.locker is locker and idle.spans(r.start, 8) == [(0, 8)]


def test_removing_a_region_unlocks_every_step_it_locked_once():
    locker = HostLocker()
    registry = pinning.Registry(locker)
    _, r = region(registry)
    registry.spans(r.start, 10 * KB)
    assert r.memory is not None                               # held: mapped while locked
    registry.remove(r)
    registry.remove(r)
    assert locker.locked == {} and r.memory is None
    assert sorted(e[1] for e in locker.log if e[0] == 'unlock') == \
        sorted(e[1] for e in locker.locks())
    assert registry.spans(r.start, 8) is None                 # forgotten


def test_a_region_whose_owner_goes_without_removing_it_is_unlocked_then():
    locker = HostLocker()
    registry = pinning.Registry(locker)
    owner, r = region(registry)
    registry.spans(r.start, 5 * KB)
    del owner
    gc.collect()
    assert locker.locked == {} and registry.spans(r.start, 8) is None


def test_a_failed_lock_is_logged_once_and_nothing_more_is_locked(caplog):
    locker = HostLocker(refuse=lambda address, nbytes, writable: address % (8 * KB) == 0)
    registry = pinning.Registry(locker)
    _, r = region(registry, start=1 << 20)                    # its third step is refused
    assert registry.spans(r.start + 4 * KB, 8) == [(0, 8)]
    with caplog.at_level(logging.INFO, logger='kvps'):
        assert registry.spans(r.start, 6 * KB) is None        # its first step is refused
        assert registry.spans(r.start + 4 * KB, 8) is None    # no more, even where locked
    assert not registry.working and 'RLIMIT_MEMLOCK' in registry.failed
    warned = [rec for rec in caplog.records if 'cannot page-lock' in rec.getMessage()]
    assert len(warned) == 1 and warned[0].levelno == logging.WARNING
    assert 'pinned staging buffers' in warned[0].getMessage()
    registry.remove(r)
    assert locker.locked == {}                                # what was locked is unlocked


def test_read_only_memory_a_gpu_cannot_lock_leaves_writable_memory_locking():
    locker = HostLocker(refuse=lambda address, nbytes, writable: not writable)
    registry = pinning.Registry(locker)
    _, ro = region(registry, start=1 << 20, writable=False)
    _, rw = region(registry, start=2 << 20)
    assert registry.spans(ro.start, 8) is None and registry.spans(rw.start, 8) == [(0, 8)]
    assert registry.working and registry.failed is None


def test_a_growing_segment_is_locked_only_in_the_steps_its_blocks_reserved(tmp_path, locker,
                                                                          monkeypatch):
    monkeypatch.setattr(shm, 'RESERVE_STEP', 64 * KB)
    segment = Segment.create(256 * KB, directory=tmp_path, grows=True)
    held = []
    for _ in range(5):
        offset, block = segment.take(40 * KB)
        held.append(block)
        assert pinning.REGISTRY.spans(block.ctypes.data, block.nbytes) is not None
        for address, (nbytes, _) in locker.locked.items():     # every lock in reserved pages
            assert address - segment.address + nbytes <= segment.reserved
    assert segment.reserved == 256 * KB
    assert [e[1] - segment.address for e in locker.locks()] == [0, 64 * KB, 128 * KB, 192 * KB]
    segment.close()
    assert locker.locked == {}                                # closed: every step unlocked


def test_mappings_of_peers_are_regions_released_before_they_go(tmp_path, locker):
    arena = Segment.create(1 << 20, directory=tmp_path, allocator=Heap, grows=True)
    seen = Mapping.open(arena.name, arena.nonce, arena.size, tmp_path, writable=False)
    offset, block = arena.take(4 * KB)
    block[:] = 3
    view = np.frombuffer(seen.view(offset, 4 * KB), np.uint8)
    assert pinning.REGISTRY.spans(view.ctypes.data, view.nbytes) == [(0, 4 * KB)]
    assert [e[3] for e in locker.locks()] == [False]          # a read-only mapping: locked so
    seen.release()
    assert locker.locked == {} and view[0] == 3               # views stay valid, unlocked
    arena.close()


def test_header_bytes_lie_in_the_first_step(tmp_path, locker):
    segment = Segment.create(1 << 20, directory=tmp_path, grows=True)
    assert pinning.REGISTRY.spans(segment.address, HEADER_BYTES) == [(0, HEADER_BYTES)]
    segment.close()


@pytest.mark.parametrize('offset, nbytes, step, want', [
    (0, 10, 4, [(0, 4), (4, 4), (8, 2)]), (3, 2, 4, [(0, 1), (1, 1)]), (4, 4, 4, [(0, 4)])])
def test_ranges_are_cut_at_step_boundaries(offset, nbytes, step, want):
    assert pinning._cut(offset, nbytes, step) == want
