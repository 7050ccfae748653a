"""CUDA kernels of the rules MXNet has beyond kvps's first ten (numpy_more's, operation by
operation: the same order and the same host-computed constants, so the same bits; the rules
that take norms agree to rounding, as LAMB does). Each says what it needs through
cuda_launch.request; cuda_kernels holds them in its rule table."""

import math

from . import common, cuda_launch as launch
from .common import kernel_scalars as _base, moment_scalars
from .cuda_source import PREP, PREP_WD, sgd_step

__all__ = ['adadelta_update', 'adamax_update', 'nadam_update', 'ftml_update', 'lars_update',
           'lbsgd_update', 'sgld_update', 'dcasgd_update', 'adabelief_update', 'lans_update']

PREP_THEN_CLIP = 'g = kv_clip<KC>(g * s_rescale + s_wd * w, s_clip);'
_NORMS = 'kv_norm[0] += (double)w * w; kv_norm[1] += (double)g * g;'


def _request(tag, core, weight, grad, states, weight32, scalars, then=None, wide=()):
    launch.request(tag, core, then, weight, grad, states, weight32, scalars, wide)


def adadelta_update(weight, grad, acc_g, acc_delta, lr, wd, rescale_grad, clip_gradient,
                    rho=0.9, epsilon=1e-5, weight32=None):
    """numpy_more.adadelta_update."""
    core = PREP + (' acc_g = acc_g * s_rho + (s_omr * g) * g;'
                   ' KC delta = sqrt(acc_delta + s_epsilon) / sqrt(acc_g + s_epsilon) * g;'
                   ' acc_delta = acc_delta * s_rho + (s_omr * delta) * delta;'
                   ' w = w - (delta + s_wd * w);')
    _request('adadelta', core, weight, grad, [('acc_g', acc_g), ('acc_delta', acc_delta)],
             weight32, _base(lr, wd, rescale_grad, clip_gradient, rho=rho, omr=1. - rho,
                             epsilon=epsilon))


def adamax_update(weight, grad, mean, u, lr, wd, rescale_grad, clip_gradient, beta1=0.9,
                  beta2=0.999, t=1, weight32=None):
    """numpy_more.adamax_update."""
    core = PREP_THEN_CLIP + (' mean = mean * s_beta1 + s_omb1 * g;'
                             ' u = kv_max<KC>(u * s_beta2, fabs(g));'
                             ' w = w - (mean * s_step) / u;')
    _request('adamax', core, weight, grad, [('mean', mean), ('u', u)], weight32,
             _base(lr, wd, rescale_grad, clip_gradient, beta1=beta1, omb1=1. - beta1,
                   beta2=beta2, step=lr / (1. - beta1 ** t)))


def nadam_update(weight, grad, mean, var, lr, wd, rescale_grad, clip_gradient, beta1=0.9,
                 beta2=0.999, epsilon=1e-8, schedule_decay=0.004, t=1, weight32=None):
    """numpy_more.nadam_update."""
    core = PREP_THEN_CLIP + (' mean = mean * s_beta1 + s_omb1 * g;'
                             ' var = var * s_beta2 + (g * s_omb2) * g;'
                             ' KC mbar = (g / s_cg) * s_a + (mean / s_cm) * s_b;'
                             ' w = w - (mbar * s_lr) / (sqrt(var / s_cv) + s_epsilon);')
    a, b, cg, cm, cv = common.nadam_coeffs(beta1, beta2, schedule_decay, t)
    _request('nadam', core, weight, grad, [('mean', mean), ('var', var)], weight32,
             _base(lr, wd, rescale_grad, clip_gradient, a=a, b=b, cg=cg, cm=cm, cv=cv,
                   **moment_scalars(beta1, beta2, epsilon)))


def ftml_update(weight, grad, d, v, z, lr, wd, rescale_grad, clip_gradient, beta1=0.6,
                beta2=0.999, epsilon=1e-8, t=1, weight32=None):
    """numpy_more.ftml_update."""
    core = PREP_THEN_CLIP + (' v = v * s_beta2 + (g * g) * s_omb2;'
                             ' KC dt = (sqrt(v / s_c2) + s_epsilon) * s_c1;'
                             ' z = (z * s_beta1 + g * s_omb1) - (dt - d * s_beta1) * w;'
                             ' d = dt; w = -(z / dt);')
    _request('ftml', core, weight, grad, [('d', d), ('v', v), ('z', z)], weight32,
             _base(lr, wd, rescale_grad, clip_gradient, c1=(1. - beta1 ** t) / lr,
                   c2=1. - beta2 ** t, **moment_scalars(beta1, beta2, epsilon)))


def lars_update(weight, grad, mom, lr, wd, rescale_grad, clip_gradient, momentum=0.0,
                eta=0.001, eps=0.0, lars=True, weight32=None):
    """numpy_more.lars_update: the norms first, the factor on the device, then SGD."""
    sc = _base(lr, wd, rescale_grad, clip_gradient, momentum=momentum)
    if not lars:
        _request('lars_off', PREP_WD + sgd_step(mom is not None), weight, grad,
                 [('mom', mom)], weight32, sc)
        return
    finish = 'kv_keep[0] = kv_lars_factor(kv_s0, kv_s1, s_eta, s_eps, s_dwd, s_drescale);'
    step = PREP_WD + sgd_step(mom is not None, '(KC)(s_dlr * kv_r0)')
    sc.update(eta=eta, eps=eps, dwd=wd, drescale=rescale_grad, dlr=lr)
    _request('lars', _NORMS, weight, grad, [('mom', mom)], weight32, sc,
             then=((finish, step),), wide=('eta', 'eps', 'dwd', 'drescale', 'dlr'))


def lbsgd_update(weight, grad, mom, cum, lr, wd, rescale_grad, clip_gradient, momentum=0.0,
                 lr_scale=1.0, batch_scale=1, apply=True, lars=False, weight32=None):
    """numpy_more.lbsgd_update."""
    states = [('mom', mom), ('cum', cum)]
    sc = _base(lr * lr_scale, wd, rescale_grad, clip_gradient, momentum=momentum,
               bs=batch_scale)
    if not apply:
        _request('lbsgd_sum', 'cum = cum + g;', weight, grad, states, weight32, sc)
        return
    grad_of = 'g = (cum + g) / s_bs; cum = (KC)0; ' if cum is not None else ''
    if not lars:
        _request('lbsgd', grad_of + PREP_WD + sgd_step(mom is not None), weight, grad,
                 states, weight32, sc)
        return
    norms = ('KC gb = (cum + g) / s_bs; ' if cum is not None else 'KC gb = g; ') + \
        'kv_norm[0] += (double)w * w; kv_norm[1] += (double)gb * gb;'
    step = grad_of + PREP_WD + sgd_step(mom is not None, '(KC)(s_dlr * kv_r0)')
    sc.update(dwd=wd, dlr=lr)
    _request('lbsgd_lars', norms, weight, grad, states, weight32, sc,
             then=(('kv_keep[0] = kv_lbsgd_lars(kv_s0, kv_s1, s_dwd);', step),),
             wide=('dwd', 'dlr'))


def sgld_update(weight, grad, lr, wd, rescale_grad, clip_gradient, noise_hi=0, noise_lo=0,
                weight32=None):
    """numpy_more.sgld_update: the noise drawn in the kernel (kernels.noise's C)."""
    core = PREP_WD + (' w = w + s_mhl * g;'
                      ' w = w + (KC)(kv_normal(s_nhi, s_nlo, i) * s_sigma);')
    _request('sgld', core, weight, grad, [], weight32,
             _base(lr, wd, rescale_grad, clip_gradient, mhl=-lr / 2, nhi=noise_hi,
                   nlo=noise_lo, sigma=math.sqrt(lr)), wide=('nhi', 'nlo', 'sigma'))


def dcasgd_update(weight, grad, mom, prev, lr, wd, rescale_grad, clip_gradient, momentum=0.0,
                  lamda=0.04, weight32=None):
    """numpy_more.dcasgd_update."""
    core = PREP + (' g = ((g + w * s_wd) + ((g * s_lamda) * g) * (w - prev)) * s_mlr;'
                   ' prev = w;')
    core += ' mom = mom * s_momentum + g; w = w + mom;' if mom is not None else ' w = w + g;'
    _request('dcasgd' if mom is None else 'dcasgd_mom', core, weight, grad,
             [('mom', mom), ('prev', prev)], weight32,
             _base(lr, wd, rescale_grad, clip_gradient, momentum=momentum, lamda=lamda,
                   mlr=-lr))


def adabelief_update(weight, grad, mean, var, lr, wd, rescale_grad, clip_gradient, beta1=0.9,
                     beta2=0.999, epsilon=1e-6, correct_bias=True, t=1, weight32=None):
    """numpy_more.adabelief_update."""
    core = PREP_THEN_CLIP + (' mean = (mean - g) * s_beta1 + g;'
                             ' KC adj = (mean - g) * (mean - g);'
                             ' var = ((var - adj) * s_beta2 + adj) + s_epsilon;'
                             ' w = w - (mean / (sqrt(var) + s_epsilon)) * s_eta;')
    eta = common.adam_lr(lr, beta1, beta2, t) if correct_bias else lr
    _request('adabelief', core, weight, grad, [('mean', mean), ('var', var)], weight32,
             _base(lr, wd, rescale_grad, clip_gradient, eta=eta,
                   **moment_scalars(beta1, beta2, epsilon)))


_LANS_GRAD = 'KC sg = kv_clip<KC>((g * s_rescale) / (KC)kv_r0, s_clip);'
_LANS_DIRECTIONS = (' KC den = sqrt(var / s_c2) + s_epsilon; KC sw = w * s_wd;'
                    ' KC m = (mean / s_c1) / den + sw; KC gd = sg / den + sw;')


def lans_update(weight, grad, mean, var, lr, wd, rescale_grad, clip_gradient, beta1=0.9,
                beta2=0.999, epsilon=1e-6, t=1, lower_bound=None, upper_bound=None,
                weight32=None):
    """numpy_more.lans_update: three passes, the per-key values kept on the device."""
    norms = ('KC sg0 = g * s_rescale;'
             ' kv_norm[0] += (double)w * w; kv_norm[1] += (double)sg0 * sg0;')
    moments = (_LANS_GRAD + ' mean = mean * s_beta1 + sg * s_omb1;'
               ' var = var * s_beta2 + (sg * s_omb2) * sg;' + _LANS_DIRECTIONS +
               ' kv_norm[0] += (double)m * m; kv_norm[1] += (double)gd * gd;')
    step = _LANS_GRAD + _LANS_DIRECTIONS + ' w = w - (m * (KC)kv_r2 + gd * (KC)kv_r3);'
    ratios = ('kv_keep[2] = s_dlr * (kv_trust_ratio(kv_r1, kv_s0, s_lower, s_upper) * s_db1);'
              ' kv_keep[3] = s_dlr * (kv_trust_ratio(kv_r1, kv_s1, s_lower, s_upper)'
              ' * s_domb1);')
    sc = _base(lr, wd, rescale_grad, clip_gradient, c1=1. - beta1 ** t, c2=1. - beta2 ** t,
               dlr=lr, db1=beta1, domb1=1. - beta1,
               lower=common.off_if_not_positive(lower_bound),
               upper=common.off_if_not_positive(upper_bound),
               **moment_scalars(beta1, beta2, epsilon))
    _request('lans', norms, weight, grad, [('mean', mean), ('var', var)], weight32, sc,
             then=(('kv_keep[0] = sqrt(kv_s1); kv_keep[1] = kv_s0;', moments),
                   (ratios, step)),
             wide=('dlr', 'db1', 'domb1', 'lower', 'upper'))
