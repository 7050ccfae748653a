"""Page-locked shared memory on a real GPU: cudaHostRegister through torch (workers) and cupy
(servers) on /dev/shm mappings, pushes copied from CUDA tensors straight into the segment,
pulls written straight onto them, a GPU shard's copies in and out, a refused lock that leaves
torch working, and no GPU memory left behind. The same logic runs on the host in
test_device_direct.py and test_device_arrays.py."""

import importlib.util

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

torch = pytest.importorskip('torch')
if not torch.cuda.is_available():
    pytest.skip('no CUDA device', allow_module_level=True)

from test_device_direct import N, ShmBackend, in_segment  # noqa: E402

from kvps import devices, pinning  # noqa: E402
from kvps.kvstore import KVStore  # noqa: E402
from kvps.wire.shm import Segment  # noqa: E402

GPU = torch.device('cuda', 0)
HAS_CUPY = importlib.util.find_spec('cupy') is not None


@pytest.fixture
def registry(monkeypatch):
    """A fresh registry: the device path installs torch's locker in it."""
    fresh = pinning.Registry()
    monkeypatch.setattr(pinning, 'REGISTRY', fresh)
    monkeypatch.setattr(devices, '_ROUTE_TOLD', False)
    return fresh


@pytest.fixture
def staged(monkeypatch):
    made, make = [], devices._host_buffer
    monkeypatch.setattr(devices, '_host_buffer',
                        lambda *args: made.append(args[0]) or make(*args))
    return made


def test_torch_locks_and_unlocks_a_dev_shm_mapping(registry):
    devices._use_torch_locker()
    segment = Segment.create(32 << 20, grows=True)
    try:
        offset, block = segment.take(1 << 20)
        assert registry.spans(block.ctypes.data, block.nbytes) == [(0, 1 << 20)]
        assert torch.from_numpy(block).is_pinned()
        segment.release()
        assert not torch.from_numpy(block).is_pinned()
    finally:
        segment.close()


def test_a_refused_lock_is_a_lock_failed_and_torch_goes_on(registry):
    locker = pinning.TorchLocker()
    with pytest.raises(pinning.LockFailed, match='cudaHostRegister'):
        locker.lock(0, 4096, True)                      # no memory there: CUDA refuses
    assert (torch.ones(4, device=GPU) * 2).sum().item() == 8.0   # no stale error raised


@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16])
def test_cuda_values_go_straight_between_the_gpu_and_the_segment(tmp_path, registry, staged,
                                                                 dtype):
    backend = ShmBackend('/dev/shm')
    kv = KVStore('dist_sync_device', backend)
    kv.init(['a', 'split'], [torch.zeros(N, dtype=dtype, device=GPU),
                             torch.zeros(2 * N, dtype=dtype, device=GPU)])
    before = torch.cuda.memory_allocated(GPU)
    staged.clear()
    grads = [[torch.full((N,), 1.5, dtype=dtype, device=GPU)] * 2,
             torch.arange(2 * N, device=GPU).to(dtype)]
    kv.push(['a', 'split'], grads)
    a, parts = backend.held[-2:]
    assert staged == [] and in_segment(backend, a) and all(in_segment(backend, p) for p in parts)
    out = [torch.zeros(N, dtype=dtype, device=GPU),
           torch.zeros(2 * N, 2, device=GPU)[:, 0]]   # strided, float32: from a buffer
    kv.pull(['a', 'split'], out=out)
    assert staged == [] and backend.messages == 2
    assert (out[0] == 3.0).all() and torch.equal(out[1].reshape(-1), grads[1].float())
    del grads, out, a, parts
    backend.held.clear()
    assert torch.cuda.memory_allocated(GPU) == before   # nothing of kvps's left on the GPU
    backend.staging.close()
    assert registry._regions == [] or all(not r.locked for r in registry._regions)


@pytest.mark.skipif(not HAS_CUPY, reason='needs cupy (GPU shards)')
def test_a_gpu_shard_copies_straight_between_the_device_and_a_worker_s_segment(tmp_path,
                                                                               monkeypatch):
    from test_device_arrays import N, Server1   # its own size: what its pulls take

    from kvps.server.device_arrays import CudaArrays
    server = Server1('/dev/shm', monkeypatch, gpu=CudaArrays)   # cupy's locker, for real
    server.init('k', np.zeros(N, np.float32))
    server.push('k', np.full(N, 2.5, np.float32))
    server.push('k', np.full(N, 1.0, np.float32), in_segment=False)   # a socket frame
    delivery, block, lease = server.pull('k')
    assert block.view(np.float32).tolist() == [1.0] * N and lease.done
    delivery, _, _ = server.pull('k', in_segment=False)
    assert delivery.frames[0].tolist() == [1.0] * N
    assert any(r.locked for r in pinning.REGISTRY._regions)   # the worker's segment
    server.lending.close()
    assert all(not r.locked for r in pinning.REGISTRY._regions)
    server.segment.close()
