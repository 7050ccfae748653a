"""Fused optimizer updates on cupy arrays: one CUDA kernel per update, numpy_kernels' API.

Each update loads weight (or its fp32 master), grad and the states once, does the whole rule
in registers and stores once, so it runs at memory bandwidth. The arithmetic mirrors the numpy
reference operation by operation (same order, same host-computed constants, no FMA
contraction: --fmad=false), so results agree bit for bit where the operations are IEEE
(+ - * / sqrt); LAMB's norms are reductions in a different order and agree to rounding.
Every rule (this module's, cuda_more's and cuda_rows') also takes its grad as a tuple of two
arrays of the compute dtype, a sync round's last pushes, which the kernel adds as it loads them
in every pass that reads the grad: the numpy kernels' sum of the tuple, so the same bits, and
no sum of its own written and read back.
Each rule here only says what it needs (cuda_launch.request: its C body and scalars);
cuda_launch plans, groups and launches, and `multi_update` runs many keys in one launch per
rule and dtypes. cupy is imported lazily: importing kvps never needs it.
"""

import numpy as np

from . import common, cuda_launch as launch, cuda_more, cuda_rows
from .common import kernel_scalars as _base, moment_scalars as _moment_scalars
from .cuda_source import MOMENTS, PREP, PREP_WD, sgd_step


def _launch(tag, core, weight, grad, states, weight32, scalars, then=None, wide=()):
    """One update: ``core`` (C) between the loads of the master weight (or weight), grad and
    live ``states`` [(local name, array or None)] and their stores; ``then``, later passes
    as (finish, body) pairs (see cuda_source); ``scalars`` as ``s_<name>``, double for the
    names in ``wide``."""
    launch.request(tag, core, then, weight, grad, states, weight32, scalars, wide)


def sgd_update(weight, grad, mom, lr, wd, rescale_grad, clip_gradient, momentum=0.0,
               nesterov=False, weight32=None):
    """MXNet SGD (mom is None when momentum is 0); nesterov=True is NAG."""
    if mom is None:
        core, tag = PREP_WD + sgd_step(False), 'sgd'
    elif nesterov:
        core, tag = PREP_WD + (' mom = s_momentum * mom + g;'
                               ' w = w - s_lr * (g + s_momentum * mom);'), 'nag_mom'
    else:
        core, tag = PREP_WD + sgd_step(True), 'sgd_mom'
    _launch(tag, core, weight, grad, [('mom', mom)], weight32,
            _base(lr, wd, rescale_grad, clip_gradient, momentum=momentum))


def nag_update(weight, grad, mom, lr, wd, rescale_grad, clip_gradient, momentum=0.0,
               weight32=None):
    """MXNet NAG: mom = m*mom + g; w -= lr*(g + m*mom)."""
    sgd_update(weight, grad, mom, lr, wd, rescale_grad, clip_gradient, momentum, True, weight32)


def adam_update(weight, grad, mean, var, lr, wd, rescale_grad, clip_gradient, beta1=0.9,
                beta2=0.999, epsilon=1e-8, t=1, weight32=None):
    """MXNet Adam: w -= lr*sqrt(1-b2^t)/(1-b1^t) * mean/(sqrt(var)+eps)."""
    core = PREP_WD + MOMENTS + ' w = w - s_step * (mean / (sqrt(var) + s_epsilon));'
    sc = _base(lr, wd, rescale_grad, clip_gradient, step=common.adam_lr(lr, beta1, beta2, t),
               **_moment_scalars(beta1, beta2, epsilon))
    _launch('adam', core, weight, grad, [('mean', mean), ('var', var)], weight32, sc)


def adamw_update(weight, grad, mean, var, lr, wd, rescale_grad, clip_gradient, beta1=0.9,
                 beta2=0.999, epsilon=1e-8, t=1, weight32=None):
    """torch AdamW: w = w*(1-lr*wd) - lr/(1-b1^t) * mean/(sqrt(var)/sqrt(1-b2^t) + eps)."""
    decay, step, bc2sqrt = common.adamw_coeffs(lr, wd, beta1, beta2, t)
    core = PREP + MOMENTS + (' w = s_decay * w - s_step * (mean / (sqrt(var) / s_bc2sqrt'
                             ' + s_epsilon));')
    sc = _base(lr, wd, rescale_grad, clip_gradient, decay=decay, step=step, bc2sqrt=bc2sqrt,
               **_moment_scalars(beta1, beta2, epsilon))
    _launch('adamw', core, weight, grad, [('mean', mean), ('var', var)], weight32, sc)


def adagrad_update(weight, grad, history, lr, wd, rescale_grad, clip_gradient, epsilon=1e-6,
                   weight32=None):
    """AdaGrad: history += g*g; w -= lr*g/(sqrt(history)+eps)."""
    core = PREP_WD + (' hist = hist + g * g;'
                      ' w = w - s_lr * (g / (sqrt(hist) + s_epsilon));')
    _launch('adagrad', core, weight, grad, [('hist', history)], weight32,
            _base(lr, wd, rescale_grad, clip_gradient, epsilon=epsilon))


def rmsprop_update(weight, grad, var, mean, mom, lr, wd, rescale_grad, clip_gradient, rho=0.9,
                   momentum=0.9, epsilon=1e-8, centered=False, clip_weights=None,
                   weight32=None):
    """RMSProp; centered needs mean and mom, plain ignores them (pass None)."""
    if centered:
        core = PREP_WD + (' mean = s_rho * mean + s_omr * g;'
                          ' var = s_rho * var + s_omr * (g * g);'
                          ' KC spread = var - mean * mean; spread = spread < 0 ? (KC)0 : spread;'
                          ' mom = s_momentum * mom - s_lr * (g / sqrt(spread + s_epsilon));'
                          ' w = w + mom;')
        states, tag = [('var', var), ('mean', mean), ('mom', mom)], 'rmsprop_centered'
    else:
        core = PREP_WD + (' var = s_rho * var + s_omr * (g * g);'
                          ' w = w - s_lr * (g / (sqrt(var) + s_epsilon));')
        states, tag = [('var', var)], 'rmsprop'
    core += ' w = kv_clip<KC>(w, s_clip_weights);'
    sc = _base(lr, wd, rescale_grad, clip_gradient, rho=rho, omr=1 - rho, momentum=momentum,
               epsilon=epsilon, clip_weights=common.off_if_not_positive(clip_weights))
    _launch(tag, core, weight, grad, states, weight32, sc)


_LAMB_D = 'KC d = (mean / s_c1) / (sqrt(var / s_c2) + s_epsilon) + s_wd * w;'
_LAMB_NORMS = ' kv_norm[0] += (double)w * w; kv_norm[1] += (double)d * d;'
_LAMB_RATIO = 'kv_keep[0] = kv_trust_ratio(kv_s0, kv_s1, s_lower, s_upper);'


def lamb_update(weight, grad, mean, var, lr, wd, rescale_grad, clip_gradient, beta1=0.9,
                beta2=0.999, epsilon=1e-6, t=1, lower_bound=None, upper_bound=None,
                bias_correction=True, weight32=None):
    """LAMB in two passes: the first updates the moments and sums ||w||^2 and ||d||^2 in
    double, the key's last block forms the trust ratio on the device (no host
    synchronisation); the second recomputes d from the stored moments, as numpy_kernels
    does, and applies w -= lr*ratio*d. Keep mean and var float32 (see numpy_kernels)."""
    c1, c2 = common.lamb_coeffs(beta1, beta2, t, bias_correction)
    norms = f'{PREP} {MOMENTS} {_LAMB_D}{_LAMB_NORMS}'
    step = _LAMB_D + ' w = w - (KC)(s_lr * kv_r0) * d;'
    sc = _base(lr, wd, rescale_grad, clip_gradient, c1=c1, c2=c2,
               lower=common.off_if_not_positive(lower_bound),
               upper=common.off_if_not_positive(upper_bound),
               **_moment_scalars(beta1, beta2, epsilon))
    _launch('lamb', norms, weight, grad, [('mean', mean), ('var', var)], weight32, sc,
            then=((_LAMB_RATIO, step),), wide=('lr', 'lower', 'upper'))


def ftrl_update(weight, grad, z, n, lr, wd, rescale_grad, clip_gradient, lamda1=0.01, beta=1.0,
                weight32=None):
    """FTRL-proximal (MXNet)."""
    core = PREP + ''' KC so = sqrt(nsq); nsq = nsq + g * g; KC sn = sqrt(nsq);
z = z + (g - ((sn - so) / s_lr) * w);
KC den = (sn + s_beta) / s_lr + s_wd;
KC a = fabs(z) - s_lamda1; a = a < 0 ? (KC)0 : a;
w = -((kv_sign<KC>(z) * a) / den);'''
    _launch('ftrl', core, weight, grad, [('z', z), ('nsq', n)], weight32,
            _base(lr, wd, rescale_grad, clip_gradient, lamda1=lamda1, beta=beta))


def signum_update(weight, grad, mom, lr, wd, rescale_grad, clip_gradient, momentum=0.9,
                  wd_lh=0.0, weight32=None):
    """Signum (mom given) or signSGD (mom None)."""
    if mom is None:
        core, tag = PREP + ' w = s_decay * w - s_lr * kv_sign<KC>(g);', 'signsgd'
    else:
        core, tag = PREP_WD + (' mom = s_momentum * mom - s_omm * g;'
                               ' w = s_decay * w + s_lr * kv_sign<KC>(mom);'), 'signum'
    decay = common.signum_decay(lr, wd, wd_lh, momentum if mom is not None else 0.0)
    _launch(tag, core, weight, grad, [('mom', mom)], weight32,
            _base(lr, wd, rescale_grad, clip_gradient, momentum=momentum, omm=1 - momentum,
                  decay=decay))


def test_update(weight, grad, lr, wd, rescale_grad, clip_gradient, weight32=None):
    """MXNet's test optimizer: w += rescale_grad * grad."""
    _launch('test', 'w = w + s_rescale * g;', weight, grad, [], weight32,
            {'rescale': rescale_grad})


test_update.__test__ = False  # not a pytest test, despite the name


# Placement helpers the updater uses to create and move state without knowing the device.
def zeros_like(array, dtype):
    cp = launch.cupy()
    with array.device:
        return cp.zeros(array.shape, dtype=dtype)


def widen(array):
    """A float32 copy of a float16 or bfloat16 (uint16) array: the master weight."""
    cp = launch.cupy()
    with array.device:
        if array.dtype == np.uint16:
            return (array.astype(cp.uint32) << 16).view(cp.float32)
        return array.astype(cp.float32)


def add_widened(a, b, out):
    """numpy_kernels.add_widened: a float32 sum of float32 or bfloat16 (uint16) arrays."""
    cp = launch.cupy()
    with out.device:
        return cp.add(*(x if x.dtype == np.float32 else widen(x) for x in (a, b)), out=out)


def narrow(src, out):
    """numpy_kernels.narrow: out = src cast to out's dtype, bfloat16 rounded to nearest even."""
    cp = launch.cupy()
    with out.device:
        if out.dtype == np.uint16:
            return common.f32_to_bf16(src, out, xp=cp)
        cp.copyto(out, src, casting='unsafe')
        return out


def to_host(array):
    return array.get()


def from_host(array, like):
    cp = launch.cupy()
    with like.device:
        return cp.asarray(array)


# cuda_more's and cuda_rows' rules join this module's rule table (multi_update looks them up
# here)
globals().update({name: getattr(module, name) for module in (cuda_more, cuda_rows)
                  for name in module.__all__})


def multi_update(calls, launches=None):
    """Many keys in few launches (multi-tensor apply). calls: [(fn_name, args, kwargs)], the
    arrays in args (weight, grad, *states) and weight32 in kwargs.

    Every call is planned and checked before anything is launched; then the keys whose plans
    share a kernel (rule, dtypes, device) run in one launch, whatever their sizes, on the
    current stream; a key met again waits for the launches before it (its updates keep
    their order). ``launches``: a dict the caller keeps from call to call (the Updater
    does), in which the prepared launches of its call lists are kept (cuda_launch.Round says
    when they stay valid); without it every call list is planned anew. A rule by rows
    (cuda_rows: a state per row) launches its own kernel per key, on the same stream."""
    by_rows = [call for call in calls if call[0] in cuda_rows.__all__]
    if not by_rows:
        launch.multi_update(calls, globals(), launches)
        return
    launch.multi_update([call for call in calls if call[0] not in cuda_rows.__all__],
                        globals(), launches)
    for name, args, kwargs in by_rows:   # (one optimizer's calls: never both kinds at once)
        globals()[name](*args, **kwargs)
