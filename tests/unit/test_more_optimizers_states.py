"""The optimizers MXNet has beyond kvps's first ten, as a server keeps them: multi-precision
(float16 and bfloat16 weights with a float32 master), states saved and loaded (Updater dicts and
a store's state files), the states' dtypes, whole keys, and bad hyper-parameters refused."""

import msgpack
import numpy as np
import pytest
from optimizer_configs import BY_ID, problem
from reference_rules import make

import kvps
from kvps.errors import ConfigError
from kvps.optimizer import create
from kvps.optimizer.kernels import numpy_kernels as K
from kvps.optimizer.optimizers import registered_class
from kvps.optimizer.updater import Updater

# one run of each optimizer, with every state it can keep
ONE_EACH = ['adadelta', 'adamax', 'nadam-decay', 'ftml', 'lars', 'lbsgd', 'lbsgd-lars', 'sgld',
            'dcasgd-momentum', 'ccsgd', 'adabelief', 'lans']
NEW = ['adadelta', 'adamax', 'nadam', 'ftml', 'lars', 'lbsgd', 'sgld', 'dcasgd', 'ccsgd',
       'adabelief', 'lans']


def low(array, dtype):
    """float32 values rounded to float16, or to bfloat16 bits (uint16)."""
    array = np.asarray(array, np.float32)
    return K.f32_to_bf16(array) if dtype == 'bfloat16' else array.astype(np.float16)


def run(updater, key, weight, grads):
    for grad in grads:
        updater.update(key, weight, grad.copy())
    return weight


def state_of(updater, name):
    """A state array of the updater's one key, from what get_states gives."""
    (_, _, state), = updater.get_states()['states']
    blob = state[name]
    dtype = np.uint16 if blob['dtype'] == 'bfloat16' else np.dtype(blob['dtype'])
    return np.frombuffer(blob['data'], dtype)


@pytest.mark.parametrize('dtype', ['float16', 'bfloat16'])
@pytest.mark.parametrize('config_id', ONE_EACH)
def test_multi_precision_master_is_the_float32_update_to_the_bit(config_id, dtype):
    """With multi_precision a float16/bfloat16 weight is updated through a float32 master: it
    follows the float32 rule exactly (from the same rounded start and gradients), and the
    weight is its rounding."""
    key = BY_ID[config_id][4]
    w0, grads = problem(config_id, 500)
    weight, grads = low(w0, dtype), [low(g, dtype) for g in grads]
    mixed = Updater(make(config_id, multi_precision=True))
    run(mixed, key, weight, grads)
    wide = K.widen(low(w0, dtype))
    run(Updater(make(config_id)), key, wide, [K.widen(g) for g in grads])
    np.testing.assert_array_equal(state_of(mixed, 'weight32'), wide)
    np.testing.assert_array_equal(weight, low(wide, dtype))


@pytest.mark.parametrize('config_id', ONE_EACH)
def test_low_precision_weights_without_a_master_keep_states_as_mxnet(config_id):
    """float16 states for a float16 weight, except where MXNet makes them float32 (AdaDelta's
    zeros are float32; LANS asks for float32); no master."""
    updater = Updater(make(config_id))
    w0, grads = problem(config_id, 50)
    run(updater, BY_ID[config_id][4], w0.astype(np.float16), [g.astype(np.float16)
                                                             for g in grads[:3]])
    (_, _, state), = updater.get_states()['states']
    want = 'float32' if BY_ID[config_id][1] in ('adadelta', 'lans') else 'float16'
    assert 'weight32' not in state
    assert {blob['dtype'] for blob in state.values()} <= {want}
    assert set(state) == set(updater.optimizer.state_names())


@pytest.mark.parametrize('dtype,mp', [(np.float32, False), (np.float16, True)])
@pytest.mark.parametrize('config_id', ONE_EACH)
def test_saved_states_carry_a_run_on_to_the_bit(config_id, dtype, mp):
    """13 updates, the state dict through msgpack into a fresh Updater (the optimizer with it),
    17 more: the weights of 30 updates in a row."""
    key, (w0, grads) = BY_ID[config_id][4], problem(config_id, 300)
    grads = [g.astype(dtype) for g in grads]
    whole = run(Updater(make(config_id, multi_precision=mp)), key, w0.astype(dtype), grads)
    first = Updater(make(config_id, multi_precision=mp))
    weight = run(first, key, w0.astype(dtype), grads[:13])
    saved = msgpack.packb(first.get_states(dump_optimizer=True))
    second = Updater(create('sgd'))   # the file carries the optimizer
    second.set_states(msgpack.unpackb(saved, strict_map_key=False))
    assert second.optimizer == first.optimizer
    np.testing.assert_array_equal(run(second, key, weight, grads[13:]), whole)


@pytest.mark.parametrize('config_id', ONE_EACH)
def test_a_stores_state_file_loads_into_a_new_store(config_id, tmp_path):
    """kv.save_optimizer_states / load_optimizer_states (whole keys in a file, states.py)."""
    w0, grads = problem(config_id, 40)

    def store(start, opt):
        kv = kvps.create('local')
        kv.init('w', start)
        kv.set_optimizer(opt)
        return kv

    def push(kv, steps):
        for g in steps:
            kv.push('w', g)
        out = np.zeros_like(w0)
        kv.pull('w', out=out)
        return out
    whole = push(store(w0, make(config_id)), grads)
    kv = store(w0, make(config_id))
    half = push(kv, grads[:11])
    kv.save_optimizer_states(str(tmp_path / 'states'))
    again = store(half, make(config_id))
    again.load_optimizer_states(str(tmp_path / 'states'))
    np.testing.assert_array_equal(push(again, grads[11:]), whole)


def test_dcasgds_previous_weight_starts_as_the_weight():
    """MXNet makes it a copy of the weight (of the float32 master under multi_precision):
    the first update has nothing to compensate."""
    for mp, dtype in ((False, np.float32), (True, np.float16)):
        updater = Updater(create('dcasgd', lamda=10.0, multi_precision=mp, learning_rate=0.5))
        weight = np.array([1.0, -2.0, 3.0], dtype)
        updater.update('k', weight, np.ones(3, dtype))
        np.testing.assert_array_equal(state_of(updater, 'prev'), [1.0, -2.0, 3.0])
        np.testing.assert_array_equal(weight, np.array([0.5, -2.5, 2.5], dtype))


def test_norms_and_noise_keep_keys_whole_and_pushed_rows_apply_densely():
    whole = {'lars', 'lbsgd', 'sgld', 'lans'}
    for name in NEW:
        opt = create(name)
        assert registered_class(opt.to_spec()).whole_tensor is (name in whole), name
        assert not Updater(opt).updates_rows or name == 'ccsgd', name   # (SGD's lazy_update)
    assert not Updater(create('lars', lazy_update=True)).updates_rows


def test_lars_leaves_gamma_beta_and_bias_keys_at_the_plain_rate():
    """As MXNet does by parameter name: a str key so named updates as SGD; int keys (Gluon's
    indices) and other names are scaled."""
    w0, grads = problem('lars', 64)

    def final(name, key, **params):
        return run(Updater(create(name, momentum=0.9, learning_rate=0.1, **params)), key,
                   w0.copy(), grads[:5])
    sgd = final('sgd', 'x')
    for key in ('fc_bias', 'bn_gamma', 'bn_beta'):
        np.testing.assert_array_equal(final('lars', key), sgd)
    for key in ('fc_weight', 0, 'gamma_table'):
        assert not np.array_equal(final('lars', key), sgd)


def test_lbsgd_changes_the_weight_once_per_batch_scale_updates():
    updater = Updater(create('lbsgd', batch_scale=3, momentum=0.9, learning_rate=0.1))
    weight, seen = np.ones(5, np.float32), []
    for step in range(7):
        updater.update('k', weight, np.full(5, step + 1.0, np.float32))
        seen.append(weight.copy())
    changed = [not np.array_equal(a, b) for a, b in zip([np.ones(5)] + seen, seen)]
    assert changed == [False, False, True, False, False, True, False]
    # the first change: SGD at lr*mult on the batch's mean gradient (1+2+3)/3 = 2,
    # mult = 1 + (3-1) * 3/160 (linear warm-up over 5 epochs of 32 updates)
    np.testing.assert_allclose(seen[2], 1 - 0.1 * (1 + 2 * 3 / 160) * 2, rtol=1e-6)


@pytest.mark.parametrize('name,params,match', [
    ('adadelta', {'rho': 1.5}, 'rho'), ('adadelta', {'epsilon': 'x'}, 'epsilon'),
    ('adamax', {'beta1': -0.1}, 'beta1'), ('nadam', {'beta2': 2.0}, 'beta2'),
    ('nadam', {'schedule_decay': None}, 'schedule_decay'), ('ftml', {'beta1': 1.5}, 'beta1'),
    ('lars', {'momentum': 1.5}, 'momentum'), ('lars', {'eta': 'big'}, 'eta'),
    ('lars', {'momentum_correction': 1}, 'momentum_correction'),
    ('lbsgd', {'warmup_strategy': 'cubic'}, "warmup_strategy.*linear, power2, sqrt, lars"),
    ('lbsgd', {'batch_scale': 0}, 'batch_scale'), ('lbsgd', {'batch_scale': 2.0}, 'batch_scale'),
    ('lbsgd', {'updates_per_epoch': 0}, 'updates_per_epoch'),
    ('lbsgd', {'warmup_epochs': -1}, 'warmup_epochs'), ('lbsgd', {'begin_epoch': -2}, 'begin'),
    ('sgld', {'seed': 1.5}, 'seed'), ('sgld', {'momentum': 0.9}, "unknown parameter 'momentum'"),
    ('dcasgd', {'momentum': -0.5}, 'momentum'), ('dcasgd', {'lamda': 'x'}, 'lamda'),
    ('adabelief', {'correct_bias': 'yes'}, 'correct_bias'), ('adabelief', {'beta1': 1.1}, 'beta1'),
    ('lans', {'lower_bound': 'x'}, 'lower_bound'), ('lans', {'beta2': -1.0}, 'beta2'),
])
def test_bad_hyper_parameters_are_config_errors_naming_them(name, params, match):
    with pytest.raises(ConfigError, match=match):
        create(name, **params)
