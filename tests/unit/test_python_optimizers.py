"""Optimizers written in Python as MXNet's are (create_state, update): run by the Updater key
by key, with kvps's counts, lr/wd multipliers, multi-precision, checkpoints; checked at
register; the same in the local store."""

import numpy as np
import pytest

import kvps
from kvps.errors import ConfigError
from kvps.optimizer import FactorScheduler, Optimizer, create, register
from kvps.optimizer.updater import Updater

RNG = np.random.default_rng(11)
pytestmark = pytest.mark.usefixtures('plugin')   # the tests' plugin (tests/conftest.py)


def grads(shape, steps, dtype=np.float32):
    return [RNG.standard_normal(shape).astype(dtype) for _ in range(steps)]


def by_hand(opt, key, weight, gs):
    """The optimizer's own update called in a loop, as MXNet's Updater calls it: the key's
    count and num_update ticked before each call."""
    state = opt.create_state(key, weight)
    for t, g in enumerate(gs, start=1):
        opt.num_update = t
        opt._index_update_count[key] = t
        opt.update(key, weight, g.copy(), state)
    return weight


SPECS = {
    'test_py_momentum': dict(learning_rate=0.1, momentum=0.9, wd=0.01, rescale_grad=0.5,
                             clip_gradient=0.8),
    'test_py_adam': dict(learning_rate=0.01, wd=0.001, eps=1e-6),
    'test_py_dcasgd': dict(learning_rate=0.05, momentum=0.5),
}


@pytest.mark.parametrize('name', sorted(SPECS))
def test_the_updater_runs_a_python_update_exactly_as_its_own_loop(name):
    shape = (4, 5)
    u = Updater(create(name, **SPECS[name]), lambda key, part: shape)
    w = np.linspace(-1, 1, 20, dtype=np.float32)      # the store's flat weight
    gs = grads(shape, 5)
    for g in gs:
        u.update('w', w, g.reshape(-1).copy())
    want = by_hand(create(name, **SPECS[name]), 'w', np.linspace(-1, 1, 20, dtype=np.float32)
                   .reshape(shape), gs)
    np.testing.assert_array_equal(w.reshape(shape), want)
    assert u.num_update == 5 and u.optimizer._index_update_count == {'w': 5}


def test_a_python_update_sees_the_shape_only_when_the_key_is_whole(plugin):
    """DCASGD's row scaling reads the shape: a flat part gives other values (split keys get
    flat parts; such an optimizer keeps whole_tensor, so the servers keep its keys whole)."""
    gs = grads((4, 5), 3)
    shaped, flat = (np.ones(20, np.float32) for _ in range(2))
    whole = Updater(create('test_py_dcasgd'), lambda key, part: (4, 5))
    parts = Updater(create('test_py_dcasgd'))
    for g in gs:
        whole.update('k', shaped, g.reshape(-1).copy())
        parts.update('k', flat, g.reshape(-1).copy())
    assert not np.array_equal(shaped, flat)
    assert plugin.PyDCASGD.whole_tensor and Updater(create('test_py_dcasgd')).updates_rows is False


def test_lr_scheduler_lr_mult_and_wd_mult_reach_the_helpers():
    opt = create('test_py_momentum', wd=0.5,
                 lr_scheduler=FactorScheduler(step=2, factor=0.5, base_lr=1.0))
    opt.set_lr_mult({'a': 2.0})
    opt.set_wd_mult({'a': 0.0})
    u = Updater(opt)
    seen = []
    update = type(opt).update

    def spy(self, index, weight, grad, state):
        seen.append((index, self._get_lr(index), self._get_wd(index), self.num_update,
                     self._index_update_count[index], self.learning_rate))
        update(self, index, weight, grad, state)
    opt.update = spy.__get__(opt)   # (runs_python reads the class: still a Python update)
    for _ in range(3):
        u.update_many([('a', 0, np.zeros(2, np.float32), np.ones(2, np.float32)),
                       ('b', 0, np.zeros(2, np.float32), np.ones(2, np.float32))])
    # counts tick for every key of a round before any update runs (MXNet's aggregation)
    assert seen == [('a', 2.0, 0.0, 1, 1, 1.0), ('b', 1.0, 0.5, 1, 1, 1.0),
                    ('a', 2.0, 0.0, 2, 2, 1.0), ('b', 1.0, 0.5, 2, 2, 1.0),
                    ('a', 1.0, 0.0, 3, 3, 0.5), ('b', 0.5, 0.5, 3, 3, 0.5)]


def test_a_key_whose_update_raises_fails_alone():
    opt = create('test_py_momentum', learning_rate=1.0)
    calls = []

    class Boom(ValueError):
        pass

    def update(index, weight, grad, state):
        calls.append(index)
        if index == 'bad':
            raise Boom('no')
        weight -= grad
    opt.update = update
    u, failures = Updater(opt), {}
    ws = {k: np.zeros(3, np.float32) for k in ('a', 'bad', 'c')}
    u.update_many([(k, 0, w, np.ones(3, np.float32)) for k, w in ws.items()], 0, failures)
    assert calls == ['a', 'bad', 'c'] and list(failures) == [1]
    assert isinstance(failures[1], Boom)
    assert ws['a'].tolist() == ws['c'].tolist() == [-1.0] * 3
    with pytest.raises(Boom):   # without a failures dict it is raised
        u.update_many([('bad', 0, ws['bad'], np.ones(3, np.float32))])


def test_the_gradient_it_gets_may_be_changed_and_a_round_of_two_pushes_is_summed():
    opt = create('test_py_momentum', learning_rate=1.0)
    got = []

    def update(index, weight, grad, state):
        got.append(grad.copy())
        grad *= 0          # as MXNet's AdaDelta does: its own copy, never a push buffer
        weight += 1
    opt.update = update
    first, last = np.full(3, 1.5, np.float32), np.full(3, 2.0, np.float32)
    last.flags.writeable = False     # a received buffer
    u, w = Updater(opt), np.zeros(3, np.float32)
    u.update('k', w, (first, last))
    u.update('k', w, last)
    assert [g.tolist() for g in got] == [[3.5] * 3, [2.0] * 3]
    assert first.tolist() == [1.5] * 3 and last.tolist() == [2.0] * 3


@pytest.mark.parametrize('dtype', ['float16', 'bfloat16'])
def test_low_precision_weights_update_through_a_float32_copy(dtype):
    """multi_precision: update gets the fp32 master (as MXNet's update_multi_precision) and
    the weight its rounding; bfloat16 without it gets a float32 copy per update."""
    from kvps.optimizer.kernels.common import bf16_to_f32, f32_to_bf16
    store = np.float16 if dtype == 'float16' else np.uint16
    narrow = (lambda a: a.astype(np.float16)) if dtype == 'float16' else f32_to_bf16
    wide = (lambda a: a.astype(np.float32)) if dtype == 'float16' else bf16_to_f32
    seen = []
    for mp in (True, False):
        if dtype == 'float16' and not mp:
            continue
        opt = create('test_py_momentum', learning_rate=0.1, momentum=0.9, multi_precision=mp)
        real = opt.update
        opt.update = lambda i, weight, grad, state, real=real: (
            seen.append((weight.dtype, grad.dtype, state.dtype)), real(i, weight, grad, state))
        u = Updater(opt)
        w = narrow(np.linspace(-1, 1, 8, dtype=np.float32))
        master = wide(w)
        ref = create('test_py_momentum', learning_rate=0.1, momentum=0.9)
        ref_state = ref.create_state(0, master)
        for t, g in enumerate(grads(8, 3), start=1):
            u.update(0, w, narrow(g))
            ref.num_update = t
            if not mp:
                master = wide(narrow(master))   # no master: the weight's rounding each step
            ref.update(0, master, wide(narrow(g)), ref_state)
            assert w.dtype == store
            np.testing.assert_array_equal(w, narrow(master))
    assert set(seen) == {(np.dtype(np.float32),) * 3}


def test_states_save_and_load_into_a_fresh_updater_and_go_on_exactly():
    shape, gs = (3, 4), grads((3, 4), 6)
    for name in sorted(SPECS):
        def fresh():
            return Updater(create(name, **SPECS[name]), lambda key, part: shape)
        straight, first = fresh(), fresh()
        w1 = np.linspace(0, 1, 12, dtype=np.float32)
        w2 = w1.copy()
        for g in gs[:3]:
            straight.update(5, w1, g.reshape(-1).copy())
            first.update(5, w2, g.reshape(-1).copy())
        saved = first.get_states(dump_optimizer=True)
        assert all(n.startswith('state') for _, _, st in saved['states'] for n in st)
        second = fresh()
        second.set_states(saved, {(5, 0): w2})
        for g in gs[3:]:
            straight.update(5, w1, g.reshape(-1).copy())
            second.update(5, w2, g.reshape(-1).copy())
        np.testing.assert_array_equal(w1, w2)


def test_a_state_of_another_optimizer_or_size_is_refused_at_load():
    w = np.zeros(6, np.float32)
    adam = Updater(create('test_py_adam'))
    adam.update('k', w, np.ones(6, np.float32))
    saved = adam.get_states()
    momentum = Updater(create('test_py_momentum', momentum=0.5))
    with pytest.raises(ConfigError, match=r"holds \['state.0', 'state.1'\].*makes \['state'\]"):
        momentum.set_states(saved, {('k', 0): w})
    with pytest.raises(ConfigError, match="'state.0' holds 6 elements, create_state makes 4"):
        Updater(create('test_py_adam')).set_states(saved, {('k', 0): np.zeros(4, np.float32)})
    with pytest.raises(ConfigError, match='kvps optimizer-state|makes'):   # at the first update
        bad = Updater(create('test_py_momentum', momentum=0.5))
        bad.set_states(saved)
        bad.update('k', w, np.ones(6, np.float32))


@pytest.mark.parametrize('made, match', [
    (lambda w: 0.0, "returned float as 'state'"),
    (lambda w: (np.zeros_like(w), 3), "returned int as 'state.1'"),
    (lambda w: np.zeros(w.size + 1, w.dtype), "of 7 float32 elements.*weight's size \\(6\\)"),
    (lambda w: np.zeros(w.shape, np.int32), 'of 6 int32 elements'),
    (lambda w: {'m': np.zeros_like(w)}, "returned dict"),
])
def test_create_state_must_make_arrays_the_size_of_the_weight(made, match):
    opt = create('test_py_momentum')
    opt.create_state = lambda index, weight: made(weight)
    with pytest.raises(ConfigError, match=match):
        Updater(opt).update('k', np.zeros(6, np.float32), np.ones(6, np.float32))


def test_hyper_parameters_travel_as_data_and_are_checked():
    opt = create('test_py_adam', eps=1e-6, beta1=0.5)
    spec = opt.to_spec()
    assert spec['name'] == 'test_py_adam' and spec['params']['epsilon'] == 1e-6
    assert Optimizer.from_spec(spec) == opt and Optimizer.from_spec(spec).beta1 == 0.5
    with pytest.raises(ConfigError, match="unknown parameter 'gamma'"):
        create('test_py_adam', gamma=1.0)
    with pytest.raises(ConfigError, match="'beta1' must be a number"):
        create('test_py_adam', beta1='big')
    with pytest.raises(ConfigError, match='momentum must be in'):
        Optimizer.from_spec({'name': 'test_py_momentum', 'params': {'momentum': 1.5}})


def test_an_unknown_name_says_how_to_register_one_on_the_servers():
    with pytest.raises(ConfigError) as info:
        create('test_py_nowhere')
    text = str(info.value)
    assert "'test_py_nowhere'" in text and 'KVPS_SERVER_PLUGINS' in text
    assert '--server-plugin' in text and 'this server' not in text   # not a server


def test_setting_it_again_keeps_its_state_unless_its_own_hyper_parameters_change():
    u, w = Updater(create('test_py_momentum', learning_rate=0.1, momentum=0.5)), np.zeros(2)
    u.update('k', w, np.ones(2))
    state = u.get_states()
    assert u.retune(create('test_py_momentum', learning_rate=0.2, momentum=0.5, wd=0.1,
                           rescale_grad=0.5).to_spec())
    assert u.get_states() == state and u.optimizer.learning_rate == 0.2
    # momentum 0 makes no state (create_state returns None): the state starts afresh
    assert not u.retune(create('test_py_momentum', momentum=0.0).to_spec())


# -- register's checks ----------------------------------------------------------------------
def _registers(body, **attrs):
    return register(type('Opt' + str(abs(hash(body)) % 10**6), (Optimizer,),
                         {'name': f'test_py_bad_{abs(hash(body)) % 10**6}', **attrs}))


def _update(self, index, weight, grad, state):
    weight -= grad


@pytest.mark.parametrize('attrs, error, match', [
    ({}, ConfigError, 'has no update: override update'),
    ({'kernel': 'my_update'}, ConfigError, "'my_update' is not one of kvps's kernels"),
    ({'update': _update, 'hyper': {'beta': ('complex', 1)}}, ConfigError, 'kind one of'),
    ({'update': _update, 'hyper': {'beta': ('float', 'x')}}, ConfigError, 'must be a number'),
    ({'update': _update, 'hyper': {'wd': ('float', 0.0)}}, ConfigError, 'every optimizer has'),
    ({'update': _update, 'hyper': {'lr': ('float', 0.0)}}, ConfigError, 'every optimizer has'),
    ({'update': _update, 'hyper': {'update': ('float', 0.0)}}, ConfigError, 'every optimizer'),
    ({'update': _update, 'aliases': {'b': 'beta'}}, ConfigError, 'does not declare'),
    ({'update': _update, '__init__': lambda self, lamda=0.1, **kw: None}, ConfigError,
     "takes 'lamda', which .* does not declare.*hyper = {'lamda'"),
    ({'update': _update, 'hyper': {'lamda': ('float', 0.1)},
      '__init__': lambda self, lamda=0.1: None}, ConfigError, 'must take \\*\\*kwargs'),
])
def test_register_refuses_what_could_not_run_on_a_server(attrs, error, match):
    with pytest.raises(error, match=match):
        _registers(repr(sorted(attrs)), **attrs)


def test_register_refuses_what_is_not_an_optimizer_class(plugin):
    with pytest.raises(TypeError, match='subclass of kvps.optimizer.Optimizer'):
        register(object)
    with pytest.raises(TypeError, match='subclass'):
        register(plugin.PyAdam())


def test_an_init_that_takes_declared_names_registers_and_its_values_travel():
    @register
    class Declared(Optimizer):
        name = 'test_py_declared'
        hyper = {'lamda': ('float', 0.1)}

        def __init__(self, lamda=0.1, **kwargs):
            super().__init__(lamda=lamda, **kwargs)
            self.derived = 2 * self.lamda

        def update(self, index, weight, grad, state):
            weight -= self.derived * grad
    opt = Optimizer.from_spec(create('test_py_declared', lamda=0.25).to_spec())
    assert opt.lamda == 0.25 and opt.derived == 0.5 and Declared.whole_tensor


def test_a_python_update_declaring_itself_elementwise_may_be_split_and_fused(plugin):
    class Elementwise(plugin.PyMomentum):
        name = 'test_py_elementwise'
        whole_tensor = False

    class Inherits(Elementwise):
        pass
    assert not Elementwise.whole_tensor and not Inherits.whole_tensor
    assert plugin.PyMomentum.whole_tensor and not kvps.optimizer.SGD.whole_tensor
    assert create('sgd').runs_python is False and plugin.PyMomentum().runs_python


def test_a_kernel_subclass_of_a_builtin_runs_the_kernel():
    @register
    class Heavy(kvps.optimizer.SGD):
        name = 'test_py_heavy'
        hyper = {**kvps.optimizer.SGD.hyper, 'momentum': ('float', 0.99)}
    opt = create('test_py_heavy')
    assert not opt.runs_python and opt.kernel == 'sgd_update' and opt.momentum == 0.99
    with pytest.raises(NotImplementedError, match='runs the kernel'):
        opt.update(0, None, None, None)


def test_mxnets_spelling_of_register_works_too():
    @Optimizer.register
    class MXNetStyle(Optimizer):
        def update(self, index, weight, grad, state):
            weight -= self.learning_rate * grad
    assert type(create('mxnetstyle')) is MXNetStyle and create('mxnetstyle').create_state(
        0, np.zeros(1)) is None
