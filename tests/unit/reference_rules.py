"""Float64 references of the rules numpy_more and cuda_more run, written from MXNet's documented
rules (the docstrings and Python of MXNet 1.9's optimizer.py, MXNet 2's adabelief.py and
lans.py), each as plainly as it reads there, not in the kernels' order of operations.

Kernel level: ``ref_<rule>(w, g, st, lr, wd, rescale, clip, t, **kernel hyper-parameters)``
returns the new weight and states (test_kernels' convention); ``clip`` None is off.
"""

import math

import numpy as np
from optimizer_configs import BY_ID

from kvps.optimizer import FactorScheduler, create
from kvps.optimizer.kernels import noise


def rescaled(g, rescale, clip, wd=0.0, w=0.0, clip_last=False):
    """MXNet's gradient preprocessing: clip(rescale*g) + wd*w, or (clip_last: adamax, nadam,
    ftml, adabelief) clip(rescale*g + wd*w)."""
    if clip_last:
        g = g * rescale + wd * w
        return np.clip(g, -clip, clip) if clip is not None else g
    g = g * rescale
    g = np.clip(g, -clip, clip) if clip is not None else g
    return g + wd * w


def ref_adadelta(w, g, st, lr, wd, rescale, clip, t, rho=0.9, epsilon=1e-5):
    g = rescaled(g, rescale, clip)
    acc_g = rho * st['acc_g'] + (1. - rho) * g * g
    delta = np.sqrt(st['acc_delta'] + epsilon) / np.sqrt(acc_g + epsilon) * g
    acc_delta = rho * st['acc_delta'] + (1. - rho) * delta * delta
    return w - (delta + wd * w), {'acc_g': acc_g, 'acc_delta': acc_delta}


def ref_adamax(w, g, st, lr, wd, rescale, clip, t, beta1=0.9, beta2=0.999):
    g = rescaled(g, rescale, clip, wd, w, clip_last=True)
    m = beta1 * st['mean'] + (1. - beta1) * g
    u = np.maximum(beta2 * st['u'], np.abs(g))
    return w - lr / (1. - beta1 ** t) * m / u, {'mean': m, 'u': u}


def momentum_schedule(beta1, schedule_decay, t):
    """Nadam's mu_t and the product mu_1 ... mu_t, computed afresh."""
    mus = [beta1 * (1. - 0.5 * 0.96 ** (i * schedule_decay)) for i in range(1, t + 2)]
    return mus[t - 1], mus[t], math.prod(mus[:t])


def ref_nadam(w, g, st, lr, wd, rescale, clip, t, beta1=0.9, beta2=0.999, epsilon=1e-8,
              schedule_decay=0.004):
    g = rescaled(g, rescale, clip, wd, w, clip_last=True)
    mu_t, mu_next, product = momentum_schedule(beta1, schedule_decay, t)
    m = beta1 * st['mean'] + (1. - beta1) * g
    v = beta2 * st['var'] + (1. - beta2) * g * g
    m_bar = (1. - mu_t) * g / (1. - product) + mu_next * m / (1. - product * mu_next)
    v_hat = v / (1. - beta2 ** t)
    return w - lr * m_bar / (np.sqrt(v_hat) + epsilon), {'mean': m, 'var': v}


def ref_ftml(w, g, st, lr, wd, rescale, clip, t, beta1=0.6, beta2=0.999, epsilon=1e-8):
    g = rescaled(g, rescale, clip, wd, w, clip_last=True)
    v = beta2 * st['v'] + (1. - beta2) * g * g
    d_t = (1. - beta1 ** t) / lr * (np.sqrt(v / (1. - beta2 ** t)) + epsilon)
    z = beta1 * st['z'] + (1. - beta1) * g - (d_t - beta1 * st['d']) * w
    return -z / d_t, {'d': d_t, 'v': v, 'z': z}


def sgd(w, g, st, lr, wd, rescale, clip, momentum):
    """MXNet SGD: state = momentum*state + lr*(rescale*clip(g) + wd*w); w -= state (sign as
    kvps keeps it: mom = -state)."""
    step = lr * rescaled(g, rescale, clip, wd, w)
    if momentum == 0:
        return w - step, st
    mom = momentum * st['mom'] - step
    return w + mom, dict(st, mom=mom)


def lars_factor(w, g, wd, rescale, eta, eps):
    """MXNet's layer-wise scale: eta*||w|| / (||g||*rescale + wd*||w|| + eps), 1 at a 0 norm."""
    wn, gn = np.linalg.norm(w), np.linalg.norm(g)
    return eta * wn / (gn * rescale + wd * wn + eps) if wn > 0 and gn > 0 else 1.0


def ref_lars(w, g, st, lr, wd, rescale, clip, t, momentum=0.0, eta=0.001, eps=0.0, lars=True):
    if lars:
        lr = lr * lars_factor(w, g, wd, rescale, eta, eps)
    return sgd(w, g, st, lr, wd, rescale, clip, momentum)


def ref_lbsgd(w, g, st, lr, wd, rescale, clip, t, momentum=0.0, lr_scale=1.0, batch_scale=1,
              apply=True, lars=False):
    if not apply:
        return w, dict(st, cum=st['cum'] + g)
    if batch_scale > 1:
        g, st = (st['cum'] + g) / batch_scale, dict(st, cum=np.zeros_like(g))
    if lars:
        w2, g2 = float(w @ w), float(g @ g)
        lr_scale = min(max(math.sqrt(w2 / (g2 + wd * w2 + 1e-18)), 0.01), 100.0)
    return sgd(w, g, st, lr * lr_scale, wd, rescale, clip, momentum)


def ref_sgld(w, g, st, lr, wd, rescale, clip, t, noise_hi=0, noise_lo=0):
    g = rescaled(g, rescale, clip)
    draw = noise.gaussian(noise_hi, noise_lo, 0, w.size)
    return w - lr / 2 * (g + wd * w) + math.sqrt(lr) * draw, st


def ref_dcasgd(w, g, st, lr, wd, rescale, clip, t, momentum=0.0, lamda=0.04):
    g = rescaled(g, rescale, clip)
    step = -lr * (g + wd * w + lamda * g * g * (w - st['prev']))
    mom = momentum * st['mom'] + step if momentum != 0 else step
    return w + mom, dict(st, prev=w, **({'mom': mom} if momentum != 0 else {}))


def ref_adabelief(w, g, st, lr, wd, rescale, clip, t, beta1=0.9, beta2=0.999, epsilon=1e-6,
                  correct_bias=True):
    g = rescaled(g, rescale, clip, wd, w, clip_last=True)
    m = beta1 * st['mean'] + (1. - beta1) * g
    s = beta2 * st['var'] + (1. - beta2) * (g - m) ** 2 + epsilon
    if correct_bias:
        lr = lr * math.sqrt(1. - beta2 ** t) / (1. - beta1 ** t)
    return w - lr * m / (np.sqrt(s) + epsilon), {'mean': m, 'var': s}


def trust(r1, direction):
    r2 = np.linalg.norm(direction)
    return r1 / r2 if r1 > 0 and r2 > 0 else 1.0


def ref_lans(w, g, st, lr, wd, rescale, clip, t, beta1=0.9, beta2=0.999, epsilon=1e-6,
             lower_bound=None, upper_bound=None):
    g = g * rescale
    g = g / np.linalg.norm(g)
    g = np.clip(g, -clip, clip) if clip is not None else g
    m = beta1 * st['mean'] + (1. - beta1) * g
    v = beta2 * st['var'] + (1. - beta2) * g * g
    den = np.sqrt(v / (1. - beta2 ** t)) + epsilon
    d_m = m / (1. - beta1 ** t) / den + wd * w
    d_g = g / den + wd * w
    r1 = np.linalg.norm(w)
    r1 = max(r1, lower_bound) if lower_bound else r1
    r1 = min(r1, upper_bound) if upper_bound else r1
    step = lr * beta1 * trust(r1, d_m) * d_m + lr * (1. - beta1) * trust(r1, d_g) * d_g
    return w - step, {'mean': m, 'var': v}


REFS = {name[4:]: fn for name, fn in globals().items() if name.startswith('ref_')}
# (rule, kernel states in call order, kernel hyper-parameters): one or more cases a rule
CASES = [
    ('adadelta', ['acc_g', 'acc_delta'], dict(rho=0.9, epsilon=1e-5)),
    ('adamax', ['mean', 'u'], dict(beta1=0.9, beta2=0.99)),
    ('nadam', ['mean', 'var'], dict(beta1=0.9, beta2=0.99, epsilon=1e-8, schedule_decay=0.004)),
    ('ftml', ['d', 'v', 'z'], dict(beta1=0.6, beta2=0.999, epsilon=1e-8)),
    ('lars', ['mom'], dict(momentum=0.9, eta=0.01, eps=1e-6)),
    ('lars', ['mom'], dict(momentum=0.0, lars=False)),
    ('lbsgd', ['mom', 'cum'], dict(momentum=0.9, batch_scale=1, lr_scale=1.5)),
    ('lbsgd', ['mom', 'cum'], dict(lars=True)),
    ('sgld', [], dict(noise_hi=12345, noise_lo=678)),
    ('dcasgd', ['mom', 'prev'], dict(momentum=0.9, lamda=0.04)),
    ('dcasgd', ['mom', 'prev'], dict(lamda=0.1)),
    ('adabelief', ['mean', 'var'], dict(beta1=0.9, beta2=0.99, epsilon=1e-6)),
    ('adabelief', ['mean', 'var'], dict(correct_bias=False, epsilon=1e-3)),
    ('lans', ['mean', 'var'], dict(beta1=0.9, beta2=0.999, epsilon=1e-6)),
    ('lans', ['mean', 'var'], dict(lower_bound=0.5, upper_bound=3.0)),
]
NEEDS_T = {'adamax', 'nadam', 'ftml', 'adabelief', 'lans'}


def allocated(name, states, hyper):
    """The states the rule's optimizer allocates for these kernel hyper-parameters."""
    live = [s for s in states if s != 'mom' or hyper.get('momentum', 0.0) != 0.0]
    return [s for s in live if s != 'cum' or hyper.get('batch_scale', 1) > 1]


# -- optimizer level: MXNet's Optimizer.update loop over one key, in float64 --------------
STATES = {'adadelta': ['acc_g', 'acc_delta'], 'adamax': ['mean', 'u'], 'nadam': ['mean', 'var'],
          'ftml': ['d', 'v', 'z'], 'lars': ['mom'], 'lbsgd': ['mom', 'cum'], 'sgld': [],
          'dcasgd': ['mom', 'prev'], 'ccsgd': ['mom'], 'adabelief': ['mean', 'var'],
          'lans': ['mean', 'var']}
_KERNEL_HYPER = {'adadelta': ('rho', 'epsilon'), 'adamax': ('beta1', 'beta2'),
                 'nadam': ('beta1', 'beta2', 'epsilon', 'schedule_decay'),
                 'ftml': ('beta1', 'beta2', 'epsilon'), 'dcasgd': ('momentum', 'lamda'),
                 'adabelief': ('beta1', 'beta2', 'epsilon', 'correct_bias'),
                 'lans': ('beta1', 'beta2', 'epsilon', 'lower_bound', 'upper_bound')}


class Reference:
    """One key's updates as MXNet's Python optimizer makes them: ``params`` are the
    optimizer's (kvps.optimizer.create's), ``lr_at(n)`` the scheduled lr at update n."""

    def __init__(self, name, params, lr_at, key=0):
        self.name, self.key, self.lr_at = name, key, lr_at
        self.p = dict(params)
        self.count = self.p.pop('begin_num_update', 0)
        self.rescale = self.p.pop('rescale_grad', 1.0)
        clip = self.p.pop('clip_gradient', None)
        self.clip = clip if clip and clip > 0 else None
        self.wd = self.p.pop('wd', 0.0)
        self.p.pop('learning_rate', None)
        self.cur_lr = self.last_lr = None   # LARS's
        self.cums = 0                       # LBSGD's

    def states(self, w):
        names = STATES[self.name]
        live = [s for s in names if s != 'mom' or self.p.get('momentum', 0.0) != 0.0]
        live = [s for s in live if s != 'cum' or self.p.get('batch_scale', 1) > 1]
        return {s: w.copy() if s == 'prev' else np.zeros_like(w) for s in live}

    def step(self, w, g, st):
        before = self.count
        self.count += 1
        lr = self.lr_at(before if self.name == 'lbsgd' else self.count)   # (LBSGD: MXNet's)
        rule = 'lars' if self.name == 'ccsgd' else self.name   # ccsgd: SGD, LARS's rule unscaled
        return REFS[rule](w, g, st, lr, self.wd, self.rescale, self.clip, self.count,
                          **self._kernel(lr))

    def _kernel(self, lr):
        """The kernel hyper-parameters of this update, as MXNet's Python works them out."""
        p = self.p
        if self.name in _KERNEL_HYPER:
            return {k: p[k] for k in _KERNEL_HYPER[self.name] if k in p}
        if self.name == 'ccsgd':
            return dict(momentum=p.get('momentum', 0.0), lars=False)
        if self.name == 'sgld':
            hi, lo = noise.stream(p.get('seed', 0), self.key, self.count)
            return dict(noise_hi=hi, noise_lo=lo)
        if self.name == 'lars':
            return self._lars(lr)
        return self._lbsgd()

    def _lars(self, lr):
        if self.cur_lr is not None:
            self.last_lr = self.cur_lr
        if self.cur_lr is None:
            self.last_lr = lr
        self.cur_lr = lr
        momentum = self.p.get('momentum', 0.0)
        if momentum > 0 and self.p.get('momentum_correction', True) and self.last_lr != 0:
            momentum = momentum * (self.cur_lr / self.last_lr)
        named = isinstance(self.key, str) and self.key.endswith(('gamma', 'beta', 'bias'))
        return dict(momentum=momentum, eta=self.p.get('eta', 0.001), eps=self.p.get('eps', 0),
                    lars=not named)

    def _lbsgd(self):
        p = self.p
        scale, strategy = p.get('batch_scale', 1), p.get('warmup_strategy', 'linear')
        self.cums = self.cums + 1 if self.cums else \
            p.get('begin_epoch', 0) * p.get('updates_per_epoch', 32) + 1
        nup, nwup = self.cums, p.get('warmup_epochs', 5) * p.get('updates_per_epoch', 32)
        if nup >= nwup:
            mult = float(scale)
        elif nwup <= 1 or strategy not in ('linear', 'power2', 'sqrt'):
            mult = 1.0
        else:
            frac = {'linear': nup / nwup, 'power2': (nup / nwup) ** 2,
                    'sqrt': math.sqrt(nup / nwup)}[strategy]
            mult = 1.0 + (scale - 1) * frac
        return dict(momentum=p.get('momentum', 0.0), batch_scale=scale,
                    apply=nup % scale == 0, lars=strategy == 'lars', lr_scale=mult)


def make(config_id, **more):
    """kvps's optimizer of an optimizer_configs run."""
    _, name, params, sched, _ = BY_ID[config_id]
    if sched:
        more['lr_scheduler'] = FactorScheduler(step=sched[0], factor=sched[1])
    return create(name, **params, **more)


def reference_run(name, params, w0, grads, lr_at, key=0):
    """The weights after MXNet's rule (float64) ran over ``grads`` from ``w0``."""
    ref = Reference(name, params, lr_at, key)
    w = np.asarray(w0, np.float64)
    st = ref.states(w)
    for g in grads:
        w, st = ref.step(w, np.asarray(g, np.float64), st)
    return w
