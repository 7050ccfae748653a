"""Learning-rate schedulers as plain data (MXNet's names), evaluated by update count."""

import math

from ..errors import ConfigError
from .hyper import check_params

__all__ = ['LRScheduler', 'FactorScheduler', 'MultiFactorScheduler', 'CosineScheduler',
           'PolyScheduler', 'create_scheduler']

_WARMUP = {'base_lr': ('float', 0.01), 'warmup_steps': ('int', 0),
           'warmup_begin_lr': ('float', 0.0), 'warmup_mode': ('str', 'linear')}
_SCHEDULERS = {}


class LRScheduler:
    """Learning rate as a pure function of the update count, with MXNet's warm-up.

    MXNet's schedulers mutate themselves as num_update grows; these compute the same values,
    to the last bit (the same operations in the same order), without depending on earlier
    calls, so they survive a checkpoint or a trip over the wire unchanged. Warm-up ramps to
    base_lr (MXNet ramps to the base_lr given at construction, which differs only when an
    optimizer's learning_rate later overrides it).
    """
    name = None
    fields = {}

    def __init__(self, **params):
        table = dict(_WARMUP, **self.fields)
        # a required field left at its None default is reported as missing, not mistyped
        params = {k: v for k, v in params.items() if v is not None or k not in table}
        for name, value in check_params(type(self).__name__, table, {}, params).items():
            setattr(self, name, value)
        if self.warmup_mode not in ('linear', 'constant'):
            raise ConfigError(f"{type(self).__name__}: warmup_mode must be 'linear' or "
                              f"'constant', got {self.warmup_mode!r}")
        if self.warmup_steps < 0:
            raise ConfigError(f'{type(self).__name__}: warmup_steps must be >= 0')

    def __call__(self, num_update):
        if num_update < self.warmup_steps:
            if self.warmup_mode == 'constant':
                return self.warmup_begin_lr
            span = self.base_lr - self.warmup_begin_lr
            return self.warmup_begin_lr + span * float(num_update) / float(self.warmup_steps)
        return self._decayed(num_update)

    def _decayed(self, num_update):
        raise NotImplementedError

    def to_spec(self):
        names = list(_WARMUP) + list(self.fields)
        return {'name': self.name, 'params': {n: getattr(self, n) for n in names}}

    def __eq__(self, other):
        return type(other) is type(self) and other.to_spec() == self.to_spec()

    def __repr__(self):
        return f'{type(self).__name__}({self.to_spec()["params"]})'


def _register_scheduler(cls):
    _SCHEDULERS[cls.name] = cls
    return cls


@_register_scheduler
class FactorScheduler(LRScheduler):
    """lr = base_lr times factor once per step updates, never below stop_factor_lr once decayed.

    MXNet multiplies by ``factor`` at each decay (``factor ** k`` would differ in the last bit
    from the 4th decay on); the product so far is remembered, so counting on from the last
    call costs one multiplication per decay, as MXNet's does."""
    name = 'factor'
    fields = {'step': ('int', None), 'factor': ('float', 1.0), 'stop_factor_lr': ('float', 1e-8)}

    def __init__(self, step=None, factor=1.0, stop_factor_lr=1e-8, **params):
        super().__init__(step=step, factor=factor, stop_factor_lr=stop_factor_lr, **params)
        if self.step < 1 or self.factor > 1.0:
            raise ConfigError('FactorScheduler: needs step >= 1 and factor <= 1')
        self._decays = (0, self.base_lr, self.base_lr)   # (decays, lr after them, for base_lr)

    def _decayed(self, num_update):
        wanted = max(0, (num_update - 1) // self.step)  # MXNet: decay when n > count + step
        done, lr, base = self._decays
        if wanted < done or base != self.base_lr:   # an earlier count, or a new base_lr
            done, lr = 0, self.base_lr
        for _ in range(wanted - done):
            lr *= self.factor
            if lr < self.stop_factor_lr:
                lr = self.stop_factor_lr
        self._decays = (wanted, lr, self.base_lr)
        return lr


@_register_scheduler
class MultiFactorScheduler(LRScheduler):
    """lr = base_lr * factor ** (number of steps s with n > s)."""
    name = 'multifactor'
    fields = {'step': ('ints', None), 'factor': ('float', 1.0)}

    def __init__(self, step=None, factor=1.0, **params):
        super().__init__(step=step, factor=factor, **params)
        ok = all(b > a for a, b in zip(self.step, self.step[1:])) and self.step[0] >= 1 \
            if self.step else False
        if not ok or self.factor > 1.0:
            raise ConfigError('MultiFactorScheduler: step must be a non-empty increasing list '
                              'of integers >= 1 and factor <= 1')

    def _decayed(self, num_update):
        lr = self.base_lr
        for boundary in self.step:
            if num_update > boundary:
                lr *= self.factor  # repeated products, exactly as MXNet accumulates them
        return lr


class _AnnealScheduler(LRScheduler):
    """Shared shape of cosine and poly: anneal base_lr -> final_lr over max_update."""

    def __init__(self, max_update=None, **params):
        super().__init__(max_update=max_update, **params)
        if self.max_update < 1 or self.max_update <= self.warmup_steps:
            raise ConfigError(f'{type(self).__name__}: max_update must be >= 1 and exceed '
                              'warmup_steps')

    def _decayed(self, num_update):
        if num_update > self.max_update:   # (MXNet keeps the value at max_update: final_lr)
            return self.final_lr
        return self._annealed(num_update - self.warmup_steps, self.max_update - self.warmup_steps)


@_register_scheduler
class CosineScheduler(_AnnealScheduler):
    """lr = final + (base - final) * (1 + cos(pi * n / max_steps)) / 2 after warm-up."""
    name = 'cosine'
    fields = {'max_update': ('int', None), 'final_lr': ('float', 0.0)}

    def _annealed(self, n, max_steps):
        return self.final_lr + (self.base_lr - self.final_lr) * \
            (1 + math.cos(math.pi * n / max_steps)) / 2   # (MXNet's order of operations)


@_register_scheduler
class PolyScheduler(_AnnealScheduler):
    """lr = final + (base - final) * (1 - n / max_steps) ** pwr after warm-up."""
    name = 'poly'
    fields = {'max_update': ('int', None), 'pwr': ('float', 2.0), 'final_lr': ('float', 0.0)}

    def _annealed(self, n, max_steps):
        return self.final_lr + (self.base_lr - self.final_lr) * \
            pow(1 - float(n) / float(max_steps), self.pwr)   # (MXNet's order of operations)


def create_scheduler(spec):
    """Build a scheduler from its spec dict (or return a scheduler object unchanged)."""
    if spec is None or isinstance(spec, LRScheduler):
        return spec
    if not isinstance(spec, dict) or not isinstance(spec.get('name'), str):
        raise ConfigError(f'lr_scheduler must be an LRScheduler or a spec dict with a name, '
                          f'got {spec!r}')
    key = spec['name'].lower().replace('scheduler', '') or '?'
    if key not in _SCHEDULERS:
        raise ConfigError(f'unknown lr_scheduler {spec["name"]!r}; known: '
                          f'{", ".join(sorted(_SCHEDULERS))}')
    params = spec.get('params', {})
    if not isinstance(params, dict):
        raise ConfigError('lr_scheduler spec: params must be a dict')
    return _SCHEDULERS[key](**params)
