"""Rows on a GPU: a GPU shard's lazy row updates and row pulls against a host shard's, and CUDA values and targets in a device store."""

import numpy as np
import pytest

pytestmark = pytest.mark.gpu
cupy = pytest.importorskip('cupy')
try:
    HAS_GPU = cupy.cuda.runtime.getDeviceCount() > 0
except Exception:  # no driver
    HAS_GPU = False
if not HAS_GPU:
    pytest.skip('no CUDA device', allow_module_level=True)

import torch  # noqa: E402

import kvps
from kvps import rows  # noqa: E402
from kvps.server.storage import CudaArrays, HostArrays, Storage  # noqa: E402
from kvps.server.shard import Shard  # noqa: E402
from kvps.optimizer.updater import Updater  # noqa: E402


def run_shard(arrays, optimizer):
    shard = Shard(2, Updater(kvps.optimizer.create(optimizer, learning_rate=0.1, wd=0.01)),
                  storage=Storage(arrays, arrays))
    start = np.arange(24, dtype=np.float32)
    shard.init('i', 'k', 0, 'float32', [8, 3], True, memoryview(start).cast('B'))
    for step in range(3):
        for worker, ids in ((b'worker-0', [1, step + 2]), (b'worker-1', [step + 2, 7])):
            values = np.full((2, 3), step + 1.0, np.float32)
            shard.push('p', worker, 'k', 0, 'rows', True,
                       memoryview(rows.encode(np.array(ids), values)))
    (_, _, (_, _, payload)), = shard.pull('q', b'worker-0', 'k', 0, (None, None))
    return rows.decode(payload, 3, np.dtype(np.float32), 8)


@pytest.mark.parametrize('optimizer', ['sgd', 'adam'])
def test_gpu_shard_updates_rows_as_the_host_shard(optimizer):
    host_ids, host_rows = run_shard(HostArrays(), optimizer)
    gpu_ids, gpu_rows = run_shard(CudaArrays(), optimizer)
    assert gpu_ids.tolist() == host_ids.tolist()
    np.testing.assert_allclose(gpu_rows, host_rows, rtol=1e-6)


def test_a_device_store_takes_cuda_rows_and_pulls_rows_onto_the_gpu():
    kv = kvps.create('device')
    kv.init(0, torch.zeros(6, 2, device='cuda'))
    grad = kvps.RowSparse(torch.tensor([4, 1, 4], device='cuda'), torch.ones(3, 2, device='cuda'))
    kv.push(0, grad)
    out = torch.full((6, 2), -1.0, device='cuda')
    kv.row_sparse_pull(0, out=out, row_ids=torch.tensor([4, 0], device='cuda'))
    assert out[:, 0].tolist() == [0, -1, -1, -1, 2, -1]
