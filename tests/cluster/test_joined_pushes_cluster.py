"""One-key pushes that leave in shared messages (kvps.worker.joined) change no result: MXNet's
loop (a push per key, then a pull per key; in one round with a priority per key, as Gluon's)
over two servers, through shared memory and over the socket, gives the exact values in
dist_sync and dist_async, with pushes of another thread and a barrier between; and pushes
were joined."""

import pytest

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(180)]

SCRIPT = '''
import threading
kv = kvps.create(os.environ['STORE'])
r = kv.rank
keys = list(range(200))   # small keys, spread over both servers
other = list(range(1000, 1020))   # pushed by a second thread meanwhile
kv.init(keys + other, [np.zeros(7, np.float32) for _ in keys + other])
kv.set_optimizer(kvps.optimizer.create('sgd', learning_rate=1.0))
grad = lambda k, step: np.full(7, float(1 + k % 5 + step * (r + 1)), np.float32)

def pushing_other_keys():
    for step in range(3):
        for k in range(len(other)):
            kv.push(other[k], grad(k, step))
helper = threading.Thread(target=pushing_other_keys)
helper.start()
seen = []
for step in range(3):
    for k in keys:   # (in round 1 with MXNet's Gluon priorities: the first keys highest)
        kv.push(k, grad(k, step), priority=-k if step == 1 else 0)
    outs = [np.zeros(7, np.float32) for _ in keys]
    waits = [kv.pull_begin(k, out) for k, out in zip(keys, outs)]
    for wait in waits:
        wait()
    seen.append([float(out[0]) for out in outs])
helper.join()
kv.barrier()
outs = [np.zeros(7, np.float32) for _ in keys + other]
kv.pull(keys + other, out=outs)
report(rank=r, seen=seen, final=[float(out[0]) for out in outs], joined=kv.stats()['joined'])
'''


def pushed(k, step, workers):
    """Every worker's push of key ``k`` in round ``step``, summed."""
    return sum(1 + k % 5 + step * (r + 1) for r in range(workers))


@pytest.mark.parametrize('store,shm', [('dist_sync', '1'), ('dist_async', '1'),
                                       ('dist_sync', '0')])
def test_joined_one_key_pushes_change_no_result(job, store, shm):
    workers = 2
    result = job(SCRIPT, workers, 2, env={'STORE': store, 'KVPS_SHM': shm})
    assert result.returncode == 0, result.output
    results = result.results()
    assert sorted(results) == [0, 1]
    total = [-sum(pushed(k, step, workers) for step in range(3)) for k in range(200)]
    total += [-sum(pushed(k, step, workers) for step in range(3)) for k in range(20)]
    for res in results.values():
        assert res['final'] == total   # SGD, lr 1: minus every push, none lost or doubled
        # a thread queues a key's push in well under the time the I/O thread waits for the
        # interpreter's lock (5 ms): 200 pushes a round always leave a backlog to join
        assert res['joined'] > 0
        if store == 'dist_sync':   # each pull sees its round: minus the pushes so far
            for step, got in enumerate(res['seen']):
                assert got == [-sum(pushed(k, s, workers) for s in range(step + 1))
                               for k in range(200)]
