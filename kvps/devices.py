"""GPU values in device stores: sums on the device, transfers through pinned host memory.

A GPU value is a torch CUDA tensor or a cupy array, recognised by its type's module (as
``arrays.is_torch`` does), so a CPU-only path imports neither library. torch does the device
work: a cupy array is viewed as a torch tensor through DLPack (``torch.from_dlpack``, no copy),
and summed, staged and written through that view. The optimizer kernels go the other way: a
CUDA tensor is viewed as a cupy array (``cupy.from_dlpack``, no copy) for ``_kernels``.
"""

import numpy as np

from . import arrays
from .errors import DTypeError
from .optimizer.kernels import is_cupy

DEVICE_TYPES = ('device', 'dist_sync_device', 'dist_async_device')


def on_gpu(value):
    """True for a cupy array or a torch CUDA tensor; imports nothing."""
    if type(value) is np.ndarray:   # the common case, answered first
        return False
    if is_cupy(value):
        return True
    return arrays.is_torch(value) and getattr(getattr(value, 'device', None), 'type', '') == 'cuda'


def is_value(value):
    """True for every value type a store accepts: numpy arrays, torch tensors, cupy arrays."""
    return arrays.is_array(value) or is_cupy(value)


def takes_device_path(values, device_store, store_type, key):
    """Whether one key's values (or pull targets) go through the GPU path: any of them is on a
    GPU. Only device stores take that path; others raise a DTypeError that names them."""
    for gpu in values:
        if on_gpu(gpu):
            break
    else:
        return False
    if not device_store:
        where = f'cuda:{gpu.device.id}' if is_cupy(gpu) else str(gpu.device)
        raise DTypeError(f'key {key!r}: a value lives on {where}, but a {store_type!r} store '
                         f'works on host arrays; use a device store type '
                         f'({", ".join(DEVICE_TYPES)}) or move the value to the CPU')
    return True


def host_sum(values):
    """What push sends for one key's GPU values: a fresh flat host copy of their sum.

    The sum runs on the device of the first value (the others are copied onto it, peer to
    peer; bfloat16 is summed in float32 and rounded once, as servers and host values sum it),
    then lands in a pinned host buffer, and the stream is synchronised before the buffer is
    handed to the backend. The caller's memory is only read."""
    tensors = [as_torch(v).reshape(-1) for v in values]
    total = tensors[0]
    if len(tensors) > 1:
        torch = _torch()
        wide = total.dtype == torch.bfloat16
        # reshape may return the caller's memory: never add into it
        total = total.float() if wide else total.clone()
        for other in tensors[1:]:
            total.add_(other.to(total.device))
        if wide:
            total = total.to(torch.bfloat16)
    host = _host_buffer(total.numel(), total.dtype, total.is_cuda)
    host.copy_(total, non_blocking=True)
    _synchronize([total.device])
    return arrays.as_numpy(host)


def check_targets(targets, key):
    """Raise unless every pull target of ``key`` can be written (ValueError: read-only, or
    elements that share memory; DTypeError: neither host memory nor a GPU), so that a pull
    raises before it writes any target rather than after writing some of them. Returns
    their numpy views, None for a GPU target."""
    views = []
    for target in targets:
        if on_gpu(target):
            view = as_torch(target)
            arrays.check_own_memory(view.shape, view.stride(), key)
            views.append(None)
        else:
            views.append(arrays.writable(target, key))
    return views


def pull_buffer(targets, dtype):
    """A fresh host buffer of wire dtype ``dtype`` (the key's) for the backend to pull one key
    into: pinned when a target is on a GPU, so that the copies to the devices (which cast to
    a target of another dtype) can run asynchronously (targets checked with
    ``check_targets`` first)."""
    torch = _torch()
    views = [as_torch(t) for t in targets]
    return _host_buffer(views[0].numel(), getattr(torch, dtype), any(v.is_cuda for v in views))


def land(host, targets):
    """Copy a pulled host buffer into every target (cupy arrays through their DLPack view),
    then wait for those copies, so the caller sees the values whatever stream it uses next."""
    # One host-to-device copy per target rather than one copy fanned out peer to peer: each
    # device reads the pinned buffer over its own link, and there is nothing to order.
    written = []
    for target in targets:
        view = as_torch(target)
        view.copy_(host.view(view.shape), non_blocking=True)
        written.append(view.device)
    _synchronize(written)


def put_rows(target, ids, values):
    """Write ``values`` (a host array, len(ids) x width, bfloat16 as uint16) into rows
    ``ids`` of ``target`` (any array or tensor of the key's shape, on a GPU or strided on
    the host)."""
    torch = _torch()
    view = as_torch(target)
    values = np.ascontiguousarray(values)
    picked = torch.from_numpy(values.view(np.int16) if values.dtype == np.uint16 else values)
    if view.dtype == torch.bfloat16:
        picked = picked.view(torch.bfloat16)
    index = torch.from_numpy(ids).to(view.device)
    view[index] = picked.reshape(len(ids), *view.shape[1:]).to(view.device)
    _synchronize([view.device])


def _host_buffer(numel, dtype, pinned):
    # A fresh buffer per push and per pull, never one kept per key: the worker client sends a
    # pushed buffer without copying and may hold it until the servers acknowledge the push, so
    # a per-key buffer refilled by the next push could be overwritten in flight. torch's caching
    # host allocator recycles a pinned block only once its last reference (the backend's) is
    # gone and its recorded copies have finished, which gives reuse without that hazard.
    torch = _torch()
    return torch.empty(numel, dtype=dtype, pin_memory=pinned)


def _synchronize(devices):
    torch = _torch()
    for device in set(devices):
        if device.type == 'cuda':
            torch.cuda.current_stream(device).synchronize()


def as_torch(value):
    """A torch tensor sharing memory with ``value``: cupy arrays through DLPack (no copy),
    numpy arrays through ``from_numpy``, tensors detached (pulls write into parameters)."""
    torch = _torch()
    if is_cupy(value):
        return torch.from_dlpack(value)
    if isinstance(value, np.ndarray):
        return torch.from_numpy(value)
    return value.detach()


def kernel_view(tensor, read_only=False):
    """A flat array that the optimizer kernels update in place, sharing ``tensor``'s memory:
    numpy for a host tensor, cupy (through DLPack) for a CUDA one. bfloat16 is seen as its
    uint16 bits, the kernels' bfloat16 storage (DLPack consumers refuse bfloat16).
    ``read_only``: for a gradient the caller keeps. The numpy kernels use a writable grad as
    scratch and copy a read-only one block by block, in cache; the CUDA kernels never write
    the grad."""
    if not on_gpu(tensor):
        view = arrays.as_numpy(tensor).reshape(-1)   # always a new array object: marking it
        if read_only:                                 # leaves the tensor's array writable
            view.flags.writeable = False
        return view
    cupy = require_cupy()
    flat = tensor.detach().reshape(-1)
    if arrays.dtype_name(flat) == 'bfloat16':
        return cupy.from_dlpack(flat.view(_torch().int16)).view(cupy.uint16)
    return cupy.from_dlpack(flat)


def require_cupy():
    """cupy, imported now (only GPU paths call this), or an ImportError that says why."""
    try:
        import cupy
    except ImportError:
        raise ImportError('updating CUDA parameters on this worker runs kvps\'s CUDA kernels '
                          'through cupy, which is not installed: pip install "kvps[cuda]", or '
                          'let the servers update (update_on_kvstore with a dist_*_device '
                          'store)') from None
    return cupy


def _torch():
    try:
        import torch
    except ImportError:
        raise ImportError('device stores handle GPU values with torch (cupy arrays are viewed '
                          'as torch tensors through DLPack); install torch') from None
    return torch
