"""An Updater's per-key state as plain data: checked against the weight it is for, and packed
for checkpoints and state files (msgpack-able dicts of dtype, shape and bytes)."""

import numpy as np

from ..errors import ConfigError, DTypeError, ShapeError
from .kernels import common, kernels_for

STATE_FORMAT = 'kvps.updater.states/1'
_LOW_PRECISION = ('float16', 'uint16')  # uint16 storage is bfloat16
STATE_DTYPES = {'float16': np.float16, 'float32': np.float32, 'float64': np.float64,
                'bfloat16': np.uint16}
STATE_ITEMSIZE = {name: np.dtype(t).itemsize for name, t in STATE_DTYPES.items()}


def unpacked_state(key, part, state):
    """``((key, part), {name: array})`` of one saved state; the error names the key."""
    try:
        return (key, int(part)), {str(n): unpack(a) for n, a in state.items()}
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise ConfigError(f'set_states: key {key!r} part {part}: malformed optimizer state '
                          f'({exc})') from None


def misfit(opt, key, part, state, weight, rows=None):
    """``(error type, message)`` if ``state`` was not made for ``weight`` under ``opt`` (a
    state of another job's key: another dtype, shape or multi_precision), else None.
    ``rows``: the key's rows, the shape of the states ``opt.row_states`` names."""
    where, dtype = f'key {key!r} part {part}', common.dtype_name(weight)
    if wants_master(opt, weight) != ('weight32' in state):
        return DTypeError, (
            f'{where}: the optimizer state holds an fp32 master weight, but this {dtype} key '
            'keeps none (only float16 and bfloat16 keys keep one, under multi_precision)'
            if 'weight32' in state else
            f'{where}: the optimizer state holds no fp32 master weight, but this {dtype} key '
            'keeps one under multi_precision')
    want = np.dtype(state_dtype(opt, weight))
    for name, arr in state.items():
        if opt.runs_python and name != 'weight32':
            continue   # made by its create_state: python_rules.fit checks them
        shape = (rows,) if name in opt.row_states else tuple(weight.shape)
        if tuple(arr.shape) != shape:
            return ShapeError, (f'{where}: optimizer state {name!r} has shape '
                                f'{tuple(arr.shape)}, the key part {tuple(weight.shape)} '
                                f'keeps {shape}')
        need = np.dtype(np.float32) if name == 'weight32' else want
        if arr.dtype != need:
            return DTypeError, (f'{where}: optimizer state {name!r} is '
                                f'{dtype_label(arr.dtype)}, but the key is {dtype}, whose state '
                                f'is {dtype_label(need)}')
    return None


def state_rows(opt, key, part, shape_of, weight):
    """The rows of ``key`` that ``opt``'s per-row states hold one element each for (None
    when it keeps none): of its shape, else of ``weight``'s; ShapeError unless the key is
    a whole 2-D weight (MXNet's GroupAdaGrad asserts two dimensions)."""
    if not opt.row_states:
        return None
    shape = shape_of(key, part) or (weight.shape if weight.ndim > 1 else None)
    if shape is None or len(shape) != 2:
        what = f'a key of shape {tuple(shape)}' if shape is not None else \
            'a flat weight of no known shape (a part of a key split across servers)'
        raise ShapeError(f'key {key!r}: {type(opt).__name__} keeps one history per row of a '
                         f'2-D weight (as MXNet), but this is {what}')
    return int(shape[0])


def wants_master(opt, weight):
    return opt.multi_precision and common.storage_name(weight) in _LOW_PRECISION


def state_dtype(opt, weight):
    low = common.storage_name(weight) in _LOW_PRECISION
    return np.float32 if low and (opt.multi_precision or opt.fp32_states) else weight.dtype


def dtype_label(dtype):
    """kvps's name of a numpy dtype: uint16 storage is bfloat16."""
    return 'bfloat16' if dtype == np.uint16 else str(dtype)


def check_state_names(opt, restored):
    """States saved under another optimizer (adam's mean and var for sgd with momentum, say)
    would be silently ignored or fail every update: refuse them at load."""
    want = set(opt.state_names())
    for (key, part), state in restored.items():
        have = set(state) - {'weight32'}
        if have != want:
            raise ConfigError(
                f'set_states: key {key!r} part {part} holds optimizer state '
                f'{sorted(have) or "none"}, but {opt.name} keeps {sorted(want) or "none"}: the '
                'states were saved under another optimizer. Set that optimizer first, or save '
                'with dump_optimizer=True so that the file carries it')


def pack(array):
    host = kernels_for(array).to_host(array)
    return {'dtype': common.dtype_name(host), 'shape': list(host.shape), 'data': host.tobytes()}


def unpack(blob):
    dtype = STATE_DTYPES.get(blob.get('dtype'))
    if dtype is None:
        raise ValueError(f'unknown state dtype {blob.get("dtype")!r}')
    shape = tuple(int(s) for s in blob['shape'])
    data = blob['data']
    if len(data) != int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize:
        raise ValueError(f'state data of {len(data)} bytes does not fit shape {shape}')
    return np.frombuffer(data, dtype=dtype).reshape(shape).copy()
