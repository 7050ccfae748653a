"""The optimizers MXNet has beyond kvps's first ten, run by the servers of a dist_sync job (two
workers, two servers): each gives, bit for bit, what the same pushes give through a local
store, a float16 key with its float32 master included."""

import hashlib
from pathlib import Path

import numpy as np
import pytest

import kvps

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(240)]

STEPS = 4
RUNS = {   # each with rescale_grad 0.5 and multi_precision (see optimizer)
    'adadelta': dict(rho=0.95, wd=0.01),
    'adamax': dict(learning_rate=0.01, wd=0.01, clip_gradient=1.0),
    'nadam': dict(learning_rate=0.01, schedule_decay=0.1),
    'ftml': dict(learning_rate=0.05),
    'lars': dict(momentum=0.9, eta=0.01, learning_rate=0.5),
    'lbsgd': dict(momentum=0.9, batch_scale=2, warmup_strategy='lars', learning_rate=0.05),
    'sgld': dict(learning_rate=0.01, seed=3),
    'dcasgd': dict(momentum=0.9, lamda=0.1, learning_rate=0.05),
    'ccsgd': dict(momentum=0.9, learning_rate=0.05),
    'adabelief': dict(learning_rate=0.01),
    'lans': dict(learning_rate=0.01, wd=0.01),
}
KEYS = {'a': (300, np.float32), 'b': (7, np.float16)}


def optimizer(name):
    return kvps.optimizer.create(name, rescale_grad=0.5, multi_precision=True, **RUNS[name])


def initial(name, key):
    n, dtype = KEYS[key]
    return np.random.default_rng([list(RUNS).index(name), n]).standard_normal(n).astype(dtype)


def grad(rank, step, name, key):
    n, dtype = KEYS[key]
    rng = np.random.default_rng([rank, step, list(RUNS).index(name), n])
    return rng.standard_normal(n).astype(dtype)


def train(kv, name, ranks):
    """STEPS pushes of ``ranks``' gradients to fresh keys under ``name``; their weights."""
    return digest(weights(kv, name, ranks))


def digest(arrays):   # (what a worker reports: a report line is bounded)
    return hashlib.sha256(b''.join(w.tobytes() for w in arrays)).hexdigest()


def weights(kv, name, ranks):
    kv.set_optimizer(optimizer(name))
    keys = [f'{name}.{key}' for key in KEYS]
    kv.init(keys, [initial(name, key) for key in KEYS])
    for step in range(STEPS):
        kv.push(keys, [[grad(r, step, name, key) for r in ranks] for key in KEYS])
    out = [np.zeros_like(initial(name, key)) for key in KEYS]
    kv.pull(keys, out=out)
    return out


SCRIPT = '''
sys.path.insert(0, os.environ['TEST_DIR'])
from test_dist_more_optimizers import RUNS, train
kv = kvps.create('dist_sync')
report(rank=kv.rank, weights={name: train(kv, name, [kv.rank]) for name in RUNS})
'''


def test_dist_sync_servers_update_as_the_local_store(job):
    result = job(SCRIPT, 2, 2, env={'TEST_DIR': str(Path(__file__).parent)})
    assert result.returncode == 0, result.output
    local, expected = kvps.create('local'), {}
    for name in RUNS:
        got = weights(local, name, [0, 1])
        assert all(np.isfinite(w).all() and not np.array_equal(w, initial(name, key))
                   for w, key in zip(got, KEYS)), name
        expected[name] = digest(got)
    found = result.results()
    assert sorted(found) == [0, 1], result.output
    for res in found.values():
        for name in RUNS:
            assert res['weights'][name] == expected[name], name


# GroupAdaGrad: 2-D keys (one history per row), dense pushes and pushes of some rows, on
# servers that would split the float32 key (MXNET_KVSTORE_BIGARRAY_BOUND below its size): set
# before init, the optimizer keeps its keys whole.
GROUP_KEYS = {'emb': ((40, 6), np.float32), 'small': ((3, 4), np.float16)}
GROUP_ENV = {'MXNET_KVSTORE_BIGARRAY_BOUND': '100'}


def group_weights(kv, ranks):
    kv.set_optimizer(kvps.optimizer.create('groupadagrad', learning_rate=0.1, rescale_grad=0.5,
                                           clip_gradient=1.0, multi_precision=True))
    rng = np.random.default_rng(11)
    kv.init(list(GROUP_KEYS), [rng.standard_normal(shape).astype(dtype)
                               for shape, dtype in GROUP_KEYS.values()])
    for step in range(STEPS):
        for key, (shape, dtype) in GROUP_KEYS.items():
            pushes = []
            for rank in ranks:
                g = np.random.default_rng([rank, step, shape[0]]).standard_normal(shape)
                g = g.astype(dtype)
                ids = np.array(sorted({(step + rank) % shape[0], (5 * step) % shape[0]}))
                pushes.append(kvps.RowSparse(ids, g[ids]) if step % 2 else g)
            kv.push(key, pushes if len(pushes) > 1 else pushes[0])
    out = [np.zeros(shape, dtype) for shape, dtype in GROUP_KEYS.values()]
    kv.pull(list(GROUP_KEYS), out=out)
    return out


GROUP_SCRIPT = '''
sys.path.insert(0, os.environ['TEST_DIR'])
from test_dist_more_optimizers import digest, group_weights
kv = kvps.create('dist_sync')
report(rank=kv.rank, weights=digest(group_weights(kv, [kv.rank])))
'''


def test_groupadagrad_on_dist_sync_servers_updates_as_the_local_store(job):
    result = job(GROUP_SCRIPT, 2, 2, env={'TEST_DIR': str(Path(__file__).parent), **GROUP_ENV})
    assert result.returncode == 0, result.output
    got = group_weights(kvps.create('local'), [0, 1])
    assert all(np.isfinite(w.astype(np.float32)).all() for w in got)
    found = result.results()
    assert sorted(found) == [0, 1], result.output
    assert all(res['weights'] == digest(got) for res in found.values()), result.output
