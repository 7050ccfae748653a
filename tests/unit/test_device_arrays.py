"""A server's GPU shards, on the host: DeviceArrays with stand-in transfers (numpy, each copy
written down) and a stand-in for cudaHostRegister. A push from a worker's segment is one copy
from page-locked memory to the device; a socket frame is copied into a pinned buffer first; a
pull is copied out straight into the worker's segment, or into a pinned frame; every copy is
waited for before the answer that frees or carries its bytes, and a worker's segment is
unlocked (after the copies from it) when it leaves, attaches anew, or the server ends."""

import logging
import os
from types import SimpleNamespace

import numpy as np
import pytest
from page_locking import HostLocker
from test_shard_storage import assert_like_host

from kvps import pinning
from kvps.optimizer.kernels import numpy_kernels
from kvps.server.device_arrays import DeviceArrays
from kvps.server.lending import Lending
from kvps.server.loop import Server
from kvps.server.regions import Regions
from kvps.server.requests import Requests
from kvps.server.shard import Shard
from kvps.server.storage import HostArrays, Storage
from kvps.server.transfers import HostCopies
from kvps.wire import protocol as P
from kvps.wire.identities import worker_identity
from kvps.wire.items import PullItem, PushItem
from kvps.wire.shm import Segment

W0 = worker_identity(0)
N = 1024   # float32 elements: 4 KB, over MIN_BYTES


class HostTransfers(HostCopies):
    """A device's copies made on the host, each written into ``log``: ``(what, host address,
    page-locked)`` for uploads and downloads, ``('pinned', nbytes)`` for pinned buffers made,
    ``('hold',)`` for each piece of work on the device, ``('settle',)`` for each wait and
    ``('record',)`` for each record of the server's event."""

    def __init__(self, log):
        super().__init__()
        self.log = log

    def upload(self, device, host, spans):
        self.log.append(('upload', host.ctypes.data, spans is not None))
        self._held.append(host)
        super().upload(device, host, spans)

    def download(self, host, device, spans):
        self.log.append(('download', host.ctypes.data, spans is not None))
        self._held.append(host)
        super().download(host, device, spans)

    def pinned(self, nbytes):
        self.log.append(('pinned', nbytes))
        return super().pinned(nbytes)

    def hold(self, array):
        self.log.append(('hold',))
        super().hold(array)

    def _wait(self):
        self.log.append(('settle',))

    def _record(self, event):
        self.log.append(('record',))
        super()._record(event)


def device_arrays(log=None):
    return DeviceArrays(np, numpy_kernels, HostTransfers([] if log is None else log))


@pytest.mark.parametrize('sync', [True, False])
@pytest.mark.parametrize('optimizer', [None, 'sgd', 'adam'])
def test_device_arrays_train_as_host_arrays_do_bit_for_bit(sync, optimizer):
    assert_like_host(device_arrays(), sync, optimizer)


class Server1:
    """One server's shard, lending and request handling, and one worker's segment it mapped
    (both in this process, as on one host); ``log``: the transfers' and the locker's events,
    in order."""

    def __init__(self, tmp_path, monkeypatch, segment=None, gpu=None):
        """``gpu``: makes the device's arrays (a real GPU's), instead of the stand-ins."""
        self.log = []
        self.locker = HostLocker(self.log)
        monkeypatch.setattr(pinning, 'REGISTRY', pinning.Registry(None if gpu else self.locker))
        self.segment = segment or Segment.create(1 << 22, directory=tmp_path, grows=True)
        self.gpu = gpu() if gpu else device_arrays(self.log)
        self.storage = Storage(HostArrays(), self.gpu)
        self.lending = Lending(Regions(directory=tmp_path, arena_bytes=1 << 22), self.storage)
        self.shard = Shard(1, storage=self.storage)
        self.requests = Requests(self.shard, self.lending, 'server 0')
        self.attach()

    def attach(self):
        self.lending.attach(W0, {'op': P.ATTACH, **self.segment.describe()}, 0.0)

    def init(self, key, value):
        self.shard.init('i', key, 0, 'float32', [value.size], True,
                        memoryview(value).cast('B'), device=True)

    def push(self, key, value, in_segment=True):
        frames, at = [], None
        if in_segment:
            at, block = self.segment.take(value.nbytes)
            block.view(np.float32)[...] = value
            self.held = block                   # the worker holds it until acknowledged
        else:
            frames = [memoryview(value).cast('B')]
        item = PushItem(key, 0, 'float32', value.size, at, self.shard.entries[(key, 0)].version)
        replies = self.requests.handle(W0, {'op': P.PUSH, 'sync': True, 'keys': [item]},
                                       frames)
        return at, replies

    def pull(self, key, in_segment=True):
        """The Delivery of a pull of ``key`` and where the worker looks for it."""
        at, block = self.segment.take(N * 4) if in_segment else (None, None)
        (reply,) = self.requests.handle(W0, {'op': P.PULL, 'keys': [PullItem(key, 0, at)]}, [])
        delivery = self.lending.deliver(reply.payload)
        return delivery, block, reply.payload.pulled[0].lease

    def mapping_address(self):
        return self.lending.regions._by_worker[W0].address


def test_a_push_from_a_worker_s_segment_is_one_copy_from_page_locked_memory(tmp_path,
                                                                            monkeypatch):
    server = Server1(tmp_path, monkeypatch)
    server.init('k', np.zeros(N, np.float32))
    server.log.clear()
    at, _ = server.push('k', np.full(N, 2.0, np.float32))
    base = server.mapping_address()
    assert server.log == [('lock', base, 1 << 22, True), ('upload', base + at, True)]
    assert server.shard.entries[('k', 0)].weight.tolist() == [2.0] * N


def test_a_socket_payload_is_received_into_a_pinned_buffer(tmp_path, monkeypatch):
    server = Server1(tmp_path, monkeypatch)
    server.init('k', np.zeros(N, np.float32))
    server.log.clear()
    server.push('k', np.full(N, 3.0, np.float32), in_segment=False)
    (pinned, nbytes), (upload, _, locked) = server.log
    assert (pinned, nbytes, upload, locked) == ('pinned', N * 4, 'upload', True)
    assert server.shard.entries[('k', 0)].weight.tolist() == [3.0] * N


def test_socket_payloads_hold_a_bounded_amount_of_pinned_memory(tmp_path, monkeypatch):
    from kvps.server import device_arrays
    monkeypatch.setattr(device_arrays, 'STAGING_BYTES', 3 * N * 4)
    server = Server1(tmp_path, monkeypatch)
    server.init('k', np.zeros(N, np.float32))
    server.storage.settle()
    server.log.clear()
    for _ in range(8):
        server.push('k', np.ones(N, np.float32), in_segment=False)
    kinds = ''.join({'pinned': 'p', 'upload': 'u', 'settle': 's'}[e[0]] for e in server.log)
    assert kinds == 'pu' * 4 + 's' + 'pu' * 4 + 's'   # waited for past 3 payloads' bytes


def test_a_pull_is_copied_from_the_device_into_the_worker_s_segment_and_waited_for(
        tmp_path, monkeypatch):
    server = Server1(tmp_path, monkeypatch)
    server.init('k', np.arange(N, dtype=np.float32))
    server.log.clear()
    delivery, block, lease = server.pull('k')
    at = delivery.items[0].at
    assert server.log == [('lock', server.mapping_address(), 1 << 22, True),
                          ('download', server.mapping_address() + at, True), ('settle',)]
    assert block.view(np.float32).tolist() == list(range(N))     # as the worker reads it
    assert lease.done and delivery.frames == [] and delivery.lease is None


def test_a_pull_through_the_socket_is_copied_into_a_pinned_frame(tmp_path, monkeypatch):
    server = Server1(tmp_path, monkeypatch)
    server.init('k', np.arange(N, dtype=np.float32))
    server.log.clear()
    delivery, _, lease = server.pull('k', in_segment=False)
    (frame,) = delivery.frames
    assert server.log == [('pinned', N * 4), ('download', frame.ctypes.data, True),
                          ('settle',)]
    assert frame.tolist() == list(range(N)) and lease.done and delivery.framed == []


def test_a_weight_updated_before_its_pull_is_answered_is_answered_as_it_was(tmp_path,
                                                                           monkeypatch):
    server = Server1(tmp_path, monkeypatch)
    server.init('k', np.zeros(N, np.float32))
    at, block = server.segment.take(N * 4)
    (reply,) = server.requests.handle(W0, {'op': P.PULL, 'keys': [PullItem('k', 0, at)]}, [])
    server.push('k', np.full(N, 5.0, np.float32))       # an update before the answer is sent
    server.lending.deliver(reply.payload)
    assert block.view(np.float32).tolist() == [0.0] * N  # copy-on-write: the pulled value
    assert server.shard.entries[('k', 0)].weight.tolist() == [5.0] * N


def test_the_loop_orders_the_replies_behind_the_copies_before_it_sends_them():
    events = []
    fake = SimpleNamespace(checkpointer=None, fenced=False,
                           shard=SimpleNamespace(storage=SimpleNamespace(
                               order=lambda: events.append('order'))),
                           replies=SimpleNamespace(flush=lambda: events.append('flush')))
    Server._flush(fake)
    assert events == ['order', 'flush']


@pytest.mark.parametrize('how', ['finish', 'attach anew', 'server ends'])
def test_a_worker_s_segment_is_unlocked_after_its_copies_when_it_goes(tmp_path, monkeypatch,
                                                                     how):
    server = Server1(tmp_path, monkeypatch)
    server.init('k', np.zeros(N, np.float32))
    server.push('k', np.ones(N, np.float32))
    base = server.mapping_address()
    server.log.clear()
    if how == 'finish':
        server.lending.forget(W0)
    elif how == 'attach anew':
        server.attach()
    else:
        server.lending.close()
    assert server.log[:2] == [('settle',), ('unlock', base)]
    assert server.locker.locked == {}


def test_a_restarted_server_maps_and_locks_the_segment_anew(tmp_path, monkeypatch):
    first = Server1(tmp_path, monkeypatch)
    first.init('k', np.zeros(N, np.float32))
    first.push('k', np.ones(N, np.float32))
    first.segment.unlink()                  # as every server has mapped it: the name is gone
    first.lending.close()                   # the server process ends
    assert first.locker.locked == {}
    again = Server1(tmp_path, monkeypatch, segment=first.segment)   # through /proc/pid/fd
    again.init('k', np.zeros(N, np.float32))
    again.log.clear()
    again.push('k', np.full(N, 4.0, np.float32))
    assert [e[0] for e in again.log] == ['lock', 'upload'] and again.log[1][2]
    assert again.shard.entries[('k', 0)].weight.tolist() == [4.0] * N
    again.lending.close()
    assert again.locker.locked == {} and os.path.exists(f'/proc/{os.getpid()}')


def test_where_locking_fails_payloads_are_staged_in_pinned_buffers(tmp_path, monkeypatch,
                                                                   caplog):
    server = Server1(tmp_path, monkeypatch)
    server.locker.refuse = lambda address, nbytes, writable: True
    server.init('k', np.zeros(N, np.float32))
    server.log.clear()
    with caplog.at_level(logging.INFO, logger='kvps'):
        server.push('k', np.full(N, 2.0, np.float32))
        delivery, block, _ = server.pull('k')
    assert [e[0] for e in server.log] == ['pinned', 'upload', 'download', 'settle']
    assert server.log[2][2] is False                      # pageable: a copy waited for
    assert block.view(np.float32).tolist() == [2.0] * N
    assert sum('cannot page-lock' in r.getMessage() for r in caplog.records) == 1
    assert all(r.levelno < logging.ERROR for r in caplog.records)


def test_the_servers_route_for_device_values_is_logged_once(caplog):
    storage = Storage(HostArrays(), probe=device_arrays)
    with caplog.at_level(logging.INFO, logger='kvps'):
        storage.for_key(False)
        first = storage.for_key(True)
        assert storage.for_key(True) is first
    told = [r.getMessage() for r in caplog.records if 'device values' in r.getMessage()]
    assert told == [f'device values: {first.route}'] and 'GPU shards' in told[0]
    without = Storage(HostArrays(), probe=lambda: None)
    with caplog.at_level(logging.INFO, logger='kvps'):
        without.for_key(True)
    assert 'device values: kept in host memory' in caplog.records[-1].getMessage()
