"""GPU values straight between the GPU and page-locked shared memory, on the host: torch runs
the device path's copies on host tensors too, and a stand-in locks the memory (the real path
is in tests/cluster/test_gpu_jobs.py). A push is copied into blocks of the worker's segment
with no pinned buffer between; a pull is written onto its targets from the segment, a
server's arena or a frame by the worker's copier; where locking fails, both take the pinned
buffers they took before, said once in the log."""

import contextlib
import logging

import numpy as np
import pytest

torch = pytest.importorskip('torch')

from page_locking import HostLocker  # noqa: E402

import kvps  # noqa: E402
from kvps import devices, pinning  # noqa: E402
from kvps.kvstore import KVStore  # noqa: E402
from kvps.kvstore.local import LocalBackend  # noqa: E402
from kvps.timeline.counters import WorkerCounts  # noqa: E402
from kvps.wire.device_segments import DeviceSegment  # noqa: E402
from kvps.wire.device_sharing import HostSharing  # noqa: E402
from kvps.wire.items import DataItem  # noqa: E402
from kvps.wire.shm import Heap, Segment  # noqa: E402
from kvps.worker.device_staging import ROUTE, DeviceStaging  # noqa: E402
from kvps.worker.messages import copier  # noqa: E402
from kvps.worker.sharding import Part  # noqa: E402
from kvps.worker.staging import Staging  # noqa: E402

NODE = 'server 0'
N = 1000   # elements of the keys that take blocks (4 KB in float32: over MIN_BYTES)


class ShmBackend(LocalBackend):
    """The in-process backend behind a worker's real shared memory, as a job on one host has
    it: pushes are made in blocks of the worker's segment (and held, as the client holds them
    until acknowledged); pulls are answered into blocks of it, lent from a server's arena
    (``arena``) or sent as frames (``frames``), and written into the targets by the worker's
    own copier. Keys named 'split*' lie in two parts."""

    def __init__(self, directory, arena=False, frames=False, ipc=False):
        """``ipc``: the worker has a device segment (the host stand-in's) that the server
        mapped: GPU values take it both ways (the ipc route)."""
        super().__init__()
        self.staging = Staging(Segment.create(1 << 22, directory=directory, grows=True))
        self.staging.attach_header(NODE)
        self.staging.answered(NODE)
        if ipc:
            self.staging.device = DeviceStaging(
                DeviceSegment(HostSharing(str(directory)), 1 << 22), [NODE])
            self.staging.device.answered(NODE)
        self.arena = None
        if arena:
            self.arena = Segment.create(1 << 22, directory=directory, allocator=Heap,
                                        grows=True)
            self.staging.map_arena(NODE, {'arena': self.arena.describe()})
        self.frames, self.held, self.messages = frames, [], 0
        self.counts = WorkerCounts()

    def parts(self, key, size):
        if str(key).startswith('split'):
            return [(0, 0, 0, size // 2), (0, 1, size // 2, size)]
        return super().parts(key, size)

    def stage(self, sizes, device=False):
        return self.staging.stage(sizes, device)

    def device_written(self, stream=None):
        if self.staging.device is not None:
            self.staging.device.record(stream)

    def device_buffer(self, nbytes):
        return None if self.staging.device is None else self.staging.device.hold(nbytes)

    def device_route(self, device=None):
        if self.staging.device is not None:
            return True, ROUTE
        return self.staging.device_route()

    def push(self, items, priority=0):
        self.held += [flat for _, flat, _ in items]
        super().push([(k, np.concatenate(f) if type(f) is list else f, d) for k, f, d in items])

    def pull(self, items, priority=0, codec=None):
        landings = [out for _, out, _ in items if type(out) is not np.ndarray]
        for key, out, dtype in items:
            (reply,) = self.shard.pull(None, b'w', key, 0)
            value = reply.payload.array
            if type(out) is np.ndarray:
                np.copyto(out.reshape(-1), value)
            else:
                self._answer(key, out, dtype, value, landings)
            reply.payload.lease.released = True

    def _answer(self, key, out, dtype, value, landings):
        """As a server answers and the worker's I/O thread lands it: one message per key."""
        part, buffers = Part(0, 0, 0, out.size), []
        (block,) = self.staging.blocks_for(NODE, [(value.nbytes, (key, 0))],
                                           [type(out) is not np.ndarray])
        if self.frames:
            answer, block = DataItem(None, None), None
            buffers = [memoryview(value.tobytes())]
        elif self.arena is not None:
            at, lent = self.arena.take(value.nbytes)
            lent.view(value.dtype)[...] = value
            answer, block = DataItem(None, at), None
        else:
            block[1].view(value.dtype)[...] = value
            answer = DataItem(block[0], None)
        on_data = copier([(key, part, out, dtype)], [block], self.staging, NODE, self.counts,
                         None, landings)
        self.messages += 1
        on_data({'keys': [answer]}, buffers)


@pytest.fixture
def on_gpu(monkeypatch):
    """Host tensors take the GPU path; every pinned buffer the path makes is counted in the
    returned list (it should be empty where the memory is page-locked)."""
    monkeypatch.setattr(devices, 'on_gpu', kvps.arrays.is_torch)
    monkeypatch.setattr(devices, '_ROUTE_TOLD', False)
    made, make = [], devices._host_buffer
    monkeypatch.setattr(devices, '_host_buffer',
                        lambda *args: made.append(args[0]) or make(*args))
    return made


def in_segment(backend, array):
    return backend.staging.segment.offset_of(array) is not None


def in_device_segment(backend, array):
    return backend.staging.device.segment.offset_of(array) is not None


@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16, torch.float64])
def test_a_push_is_copied_from_the_gpu_into_the_segment_with_no_staging_buffer(
        tmp_path, locker, on_gpu, dtype):
    backend = ShmBackend(tmp_path)
    kv = KVStore('dist_sync_device', backend)
    kv.init(['a', 'split'], [torch.zeros(N, dtype=dtype), torch.zeros(2 * N, dtype=dtype)])
    on_gpu.clear()                                        # (init's copies: staged, as before)
    waits, finish = [], devices.PushCopies.finish
    devices.PushCopies.finish = lambda self, recorded: waits.append(1) or finish(self, recorded)
    try:
        values = [[torch.full((N,), 1.5, dtype=dtype), torch.full((N,), 0.25, dtype=dtype)],
                  torch.arange(2 * N, dtype=dtype)]
        kv.push(['a', 'split'], values)
    finally:
        devices.PushCopies.finish = finish
    a, (split0, split1) = backend.held
    assert on_gpu == [] and waits == [1]                  # one wait for the whole push
    assert in_segment(backend, a) and in_segment(backend, split0) and in_segment(backend, split1)
    assert torch.from_numpy(a.view(np.int16) if dtype == torch.bfloat16 else a).view(
        dtype).tolist() == [1.75] * N
    assert split1.nbytes == N * values[1].element_size()   # one block per part
    assert locker.locks() and all(e[3] for e in locker.locks())   # its segment, writable
    assert values[0][0].tolist() == [1.5] * N                      # pushed values only read
    out = [torch.zeros(N, dtype=dtype), torch.zeros(2 * N, dtype=dtype)]
    kv.pull(['a', 'split'], out=out)
    assert out[1].tolist() == values[1].tolist()


def test_a_push_into_the_device_segment_records_its_event_and_waits_for_nothing(
        tmp_path, locker, on_gpu, monkeypatch):
    backend = ShmBackend(tmp_path, ipc=True)
    kv = KVStore('dist_sync_device', backend)
    kv.init(['a', 'split', 'host'], [torch.zeros(N), torch.zeros(2 * N), np.zeros(N)])
    synchronized, recorded = [], []
    monkeypatch.setattr(devices, '_synchronize', lambda d: synchronized.append(set(d)))
    monkeypatch.setattr(backend, 'device_written', recorded.append)
    push = backend.push
    monkeypatch.setattr(backend, 'push', lambda *a: recorded.append('push') or push(*a))
    kv.push(['a', 'split', 'host'], [torch.ones(N), torch.arange(2 * N) * 1.0, np.ones(N)])
    a, (split0, split1), host = backend.held
    assert all(in_device_segment(backend, v) for v in (a, split0, split1))
    assert in_segment(backend, host)
    # one record for the push (on the stand-in's no stream), before the backend has it; no
    # copy waited for (the host value's sum is numpy's)
    assert recorded == [None, 'push'] and synchronized == [set()]


def test_small_values_and_values_that_find_no_room_are_staged_as_before(tmp_path, locker,
                                                                       on_gpu):
    backend = ShmBackend(tmp_path)
    kv = KVStore('dist_async_device', backend)
    kv.init([0, 1], [torch.zeros(10), torch.zeros(N)])
    on_gpu.clear()
    backend.staging.segment.take = lambda nbytes: None   # the segment is full
    kv.push([0, 1], [torch.ones(10), torch.ones(N)])
    assert on_gpu == [10, N] and not any(in_segment(backend, h) for h in backend.held)


def test_where_the_segment_cannot_be_locked_gpu_values_take_pinned_buffers(
        tmp_path, monkeypatch, on_gpu, caplog):
    locker = HostLocker(refuse=lambda address, nbytes, writable: True)
    monkeypatch.setattr(pinning, 'REGISTRY', pinning.Registry(locker))
    backend = ShmBackend(tmp_path)
    kv = KVStore('dist_sync_device', backend)
    asked, stage = [], backend.stage
    backend.stage = lambda sizes: asked.append(sizes) or stage(sizes)
    with caplog.at_level(logging.INFO, logger='kvps'):
        kv.init(0, torch.zeros(N))
        on_gpu.clear()
        for _ in range(2):
            kv.push(0, torch.ones(N))
        out = torch.zeros(N)
        kv.pull(0, out=out)
    assert out.tolist() == [1.0] * N                  # (no optimizer: the last push)
    assert asked == [[0], [0]]                     # no block asked for a GPU value
    assert on_gpu == [N, N, N]                     # two pushes and the pull, pinned as before
    assert backend.messages == 0                   # the pull was not written through a Landing
    messages = [r.getMessage() for r in caplog.records]
    assert sum('cannot page-lock' in m for m in messages) == 1
    assert any(m.startswith('device values: GPU <-> pinned host buffers') and
               'RLIMIT_MEMLOCK' in m for m in messages)
    assert all(r.levelno < logging.ERROR for r in caplog.records)


@pytest.mark.parametrize('source', ['segment', 'arena', 'frames'])
def test_a_pull_lands_on_its_gpu_targets_straight_from_host_memory(tmp_path, locker, on_gpu,
                                                                   source):
    backend = ShmBackend(tmp_path, arena=source == 'arena', frames=source == 'frames')
    kv = KVStore('dist_sync_device', backend)
    w = torch.arange(2.0 * N).reshape(2, N)
    kv.init('w', w)
    on_gpu.clear()
    same = torch.zeros(2, N)
    transposed = torch.zeros(N, 2).t()
    wider = torch.zeros(2, N, dtype=torch.float64)
    pointer = same.data_ptr()
    kv.pull('w', out=[transposed, same, wider])
    assert on_gpu == [] and backend.messages == 1
    assert same.data_ptr() == pointer
    for target in (same, transposed, wider):
        assert torch.equal(target.float(), w)
    # the segment's first step (locked as the route was found), the arena's, a frame's none
    assert {e[3] for e in locker.locks()} == ({True, False} if source == 'arena' else {True})


def test_a_key_with_host_and_gpu_targets_lands_through_a_pinned_buffer(tmp_path, locker,
                                                                      on_gpu, monkeypatch):
    backend = ShmBackend(tmp_path)
    kv = KVStore('dist_sync_device', backend)
    kv.init(0, torch.ones(N))
    on_gpu.clear()
    on_device, on_host = torch.zeros(N), np.zeros(N, np.float32)
    monkeypatch.setattr(devices, 'on_gpu', lambda v: kvps.arrays.is_torch(v))
    kv.pull(0, out=[on_device, on_host])
    assert on_device.tolist() == on_host.tolist() == [1.0] * N
    assert on_gpu == [N] and backend.messages == 0


def test_a_landing_s_writes_are_made_and_waited_for_within_each_answer(tmp_path, locker,
                                                                         on_gpu, monkeypatch):
    backend = ShmBackend(tmp_path)
    kv = KVStore('dist_sync_device', backend)
    kv.init(['a', 'b'], [torch.ones(N), torch.ones(N)])
    events, writing = [], devices.Landings.writing

    def watched(self):
        events.append('enter')
        with writing(self):
            yield
        events.append('waited')
    monkeypatch.setattr(devices.Landings, 'writing', contextlib.contextmanager(watched))
    setitem = devices.Landing.__setitem__
    monkeypatch.setattr(devices.Landing, '__setitem__',
                        lambda self, where, source: events.append('write') or
                        setitem(self, where, source))
    kv.pull(['a', 'b'], out=[torch.zeros(N), torch.zeros(N)])
    assert events == ['enter', 'write', 'waited'] * 2    # a message a key here


@pytest.mark.parametrize('ipc', [False, True])
def test_the_trainer_through_page_locked_memory_matches_the_host_path(tmp_path, locker,
                                                                      on_gpu, monkeypatch, ipc):
    """(``ipc``: through the worker's device segment, the host stand-in of CUDA IPC, where
    the fused key of w and b gathers its gradients, pushed from there.)"""
    def train(backend):
        gen = torch.Generator().manual_seed(0)
        w = torch.nn.Parameter(torch.randn(40, 70, generator=gen))
        b = torch.nn.Parameter(torch.randn(7, generator=gen))
        trainer = kvps.Trainer([w, b], 'sgd', {'learning_rate': 0.1, 'momentum': 0.9},
                               kvstore=KVStore('dist_sync_device', backend))
        for _ in range(3):
            trainer.zero_grad()
            ((w * torch.randn(40, 70, generator=gen)).sum() + b.sum()).backward()
            trainer.step(4)
        return trainer, (w.detach().clone(), b.detach().clone())
    monkeypatch.setattr(devices, 'on_gpu', lambda v: False)
    _, want = train(LocalBackend())
    monkeypatch.setattr(devices, 'on_gpu', kvps.arrays.is_torch)
    copies, into_block = [], devices._into_block
    monkeypatch.setattr(devices, '_into_block', lambda *a: copies.append(1) or into_block(*a))
    backend = ShmBackend(tmp_path, ipc=ipc)
    recorded, written = [], backend.device_written
    backend.device_written = lambda stream=None: recorded.append(stream) or written(stream)
    trainer, got = train(backend)
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    where = in_device_segment if ipc else in_segment
    assert backend.messages > 0 and any(where(backend, h) for h in backend.held)
    assert (backend.counts.pulled_ipc > 0) == ipc and (backend.counts.pulled_shm > 0) != ipc
    (fused,) = trainer._layout.fused
    bucket = fused.grad.numpy()
    if ipc:   # every push handed over the bucket itself, recorded, never copied
        assert in_device_segment(backend, bucket)
        assert len(backend.held) == len(recorded) == 3 and copies == []
        assert all(np.shares_memory(h, bucket) for h in backend.held)
    else:
        assert len(copies) == 3 and recorded == []


def test_the_route_is_logged_once_at_info(tmp_path, locker, on_gpu, caplog):
    backend = ShmBackend(tmp_path)
    kv = KVStore('dist_sync_device', backend)
    with caplog.at_level(logging.INFO, logger='kvps'):
        kv.init(0, torch.zeros(N))
        kv.push(0, torch.ones(N))
        kv.pull(0, out=torch.zeros(N))
        kv.push(0, torch.ones(N))
    told = [r for r in caplog.records if r.getMessage().startswith('device values:')]
    assert len(told) == 1 and told[0].levelno == logging.INFO
    assert 'page-locked shared memory' in told[0].getMessage()


def test_a_lost_server_s_arena_and_a_leaving_worker_s_segment_are_unlocked(tmp_path, locker,
                                                                          on_gpu):
    backend = ShmBackend(tmp_path, arena=True)
    kv = KVStore('dist_sync_device', backend)
    kv.init(0, torch.zeros(N))

    def arena_locked():   # the read-only locks held now (the arena's, as this worker maps it)
        return [a for a, (_, writable) in locker.locked.items() if not writable]
    kv.pull(0, out=torch.zeros(N))
    assert len(arena_locked()) == 1 and len(locker.locked) == 2
    backend.staging.detach(NODE)                       # the server is lost: its arena unlocked
    assert arena_locked() == [] and len(locker.locked) == 1
    backend.staging.map_arena(NODE, {'arena': backend.arena.describe()})   # it is back
    kv.pull(0, out=torch.zeros(N))
    assert len(arena_locked()) == 1
    backend.staging.map_arena(NODE, {'arena': backend.arena.describe()})   # mapped anew
    assert arena_locked() == []
    backend.staging.close()                            # the worker leaves: all unlocked
    assert locker.locked == {}
    assert len([e for e in locker.log if e[0] == 'unlock']) == len(locker.locks()) == 3
