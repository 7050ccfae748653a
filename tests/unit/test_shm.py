"""Shared-memory segments: the ring and heap allocators, block lifetimes, every check a server
makes on what a worker names (segment, nonce, offsets), and a server's arena lent to a worker,
without sockets."""

import collections
import errno
import gc
import os

import numpy as np
import pytest

from kvps.wire import protocol as P
from kvps.wire import shm
from kvps.wire.items import PushItem
from kvps.optimizer.kernels.numpy_packing import PACK_UP_TO
from kvps.config import Config
from kvps.errors import KVPSError, ProtocolError
from kvps.server.regions import Regions
from kvps.server.storage import HostArrays, Storage
from kvps.server.shard import Shard
from kvps.wire.shm import (ALIGN, HEADER_BYTES, Heap, Mapping, Ring, Segment, aligned,
                           remove_leftovers)
from kvps.worker.staging import Arena, Staging

KB = 1024


def test_ring_reuses_space_only_once_every_earlier_block_is_free():
    ring = Ring(0, 4 * KB)
    a, b, c = ring.alloc(KB), ring.alloc(KB), ring.alloc(KB)
    assert (a, b, c) == (0, KB, 2 * KB)
    assert ring.alloc(2 * KB) is None              # full: never waits, never overlaps
    ring.free(b)                                   # out of order: a is still live
    assert ring.alloc(2 * KB) is None and len(ring) == 3
    ring.free(a)                                   # now a and b are reclaimed together
    assert len(ring) == 1
    d = ring.alloc(KB)                             # the tail end first
    assert d == 3 * KB
    e = ring.alloc(KB)                             # then wrap around to the start
    assert e == 0
    assert ring.alloc(KB) is None                  # [KB, 2KB) is free, but then head == tail
    ring.free(c)
    f = ring.alloc(KB)
    assert f == KB
    for offset in (d, e, f):
        ring.free(offset)
    assert len(ring) == 0 and ring.alloc(4 * KB) == 0


def test_ring_aligns_blocks_and_refuses_what_never_fits():
    ring = Ring(HEADER_BYTES, HEADER_BYTES + 10 * ALIGN)
    assert ring.alloc(1) == HEADER_BYTES
    assert ring.alloc(ALIGN + 1) == HEADER_BYTES + ALIGN
    assert ring.alloc(100 * ALIGN) is None
    assert ring.alloc(0) == HEADER_BYTES + 3 * ALIGN   # an empty block still gets its own line


def test_ring_wraps_past_an_unusable_gap_at_the_end():
    ring = Ring(0, 10 * KB)
    blocks = [ring.alloc(3 * KB) for _ in range(3)]   # 9 KB used, a 1 KB gap at the end
    ring.free(blocks[0])
    assert ring.alloc(2 * KB) == 0                     # does not fit the gap: wraps
    ring.free(blocks[1])
    ring.free(blocks[2])
    assert ring.alloc(6 * KB) == 2 * KB                # the gap is reclaimed with its block


def test_a_block_returns_only_when_every_view_of_it_is_gone(tmp_path):
    segment = Segment.create(1 << 20, directory=tmp_path)
    offset, block = segment.take(4000)
    assert offset >= HEADER_BYTES and offset % ALIGN == 0
    part = block.view(np.float32)[10:20]
    assert segment.offset_of(part) == offset + 40
    assert segment.offset_of(np.zeros(10)) is None
    del block
    gc.collect()
    assert len(segment.blocks) == 1                    # `part` still reads it
    del part
    assert len(segment.blocks) == 0
    segment.unlink()
    segment.unlink()                                   # idempotent
    assert os.listdir(tmp_path) == []


def test_the_launcher_removes_what_a_killed_worker_left(tmp_path):
    mine = Segment.create(1 << 16, directory=tmp_path)
    (tmp_path / 'kvps-1-0123456789abcdef').write_bytes(b'')
    (tmp_path / f'kvps-{os.getpid()}-other').write_bytes(b'')     # not a name kvps makes
    remove_leftovers(os.getpid(), directory=tmp_path)
    assert sorted(os.listdir(tmp_path)) == ['kvps-1-0123456789abcdef', f'kvps-{os.getpid()}-other']
    assert not os.path.exists(mine.path)


def test_segment_creation_fails_cleanly_without_room(tmp_path):
    with pytest.raises(KVPSError, match='bytes free'):
        Segment.create(1 << 40, directory=tmp_path)
    with pytest.raises(KVPSError, match='cannot create'):
        Segment.create(1 << 20, directory=tmp_path / 'missing')
    with pytest.raises(KVPSError, match='out of range'):
        Segment.create(10, directory=tmp_path)
    assert os.listdir(tmp_path) == []


def test_an_arena_reserves_its_pages_as_blocks_fill_it(tmp_path, monkeypatch):
    step = shm.RESERVE_STEP
    arena = Segment.create(4 * step, directory=tmp_path, allocator=Heap, grows=True)
    allocated = (lambda: os.fstat(arena.fd).st_blocks * 512)
    assert os.fstat(arena.fd).st_size == 4 * step
    assert arena.reserved == step and allocated() <= step        # the rest is a hole
    offset, block = arena.take(step)                               # crosses the first step
    assert arena.reserved == 2 * step and allocated() >= 2 * step - HEADER_BYTES
    block[:] = 7                                                   # reserved: safe to write
    # /dev/shm full: the block finds no room (never a SIGBUS later) and gives its space back
    monkeypatch.setattr(shm.os, 'posix_fallocate', _no_space)
    assert arena.take(2 * step) is None and arena.reserved == 2 * step
    monkeypatch.undo()                                             # room again
    again, _ = arena.take(2 * step)
    assert again == offset + step and arena.reserved == 4 * step   # the same space, now held
    arena.close()
    assert os.listdir(tmp_path) == []


def _no_space(fd, offset, length):
    raise OSError(errno.ENOSPC, 'No space left on device')


def test_a_ring_wraps_below_its_limit_before_it_asks_for_more():
    ring = Ring(0, 8 * KB)
    blocks = [ring.alloc(KB, 3 * KB) for _ in range(3)]
    assert blocks == [0, KB, 2 * KB] and ring.alloc(KB, 3 * KB) is None
    assert ring.reach(KB) == 4 * KB and ring.reach(6 * KB) is None   # at the head, within stop
    ring.free(blocks[0])
    ring.free(blocks[1])
    assert ring.alloc(KB, 3 * KB) == 0             # the start is free: reused, not more asked
    assert ring.alloc(KB, 8 * KB) is None and ring.reach(KB) is None  # wrapped: until [2KB, 3KB)
    ring.free(blocks[2])                                              # is free, no limit helps
    assert ring.reach(KB) == 2 * KB and ring.alloc(KB, 2 * KB) == KB


def test_a_worker_segment_reserves_pages_only_for_the_blocks_it_holds_at_once(tmp_path):
    step, mib = shm.RESERVE_STEP, 1 << 20
    segment = Segment.create(3 * step, directory=tmp_path, grows=True)
    allocated = (lambda: os.fstat(segment.fd).st_blocks * 512)
    assert segment.reserved == step and allocated() <= step
    held = collections.deque()
    for _ in range(8 * step // mib):               # 8 steps' worth, at most 3 MiB at once
        held.append(segment.take(mib)[1])
        if len(held) == 3:
            held.popleft()
    assert segment.reserved == step and allocated() <= step          # it wrapped instead
    held.clear()
    reserved = []
    while (taken := segment.take(mib)) is not None:                   # all held: it grows
        held.append(taken[1])
        reserved.append(segment.reserved)
    assert reserved == [-(-(HEADER_BYTES + n * mib) // step) * step
                        for n in range(1, len(held) + 1)]            # a step when needed
    assert len(held) == (3 * step - HEADER_BYTES) // mib and reserved[-1] == 3 * step
    assert allocated() <= 3 * step
    segment.close()
    assert os.listdir(tmp_path) == []


def test_a_worker_segment_that_cannot_grow_takes_nothing_for_the_block(tmp_path, monkeypatch):
    step, mib = shm.RESERVE_STEP, 1 << 20
    segment = Segment.create(2 * step, directory=tmp_path, grows=True)
    held = [segment.take(mib)[1] for _ in range((step - HEADER_BYTES) // mib)]   # a step full
    monkeypatch.setattr(shm.os, 'posix_fallocate', _no_space)
    assert segment.take(mib) is None and segment.reserved == step
    assert len(segment.blocks) == len(held)        # no block left allocated for it
    del held[:2]
    offset, block = segment.take(mib)              # what it holds is still there to reuse
    assert offset == HEADER_BYTES
    del held[:], block
    monkeypatch.undo()                             # room again
    assert segment.take(step)[0] == HEADER_BYTES and segment.reserved == 2 * step
    segment.close()


def test_a_server_maps_only_the_segment_announced(tmp_path):
    segment = Segment.create(1 << 20, directory=tmp_path)
    name, nonce, size = segment.name, segment.nonce, segment.size
    mapping = Mapping.open(name, nonce, size, directory=tmp_path)
    offset, block = segment.take(8)
    block[:] = 7
    assert bytes(mapping.view(offset, 8)) == b'\x07' * 8
    bad = [(('../' + name), nonce, size, 'not a kvps segment name'),
           ('kvps-1-0123456789abcdef', nonce, size, 'is gone'),
           (name, b'x' * 16, size, 'nonce differs'),
           (name, nonce[:8], size, '16 bytes'),
           (name, nonce, size * 2, 'not a segment of'),
           (name, nonce, 10, 'out of range'),
           (['x'], nonce, size, 'not a kvps segment name')]
    for args in bad:
        with pytest.raises(ProtocolError, match=args[3]):
            Mapping.open(*args[:3], directory=tmp_path)
    segment.unlink()


def test_a_segment_whose_name_is_gone_is_mapped_through_the_process_holding_it(tmp_path):
    segment = Segment.create(1 << 20, directory=tmp_path)
    described = segment.describe()
    assert (described['pid'], described['fd']) == (os.getpid(), segment.fd)
    offset, block = segment.take(8)
    block[:] = 9
    segment.unlink()                       # as every worker does once its servers mapped it
    args = segment.name, segment.nonce, segment.size
    with pytest.raises(ProtocolError, match='no process holding it'):
        Mapping.open(*args, directory=tmp_path)
    mapping = Mapping.open(*args, directory=tmp_path, holder=(os.getpid(), segment.fd))
    assert bytes(mapping.view(offset, 8)) == b'\x09' * 8     # a restarted server's way in
    read, write = os.pipe()                # a holder must name a plain shared-memory file
    other = tmp_path / 'other'
    other.write_bytes(bytes(segment.size))
    with open(other, 'rb') as plain:
        for holder, why in [((os.getpid(), read), 'not a shared-memory file'),
                            ((os.getpid(), 10 ** 6), 'cannot be opened'),
                            ((True, segment.fd), 'no process holding it'),
                            (('1', segment.fd), 'no process holding it'),
                            ((os.getpid(), plain.fileno()), 'nonce differs')]:
            with pytest.raises(ProtocolError, match=why):
                Mapping.open(*args, directory=tmp_path, holder=holder)
    os.close(read), os.close(write)
    segment.close()
    assert segment.fd is None and os.listdir(tmp_path) == ['other']


@pytest.mark.parametrize('offset, nbytes', [
    (0, 8), (HEADER_BYTES - 8, 16), (1 << 20, 1), ((1 << 20) - 4, 8), (-8, 8), (HEADER_BYTES, -1),
    (HEADER_BYTES, 1 << 40), (1 << 63, 8), ('4096', 8), (None, 8)])
def test_hostile_offsets_are_refused(tmp_path, offset, nbytes):
    segment = Segment.create(1 << 20, directory=tmp_path)
    mapping = Mapping.open(segment.name, segment.nonce, segment.size, directory=tmp_path)
    with pytest.raises(ProtocolError, match='outside the segment'):
        mapping.view(offset, nbytes)
    assert len(mapping.view((1 << 20) - 8, 8)) == 8
    segment.unlink()


def test_server_regions_keep_each_worker_to_its_own_segment(tmp_path):
    segment = Segment.create(1 << 20, directory=tmp_path)
    regions = Regions(directory=tmp_path)
    header = {'name': segment.name, 'nonce': segment.nonce, 'size': segment.size}
    regions.attach(b'worker-0', header)
    offset, block = segment.take(16)
    block.view(np.float32)[:] = [1, 2, 3, 4]
    items = [PushItem('k', 0, 'float32', 4, offset, 0), PushItem('s', 0, 'int8', 2, None, 0),
             PushItem('h', 0, 'float32', 4, 1 << 20, 0)]
    shm, frame, hostile = regions.payloads(b'worker-0', items, [b'ab'])
    assert P.as_array(shm, 'float32').tolist() == [1, 2, 3, 4] and frame == b'ab'
    assert shm.readonly   # an update must not clobber the worker's copy: it may resend it
    assert isinstance(hostile, ProtocolError)
    other = regions.payloads(b'worker-1', items[:1], [])[0]
    assert isinstance(other, ProtocolError) and 'not attached' in str(other)
    with pytest.raises(KVPSError, match='KVPS_SHM=0'):
        Regions(enabled=False).attach(b'worker-0', header)
    segment.unlink()


def test_staging_turns_shared_memory_items_into_frames_for_a_server_without_it(tmp_path):
    staging = Staging(Segment.create(1 << 22, directory=tmp_path))
    staging.attach_header('server 0')
    staging.attach_header('server 1')
    staging.answered('server 0')
    assert os.listdir(tmp_path)                        # server 1 has not answered yet
    staging.answered('server 1', KVPSError('other host'))
    assert os.listdir(tmp_path) == [] and staging.attached == {'server 0'}
    flat, small, other = staging.stage([1 << 20, 100, 1000 + (1 << 16)])
    flat = flat.view(np.float32)
    flat[:] = np.arange(flat.size)
    at = staging.offset_in('server 0', flat[4:8])
    assert at is not None and staging.offset_in('server 1', flat) is None
    assert small is None                              # small payloads use the socket
    # One allocation, each block on its own cache line.
    assert staging.offset_in('server 0', other) == staging.offset_in('server 0', flat) + (1 << 20)
    assert other.nbytes == 1000 + (1 << 16)
    assert staging.stage([1 << 30]) == [None]         # no room: the socket
    # Too big together for what is left: each value that fits alone still gets a block.
    parts = staging.stage([(5 << 20) // 2, 1 << 20, 1 << 20])   # 2.9 MiB are left
    assert parts[0] is not None and parts[1] is None and parts[2] is None
    push = {'op': P.PUSH, 'keys': [PushItem('k', 0, 'float32', 4, at, 0),
                                   PushItem('s', 0, 'int8', 1, None, 0)]}
    assert staging.readable('server 0', push, [b'x']) == (push, [b'x'])
    staging.detach('server 0')                        # lost; a replacement has no mapping
    header, buffers = staging.readable('server 0', push, [b'x'])
    assert [item.at for item in header['keys']] == [None, None]
    assert push['keys'][0].at == at                   # the request as queued is unchanged
    assert P.as_array(buffers[0], 'float32').tolist() == [4, 5, 6, 7] and buffers[1] == b'x'
    assert staging.blocks_for('server 0', [(1 << 20, ('k', 0))]) == [None]


def test_a_pull_message_cuts_its_blocks_from_one_allocation(tmp_path):
    staging = Staging(Segment.create(1 << 22, directory=tmp_path))
    staging.attach_header('server 0')
    staging.answered('server 0')
    staging.arenas['server 0'] = Arena(None)
    staging.arenas['server 0'].note(('lent', 0), True)   # lent last time: it will be again
    parts = [(4000, ('a', 0)), (100, ('small', 0)), (5000, ('lent', 0)), (3000, ('b', 1))]
    a, small, lent, b = staging.blocks_for('server 0', parts)
    assert small is None and lent is None                # the socket, and the arena
    assert a[1].nbytes == 4000 and b[1].nbytes == 3000
    assert b[0] == a[0] + aligned(4000)                  # one allocation, cache-line cut
    assert staging.offset_in('server 0', a[1]) == a[0]   # the offsets name the slices
    assert staging.offset_in('server 0', b[1]) == b[0]
    assert staging.blocks_for('server 1', parts[:1]) == [None]   # not attached there
    ring = staging.segment.blocks
    assert len(ring) == 1
    del a
    gc.collect()
    assert len(ring) == 1                                # b still holds the allocation
    del b
    gc.collect()
    assert len(ring) == 0


def test_small_takes_of_successive_calls_are_cut_from_one_chunk_that_pins_nothing(tmp_path):
    """A loop of one-key calls takes a block a call: cut from one chunk of the segment, which
    returns to it once its last cut is gone, whether or not more calls follow."""
    from kvps.worker import staging as staging_module
    staging = Staging(Segment.create(1 << 24, directory=tmp_path, grows=True))
    staging.attach_header('server 0')
    staging.answered('server 0')
    ring = staging.segment.blocks
    (first,), (second,) = staging.stage([4000]), staging.stage([3000])
    pulled, = staging.blocks_for('server 0', [(5000, ('k', 0))])
    assert len(ring) == 1                                  # one chunk for the three
    assert staging.offset_in('server 0', second) == staging.offset_in(
        'server 0', first) + aligned(4000)                 # cut end to end
    assert pulled[0] == staging.offset_in('server 0', second) + aligned(3000)
    big, = staging.stage([staging_module.CUT_MOST + 1])
    assert len(ring) == 2 and big.nbytes == staging_module.CUT_MOST + 1   # a block of its own
    del first, second, big
    gc.collect()
    assert len(ring) == 2          # the pull's cut holds the chunk (a ring frees in order)
    del pulled
    gc.collect()
    assert len(ring) == 0                                  # nothing pinned by the staging
    again, = staging.stage([4000])
    assert len(ring) == 1 and again.nbytes == 4000         # a fresh chunk
    del again
    staging.close()


def test_a_cut_finds_a_block_of_its_own_where_no_chunk_fits(tmp_path):
    from kvps.worker import staging as staging_module
    staging = Staging(Segment.create(HEADER_BYTES + (256 << 10), directory=tmp_path))
    staging.attach_header('server 0')
    staging.answered('server 0')
    assert staging._chunk_bytes == staging_module.CUT_MOST   # a small segment's chunks are small
    big, = staging.stage([200 << 10])                      # leaves less than a chunk
    block, = staging.stage([4000])
    assert block.nbytes == 4000
    assert staging.offset_in('server 0', block) == HEADER_BYTES + aligned(200 << 10)
    del big, block
    staging.close()


def test_staging_is_off_when_configured_off():
    assert Staging.create(Config(shm=False)) is None


def test_heap_gives_each_freed_block_to_the_next_of_its_size():
    heap = Heap(0, 4 * KB)
    a, b = heap.alloc(KB), heap.alloc(2 * KB)
    assert (a, b) == (0, KB) and heap.alloc(2 * KB) is None and len(heap) == 2
    heap.free(a)
    assert heap.alloc(2 * KB) is None              # a's space is for blocks of its size
    assert heap.alloc(KB - 5) == a                 # (sizes round up to cache lines)
    assert heap.alloc(KB) == 3 * KB and heap.alloc(1) is None


def test_arena_offsets_are_remembered_only_while_their_arrays_live(tmp_path):
    worker_segment = Segment.create(1 << 20, directory=tmp_path)
    regions = Regions(directory=tmp_path, arena_bytes=1 << 22, neighbours=1)
    regions.attach(b'worker-0', worker_segment.describe())
    offset, block = regions.arena.take(4096)
    inside, outside = block.view(np.float32), np.zeros(1024, np.float32)
    assert regions.lendable(inside) == regions.lendable(inside) == offset
    assert regions.lendable(inside[1:]) == offset + 4
    assert regions.lendable(outside) is None and regions.lendable(outside) is None
    del inside, outside, block
    gc.collect()
    assert regions._offsets == {}   # nothing kept for arrays that are gone
    regions.close()
    worker_segment.unlink()
    assert os.listdir(tmp_path) == []


def test_an_arena_weight_is_lent_in_place_and_never_changed_before_the_worker_copied_it(
        tmp_path):
    worker_segment = Segment.create(1 << 20, directory=tmp_path)
    regions = Regions(directory=tmp_path, arena_bytes=1 << 22, neighbours=1)
    arena = regions.attach(b'worker-0', worker_segment.describe())
    assert len(os.listdir(tmp_path)) == 2              # the worker's segment and the arena
    staging = Staging(worker_segment)
    staging.map_arena('server 0', {'arena': arena})
    assert 'server 0' in staging.arenas
    storage = Storage(HostArrays())
    storage.use_arena(regions.arena)
    shard = Shard(1, storage=storage)
    n = PACK_UP_TO + 1   # not a small key (those share chunks): a block of its own
    shard.init('i', 'k', 0, 'float32', [n], True, np.ones(n, np.float32).tobytes())
    shard.push('p', b'worker-0', 'k', 0, 'float32', True, np.full(n, 2, np.float32).tobytes())
    (_, _, (entry, array, lease)), = shard.pull('q', b'worker-0', 'k', 0)
    at = regions.lendable(array)
    reader = regions.saw(b'worker-0', {'seen': 0})
    assert os.listdir(tmp_path) == [worker_segment.name]   # its one neighbour mapped it
    lease.reader, lease.number = reader, regions.lend(reader, [array])
    del array
    assert (np.frombuffer(staging.arenas['server 0'].view(at, n * 4), np.float32) == 2).all()
    # The next round's update comes before the worker copied: it goes to a new arena block,
    # and the lent one stays as it was until the worker's `seen` reaches its reply.
    shard.push('p2', b'worker-0', 'k', 0, 'float32', True, np.full(n, 3, np.float32).tobytes())
    assert regions.lendable(entry.weight) not in (None, at)
    assert (np.frombuffer(staging.arenas['server 0'].view(at, n * 4), np.float32) == 2).all()
    regions.saw(b'worker-0', {'seen': lease.number})
    gc.collect()
    assert lease.done and len(regions.arena.blocks) == 1   # the lent block is free again
    with pytest.raises(ProtocolError):
        staging.arenas['server 0'].view(regions.arena.size, 4)    # outside the arena
    assert 'server 1' not in staging.arenas                # an arena never mapped
    regions.close()
    worker_segment.unlink()
    assert os.listdir(tmp_path) == []
