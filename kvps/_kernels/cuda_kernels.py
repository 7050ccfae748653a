"""Fused optimizer updates on cupy arrays: one CUDA kernel per update, numpy_kernels' API.

Each update loads weight (or its fp32 master), grad and the states once, does the whole rule
in registers and stores once, so it runs at memory bandwidth. The arithmetic mirrors the numpy
reference operation by operation (same order, same host-computed constants, no FMA
contraction: --fmad=false), so results agree bit for bit where the operations are IEEE
(+ - * / sqrt); LAMB's norms are reductions in a different order and agree to rounding.
cupy is imported lazily: importing kvps never needs it.
"""

import functools

import numpy as np

from kvps._kernels import common

_OPTIONS = ('--fmad=false',)

# bfloat16 lives in uint16 storage; float16 goes through cupy's float16 (operator float, and
# a constructor from float that rounds to nearest even); everything is computed in KC.
_PREAMBLE = r'''
__device__ __forceinline__ float kv_bf16_to_f32(unsigned short u) {
    return __uint_as_float(((unsigned int)u) << 16);
}
__device__ __forceinline__ unsigned short kv_f32_to_bf16(float f) {
    unsigned int x = __float_as_uint(f);
    if ((x & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((x >> 16) | 0x40u);
    x += 0x7fffu + ((x >> 16) & 1u);
    return (unsigned short)(x >> 16);
}
template <typename C, typename T> __device__ __forceinline__ C kv_ld(T x) { return (C)(float)x; }
template <typename C> __device__ __forceinline__ C kv_ld(double x) { return (C)x; }
template <typename C> __device__ __forceinline__ C kv_ld(unsigned short x) {
    return (C)kv_bf16_to_f32(x);
}
template <typename D, typename C> __device__ __forceinline__ void kv_st(D& d, C v) {
    d = D((float)v);
}
template <typename C> __device__ __forceinline__ void kv_st(double& d, C v) { d = (double)v; }
template <typename C> __device__ __forceinline__ void kv_st(unsigned short& d, C v) {
    d = kv_f32_to_bf16((float)v);
}
template <typename C> __device__ __forceinline__ C kv_clip(C x, C c) {
    return c < 0 ? x : (x > c ? c : (x < -c ? -c : x));   /* NaN passes, as np.clip */
}
template <typename C> __device__ __forceinline__ C kv_sign(C x) {
    return (C)((x > 0) - (x < 0));
}
template <typename T> __device__ __forceinline__ double kv_sq(T x) {
    double v = kv_ld<double>(x);
    return v * v;
}
'''

PREP = 'g = kv_clip<KC>(g * s_rescale, s_clip);'
PREP_WD = PREP + ' g = g + s_wd * w;'
MOMENTS = 'mean = s_beta1 * mean + s_omb1 * g; var = s_beta2 * var + s_omb2 * (g * g);'


def _cupy():
    import cupy  # lazily, only when an array already is a cupy array
    return cupy


@functools.lru_cache(maxsize=None)
def _elementwise(tag, ins, outs, code):
    cp = _cupy()
    return cp.ElementwiseKernel(', '.join(ins), ', '.join(outs), code, name=f'kvps_{tag}',
                                preamble=_PREAMBLE, options=_OPTIONS, no_return=True)


@functools.lru_cache(maxsize=None)
def _sumsq_kernel():
    cp = _cupy()
    return cp.ReductionKernel('T x', 'float64 y', 'kv_sq(x)', 'a + b', 'y = a', '0',
                              'kvps_sumsq', preamble=_PREAMBLE, options=_OPTIONS)


def _array_params(weight, grad, states, weight32, write_weight):
    """Parameter declarations, arguments, and the load/store code for the arrays."""
    master = weight32 if weight32 is not None else weight
    ins, outs, args_in, args_out = [], [], [], []
    loads, stores = ['KC w = kv_ld<KC>(p_w);'], []
    (outs if write_weight else ins).append(f'{master.dtype} p_w')
    (args_out if write_weight else args_in).append(master)
    if write_weight:
        stores.append('kv_st(p_w, w);')
        if weight32 is not None:  # the low-precision weight gets the rounded master
            outs.append(f'{weight.dtype} p_weight')
            args_out.append(weight)
            stores.append('kv_st(p_weight, w);')
    if grad is not None:
        ins.append(f'{grad.dtype} p_g')
        args_in.append(grad)
        loads.append('KC g = kv_ld<KC>(p_g);')
    for name, arr in states:
        if arr is not None:
            outs.append(f'{arr.dtype} p_{name}')
            args_out.append(arr)
            loads.append(f'KC {name} = kv_ld<KC>(p_{name});')
            stores.append(f'kv_st(p_{name}, {name});')
    return ins, outs, args_in, args_out, loads, stores


def _launch(tag, core, weight, grad, states, weight32, scalars, write_weight=True,
            extra_in=(), extra_out=(), wide=()):
    """Generate (once per variant and dtypes) and run the elementwise kernel for `core`.

    states: [(local name, array or None)]; scalars: name -> value, passed as the compute
    dtype (names in `wide` as float64); extra_in/out: [(param decl, array)] used by core.
    """
    common.check_arrays(weight, grad, {n: a for n, a in states}, weight32)
    master = weight32 if weight32 is not None else weight
    cname = common.compute_dtype_name(master)
    ins, outs, args_in, args_out, loads, stores = _array_params(weight, grad, states,
                                                                weight32, write_weight)
    for decl, arr in extra_in:
        ins.append(decl)
        args_in.append(arr)
    for decl, arr in extra_out:
        outs.append(decl)
        args_out.append(arr)
    for name, value in scalars.items():
        dt = 'float64' if name in wide else cname
        ins.append(f'{dt} s_{name}')
        args_in.append(np.dtype(dt).type(value))
    ctype = 'double' if cname == 'float64' else 'float'
    code = '\n'.join([f'typedef {ctype} KC;'] + loads + [core] + stores)
    kernel = _elementwise(tag, tuple(ins), tuple(outs), code)
    with master.device:
        kernel(*args_in, *args_out)


def _base(lr, wd, rescale_grad, clip_gradient, **more):
    return dict(lr=lr, wd=wd, rescale=rescale_grad,
                clip=common.off_if_not_positive(clip_gradient), **more)


def sgd_update(weight, grad, mom, lr, wd, rescale_grad, clip_gradient, momentum=0.0,
               nesterov=False, weight32=None):
    """MXNet SGD (mom is None when momentum is 0); nesterov=True is NAG."""
    if mom is None:
        core, tag = PREP_WD + ' w = w - s_lr * g;', 'sgd'
    elif nesterov:
        core, tag = PREP_WD + (' mom = s_momentum * mom + g;'
                               ' w = w - s_lr * (g + s_momentum * mom);'), 'nag_mom'
    else:
        core, tag = PREP_WD + ' mom = s_momentum * mom - s_lr * g; w = w + mom;', 'sgd_mom'
    _launch(tag, core, weight, grad, [('mom', mom)], weight32,
            _base(lr, wd, rescale_grad, clip_gradient, momentum=momentum))


def nag_update(weight, grad, mom, lr, wd, rescale_grad, clip_gradient, momentum=0.0,
               weight32=None):
    """MXNet NAG: mom = m*mom + g; w -= lr*(g + m*mom)."""
    sgd_update(weight, grad, mom, lr, wd, rescale_grad, clip_gradient, momentum, True, weight32)


def _moment_scalars(beta1, beta2, epsilon):
    return dict(beta1=beta1, beta2=beta2, omb1=1 - beta1, omb2=1 - beta2, epsilon=epsilon)


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
                          ' mom = s_momentum * mom - s_lr * (g / sqrt(var - mean * mean'
                          ' + s_epsilon)); w = w + mom;')
        states, tag = [('var', var), ('mean', mean), ('mom', mom)], 'rmsprop_centered'
    else:
        core = PREP_WD + (' var = s_rho * var + s_omr * (g * g);'
                          ' w = w - s_lr * (g / (sqrt(var) + s_epsilon));')
        states, tag = [('var', var)], 'rmsprop'
    core += ' w = kv_clip<KC>(w, s_clip_weights);'
    sc = _base(lr, wd, rescale_grad, clip_gradient, rho=rho, omr=1 - rho, momentum=momentum,
               epsilon=epsilon, clip_weights=common.off_if_not_positive(clip_weights))
    _launch(tag, core, weight, grad, states, weight32, sc)


_LAMB_RATIO = '''
double r1 = sqrt(p_r[0]), r2 = sqrt(p_r[1]);
if (s_lower > 0) r1 = r1 > s_lower ? r1 : s_lower;
if (s_upper > 0) r1 = r1 < s_upper ? r1 : s_upper;
double ratio = (r1 > 0 && r2 > 0 && isfinite(r1 / r2)) ? r1 / r2 : 1.0;
KC step = (KC)(s_lr * ratio);
w = w - step * p_d;'''


def lamb_update(weight, grad, mean, var, lr, wd, rescale_grad, clip_gradient, beta1=0.9,
                beta2=0.999, epsilon=1e-6, t=1, lower_bound=None, upper_bound=None,
                bias_correction=True, weight32=None):
    """LAMB: kernel 1 updates the moments and writes the direction d; two reductions give
    the norms (accumulated in double); kernel 2 applies w -= lr*ratio*d with the ratio formed
    on the device (no host synchronisation). Keep mean and var float32 (see numpy_kernels)."""
    cp = _cupy()
    master = weight32 if weight32 is not None else weight
    c1, c2 = common.lamb_coeffs(beta1, beta2, t, bias_correction)
    d = cp.empty(master.shape, dtype=common.compute_dtype_name(master))
    core1 = PREP + MOMENTS + (' p_d = (mean / s_c1) / (sqrt(var / s_c2) + s_epsilon)'
                              ' + s_wd * w;')
    sc = _base(lr, wd, rescale_grad, clip_gradient, c1=c1, c2=c2,
               **_moment_scalars(beta1, beta2, epsilon))
    _launch('lamb_phase1', core1, weight, grad, [('mean', mean), ('var', var)], weight32, sc,
            write_weight=False, extra_out=[(f'{d.dtype} p_d', d)])
    with master.device:
        sums = cp.stack([_sumsq_kernel()(master), _sumsq_kernel()(d)])
    bounds = dict(lr=lr, lower=common.off_if_not_positive(lower_bound),
                  upper=common.off_if_not_positive(upper_bound))
    _launch('lamb_phase2', _LAMB_RATIO, weight, None, [], weight32, bounds,
            extra_in=[('raw float64 p_r', sums), (f'{d.dtype} p_d', d)],
            wide=('lr', 'lower', 'upper'))


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
    cp = _cupy()
    with array.device:
        return cp.zeros(array.shape, dtype=dtype)


def widen(array):
    """A float32 copy of a float16 or bfloat16 (uint16) array: the master weight."""
    cp = _cupy()
    with array.device:
        if array.dtype == np.uint16:
            return (array.astype(cp.uint32) << 16).view(cp.float32)
        return array.astype(cp.float32)


def to_host(array):
    return array.get()


def from_host(array, like):
    cp = _cupy()
    with like.device:
        return cp.asarray(array)


def multi_update(calls):
    """Many small keys. Documented fallback: one launch per key, queued back to back on the
    stream without synchronising, so the cost is launch overhead (~5 us per key), not a
    device round trip. A packed pointer-table launch is future work.
    calls: [(fn_name, args, kwargs)]."""
    for name, args, kwargs in calls:
        globals()[name](*args, **kwargs)
