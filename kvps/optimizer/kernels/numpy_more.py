"""numpy kernels of the rules MXNet has beyond kvps's first ten: adadelta, adamax, nadam, ftml,
lars, lbsgd, sgld, dcasgd, adabelief and lans (numpy_kernels' contract, and its rule table).

Each follows MXNet's operations in MXNet's order (the optimizer's Python, or its C++ kernel
where the Python calls one); cuda_more does the same operations in the same order. Rules that
take norms (lars, lans, lbsgd's 'lars' warm-up) sum them in a pass of their own, as LAMB does.
"""

import math

import numpy as np

from . import common, noise
from .common import kernel_scalars as _base, moment_scalars
from .numpy_blocks import adam_step, first_moment, prep as _prep, run, sgd_body

__all__ = ['adadelta_update', 'adamax_update', 'nadam_update', 'ftml_update', 'lars_update',
           'lbsgd_update', 'sgld_update', 'dcasgd_update', 'adabelief_update', 'lans_update']


def _prep_then_clip(g, w, tmp, sc):
    """g = clip(rescale * g + wd * w): the order of MXNet's adamax, nadam, ftml, adabelief."""
    if sc.rescale != 1:
        g *= sc.rescale
    np.multiply(w, sc.wd, out=tmp)
    g += tmp
    if sc.clip >= 0:
        np.clip(g, -sc.clip, sc.clip, out=g)


def _sums(results):
    """The two sums of a pass that reduces, added over its blocks in order."""
    return sum(r[0] for r in results), sum(r[1] for r in results)


def _read_only(grad):
    """``grad`` for a pass before the last, which must not write it (a later pass reads it
    again): a read-only view, which the blocks copy before a body changes them."""
    if type(grad) is tuple:
        return grad
    view = grad.view()
    view.flags.writeable = False
    return view


def _adadelta(w, g, acc_g, acc_delta, tmp, sc):
    _prep(g, w, tmp[0], sc, wd=False)
    acc_g *= sc.rho
    np.multiply(g, sc.omr, out=tmp[0])
    tmp[0] *= g
    acc_g += tmp[0]
    np.add(acc_delta, sc.epsilon, out=tmp[0])   # delta = sqrt(acc_delta + eps) /
    np.sqrt(tmp[0], out=tmp[0])                 #         sqrt(acc_g + eps) * g
    np.add(acc_g, sc.epsilon, out=tmp[1])
    np.sqrt(tmp[1], out=tmp[1])
    tmp[0] /= tmp[1]
    tmp[0] *= g
    acc_delta *= sc.rho
    np.multiply(tmp[0], sc.omr, out=tmp[1])
    tmp[1] *= tmp[0]
    acc_delta += tmp[1]
    np.multiply(w, sc.wd, out=tmp[1])           # w -= delta + wd * w
    tmp[0] += tmp[1]
    w -= tmp[0]


def adadelta_update(weight, grad, acc_g, acc_delta, lr, wd, rescale_grad, clip_gradient,
                    rho=0.9, epsilon=1e-5, weight32=None):
    """MXNet 1.9 AdaDelta: no learning rate; wd decays the weight after the step."""
    sc = _base(lr, wd, rescale_grad, clip_gradient, rho=rho, omr=1. - rho, epsilon=epsilon)
    run(_adadelta, weight, grad, (acc_g, acc_delta), weight32, sc)


def _adamax(w, g, mean, u, tmp, sc):
    _prep_then_clip(g, w, tmp[0], sc)
    first_moment(mean, g, tmp[0], sc)
    u *= sc.beta2
    np.abs(g, out=g)
    np.maximum(u, g, out=u)
    np.multiply(mean, sc.step, out=tmp[0])
    tmp[0] /= u
    w -= tmp[0]


def adamax_update(weight, grad, mean, u, lr, wd, rescale_grad, clip_gradient, beta1=0.9,
                  beta2=0.999, t=1, weight32=None):
    """MXNet AdaMax: u = max(beta2*u, |g|); w -= lr/(1-beta1^t) * mean / u (no epsilon: an
    element whose u is 0 becomes NaN, as in MXNet)."""
    sc = _base(lr, wd, rescale_grad, clip_gradient, beta1=beta1, omb1=1. - beta1, beta2=beta2,
               step=lr / (1. - beta1 ** t))
    run(_adamax, weight, grad, (mean, u), weight32, sc)


def _nadam(w, g, mean, var, tmp, sc):
    _prep_then_clip(g, w, tmp[0], sc)
    first_moment(mean, g, tmp[0], sc)
    var *= sc.beta2
    np.multiply(g, sc.omb2, out=tmp[0])
    tmp[0] *= g
    var += tmp[0]
    g /= sc.cg                                   # mbar = (1-mu_t) g' + mu_t+1 mean'
    g *= sc.a
    np.divide(mean, sc.cm, out=tmp[0])
    tmp[0] *= sc.b
    g += tmp[0]
    np.divide(var, sc.cv, out=tmp[0])            # w -= lr * mbar / (sqrt(var') + eps)
    np.sqrt(tmp[0], out=tmp[0])
    tmp[0] += sc.epsilon
    g *= sc.lr
    g /= tmp[0]
    w -= g


def nadam_update(weight, grad, mean, var, lr, wd, rescale_grad, clip_gradient, beta1=0.9,
                 beta2=0.999, epsilon=1e-8, schedule_decay=0.004, t=1, weight32=None):
    """MXNet Nadam, its momentum schedule by the key's update count ``t``."""
    a, b, cg, cm, cv = common.nadam_coeffs(beta1, beta2, schedule_decay, t)
    sc = _base(lr, wd, rescale_grad, clip_gradient, a=a, b=b, cg=cg, cm=cm, cv=cv,
               **moment_scalars(beta1, beta2, epsilon))
    run(_nadam, weight, grad, (mean, var), weight32, sc)


def _ftml(w, g, d, v, z, tmp, sc):
    _prep_then_clip(g, w, tmp[0], sc)
    v *= sc.beta2
    np.multiply(g, g, out=tmp[0])
    tmp[0] *= sc.omb2
    v += tmp[0]
    np.divide(v, sc.c2, out=tmp[0])              # d_t = (1-b1^t)/lr * (sqrt(v/(1-b2^t)) + eps)
    np.sqrt(tmp[0], out=tmp[0])
    tmp[0] += sc.epsilon
    tmp[0] *= sc.c1
    z *= sc.beta1                                # z = b1 z + (1-b1) g - (d_t - b1 d) w
    np.multiply(g, sc.omb1, out=tmp[1])
    z += tmp[1]
    np.multiply(d, sc.beta1, out=tmp[1])
    np.subtract(tmp[0], tmp[1], out=tmp[1])
    tmp[1] *= w
    z -= tmp[1]
    np.copyto(d, tmp[0])
    np.divide(z, tmp[0], out=w)
    np.negative(w, out=w)


def ftml_update(weight, grad, d, v, z, lr, wd, rescale_grad, clip_gradient, beta1=0.6,
                beta2=0.999, epsilon=1e-8, t=1, weight32=None):
    """MXNet FTML (its ftml_update kernel): w = -z / d_t."""
    sc = _base(lr, wd, rescale_grad, clip_gradient, c1=(1. - beta1 ** t) / lr,
               c2=1. - beta2 ** t, **moment_scalars(beta1, beta2, epsilon))
    run(_ftml, weight, grad, (d, v, z), weight32, sc)


def _norms(w, g, tmp, sc):
    """The sums of squares of the weight and the grad (as it came, not rescaled)."""
    return float(np.dot(w, w)), float(np.dot(g, g))


def lars_update(weight, grad, mom, lr, wd, rescale_grad, clip_gradient, momentum=0.0,
                eta=0.001, eps=0.0, lars=True, weight32=None):
    """MXNet LARS: SGD with lr scaled by common.lars_factor of the key's norms (``lars``:
    False for the keys MXNet leaves out, see more_optimizers.LARS)."""
    if lars:
        norms = run(_norms, weight, grad, (), weight32, {}, write_weight=False, reduces=True)
        lr = lr * common.lars_factor(*_sums(norms), eta, eps, wd, rescale_grad)
    sc = _base(lr, wd, rescale_grad, clip_gradient, momentum=momentum, nesterov=False)
    run(sgd_body, weight, grad, (mom,), weight32, sc)


def _lbsgd_grad(g, cum, sc):
    """LBSGD's gradient on an update that applies: (cum + g) / batch_scale; cum restarts."""
    if cum is not None:
        g += cum
        g /= sc.bs
        cum.fill(0)


def _lbsgd(w, g, mom, cum, tmp, sc):
    if not sc.apply:   # a step inside a macro-batch: the gradient only accumulates
        cum += g
        return
    _lbsgd_grad(g, cum, sc)
    sgd_body(w, g, mom, tmp, sc)


def _lbsgd_norms(w, g, cum, tmp, sc):
    if cum is not None:
        np.add(cum, g, out=tmp[0])
        tmp[0] /= sc.bs
        g = tmp[0]
    return float(np.dot(w, w)), float(np.dot(g, g))


def lbsgd_update(weight, grad, mom, cum, lr, wd, rescale_grad, clip_gradient, momentum=0.0,
                 lr_scale=1.0, batch_scale=1, apply=True, lars=False, weight32=None):
    """MXNet LBSGD: gradients summed in ``cum`` over ``batch_scale`` updates, then an SGD
    step at lr * lr_scale (``lars``: at lr times common.lbsgd_lars of the norms)."""
    if apply and lars:
        norms = run(_lbsgd_norms, weight, grad, (cum,), weight32, {'bs': batch_scale},
                    write_weight=False, reduces=True)
        lr_scale = common.lbsgd_lars(*_sums(norms), wd)
    sc = _base(lr * lr_scale, wd, rescale_grad, clip_gradient, momentum=momentum,
               nesterov=False, bs=batch_scale, apply=bool(apply))
    run(_lbsgd, weight, grad, (mom, cum), weight32, sc)


def _sgld(w, g, nz, tmp, sc):
    _prep(g, w, tmp[0], sc)
    g *= sc.mhl
    w += g
    w += nz


def sgld_update(weight, grad, lr, wd, rescale_grad, clip_gradient, noise_hi=0, noise_lo=0,
                weight32=None):
    """MXNet SGLD: w += -lr/2 * (g + wd*w), then w += N(0, sqrt(lr)) drawn by kernels.noise
    from the stream (noise_hi, noise_lo) that more_optimizers.SGLD gives the key's update."""
    master = weight32 if weight32 is not None else weight
    cdt = np.float64 if common.compute_dtype_name(master) == 'float64' else np.float32
    z = noise.gaussian(noise_hi, noise_lo, 0, master.size)
    z *= math.sqrt(lr)
    sc = _base(lr, wd, rescale_grad, clip_gradient, mhl=-lr / 2)
    run(_sgld, weight, grad, (z.astype(cdt).reshape(master.shape),), weight32, sc)


def _dcasgd(w, g, mom, prev, tmp, sc):
    _prep(g, w, tmp[0], sc, wd=False)
    np.subtract(w, prev, out=tmp[0])             # -lr (g + wd w + lamda g g (w - prev))
    np.multiply(g, sc.lamda, out=tmp[1])
    tmp[1] *= g
    tmp[1] *= tmp[0]
    np.multiply(w, sc.wd, out=tmp[0])
    g += tmp[0]
    g += tmp[1]
    g *= sc.mlr
    np.copyto(prev, w)
    if mom is None:
        w += g
    else:
        mom *= sc.momentum
        mom += g
        w += mom


def dcasgd_update(weight, grad, mom, prev, lr, wd, rescale_grad, clip_gradient, momentum=0.0,
                  lamda=0.04, weight32=None):
    """MXNet DCASGD; ``prev`` holds the weight before the last update (made from the weight
    at the first)."""
    sc = _base(lr, wd, rescale_grad, clip_gradient, momentum=momentum, lamda=lamda, mlr=-lr)
    run(_dcasgd, weight, grad, (mom, prev), weight32, sc)


def _adabelief(w, g, mean, var, tmp, sc):
    _prep_then_clip(g, w, tmp[0], sc)
    mean -= g                                    # mean = b1 (mean - g) + g
    mean *= sc.beta1
    mean += g
    np.subtract(mean, g, out=tmp[0])             # var = b2 (var - adj) + adj + eps
    tmp[0] *= tmp[0]
    var -= tmp[0]
    var *= sc.beta2
    var += tmp[0]
    var += sc.epsilon
    adam_step(w, mean, var, tmp[0], sc, sc.eta)


def adabelief_update(weight, grad, mean, var, lr, wd, rescale_grad, clip_gradient, beta1=0.9,
                     beta2=0.999, epsilon=1e-6, correct_bias=True, t=1, weight32=None):
    """MXNet 2 AdaBelief (its fused kernel): w -= eta * mean / (sqrt(var) + eps)."""
    eta = common.adam_lr(lr, beta1, beta2, t) if correct_bias else lr
    sc = _base(lr, wd, rescale_grad, clip_gradient, eta=eta,
               **moment_scalars(beta1, beta2, epsilon))
    run(_adabelief, weight, grad, (mean, var), weight32, sc)


def _lans_norms(w, g, tmp, sc):
    np.multiply(g, sc.rescale, out=tmp[0])
    return float(np.dot(w, w)), float(np.dot(tmp[0], tmp[0]))


def _lans_grad(g, sc):
    """The normalized gradient: clip(rescale * g / ||rescale * g||)."""
    g *= sc.rescale
    g /= sc.gnorm
    if sc.clip >= 0:
        np.clip(g, -sc.clip, sc.clip, out=g)


def _lans_directions(w, g, mean, var, tmp, sc):
    """From the normalized gradient in g: m = mean'/den + wd w into tmp[1], g/den + wd w
    into g (den = sqrt(var') + eps)."""
    np.divide(var, sc.c2, out=tmp[0])
    np.sqrt(tmp[0], out=tmp[0])
    tmp[0] += sc.epsilon
    np.divide(mean, sc.c1, out=tmp[1])
    tmp[1] /= tmp[0]
    g /= tmp[0]
    np.multiply(w, sc.wd, out=tmp[0])
    tmp[1] += tmp[0]
    g += tmp[0]


def _lans_moments(w, g, mean, var, tmp, sc):
    _lans_grad(g, sc)
    first_moment(mean, g, tmp[0], sc)
    var *= sc.beta2
    np.multiply(g, sc.omb2, out=tmp[0])
    tmp[0] *= g
    var += tmp[0]
    _lans_directions(w, g, mean, var, tmp, sc)
    return float(np.dot(tmp[1], tmp[1])), float(np.dot(g, g))


def _lans_apply(w, g, mean, var, tmp, sc):
    _lans_grad(g, sc)
    _lans_directions(w, g, mean, var, tmp, sc)
    tmp[1] *= sc.am
    g *= sc.ag
    tmp[1] += g
    w -= tmp[1]


def lans_update(weight, grad, mean, var, lr, wd, rescale_grad, clip_gradient, beta1=0.9,
                beta2=0.999, epsilon=1e-6, t=1, lower_bound=None, upper_bound=None,
                weight32=None):
    """MXNet 2 LANS (its fused multi_lans kernel) in three passes: the norms of the weight and
    the gradient; the moments and the norms of both directions; the step."""
    grad = _read_only(grad)
    sums_w, sums_g = _sums(run(_lans_norms, weight, grad, (), weight32, {'rescale': rescale_grad},
                               write_weight=False, reduces=True))
    sc = _base(lr, wd, rescale_grad, clip_gradient, gnorm=math.sqrt(sums_g),
               c1=1. - beta1 ** t, c2=1. - beta2 ** t, **moment_scalars(beta1, beta2, epsilon))
    sums_m, sums_d = _sums(run(_lans_moments, weight, grad, (mean, var), weight32, sc,
                               write_weight=False, reduces=True))
    sc['am'] = lr * (common.lamb_ratio(sums_w, sums_m, lower_bound, upper_bound) * beta1)
    sc['ag'] = lr * (common.lamb_ratio(sums_w, sums_d, lower_bound, upper_bound) * (1. - beta1))
    run(_lans_apply, weight, grad, (mean, var), weight32, sc)
