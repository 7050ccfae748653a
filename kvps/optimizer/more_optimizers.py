"""The optimizers MXNet registers beyond kvps's first ten, by MXNet's names and rules.

From MXNet 1.9: adadelta, adamax, nadam, ftml, lars, lbsgd, sgld, dcasgd, ccsgd (SGD's old
name) and groupadagrad (contrib); from MXNet 2 (1.9 has none of them): adabelief and lans.
Each takes MXNet's hyper-parameter names and defaults and runs its kernel (kernels.numpy_more
and cuda_more; GroupAdaGrad's, which keeps a state per row: numpy_rows and cuda_rows).
Where MXNet's Python keeps state outside the per-key arrays (a momentum schedule shared by all
keys, a last learning rate), kvps keeps it per key, which gives what MXNet gives a model of one
parameter; each class says where it differs.
"""

import math

from ..errors import ConfigError
from .kernels import noise
from .optimizers import SGD, Optimizer, _MomentumState, _unit_interval, register

__all__ = ['AdaDelta', 'Adamax', 'Nadam', 'FTML', 'LARS', 'LBSGD', 'SGLD', 'DCASGD', 'ccSGD',
           'GroupAdaGrad', 'AdaBelief', 'LANS']


class _Betas:
    """Optimizers with decay rates beta1 and beta2, each in [0, 1]."""

    def _validate(self):
        _unit_interval(self, 'beta1', 'beta2')


@register
class AdaDelta(Optimizer):
    """MXNet 1.9 AdaDelta: g = clip(rescale*grad); acc_g = rho*acc_g + (1-rho)*g^2;
    delta = sqrt(acc_delta + eps) / sqrt(acc_g + eps) * g; acc_delta = rho*acc_delta +
    (1-rho)*delta^2; w -= delta + wd*w. No learning rate (MXNet 1.9 has none: a scheduler
    changes nothing), and wd decays the weight outside the adaptive step (torch puts it in the
    gradient). Its states are float32, as MXNet's."""
    name = 'adadelta'
    hyper = {'rho': ('float', 0.9), 'epsilon': ('float', 1e-5)}
    kernel, kernel_params, kernel_states = 'adadelta_update', ('rho', 'epsilon'), \
        ('acc_g', 'acc_delta')
    fp32_states = True

    def _validate(self):
        _unit_interval(self, 'rho')


@register
class Adamax(_Betas, Optimizer):
    """MXNet AdaMax: g = clip(rescale*grad + wd*w); m = beta1*m + (1-beta1)*g;
    u = max(beta2*u, |g|); w -= lr/(1-beta1^t) * m/u. No epsilon, as in MXNet: an element
    whose gradient has been exactly 0 from the first update on has u = 0 and becomes NaN
    (torch adds eps to |g|)."""
    name = 'adamax'
    default_lr = 0.002
    hyper = {'beta1': ('float', 0.9), 'beta2': ('float', 0.999)}
    kernel, kernel_params, kernel_states = 'adamax_update', ('beta1', 'beta2'), ('mean', 'u')
    needs_count = True


@register
class Nadam(_Betas, Optimizer):
    """MXNet Nadam: Adam with Nesterov momentum under the schedule
    mu_t = beta1*(1 - 0.5*0.96^(t*schedule_decay)), g = clip(rescale*grad + wd*w). MXNet keeps
    one product of the mu_t for all keys, multiplied at every key's update, so each key's
    step depends on how many keys a model has and in which order they come; kvps keeps the
    product per key, by the key's update count: what MXNet gives a model of one parameter,
    the same on any number of servers."""
    name = 'nadam'
    default_lr = 0.001
    hyper = {'beta1': ('float', 0.9), 'beta2': ('float', 0.999), 'epsilon': ('float', 1e-8),
             'schedule_decay': ('float', 0.004)}
    kernel, kernel_states, needs_count = 'nadam_update', ('mean', 'var'), True
    kernel_params = ('beta1', 'beta2', 'epsilon', 'schedule_decay')


@register
class FTML(_Betas, Optimizer):
    """MXNet FTML (Follow the Moving Leader): g = clip(rescale*grad + wd*w);
    v = beta2*v + (1-beta2)*g^2; d_t = (1-beta1^t)/lr * (sqrt(v/(1-beta2^t)) + eps);
    z = beta1*z + (1-beta1)*g - (d_t - beta1*d)*w; d = d_t; w = -z/d_t."""
    name = 'ftml'
    hyper = {'beta1': ('float', 0.6), 'beta2': ('float', 0.999), 'epsilon': ('float', 1e-8)}
    kernel, kernel_states, needs_count = 'ftml_update', ('d', 'v', 'z'), True
    kernel_params = ('beta1', 'beta2', 'epsilon')


_NOT_SCALED = ('gamma', 'beta', 'bias')   # MXNet's LARS leaves parameters so named alone


@register
class LARS(_MomentumState, Optimizer):
    """MXNet LARS: SGD (momentum, wd, clip) at lr * eta*||w|| / (||g||*rescale + wd*||w|| +
    eps), the norms over the whole weight (kept whole on one server, as LAMB's), 1 when
    either is 0. As in MXNet, a str key ending in 'gamma', 'beta' or 'bias' keeps the plain
    lr (int keys, as Gluon's, never do). momentum_correction scales momentum by the change of
    the scheduled lr since the previous update of the job (MXNet: since its previous call,
    of whichever key; the same for one key, or for every key of a sync round). lazy_update is
    accepted: rows pushed alone apply as the dense gradient they stand for (the norms read
    the whole weight)."""
    name = 'lars'
    hyper = {'momentum': ('float', 0.0), 'lazy_update': ('bool', True),
             'eta': ('float', 0.001), 'eps': ('float', 0.0),
             'momentum_correction': ('bool', True)}
    kernel, kernel_states, whole_tensor = 'lars_update', ('mom',), True

    def kernel_args(self, count):
        momentum = self.momentum
        now, before = self.num_update, self.num_update - 1
        if momentum > 0 and self.momentum_correction and before > self.begin_num_update:
            last = self.base_lr(before)
            if last != 0:
                momentum = self.momentum * (self.base_lr(now) / last)
        return {'momentum': momentum, 'eta': self.eta, 'eps': self.eps}

    def key_args(self, key, count):
        """Per key: whether its lr is scaled (MXNet skips gamma, beta and bias by name)."""
        return {'lars': not (isinstance(key, str) and key.endswith(_NOT_SCALED))}


_WARMUPS = ('linear', 'power2', 'sqrt', 'lars')


@register
class LBSGD(_MomentumState, Optimizer):
    """MXNet LBSGD (large-batch SGD): the gradients of batch_scale updates are summed and
    applied once, averaged, by SGD at lr times a warm-up multiplier ('linear', 'power2' or
    'sqrt' from 1 to batch_scale over warmup_epochs * updates_per_epoch updates, or 'lars':
    sqrt(|w|^2 / (|g|^2 + wd*|w|^2)) in [0.01, 100], whose norms keep keys whole); between,
    the weight stays. As in MXNet the lr is the scheduler's before this update's count, and
    num_epochs is accepted and unused. Unlike MXNet, an unknown warmup_strategy is refused
    (MXNet silently uses a multiplier of 1)."""
    name = 'lbsgd'
    hyper = {'momentum': ('float', 0.0), 'warmup_strategy': ('str', 'linear'),
             'warmup_epochs': ('int', 5), 'batch_scale': ('int', 1),
             'updates_per_epoch': ('int', 32), 'begin_epoch': ('int', 0),
             'num_epochs': ('int', 60)}
    kernel, kernel_states, whole_tensor = 'lbsgd_update', ('mom', 'cum'), True

    def _validate(self):
        super()._validate()
        if self.warmup_strategy not in _WARMUPS:
            raise ConfigError(f'LBSGD: warmup_strategy must be one of {", ".join(_WARMUPS)}, '
                              f'got {self.warmup_strategy!r}')
        for name in ('batch_scale', 'updates_per_epoch'):
            if getattr(self, name) < 1:
                raise ConfigError(f'LBSGD: {name} must be at least 1, got '
                                  f'{getattr(self, name)}')
        for name in ('warmup_epochs', 'begin_epoch'):
            if getattr(self, name) < 0:
                raise ConfigError(f'LBSGD: {name} must be at least 0, got '
                                  f'{getattr(self, name)}')

    def state_names(self):
        return super().state_names() + (('cum',) if self.batch_scale > 1 else ())

    def get_lr(self, key, num_update):
        # MXNet reads the lr before it counts the update
        return super().get_lr(key, max(num_update - 1, self.begin_num_update))

    def kernel_args(self, count):
        updates = self.begin_epoch * self.updates_per_epoch + count - self.begin_num_update
        return {'momentum': self.momentum, 'batch_scale': self.batch_scale,
                'apply': updates % self.batch_scale == 0,
                'lars': self.warmup_strategy == 'lars', 'lr_scale': self._warmup(updates)}

    def _warmup(self, updates):
        """MXNet's _get_lbmult, operation by operation."""
        warmup = self.warmup_epochs * self.updates_per_epoch
        most = float(self.batch_scale)
        if updates >= warmup:
            return most
        if warmup <= 1:
            return 1.0
        if self.warmup_strategy == 'linear':
            return 1.0 + (most - 1) * updates / warmup
        if self.warmup_strategy == 'power2':
            return 1.0 + (most - 1) * (updates * updates) / (warmup * warmup)
        if self.warmup_strategy == 'sqrt':
            return 1.0 + (most - 1) * math.sqrt(float(updates) / warmup)
        return 1.0   # 'lars': the kernel takes the multiplier from the norms


@register
class SGLD(Optimizer):
    """MXNet SGLD (stochastic gradient Langevin dynamics): g = clip(rescale*grad);
    w += -lr/2 * (g + wd*w) + N(0, sqrt(lr)). The noise of each element is drawn from seed
    (an int, kvps's own: MXNet draws from its global generator), the key and the key's
    update count (kernels.noise): a job is reproducible, and the same on a CPU and a GPU.
    Keys stay whole on one server, so an element's noise does not depend on the number of
    servers."""
    name = 'sgld'
    hyper = {'seed': ('int', 0)}
    kernel, whole_tensor = 'sgld_update', True

    def key_args(self, key, count):
        """Per key and update: the stream its noise is drawn from."""
        hi, lo = noise.stream(self.seed, key, count)
        return {'noise_hi': hi, 'noise_lo': lo}


@register
class DCASGD(Optimizer):
    """MXNet DCASGD (delay-compensated async SGD): g = clip(rescale*grad);
    mom = momentum*mom - lr*(g + wd*w + lamda*g^2*(w - prev)); prev = w; w += mom. prev is
    the weight before the last update, one per key as on MXNet's servers (not one per
    worker), made from the weight at the key's first update. MXNet 1.9 fails with momentum
    (it tests an array's truth); kvps runs the rule as written."""
    name = 'dcasgd'
    hyper = {'momentum': ('float', 0.0), 'lamda': ('float', 0.04)}
    kernel, kernel_params, kernel_states = 'dcasgd_update', ('momentum', 'lamda'), \
        ('mom', 'prev')
    state_from_weight = ('prev',)   # the Updater makes these from the weight, not zeros

    def _validate(self):
        _unit_interval(self, 'momentum')

    def state_names(self):
        return ('mom', 'prev') if self.momentum != 0.0 else ('prev',)


@register
class ccSGD(SGD):   # noqa: N801 (MXNet's name)
    """MXNet's deprecated name for SGD, kept by MXNet 1.9 for old scripts."""
    name = 'ccsgd'


@register
class GroupAdaGrad(Optimizer):
    """MXNet 1.9 contrib GroupAdaGrad: AdaGrad with one history per row of a 2-D weight,
    g = clip(rescale*grad); h += mean(g^2 over the row); w -= lr*g / sqrt(h + eps), as its
    fused (row_sparse) kernel computes it: the row's squares summed in order, then divided
    by the row's length. Pushed rows update only those rows and their history (MXNet's lazy
    update, the only one it has). Weight decay is refused, as in MXNet (an assert there, at
    the first update): ConfigError at creation. MXNet 1.9 names epsilon ``eps`` (MXNet 2
    ``epsilon``; both are taken). The history is float32 for float16/bfloat16 weights (MXNet
    makes it float32 and then fails the update of a float16 weight without
    multi_precision). Keys stay whole on one server (their rows are counted from the
    shape) and are never fused with others."""
    name = 'groupadagrad'
    hyper = {'epsilon': ('float', 1e-5)}
    aliases = {'eps': 'epsilon'}
    kernel, kernel_params, kernel_states = 'group_adagrad_update', ('epsilon',), ('history',)
    fp32_states = whole_tensor = True
    lazy_update = True     # (not a hyper-parameter: MXNet has no other way)
    row_states = ('history',)   # one element per row, not per element (see Updater)

    def _validate(self):
        if self.wd != 0.0:
            raise ConfigError(f'GroupAdaGrad does not support weight decay: wd must be 0, got '
                              f'{self.wd} (as in MXNet)')


@register
class AdaBelief(_Betas, Optimizer):
    """MXNet 2 AdaBelief (its fused kernel; MXNet 1.9 has none): g = clip(rescale*grad +
    wd*w); m = beta1*m + (1-beta1)*g; s = beta2*s + (1-beta2)*(g-m)^2 + eps;
    w -= lr*sqrt(1-beta2^t)/(1-beta1^t) * m/(sqrt(s) + eps) (correct_bias=False: lr)."""
    name = 'adabelief'
    default_lr = 0.001
    hyper = {'beta1': ('float', 0.9), 'beta2': ('float', 0.999), 'epsilon': ('float', 1e-6),
             'correct_bias': ('bool', True)}
    kernel, kernel_states, needs_count = 'adabelief_update', ('mean', 'var'), True
    kernel_params = ('beta1', 'beta2', 'epsilon', 'correct_bias')


@register
class LANS(_Betas, Optimizer):
    """MXNet 2 LANS (its fused multi_lans kernel; MXNet 1.9 has none): LAMB with Nesterov
    momentum on the gradient normalized by its norm, g = clip(rescale*grad/||rescale*grad||):
    w -= lr*beta1*r_m*(m' + wd*w) + lr*(1-beta1)*r_g*(g' + wd*w), m' and g' Adam's directions
    of the moments and of g, r_m and r_g trust ratios ||w|| / ||direction|| (||w|| bounded by
    lower_bound and upper_bound). Float32 states, weights kept whole, as LAMB."""
    name = 'lans'
    default_lr = 0.001
    hyper = {'beta1': ('float', 0.9), 'beta2': ('float', 0.999), 'epsilon': ('float', 1e-6),
             'lower_bound': ('float?', None), 'upper_bound': ('float?', None)}
    kernel, kernel_states, needs_count = 'lans_update', ('mean', 'var'), True
    kernel_params = ('beta1', 'beta2', 'epsilon', 'lower_bound', 'upper_bound')
    fp32_states = whole_tensor = True
