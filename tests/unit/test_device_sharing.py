"""Device memory shared between processes (kvps.wire.device_sharing) and a worker's device segment
(kvps.wire.device_segments), through the host stand-in: export, open, close, the checks made on
what a peer names, nothing left in /dev/shm. The CUDA implementation shares every check here,
and its calls into cupy are checked against a stand-in that records them;
test_device_sharing_gpu.py runs it on a GPU, between two processes."""

import gc
import os
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest

from kvps.errors import ConfigError, KVPSError, ProtocolError
from kvps.wire.device_segments import DEVICE_BASE, DeviceMapping, DeviceSegment
from kvps.wire.device_sharing import HANDLE_BYTES, HostSharing, sharing_for


@pytest.fixture
def sharing(tmp_path):
    return HostSharing(str(tmp_path))


def files(path):
    return sorted(os.listdir(path))


def test_a_buffer_exported_is_opened_by_its_handle_and_both_see_the_same_bytes(sharing, tmp_path):
    mine = sharing.export(4096)
    assert mine.exported and len(mine.handle) == HANDLE_BYTES and mine.nbytes == 4096
    assert files(tmp_path) == []   # no name: peers open the exporter's file, as it lives
    theirs = HostSharing(str(tmp_path)).open(mine.handle, 4096)   # (another process's view)
    mine.array[:8] = np.arange(8, dtype=np.uint8)
    assert theirs.array[:8].tolist() == list(range(8))
    theirs.array[100] = 7
    assert mine.array[100] == 7
    theirs.close()
    mine.close()
    assert files(tmp_path) == [] and sharing.open_buffers == 0


def test_closing_twice_is_harmless_and_a_closed_buffer_is_gone(sharing, tmp_path):
    mine = sharing.export(4096)
    theirs = sharing.open(mine.handle, 4096)
    assert sharing.open_buffers == 2
    for shared in (theirs, theirs, mine, mine):
        shared.close()
    assert mine.closed and theirs.closed and sharing.open_buffers == 0
    with pytest.raises(ProtocolError, match='is gone'):
        sharing.open(mine.handle, 4096)   # its exporter closed it


@pytest.mark.parametrize('handle, nbytes, why', [
    (b'x' * 63, 4096, 'must be 64 bytes'),
    ('a' * 64, 4096, 'must be 64 bytes'),
    (b'../../etc/passwd'.ljust(64, b'\0'), 4096, 'not a kvps segment name'),
    (b'\xff' * 64, 4096, 'not a device buffer handle'),
    (b'kvps-1-0123456789abcdef'.ljust(64, b'\0'), 4096, 'is gone'),
    ('another nonce', 4096, 'nonce differs'),   # the same name in another /dev/shm
    (None, 0, 'out of range'),
    (None, 8192, 'not a segment of 13312 bytes'),   # (its stamps after it)
    (None, True, 'out of range'),
])
def test_a_handle_or_size_a_peer_got_wrong_is_refused(sharing, handle, nbytes, why):
    mine = sharing.export(4096)
    if handle in (None, 'another nonce'):
        handle = mine.handle if handle is None else mine.handle[:40] + bytes(16) + mine.handle[56:]
    with pytest.raises(ProtocolError, match=why):
        sharing.open(handle, nbytes)
    assert sharing.open_buffers == 1
    mine.close()


def test_events_are_recorded_by_the_exporter_and_waited_on_by_the_peer(sharing):
    event = sharing.event()
    peer = HostSharing(sharing.directory).open_event(event.handle)   # (another process's)
    assert peer.recorded() == 0
    event.record()
    peer.wait()
    assert (event.records, peer.waits, peer.recorded()) == (1, 1, 1)   # the count is shared
    event.close()
    with pytest.raises(ProtocolError, match='not a device event handle'):
        sharing.open_event(b'\0' * HANDLE_BYTES)
    with pytest.raises(ProtocolError, match='event handle must be 64 bytes'):
        sharing.open_event(b'short')
    peer.close()
    peer.close()


def test_no_room_is_a_kvps_error_that_leaves_nothing(tmp_path):
    with pytest.raises(KVPSError, match='cannot export'):
        HostSharing(str(tmp_path / 'missing')).export(4096)
    assert files(tmp_path) == []


def test_the_setting_names_the_implementation():
    assert sharing_for('off') is None
    assert isinstance(sharing_for('host'), HostSharing)
    with pytest.raises(ConfigError, match="KVPS_IPC: 'gpu' is not one of off, cuda, host"):
        sharing_for('gpu')


def test_a_killed_exporters_buffer_goes_with_it(tmp_path):
    code = (f'import os, sys; from kvps.wire.device_sharing import HostSharing\n'
            f'b = HostSharing({str(tmp_path)!r}).export(4096)\n'
            f'b.array[:3] = 7; print(b.handle.hex(), flush=True); sys.stdin.read()')
    proc = subprocess.Popen([sys.executable, '-c', code], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True,
                            env={**os.environ, 'PYTHONPATH': os.pathsep.join(
                                filter(None, [os.getcwd(), os.environ.get('PYTHONPATH')]))})
    try:
        handle = bytes.fromhex(proc.stdout.readline())
        theirs = HostSharing(str(tmp_path)).open(handle, 4096)
        assert theirs.array[:4].tolist() == [7, 7, 7, 0]
        theirs.close()
    finally:
        proc.kill()
        proc.wait(10)
        proc.stdout.close()
        proc.stdin.close()
    with pytest.raises(ProtocolError, match='is gone'):
        HostSharing(str(tmp_path)).open(handle, 4096)
    assert files(tmp_path) == []


def test_the_stand_in_orders_a_block_only_behind_a_record_made_after_it_was_taken(sharing):
    # (a CUDA read before the writes land: what a push header sent before its record gets)
    mine, event = sharing.export(4096), sharing.event()
    peer_sharing = HostSharing(sharing.directory)
    theirs = peer_sharing.open(mine.handle, 4096)
    peer = peer_sharing.open_event(event.handle)
    sharing.piece(mine, 0, 1000)
    assert not peer_sharing.ordered(theirs, peer, 0)
    event.record()
    sharing.piece(mine, 1024, 1000)   # taken after that record: not ordered by it
    assert peer_sharing.ordered(theirs, peer, 0)
    assert not peer_sharing.ordered(theirs, peer, 1024)
    event.record()
    assert peer_sharing.ordered(theirs, peer, 1024)
    for closing in (theirs, peer, mine, event):
        closing.close()
    assert files(sharing.directory) == []


# -- the device segment ------------------------------------------------------------------------
def test_device_segment_blocks_are_named_above_every_host_offset(sharing):
    segment = DeviceSegment(sharing, 1 << 16)
    at, block = segment.take(1000)
    # (the last offset of the biggest host segment is below every device offset)
    assert at == DEVICE_BASE and (1 << 40) - 1 < DEVICE_BASE
    block[:] = 3
    server = DeviceMapping(HostSharing(sharing.directory), segment.describe())
    assert server.view(at, 1000).tolist() == [3] * 1000
    at2, _ = segment.take(1000)
    assert at2 == DEVICE_BASE + 1024   # blocks on cache lines, as in host segments
    server.close()
    segment.close()
    assert files(sharing.directory) == []


def test_a_device_block_returns_once_its_array_is_gone(sharing):
    segment = DeviceSegment(sharing, 4096)
    taken = segment.take(4096)
    assert segment.take(64) is None   # full: the caller takes another route
    del taken
    gc.collect()
    assert segment.take(4096)[0] == DEVICE_BASE
    segment.close()
    assert segment.take(64) is None   # closed: nothing more is handed out


def test_a_held_device_block_is_cut_before_any_other_and_never_returns(sharing):
    segment = DeviceSegment(sharing, 1 << 16)
    at, held = segment.hold(1000)
    assert at == DEVICE_BASE and segment.offset_of(held) == at and len(held) == 1000
    taken = segment.take(1 << 14)
    assert taken[0] == at + 1024 and segment.hold(64) is None   # blocks out: none cut
    del taken
    gc.collect()
    taken = segment.take((1 << 16) - 1024)                     # the ring goes round it
    assert taken[0] == at + 1024
    del taken
    gc.collect()
    assert segment.hold(1 << 16) is None                         # no room
    assert segment.hold(1024)[0] == at + 1024                    # the next one after it
    segment.close()
    assert segment.hold(64) is None


@pytest.mark.parametrize('at, nbytes', [(0, 4), (DEVICE_BASE - 1, 4), (DEVICE_BASE, 4097),
                                        (DEVICE_BASE + 4096, 1), (DEVICE_BASE, -1),
                                        (DEVICE_BASE, 1.5)])
def test_a_server_refuses_device_ranges_outside_the_segment(sharing, at, nbytes):
    segment = DeviceSegment(sharing, 4096)
    server = DeviceMapping(sharing, segment.describe())
    with pytest.raises(ProtocolError, match='outside the worker\'s device segment'):
        server.view(at, nbytes)
    server.close()
    with pytest.raises(ProtocolError):
        server.view(DEVICE_BASE, 4)   # unmapped
    segment.close()


@pytest.mark.parametrize('change, why', [
    ({'kind': 'cuda'}, "a device segment of 'cuda' memory, this server shares 'host'"),
    ({'handle': b'1' * 64}, 'not a kvps segment name'),
    ({'event': b'1' * 64}, 'not a device event handle'),
    ({'size': 1 << 50}, 'out of range'),
])
def test_a_server_maps_only_a_segment_described_right(sharing, change, why):
    segment = DeviceSegment(sharing, 4096)
    with pytest.raises(ProtocolError, match=why):
        DeviceMapping(sharing, {**segment.describe(), **change})
    with pytest.raises(ProtocolError, match='not a map'):
        DeviceMapping(sharing, [1])
    assert sharing.open_buffers == 1   # the worker's own: nothing half-mapped stays open
    segment.close()


# -- CUDA IPC, through a stand-in for cupy that records the runtime calls ----------------------
class FakeCupy:
    """What CudaSharing uses of cupy, recording each runtime call into ``calls``; handles the
    'driver' does not know fail as cupy's CUDARuntimeError would."""

    def __init__(self):
        calls = self.calls = []
        fake = self

        class Memory:
            def __init__(self, nbytes):
                self.ptr, self.nbytes = 0x1000, nbytes
                calls.append(('malloc', nbytes, fake.current))

        class UnownedMemory:
            def __init__(self, ptr, nbytes, owner):
                self.ptr, self.nbytes, self.owner = ptr, nbytes, owner

        class Device:
            def __init__(self, index=None):
                self.index = index

            def __enter__(self):
                fake.current = self.index

            def __exit__(self, *exc):
                fake.current = None

        class Event:
            def __init__(self, block, disable_timing, interprocess):
                assert interprocess and disable_timing   # (CUDA refuses timing on IPC events)
                self.ptr = 0x2000
                calls.append(('event', fake.current))


        def open_mem(handle):
            if handle != b'm' * 64:
                raise RuntimeError('cudaErrorInvalidResourceHandle')
            calls.append(('open', handle))
            return 0x3000

        self.current = None
        self.uint8 = np.uint8
        self.ndarray = lambda shape, dtype, pointer: SimpleNamespace(
            nbytes=shape[0], data=pointer, shape=shape)
        runtime = SimpleNamespace(
            ipcGetMemHandle=lambda ptr: b'm' * 64, ipcOpenMemHandle=open_mem,
            ipcCloseMemHandle=lambda ptr: calls.append(('close', ptr)),
            ipcGetEventHandle=lambda ptr: b'e' * 64,
            ipcOpenEventHandle=lambda handle: calls.append(('open event', fake.current)) or
            0x4000,
            streamWaitEvent=lambda stream, event, flags: calls.append(('wait', stream, event)),
            eventRecord=lambda event, stream: calls.append(('record', event, stream)),
            eventSynchronize=lambda event: calls.append(('synchronize', event, fake.current)),
            eventDestroy=lambda ptr: calls.append(('destroy', ptr)))
        self.cuda = SimpleNamespace(
            runtime=runtime, Memory=Memory, UnownedMemory=UnownedMemory, Device=Device,
            Event=Event, MemoryPointer=lambda memory, offset: SimpleNamespace(
                mem=memory, ptr=memory.ptr + offset),
            get_current_stream=lambda: SimpleNamespace(ptr=0x5000))


@pytest.fixture
def cupy(monkeypatch):
    fake = FakeCupy()
    monkeypatch.setitem(sys.modules, 'cupy', fake)
    return fake


def test_cuda_buffers_are_allocations_of_their_own_on_the_values_device(cupy):
    sharing = sharing_for('cuda', device=3)
    mine = sharing.export(4096)
    assert cupy.calls == [('malloc', 4096, 3)] and mine.handle == b'm' * 64
    piece, anchor = sharing.piece(mine, 1024, 512)
    assert piece.data.ptr == 0x1000 + 1024 and piece.data.mem.owner is anchor
    assert sharing.address(piece) == 0x1000 + 1024
    theirs = sharing.open(mine.handle, 4096)
    theirs.close()
    theirs.close()
    assert cupy.calls[1:] == [('open', b'm' * 64), ('close', 0x3000)]   # closed once
    with pytest.raises(ProtocolError, match='cannot open a device buffer handle'):
        sharing.open(b'x' * 64, 4096)
    mine.close()
    assert sharing.open_buffers == 0


def test_cuda_events_are_interprocess_and_waited_for_on_the_current_stream(cupy):
    sharing = sharing_for('cuda', device=1)
    event = sharing.event()
    assert event.handle == b'e' * 64 and cupy.calls == [('event', 1)]
    event.record(0x7000)   # on the stream of the copies (torch's current one)
    event.record(0x8000)   # another stream: it waits for the record before, then records
    event.record()         # (no stream: the legacy default one)
    peer = sharing.open_event(event.handle)
    peer.wait()
    peer.synchronize()   # (a worker's I/O thread, for a server's answer: on the device's own)
    peer.close()
    peer.close()
    assert cupy.calls[1:] == [('record', 0x2000, 0x7000),
                              ('wait', 0x8000, 0x2000), ('record', 0x2000, 0x8000),
                              ('wait', 0, 0x2000), ('record', 0x2000, 0),
                              ('open event', 1), ('wait', 0x5000, 0x4000),
                              ('synchronize', 0x4000, 1), ('destroy', 0x4000)]


def test_cuda_ipc_without_cupy_is_a_config_error(monkeypatch):
    monkeypatch.setitem(sys.modules, 'cupy', None)
    with pytest.raises(ConfigError, match='CUDA IPC needs cupy'):
        sharing_for('cuda')


def test_a_host_copy_of_a_block_waits_for_the_writes_recorded_so_far(cupy):
    # (a push sent again to a restarted server as a frame: its copy into the block may still
    # be running on the writer's stream)
    segment = DeviceSegment(sharing_for('cuda'), 4096)
    at, _ = segment.take(64)
    segment.record(0x7000)
    copies = []
    cupy.asnumpy = lambda array: copies.append(cupy.calls[-1]) or len(array)
    segment.buffer.array = list(range(4096))   # (slices of the fake's arrays: lists)
    assert segment.host_copy(at + 64, 32) == 32 and copies == [('synchronize', 0x2000, None)]
    assert cupy.calls[-2:] == [('record', 0x2000, 0x7000), ('synchronize', 0x2000, None)]
    segment.buffer.array = None   # (closed: nothing to free in the fake)
    segment.close()


def test_a_gpu_s_device_segment_finds_no_host_array_in_it(cupy):
    segment = DeviceSegment(sharing_for('cuda'), 4096)
    assert segment.offset_of(np.zeros(4)) is None   # (a host payload: never asked its .data)
    at, block = segment.take(64)
    assert segment.offset_of(block) == at
    segment.close()
