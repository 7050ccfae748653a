"""Server-side optimizers: dist_sync equals the local store; optimizer state survives a new job."""

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

import kvps

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(240)]

OPTIMIZERS = {
    'adam': dict(learning_rate=0.01, wd=0.01, rescale_grad=0.5, clip_gradient=2.0,
                 lr_scheduler={'name': 'factor', 'params': {'step': 2, 'factor': 0.5,
                                                            'base_lr': 0.01}}),
    'sgd': dict(learning_rate=0.1, momentum=0.9, wd=0.001, rescale_grad=0.5),
}
KEYS = {'big': 3000, 'small': 7}      # 'big' is split across both servers (bound 1000)


def grad(rank, step, key):
    rng = np.random.default_rng([rank, step, list(KEYS).index(key)])
    return rng.standard_normal(KEYS[key]).astype(np.float32)


def initial(key):
    return np.linspace(-1, 1, KEYS[key], dtype=np.float32)


def make_optimizer(name):
    params = dict(OPTIMIZERS[name])
    scheduler = params.pop('lr_scheduler', None)
    opt = kvps.optimizer.create(name, **params)
    if scheduler:
        opt = kvps.optimizer.Optimizer.from_spec({**opt.to_spec(), 'lr_scheduler': scheduler})
    return opt


SCRIPT = '''
sys.path.insert(0, os.environ['TEST_DIR'])
from test_dist_optimizers import KEYS, grad, initial, make_optimizer
kv = kvps.create('dist_sync')
r = kv.rank
name, first, steps = os.environ['OPT'], int(os.environ['FIRST']), int(os.environ['STEPS'])
start = json.loads(open(os.environ['START']).read()) if os.environ.get('START') else None
for key in KEYS:
    kv.init(key, np.array(start[key], np.float32) if start else initial(key))
kv.set_optimizer(make_optimizer(name))
if os.environ.get('LOAD'):
    kv.load_optimizer_states(os.environ['LOAD'])
for step in range(first, first + steps):
    for key in KEYS:
        kv.push(key, grad(r, step, key))
out = {}
for key in KEYS:
    w = np.zeros(KEYS[key], np.float32); kv.pull(key, out=w); out[key] = w.tolist()
kv.barrier()
if r == 0 and os.environ.get('SAVE'):
    kv.save_optimizer_states(os.environ['SAVE'])
report(rank=r, weights=out)
'''


def local_run(name, first, steps, start=None, load=None, save=None):
    kv = kvps.create('local')
    for key in KEYS:
        kv.init(key, np.array(start[key], np.float32) if start else initial(key))
    kv.set_optimizer(make_optimizer(name))
    if load:
        kv.load_optimizer_states(load)
    for step in range(first, first + steps):
        for key in KEYS:
            kv.push(key, [grad(0, step, key), grad(1, step, key)])
    out = {}
    for key in KEYS:
        w = np.zeros(KEYS[key], np.float32)
        kv.pull(key, out=w)
        out[key] = w.tolist()
    if save:
        kv.save_optimizer_states(save)
    return out


@pytest.mark.parametrize('name, partition', [('adam', None), ('sgd', None), ('adam', '2000')],
                         ids=['adam', 'sgd', 'adam-partitioned'])
def test_dist_sync_matches_local_and_states_survive_a_new_job(job, tmp_path, name, partition):
    """partition: 'big' (12000 bytes) is cut into 6 parts of 2000 bytes, 3 on each server."""
    env = {'OPT': name, 'TEST_DIR': str(Path(__file__).parent), 'KVPS_BIGARRAY_BOUND': '1000',
           **({'KVPS_PARTITION_BYTES': partition} if partition else {})}
    saved = tmp_path / 'states.kvps'
    first = job(SCRIPT, 2, 2, env={**env, 'FIRST': '0', 'STEPS': '4', 'SAVE': str(saved)})
    assert first.returncode == 0, first.output
    expected = local_run(name, 0, 4, save=tmp_path / 'local.kvps')
    for res in first.results().values():
        assert res['weights'] == expected            # bit for bit: same kernels, same sums
    # Whole-key state files agree, whatever the number of servers behind them.
    assert saved.read_bytes() == (tmp_path / 'local.kvps').read_bytes()

    # A new job (new servers) resumes from the weights and the saved optimizer state ...
    start = tmp_path / 'start.json'
    start.write_text(json.dumps(expected))
    second = job(SCRIPT, 2, 2, env={**env, 'FIRST': '4', 'STEPS': '3', 'START': str(start),
                                    'LOAD': str(saved)})
    assert second.returncode == 0, second.output
    # ... exactly as if training had never stopped.
    uninterrupted = local_run(name, 0, 7)
    for res in second.results().values():
        assert res['weights'] == uninterrupted


THREADS_SCRIPT = '''
import hashlib
kv = kvps.create('dist_sync')
n = int(os.environ['N'])
kv.init('w', np.linspace(-1, 1, n, dtype=np.float32))
kv.set_optimizer(kvps.optimizer.create('adam', learning_rate=0.01, wd=0.01))
for step in range(3):
    kv.push('w', np.random.default_rng([kv.rank, step]).standard_normal(n).astype(np.float32))
w = np.zeros(n, np.float32)
kv.pull('w', out=w)
report(rank=kv.rank, digest=hashlib.sha256(w.tobytes()).hexdigest())
'''


def test_servers_updating_on_threads_match_the_local_store(job):
    """KVPS_UPDATE_THREADS=3: each server's 300,000-element share of the key is updated on
    two threads (it is over SPLIT_MIN), bit for bit what one thread gives."""
    n = 600_000
    result = job(THREADS_SCRIPT, 2, 2, env={'N': str(n), 'KVPS_UPDATE_THREADS': '3'})
    assert result.returncode == 0, result.output
    kv = kvps.create('local')
    kv.init('w', np.linspace(-1, 1, n, dtype=np.float32))
    kv.set_optimizer(kvps.optimizer.create('adam', learning_rate=0.01, wd=0.01))
    for step in range(3):
        kv.push('w', [np.random.default_rng([rank, step]).standard_normal(n).astype(np.float32)
                      for rank in (0, 1)])
    w = np.zeros(n, np.float32)
    kv.pull('w', out=w)
    for res in result.results().values():
        assert res['digest'] == hashlib.sha256(w.tobytes()).hexdigest()


def test_servers_resume_from_their_checkpoint_directory(job, tmp_path):
    env = {'OPT': 'adam', 'TEST_DIR': str(Path(__file__).parent), 'KVPS_BIGARRAY_BOUND': '1000',
           'KVPS_CHECKPOINT_DIR': str(tmp_path / 'ckpt')}
    first = job(SCRIPT, 2, 2, env={**env, 'FIRST': '0', 'STEPS': '4'})
    assert first.returncode == 0, first.output
    assert sorted(p.name for p in (tmp_path / 'ckpt').iterdir()) == [
        'server-0-of-2.kvps', 'server-1-of-2.kvps']
    # New servers, same directory: init values are ignored for restored keys, the optimizer
    # state carries on, and training continues as if it never stopped.
    second = job(SCRIPT, 2, 2, env={**env, 'FIRST': '4', 'STEPS': '3'})
    assert second.returncode == 0, second.output
    expected = local_run('adam', 0, 7)
    for res in second.results().values():
        assert res['weights'] == expected


FAILED_UPDATE_SCRIPT = '''
kv = kvps.create(os.environ['STORE'])
kv.init(['f', 'i'], [np.zeros(3, np.float32), np.zeros(3, np.int32)])
kv.set_optimizer(kvps.optimizer.create('sgd', learning_rate=1.0))
seen = []
for step in range(3):
    kv.push(['f', 'i'], [np.ones(3, np.float32), np.ones(3, np.int32)])
    f, i = np.zeros(3, np.float32), np.full(3, -1, np.int32)
    try:
        kv.pull(['f', 'i'], out=[f, i])
        seen.append(['no error'])
    except kvps.errors.DTypeError as exc:
        seen.append([str(exc)])
    kv.barrier()
    kv.pull(['f', 'i'], out=[f, i])
    seen[-1] += [f.tolist(), i.tolist()]
    kv.barrier()   # async: no worker's next push may land before everyone has pulled
report(rank=kv.rank, seen=seen)
'''


@pytest.mark.parametrize('store', ['dist_sync', 'dist_async'])
def test_a_key_the_optimizer_cannot_update_fails_its_pushes_not_the_job(job, store):
    # An optimizer cannot update an int key. Each push of it fails, once, with the reason,
    # by the pull after it (not after KVPS_TIMEOUT); the float key sent in the same messages
    # is updated, and later rounds of both keys go on.
    result = job(FAILED_UPDATE_SCRIPT, 2, 1, env={'STORE': store})
    assert result.returncode == 0, result.output
    for rank, res in result.results().items():
        for step, (error, f, i) in enumerate(res['seen']):
            assert 'int32' in error and 'not supported' in error, (rank, error)
            assert f == [-2.0 * (step + 1)] * 3 and i == [0, 0, 0]



LAMB_SCRIPT = '''
sys.path.insert(0, os.environ['TEST_DIR'])
from test_dist_optimizers import KEYS, initial, lamb_keys, lamb_model, lamb_train
kv = kvps.create('dist_sync')
r = kv.rank
if os.environ['ORDER'] == 'after':    # keys placed first: 'big' is split over both servers
    kv.init(list(KEYS), [initial(key) for key in KEYS])
    try:
        kv.set_optimizer(kvps.optimizer.create('lamb'))
    except kvps.errors.ConfigError as exc:
        report(rank=r, refused=str(exc))
    sys.exit(0)
got = lamb_keys(kv, [r])              # sets the optimizer first: later keys stay whole
want = lamb_keys(kvps.create('local'), [0, 1])
# The Trainer sets the optimizer after its init: it asks for whole keys itself.
model, single = lamb_model(), lamb_model()
lamb_train(model, kvps.Trainer(model, 'lamb', {'learning_rate': 0.1},
                               kvstore=kvps.create('dist_sync')), [r], 2)
lamb_train(single, kvps.Trainer(single, 'lamb', {'learning_rate': 0.1}), [0, 1], 2)
report(rank=r, keys_equal=all((got[k] == want[k]).all() for k in KEYS),
       model_diff=max(float((a - b).abs().max()) for a, b in zip(model.parameters(),
                                                                 single.parameters())))
'''


def lamb_keys(kv, ranks):
    """Three LAMB steps over KEYS, pushing the gradients of ``ranks``; the weights."""
    kv.set_optimizer(kvps.optimizer.create('lamb', learning_rate=0.1, wd=0.01))
    kv.init(list(KEYS), [initial(key) for key in KEYS])
    for step in range(3):
        kv.push(list(KEYS), [[grad(r, step, key) for r in ranks] for key in KEYS])
    out = {key: np.zeros(KEYS[key], np.float32) for key in KEYS}
    kv.pull(list(KEYS), out=[out[key] for key in KEYS])
    return out


def lamb_model():
    torch = pytest.importorskip('torch')
    torch.manual_seed(0)
    return torch.nn.Linear(60, 50)         # 3000 weights: above the bound of 1000


def lamb_train(model, trainer, ranks, workers, steps=3):
    """Steps on the rows of a batch of 8 that ``ranks`` (of ``workers``) take."""
    torch = pytest.importorskip('torch')
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(8, 60, generator=g), torch.randn(8, 50, generator=g)
        rows = [i for i in range(8) if i % workers in ranks]
        trainer.zero_grad()
        ((model(x[rows]) - y[rows]) ** 2).sum().backward()
        trainer.step(8)


@pytest.mark.parametrize('order', ['before', 'after'])
def test_lamb_sees_whole_weights_never_a_servers_slice(job, order):
    # LAMB's trust ratio takes norms over the whole weight; a slice per server would give
    # another update for every split key, depending on the number of servers.
    if order == 'before':
        pytest.importorskip('torch')   # its workers train through the Trainer too
    env = {'ORDER': order, 'TEST_DIR': str(Path(__file__).parent), 'KVPS_BIGARRAY_BOUND': '1000'}
    result = job(LAMB_SCRIPT, 2, 2, env=env)
    assert result.returncode == 0, result.output
    found = result.results()
    assert sorted(found) == [0, 1], result.output
    for res in found.values():
        if order == 'after':
            assert "'big' are split across servers" in res['refused']
        else:
            assert res['keys_equal'] and res['model_diff'] < 1e-6, res


SCHEDULE_SCRIPT = '''
kv = kvps.create('dist_sync')
kv.init('often', np.zeros(10, np.float32))
kv.init('once', np.zeros(3000, np.float32))       # split across both servers
kv.set_optimizer(kvps.optimizer.create('sgd', lr_scheduler=kvps.optimizer.FactorScheduler(
    step=1, factor=0.5, base_lr=1.0)))
for step in range(4):
    kv.push('often', np.ones(10, np.float32))
    if step == 3:
        kv.push('once', np.ones(3000, np.float32))
w = np.zeros(3000, np.float32)
kv.pull('once', out=w)
report(rank=kv.rank, once=sorted(set(w.tolist())))
'''


def test_lr_schedule_counts_every_key_whatever_server_holds_it(job):
    # MXNet's num_update is the max of every key's update count. 'once' is first pushed at
    # step 4, after 'often' three times; the server without 'often' must not schedule it as
    # a first update (one weight, two learning rates, a result that depends on placement).
    result = job(SCHEDULE_SCRIPT, 2, 2, env={'KVPS_BIGARRAY_BOUND': '1000'})
    assert result.returncode == 0, result.output
    kv = kvps.create('local')
    kv.init('often', np.zeros(10, np.float32))
    kv.init('once', np.zeros(3000, np.float32))
    kv.set_optimizer(kvps.optimizer.create('sgd', lr_scheduler=kvps.optimizer.FactorScheduler(
        step=1, factor=0.5, base_lr=1.0)))
    for step in range(4):
        kv.push('often', [np.ones(10, np.float32)] * 2)
        if step == 3:
            kv.push('once', [np.ones(3000, np.float32)] * 2)
    expected = np.zeros(3000, np.float32)
    kv.pull('once', out=expected)
    for res in result.results().values():
        assert res['once'] == sorted(set(expected.tolist())) == [-0.25]


def test_lr_schedule_counts_from_the_optimizer_or_the_states_a_job_sets(job, tmp_path):
    """The workers' sync push step counts from the job's start; a server counts a new
    optimizer's schedule from when it was set (not from the rounds before: pushes without an
    optimizer, or another kind's), and loaded states' from their own count, as a local store
    does. A round's gradients sum to 1, so each weight moves by that update's lr."""
    script = f'''
    def sched(name, **params):
        return kvps.optimizer.create(name, lr_scheduler={{'name': 'factor', 'params': {{
            'step': 2, 'factor': 0.5, 'base_lr': 0.8}}}}, **params)
    kv = kvps.create('dist_sync')
    kv.init(0, np.zeros(4))
    out, before = np.zeros(4), np.zeros(4)

    def moves(rounds):
        got = []
        for _ in range(rounds):
            kv.push(0, np.full(4, 0.5))
            kv.pull(0, out=out)
            got.append(round(float(before[0] - out[0]), 6))
            before[:] = out
        return got
    moves(3)                                  # no optimizer: the value is the round's sum
    kv.set_optimizer(sched('sgd'))
    first = moves(3)
    kv.set_optimizer(sched('nag', momentum=0.0))   # another kind: its schedule starts afresh
    second = moves(2)
    path = os.path.join({str(tmp_path)!r}, f'states{{kv.rank}}')
    kv.save_optimizer_states(path)            # at its count of 2
    moves(4)
    kv.load_optimizer_states(path)            # back to 2
    kv.pull(0, out=before)
    report(first=first, second=second, loaded=moves(2))
    '''
    result = job(script, 2, 1)
    assert result.returncode == 0, result.output
    for res in result.results().values():
        assert res == {'first': [0.8, 0.8, 0.4], 'second': [0.8, 0.8], 'loaded': [0.4, 0.4]}, res


def test_per_key_options_of_very_many_keys_reach_the_servers(job):
    # 20,000 named multipliers pack to ~1.3 MB, more than a message header may carry: the
    # spec travels as a frame of its own.
    script = '''
    kv = kvps.create('dist_sync')
    kv.init(['w', 'b'], [np.ones(4, np.float32), np.ones(4, np.float32)])
    opt = kvps.optimizer.create('sgd', learning_rate=1.0, wd=0.5)
    names = [f'module.layer{i}.a_parameter_name_as_long_as_real_ones.weight' for i in range(20000)]
    opt.set_wd_mult({**{name: 0.0 for name in names}, 'b': 0.0})
    opt.set_lr_mult({'w': 0.25})
    kv.set_optimizer(opt)
    kv.push(['w', 'b'], [np.ones(4, np.float32), np.ones(4, np.float32)])
    out = [np.zeros(4, np.float32), np.zeros(4, np.float32)]
    kv.pull(['w', 'b'], out=out)
    report(w=out[0].tolist(), b=out[1].tolist())
    '''
    result = job(script, 2, 2)
    assert result.returncode == 0, result.output
    # w: lr 0.25, wd 0.5: 1 - 0.25 * (2 + 0.5 * 1); b: lr 1, no wd: 1 - 2
    assert result.results() == {r: {'w': [0.375] * 4, 'b': [-1.0] * 4} for r in (0, 1)}


def test_a_state_bigger_than_a_message_is_saved_and_loaded_in_pieces(job, tmp_path):
    # Messages of at most 1 MB, 2.4 MB of adam state on each server (3 keys of 400 KB):
    # every state goes in pieces, both ways. Loading what was saved, after a step that
    # changed the state, then saving again gives the same file.
    script = f'''
    kv = kvps.create('dist_sync')
    keys = list('abcdef')
    kv.init(keys, [np.zeros(100000, np.float32)] * len(keys))
    kv.set_optimizer(kvps.optimizer.create('adam', learning_rate=0.1))
    def step(value):
        kv.push(keys, [np.full(100000, value, np.float32)] * len(keys))
        kv.pull(keys, out=[np.zeros(100000, np.float32) for _ in keys])
    def path(name):   # (one file per worker: both save)
        return os.path.join({str(tmp_path)!r}, f'{{name}}{{kv.rank}}.states')
    step(1.0)
    kv.save_optimizer_states(path('first'))
    step(-2.0)
    kv.load_optimizer_states(path('first'))
    kv.save_optimizer_states(path('again'))
    first, again = (open(path(name), 'rb').read() for name in ('first', 'again'))
    report(size=len(first), same=first == again)
    '''
    result = job(script, 2, 2, env={'KVPS_MAX_MESSAGE_BYTES': '1000000'})
    assert result.returncode == 0, result.output
    for res in result.results().values():
        assert res['same'] and res['size'] > 4_800_000, res
