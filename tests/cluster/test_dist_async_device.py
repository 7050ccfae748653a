"""dist_async and the device store types on host values, across 2 workers and 2 servers: exact
totals, several values per key, mixed and strided arrays, compression and optimizer state."""

import msgpack
import numpy as np
import pytest

import kvps

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(180)]

# Key 0 (3000 elements) and str key 'c' are split across both servers (bound 1000).
VALUES_SCRIPT = '''
import torch
kv = kvps.create(os.environ['STORE'])
r, sync = kv.rank, '_async' not in os.environ['STORE']
f64 = torch.float64
kv.init([0, 1, 2, 3], [np.zeros(3000, np.float32), np.zeros(5, np.float16),
                       torch.zeros(6, dtype=torch.bfloat16), torch.zeros((2, 3), dtype=f64)])
kv.init([4, 5, 6, 7], [torch.tensor(0.0), torch.zeros(0, 3), np.zeros(4, np.float32), np.zeros(2)])
kv.set_optimizer(kvps.optimizer.create('test', rescale_grad=1.0))   # w += g: exact totals
for _ in range(3):
    # several values per key (one per device), torch and numpy mixed, a transposed view
    kv.push([0, 1, 2, 3, 4, 5], [
        [np.ones(3000, np.float32), torch.arange(3000.0)],
        [np.full(5, 0.5, np.float16), torch.full((5,), 0.25, dtype=torch.float16)],
        [torch.ones(6, dtype=torch.bfloat16)] * 2,
        [torch.arange(6, dtype=f64).reshape(3, 2).t(), np.ones((2, 3))],
        [torch.tensor(1.0 + r), np.array(2.0, np.float32)],
        [torch.zeros(0, 3), np.zeros((0, 3), np.float32)]])
    if r == 0 and not sync:       # async: a key only one worker pushes
        kv.push(6, np.ones(4, np.float32))
mine = np.zeros(2)
kv.pushpull(7, np.full(2, 1.0 + r), out=mine)
# 2bit compression in a second store (str keys, float64): 0.5 - 2**-30 (pushed as two
# halves) is below the threshold, so the rule sends 0, 0.5, 0.5 over three pushes; 0.25
# sends 0, 0.5, 0 (part 1 of the key keeps its own residual)
strs = kvps.create(os.environ['STORE'])
strs.init('c', np.zeros(3000))
strs.set_gradient_compression({'type': '2bit', 'threshold': 0.5})
grad = np.where(np.arange(3000) < 1500, 0.5 - 2.0 ** -30, 0.25)
for _ in range(3):
    strs.push('c', [grad / 2, grad / 2])
kv.barrier()                    # every worker's pushes are applied once it returns
errors = []
for call in (lambda: kv.push(3, torch.zeros((2, 3))),
             lambda: kv.push(1, [np.zeros(5, np.float16), np.zeros(4, np.float16)]),
             lambda: kv.pull(3, out=[torch.zeros(2, 3, dtype=f64), np.zeros((3, 2))])):
    try:
        call()
    except kvps.KVPSError as exc:
        errors.append(f'{type(exc).__name__}: {exc}')
big = [torch.zeros(3000), np.zeros(3000, np.float32)]
small = [np.zeros(5, np.float16), torch.zeros(6, dtype=torch.bfloat16)]
grid = [torch.zeros(3, 2, dtype=f64).t(), np.zeros((3, 2)).T, torch.zeros(2, 3, dtype=f64)]
scalar = [torch.tensor(-1.0), np.array(-1.0, np.float32)]
empty, one, both = torch.zeros(0, 3), np.zeros(4, np.float32), np.zeros(2)
kv.pull([0, 1, 2, 3, 4, 5, 6, 7], out=[big, small[0], small[1], grid, scalar, empty, one, both])
c = np.zeros(3000); strs.pull('c', out=c)
report(rank=r, big=[b.tolist()[:3] + b.tolist()[-1:] for b in big],
       small=[s.tolist() for s in small], grid=[g.tolist() for g in grid],
       scalar=[float(s) for s in scalar], empty=list(empty.shape), one=one.tolist(),
       mine=mine.tolist(), both=both.tolist(), c=[c[0], c[1499], c[1500], c[-1]], errors=errors)
'''


@pytest.mark.parametrize('store', ['dist_async', 'dist_async_device', 'dist_sync_device'])
def test_every_push_counts_once_with_several_mixed_values_per_key(job, store):
    result = job(VALUES_SCRIPT, 2, 2, env={'STORE': store, 'KVPS_BIGARRAY_BOUND': '1000'})
    assert result.returncode == 0, result.output
    results = result.results()
    assert sorted(results) == [0, 1]
    sync = '_async' not in store
    for rank, res in results.items():
        # 2 workers x 3 pushes of (1 + j) per element j
        assert res['big'] == [[6.0, 12.0, 18.0, 18000.0]] * 2
        assert res['small'] == [[4.5] * 5, [12.0] * 6]
        assert res['grid'] == [[[6.0, 18.0, 30.0], [12.0, 24.0, 36.0]]] * 3
        assert res['scalar'] == [21.0, 21.0] and res['empty'] == [0, 3]
        assert res['one'] == ([0.0] * 4 if sync else [3.0] * 4)
        # pushpull sees at least this worker's push (sync: the round's sum); after the
        # barrier every worker's
        assert res['mine'] in ([[3.0, 3.0]] if sync else [[1.0 + rank] * 2, [3.0] * 2])
        assert res['both'] == [3.0, 3.0]
        assert res['c'] == [2.0, 2.0, 1.0, 1.0]
        assert len(res['errors']) == 3
        assert res['errors'][0].startswith('DTypeError: key 3: pushed value has dtype float32')
        assert res['errors'][1].startswith('ShapeError: key 1: pushed value has shape (4,)')
        assert res['errors'][2].startswith('ShapeError: key 3: pull target has shape (3, 2)')


STATES_SCRIPT = '''
kv = kvps.create('dist_async')
r = kv.rank
kv.init(['big', 'small'], [np.zeros(3000, np.float32), np.zeros(5)])
# no optimizer: a push replaces the value, whichever worker made it last
if r == 0:
    kv.push(['big', 'small'], [np.full(3000, 7.0, np.float32), np.full(5, 7.0)])
kv.barrier()
if r == 1:
    kv.push(['big', 'small'], [[np.full(3000, 1.0, np.float32)] * 2, np.full(5, 2.0)])
kv.barrier()
replaced = [np.zeros(3000, np.float32), np.zeros(5)]
kv.pull(['big', 'small'], out=replaced)
kv.set_optimizer(kvps.optimizer.create('adam', learning_rate=0.01))
for _ in range(4):   # the same gradients from both workers: the order of updates is moot
    kv.push(['big', 'small'], [np.full(3000, 0.5, np.float32), [np.full(5, 0.25)] * 2])
kv.barrier()
if r == 0:
    kv.save_optimizer_states(os.environ['SAVE'], dump_optimizer=True)
kv.barrier()
for _ in range(3):
    kv.push(['big', 'small'], [np.full(3000, -1.0, np.float32), np.full(5, 2.0)])
kv.barrier()
kv.load_optimizer_states(os.environ['SAVE'])   # state back to the save; weights go on
for _ in range(2):
    kv.push(['big', 'small'], [np.full(3000, 0.5, np.float32), np.full(5, 0.5)])
kv.barrier()
outs = [np.zeros(3000, np.float32), np.zeros(5)]
kv.pull(['big', 'small'], out=outs)
report(rank=r, replaced=[replaced[0][[0, -1]].tolist(), replaced[1].tolist()],
       weights=[outs[0][[0, 1500, -1]].tolist(), outs[1].tolist()])
'''


def _pushes(kv, grads, times):
    for _ in range(times):
        kv.push(['big', 'small'], [np.full(3000, grads[0], np.float32), np.full(5, grads[1])])


def test_async_optimizer_state_saved_after_a_barrier_is_exact(job, tmp_path):
    """After a barrier, a dist_async save holds what a local store that applied the same
    pushes one by one holds (a split key's parts included), and loading it back resumes
    from there."""
    saved = tmp_path / 'async.states'
    result = job(STATES_SCRIPT, 2, 2, env={'KVPS_BIGARRAY_BOUND': '1000', 'SAVE': str(saved)})
    assert result.returncode == 0, result.output
    kv = kvps.create('local')
    kv.init(['big', 'small'], [np.full(3000, 2.0, np.float32), np.full(5, 2.0)])
    kv.set_optimizer(kvps.optimizer.create('adam', learning_rate=0.01))
    _pushes(kv, (0.5, 0.5), 8)     # 2 workers x 4 async pushes, each its own update
    local = tmp_path / 'local.states'
    kv.save_optimizer_states(str(local), dump_optimizer=True)
    assert msgpack.unpackb(saved.read_bytes(), strict_map_key=False) == \
        msgpack.unpackb(local.read_bytes(), strict_map_key=False)
    _pushes(kv, (-1.0, 2.0), 6)
    kv.load_optimizer_states(str(local))
    _pushes(kv, (0.5, 0.5), 4)
    outs = [np.zeros(3000, np.float32), np.zeros(5)]
    kv.pull(['big', 'small'], out=outs)
    for res in result.results().values():
        assert res['replaced'] == [[2.0, 2.0], [2.0] * 5]
        assert res['weights'] == [outs[0][[0, 1500, -1]].tolist(), outs[1].tolist()]
