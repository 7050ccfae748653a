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
from test_server_restart import RECOVERY, TRAIN

from kvps.wire.device_segments import DEVICE_BASE

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(240)]

IPC = {'KVPS_IPC': 'host', 'KVPS_IPC_BYTES': str(16 << 20), 'KVPS_BIGARRAY_BOUND': '1000',
       'KVPS_LOG_LEVEL': 'INFO'}
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


# Host shards (KVPS_SERVER_DEVICE=cpu): the servers say they would not map a device segment,
# so the workers never make one (no export of the stand-in's device memory), and their GPU
# values take page-locked shared memory, as the INFO lines say.
COUNT_EXPORTS = """
from kvps.wire.device_sharing import Sharing
EXPORTS, export = [], Sharing.export
Sharing.export = lambda self, nbytes: EXPORTS.append(nbytes) or export(self, nbytes)
"""
ON_HOST_SHARDS = """
kv = kvps.create('dist_sync_device')
kv.init(0, ON_GPU(torch.zeros(5000)))
for step in range(3):
    kv.push(0, ON_GPU(torch.full((5000,), float(kv.rank + 1))))
    out = ON_GPU(torch.zeros(5000))
    kv.pull(0, out=out)
stats = kv.stats()
report(value=out[0].item(), exports=len(EXPORTS), ipc=stats['pushed_bytes']['ipc'],
       shm=stats['pushed_bytes']['shm'])
kv.close()
"""


def on_host_shards_makes_no_device_segment(job, prelude, env):
    """ON_HOST_SHARDS with ``prelude`` (ON_GPU) and settings ``env``, checked."""
    result = job(prelude + COUNT_EXPORTS + ON_HOST_SHARDS, 2, 2,
                 env={**env, 'KVPS_SERVER_DEVICE': 'cpu', 'KVPS_LOG_LEVEL': 'INFO'})
    assert result.returncode == 0, result.output[-4000:]
    for report in result.results().values():
        assert report == {'value': 3.0, 'exports': 0, 'ipc': 0, 'shm': report['shm']}
        assert report['shm'] > 0
    assert result.output.count('no CUDA IPC for GPU values (server 0: this server keeps no '
                               'GPU shards that could map a device segment (on server 0); '
                               'server 1: ') == 2
    assert result.output.count('device values: GPU <-> page-locked shared memory') == 2


def test_a_job_on_host_shards_makes_no_device_segment(job):
    on_host_shards_makes_no_device_segment(job, EMULATED, IPC)


# The Trainer on the ipc route (DEV: where the model is; on the host every torch tensor is
# taken for a GPU value): its fused gradients are gathered in the worker's device segment and
# pushed from there, never copied into a block, and the model trains as plain torch does on the
# combined batch.
TRAINER = """
import copy
into_block, COPIES = kvps.devices._into_block, []
kvps.devices._into_block = lambda *args: COPIES.append(1) or into_block(*args)
kv = kvps.create('dist_sync_device')
rank, nw = kv.rank, kv.num_workers
torch.manual_seed(rank)   # (the Trainer broadcasts rank 0's weights)
model = torch.nn.Sequential(torch.nn.Linear(60, 50), torch.nn.Tanh(), torch.nn.Linear(50, 3))
model = model.to(DEV)
trainer = kvps.Trainer(model.parameters(), 'sgd', {'learning_rate': 0.1, 'momentum': 0.9},
                       kvstore=kv)
ref = copy.deepcopy(model)
ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
loss_fn = torch.nn.CrossEntropyLoss(reduction='sum')
for step in range(5):
    g = torch.Generator().manual_seed(100 + step)
    x, y = torch.randn(8, 60, generator=g).to(DEV), torch.randint(0, 3, (8,), generator=g)
    y = y.to(DEV)
    trainer.zero_grad()
    loss_fn(model(x[rank::nw]), y[rank::nw]).backward()
    trainer.step(len(x))
    ref_opt.zero_grad()
    (loss_fn(ref(x), y) / len(x)).backward()
    ref_opt.step()
diff = max(float((a - b).abs().max()) for a, b in zip(model.parameters(), ref.parameters()))
(fused,) = trainer._layout.fused
segment = kv._backend.io.staging.device.segment
report(diff=diff, in_segment=segment.offset_of(AS_ARRAY(fused.grad)) is not None,
       into_blocks=len(COPIES), ipc=kv.stats()['pushed_bytes']['ipc'])
kv.close()
"""
ON_HOST = """
DEV = 'cpu'
kvps.devices.on_gpu = kvps.arrays.is_torch
AS_ARRAY = lambda t: t.numpy()
"""


def trainer_pushes_from_the_device_segment(job, prelude, env):
    """TRAINER with ``prelude`` (DEV, AS_ARRAY) and settings ``env``, checked."""
    result = job(prelude + TRAINER, 2, 2, env=env)
    assert result.returncode == 0, result.output[-4000:]
    reports = result.results()
    assert sorted(reports) == [0, 1], result.output[-4000:]
    for report in reports.values():
        assert report['diff'] < 1e-5 and report['in_segment'], report
        # 5 pushes of the fused key's 12,812 bytes, none copied into a block
        assert report['into_blocks'] == 0 and report['ipc'] == 5 * 3203 * 4, report


def test_the_trainer_s_fused_gradients_are_pushed_from_the_device_segment(job):
    trainer_pushes_from_the_device_segment(job, EMULATED + ON_HOST, IPC)


# A worker dies by SIGKILL mid-round (key 0 pushed, key 1 not) on the ipc route: the other
# worker's next call raises PeerLostError naming it, as on every route.
KILLED = '''
from kvps.errors import PeerLostError
kv = kvps.create('dist_sync_device')
zeros = lambda: ON_GPU(torch.zeros(5000))
kv.init([0, 1], [zeros(), zeros()])
try:
    for step in range(100000):
        kv.push(0, ON_GPU(torch.ones(5000)))
        if kv.rank == 1 and step == 3:
            print('IPC BYTES', kv.stats()['pushed_bytes']['ipc'], flush=True)
            os.kill(os.getpid(), 9)
        kv.push(1, ON_GPU(torch.ones(5000)))
        kv.pull([0, 1], out=[zeros(), zeros()])
except PeerLostError as exc:
    report(role=exc.role, rank=exc.rank)
    sys.exit(7)
'''


def killed_mid_round(by_hand, extra, prelude):
    """Run KILLED (``prelude`` defines ON_GPU; ``extra``: settings) with 2 workers and 2
    servers started by hand: worker 1 dies by SIGKILL on the ipc route, worker 0 gets a
    PeerLostError naming it, the job ends, and none of its processes left anything in
    /dev/shm (no launcher sweeps here)."""
    sched, env = by_hand.scheduler(num_workers=2, num_servers=2)
    env = {**env, **extra}
    servers = [by_hand('server', env, rank=i) for i in range(2)]
    workers = [by_hand('worker', env, script=prelude + KILLED, rank=r) for r in range(2)]
    code, out = by_hand.finish(workers[1], timeout=60)
    assert code == -9 and int(out.split('IPC BYTES ')[1].split()[0]) > 0, out
    code, out = by_hand.finish(workers[0], timeout=60, exits_when='the heartbeat bound (6 s '
                               'here) names the lost worker, before KVPS_TIMEOUT (60 s)')
    assert code == 7, out
    report = json.loads(out.split('RESULT ', 1)[1].splitlines()[0])
    assert (report['role'], report['rank']) == ('worker', 1)
    for proc in servers + [sched]:
        proc.wait(30)
    for proc in servers + workers + [sched]:
        assert not left_by(proc.pid), proc.args


def test_a_worker_killed_mid_round_is_a_peer_lost_error_and_leaves_nothing(by_hand):
    killed_mid_round(by_hand, IPC, EMULATED)


# test_server_restart.py's job with GPU values on the ipc route: rank 0 kills server 1 with
# SIGKILL mid-round; the launcher restarts it from its checkpoint; the requests it left
# unanswered are resent with their device items as frames, and then it maps each worker's
# device segment again (ATTACH_DEVICE), so later pushes take the ipc route again. The weights
# equal a local store's fed the same pushes, exactly.
AS_GPU_VALUES = """
VALUE = lambda a: ON_GPU(torch.from_numpy(a))
"""


@pytest.mark.parametrize('mode', ['dist_sync_device', 'dist_async_device'])
def test_a_restarted_server_maps_the_device_segments_again(job, tmp_path, mode):
    env = {**IPC, **RECOVERY, 'MODE': mode,
           'KVPS_CHECKPOINT_DIR': str(tmp_path / 'ckpt')}
    result = job(EMULATED + AS_GPU_VALUES + TRAIN, workers=2, servers=2, env=env,
                 launcher_args=['--restart-servers', '1'])
    assert result.returncode == 0, result.output[-4000:]
    assert 'restarting it' in result.stderr and 'rejoined' in result.output
    reports = result.results()
    assert sorted(reports) == [0, 1], result.output[-4000:]
    for report in reports.values():
        assert report['exact'] and report['device_remapped'], report
        assert report['at_after'] == -1 or report['at_after'] >= DEVICE_BASE, report
