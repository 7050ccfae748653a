"""CUDA kernel of numpy_rows' rule (MXNet's GroupAdaGrad): one thread per row, which adds the
row's squares in order and then updates the row, the same operations as numpy_rows in the
same order, so the same bits. A grad given as two arrays (a sync round's last pushes) is
added as it is loaded, as numpy_rows adds it. Its source is made from dtype names alone (no
cupy needed: the tests compile it with NVRTC and run it on the CPU under g++)."""

import numpy as np

from ...errors import ShapeError
from . import common, cuda_launch as launch
from .cuda_source import CTYPES, GRADS, MAX_BLOCKS, PREAMBLE, THREADS
from .numpy_rows import row_width

__all__ = ['group_adagrad_update']

_SHORT = {'float32': 'f32', 'float64': 'f64', 'float16': 'f16', 'uint16': 'bf16'}
SCALARS = ('lr', 'rescale', 'clip', 'epsilon')   # the kernel's scalars, in its order
_KERNELS = {}   # dtype names -> RawKernel

# One row per thread (a grid-stride loop over rows): its squares added column by column,
# then its history, then its elements; `p_low` only where a master copy rounds into it.
_BODY = r'''
    for (long long r = (long long)blockIdx.x * blockDim.x + threadIdx.x; r < rows;
         r += (long long)gridDim.x * blockDim.x) {
        const long long base = r * width;
        KC ssq = 0;
        for (long long j = 0; j < width; ++j) {
            const KC g = kv_clip<KC>(GRAD * s_rescale, s_clip);
            ssq = ssq + g * g;
        }
        const KC h = kv_ld<KC>(p_history[r]) + ssq / (KC)width;
        kv_st<KC>(p_history[r], h);
        const KC d = sqrt(h + s_epsilon);
        for (long long j = 0; j < width; ++j) {
            const KC g = kv_clip<KC>(GRAD * s_rescale, s_clip);
            const KC w = kv_ld<KC>(p_w[base + j]) - (s_lr * g) / d;
            kv_st<KC>(p_w[base + j], w);
            LOW_STORE
        }
    }
}
'''


def kernel_name(compute, w, g, history, low=None, grads=1):
    """``kvps_group_adagrad_<compute>_<master>[_<low>]_<grad>[x2]_<history>`` (storage
    names; x2: a grad of two arrays)."""
    names = [w] + ([low] if low else []) + [g, history]
    return f'kvps_group_adagrad_{_SHORT[compute]}_' + '_'.join(
        _SHORT[n] + ('x2' if grads > 1 and i == len(names) - 2 else '')
        for i, n in enumerate(names))


def definition(compute, w, g, history, low=None, grads=1):
    """The kernel alone (after PREAMBLE) for these storage dtype names and ``grads`` arrays
    of the grad (1 or 2)."""
    params = ['const long long rows', 'const long long width',
              f'{CTYPES[w]}* __restrict__ p_w']
    params += [f'{CTYPES[low]}* __restrict__ p_low'] if low else []
    params += [f'const {CTYPES[g]}* __restrict__ p_{name}' for name in GRADS[:grads]]
    params += [f'{CTYPES[history]}* __restrict__ p_history']
    params += [f'const KC s_{name}' for name in SCALARS]
    grad = ' + '.join(f'kv_ld<KC>(p_{name}[base + j])' for name in GRADS[:grads])
    return '\n'.join([
        f'typedef {"double" if compute == "float64" else "float"} KC;',
        f'extern "C" __global__ void {kernel_name(compute, w, g, history, low, grads)}(',
        '        ' + ',\n        '.join(params) + ') {',
        _BODY.strip('\n').replace('GRAD', f'({grad})' if grads > 1 else grad).replace(
            'LOW_STORE', 'kv_st<KC>(p_low[base + j], w);' if low else '')])


def source(compute, w, g, history, low=None, grads=1):
    return PREAMBLE + definition(compute, w, g, history, low, grads)


def group_adagrad_update(weight, grad, history, lr, wd, rescale_grad, clip_gradient,
                         epsilon=1e-5, weight32=None):
    """numpy_rows.group_adagrad_update on cupy arrays (a device's, launched on its current
    stream); ``grad``: an array, or a tuple of two (added as they are loaded)."""
    master = weight32 if weight32 is not None else weight
    grads = common.grad_parts(grad, master, most=len(GRADS))
    common.check_arrays(weight, grads[0], (), weight32)
    if master.size == 0:
        return
    width = row_width(master.size, history.size)
    compute = common.compute_dtype_name(master)
    low = weight if weight32 is not None else None
    names = (compute, common.storage_name(master), common.storage_name(grads[0]),
             common.storage_name(history), common.storage_name(low) if low is not None else None,
             len(grads))
    kernel = _KERNELS.get(names)
    if kernel is None:
        kernel = _KERNELS[names] = launch.compiled(source(*names), kernel_name(*names))
    cdt = np.float64 if compute == 'float64' else np.float32
    scalars = common.kernel_scalars(lr, wd, rescale_grad, clip_gradient, epsilon=epsilon)
    written = [master] + ([low] if low is not None else [])
    if not all(a.flags.c_contiguous for a in (*written, history)):
        raise ShapeError('optimizer state and weights must be C-contiguous arrays')
    cp = launch.cupy()
    with master.device:
        grads = [g if g.flags.c_contiguous else cp.ascontiguousarray(g) for g in grads]
        arrays = [*written, *grads, history]
        blocks = max(1, min(-(-history.size // THREADS), MAX_BLOCKS))
        kernel((blocks,), (THREADS,), (np.int64(history.size), np.int64(width), *arrays,
                                       *(cdt(scalars[name]) for name in SCALARS)))
