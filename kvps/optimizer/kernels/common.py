"""Host-side pieces shared by the numpy and CUDA kernels: argument checks and scalar constants."""

import functools
import math
import threading

import numpy as np

from ...errors import DTypeError, ShapeError

# uint16 storage means bfloat16 (numpy and cupy have no bfloat16 dtype); the name on the wire
# and in state dicts is 'bfloat16'.
BF16_STORAGE = 'uint16'
WEIGHT_DTYPES = ('float16', 'float32', 'float64', BF16_STORAGE)


def bf16_to_f32(u16, out=None, xp=np):
    """Widen bfloat16 bits (uint16) to float32 exactly. ``xp``: numpy, or cupy for cupy
    arrays (the same operations serve both)."""
    u16 = xp.asarray(u16)
    if out is None:
        out = xp.empty(u16.shape, np.float32)
    bits = out.view(np.uint32)
    xp.copyto(bits, u16, casting='unsafe')
    bits <<= 16
    return out


def f32_to_bf16(f32, out=None, xp=np):
    """Round float32 to bfloat16 bits (uint16), to nearest even; NaN stays a (quiet) NaN."""
    f32 = xp.ascontiguousarray(f32, dtype=np.float32)
    if out is None:
        out = xp.empty(f32.shape, np.uint16)
    bits = f32.view(np.uint32)
    rounded = bits >> 16
    rounded &= 1
    rounded += 0x7FFF
    rounded += bits  # cannot wrap for non-NaN inputs: 0xFF7FFFFF + 0x8000 < 2**32
    rounded >>= 16
    nan = xp.isnan(f32)
    if nan.any():
        rounded[nan] = (bits[nan] >> 16) | 0x40
    xp.copyto(out, rounded, casting='unsafe')
    return out


_STORAGE_NAMES = {}   # dtype object -> str(dtype): numpy builds that string in microseconds


def storage_name(array):
    """``str(array.dtype)`` of a numpy or cupy array ('float32', 'uint16', ...), cached: the
    kernels ask for it several times per key and update."""
    name = _STORAGE_NAMES.get(array.dtype)
    if name is None:
        name = _STORAGE_NAMES[array.dtype] = str(array.dtype)
    return name


def dtype_name(array):
    """The kvps dtype name of an array: 'bfloat16' for uint16 storage, else numpy's name."""
    name = storage_name(array)
    return 'bfloat16' if name == BF16_STORAGE else name


def compute_dtype_name(master):
    """Arithmetic runs in float64 for float64 weights, float32 for everything else."""
    return 'float64' if storage_name(master) == 'float64' else 'float32'


def check_arrays(weight, grad, states, weight32):
    """Raise ShapeError/DTypeError unless every array matches the weight's shape and the
    dtypes are ones the kernels handle. ``states``: (name, array or None) pairs; an int name
    reads 'state <name>'."""
    for label, arr in (('weight', weight), ('grad', grad), ('weight32', weight32)):
        if arr is not None and storage_name(arr) not in WEIGHT_DTYPES:
            raise DTypeError(f'{label} has dtype {arr.dtype}; supported: float16, float32, '
                             'float64, bfloat16 (as uint16 storage)')
    if weight32 is not None and storage_name(weight32) not in ('float32', 'float64'):
        raise DTypeError(f'weight32 (the master copy) must be float32, got {weight32.dtype}')
    shape = weight.shape
    for label, arr in (('grad', grad), ('weight32', weight32), *states):
        if arr is not None and arr.shape != shape and tuple(arr.shape) != tuple(shape):
            label = f'state {label}' if type(label) is int else label
            raise ShapeError(f'{label} has shape {tuple(arr.shape)}, weight has '
                             f'{tuple(shape)}')


def grad_parts(grad, master, most=None):
    """The arrays of a grad: ``(grad,)``, or a tuple ``grad`` (a sync round's last pushes,
    added in the update's pass) checked: two or more (``most`` at most), each of
    ``master``'s compute dtype (a sum in a narrower one would round otherwise) and shape."""
    if type(grad) is not tuple:
        return (grad,)
    if len(grad) < 2 or (most is not None and len(grad) > most):
        raise ShapeError('a grad given as parts needs two or more of them' + (
            f' (these kernels take at most {most})' if most is not None else ''))
    compute, shape = compute_dtype_name(master), tuple(master.shape)
    for part in grad:
        if storage_name(part) != compute or tuple(part.shape) != shape:
            raise DTypeError(f'grad parts must all be {compute} of shape {shape}; got '
                             f'{part.dtype} {tuple(part.shape)}')
    return grad


_ONES = (1.0,) * 64   # more than any kernel or call has scalars


def signed_key(values):
    """``values`` (re-iterable) and their signs, as a dict key that tells 0.0 from -0.0:
    equal as keys, they round differently (-0.0 * g flips the sign of a zero). A value that
    has no sign (None: a clip that is off) counts as 0."""
    try:
        return (*values, *map(math.copysign, _ONES, values))
    except TypeError:
        return (*values, *[math.copysign(1.0, v) if isinstance(v, (float, np.floating))
                           else 0.0 for v in values])


def off_if_not_positive(value):
    """MXNet's "None or <= 0 means off" as the kernels' convention: a negative number."""
    return float(value) if value is not None and value > 0 else -1.0


def kernel_scalars(lr, wd, rescale_grad, clip_gradient, **more):
    """The scalars of an update under the names its rule reads (numpy and CUDA alike)."""
    return dict(lr=lr, wd=wd, rescale=rescale_grad, clip=off_if_not_positive(clip_gradient),
                **more)


def moment_scalars(beta1, beta2, epsilon):
    """The decay rates of Adam-like moments, each with its complement, and epsilon."""
    return dict(beta1=beta1, beta2=beta2, omb1=1 - beta1, omb2=1 - beta2, epsilon=epsilon)


def adam_lr(lr, beta1, beta2, t):
    """MXNet Adam folds both bias corrections into the step size."""
    coef1 = 1.0 - beta1 ** t
    coef2 = 1.0 - beta2 ** t
    return lr * math.sqrt(coef2) / coef1


def adamw_coeffs(lr, wd, beta1, beta2, t):
    """torch AdamW: (weight decay factor, step size, sqrt of the second bias correction)."""
    return 1.0 - lr * wd, lr / (1.0 - beta1 ** t), math.sqrt(1.0 - beta2 ** t)


def lamb_coeffs(beta1, beta2, t, bias_correction):
    """Divisors of mean and var (1 when bias correction is off)."""
    if not bias_correction:
        return 1.0, 1.0
    return 1.0 - beta1 ** t, 1.0 - beta2 ** t


def lamb_ratio(sumsq_w, sumsq_d, lower_bound, upper_bound):
    """Trust ratio ||w|| / ||d||, with ||w|| bounded; 1 when either norm is 0 or not finite
    (MXNet's nan_or_zero rule). The CUDA kernel mirrors this on the device."""
    r1, r2 = math.sqrt(sumsq_w), math.sqrt(sumsq_d)
    if lower_bound is not None and lower_bound > 0:
        r1 = max(r1, lower_bound)
    if upper_bound is not None and upper_bound > 0:
        r1 = min(r1, upper_bound)
    if r1 > 0 and r2 > 0 and math.isfinite(r1 / r2):
        return r1 / r2
    return 1.0


def signum_decay(lr, wd, wd_lh, momentum):
    """Signum decays decoupled by wd_lh (wd goes into the gradient); signSGD by wd + wd_lh."""
    return 1.0 - lr * wd_lh if momentum != 0.0 else 1.0 - lr * (wd + wd_lh)


def lars_factor(sumsq_w, sumsq_g, eta, eps, wd, rescale):
    """MXNet's LARS scale of a key's learning rate: eta ||w|| / (||g|| rescale + wd ||w|| +
    eps), 1 when either norm is 0 (MXNet's multi_lars; the CUDA kernel mirrors it)."""
    wn = math.sqrt(sumsq_w)
    if wn > 0 and sumsq_g > 0:
        return eta * wn / (math.sqrt(sumsq_g) * rescale + wd * wn + eps)
    return 1.0


def lbsgd_lars(sumsq_w, sumsq_g, wd):
    """LBSGD's 'lars' warm-up multiplier, sqrt(|w|^2 / (|g|^2 + wd |w|^2)) bounded to
    [0.01, 100] (NaN stays NaN, as in MXNet; the CUDA kernel mirrors it)."""
    ratio = math.sqrt(sumsq_w / (sumsq_g + wd * sumsq_w + 1e-18))
    if ratio < 0.01:
        return 0.01
    if ratio > 100.0:
        return 100.0
    return ratio


@functools.lru_cache(maxsize=64)
def _momentum_schedule(beta1, schedule_decay):
    return [1.0]   # products of Nadam's momenta, grown on demand (see nadam_coeffs)


_GROWING = threading.Lock()   # kernels run from several threads (a store shared by threads)


def nadam_coeffs(beta1, beta2, schedule_decay, t):
    """Nadam's scalars at a key's ``t``-th update, as MXNet computes them in Python:
    (1 - mu_t, mu_{t+1}, 1 - prod mu_1..t, 1 - prod mu_1..t+1, 1 - beta2^t). MXNet keeps one
    product for all keys; kvps keeps it per key (see more_optimizers.Nadam)."""
    def mu(i):
        return beta1 * (1. - 0.5 * (pow(0.96, i * schedule_decay)))
    products = _momentum_schedule(beta1, schedule_decay)
    if len(products) <= t:
        with _GROWING:
            while len(products) <= t:   # the same multiplications, in order, as MXNet's
                products.append(products[-1] * mu(len(products)))
    mu_t, mu_next = mu(t), mu(t + 1)
    return 1. - mu_t, mu_next, 1. - products[t], 1. - products[t] * mu_next, 1. - beta2 ** t
