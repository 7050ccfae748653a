"""The route of GPU values through a real job, on the host: workers whose torch tensors are taken
for GPU values (and a stand-in for cudaHostRegister) push them straight into their page-locked
segments and land pulls from there in their I/O threads, and get exactly what host values
get; every lock is given back. The same job on a GPU is tests/cluster/test_gpu_jobs.py."""

import pytest

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(240)]

# Every worker pushes the same gradients twice per key: as CUDA tensors to the 'gpu' keys
# and as host tensors to the 'host' keys (both through device stores: the same servers and
# the same placement). Gradients are multiples of 2**-8 of at most 8: sums of a round are
# exact in any order, so in dist_sync the servers' arrival order changes nothing, and in
# dist_async every worker pushes the same gradients in a step (a barrier between steps).
# SGD first (keys 'a*'), then Adam (keys 'b*'); 'big' keys are split over both servers.
SCRIPT = '''
import hashlib, zlib, torch
from kvps import pinning
store = os.environ['STORE']
kv = kvps.create(store)
r, sync, dev = kv.rank, '_async' not in store, torch.device('cuda', 0)
on_gpu = globals().get('ON_GPU') or (lambda t: t.to(dev))   # (EMULATED: marked host tensors)
base = torch.cuda.memory_allocated(dev) if 'ON_GPU' not in globals() else 0
shapes = {'small': (300,), 'big': (5000,), 'half': (257,)}
dtypes = {'small': torch.float32, 'big': torch.float32, 'half': torch.bfloat16}

def grad(name, step):
    gen = torch.Generator().manual_seed(zlib.crc32(f'{name} {step} {r if sync else 0}'.encode()))
    g = torch.randint(-512, 512, shapes[name], generator=gen) / 256.0
    return g.to(dtypes[name])

def run(prefix, optimizer, steps):
    keys = [f'{prefix}{where}-{name}' for where in ('gpu', 'host') for name in shapes]
    init = [torch.linspace(-1, 1, shapes[n][0]).to(dtypes[n]) for n in shapes] * 2
    kv.init(keys, [on_gpu(t) if i < len(shapes) else t for i, t in enumerate(init)])
    kv.set_optimizer(optimizer)
    outs = [on_gpu(torch.zeros(shapes[n], dtype=dtypes[n])) for n in shapes]
    outs += [torch.zeros(shapes[n], dtype=dtypes[n]) for n in shapes]
    for step in range(steps):
        grads = [grad(n, step) for n in shapes]
        kv.push(keys, [on_gpu(g) for g in grads] + grads)
        kv.pull(keys, out=outs)
        if not sync:
            kv.barrier()
    kv.pull(keys, out=outs)
    outs = [o.float().cpu() for o in outs]
    # per name: GPU values' result bit for bit the host values', their largest difference,
    # and a digest of it (every worker must have pulled the same)
    return {name: [torch.equal(g, h), (g - h).abs().max().item(),
                   hashlib.sha256(g.numpy().tobytes()).hexdigest()]
            for name, g, h in zip(shapes, outs[:len(shapes)], outs[len(shapes):])}

got = {'sgd': run('a', kvps.optimizer.create('sgd', learning_rate=0.25, momentum=0.5), 4),
       'adam': run('b', kvps.optimizer.create('adam', learning_rate=0.01), 4)}
gone = torch.cuda.memory_allocated(dev) if 'ON_GPU' not in globals() else 0
stats = kv.stats()
kv.close()
locked = sum(len(region.locked) for region in pinning.REGISTRY._regions)
report(rank=r, values=got, allocated=[base, gone], locked=locked,
       shm=[stats['pushed_bytes']['shm'], stats['pulled_bytes']['shm']],
       ipc=[stats['pushed_bytes']['ipc'], stats['pulled_bytes']['ipc']], pid=os.getpid(),
       counted=globals().get('COUNTED'))
'''


# Host tensors taken for GPU values (marked, so the 'host' keys' tensors are not), and a
# stand-in for cudaHostRegister that counts what it locks, installed before any copy.
EMULATED = '''
import torch
import kvps.devices
from kvps import pinning

class Locker:
    locks = 0
    def lock(self, address, nbytes, writable):
        Locker.locks += 1
    def unlock(self, address):
        pass

pinning.REGISTRY.use(Locker())
kvps.devices.on_gpu = lambda value: getattr(value, 'on_gpu', False)

def ON_GPU(t):
    t = t.clone()
    t.on_gpu = True
    return t

COUNTED = {'landed': 0, 'into_blocks': 0}   # part writes through Landings, copies into blocks
setitem, into_block = kvps.devices.Landing.__setitem__, kvps.devices._into_block

def counted_setitem(self, where, source):
    COUNTED['landed'] += 1
    setitem(self, where, source)

def counted_into_block(flat, block):
    COUNTED['into_blocks'] += block is not None
    return into_block(flat, block)

kvps.devices.Landing.__setitem__ = counted_setitem
kvps.devices._into_block = counted_into_block
'''


def check_reports(reports, workers):
    """What every worker of SCRIPT reported: GPU values' results bit for bit the host values'
    with SGD, within 1e-6 with Adam, the same on every worker, nothing left allocated or
    locked."""
    assert sorted(reports) == list(range(workers))
    for rank, report in reports.items():
        for name, (equal, diff, _) in report['values']['sgd'].items():
            assert equal, (rank, 'sgd', name, diff)
        for name, (_, diff, _) in report['values']['adam'].items():
            assert diff <= 1e-6, (rank, 'adam', name, diff)
        assert report['values'] == reports[0]['values']
        assert report['allocated'][1] == report['allocated'][0]
        assert report['locked'] == 0


@pytest.mark.parametrize('store', ['dist_sync_device', 'dist_async_device'])
def test_gpu_values_take_page_locked_shared_memory_through_a_job(job, store):
    result = job(EMULATED + SCRIPT, 3, 2, env={'STORE': store, 'KVPS_BIGARRAY_BOUND': '1000',
                                               'KVPS_LOG_LEVEL': 'INFO'})
    assert result.returncode == 0, result.output[-4000:]
    reports = result.results()
    check_reports(reports, 3)
    assert result.output.count('device values: GPU <-> page-locked shared memory') == 3
    for report in reports.values():   # the keys over 1 KiB went through shared memory
        assert min(report['shm']) > 0
        assert min(report['counted'].values()) > 0   # pushed into blocks, pulls landed
