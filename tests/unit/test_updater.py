"""The server Updater: lazy state, lr by update count, multi-precision, checkpoints."""

import subprocess
import sys

import msgpack
import numpy as np
import pytest

from kvps.optimizer.kernels import numpy_kernels as K
from kvps.errors import ConfigError, DTypeError, ShapeError
from kvps.optimizer import FactorScheduler, create
from kvps.optimizer.updater import Updater

RNG = np.random.default_rng(7)


def grads(n, steps, dtype=np.float32):
    return [RNG.standard_normal(n).astype(dtype) for _ in range(steps)]


def test_accepts_optimizer_or_spec_and_rejects_others():
    opt = create('adam', learning_rate=0.1)
    assert Updater(opt).optimizer is opt
    assert Updater(opt.to_spec()).optimizer == opt
    with pytest.raises(ConfigError, match='Optimizer or its spec'):
        Updater('adam')
    with pytest.raises(ConfigError, match='unknown optimizer'):
        Updater({'name': 'pickle', 'params': {}})


def test_update_is_in_place_and_matches_the_kernel():
    u = Updater(create('adam', learning_rate=0.01, wd=0.1, rescale_grad=0.5))
    w = np.ones(100, np.float32)
    ref, m, v = w.copy(), np.zeros_like(w), np.zeros_like(w)
    for t, g in enumerate(grads(100, 4), start=1):
        u.update(7, w, g.copy())
        K.adam_update(ref, g.copy(), m, v, 0.01, 0.1, 0.5, None, t=t)
    np.testing.assert_array_equal(w, ref)
    assert u.num_update == 4


def _sgd_delta(u, key, part=0):
    """The lr an SGD step (no momentum, no wd) applied to `key`, read back from the weight."""
    w = np.zeros(3, np.float64)
    u.update(key, w, np.ones(3), part)
    return -w[0]


def test_scheduler_runs_on_max_update_count_and_counts_tick_before_lr():
    sched = FactorScheduler(step=2, factor=0.5, base_lr=1.0)
    u = Updater(create('sgd', lr_scheduler=sched))
    assert [_sgd_delta(u, 'a') for _ in range(3)] == [1.0, 1.0, 0.5]  # counts 1, 2, 3
    # 'b' is at count 1 but num_update is the max over keys (3): the decayed lr applies
    assert _sgd_delta(u, 'b') == 0.5
    assert _sgd_delta(u, 'a', part=1) == 0.5  # parts count separately, same global max
    assert u.optimizer.learning_rate == 0.5 and u.num_update == 3
    for _ in range(3):
        _sgd_delta(u, 'a')
    assert _sgd_delta(u, 'b') == 0.25  # 'a' at 6 -> (6-1)//2 = 2 decays


def test_sync_steps_count_from_when_the_updater_took_over():
    """The workers' push step counts from the job's start: an updater set at step 6 (or
    states loaded then) counts the lr schedule from its own num_update, and keeps where it
    counts from in its states, for a restarted server."""
    sched = FactorScheduler(step=2, factor=0.5, base_lr=1.0)

    def delta(u, step):
        w = np.zeros(3, np.float64)
        u.update_many([('a', 0, w, np.ones(3))], step=step)
        return -w[0]
    u = Updater(create('sgd', lr_scheduler=sched))
    u.start_at(6)
    assert [delta(u, step) for step in (7, 8, 9)] == [1.0, 1.0, 0.5]   # counts 1, 2, 3
    saved = u.get_states()
    assert saved['step_offset'] == -6
    restarted = Updater(create('sgd', lr_scheduler=sched))
    restarted.set_states(saved)       # (a checkpoint: where it counts from comes with it)
    assert [delta(restarted, step) for step in (10, 11)] == [0.5, 0.25]
    loaded = Updater(create('sgd', lr_scheduler=sched))
    loaded.set_states(saved)
    loaded.start_at(20)               # (loaded in a job at step 20: counts on from 3)
    assert [delta(loaded, step) for step in (21, 22)] == [0.5, 0.25]


def test_bias_correction_uses_the_keys_own_count():
    u = Updater(create('adam', learning_rate=0.1))
    for g in grads(10, 5):
        u.update('busy', np.zeros(10, np.float32), g)
    w, g = np.zeros(10, np.float32), grads(10, 1)[0]
    ref = w.copy()
    u.update('fresh', w, g.copy())
    K.adam_update(ref, g, np.zeros_like(ref), np.zeros_like(ref), 0.1, 0.0, 1.0, None, t=1)
    np.testing.assert_array_equal(w, ref)


def test_lr_mult_and_wd_mult_by_key():
    opt = create('sgd', learning_rate=0.1, wd=0.5)
    opt.set_lr_mult({1: 2.0, 'emb': 0.0})
    opt.set_wd_mult({1: 0.0})
    u = Updater(opt)
    w1, w2, we = (np.ones(4) for _ in range(3))
    u.update(1, w1, np.ones(4))
    u.update(2, w2, np.ones(4))
    u.update('emb', we, np.ones(4))
    np.testing.assert_allclose(w1, 1 - 0.2 * 1.0)          # lr x2, no wd
    np.testing.assert_allclose(w2, 1 - 0.1 * (1 + 0.5))    # defaults
    np.testing.assert_array_equal(we, 1.0)                 # frozen


def test_keys_of_one_update_many_keep_their_own_lr_wd_and_count():
    """Keys that share a count, lr and wd share one set of kernel arguments; any of the three
    differing gives a key its own (adam's step t follows each key's count)."""
    def trained(together):
        opt = create('adam', learning_rate=0.1, wd=0.5)
        opt.set_lr_mult({1: 2.0, 3: 0.0})
        opt.set_wd_mult({2: 0.0})
        u = Updater(opt)
        ws = [np.ones(6, np.float32) for _ in range(5)]
        u.update(4, ws[4], np.full(6, 0.5, np.float32))   # key 4 is one update ahead
        for step in range(2):
            gs = [np.full(6, 0.1 * (k + 1) + step, np.float32) for k in range(5)]
            if together:
                u.update_many([(k, 0, w, g) for k, (w, g) in enumerate(zip(ws, gs))])
            else:
                for k, (w, g) in enumerate(zip(ws, gs)):
                    u.update(k, w, g)
        return ws
    for got, want in zip(trained(True), trained(False)):
        np.testing.assert_array_equal(got, want)
    assert (trained(True)[3] == 1.0).all()   # lr_mult 0: frozen, wd and all


def test_update_many_equals_sequential_updates():
    a, b = Updater(create('rmsprop', centered=True)), Updater(create('rmsprop', centered=True))
    ws_a = [np.ones(n, np.float32) for n in (1, 5, 50)]
    ws_b = [w.copy() for w in ws_a]
    for _ in range(3):
        gs = [grads(w.size, 1)[0] for w in ws_a]
        a.update_many([(k, 0, w, g.copy()) for k, (w, g) in enumerate(zip(ws_a, gs))])
        for k, (w, g) in enumerate(zip(ws_b, gs)):
            b.update(k, w, g.copy())
    for wa, wb in zip(ws_a, ws_b):
        np.testing.assert_array_equal(wa, wb)


def test_small_keys_states_lie_end_to_end_also_after_a_restore():
    """So that a packed pass updates them in place (numpy_packing): states are made key
    after key in one run per name, and a restore lays them out so again."""
    u = Updater(create('adam'))
    ws = [np.ones(n, np.float32) for n in (3, 5, 8)]
    u.update_many([(k, 0, w, np.ones_like(w)) for k, w in enumerate(ws)])

    def end_to_end(updater):
        for name in ('mean', 'var'):
            arrays = [updater._states[(k, 0)][name] for k in range(len(ws))]
            starts = [a.__array_interface__['data'][0] for a in arrays]
            assert [b - a for a, b in zip(starts, starts[1:])] == [a.nbytes for a in arrays[:-1]]
    end_to_end(u)
    v = Updater(create('adam'))
    v.set_states(msgpack.unpackb(msgpack.packb(u.get_states())))
    end_to_end(v)
    assert msgpack.packb(v.get_states()) == msgpack.packb(u.get_states())


@pytest.mark.parametrize('name', ['sgd', 'adam', 'lamb', 'adagrad'])
@pytest.mark.parametrize('wdtype', ['float16', 'bfloat16'])
def test_multi_precision_keeps_fp32_master_and_weight_is_its_cast(name, wdtype):
    params = dict(learning_rate=0.05, wd=0.01, momentum=0.9) if name == 'sgd' else {}
    u = Updater(create(name, multi_precision=True, **params))
    ref = Updater(create(name, **params))
    w32 = RNG.standard_normal(3000).astype(np.float32)
    low = w32.astype(np.float16) if wdtype == 'float16' else K.f32_to_bf16(w32)
    master_ref = low.astype(np.float32) if wdtype == 'float16' else K.bf16_to_f32(low)
    for g in grads(3000, 5, np.float16):
        u.update('k', low, g.copy())
        ref.update('k', master_ref, g.astype(np.float32))
        master = u.get_states()['states'][0][2]['weight32']
        master = np.frombuffer(master['data'], np.float32)
        cast = master.astype(np.float16) if wdtype == 'float16' else K.f32_to_bf16(master)
        np.testing.assert_array_equal(low, cast)   # a pull sees the cast of the master
    np.testing.assert_array_equal(master, master_ref)


def test_low_precision_without_multi_precision_keeps_state_in_weight_dtype():
    u = Updater(create('adam'))
    w = np.ones(10, np.float16)
    u.update(0, w, np.ones(10, np.float16))
    st = u.get_states()['states'][0][2]
    assert set(st) == {'mean', 'var'} and st['mean']['dtype'] == 'float16'
    assert (w < 1).all()


@pytest.mark.parametrize('name,params,dtype', [
    ('adam', {'lr_scheduler': FactorScheduler(step=3, factor=0.7, base_lr=0.01)}, 'float32'),
    ('sgd', {'momentum': 0.9, 'multi_precision': True}, 'float16'),
    ('lamb', {'multi_precision': True}, 'bfloat16'),
    ('rmsprop', {'centered': True}, 'float64'),
    ('ftrl', {}, 'float32'),
    ('signum', {}, 'bfloat16'),
])
def test_states_round_trip_through_msgpack_and_training_continues_identically(name, params,
                                                                             dtype):
    def fresh_weights():
        ws = {k: RNG.standard_normal(n).astype(np.float32) for k, n in ((0, 10), ('s', 40))}
        if dtype == 'bfloat16':
            return {k: K.f32_to_bf16(w) for k, w in ws.items()}
        return {k: w.astype(dtype) for k, w in ws.items()}

    u = Updater(create(name, **params))
    ws = fresh_weights()
    for _ in range(4):
        for k, w in ws.items():
            u.update(k, w, grads(w.size, 1)[0])
    blob = msgpack.packb(u.get_states(dump_optimizer=True))
    saved = {k: w.copy() for k, w in ws.items()}
    later = [{k: grads(w.size, 1)[0] for k, w in ws.items()} for _ in range(4)]
    for step in later:
        for k, w in ws.items():
            u.update(k, w, step[k].copy())
    v = Updater(create('test'))                    # the optimizer comes from the checkpoint
    v.set_states(msgpack.unpackb(blob))            # default msgpack options suffice
    assert v.optimizer == u.optimizer and v.num_update == 4
    for step in later:
        for k, w in saved.items():
            v.update(k, w, step[k].copy())
    for k in ws:
        np.testing.assert_array_equal(saved[k], ws[k])
    assert msgpack.unpackb(msgpack.packb(v.get_states())) == msgpack.unpackb(
        msgpack.packb(u.get_states()))


def test_errors_are_shape_and_dtype_errors():
    u = Updater(create('sgd', momentum=0.9))
    with pytest.raises(ShapeError, match=r"key 3 part 0: grad shape \(4,\) does not match"):
        u.update(3, np.zeros(5, np.float32), np.zeros(4, np.float32))
    with pytest.raises(DTypeError, match='int64 is not supported'):
        u.update(3, np.zeros(5, np.int64), np.zeros(5, np.float32))
    with pytest.raises(DTypeError, match='grad dtype complex64'):
        u.update(3, np.zeros(5, np.float32), np.zeros(5, np.complex64))
    with pytest.raises(ShapeError, match='C-contiguous'):
        u.update(3, np.zeros((5, 4), np.float32).T, np.zeros((4, 5), np.float32))
    assert u.num_update == 0  # failed updates leave no trace
    u.update(3, np.zeros(5, np.float32), np.zeros(5, np.float32))
    with pytest.raises(ShapeError, match="state 'mom'"):
        u.update(3, np.zeros(6, np.float32), np.zeros(6, np.float32))
    with pytest.raises(DTypeError, match="'mom' is float32, but the key is float64"):
        u.update(3, np.zeros(5, np.float64), np.zeros(5, np.float64))
    g = np.ones((4, 6), np.float32)[:, ::2]  # a strided grad is fine
    u.update(9, np.zeros((4, 3), np.float32), g)


@pytest.mark.parametrize('bad', [
    {}, {'format': 'x'},
    {'format': 'kvps.updater.states/1', 'num_update': 1, 'counts': [[1, 0]], 'states': []},
    {'format': 'kvps.updater.states/1', 'num_update': 1, 'counts': [],
     'states': [[1, 0, {'mom': {'dtype': 'object', 'shape': [1], 'data': b'x'}}]]},
    {'format': 'kvps.updater.states/1', 'num_update': 1, 'counts': [],
     'states': [[1, 0, {'mom': {'dtype': 'float32', 'shape': [2], 'data': b'abc'}}]]},
])
def test_malformed_states_are_config_errors(bad):
    with pytest.raises(ConfigError):
        Updater(create('sgd')).set_states(bad)


def test_importing_and_updating_never_imports_cupy():
    code = ('import sys, numpy as np\n'
            'from kvps.optimizer.updater import Updater\n'
            'from kvps.optimizer import create\n'
            'Updater(create("adam")).update(0, np.ones(3), np.ones(3))\n'
            'assert "cupy" not in sys.modules and "torch" not in sys.modules\n')
    subprocess.run([sys.executable, '-c', code], check=True, timeout=60)


def test_an_optimizer_that_overrides_get_lr_and_get_wd_is_asked_for_every_key():
    from kvps.optimizer import SGD

    class Halving(SGD):   # not registered: the Updater takes the instance as it is
        def get_lr(self, key, num_update):
            return 0.5 if key == 'slow' else 1.0

        def get_wd(self, key):
            return 0.0

    u = Updater(Halving(learning_rate=1.0, wd=0.5))
    weights = {k: np.ones(4, np.float32) for k in ('slow', 'fast')}
    u.update_many([(k, 0, w, np.ones(4, np.float32)) for k, w in weights.items()])
    assert weights['slow'].tolist() == [0.5] * 4 and weights['fast'].tolist() == [0.0] * 4
