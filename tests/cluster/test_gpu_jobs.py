"""Real jobs with CUDA tensors (python -m kvps.launch, several workers, keys split over two
servers): GPU values through CUDA IPC (the default where every server is on the host with GPU
shards) and through page-locked shared memory (KVPS_IPC=off) give exactly what host values
give on the same GPU shards, in dist_sync_device and dist_async_device (bit for bit with SGD,
within 1e-6 with Adam); GPU memory and page-locked memory are all given back, after a job and
after a worker's death; a worker killed mid-round is a PeerLostError on the others; a
restarted server maps the workers' device buffers again; a job on host shards takes no GPU
memory for CUDA IPC (its workers ask first); a Trainer's fused keys are pushed from the
device buffers themselves; the route works between the clients of an MPS daemon
(kvps.launch --mps). Skipped without a CUDA device. The
same jobs run on the host, with stand-ins, in test_device_route_cluster.py and
test_ipc_route_cluster.py."""

import shutil

import pytest
from test_device_route_cluster import SCRIPT, check_reports
from test_ipc_route_cluster import (AS_GPU_VALUES, ROUTE, killed_mid_round,
                                    on_host_shards_makes_no_device_segment,
                                    trainer_pushes_from_the_device_segment)
from test_server_restart import RECOVERY, TRAIN

pytestmark = [pytest.mark.cluster, pytest.mark.gpu, pytest.mark.timeout(240)]

torch = pytest.importorskip('torch')
if not torch.cuda.is_available():
    pytest.skip('no CUDA device', allow_module_level=True)

CUDA = '''
import torch
ON_GPU = lambda t: t.to('cuda')
TO_HOST = lambda t: t.cpu().numpy()
'''
SLACK = 16 << 20   # what the driver may keep of a job's GPU memory (its own bookkeeping)


def gpu_memory_used():
    free, total = torch.cuda.mem_get_info(0)
    return total - free


@pytest.mark.parametrize('ipc, route', [('auto', ROUTE),
                                        ('off', 'device values: GPU <-> page-locked shared')])
@pytest.mark.parametrize('store', ['dist_sync_device', 'dist_async_device'])
def test_cuda_values_give_what_host_values_give(job, store, ipc, route):
    # (host shards behind the same worker path: test_device_route_cluster.py, on the host)
    before = gpu_memory_used()
    result = job(SCRIPT, 3, 2, env={'STORE': store, 'KVPS_SERVER_DEVICE': 'auto',
                                    'KVPS_IPC': ipc, 'KVPS_BIGARRAY_BOUND': '1000',
                                    'KVPS_LOG_LEVEL': 'INFO'})
    assert result.returncode == 0, result.output[-4000:]
    reports = result.results()
    check_reports(reports, 3)
    assert result.output.count(route) == 3
    assert result.output.count('device values: GPU shards') == 2
    for report in reports.values():   # the route each took, by the bytes it moved
        assert (min(report['ipc']) > 0) == (ipc == 'auto'), report
    assert gpu_memory_used() <= before + SLACK   # the job's GPU memory is all back


def test_a_worker_killed_mid_round_is_a_peer_lost_error(by_hand):
    before = gpu_memory_used()
    killed_mid_round(by_hand, {'KVPS_BIGARRAY_BOUND': '1000', 'KVPS_LOG_LEVEL': 'INFO'}, CUDA)
    assert gpu_memory_used() <= before + SLACK   # the dead worker's too


@pytest.mark.parametrize('mode', ['dist_sync_device', 'dist_async_device'])
def test_a_restarted_server_maps_the_device_buffers_again(job, tmp_path, mode):
    before = gpu_memory_used()
    env = {**RECOVERY, 'MODE': mode, 'KVPS_CHECKPOINT_DIR': str(tmp_path / 'ckpt')}
    result = job(CUDA + AS_GPU_VALUES + TRAIN, workers=2, servers=2, env=env,
                 launcher_args=['--restart-servers', '1'])
    assert result.returncode == 0, result.output[-4000:]
    reports = result.results()
    assert sorted(reports) == [0, 1], result.output[-4000:]
    for report in reports.values():
        assert report['exact'] and report['device_remapped'], report
    assert gpu_memory_used() <= before + SLACK


def test_a_job_on_host_shards_exports_no_gpu_memory(job):
    on_host_shards_makes_no_device_segment(job, CUDA, {'KVPS_BIGARRAY_BOUND': '1000'})


def test_the_trainer_s_fused_gradients_are_pushed_from_the_device_buffer(job):
    trainer_pushes_from_the_device_segment(job, CUDA + """
import cupy
DEV = 'cuda'
AS_ARRAY = cupy.from_dlpack
""", {'KVPS_BIGARRAY_BOUND': '1000'})


@pytest.mark.skipif(shutil.which('nvidia-cuda-mps-control') is None,
                    reason='no CUDA MPS on this machine')
def test_cuda_ipc_between_the_clients_of_an_mps_daemon(job):
    # kvps.launch --mps: every process a client of one MPS daemon; the CUDA IPC route between
    # them must give what it gives without (or say plainly that it was not taken)
    result = job(SCRIPT, 2, 2, env={'STORE': 'dist_sync_device', 'KVPS_SERVER_DEVICE': 'auto',
                                    'KVPS_BIGARRAY_BOUND': '1000', 'KVPS_LOG_LEVEL': 'INFO'},
                 launcher_args=['--mps'])
    assert result.returncode == 0, result.output[-4000:]
    assert 'MPS on: a private control daemon' in result.output
    check_reports(result.results(), 2)
    assert result.output.count(ROUTE) == 2, result.output[-4000:]
