"""The numpy kernels' passes: an update body run block by block in cache, low-precision arrays
widened and rounded back per block, and a big key's blocks split over threads; the bodies
several rules share (MXNet's gradient preprocessing, SGD's and Adam's steps).

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

from ...errors import ShapeError
from . import common, numpy_packing
from .common import bf16_to_f32, f32_to_bf16

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


def prep(g, w, tmp, sc, wd=True):
    """g = clip(rescale * g) (+ wd * w): MXNet's gradient preprocessing, in place in a block
    (``tmp``: a block of scratch)."""
    if sc.rescale != 1:
        g *= sc.rescale
    if sc.clip >= 0:
        np.clip(g, -sc.clip, sc.clip, out=g)
    if wd and sc.wd != 0:
        np.multiply(w, sc.wd, out=tmp)
        g += tmp


def sgd_body(w, g, mom, tmp, sc):
    """MXNet's SGD on a block (LARS and LBSGD run it with their own learning rate)."""
    prep(g, w, tmp[0], sc)
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


def first_moment(mean, g, tmp, sc):
    """mean = beta1 * mean + (1 - beta1) * g, in a block."""
    mean *= sc.beta1
    np.multiply(g, sc.omb1, out=tmp)
    mean += tmp


def adam_step(w, mean, var, tmp, sc, step):
    """w -= step * (mean / (sqrt(var) + epsilon)): Adam's step (and AdaBelief's)."""
    np.sqrt(var, out=tmp)
    tmp += sc.epsilon
    np.divide(mean, tmp, out=tmp)
    tmp *= step
    w -= tmp


def load(src, dst):
    if src.dtype == np.uint16:
        bf16_to_f32(src, out=dst)
    else:
        np.copyto(dst, src, casting='unsafe')


def store(src, dst):
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


def run(body, weight, grad, states, weight32, sc, write_weight=True, reduces=False):
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
        parts = [_flat(part, 'grad') for part in common.grad_parts(parts, master)]
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
                    load(a[lo:hi], b[:hi - lo])
                    views.append(b[:hi - lo])
            results.append(body(*views, [tmp[0][:hi - lo], tmp[1][:hi - lo]], sc))
            for i, (a, b) in enumerate(zip(arrays, bufs)):
                if b is not None and i != 1 and (i or write_weight):  # grad is never written
                    store(views[i], a[lo:hi])
            if cast_to is not None:
                store(views[0], cast_to[lo:hi])
        return results
    return split(blocks, n, blk if reduces else max(blk, SPLIT_BLOCK))


def _temporaries(blk, cdt):
    return [_scratch('tmp', blk, cdt), _scratch('tmp2', blk, cdt)]


def split(blocks, n, step):
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
        load(grad[lo:hi], out)
    return out


def _scratch(slot, size, cdt):
    """``size`` elements of this thread's block buffer for ``slot``, reused from call to call."""
    return numpy_packing.scratch(_local, slot, size, cdt, BLOCK)
