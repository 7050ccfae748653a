"""Optimizers as plain, msgpack-able data, registered by MXNet name (schedulers: lr_scheduler)."""

import warnings

from ..errors import ConfigError
from . import python_rules
from .hyper import check_params, coerce
from .lr_scheduler import (CosineScheduler, FactorScheduler, LRScheduler, MultiFactorScheduler,
                           PolyScheduler, create_scheduler)

__all__ = [
    'Optimizer', 'SGD', 'NAG', 'Adam', 'AdamW', 'AdaGrad', 'RMSProp', 'LAMB', 'Ftrl', 'Signum',
    'Test', 'create', 'register', 'registered', 'LRScheduler', 'FactorScheduler',
    'MultiFactorScheduler', 'CosineScheduler', 'PolyScheduler', 'create_scheduler',
]

# --------------------------------------------------------------------------- optimizers

_REGISTRY = {}
_BASE = {'learning_rate': ('float?', None), 'wd': ('float', 0.0),
         'rescale_grad': ('float', 1.0), 'clip_gradient': ('float?', None),
         'multi_precision': ('bool', False), 'begin_num_update': ('int', 0)}


def register(cls):
    """Class decorator: make an Optimizer subclass creatable by its (case-insensitive) name.
    The class is checked first (its ``hyper`` table, its ``__init__``, a kernel or an update of
    its own): ConfigError or TypeError naming what is wrong."""
    python_rules.check_class(cls, Optimizer, _BASE)
    key = (cls.name or cls.__name__).lower()
    if key in _REGISTRY and _REGISTRY[key] is not cls:
        warnings.warn(f'optimizer {key!r} re-registered: {cls.__name__} replaces '
                      f'{_REGISTRY[key].__name__}', stacklevel=2)
    cls.name = key
    _REGISTRY[key] = cls
    return cls


def registered():
    """The sorted registry names."""
    return sorted(_REGISTRY)


def create(name, **params):
    """Create an optimizer by registry name (case-insensitive)."""
    if not isinstance(name, str) or name.lower() not in _REGISTRY:
        raise ConfigError(python_rules.unknown_message(name, registered()))
    return _REGISTRY[name.lower()](**params)


def registered_class(spec):
    """The class registered here under the name a spec gives, or None (unknown here: a
    plugin's that only servers import, say)."""
    name = spec.get('name') if isinstance(spec, dict) else None
    return _REGISTRY.get(name.lower()) if isinstance(name, str) else None


def _mult_table(mults, what):
    """Validate a key -> multiplier table; accepts a dict or msgpack-friendly [key, value] pairs."""
    pairs = mults.items() if isinstance(mults, dict) else mults
    out = {}
    try:
        for key, value in pairs:
            if isinstance(key, bool) or not isinstance(key, (int, str)):
                raise ConfigError(f'{what}: keys must be int or str, got {key!r}')
            out[key] = coerce('float', f'{what}[{key!r}]', value, 'Optimizer')
    except (TypeError, ValueError) as exc:
        if isinstance(exc, ConfigError):
            raise
        raise ConfigError(f'{what} must be a dict of key -> float, got {mults!r}') from None
    return out


class Optimizer:
    """Base of all optimizers: the hyper-parameters, the lr/wd schedule and the kernel to run.

    An optimizer is data: `to_spec()` gives a msgpack-able dict and `from_spec` rebuilds an
    identical object after validating every name and type, so a server never runs code a
    peer sent. Subclasses declare `hyper` (name -> (kind, default)), `aliases` (MXNet 1.x
    spellings), `kernel` (function name in kvps.optimizer.kernels), `kernel_params` (hyper-parameters
    the kernel takes), `needs_count` (kernel takes the per-key update count as `t`) and
    `fp32_states` (float32 states for low-precision weights even without multi_precision)
    and `whole_tensor` (the update reads the whole weight, as LAMB's norms do: servers must
    not split it), `row_states` (states of one element per row of a 2-D key, not one per
    element: GroupAdaGrad's history). An optimizer of one's own may instead override MXNet's
    `create_state` and `update` (Python on numpy or cupy arrays, key by key; whole tensors
    unless it sets `whole_tensor = False`): see kvps.optimizer.python_rules and docs/plugins.md.
    """
    name = None
    default_lr = 0.01
    hyper = {}
    aliases = {}
    kernel = None
    kernel_params = ()
    kernel_states = ()
    needs_count = False
    fp32_states = False  # keep states fp32 for float16/bfloat16 weights even without a master
    whole_tensor = False
    row_states = ()   # states of one element per row of a 2-D key, not per element

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        python_rules.default_whole_tensor(cls, Optimizer)

    def __init__(self, learning_rate=None, wd=0.0, rescale_grad=1.0, clip_gradient=None,
                 lr_scheduler=None, multi_precision=False, begin_num_update=0, **hyper):
        owner = type(self).__name__
        base = check_params(owner, _BASE, {}, dict(
            learning_rate=learning_rate, wd=wd, rescale_grad=rescale_grad,
            clip_gradient=clip_gradient, multi_precision=multi_precision,
            begin_num_update=begin_num_update))
        params = check_params(owner, self.hyper, self.aliases, hyper,
                              also=(*_BASE, 'lr_scheduler'))
        for name, value in params.items():
            setattr(self, name, value)
        self.wd, self.rescale_grad = base['wd'], base['rescale_grad']
        self.multi_precision = base['multi_precision']
        self.begin_num_update = self.num_update = base['begin_num_update']
        clip = base['clip_gradient']
        self.clip_gradient = clip if clip is not None and clip > 0 else None  # <= 0 means off
        # A scheduler is copied so the caller's object is never mutated; an explicit
        # learning_rate overrides its base_lr (MXNet 2 rule), else the scheduler's base_lr rules.
        sched = create_scheduler(lr_scheduler)
        self.lr_scheduler = create_scheduler(sched.to_spec()) if sched is not None else None
        lr = base['learning_rate']
        if self.lr_scheduler is not None:
            if lr is not None:
                self.lr_scheduler.base_lr = lr
            lr = self.lr_scheduler.base_lr
        self.lr = self.default_lr if lr is None else lr
        self.lr_mult, self.wd_mult = {}, {}
        self._index_update_count = {}   # MXNet's: key -> its updates (see _update_count)
        self._validate()

    def _validate(self):
        """Range checks a subclass needs beyond types; raise ConfigError."""

    # -- learning rate and weight decay ----------------------------------------------------
    @property
    def learning_rate(self):
        """The current learning rate: the scheduler's value at num_update, else the base lr."""
        return self.lr_scheduler(self.num_update) if self.lr_scheduler else self.lr

    def set_learning_rate(self, lr):
        """Set the base lr; refused when a scheduler owns the learning rate (as MXNet)."""
        if self.lr_scheduler is not None:
            raise ConfigError('set_learning_rate: this optimizer has an lr_scheduler, which '
                              'owns the learning rate; change the scheduler instead')
        self.lr = coerce('float', 'learning_rate', lr, type(self).__name__)

    def set_lr_mult(self, mults):
        """Per-key learning-rate multipliers (Gluon lr_mult); replaces the previous table."""
        self.lr_mult = _mult_table(mults, 'lr_mult')

    def set_wd_mult(self, mults):
        """Per-key weight-decay multipliers (Gluon wd_mult); replaces the previous table."""
        self.wd_mult = _mult_table(mults, 'wd_mult')

    def get_lr(self, key, num_update):
        """The lr of `key` when the job-wide update count is num_update."""
        return self.base_lr(num_update) * self.lr_mult.get(key, 1.0)

    def base_lr(self, num_update):
        """The lr before any key's lr_mult, when the job-wide update count is num_update."""
        return self.lr_scheduler(num_update) if self.lr_scheduler else self.lr

    def get_wd(self, key):
        return self.wd * self.wd_mult.get(key, 1.0)

    # -- an update written in Python, as MXNet's are (kvps.optimizer.python_rules runs it) ---
    @property
    def runs_python(self):
        """Whether updates run this class's own ``update`` (else its ``kernel``)."""
        return type(self).update is not Optimizer.update

    def create_state(self, index, weight):
        """MXNet's: the state ``update`` gets for key ``index`` (None, an array of the weight's
        size, or a tuple or list of those), made at its first update from ``weight``."""

    def update(self, index, weight, grad, state):
        """MXNet's: change ``weight`` (and ``state``) in place by ``grad``. Override it, with
        create_state, to write an optimizer in Python; kvps's own name a ``kernel``."""
        raise NotImplementedError(f'{type(self).__name__} runs the kernel {self.kernel!r} '
                                  '(kvps.optimizer.updater.Updater), not a Python update')

    def _get_lr(self, index):   # MXNet's: the scheduler at num_update, times the lr_mult
        return self.get_lr(index, self.num_update)

    def _get_lrs(self, indices):
        return [self._get_lr(index) for index in indices]

    def _get_wd(self, index):   # MXNet's
        return self.get_wd(index)

    def _get_wds(self, indices):
        return [self.get_wd(index) for index in indices]

    def _update_count(self, index):
        """MXNet's count of an update. kvps counts each key's updates before ``update`` runs
        (``num_update`` and ``_index_update_count[index]`` include this one already): nothing
        to do here; kept so that MXNet's code runs unchanged."""

    # -- kernel interface --------------------------------------------------------------------
    def state_names(self):
        """Names of the per-key state arrays this configuration allocates (subset of
        kernel_states; the kernel gets None for the others)."""
        return self.kernel_states

    def kernel_args(self, count):
        """Hyper-parameters for the kernel call, given the key's update count."""
        args = {name: getattr(self, name) for name in self.kernel_params}
        if self.needs_count:
            args['t'] = count
        return args

    # -- plain data --------------------------------------------------------------------------
    def to_spec(self):
        """A msgpack-able dict that from_spec turns back into an identical optimizer.

        lr_mult/wd_mult are dicts keyed by the store's keys; int keys need
        msgpack.unpackb(..., strict_map_key=False) (from_spec also takes [key, value] pairs).
        """
        params = {'learning_rate': self.lr, 'wd': self.wd, 'rescale_grad': self.rescale_grad,
                  'clip_gradient': self.clip_gradient, 'multi_precision': self.multi_precision,
                  'begin_num_update': self.begin_num_update}
        params.update({name: getattr(self, name) for name in self.hyper})
        return {'name': self.name, 'params': params,
                'lr_scheduler': self.lr_scheduler.to_spec() if self.lr_scheduler else None,
                'lr_mult': dict(self.lr_mult), 'wd_mult': dict(self.wd_mult)}

    @classmethod
    def from_spec(cls, spec):
        """Validate a spec (names, types) and build the optimizer; errors are ConfigError."""
        if not isinstance(spec, dict):
            raise ConfigError(f'optimizer spec must be a dict, got {type(spec).__name__}')
        extra = set(spec) - {'name', 'params', 'lr_scheduler', 'lr_mult', 'wd_mult'}
        if extra:
            raise ConfigError(f'optimizer spec: unknown fields {sorted(extra, key=repr)}; '
                              'valid: name, params, lr_scheduler, lr_mult, wd_mult')
        params = spec.get('params') or {}
        if not isinstance(params, dict) or not all(isinstance(k, str) for k in params):
            raise ConfigError('optimizer spec: params must be a dict with str keys')
        if 'lr_scheduler' in params:
            raise ConfigError("optimizer spec: give lr_scheduler at top level, not in params")
        opt = create(spec.get('name'), lr_scheduler=spec.get('lr_scheduler'), **params)
        if cls is not Optimizer and not isinstance(opt, cls):
            raise ConfigError(f'spec names {spec.get("name")!r}, not a {cls.__name__}')
        opt.set_lr_mult(spec.get('lr_mult') or {})
        opt.set_wd_mult(spec.get('wd_mult') or {})
        return opt

    def __eq__(self, other):
        return isinstance(other, Optimizer) and other.to_spec() == self.to_spec()

    def __repr__(self):
        return f'{type(self).__name__}({self.to_spec()["params"]})'


Optimizer.register = staticmethod(register)   # MXNet's spelling: @Optimizer.register


def _unit_interval(opt, *names):
    for name in names:
        value = getattr(opt, name)
        if not 0.0 <= value <= 1.0:
            raise ConfigError(f'{type(opt).__name__}: {name} must be in [0, 1], got {value}')


class _MomentumState:
    """Optimizers whose only state is a momentum buffer, kept only when momentum is on."""

    def _validate(self):
        _unit_interval(self, 'momentum')

    def state_names(self):
        return ('mom',) if self.momentum != 0.0 else ()


@register
class SGD(_MomentumState, Optimizer):
    """mom = momentum*mom - lr*g; w += mom, with g = clip(rescale*grad) + wd*w (MXNet).
    nesterov=True gives NAG's rule; lazy_update (as MXNet's): pushed rows (kvps.RowSparse)
    update only those rows and their momentum, and wd reaches a row only with a gradient."""
    name = 'sgd'
    hyper = {'momentum': ('float', 0.0), 'lazy_update': ('bool', True),
             'nesterov': ('bool', False)}
    kernel, kernel_params, kernel_states = 'sgd_update', ('momentum', 'nesterov'), ('mom',)


@register
class NAG(SGD):
    """Nesterov: mom = momentum*mom + g; w -= lr*(g + momentum*mom) (MXNet NAG, torch nesterov)."""
    name = 'nag'
    hyper = {'momentum': ('float', 0.0)}
    kernel, kernel_params = 'nag_update', ('momentum',)


@register
class Adam(Optimizer):
    """MXNet Adam: g = clip(rescale*grad) + wd*w; m, v moving averages of g and g^2;
    w -= lr*sqrt(1-b2^t)/(1-b1^t) * m/(sqrt(v)+eps) (epsilon not bias-corrected, unlike torch).
    lazy_update as SGD's (t counts the key's updates, as in MXNet's lazy Adam)."""
    name = 'adam'
    default_lr = 0.001
    hyper = {'beta1': ('float', 0.9), 'beta2': ('float', 0.999), 'epsilon': ('float', 1e-8),
             'lazy_update': ('bool', True)}
    kernel, kernel_states = 'adam_update', ('mean', 'var')
    kernel_params, needs_count = ('beta1', 'beta2', 'epsilon'), True

    def _validate(self):
        _unit_interval(self, 'beta1', 'beta2')


@register
class AdamW(Adam):
    """Decoupled weight decay, exactly torch.optim.AdamW:
    g = clip(rescale*grad); m, v as Adam;
    w = w*(1 - lr*wd) - lr/(1-b1^t) * m/(sqrt(v)/sqrt(1-b2^t) + eps).
    (MXNet's contrib adamw_update has no bias correction and scales wd by eta; kvps follows
    torch.)"""
    name = 'adamw'
    hyper = {'beta1': ('float', 0.9), 'beta2': ('float', 0.999), 'epsilon': ('float', 1e-8)}
    kernel = 'adamw_update'


@register
class AdaGrad(Optimizer):
    """MXNet 2 AdaGrad (= torch Adagrad): g += wd*w; h += g^2; w -= lr*g/(sqrt(h)+epsilon)."""
    name = 'adagrad'
    hyper = {'epsilon': ('float', 1e-6)}
    aliases = {'eps': 'epsilon'}
    kernel, kernel_params, kernel_states = 'adagrad_update', ('epsilon',), ('history',)


@register
class RMSProp(Optimizer):
    """Tieleman-Hinton (w -= lr*g/(sqrt(var)+eps)) or, centered, Graves with momentum
    (mom = momentum*mom - lr*g/sqrt(max(var - mean^2, 0) + eps); w += mom: the max keeps a
    steady gradient's rounding from NaN weights); MXNet 2 names rho and momentum, MXNet 1
    names gamma1 and gamma2 accepted."""
    name = 'rmsprop'
    default_lr = 0.001
    hyper = {'rho': ('float', 0.9), 'momentum': ('float', 0.9), 'epsilon': ('float', 1e-8),
             'centered': ('bool', False), 'clip_weights': ('float?', None)}
    aliases = {'gamma1': 'rho', 'gamma2': 'momentum'}
    kernel, kernel_states = 'rmsprop_update', ('var', 'mean', 'mom')
    kernel_params = ('rho', 'momentum', 'epsilon', 'centered', 'clip_weights')

    def _validate(self):
        _unit_interval(self, 'rho', 'momentum')
        if self.clip_weights is not None and self.clip_weights <= 0:
            self.clip_weights = None  # MXNet tests truthiness: 0 means off

    def state_names(self):
        return ('var', 'mean', 'mom') if self.centered else ('var',)


@register
class LAMB(Optimizer):
    """LAMB (MXNet): Adam direction d (+ wd*w) scaled by trust ratio ||w||/||d|| (bounded)."""
    name = 'lamb'
    default_lr = 0.001
    hyper = {'beta1': ('float', 0.9), 'beta2': ('float', 0.999), 'epsilon': ('float', 1e-6),
             'lower_bound': ('float?', None), 'upper_bound': ('float?', None),
             'bias_correction': ('bool', True)}
    kernel, kernel_states, needs_count = 'lamb_update', ('mean', 'var'), True
    fp32_states = True  # as MXNet: LAMB's moments are always float32
    whole_tensor = True  # the trust ratio's norms are over the whole weight
    kernel_params = ('beta1', 'beta2', 'epsilon', 'lower_bound', 'upper_bound',
                     'bias_correction')

    def _validate(self):
        _unit_interval(self, 'beta1', 'beta2')


@register
class Ftrl(Optimizer):
    """FTRL-proximal (MXNet): z, n accumulators;
    w = -sign(z)*max(|z|-lamda1, 0) / ((beta+sqrt(n))/lr + wd)."""
    name = 'ftrl'
    default_lr = 0.1
    hyper = {'lamda1': ('float', 0.01), 'beta': ('float', 1.0)}
    kernel, kernel_params, kernel_states = 'ftrl_update', ('lamda1', 'beta'), ('z', 'n')


@register
class Signum(_MomentumState, Optimizer):
    """Signum (MXNet): mom = momentum*mom - (1-momentum)*g; w = (1-lr*wd_lh)*w + lr*sign(mom);
    momentum 0 is signSGD: w = (1-lr*(wd+wd_lh))*w - lr*sign(g)."""
    name = 'signum'
    hyper = {'momentum': ('float', 0.9), 'wd_lh': ('float', 0.0)}
    kernel, kernel_params, kernel_states = 'signum_update', ('momentum', 'wd_lh'), ('mom',)


@register
class Test(Optimizer):
    """MXNet's test optimizer: w += rescale_grad * grad (no lr, wd or clipping)."""
    name = 'test'
    kernel = 'test_update'
