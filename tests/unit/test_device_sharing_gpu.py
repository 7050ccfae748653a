"""CUDA IPC on a GPU (kvps.wire.device_cuda.CudaSharing), between two processes: a buffer
exported here is written by a peer that opened its handle, behind an event, and the GPU memory
it took is given back once both have closed it; writes still running on a stream of this
process when the event is recorded there are seen by the peer, which only waits on its stream.
Skipped without cupy and a CUDA device."""

import os
import subprocess
import sys

import msgpack
import pytest

from kvps.wire.device_segments import DeviceSegment

pytestmark = pytest.mark.gpu
cupy = pytest.importorskip('cupy')
if cupy.cuda.runtime.getDeviceCount() < 1:
    pytest.skip('no CUDA device', allow_module_level=True)

from kvps.wire.device_cuda import CudaSharing  # noqa: E402  (after the skip)

# The peer: maps the segment a description (hex of msgpack) names, waits on its event, adds 1
# to every byte the first block holds, and says done.
PEER = '''
import sys, msgpack
from kvps.wire.device_segments import DEVICE_BASE, DeviceMapping
from kvps.wire.device_cuda import CudaSharing
mapping = DeviceMapping(CudaSharing(), msgpack.unpackb(bytes.fromhex(sys.stdin.readline())))
mapping.event.wait()
view = mapping.view(DEVICE_BASE, 4096)
view += 1
import cupy
cupy.cuda.get_current_stream().synchronize()
mapping.close()
print('done', flush=True)
'''


def with_this_tree():
    """The environment, with this tree's kvps first on the path (and whatever else is there)."""
    return {**os.environ, 'PYTHONPATH': os.pathsep.join(
        filter(None, [os.getcwd(), os.environ.get('PYTHONPATH')]))}


def used():
    free, total = cupy.cuda.runtime.memGetInfo()
    return total - free


def test_a_peer_writes_the_buffer_this_process_exported():
    before = used()
    segment = DeviceSegment(CudaSharing(), 1 << 20)
    at, block = segment.take(4096)
    block[...] = 41
    segment.event.record()
    peer = subprocess.run([sys.executable, '-c', PEER], capture_output=True, text=True,
                          input=msgpack.packb(segment.describe()).hex() + '\n', timeout=120,
                          env=with_this_tree())
    assert peer.returncode == 0 and 'done' in peer.stdout, peer.stderr
    assert cupy.asnumpy(block).tolist() == [42] * 4096
    del block
    segment.close()
    cupy.get_default_memory_pool().free_all_blocks()
    assert used() <= before + (2 << 20)


# The peer, mapped before the writes are issued: says so, then at 'go' waits on the event
# (its stream only) and adds 1 to the first block, as PEER does.
LATE_PEER = PEER.replace('mapping.event.wait()',
                         "print('mapped', flush=True)\nsys.stdin.readline()\n"
                         "mapping.event.wait()")
SPIN = r'''
extern "C" __global__ void spin(long long cycles) {
    long long start = clock64();
    while (clock64() - start < cycles) {}
}'''


def test_a_peer_waiting_on_the_event_sees_writes_still_running_when_it_was_recorded():
    segment = DeviceSegment(CudaSharing(), 1 << 20)
    at, block = segment.take(4096)
    block[...] = 0
    cupy.cuda.get_current_stream().synchronize()
    peer = subprocess.Popen([sys.executable, '-c', LATE_PEER], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=with_this_tree())
    try:
        peer.stdin.write(msgpack.packb(segment.describe()).hex() + '\n')
        peer.stdin.flush()
        assert peer.stdout.readline().strip() == 'mapped'
        stream = cupy.cuda.Stream(non_blocking=True)   # (as torch's side streams are)
        with stream:   # a second or so of work, then the writes: all queued, none waited for
            cupy.RawKernel(SPIN, 'spin')((1,), (1,), (cupy.int64(2 * 10 ** 9),))
            block[...] = 41
        segment.record(stream.ptr)
        peer.stdin.write('go\n')
        peer.stdin.flush()
        out, err = peer.communicate(timeout=120)
        assert peer.returncode == 0 and 'done' in out, err
    finally:
        if peer.poll() is None:
            peer.kill()
            peer.wait(10)
    assert cupy.asnumpy(block).tolist() == [42] * 4096   # the peer added to 41, not to 0
    del block
    segment.close()
