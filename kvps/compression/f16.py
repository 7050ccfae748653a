"""float16 conversions at memory speed: numpy converts float16 one element at a time (about
25 ms for 16 M float32 elements on one core), torch with the CPU's conversion instructions
(about 2.5 ms), so the codecs' float16 casts go through torch.

torch is imported on a thread of its own when the first cast runs, and numpy casts until it is
ready: a server importing it on its loop would stop answering, heartbeats included, for the
seconds an import of torch takes on a busy host."""

import atexit
import math
import threading
import warnings

import numpy as np

from .. import allocator

# torch warns (once a process) that it cannot mark a tensor read-only: the casts here read
# received payloads, which are read-only buffers, and never write them
warnings.filterwarnings('ignore', 'The given NumPy array is not writable', UserWarning,
                        r'kvps\.compression\.f16')

SMALL = 4096   # elements below which numpy's cast costs less than reaching torch
FP16_MAX = 65504.0   # the largest finite float16
_STATE = {}    # 'torch': the module once imported (None where it is not installed); 'thread'
_STARTING = threading.Lock()


def _torch_module():
    """torch, or None while it is being imported (or where it is not installed)."""
    try:
        return _STATE['torch']
    except KeyError:
        with _STARTING:
            if 'thread' not in _STATE:   # only here: servers that never cast never load it
                _STATE['thread'] = threading.Thread(target=_import_torch, daemon=True,
                                                    name='kvps-torch-import')
                _STATE['thread'].start()
                # A daemon thread that takes the GIL back once Python's finalization has begun
                # is ended by pthread_exit, whose unwinding through torch's C++ frames aborts
                # the process ("terminate called without an active exception") after a script
                # that ran well; the exit hooks run before finalization, so one waits for it.
                # (Not a non-daemon thread: Python's exit would join it only after refusing
                # the exit hooks that torch's import registers, failing the import.)
                atexit.register(_STATE['thread'].join)
        return None


def prepare():
    """Start loading torch now (in the background) for the float16 casts to come: a worker
    calls it as it sets fp16 compression, so its first pushes need not wait on numpy."""
    _torch_module()


def loaded(timeout=None):
    """Start loading torch if not yet, and wait for it up to ``timeout`` seconds; returns
    whether the casts now go through it (benchmarks time them once it is there)."""
    _torch_module()
    _STATE['thread'].join(timeout)
    return _STATE.get('torch') is not None


def _import_torch():
    try:
        import torch
    except (ImportError, RuntimeError):   # not installed; or cut short by an exit (Python
        torch = None                      # refuses new exit hooks once it shuts down)
    allocator.exempt_imported()
    _STATE['torch'] = torch


def cast_into(out, values):
    """Write ``values`` into ``out`` (numpy arrays of one shape, either of them float16),
    rounding to nearest even as numpy's cast does (beyond float16's range: +-inf; NaN stays
    NaN, though its payload bits may differ). Returns ``out``."""
    # torch only between float32 and float16: it rounds float64 to float16 through float32,
    # twice, where numpy rounds once
    fast = values.size >= SMALL and {out.dtype.char, values.dtype.char} == {'e', 'f'}
    torch = _torch_module() if fast else None
    if torch is not None:
        try:
            torch.from_numpy(out).copy_(torch.from_numpy(values))
            return out
        except (ValueError, TypeError):   # negative strides, another byte order
            pass
    with np.errstate(over='ignore'):
        np.copyto(out, values, casting='unsafe')
    return out


def round_off(residual, out, added=None):
    """The fp16 codec's step in three passes of torch (four with ``added``, a float32 or
    float16 array of the residual's size added to it first): float16 ``out`` gets float32
    ``residual`` clipped to +-65504 (the largest finite float16) and rounded to nearest even,
    and ``residual`` keeps what that leaves (``residual -= out``, exact in float32). False
    (nothing done) where torch is not there yet, or for a small block: the caller does it
    with numpy, to the same bits."""
    torch = _torch_module() if residual.size >= SMALL else None
    if torch is None:
        return False
    r, o = torch.from_numpy(residual), torch.from_numpy(out)
    if added is not None:
        r.add_(torch.from_numpy(added))
    o.copy_(r)
    # Cast unclipped, checked after: below 65520 a value rounds to what its clip would (at
    # most 65504), and from there it becomes inf. The float16 sum (half the bytes aminmax
    # read before the cast, at a third of its cost) is finite unless an element is inf or
    # NaN, or the sum passes 65504: the float32 sum tells those apart.
    if not math.isfinite(o.sum()) and not math.isfinite(o.sum(dtype=torch.float32)):
        o.copy_(r.clamp(-FP16_MAX, FP16_MAX))   # (a NaN stays NaN: it travels)
    r.sub_(o)
    return True


def astype(values, dtype):
    """``values`` as a numpy array of ``dtype`` (``values`` itself when it is one)."""
    if values.dtype == dtype:
        return values
    return cast_into(np.empty(values.shape, dtype), values)
