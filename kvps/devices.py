"""GPU values in device stores: sums on the device, transfers to and from host memory.

A GPU value is a torch CUDA tensor or a cupy array, recognised by its type's module (as
``arrays.is_torch`` does), so a CPU-only path imports neither library. torch does the device
work: a cupy array is viewed as a torch tensor through DLPack (``torch.from_dlpack``, no copy),
and summed, staged and written through that view. The optimizer kernels go the other way: a
CUDA tensor is viewed as a cupy array (``cupy.from_dlpack``, no copy) for ``_kernels``.

Where the backend's shared memory is page-locked (kvps.pinning; its ``device_route``), a push
is copied from the GPU straight into blocks of it and a pull straight out of it onto the GPU
(a Landing): one DMA each way. Elsewhere a push is staged in a fresh pinned buffer and a pull
lands in one (a copy more each way, the host's).
"""

import contextlib
import ctypes
import logging

import numpy as np

from . import arrays, pinning
from .errors import DTypeError
from .optimizer.kernels import is_cupy
from .wire.protocol import DTYPES

log = logging.getLogger('kvps')

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
    total = _device_sum(values)
    host = _staged(total)
    _synchronize([total.device])
    return host


def _device_sum(values):
    """The flat sum of one key's GPU values, on the first one's device (maybe its memory)."""
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
    return total


def _staged(flat):
    """A fresh pinned host copy of device tensor ``flat`` (not waited for), as numpy."""
    host = _host_buffer(flat.numel(), flat.dtype, flat.is_cuda)
    host.copy_(flat, non_blocking=True)
    return arrays.as_numpy(host)


class PushCopies:
    """The copies of one push's GPU values into the blocks the backend gave: page-locked
    shared memory (one DMA per block, on the caller's stream, behind the kernels that made
    the values), or GPU memory its servers map (the ipc route: a copy on the device).
    ``finish`` before the push is handed to the backend."""

    def __init__(self):
        self._devices = set()   # devices whose copies into host memory are waited for
        self._streams = set()   # streams of the copies into mapped GPU memory

    def copy(self, values, blocks, cuts=None, mapped=()):
        """The flat sum of ``values`` (a list of one copy per part for a key in parts,
        ``cuts``: their ``(start, stop)``), each in its block (a uint8 array of its bytes)
        or, where it has none or the block cannot be page-locked, in a fresh pinned buffer.
        ``mapped``: the ids of the blocks of GPU memory the servers map (the ipc route)."""
        total = _device_sum(values)
        flats = [total] if cuts is None else [total[a:b] for a, b in cuts]
        out = []
        for flat, block in zip(flats, blocks):
            if id(block) in mapped:
                self._streams.add(_stream_of(block))
            else:
                self._devices.add(total.device)
            out.append(_into_block(flat, block))
        return out[0] if cuts is None else out

    def held(self, flat, cuts=None):
        """What a push sends of a value lying in GPU memory the servers map (``flat``, its
        wire view): itself, or its parts at ``cuts``; its writes are recorded as copies are."""
        self._streams.add(_stream_of(flat))
        return flat if cuts is None else [flat[a:b] for a, b in cuts]

    def finish(self, recorded):
        """Wait for the copies into host memory (their streams synchronised); for those into
        mapped GPU memory, call ``recorded(stream)`` per stream they were issued on (the
        backend records its event there, which its servers' reads wait for): not waited
        for."""
        _synchronize(self._devices)
        for stream in self._streams:
            recorded(stream)


def _stream_of(block):
    """The stream a copy into device ``block`` runs on: torch's current one of its device (a
    handle), or None for the host stand-in's blocks (numpy)."""
    if not is_cupy(block):
        return None
    return _torch().cuda.current_stream(block.device.id).cuda_stream


def _into_block(flat, block):
    """``flat`` copied into ``block`` when it is page-locked (as numpy of its dtype), else
    into a fresh pinned buffer; not waited for. A cupy ``block`` is one of the worker's
    device segment (the ipc route): copied on the device, and handed on as a cupy array."""
    if is_cupy(block):
        _torch().from_dlpack(block).view(flat.dtype).copy_(flat, non_blocking=True)
        return block.view(DTYPES[arrays.dtype_name(flat)])
    spans = None if block is None else pinning.REGISTRY.spans(block.ctypes.data, block.nbytes)
    if spans is None:
        return _staged(flat)
    host = _torch().from_numpy(block).view(flat.dtype)
    _copy_spans(host, flat, spans)
    return arrays.as_numpy(host)


def _copy_spans(dst, src, spans):
    """``dst.copy_(src)`` (flat, of one dtype, asynchronous where the device allows), one copy
    per span of kvps.pinning's (bytes of the host side), so that each lies in one page-locked
    range."""
    size = dst.element_size()
    if len(spans) == 1 or any(at % size or n % size for at, n in spans):
        dst.copy_(src, non_blocking=True)
        return
    for at, n in spans:
        dst[at // size:(at + n) // size].copy_(src[at // size:(at + n) // size],
                                               non_blocking=True)


def direct(backend):
    """Whether GPU values take ``backend``'s page-locked shared memory (its ``device_route``),
    a DMA each way straight between it and the GPU; the route is logged at INFO the first
    time a GPU value moves."""
    _use_torch_locker()
    ok, how = backend.device_route(current_cuda_device())
    global _ROUTE_TOLD
    if not _ROUTE_TOLD:
        _ROUTE_TOLD = True
        log.info('device values: GPU <-> %s', how)
    return ok


_ROUTE_TOLD = False


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
    then wait for those copies, so the caller sees the values whatever stream it uses next.
    ``host`` may be the Landing that the backend wrote the targets through: it finishes."""
    if isinstance(host, Landing):
        host.finish()
        return
    # One host-to-device copy per target rather than one copy fanned out peer to peer: each
    # device reads the pinned buffer over its own link, and there is nothing to order.
    written = []
    for target in targets:
        view = as_torch(target)
        view.copy_(host.view(view.shape), non_blocking=True)
        written.append(view.device)
    _synchronize(written)


class Landing:
    """A pull of one key into targets all on GPUs, written straight from host memory as the
    answers come: a backend's copier sets ``landing[start:stop] = host array`` (the key's
    dtype: its page-locked segment, a server's arena, a frame) inside ``with
    landing.writing():``, which waits for the writes as it ends. They go into the first target
    of the key's dtype that is contiguous (else a buffer on its device); ``finish`` copies it
    into the others. ``group``: the Landings of the pull call."""

    def __init__(self, targets, dtype, group):
        torch = _torch()
        views = [as_torch(t) for t in targets]
        wire = getattr(torch, dtype)
        first = next((v for v in views if v.dtype == wire and v.is_contiguous()), None)
        if first is None:
            first = torch.empty(views[0].shape, dtype=wire, device=views[0].device)
        self._flat = first.view(-1)
        self._rest = [v for v in views if v is not first]
        self.dtype = np.dtype(DTYPES[dtype])
        self.itemsize, self.size = self.dtype.itemsize, self._flat.numel()
        self.group = group
        group.lands_on(self._flat.device)

    def __setitem__(self, where, source):
        dst = self._flat[where]
        if is_cupy(source):   # a block of the worker's device segment (the ipc route)
            dst.copy_(_torch().from_dlpack(source.view('uint8')).view(dst.dtype),
                      non_blocking=True)
            return
        spans = pinning.REGISTRY.spans(source.ctypes.data, source.nbytes)
        _copy_spans(dst, _host_tensor(source, dst.dtype), spans or [(0, source.nbytes)])

    def writing(self):
        """The context the writes of one answer are made in (its pull call's)."""
        return self.group.writing()

    def finish(self):
        """The pull is answered: copy into the other targets (cast where their dtype differs)
        and wait, so the caller sees the values whatever stream it uses next."""
        for view in self._rest:
            view.copy_(self._flat.view(view.shape), non_blocking=True)
        _synchronize([view.device for view in self._rest])


class Landings:
    """The Landings of one pull call: the GPUs they land on, and for each what the caller's
    stream had queued when the pull was made (an event: the targets may still be in use)."""

    def __init__(self):
        self._events = {}   # device -> event on the caller's stream

    def lands_on(self, device):
        if device.type == 'cuda' and device not in self._events:
            torch = _torch()
            self._events[device] = torch.cuda.Event()
            self._events[device].record(torch.cuda.current_stream(device))

    @contextlib.contextmanager
    def writing(self):
        """Writes made in it run on the writing thread's own stream of each device, behind
        the events; they are waited for as it ends."""
        torch, entered = _torch(), []
        try:
            for device, event in self._events.items():
                stream = _LANDING_STREAMS.get(device.index)
                if stream is None:
                    stream = _LANDING_STREAMS[device.index] = torch.cuda.Stream(device)
                stream.wait_event(event)
                context = torch.cuda.stream(stream)
                context.__enter__()
                entered.append((context, stream))
            yield
        finally:
            for context, stream in reversed(entered):
                stream.synchronize()
                context.__exit__(None, None, None)


_LANDING_STREAMS = {}   # device index -> the stream pulls land on there


def _host_tensor(source, dtype):
    """A CPU tensor of ``dtype`` over host array ``source``'s bytes. A read-only one (an arena,
    a frame) is reached by address (torch warns of read-only arrays): it is only read."""
    if not source.flags.writeable:
        source = np.frombuffer((ctypes.c_char * source.nbytes).from_address(source.ctypes.data),
                               np.uint8)
    return _torch().from_numpy(source.view(np.uint8)).view(dtype)


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


def current_cuda_device():
    """torch's current CUDA device (the one a worker's GPU values are on, as DDP sets it), or
    None without one."""
    torch = _torch()
    return torch.cuda.current_device() if torch.cuda.is_available() else None


def _use_torch_locker():
    """Page-lock with torch from now on (kvps.pinning), where there is a CUDA device."""
    registry = pinning.REGISTRY
    if registry.locker is None and _torch().cuda.is_available():
        registry.use(pinning.TorchLocker())


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
