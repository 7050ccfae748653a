"""Priorities change only the order requests travel in: a job's results with mixed priorities
are bit for bit those of priority 0, and so are the Trainer's weights with cross_barrier."""

import pytest

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(240)]

CALLS_SCRIPT = '''
import hashlib
kv = kvps.create(os.environ['STORE'])
r = kv.rank
SHAPES = [(4,), (3000,), (7,), (1,), (50, 50), (16,)]   # 3000 and 2500 elements: split


def run(base, prio):
    """Pushes in reverse order, pushes of one key twice at rising priorities, pulls (whole,
    begun, of rows, pushpull) ahead of them: the digests of what every pull brought."""
    keys = [base + i for i in range(len(SHAPES))]
    kv.init(keys, [np.full(s, 1.0, np.float32) for s in SHAPES])
    if base == 0:
        kv.set_optimizer(kvps.optimizer.create('sgd', learning_rate=0.1, momentum=0.9))
    digest = hashlib.sha256()
    for step in range(4):
        grads = [(np.arange(np.prod(s), dtype=np.float32).reshape(s) % 17) * (r + 1) + step
                 for s in SHAPES]
        for i in reversed(range(len(keys))):
            kv.push(keys[i], grads[i], priority=prio(-i))
        kv.push(keys[1], grads[1] * 2, priority=prio(9))   # a second round of key 1
        outs = [np.empty(s, np.float32) for s in SHAPES]
        kv.pull(keys[3:], out=outs[3:], priority=prio(5))
        waits = [kv.pull_begin(keys[i], outs[i], priority=prio(i)) for i in range(3)]
        for wait in waits:
            wait()
        rows = np.zeros(SHAPES[4], np.float32)
        kv.row_sparse_pull(keys[4], out=rows, row_ids=np.array([1, 30, 49]), priority=prio(8))
        kv.pushpull(keys[0], grads[0], out=outs[0], priority=prio(7))
        for out in outs + [rows]:
            digest.update(out.tobytes())
    return digest.hexdigest()


prioritized = run(0, lambda p: p)
plain = run(100, lambda p: 0)
kv.barrier()
report(rank=r, prioritized=prioritized, plain=plain)
'''


@pytest.mark.parametrize('store, workers, servers', [('dist_sync', 2, 2), ('dist_async', 1, 2)])
def test_results_with_priorities_are_exactly_those_of_priority_zero(job, store, workers,
                                                                     servers):
    """Two workers sum in either order to the same bits (a sync round), and one async worker's
    pushes of a key are applied in its order: any difference is the priorities'."""
    result = job(CALLS_SCRIPT, workers, servers,
                 env={'STORE': store, 'KVPS_BIGARRAY_BOUND': '1000'})
    assert result.returncode == 0, result.output
    results = result.results()
    assert sorted(results) == list(range(workers))
    for res in results.values():
        assert res['prioritized'] == res['plain']


TRAIN_SCRIPT = '''
import hashlib
import torch
torch.manual_seed(0)
net = torch.nn.Sequential(torch.nn.Linear(64, 300), torch.nn.ReLU(), torch.nn.Linear(300, 300),
                          torch.nn.ReLU(), torch.nn.Linear(300, 10))
kv = kvps.create('dist_sync')
trainer = kvps.Trainer(net, 'sgd', {'learning_rate': 0.01, 'momentum': 0.9}, kvstore=kv,
                       bucket_bytes=64 << 10, cross_barrier=os.environ['CROSS'] == '1')
for step in range(6):
    torch.manual_seed(100 * step + kv.rank)
    x, y = torch.randn(16, 64), torch.randint(0, 10, (16,))
    trainer.zero_grad()
    torch.nn.functional.cross_entropy(net(x), y, reduction='sum').backward()
    trainer.step(16 * kv.num_workers)
trainer.wait()
digest = hashlib.sha256()
for p in net.parameters():
    digest.update(p.detach().numpy().tobytes())
report(rank=kv.rank, weights=digest.hexdigest())
'''


def test_cross_barrier_training_gives_the_waiting_steps_weights_bit_for_bit(job):
    """Two workers, two servers, keys split and fused: the weights after six steps."""
    weights = {}
    for cross in ('0', '1'):
        result = job(TRAIN_SCRIPT, 2, 2, env={'CROSS': cross, 'KVPS_BIGARRAY_BOUND': '20000'})
        assert result.returncode == 0, result.output
        weights[cross] = {res['weights'] for res in result.results().values()}
        assert len(result.results()) == 2 and len(weights[cross]) == 1   # workers agree
    assert weights['0'] == weights['1']
