"""GroupAdaGrad (MXNet 1.9 contrib): one history per row of a 2-D key. MXNet 1.9.1's own weights
(its fused row_sparse kernel to the bit, its dense Python rule to rounding), a float64 reference
of the documented rule, pushed rows touching only their rows, its refusals, float32 history for
low-precision weights, and its state saved and loaded through a store."""

import re

import numpy as np
import pytest
from optimizer_configs import GROUP_CONFIGS, GROUP_SHAPE, group_problem, group_rows

import kvps
from kvps.errors import ConfigError, ShapeError
from kvps.optimizer import FactorScheduler, GroupAdaGrad, create
from kvps.optimizer.kernels import numpy_kernels as K
from kvps.optimizer.updater import Updater

# MXNet 1.9.1's weights after optimizer_configs' GROUP_CONFIGS runs, printed by mxnet_anchors.py
MXNET_GROUP = {
    'groupadagrad': [
        -2.01019478, 0.346068591, 0.888831675, 1.51226819, 0.63486445, -0.303258032,
        0.854588151, -1.32064211, -1.16548026, 0.433188975, -1.3211273, -2.34398866,
        0.0287349634, 0.397168428, 0.863271356, -1.23469913, 0.399296582, -0.128226712,
        0.0284407586, 0.0728831515, 1.00049555, -0.219102815, -2.15402937, -1.17163658,
        0.765927553, -0.524330974, -1.41483712, -0.243841633, 0.720505416, -0.160404816],
    'groupadagrad-rows': [
        0.00577388797, -0.254048795, 0.94678992, 0.0799701884, -0.768126726, -0.0130833928,
        -2.07279634, -0.258323133, -2.57398391, -0.527551949, -1.08041739, -1.80270743,
        -0.85606128, -0.512158751, 0.405136764, -1.00768018, 0.0865828395, -1.24597883,
        -0.720899522, -0.576218843, -0.409969449, 0.304395199, -2.04843903, -1.27655625,
        0.602547228, -0.115449093, -0.0595066361, 0.333764464, -1.19896233, -0.0295892004],
    'groupadagrad-some': [
        0.338053703, 0.154303551, -0.498451829, 0.678232849, -0.529664338, 0.00873569027,
        -0.159120917, 1.02218199, -0.552039802, -0.397259146, 0.0176567938, 1.12792218,
        1.40150237, -0.593477786, 0.624844909, -0.832290828, -1.38389933, 0.6494627,
        1.17299771, -1.81652606, 1.25526798, -0.706907868, 0.312728941, -0.328568578,
        -0.671455204, 0.822053194, 0.966171324, 0.966220856, 0.985639989, -1.05649376],
    'groupadagrad-mp': [
        -1.54296875, -1.19726562, 0.440917969, -0.546386719, -1.03320312, -1.30761719,
        0.392578125, -1.89550781, -0.3515625, -0.213134766, -1.64648438, 0.87890625,
        -0.670898438, 2.76171875, -0.151489258, 1, 0.282470703, 0.698242188, 2.46875,
        -0.0846557617, -1.18359375, -0.296386719, 1.42578125, -0.803710938, 0.0897827148,
        -0.83984375, 2.98632812, 0.997070312, 0.397216797, 0.0853881836],
}
ROWS, WIDTH = GROUP_SHAPE


def optimizer(params, sched):
    more = {'lr_scheduler': FactorScheduler(step=sched[0], factor=sched[1])} if sched else {}
    return create('groupadagrad', **params, **more)


def kvps_run(config_id, params, sched, grads_as, mp, dtype=np.float32):
    """The run of GROUP_CONFIGS as a server does it: a flat weight of a key of GROUP_SHAPE."""
    updater = Updater(optimizer(params, sched), lambda key, part: GROUP_SHAPE)
    w0, grads = group_problem(config_id)
    weight = w0.astype(np.float16 if mp else dtype).reshape(-1)
    for step, g in enumerate(grads):
        g = g.astype(weight.dtype)
        if grads_as == 'dense':
            updater.update(0, weight, g.reshape(-1))
            continue
        rows = np.arange(ROWS) if grads_as == 'rows' else np.array(group_rows(step))
        updater.update_rows(0, 0, weight, rows, g[rows], WIDTH)
    return weight, updater


@pytest.mark.parametrize('config', GROUP_CONFIGS, ids=[c[0] for c in GROUP_CONFIGS])
def test_mxnets_own_weights(config):
    """Rows (MXNet's fused kernel) to the bit; dense, where MXNet's Python takes the mean
    and divides in another order, to rounding."""
    weight, _ = kvps_run(*config)
    want = np.array(MXNET_GROUP[config[0]], weight.dtype)
    if config[3] == 'dense':
        np.testing.assert_allclose(weight, want, rtol=2e-6, atol=1e-7)
    else:
        np.testing.assert_array_equal(weight, want)


def reference(w0, grads, lr_at, eps, rescale=1.0, clip=None):
    """MXNet's documented rule in float64: h += mean(g^2, axis=1); w -= lr*g/sqrt(h+eps)."""
    w, h = np.asarray(w0, np.float64), np.zeros((w0.shape[0], 1))
    for t, g in enumerate(grads, start=1):
        g = np.asarray(g, np.float64) * rescale
        if clip is not None:
            g = np.clip(g, -clip, clip)
        h += np.mean(g * g, axis=1, keepdims=True)
        w = w - lr_at(t) * g / np.sqrt(h + eps)
    return w


def test_float64_follows_the_documented_rule():
    config = GROUP_CONFIGS[0]
    weight, updater = kvps_run(*config, dtype=np.float64)
    w0, grads = group_problem(config[0])
    want = reference(w0, grads, updater.optimizer.base_lr, 1e-5, 0.5, 0.8)
    np.testing.assert_allclose(weight.reshape(GROUP_SHAPE), want, rtol=1e-12, atol=1e-14)


def test_pushed_rows_touch_only_their_rows_and_histories():
    updater = Updater(create('groupadagrad', learning_rate=0.1), lambda key, part: GROUP_SHAPE)
    w0, grads = group_problem('groupadagrad-some')
    weight = w0.reshape(-1).copy()
    updater.update(0, weight, grads[0].reshape(-1))
    before, history = weight.copy(), updater.get_states()['states'][0][2]['history']
    updater.update_rows(0, 0, weight, np.array([1, 4]), grads[1][[1, 4]], WIDTH)
    after = updater.get_states()['states'][0][2]['history']
    changed = np.flatnonzero((weight != before).reshape(GROUP_SHAPE).any(axis=1))
    assert changed.tolist() == [1, 4]
    h0, h1 = (np.frombuffer(h['data'], np.float32) for h in (history, after))
    assert np.flatnonzero(h0 != h1).tolist() == [1, 4] and after['shape'] == [ROWS]
    assert updater.updates_rows


def test_a_dense_gradient_with_zero_rows_leaves_them_as_rows_alone_do():
    """No wd and no momentum: a row without gradient keeps its value either way."""
    w0, grads = group_problem('groupadagrad-some')
    alone, dense = w0.reshape(-1).copy(), w0.reshape(-1).copy()
    one = Updater(create('groupadagrad'), lambda key, part: GROUP_SHAPE)
    two = Updater(create('groupadagrad'), lambda key, part: GROUP_SHAPE)
    for step, g in enumerate(grads[:5]):
        rows = group_rows(step)
        one.update_rows(0, 0, alone, np.array(rows), g[rows], WIDTH)
        full = np.zeros(GROUP_SHAPE, np.float32)
        full[rows] = g[rows]
        two.update(0, dense, full.reshape(-1))
    np.testing.assert_array_equal(alone, dense)


def test_names_defaults_and_refusals():
    opt = create('groupadagrad')
    assert isinstance(opt, GroupAdaGrad) and opt.epsilon == 1e-5 and opt.lr == 0.01
    assert create('groupadagrad', eps=1e-3).epsilon == 1e-3          # MXNet 1.9's name
    assert create('GroupAdaGrad', epsilon=1e-3).to_spec()['params']['epsilon'] == 1e-3
    with pytest.raises(ConfigError, match='GroupAdaGrad does not support weight decay.*0.1'):
        create('groupadagrad', wd=0.1)
    with pytest.raises(ConfigError, match="unknown parameter 'momentum'"):
        create('groupadagrad', momentum=0.9)
    with pytest.raises(ConfigError, match="'epsilon' given twice"):
        create('groupadagrad', eps=1e-3, epsilon=1e-3)


@pytest.mark.parametrize('shape', [(30,), (2, 3, 5)])
def test_a_key_not_2d_is_refused_naming_it(shape):
    updater = Updater(create('groupadagrad'), lambda key, part: shape)
    with pytest.raises(ShapeError, match="key 'emb'.*2-D weight.*shape " + re.escape(str(shape))):
        updater.update('emb', np.zeros(30, np.float32), np.ones(30, np.float32))
    flat = Updater(create('groupadagrad'))   # no shape known: a flat part
    with pytest.raises(ShapeError, match="key 'emb'.*no known shape"):
        flat.update('emb', np.zeros(30, np.float32), np.ones(30, np.float32))


@pytest.mark.parametrize('dtype', [np.float16, np.uint16])   # uint16: bfloat16
def test_low_precision_weights_keep_a_float32_history_per_row(dtype):
    updater = Updater(create('groupadagrad', learning_rate=0.1))
    weight = np.zeros(GROUP_SHAPE, dtype)
    grad = np.full(GROUP_SHAPE, 0x3F80 if dtype == np.uint16 else 1.0, dtype)  # (bf16 1.0)
    updater.update(0, weight, grad)
    state = updater.get_states()['states'][0][2]
    assert set(state) == {'history'}
    assert state['history']['dtype'] == 'float32' and state['history']['shape'] == [ROWS]
    assert np.frombuffer(state['history']['data'], np.float32).tolist() == [1.0] * ROWS


def test_the_kernel_refuses_a_history_that_does_not_fit():
    with pytest.raises(ShapeError, match='per-row optimizer state of 4 elements'):
        K.group_adagrad_update(np.zeros(30, np.float32), np.ones(30, np.float32),
                               np.zeros(4, np.float32), 0.1, 0.0, 1.0, None)


def store_run(kv, steps, start=0):
    """Dense and row pushes to key 'emb' of GROUP_SHAPE; its weight after them."""
    _, grads = group_problem('groupadagrad-some')
    for step in range(start, start + steps):
        if step % 2:
            rows = group_rows(step)
            kv.push('emb', kvps.RowSparse(np.array(rows), grads[step][rows]))
        else:
            kv.push('emb', grads[step])
    out = np.zeros(GROUP_SHAPE, np.float32)
    kv.pull('emb', out=out)
    return out


def fresh_store():
    kv = kvps.create('local')
    kv.set_optimizer(create('groupadagrad', learning_rate=0.1, rescale_grad=0.5))
    kv.init('emb', group_problem('groupadagrad-some')[0])
    return kv


def test_states_saved_and_loaded_through_a_store_go_on_as_never_stopped(tmp_path):
    straight = store_run(fresh_store(), 8)
    first = fresh_store()
    store_run(first, 4)
    first.save_optimizer_states(str(tmp_path / 'opt.states'))
    merged = first.get_optimizer_states()
    (entry,) = merged['keys']
    assert entry[2]['history']['shape'] == [ROWS]   # one per row, as MXNet's (rows, 1)
    second = kvps.create('local')
    second.set_optimizer(create('groupadagrad', learning_rate=0.1, rescale_grad=0.5))
    second.init('emb', first_weight(first))
    second.load_optimizer_states(str(tmp_path / 'opt.states'))
    np.testing.assert_array_equal(store_run(second, 4, start=4), straight)


def first_weight(kv):
    out = np.zeros(GROUP_SHAPE, np.float32)
    kv.pull('emb', out=out)
    return out


def test_states_of_a_key_with_other_rows_are_refused_naming_it(tmp_path):
    first = fresh_store()
    store_run(first, 2)
    first.save_optimizer_states(str(tmp_path / 'opt.states'))
    other = kvps.create('local')
    other.set_optimizer(create('groupadagrad'))
    other.init('emb', np.zeros((5, 6), np.float32))   # 30 elements, 5 rows
    with pytest.raises(ConfigError, match="opt.states.*key 'emb'.*'history' has shape \\(6,\\)"):
        other.load_optimizer_states(str(tmp_path / 'opt.states'))
