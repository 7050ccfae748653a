"""Pushes over the socket held in the worker (KVPS_SOCKET_QUEUE) change no result: push then
pull loops, pulls begun per key, pushpull and a barrier give the exact values in dist_sync and
dist_async, and the pushes were held."""

import pytest

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(180)]

SCRIPT = '''
kv = kvps.create(os.environ['STORE'])
r, n = kv.rank, kv.num_workers
# keys of 1.2 MB go in messages of their own: each waits for zmq to take the one before
sizes = [300000, 5, 300000, 300, 300000, 300000]
keys = list(range(len(sizes)))
kv.init(keys, [np.zeros(size, np.float32) for size in sizes])
kv.set_optimizer(kvps.optimizer.create('sgd', learning_rate=1.0))
grads = lambda step: [np.full(size, float(1 + k + step * (r + 1)), np.float32)
                      for k, size in zip(keys, sizes)]
seen = []
for step in range(3):
    kv.push(keys, grads(step))
    outs = [np.zeros(size, np.float32) for size in sizes]
    if step == 1:   # one call per key, begun before any wait
        for k, out in zip(keys, outs):
            kv.pull_begin(k, out)
        kv.pull(keys, out=outs)
    else:
        kv.pull(keys, out=outs)
    seen.append([[float(o[0]), float(o[-1])] for o in outs])
kv.pushpull(keys, grads(3), out=outs)
kv.barrier()
kv.pull(keys, out=outs)
report(rank=r, seen=seen, final=[[float(o[0]), float(o[-1])] for o in outs],
       held=kv.stats()['held'])
'''


def pushed(k, step, workers):
    """Every worker's push of key ``k`` in round ``step``, summed."""
    return sum(1 + k + step * (r + 1) for r in range(workers))


@pytest.mark.parametrize('store', ['dist_sync', 'dist_async'])
def test_held_socket_pushes_change_no_result(job, store):
    workers = 2
    result = job(SCRIPT, workers, 1, env={'STORE': store, 'KVPS_SHM': '0',
                                          'KVPS_SOCKET_QUEUE': '1'})
    assert result.returncode == 0, result.output
    results = result.results()
    assert sorted(results) == [0, 1]
    total = [-sum(pushed(k, step, workers) for step in range(4)) for k in range(6)]
    for res in results.values():
        assert res['final'] == [[t, t] for t in total]   # SGD, lr 1: minus every push
        assert res['held'] > 0
        if store == 'dist_sync':   # each pull sees its round: minus the pushes so far
            for step, got in enumerate(res['seen']):
                want = [-sum(pushed(k, s, workers) for s in range(step + 1)) for k in range(6)]
                assert got == [[w, w] for w in want]
