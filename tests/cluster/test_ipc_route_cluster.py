"""The ipc route through real jobs, on the host: workers whose torch tensors are taken for GPU
values push them into their device segments and pull from them (the host stand-in of CUDA IPC,
KVPS_IPC=host, which also gives the servers emulated GPU shards), and get exactly what the
same values get through shared memory; a worker killed mid-round is a PeerLostError naming
it, and a restarted server maps the device segments again. The same jobs on a GPU are in
tests/cluster/test_gpu_jobs.py."""

import glob
import json

import pytest
from test_device_route_cluster import EMULATED, SCRIPT, check_reports

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(240)]

IPC = {'KVPS_IPC': 'host', 'KVPS_BIGARRAY_BOUND': '1000', 'KVPS_LOG_LEVEL': 'INFO'}
ROUTE = 'device values: GPU <-> CUDA IPC'


def left_by(pid):
    """What process ``pid`` left in /dev/shm (its segments, the stand-in's device buffers)."""
    return glob.glob(f'/dev/shm/kvps-{pid}-*')


@pytest.mark.parametrize('store', ['dist_sync_device', 'dist_async_device'])
def test_the_ipc_route_gives_what_shared_memory_gives(job, store):
    # SCRIPT pushes every gradient twice: as GPU values to the 'gpu' keys (the ipc route) and
    # as host values to the 'host' keys (shared memory), all on the same emulated GPU shards
    result = job(EMULATED + SCRIPT, 2, 2, env={**IPC, 'STORE': store})
    assert result.returncode == 0, result.output[-4000:]
    reports = result.results()
    check_reports(reports, 2)
    assert result.output.count(ROUTE) == 2
    assert result.output.count('device values: GPU shards') == 2   # (the servers' line)
    for report in reports.values():
        assert min(report['ipc']) > 0 and min(report['shm']) > 0
        assert not left_by(report['pid'])
