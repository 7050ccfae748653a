"""Fused optimizer updates on cupy arrays: one CUDA kernel per update, numpy_kernels' API.

Each update loads weight (or its fp32 master), grad and the states once, does the whole rule
in registers and stores once, so it runs at memory bandwidth. The arithmetic mirrors the numpy
reference operation by operation (same order, same host-computed constants, no FMA
contraction: --fmad=false), so results agree bit for bit where the operations are IEEE
(+ - * / sqrt); LAMB's norms are reductions in a different order and agree to rounding.
Kernels are cupy RawKernels over source from cuda_source; `multi_update` runs many small keys
in one launch. cupy is imported lazily: importing kvps never needs it.
"""

import functools
import threading

import numpy as np

from ...errors import ShapeError
from . import common, cuda_source as src

_OPTIONS = ('--fmad=false',)
MULTI_MAX = 1 << 16      # keys of up to this many elements share multi-tensor launches
MAX_KEYS_PER_LAUNCH = 65535   # gridDim.y
_UNFUSED = ('lamb_update',)   # reductions between two passes: launched key by key

PREP = 'g = kv_clip<KC>(g * s_rescale, s_clip);'
PREP_WD = PREP + ' g = g + s_wd * w;'
MOMENTS = 'mean = s_beta1 * mean + s_omb1 * g; var = s_beta2 * var + s_omb2 * (g * g);'

_collecting = threading.local()   # .plans: a list while multi_update gathers, else unset


def _cupy():
    import cupy  # lazily, only when an array already is a cupy array
    return cupy


def _compiled(code, name):
    # (cached by the callers, by what the source is made from: the source itself is ~3 KB)
    return _cupy().RawKernel(code, name, options=_OPTIONS)


_KERNELS = {}   # (plan signature, multi) -> RawKernel


def _kernel(plan, multi=False):
    """The compiled kernel of ``plan``, found by its signature: generating the source costs
    ~50 us, more than the launch itself, and the same few kernels run on every key."""
    key = (plan.signature(), multi)
    kernel = _KERNELS.get(key)
    if kernel is None:
        kernel = _KERNELS[key] = _compiled(src.source(plan, multi), plan.kernel_name(multi))
    return kernel


@functools.lru_cache(maxsize=None)
def _sumsq_kernel(dtype, name):
    return _compiled(src.sumsq_source(dtype), name)


def _contiguous(array, written):
    """The kernels index flat memory: inputs are made contiguous, outputs must be."""
    if array.flags.c_contiguous:
        return array
    if written:
        raise ShapeError('optimizer state and weights must be C-contiguous arrays')
    return _cupy().ascontiguousarray(array)


def _plan(tag, core, weight, grad, states, weight32, scalars, write_weight=True,
          extra_in=(), extra_out=(), raws=(), wide=()):
    """The Plan of one update: the master weight (``p_w``), the low-precision weight it
    rounds into, the grad, the states [(local name, array or None)], extra element-wise
    arrays [(name, array)], ``raws`` indexed freely, and the scalars (compute dtype, or
    double for names in ``wide``)."""
    common.check_arrays(weight, grad, states, weight32)
    master = weight32 if weight32 is not None else weight
    arrays, loads, stores = [('w', master, write_weight)], ['KC w = kv_ld<KC>(p_w);'], []
    if write_weight:
        stores.append('kv_st(p_w, w);')
        if weight32 is not None:  # the low-precision weight gets the rounded master
            arrays.append(('weight', weight, True))
            stores.append('kv_st(p_weight, w);')
    if grad is not None:
        arrays.append(('g', grad, False))
        loads.append('KC g = kv_ld<KC>(p_g);')
    for name, arr in states:
        if arr is not None:
            arrays.append((name, arr, True))
            loads.append(f'KC {name} = kv_ld<KC>(p_{name});')
            stores.append(f'kv_st(p_{name}, {name});')
    arrays += [(name, arr, False) for name, arr in extra_in]
    arrays += [(name, arr, True) for name, arr in extra_out]
    arrays = [(name, _contiguous(arr, written), written) for name, arr, written in arrays]
    body = '\n'.join(loads + [core] + stores)
    return src.Plan(tag, common.compute_dtype_name(master), int(master.size), arrays, body,
                    [(name, value, name in wide) for name, value in scalars.items()],
                    list(raws))


def _launch(*args, **kwargs):
    """Plan one update and run it now, or hand it to multi_update when that is gathering."""
    plan = _plan(*args, **kwargs)
    plans = getattr(_collecting, 'plans', None)
    if plans is not None:
        plans.append(plan)
    else:
        _run(plan)


def _run(plan):
    if plan.n == 0:
        return
    compute = np.float64 if plan.compute == 'float64' else np.float32
    scalars = [(np.float64 if wide else compute)(value) for _, value, wide in plan.scalars]
    args = [np.int64(plan.n), *(a for _, a, _ in plan.arrays), *(r for _, r in plan.raws),
            *scalars]
    with plan.arrays[0][1].device:
        _kernel(plan)((src.blocks_for(plan.n),), (src.THREADS,), tuple(args))


def _run_multi(plans):
    """One launch over the keys of ``plans`` (same signature, same device): a table row per
    key of its element count and array pointers, and a row of its scalars."""
    cp, first = _cupy(), plans[0]
    table = np.array([[p.n] + [a.data.ptr for _, a, _ in p.arrays] for p in plans], np.int64)
    scal = np.array([[float(v) for _, v, _ in p.scalars] for p in plans], np.float64)
    with first.arrays[0][1].device:
        kernel = _kernel(first, multi=True)
        # cupy's memory pool reuses these buffers only on this stream, after the kernel
        rows, scalars = cp.asarray(table), cp.asarray(scal)
        blocks = src.blocks_for(max(p.n for p in plans))
        kernel((blocks, len(plans)), (src.THREADS,), (rows, scalars))


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
    with master.device:
        d = cp.empty(master.shape, dtype=common.compute_dtype_name(master))
    core1 = PREP + MOMENTS + (' p_d = (mean / s_c1) / (sqrt(var / s_c2) + s_epsilon)'
                              ' + s_wd * w;')
    sc = _base(lr, wd, rescale_grad, clip_gradient, c1=c1, c2=c2,
               **_moment_scalars(beta1, beta2, epsilon))
    _launch('lamb_phase1', core1, weight, grad, [('mean', mean), ('var', var)], weight32, sc,
            write_weight=False, extra_out=[('d', d)])
    sums = _sums_of_squares(master, d)
    bounds = dict(lr=lr, lower=common.off_if_not_positive(lower_bound),
                  upper=common.off_if_not_positive(upper_bound))
    _launch('lamb_phase2', _LAMB_RATIO, weight, None, [], weight32, bounds,
            extra_in=[('d', d)], raws=[('r', sums)], wide=('lr', 'lower', 'upper'))


def _sums_of_squares(*arrays):
    """A float64 device array of each array's sum of squares, accumulated in double in a
    fixed order (the same result every run): per-block partials, then one block per row."""
    cp, width = _cupy(), src.THREADS
    with arrays[0].device:
        partial = cp.empty(len(arrays) * width, cp.float64)
        for row, arr in enumerate(arrays):
            dtype = str(arr.dtype)
            kernel = _sumsq_kernel(dtype, src.sumsq_name(dtype))
            kernel((width,), (width,), (arr, np.int64(arr.size), partial[row * width:]))
        sums = cp.empty(len(arrays), cp.float64)
        rows = _sumsq_kernel('float64', 'kvps_sum_rows')
        rows((len(arrays),), (width,), (partial, sums))
    return sums


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


def add_widened(a, b, out):
    """numpy_kernels.add_widened: a float32 sum of float32 or bfloat16 (uint16) arrays."""
    cp = _cupy()
    with out.device:
        return cp.add(*(x if x.dtype == np.float32 else widen(x) for x in (a, b)), out=out)


def narrow(src, out):
    """numpy_kernels.narrow: out = src cast to out's dtype, bfloat16 rounded to nearest even."""
    cp = _cupy()
    with out.device:
        if out.dtype == np.uint16:
            return common.f32_to_bf16(src, out, xp=cp)
        cp.copyto(out, src, casting='unsafe')
        return out


def to_host(array):
    return array.get()


def from_host(array, like):
    cp = _cupy()
    with like.device:
        return cp.asarray(array)


def multi_update(calls):
    """Many keys in few launches (multi-tensor apply). calls: [(fn_name, args, kwargs)].

    Each call is planned as usual; keys of up to MULTI_MAX elements whose plans share a
    kernel (same rule, dtypes and device) run in one launch, bigger keys and LAMB key by
    key. Every launch goes to the same stream, and a key met again is flushed first, so
    no key's updates reorder."""
    pending, seen = {}, set()   # (kernel signature, device) -> plans; weights pending

    def flush():
        for group in pending.values():
            for start in range(0, len(group), MAX_KEYS_PER_LAUNCH):
                chunk = group[start:start + MAX_KEYS_PER_LAUNCH]
                _run(chunk[0]) if len(chunk) == 1 else _run_multi(chunk)
        pending.clear()
        seen.clear()

    for name, args, kwargs in calls:
        fn, weight = globals()[name], args[0].data.ptr
        if weight in seen:
            flush()
        if name in _UNFUSED:
            fn(*args, **kwargs)
            continue
        seen.add(weight)
        for plan in _planned(fn, args, kwargs):
            if plan.n > MULTI_MAX:
                _run(plan)
            else:
                key = (plan.signature(), plan.arrays[0][1].device.id)
                pending.setdefault(key, []).append(plan)
    flush()


def _planned(fn, args, kwargs):
    """The plans ``fn`` would launch, gathered instead of launched."""
    _collecting.plans = []
    try:
        fn(*args, **kwargs)
        return _collecting.plans
    finally:
        _collecting.plans = None
