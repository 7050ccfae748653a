"""Optimizer specs: registry, validation, msgpack round trips, and the lr schedulers vs MXNet's."""

import hashlib
import math
import struct

import msgpack
import pytest

from kvps import optimizer as opt_mod
from kvps.errors import ConfigError
from kvps.optimizer import (CosineScheduler, FactorScheduler, MultiFactorScheduler, Optimizer,
                            PolyScheduler, create)

NAMES = ['sgd', 'nag', 'adam', 'adamw', 'adagrad', 'rmsprop', 'lamb', 'ftrl', 'signum', 'test',
         'adadelta', 'adamax', 'nadam', 'ftml', 'lars', 'lbsgd', 'sgld', 'dcasgd', 'ccsgd',
         'groupadagrad', 'adabelief', 'lans']
# Every name MXNet 1.9.1 registers (mx.optimizer.Optimizer.opt_registry): kvps has them all.
MXNET_19 = ['adadelta', 'adagrad', 'adam', 'adamax', 'ccsgd', 'dcasgd', 'ftml', 'ftrl',
            'groupadagrad', 'lamb', 'lars', 'lbsgd', 'nadam', 'nag', 'rmsprop', 'sgd', 'sgld',
            'signum', 'test']


def test_registry_has_the_mxnet_names_and_classes():
    assert opt_mod.registered() == sorted(NAMES)
    assert set(MXNET_19) - set(NAMES) == set()
    for cls_name, name in [('SGD', 'sgd'), ('NAG', 'nag'), ('Adam', 'adam'), ('AdamW', 'adamw'),
                           ('AdaGrad', 'adagrad'), ('RMSProp', 'rmsprop'), ('LAMB', 'lamb'),
                           ('Ftrl', 'ftrl'), ('Signum', 'signum'), ('Test', 'test'),
                           ('AdaDelta', 'adadelta'), ('Adamax', 'adamax'), ('Nadam', 'nadam'),
                           ('FTML', 'ftml'), ('LARS', 'lars'), ('LBSGD', 'lbsgd'),
                           ('SGLD', 'sgld'), ('DCASGD', 'dcasgd'), ('ccSGD', 'ccsgd'),
                           ('GroupAdaGrad', 'groupadagrad'), ('AdaBelief', 'adabelief'),
                           ('LANS', 'lans')]:
        assert type(create(name.upper())) is getattr(opt_mod, cls_name)
    assert isinstance(create('ccsgd'), opt_mod.SGD)


def test_unknown_optimizer_lists_known_names():
    with pytest.raises(ConfigError, match='unknown optimizer .*adam.*sgd'):
        create('adamm')
    with pytest.raises(ConfigError, match='unknown optimizer'):
        Optimizer.from_spec({'name': 'nope', 'params': {}})


def test_unknown_hyper_parameter_lists_valid_names():
    with pytest.raises(ConfigError, match="unknown parameter 'betta1'.*beta1.*epsilon"):
        create('adam', betta1=0.9)
    with pytest.raises(ConfigError, match="unknown parameter 'learnin_rate'.*learning_rate.*"
                                          "momentum"):   # the common names are listed too
        create('sgd', learnin_rate=0.1)
    with pytest.raises(ConfigError, match="unknown parameter 'momentum'"):
        create('adam', momentum=0.9)


@pytest.mark.parametrize('name,params', [
    ('sgd', {'momentum': '0.9'}), ('sgd', {'learning_rate': True}), ('adam', {'wd': None}),
    ('rmsprop', {'centered': 1}), ('lamb', {'lower_bound': 'x'}),
    ('sgd', {'begin_num_update': 1.5}), ('sgd', {'momentum': 1.5}),
])
def test_wrong_types_and_ranges_are_config_errors(name, params):
    with pytest.raises(ConfigError, match='|'.join(params)):
        create(name, **params)


def test_defaults_aliases_and_mxnet_conventions():
    assert create('sgd').learning_rate == 0.01
    assert create('adam').learning_rate == 0.001 and create('ftrl').learning_rate == 0.1
    assert create('adagrad', eps=1e-5).epsilon == 1e-5
    r = create('rmsprop', gamma1=0.8, gamma2=0.7)
    assert (r.rho, r.momentum) == (0.8, 0.7)
    with pytest.raises(ConfigError, match='given twice'):
        create('rmsprop', gamma1=0.8, rho=0.8)
    assert create('sgd', clip_gradient=-1).clip_gradient is None  # <= 0 means off
    assert create('sgd', clip_gradient=0).clip_gradient is None
    assert create('sgd', learning_rate=1).lr == 1.0 and isinstance(create('sgd', wd=1).wd, float)
    assert create('sgd', use_fused_step=False, aggregate_num=4) == create('sgd')  # ignored
    assert create('sgd', momentum=0.0).state_names() == ()
    assert create('sgd', momentum=0.5).state_names() == ('mom',)
    assert create('rmsprop', centered=True).state_names() == ('var', 'mean', 'mom')


# The spec round trip of every optimizer and hyper-parameter, against specs written out rather
# than to_spec's own output: test_optimizer_specs.


def test_spec_with_str_keys_survives_default_msgpack_and_pairs_are_accepted():
    opt = create('adam', lr_scheduler={'name': 'cosine', 'params': {'max_update': 100}})
    opt.set_lr_mult({'fc1_weight': 0.1})
    assert Optimizer.from_spec(msgpack.unpackb(msgpack.packb(opt.to_spec()))) == opt
    spec = opt.to_spec()
    spec['lr_mult'] = [[5, 0.5], ['x', 2]]  # the msgpack-safe spelling for int keys
    assert Optimizer.from_spec(spec).lr_mult == {5: 0.5, 'x': 2.0}


@pytest.mark.parametrize('spec,match', [
    ([1, 2], 'must be a dict'),
    ({'name': 'sgd', 'extra': 1}, 'unknown fields'),
    ({'name': 'sgd', 7: 1, 'x': 2}, 'unknown fields'),    # mixed key types: no TypeError
    ({'name': 'sgd', 'params': {'lr_scheduler': None}}, 'top level'),
    ({'name': 'sgd', 'params': {1: 2}}, 'str keys'),
    ({'name': 'sgd', 'lr_mult': {1.5: 1.0}}, 'int or str'),
    ({'name': 'sgd', 'lr_mult': {1: 'x'}}, 'must be a number'),
    ({'name': 'sgd', 'lr_mult': 7}, 'dict of key'),
    ({'name': 'sgd', 'params': {'learning_rate': float('nan')}}, 'finite number, got nan'),
    ({'name': 'adam', 'params': {'beta1': float('inf')}}, 'finite number, got inf'),
    ({'name': 'sgd', 'lr_mult': {1: float('nan')}}, 'finite number'),
    ({'name': 'sgd', 'lr_scheduler': {'name': 'factor', 'params': {'factor': float('nan')}}},
     'finite number'),
    ({'name': 'sgd', 'lr_scheduler': {'name': 'warp'}}, 'unknown lr_scheduler.*cosine'),
    ({'name': 'sgd', 'lr_scheduler': {'name': 'factor', 'params': {'step': 0}}}, 'step >= 1'),
    ({'name': 'sgd', 'lr_scheduler': {'name': 'factor', 'params': {'stp': 1}}}, 'unknown'),
])
def test_bad_specs_are_config_errors(spec, match):
    with pytest.raises(ConfigError, match=match):
        Optimizer.from_spec(spec)


def test_learning_rate_and_scheduler_ownership():
    sched = FactorScheduler(step=2, factor=0.5, base_lr=1.0)
    opt = create('sgd', lr_scheduler=sched)
    assert opt.lr == 1.0 and opt.learning_rate == 1.0  # the scheduler's base_lr rules
    with pytest.raises(ConfigError, match='lr_scheduler'):
        opt.set_learning_rate(0.1)
    opt2 = create('sgd', learning_rate=0.4, lr_scheduler=sched)
    assert opt2.lr_scheduler.base_lr == 0.4 and sched.base_lr == 1.0  # copied, not mutated
    opt2.num_update = 5
    assert opt2.learning_rate == pytest.approx(0.1)
    plain = create('sgd', learning_rate=0.3)
    with pytest.raises(ConfigError, match='finite'):   # it would turn every weight into NaN
        plain.set_learning_rate(float('nan'))
    plain.set_learning_rate(0.2)
    assert plain.learning_rate == 0.2 and plain.get_lr('k', 99) == 0.2
    plain.set_lr_mult({'k': 3})
    assert plain.get_lr('k', 0) == pytest.approx(0.6) and plain.get_lr('other', 0) == 0.2


def test_kernel_args_include_count_only_where_needed():
    assert create('adam').kernel_args(7) == {'beta1': 0.9, 'beta2': 0.999, 'epsilon': 1e-8,
                                             't': 7}
    assert create('sgd', momentum=0.9).kernel_args(7) == {'momentum': 0.9, 'nesterov': False}
    assert create('test').kernel_args(1) == {}


# ---------------------------------------------------------------- MXNet's stateful schedulers
# Written from MXNet 1.9's python/mxnet/lr_scheduler.py, operation by operation: the values
# must be equal, not close (a script compared against MXNet's output bit for bit: MXNET_SHA256).
class MxWarmup:
    def __init__(self, base_lr, warmup_steps, warmup_begin_lr, warmup_mode):
        self.base_lr, self.warmup_steps = base_lr, warmup_steps
        self.warmup_begin_lr, self.warmup_mode = warmup_begin_lr, warmup_mode
        self.warmup_final_lr = base_lr

    def warm(self, n):
        if self.warmup_mode == 'linear':
            inc = (self.warmup_final_lr - self.warmup_begin_lr) * float(n) / self.warmup_steps
            return self.warmup_begin_lr + inc
        return self.warmup_begin_lr


class MxFactor(MxWarmup):
    def __init__(self, step, factor, stop_factor_lr, **kw):
        super().__init__(**kw)
        self.step, self.factor, self.stop, self.count = step, factor, stop_factor_lr, 0

    def __call__(self, n):
        if n < self.warmup_steps:
            return self.warm(n)
        while n > self.count + self.step:
            self.count += self.step
            self.base_lr *= self.factor
            if self.base_lr < self.stop:
                self.base_lr = self.stop
        return self.base_lr


class MxMulti(MxWarmup):
    def __init__(self, step, factor, **kw):
        super().__init__(**kw)
        self.step, self.factor, self.ind = step, factor, 0

    def __call__(self, n):
        if n < self.warmup_steps:
            return self.warm(n)
        while self.ind < len(self.step) and n > self.step[self.ind]:
            self.ind += 1
            self.base_lr *= self.factor
        return self.base_lr


class MxAnneal(MxWarmup):
    def __init__(self, kind, max_update, final_lr, pwr=2, **kw):
        super().__init__(**kw)
        self.kind, self.max_update, self.final_lr, self.pwr = kind, max_update, final_lr, pwr
        self.orig = self.base_lr

    def __call__(self, n):
        if n < self.warmup_steps:
            return self.warm(n)
        if n <= self.max_update:
            steps = self.max_update - self.warmup_steps
            if self.kind == 'cosine':
                self.base_lr = self.final_lr + (self.orig - self.final_lr) * \
                    (1 + math.cos(math.pi * (n - self.warmup_steps) / steps)) / 2
            else:
                self.base_lr = self.final_lr + (self.orig - self.final_lr) * \
                    pow(1 - float(n - self.warmup_steps) / float(steps), self.pwr)
        return self.base_lr


WARM = {'none': dict(warmup_steps=0, warmup_begin_lr=0.0, warmup_mode='linear'),
        'linear': dict(warmup_steps=37, warmup_begin_lr=0.01, warmup_mode='linear'),
        'constant': dict(warmup_steps=23, warmup_begin_lr=0.05, warmup_mode='constant')}
SCHEDULERS = {   # name: (ours, MXNet's), each given the same parameters
    'factor': (lambda **w: FactorScheduler(step=7, factor=0.6, stop_factor_lr=1e-4, **w),
               lambda **w: MxFactor(7, 0.6, 1e-4, **w)),
    'factor1': (lambda **w: FactorScheduler(step=1, factor=0.999, stop_factor_lr=1e-8, **w),
                lambda **w: MxFactor(1, 0.999, 1e-8, **w)),
    'multifactor': (lambda **w: MultiFactorScheduler(step=[6, 11, 30, 400, 1500], factor=0.3,
                                                     **w),
                    lambda **w: MxMulti([6, 11, 30, 400, 1500], 0.3, **w)),
    'cosine': (lambda **w: CosineScheduler(max_update=2500, final_lr=0.05, **w),
               lambda **w: MxAnneal('cosine', 2500, 0.05, **w)),
    'poly': (lambda **w: PolyScheduler(max_update=2500, pwr=1.5, final_lr=0.01, **w),
             lambda **w: MxAnneal('poly', 2500, 0.01, pwr=1.5, **w)),
}
BASE_LR = {'factor1': 0.1}   # (0.5 for the others)
# sha256 (first 16 hex digits) of MXNet 1.9.1's learning rates for updates 0..2999 of each
# scheduler above, called in order, packed as little-endian float64
MXNET_SHA256 = {
    'factor/none': 'c8128a3fc7a89af1', 'factor/linear': '4531e751080282dd',
    'factor/constant': '7db8139cad8680cc', 'factor1/none': 'e5bf58ded4946dac',
    'factor1/linear': '099bfa2cf7ebfb80', 'factor1/constant': 'fe2247d17e58102d',
    'multifactor/none': '098239c87c7af37a', 'multifactor/linear': '135faae9a6a46c12',
    'multifactor/constant': '7f770aaf48374a0f', 'cosine/none': '403f5c33cafa21f4',
    'cosine/linear': '6c755316a600f191', 'cosine/constant': '5cad11a122cb5b80',
    'poly/none': '33403c0bed7a1c9e', 'poly/linear': '6b5bf92f7125e226',
    'poly/constant': '3d1d272be703e718',
}


@pytest.mark.parametrize('warm', WARM)
@pytest.mark.parametrize('kind', SCHEDULERS)
def test_schedulers_equal_mxnet_to_the_last_bit(kind, warm):
    """Over 3000 updates, in order and (for ours, which keeps no state that matters) in any
    order: the same learning rates as MXNet 1.9, bit for bit."""
    params = dict(base_lr=BASE_LR.get(kind, 0.5), **WARM[warm])
    make_ours, make_theirs = SCHEDULERS[kind]
    ours, theirs = make_ours(**params), make_theirs(**params)
    rates = [ours(n) for n in range(3000)]
    assert rates == [theirs(n) for n in range(3000)]
    packed = struct.pack(f'<{len(rates)}d', *rates)
    assert hashlib.sha256(packed).hexdigest()[:16] == MXNET_SHA256[f'{kind}/{warm}']
    again = make_ours(**params)   # asked out of order: the same values
    assert [again(n) for n in (2999, 5, 1700, 0, 2999)] == [rates[n] for n in
                                                           (2999, 5, 1700, 0, 2999)]
    spec = msgpack.unpackb(msgpack.packb(ours.to_spec()))
    assert opt_mod.create_scheduler(spec) == ours


def test_scheduler_validation():
    with pytest.raises(ConfigError, match='warmup_mode'):
        FactorScheduler(step=1, warmup_mode='cubic')
    with pytest.raises(ConfigError, match='increasing'):
        MultiFactorScheduler(step=[5, 3])
    with pytest.raises(ConfigError, match='max_update'):
        CosineScheduler(max_update=5, warmup_steps=5)
    with pytest.raises(ConfigError, match='lr_scheduler must be'):
        create('sgd', lr_scheduler=42)


hypothesis = pytest.importorskip('hypothesis')
st = hypothesis.strategies
_unit = st.floats(0.0, 1.0)
_keys = st.one_of(st.integers(-2**40, 2**40), st.text(max_size=8))


@hypothesis.settings(max_examples=60, deadline=None)
@hypothesis.given(name=st.sampled_from(['sgd', 'adam', 'rmsprop', 'lamb']), lr=st.floats(0, 10),
                  wd=st.floats(0, 1), clip=st.one_of(st.none(), st.floats(-1, 10)), b=_unit,
                  flag=st.booleans(), mults=st.dictionaries(_keys, st.floats(0, 10), max_size=4))
def test_any_valid_spec_round_trips(name, lr, wd, clip, b, flag, mults):
    hyper = {'sgd': dict(momentum=b, nesterov=flag), 'adam': dict(beta1=b, lazy_update=flag),
             'rmsprop': dict(rho=b, centered=flag), 'lamb': dict(beta2=b, bias_correction=flag)}
    opt = create(name, learning_rate=lr, wd=wd, clip_gradient=clip, **hyper[name])
    opt.set_lr_mult(mults)
    back = Optimizer.from_spec(msgpack.unpackb(msgpack.packb(opt.to_spec()),
                                               strict_map_key=False))
    assert back == opt and back.lr_mult == mults
    # each value itself, not only to_spec's view of it (which __eq__ compares)
    assert (back.lr, back.wd) == (lr, wd) and back.clip_gradient == (clip if clip and clip > 0
                                                                     else None)
    assert all(getattr(back, k) == v for k, v in hyper[name].items())
