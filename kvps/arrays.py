"""Adapters between user values (numpy arrays, torch tensors) and numpy views, without copies.

torch is never imported here: tensors are recognised by their type's module, and viewed as
numpy through their own ``.numpy()``; bfloat16 tensors are viewed through their raw 16 bits.
"""

import numpy as np

from .errors import DTypeError, ShapeError
from .wire.protocol import DTYPES

_NUMPY_NAMES = {np.dtype(v).name: k for k, v in DTYPES.items() if k != 'bfloat16'}


def is_torch(value):
    return type(value).__module__.startswith('torch')


def is_array(value):
    """True for the array types kvps accepts as values."""
    return isinstance(value, np.ndarray) or (is_torch(value) and hasattr(value, 'dtype'))


_NAME_OF = {}   # dtype object (numpy or torch) -> wire name: numpy's .name costs microseconds


def dtype_name(value):
    """The wire dtype name of a numpy array or torch tensor."""
    name = _NAME_OF.get(value.dtype)
    if name is None:
        name = _NAME_OF[value.dtype] = _wire_name(value)
    return name


def _wire_name(value):
    if is_torch(value):
        name = str(value.dtype).replace('torch.', '')
        name = {'half': 'float16', 'float': 'float32', 'double': 'float64'}.get(name, name)
    else:
        dtype = np.dtype(value.dtype)
        name = dtype.name
        if not dtype.isnative:   # the wire carries native bytes; these would be misread
            raise DTypeError(f'unsupported byte order of {dtype.str}; convert with '
                             '.astype(dtype.newbyteorder("="))')
    if name not in DTYPES:
        raise DTypeError(f'unsupported dtype {name}; kvps carries {", ".join(DTYPES)}')
    return name


def shape_of(value):
    return tuple(int(d) for d in value.shape)


def as_numpy(value):
    """A numpy view sharing memory with ``value`` (bfloat16 as uint16 bit patterns)."""
    if isinstance(value, np.ndarray):
        return value
    if is_torch(value):
        if value.device.type != 'cpu':
            raise DTypeError(
                f'tensor on {value.device} given to a CPU path; use a *_device store type')
        tensor = value.detach()
        if dtype_name(tensor) == 'bfloat16':
            import torch  # only here: reinterpret bits, torch has no numpy bfloat16
            return tensor.view(torch.int16).numpy().view(np.uint16)
        return tensor.numpy()
    raise TypeError(f'expected a numpy array or torch tensor, got {type(value).__name__}')


def flat_copy(value, into=None):
    """A fresh contiguous 1-D copy: what push sends, so the caller's array is never touched.
    ``into``: a uint8 array of exactly the value's bytes to copy into (shared memory)."""
    arr = as_numpy(value)
    if into is None:
        return np.array(arr, copy=True, order='C').reshape(-1)
    flat = into.view(arr.dtype)
    # an assignment, not np.copyto (same dtype, so the same copy): a quarter of the overhead,
    # which a small key pays on every push
    flat.reshape(arr.shape)[...] = arr
    return flat


def sum_values(values, into=None):
    """Sum a list of same-shaped values (one per device) into a new flat numpy array (or
    ``into``, as flat_copy). bfloat16 values are summed in float32 and rounded once."""
    total = flat_copy(values[0], into)
    if dtype_name(values[0]) == 'bfloat16':
        from .optimizer.kernels import numpy_kernels as kernels  # bfloat16 arithmetic lives there
        wide = kernels.widen(total)
        for other in values[1:]:
            kernels.add_widened(wide, as_numpy(other).reshape(-1), out=wide)
        return kernels.narrow(wide, total)
    for other in values[1:]:
        np.add(total, as_numpy(other).reshape(-1), out=total)
    return total


def check_like(value, shape, dtype, key, what):
    """Raise ShapeError/DTypeError unless ``value`` matches the key's shape and dtype
    (``shape``: a tuple)."""
    if value.shape == shape and dtype_name(value) == dtype:   # the common case, kept cheap
        return
    got_shape, got_dtype = shape_of(value), dtype_name(value)
    if got_shape != tuple(shape):
        raise ShapeError(f'key {key!r}: {what} has shape {got_shape}, '
                         f'but the key was initialized with shape {tuple(shape)}')
    if got_dtype != dtype:
        raise DTypeError(f'key {key!r}: {what} has dtype {got_dtype}, '
                         f'but the key was initialized with dtype {dtype}')


def check_pull_target(value, shape, dtype, key):
    """Raise ShapeError unless pull target ``value`` has the key's shape, DTypeError unless
    its dtype is one kvps carries; returns its dtype name. Another dtype than the key's is
    cast into (MXNet's CopyFromTo casts a pull into an array of another dtype)."""
    if value.shape == shape and dtype_name(value) == dtype:   # the common case, kept cheap
        return dtype
    check_like(value, shape, dtype_name(value), key, 'pull target')
    return dtype_name(value)


def cast_into(target, target_dtype, source, source_dtype):
    """Write ``source`` (numpy, wire dtype ``source_dtype``, bfloat16 as its bits) into
    numpy view ``target`` (``target_dtype``), converted as C casts do (floats to integers
    toward zero), as MXNet and torch convert; bfloat16 goes through float32 and is rounded
    to nearest even."""
    from .optimizer.kernels.common import bf16_to_f32, f32_to_bf16  # (bfloat16 lives there)
    if source_dtype == 'bfloat16':
        source = bf16_to_f32(source)   # exact
    if target_dtype == 'bfloat16':
        source = f32_to_bf16(source.astype(np.float32, copy=False))
    np.copyto(target, source.reshape(target.shape), casting='unsafe')


def flat_view(out):
    """A 1-D view of numpy array ``out`` if it is contiguous, else None. For backends, whose
    pull targets come already checked (``writable``, by the store)."""
    return out.reshape(-1) if out.flags.c_contiguous else None


def writable(out, key=None):
    """A numpy view of pull target ``out``; ValueError if it is read-only or some of its
    elements share memory (an expanded or broadcast view: every write to one would land on
    the others, and torch's own ``copy_`` refuses it too), DTypeError if it is not in host
    memory. ``key``: named in the errors."""
    named = '' if key is None else f'key {key!r}: '
    try:
        arr = as_numpy(out)
    except DTypeError as exc:
        raise DTypeError(named + str(exc)) from None
    if not arr.flags.writeable:
        raise ValueError(f'{named}pull target is read-only')
    if not arr.flags.c_contiguous:
        check_own_memory(arr.shape, arr.strides, key)
    return arr


def check_own_memory(shape, strides, key=None):
    """ValueError if a pull target of this layout has elements that share memory (a step of
    0 along an axis of more than one element); strides in any unit."""
    if any(step == 0 and n > 1 for step, n in zip(strides, shape)):
        named = '' if key is None else f'key {key!r}: '
        raise ValueError(f'{named}pull target of shape {tuple(shape)} has elements that share '
                         f'memory (strides {tuple(strides)}: an expanded or broadcast view); '
                         'pull into an array of its own (.clone() or .copy())')
