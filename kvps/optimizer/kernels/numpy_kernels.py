"""Fused optimizer updates on numpy arrays: each one cache-blocked pass, in place (the reference).

Contract of every `*_update(weight, grad, *states, lr, wd, rescale_grad, clip_gradient, ...,
weight32=None)`:
- weight and the states are updated in place; `grad` is scratch space and is clobbered (the
  server hands its merge buffer, which it no longer needs). Pass a copy to keep a gradient.
- arrays are C-contiguous and of one shape; arithmetic runs in float64 for float64 weights
  and float32 otherwise. float16 and bfloat16 (uint16 storage) arrays are widened block by
  block, updated, and rounded back (round to nearest even), so a low-precision weight, state
  or grad never needs a full-size temporary.
- with weight32 (the fp32 master copy of a float16/bfloat16 weight) the update runs on
  weight32 and weight receives its rounded cast.
- `grad` may also be a tuple of arrays of the compute dtype (a sync round's last pushes,
  read-only receive buffers): they are added in order block by block, in cache, and never
  written, so the server's sum costs no pass of its own.
Each runs as one pass of numpy_blocks (cache-blocked, split over threads for big keys); many
small keys at once run as packed passes of numpy_packing (multi_update).
"""

import numpy as np

from . import common, numpy_more, numpy_packing, numpy_rows
from .common import bf16_to_f32, f32_to_bf16, kernel_scalars as _base, moment_scalars
from .numpy_blocks import (BLOCK, adam_step, first_moment, prep as _prep, run, set_threads,
                           sgd_body, store)

__all__ = ['sgd_update', 'nag_update', 'adam_update', 'adamw_update', 'adagrad_update',
           'rmsprop_update', 'lamb_update', 'ftrl_update', 'signum_update', 'test_update',
           *numpy_more.__all__, *numpy_rows.__all__, 'zeros_like', 'widen', 'add_widened',
           'narrow', 'to_host', 'from_host', 'multi_update', 'set_threads', 'bf16_to_f32',
           'f32_to_bf16', 'BLOCK']


def sgd_update(weight, grad, mom, lr, wd, rescale_grad, clip_gradient, momentum=0.0,
               nesterov=False, weight32=None):
    """MXNet SGD (mom is None when momentum is 0); nesterov=True is NAG."""
    sc = _base(lr, wd, rescale_grad, clip_gradient, momentum=momentum, nesterov=bool(nesterov))
    run(sgd_body, weight, grad, (mom,), weight32, sc)


def nag_update(weight, grad, mom, lr, wd, rescale_grad, clip_gradient, momentum=0.0,
               weight32=None):
    """MXNet NAG: mom = m*mom + g; w -= lr*(g + m*mom)."""
    sgd_update(weight, grad, mom, lr, wd, rescale_grad, clip_gradient, momentum, True, weight32)


def _moments(g, mean, var, tmp, sc):
    """mean = b1*mean + (1-b1)*g; var = b2*var + (1-b2)*g*g (clobbers g)."""
    first_moment(mean, g, tmp, sc)
    np.multiply(g, g, out=g)
    g *= sc.omb2
    var *= sc.beta2
    var += g


def _adam(w, g, mean, var, tmp, sc):
    _prep(g, w, tmp[0], sc)
    _moments(g, mean, var, tmp[0], sc)
    adam_step(w, mean, var, tmp[0], sc, sc.step)


def adam_update(weight, grad, mean, var, lr, wd, rescale_grad, clip_gradient, beta1=0.9,
                beta2=0.999, epsilon=1e-8, t=1, weight32=None):
    """MXNet Adam: w -= lr*sqrt(1-b2^t)/(1-b1^t) * mean/(sqrt(var)+eps)."""
    sc = _base(lr, wd, rescale_grad, clip_gradient, step=common.adam_lr(lr, beta1, beta2, t),
               **moment_scalars(beta1, beta2, epsilon))
    run(_adam, weight, grad, (mean, var), weight32, sc)


def _adamw(w, g, mean, var, tmp, sc):
    _prep(g, w, tmp[0], sc, wd=False)
    _moments(g, mean, var, tmp[0], sc)
    if sc.decay != 1:
        w *= sc.decay
    np.sqrt(var, out=tmp[0])
    tmp[0] /= sc.bc2sqrt
    tmp[0] += sc.epsilon
    np.divide(mean, tmp[0], out=tmp[0])
    tmp[0] *= sc.step
    w -= tmp[0]


def adamw_update(weight, grad, mean, var, lr, wd, rescale_grad, clip_gradient, beta1=0.9,
                 beta2=0.999, epsilon=1e-8, t=1, weight32=None):
    """torch AdamW: w = w*(1-lr*wd) - lr/(1-b1^t) * mean/(sqrt(var)/sqrt(1-b2^t) + eps)."""
    decay, step, bc2sqrt = common.adamw_coeffs(lr, wd, beta1, beta2, t)
    sc = _base(lr, wd, rescale_grad, clip_gradient, decay=decay, step=step, bc2sqrt=bc2sqrt,
               **moment_scalars(beta1, beta2, epsilon))
    run(_adamw, weight, grad, (mean, var), weight32, sc)


def _adagrad(w, g, history, tmp, sc):
    _prep(g, w, tmp[0], sc)
    np.multiply(g, g, out=tmp[0])
    history += tmp[0]
    np.sqrt(history, out=tmp[0])
    tmp[0] += sc.epsilon
    np.divide(g, tmp[0], out=g)
    g *= sc.lr
    w -= g


def adagrad_update(weight, grad, history, lr, wd, rescale_grad, clip_gradient, epsilon=1e-6,
                   weight32=None):
    """AdaGrad: history += g*g; w -= lr*g/(sqrt(history)+eps)."""
    sc = _base(lr, wd, rescale_grad, clip_gradient, epsilon=epsilon)
    run(_adagrad, weight, grad, (history,), weight32, sc)


def _rmsprop(w, g, var, mean, mom, tmp, sc):
    _prep(g, w, tmp[0], sc)
    if mean is not None:  # centered (Graves): mean of g too, and heavy-ball momentum
        mean *= sc.rho
        np.multiply(g, sc.omr, out=tmp[0])
        mean += tmp[0]
    var *= sc.rho
    np.multiply(g, g, out=tmp[0])
    tmp[0] *= sc.omr
    var += tmp[0]
    if mean is None:
        np.sqrt(var, out=tmp[0])
        tmp[0] += sc.epsilon
    else:
        np.multiply(mean, mean, out=tmp[0])
        np.subtract(var, tmp[0], out=tmp[0])
        # var >= mean^2 in exact arithmetic; a steady gradient leaves them equal, and float
        # rounding below zero would turn the square root into NaN
        np.maximum(tmp[0], 0, out=tmp[0])
        tmp[0] += sc.epsilon
        np.sqrt(tmp[0], out=tmp[0])
    np.divide(g, tmp[0], out=g)
    g *= sc.lr
    if mom is None:
        w -= g
    else:
        mom *= sc.momentum
        mom -= g
        w += mom
    if sc.clip_weights >= 0:
        np.clip(w, -sc.clip_weights, sc.clip_weights, out=w)


def rmsprop_update(weight, grad, var, mean, mom, lr, wd, rescale_grad, clip_gradient, rho=0.9,
                   momentum=0.9, epsilon=1e-8, centered=False, clip_weights=None,
                   weight32=None):
    """RMSProp; centered needs mean and mom, plain ignores them (pass None)."""
    if not centered:
        mean = mom = None
    sc = _base(lr, wd, rescale_grad, clip_gradient, rho=rho, omr=1 - rho, momentum=momentum,
               epsilon=epsilon, clip_weights=common.off_if_not_positive(clip_weights))
    run(_rmsprop, weight, grad, (var, mean, mom), weight32, sc)


def _lamb_direction(w, mean, var, tmp, sc):
    """d = (mean/c1) / (sqrt(var/c2) + eps) + wd*w into tmp[0]."""
    np.divide(var, sc.c2, out=tmp[0])
    np.sqrt(tmp[0], out=tmp[0])
    tmp[0] += sc.epsilon
    np.divide(mean, sc.c1, out=tmp[1])
    np.divide(tmp[1], tmp[0], out=tmp[0])
    if sc.wd != 0:
        np.multiply(w, sc.wd, out=tmp[1])
        tmp[0] += tmp[1]
    return tmp[0]


def _lamb_moments(w, g, mean, var, tmp, sc):
    _prep(g, w, tmp[0], sc, wd=False)
    _moments(g, mean, var, tmp[0], sc)
    d = _lamb_direction(w, mean, var, tmp, sc)
    return float(np.dot(w, w)), float(np.dot(d, d))


def _lamb_apply(w, g, mean, var, tmp, sc):
    d = _lamb_direction(w, mean, var, tmp, sc)
    d *= sc.step
    w -= d


def lamb_update(weight, grad, mean, var, lr, wd, rescale_grad, clip_gradient, beta1=0.9,
                beta2=0.999, epsilon=1e-6, t=1, lower_bound=None, upper_bound=None,
                bias_correction=True, weight32=None):
    """LAMB in two passes: moments and both norms, then w -= lr*ratio*d (d recomputed, which
    reads mean and var again instead of keeping a full-size direction array). Keep mean and
    var in float32 or float64 (the updater does): from rounded float16 states the recomputed
    d would differ from the one whose norm was taken, and from the CUDA kernel's."""
    c1, c2 = common.lamb_coeffs(beta1, beta2, t, bias_correction)
    sc = _base(lr, wd, rescale_grad, clip_gradient, c1=c1, c2=c2,
               **moment_scalars(beta1, beta2, epsilon))
    sums = run(_lamb_moments, weight, grad, (mean, var), weight32, sc, write_weight=False,
                reduces=True)
    ratio = common.lamb_ratio(sum(s[0] for s in sums), sum(s[1] for s in sums),
                              lower_bound, upper_bound)
    sc['step'] = lr * ratio
    run(_lamb_apply, weight, None, (mean, var), weight32, sc)


def _ftrl(w, g, z, n, tmp, sc):
    _prep(g, w, tmp[0], sc, wd=False)
    np.sqrt(n, out=tmp[0])
    np.multiply(g, g, out=tmp[1])
    n += tmp[1]
    np.sqrt(n, out=tmp[1])
    np.subtract(tmp[1], tmp[0], out=tmp[0])  # sigma = (sqrt(n_new) - sqrt(n_old)) / lr
    tmp[0] /= sc.lr
    tmp[0] *= w
    g -= tmp[0]
    z += g
    tmp[1] += sc.beta  # denominator: (beta + sqrt(n)) / lr + wd
    tmp[1] /= sc.lr
    tmp[1] += sc.wd
    np.abs(z, out=tmp[0])
    tmp[0] -= sc.lamda1
    np.maximum(tmp[0], 0, out=tmp[0])
    np.sign(z, out=g)
    g *= tmp[0]
    g /= tmp[1]
    np.negative(g, out=w)


def ftrl_update(weight, grad, z, n, lr, wd, rescale_grad, clip_gradient, lamda1=0.01, beta=1.0,
                weight32=None):
    """FTRL-proximal (MXNet)."""
    sc = _base(lr, wd, rescale_grad, clip_gradient, lamda1=lamda1, beta=beta)
    run(_ftrl, weight, grad, (z, n), weight32, sc)


def _signum(w, g, mom, tmp, sc):
    _prep(g, w, tmp[0], sc, wd=mom is not None)
    if sc.decay != 1:
        w *= sc.decay
    if mom is None:  # signSGD
        np.sign(g, out=g)
        g *= sc.lr
        w -= g
    else:
        mom *= sc.momentum
        g *= sc.omm
        mom -= g
        np.sign(mom, out=tmp[0])
        tmp[0] *= sc.lr
        w += tmp[0]


def signum_update(weight, grad, mom, lr, wd, rescale_grad, clip_gradient, momentum=0.9,
                  wd_lh=0.0, weight32=None):
    """Signum (mom given) or signSGD (mom None)."""
    sc = _base(lr, wd, rescale_grad, clip_gradient, momentum=momentum, omm=1 - momentum,
               decay=common.signum_decay(lr, wd, wd_lh, momentum if mom is not None else 0.0))
    run(_signum, weight, grad, (mom,), weight32, sc)


def _test(w, g, tmp, sc):
    g *= sc.rescale
    w += g


def test_update(weight, grad, lr, wd, rescale_grad, clip_gradient, weight32=None):
    """MXNet's test optimizer: w += rescale_grad * grad."""
    run(_test, weight, grad, (), weight32, _base(lr, wd, rescale_grad, clip_gradient))


test_update.__test__ = False  # not a pytest test, despite the name


# Placement helpers the updater uses to create and move state without knowing the device.
def zeros_like(array, dtype):
    return np.zeros(array.shape, dtype=dtype)


def widen(array):
    """A float32 copy of a float16 or bfloat16 (uint16) array: the master weight."""
    return bf16_to_f32(array) if array.dtype == np.uint16 else array.astype(np.float32)


def add_widened(a, b, out):
    """out = a + b into a float32 ``out`` (which may be ``a``), block by block; ``a`` and ``b``
    are float32 or bfloat16 bits (uint16, widened exactly). How bfloat16 gradients are summed:
    numpy would add their bit patterns as integers."""
    flat_a, flat_b, flat_out = a.reshape(-1), b.reshape(-1), out.reshape(-1)
    blk = max(1, min(BLOCK, flat_out.size))
    bufs = np.empty(blk, np.float32), np.empty(blk, np.float32)
    for lo in range(0, flat_out.size, blk):
        hi = min(lo + blk, flat_out.size)
        x, y = (_as_f32(src[lo:hi], buf[:hi - lo]) for src, buf in zip((flat_a, flat_b), bufs))
        np.add(x, y, out=flat_out[lo:hi])
    return out


def _as_f32(block, buf):
    return bf16_to_f32(block, out=buf) if block.dtype == np.uint16 else block


def narrow(src, out):
    """out = src cast to out's dtype; bfloat16 bits (uint16) round to nearest even. Block by
    block: the rounding's temporaries stay in cache (twice as fast as one whole pass)."""
    flat_src, flat_out = src.reshape(-1), out.reshape(-1)
    for lo in range(0, flat_out.size, BLOCK):
        store(flat_src[lo:lo + BLOCK], flat_out[lo:lo + BLOCK])
    return out


def to_host(array):
    return np.ascontiguousarray(array)


def from_host(array, like):
    return np.ascontiguousarray(array)


# numpy_more's and numpy_rows' rules join this module's rule table (multi_update looks them
# up here)
globals().update({name: getattr(module, name) for module in (numpy_more, numpy_rows)
                  for name in module.__all__})


def multi_update(calls, launches=None):
    """Many keys at once, calls: [(fn_name, args, kwargs)], args = (weight, grad, *states):
    small keys of one elementwise rule and equal scalars in packed passes (numpy_packing).
    ``launches`` is cuda_kernels': the packed passes keep their layouts themselves."""
    numpy_packing.multi_update(calls, globals())
