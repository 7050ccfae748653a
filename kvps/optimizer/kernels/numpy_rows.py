"""numpy kernel of the rule that keeps one state element per row of a weight: MXNet's
GroupAdaGrad (numpy_kernels' contract, but the history holds one element per row).

The rows of a weight are given by the sizes: a weight of n elements with a history of r
elements has rows of n / r. The work goes in blocks of whole rows; each row's squares are
added in order, column after column (MXNet's fused kernel's order, and cuda_rows' per
thread), so numpy and CUDA give the same bits.
"""

import numpy as np

from ...errors import ShapeError
from . import common
from .numpy_blocks import BLOCK, load, store
from .numpy_packing import add_parts

__all__ = ['group_adagrad_update']

_COMPUTE_TYPES = {'float32': np.float32, 'float64': np.float64}


def row_width(size, rows):
    """Elements per row of a weight of ``size`` elements whose per-row state has ``rows``
    elements; ShapeError unless they fit."""
    if rows <= 0 or size % rows:
        raise ShapeError(f'a per-row optimizer state of {rows} elements does not fit a '
                         f'weight of {size} elements')
    return size // rows


def group_adagrad_update(weight, grad, history, lr, wd, rescale_grad, clip_gradient,
                         epsilon=1e-5, weight32=None):
    """MXNet GroupAdaGrad: g = clip(rescale*grad); h += (sum of the row's g^2) / width;
    w -= (lr*g) / sqrt(h + epsilon). ``history``: one element per row. wd is not used
    (the optimizer refuses it, as MXNet)."""
    master = weight32 if weight32 is not None else weight
    grads = common.grad_parts(grad, master)   # (a tuple: a sync round's last pushes)
    common.check_arrays(weight, grads[0], (), weight32)
    if master.size == 0:
        return
    width = row_width(master.size, history.size)
    cdt = _COMPUTE_TYPES[common.compute_dtype_name(master)]
    scalars = common.kernel_scalars(lr, wd, rescale_grad, clip_gradient, epsilon=epsilon)
    lr, rescale, clip, eps = (cdt(scalars[k]) for k in ('lr', 'rescale', 'clip', 'epsilon'))
    flat = [a.reshape(-1) for a in (master, history)]
    grads = [g.reshape(-1) for g in grads]
    low = weight.reshape(-1) if weight32 is not None else None
    step = max(1, BLOCK // width)
    for r0 in range(0, history.size, step):
        r1 = min(r0 + step, history.size)
        lo, hi = r0 * width, r1 * width
        g = np.empty(hi - lo, cdt)
        if len(grads) > 1:
            add_parts(grads, lo, hi, g)
        else:
            load(grads[0][lo:hi], g)
        g *= rescale
        if clip >= 0:
            np.clip(g, -clip, clip, out=g)
        rows = g.reshape(-1, width)
        squares = rows * rows
        ssq = squares[:, 0].copy()
        for j in range(1, width):     # in order, as one thread of MXNet's kernel adds them
            ssq += squares[:, j]
        ssq /= cdt(width)
        h = np.empty(r1 - r0, cdt)
        load(flat[1][r0:r1], h)
        h += ssq
        store(h, flat[1][r0:r1])
        h += eps
        np.sqrt(h, out=h)
        g *= lr
        rows /= h[:, None]
        w = np.empty(hi - lo, cdt)
        load(flat[0][lo:hi], w)
        w -= g
        store(w, flat[0][lo:hi])
        if low is not None:
            store(w, low[lo:hi])
