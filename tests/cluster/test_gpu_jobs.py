"""Real jobs with CUDA tensors (python -m kvps.launch, several workers, keys split over two
servers): GPU values through page-locked shared memory give exactly what host values give on
the same GPU shards, in dist_sync_device and dist_async_device (bit for bit with SGD, within
1e-6 with Adam); GPU memory and page-locked memory are all given back; a worker killed
mid-round is a PeerLostError on the others. Skipped without a CUDA device."""

import json
import signal

import pytest
from test_device_route_cluster import SCRIPT, check_reports

pytestmark = [pytest.mark.cluster, pytest.mark.gpu, pytest.mark.timeout(240)]

torch = pytest.importorskip('torch')
if not torch.cuda.is_available():
    pytest.skip('no CUDA device', allow_module_level=True)


def gpu_memory_used():
    free, total = torch.cuda.mem_get_info(0)
    return total - free


@pytest.mark.parametrize('store', ['dist_sync_device', 'dist_async_device'])
def test_cuda_values_give_what_host_values_give(job, store):
    # (host shards behind the same worker path: test_device_route_cluster.py, on the host)
    before = gpu_memory_used()
    result = job(SCRIPT, 3, 2, env={'STORE': store, 'KVPS_SERVER_DEVICE': 'auto',
                                    'KVPS_BIGARRAY_BOUND': '1000', 'KVPS_LOG_LEVEL': 'INFO'})
    assert result.returncode == 0, result.output[-4000:]
    check_reports(result.results(), 3)
    assert result.output.count('device values: GPU <-> page-locked shared memory') == 3
    assert result.output.count('device values: GPU shards') == 2
    assert gpu_memory_used() <= before + (16 << 20)   # the job's GPU memory is all back


KILLED = '''
import torch
from kvps.errors import PeerLostError
kv = kvps.create('dist_sync_device')
dev = torch.device('cuda', 0)
kv.init([0, 1], [torch.zeros(5000, device=dev), torch.zeros(5000, device=dev)])
print('READY', flush=True)
try:
    for step in range(100000):
        kv.push(0, torch.ones(5000, device=dev))
        if kv.rank == 1 and step == 3:
            os.kill(os.getpid(), 9)          # dies mid-round: key 0 pushed, key 1 not
        kv.push(1, torch.ones(5000, device=dev))
        kv.pull([0, 1], out=[torch.zeros(5000, device=dev), torch.zeros(5000, device=dev)])
except PeerLostError as exc:
    report(role=exc.role, rank=exc.rank)
    sys.exit(7)
'''


def test_a_worker_killed_mid_round_is_a_peer_lost_error(by_hand):
    before = gpu_memory_used()
    sched, env = by_hand.scheduler(num_workers=2, num_servers=2)
    servers = [by_hand('server', {**env, 'KVPS_BIGARRAY_BOUND': '1000'}, rank=i)
               for i in range(2)]
    workers = [by_hand('worker', {**env, 'KVPS_BIGARRAY_BOUND': '1000'}, script=KILLED, rank=r)
               for r in range(2)]
    assert workers[1].wait(60) == -signal.SIGKILL
    code, out = by_hand.finish(workers[0], timeout=60, exits_when='the heartbeat bound (6 s '
                               'here) names the lost worker, before KVPS_TIMEOUT (60 s)')
    assert code == 7, out
    report = json.loads(out.split('RESULT ', 1)[1].splitlines()[0])
    assert (report['role'], report['rank']) == ('worker', 1)
    for proc in servers + [sched]:
        proc.wait(30)
    assert gpu_memory_used() <= before + (16 << 20)
