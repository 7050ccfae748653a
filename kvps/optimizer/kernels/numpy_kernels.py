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
The work goes in blocks of BLOCK elements: every array is read and written once from main
memory while the handful of ufunc passes per block stay in cache. A key of at least
SPLIT_MIN elements has its blocks split over `set_threads` threads (numpy releases the GIL
in its loops): each element is computed as alone, so results are bit for bit the same.
"""

import concurrent.futures
import os
import threading
import types

import numpy as np

from ...errors import DTypeError, ShapeError
from . import common, numpy_packing
from .common import bf16_to_f32, f32_to_bf16  # noqa: F401  (part of this API)

BLOCK = 1 << 15  # 32 Ki elements: ~6 live blocks x 128 KiB stay in a 1-2 MiB L2
_COMPUTE_TYPES = {'float32': np.float32, 'float64': np.float64}
_local = threading.local()   # .buffers: {(slot, compute type): block buffer}
SPLIT_MIN = 1 << 18          # 1 MiB of float32: each of the threads gets 2+ blocks
# Blocks of a split update: each ufunc call hands the GIL over twice, which costs more than
# BLOCK elements of arithmetic when another thread waits for it (two threads ran slower than
# one on 32 Ki blocks; at 128 Ki, 1.9x faster). Updates whose bodies reduce (LAMB's norms)
# keep BLOCK: their per-block partial sums, added in order, must not change with threads.
SPLIT_BLOCK = 1 << 17
_pool = types.SimpleNamespace(threads=1, executor=None, made_for=None)   # made_for: (pid, threads)


def set_threads(threads):
    """Split each big key's update over ``threads`` threads (1: the caller's alone)."""
    if threads < 1:
        raise ValueError(f'threads must be at least 1, got {threads}')
    _pool.threads = threads


def _executor():
    # Made on first use, when the count changes, and again in a forked child, whose copy
    # has no threads behind it.
    wanted = (os.getpid(), _pool.threads)
    if _pool.made_for != wanted:
        if _pool.made_for is not None and _pool.made_for[0] == wanted[0]:
            _pool.executor.shutdown(wait=False)
        _pool.executor = concurrent.futures.ThreadPoolExecutor(
            _pool.threads - 1, thread_name_prefix='kvps-update')
        _pool.made_for = wanted
    return _pool.executor


def _load(src, dst):
    if src.dtype == np.uint16:
        bf16_to_f32(src, out=dst)
    else:
        np.copyto(dst, src, casting='unsafe')


def _store(src, dst):
    if dst.dtype == np.uint16:
        f32_to_bf16(src, out=dst)
    else:
        np.copyto(dst, src, casting='unsafe')


def _flat(array, label):
    if array.ndim == 1 and array.flags.c_contiguous:   # most weights, states and grads
        return array
    if not array.flags.c_contiguous:
        raise ShapeError(f'{label} must be C-contiguous for the numpy kernels')
    return array.reshape(-1)


SCALARS_KEPT = 256   # scalar sets remembered: the keys of a round mostly share one
_SCALARS = {}        # (compute dtype, names, values, their signs) -> namespace


def _scalars(cdt, values):
    """Scalars as the compute dtype, so numpy and CUDA round the same constants the same way.
    Remembered per set: converting them cost more than the arithmetic of a small key."""
    key = (cdt, *values, *common.signed_key(values.values()))
    sc = _SCALARS.get(key)
    if sc is None:
        if len(_SCALARS) >= SCALARS_KEPT:
            _SCALARS.clear()
        sc = _SCALARS[key] = types.SimpleNamespace(
            **{k: v if isinstance(v, bool) else cdt(v) for k, v in values.items()})
    return sc


def _run(body, weight, grad, states, weight32, sc, write_weight=True, reduces=False):
    """Apply body(w, g, *states, tmp, sc) block by block; returns the bodies' results (one
    per block of BLOCK elements when ``reduces``). ``grad`` may be a tuple of arrays of the
    compute dtype, added block by block in order (a sync round's sum made inside the
    update's pass: no merge buffer written and read back)."""
    parts = None
    if type(grad) is tuple:
        parts, grad = grad, grad[0]
    common.check_arrays(weight, grad, enumerate(states), weight32)
    master = weight32 if weight32 is not None else weight
    if master.size == 0:
        return []     # an empty key: nothing to update (blocks below are at least 1 long)
    cdt = _COMPUTE_TYPES[common.compute_dtype_name(master)]
    if parts is not None:
        parts = _summands(parts, grad, cdt)
    sc = _scalars(cdt, sc)
    arrays = [_flat(master, 'weight'), None if grad is None else _flat(grad, 'grad')]
    arrays += [None if s is None else _flat(s, 'state') for s in states]
    cast_to = _flat(weight, 'weight') if weight32 is not None and write_weight else None
    n = master.size
    blk = min(BLOCK, n)
    # a read-only grad (a zero-copy receive buffer) is widened into a block buffer instead,
    # and the parts of a tuple grad are summed into one
    scratched = [a is not None and (a.dtype != cdt or (i == 1 and not a.flags.writeable))
                 for i, a in enumerate(arrays)]
    scratched[1] = scratched[1] or parts is not None
    if n == blk and cast_to is None and not scratched[0] and not any(scratched[2:]):
        # one block and at most the grad to make: no slicing (most keys of a round)
        if scratched[1]:
            arrays[1] = _grad_block(arrays[1], parts, 0, n, _scratch(1, blk, cdt))
        return [body(*arrays, _temporaries(blk, cdt), sc)]

    def blocks(start, stop, step):
        """The bodies' results of the blocks of ``step`` elements in [start, stop), in this
        thread's buffers."""
        bufs = [_scratch(i, step, cdt) if need else None for i, need in enumerate(scratched)]
        tmp = _temporaries(step, cdt)
        results = []
        for lo in range(start, stop, step):
            hi = min(lo + step, stop)
            views = []
            for i, (a, b) in enumerate(zip(arrays, bufs)):
                if a is None:
                    views.append(None)
                elif b is None:
                    views.append(a[lo:hi])
                elif i == 1:
                    views.append(_grad_block(a, parts, lo, hi, b[:hi - lo]))
                else:
                    _load(a[lo:hi], b[:hi - lo])
                    views.append(b[:hi - lo])
            results.append(body(*views, [tmp[0][:hi - lo], tmp[1][:hi - lo]], sc))
            for i, (a, b) in enumerate(zip(arrays, bufs)):
                if b is not None and i != 1 and (i or write_weight):  # grad is never written
                    _store(views[i], a[lo:hi])
            if cast_to is not None:
                _store(views[0], cast_to[lo:hi])
        return results
    return _split(blocks, n, blk if reduces else max(blk, SPLIT_BLOCK))


def _temporaries(blk, cdt):
    return [_scratch('tmp', blk, cdt), _scratch('tmp2', blk, cdt)]


def _split(blocks, n, step):
    """``blocks(start, stop, block)`` over [0, n): whole in this thread in blocks of BLOCK, or
    for a big key in spans of whole blocks of ``step``, one span per thread, this one taking
    the first; results in block order."""
    threads = min(_pool.threads, -(-n // (2 * step))) if n >= SPLIT_MIN else 1
    if threads < 2:
        return blocks(0, n, min(BLOCK, n))
    per = -(-n // step // threads) * step
    spans = [(lo, min(lo + per, n), step) for lo in range(0, n, per)]
    others = [_executor().submit(blocks, *span) for span in spans[1:]]
    try:
        results = blocks(*spans[0])
    finally:   # never return while another thread still writes the arrays
        concurrent.futures.wait(others)
    for future in others:
        results += future.result()
    return results


def _grad_block(grad, parts, lo, hi, out):
    """Elements [lo, hi) of the grad in ``out``, in the compute dtype: the sum of ``parts``
    (in order), or ``grad`` widened."""
    if parts:
        numpy_packing.add_parts(parts, lo, hi, out)
    else:
        _load(grad[lo:hi], out)
    return out


def _scratch(slot, size, cdt):
    """``size`` elements of this thread's block buffer for ``slot``, reused from call to call."""
    return numpy_packing.scratch(_local, slot, size, cdt, BLOCK)


def _summands(parts, first, cdt):
    """The flat arrays of a tuple grad, checked: two or more, each like the first and of the
    compute dtype (summed in a wider dtype, a low-precision sum would round differently)."""
    if len(parts) < 2:
        raise ShapeError('a grad given as parts needs two or more of them')
    for part in parts:
        if part.dtype != cdt or tuple(part.shape) != tuple(first.shape):
            raise DTypeError(f'grad parts must all be {np.dtype(cdt).name} of shape '
                             f'{tuple(first.shape)}; got {part.dtype} {tuple(part.shape)}')
    return [_flat(part, 'grad') for part in parts]


def _base(lr, wd, rescale_grad, clip_gradient, **more):
    return dict(lr=lr, wd=wd, rescale=rescale_grad,
                clip=common.off_if_not_positive(clip_gradient), **more)


def _prep(g, w, tmp, sc, wd=True):
    """g = clip(rescale * g) (+ wd * w): MXNet's gradient preprocessing, in place."""
    if sc.rescale != 1:
        g *= sc.rescale
    if sc.clip >= 0:
        np.clip(g, -sc.clip, sc.clip, out=g)
    if wd and sc.wd != 0:
        np.multiply(w, sc.wd, out=tmp)
        g += tmp


def _sgd(w, g, mom, tmp, sc):
    _prep(g, w, tmp[0], sc)
    if mom is None:
        g *= sc.lr
        w -= g
    elif sc.nesterov:  # mom = m*mom + g; w -= lr*(g + m*mom)
        mom *= sc.momentum
        mom += g
        np.multiply(mom, sc.momentum, out=tmp[0])
        g += tmp[0]
        g *= sc.lr
        w -= g
    else:  # mom = m*mom - lr*g; w += mom
        mom *= sc.momentum
        g *= sc.lr
        mom -= g
        w += mom


def sgd_update(weight, grad, mom, lr, wd, rescale_grad, clip_gradient, momentum=0.0,
               nesterov=False, weight32=None):
    """MXNet SGD (mom is None when momentum is 0); nesterov=True is NAG."""
    sc = _base(lr, wd, rescale_grad, clip_gradient, momentum=momentum, nesterov=bool(nesterov))
    _run(_sgd, weight, grad, (mom,), weight32, sc)


def nag_update(weight, grad, mom, lr, wd, rescale_grad, clip_gradient, momentum=0.0,
               weight32=None):
    """MXNet NAG: mom = m*mom + g; w -= lr*(g + m*mom)."""
    sgd_update(weight, grad, mom, lr, wd, rescale_grad, clip_gradient, momentum, True, weight32)


def _moments(g, mean, var, tmp, sc):
    """mean = b1*mean + (1-b1)*g; var = b2*var + (1-b2)*g*g (clobbers g)."""
    mean *= sc.beta1
    np.multiply(g, sc.omb1, out=tmp)
    mean += tmp
    np.multiply(g, g, out=g)
    g *= sc.omb2
    var *= sc.beta2
    var += g


def _adam(w, g, mean, var, tmp, sc):
    _prep(g, w, tmp[0], sc)
    _moments(g, mean, var, tmp[0], sc)
    np.sqrt(var, out=tmp[0])
    tmp[0] += sc.epsilon
    np.divide(mean, tmp[0], out=tmp[0])
    tmp[0] *= sc.step
    w -= tmp[0]


def adam_update(weight, grad, mean, var, lr, wd, rescale_grad, clip_gradient, beta1=0.9,
                beta2=0.999, epsilon=1e-8, t=1, weight32=None):
    """MXNet Adam: w -= lr*sqrt(1-b2^t)/(1-b1^t) * mean/(sqrt(var)+eps)."""
    sc = _base(lr, wd, rescale_grad, clip_gradient, beta1=beta1, beta2=beta2, omb1=1 - beta1,
               omb2=1 - beta2, epsilon=epsilon, step=common.adam_lr(lr, beta1, beta2, t))
    _run(_adam, weight, grad, (mean, var), weight32, sc)


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
    sc = _base(lr, wd, rescale_grad, clip_gradient, beta1=beta1, beta2=beta2, omb1=1 - beta1,
               omb2=1 - beta2, epsilon=epsilon, decay=decay, step=step, bc2sqrt=bc2sqrt)
    _run(_adamw, weight, grad, (mean, var), weight32, sc)


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
    _run(_adagrad, weight, grad, (history,), weight32, sc)


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
    _run(_rmsprop, weight, grad, (var, mean, mom), weight32, sc)


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
    sc = _base(lr, wd, rescale_grad, clip_gradient, beta1=beta1, beta2=beta2, omb1=1 - beta1,
               omb2=1 - beta2, epsilon=epsilon, c1=c1, c2=c2)
    sums = _run(_lamb_moments, weight, grad, (mean, var), weight32, sc, write_weight=False,
                reduces=True)
    ratio = common.lamb_ratio(sum(s[0] for s in sums), sum(s[1] for s in sums),
                              lower_bound, upper_bound)
    sc['step'] = lr * ratio
    _run(_lamb_apply, weight, None, (mean, var), weight32, sc)


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
    _run(_ftrl, weight, grad, (z, n), weight32, sc)


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
    _run(_signum, weight, grad, (mom,), weight32, sc)


def _test(w, g, tmp, sc):
    g *= sc.rescale
    w += g


def test_update(weight, grad, lr, wd, rescale_grad, clip_gradient, weight32=None):
    """MXNet's test optimizer: w += rescale_grad * grad."""
    _run(_test, weight, grad, (), weight32, _base(lr, wd, rescale_grad, clip_gradient))


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
        _store(flat_src[lo:lo + BLOCK], flat_out[lo:lo + BLOCK])
    return out


def to_host(array):
    return np.ascontiguousarray(array)


def from_host(array, like):
    return np.ascontiguousarray(array)


def multi_update(calls):
    """Many keys at once, calls: [(fn_name, args, kwargs)], args = (weight, grad, *states):
    small keys of one elementwise rule and equal scalars in packed passes (numpy_packing)."""
    numpy_packing.multi_update(calls, globals())
