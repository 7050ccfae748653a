"""Where a shard keeps each key's arrays: host memory (numpy) or a CUDA device (cupy).

The Shard never calls numpy or cupy directly for its weights, merge buffers and received
gradients; it asks the key's arrays (Storage.for_key). Host arrays (host_arrays.py) read wire
buffers in place and lend the weight itself to a pull reply (copy-on-write leases); big ones
live in the server's shared-memory arena once it has one, where workers on this host copy
pulls straight out of them. Device arrays (device_arrays.py) copy a received buffer to the
device once and copy the weight out once for each pull, straight between the device and the
workers' page-locked shared memory where they are on this host.
"""

import logging
import os

from ..errors import ConfigError
from ..optimizer.kernels import numpy_kernels
from .device_arrays import CudaArrays, HostStandIn
from .host_arrays import HostArrays

__all__ = ['CudaArrays', 'HostArrays', 'HostStandIn', 'Storage', 'for_device', 'gpu_if_present',
           'use_update_threads']

log = logging.getLogger('kvps.server')


class Storage:
    """Where a new key goes: ``default`` for keys of host-side stores; for keys a device-side
    store (dist_sync_device, dist_async_device) initialises, ``device``, or what ``probe``
    finds the first time one is asked for (None from it: the default)."""

    def __init__(self, default, device=None, probe=None):
        self.default = default
        self._device, self._probe = device, probe
        self._told = False   # the device values' route is logged once, when the first comes

    def use_arena(self, arena):
        """Host arrays of MIN_BYTES and more come from ``arena`` from now on."""
        for arrays in self._placements():
            arrays.arena = arena

    def for_key(self, wants_device):
        if not wants_device:
            return self.default
        if not self._told:
            if self._device is None:
                self._device = (self._probe() if self._probe else None) or self.default
            self._told = True
            log.info('device values: %s', self._device.route)
        return self._device

    @property
    def sharing(self):
        """The kvps.wire.device_sharing that workers' device segments are mapped with: the
        device-store keys' arrays' (probed now, if not yet), None where they are on the host
        or are not shared."""
        return self.for_key(True).sharing

    def order_event(self):
        """This server's interprocess event (its device arrays'), which the workers that map
        their device segments here wait for before they reuse or read them."""
        return self.for_key(True).order_event()

    @property
    def on_device(self):
        """Whether some keys may live on a device (their pulls are copied out of it)."""
        return self._device is not None and self._device.on_device

    def settle(self):
        """Wait for the copies the arrays have made (a device's): before a worker's segment
        is released, or one it replaces mapped."""
        for arrays in self._placements():
            arrays.settle()

    def order(self):
        """Before answers go out: what they depend on waited for, or ordered behind this
        server's interprocess event where only the device's work is out
        (kvps.server.transfers)."""
        for arrays in self._placements():
            arrays.order()

    def _placements(self):
        """The arrays keys are kept in: the default, and the device's where it is another."""
        if self._device is None or self._device is self.default:
            return (self.default,)
        return self.default, self._device


def gpu_if_present(ipc='auto'):
    """CUDA placement if this server can use a GPU, else None (logged once, not an error:
    a device-side store's values are the same wherever a server keeps them). ``ipc``:
    KVPS_IPC."""
    try:
        return CudaArrays(ipc)
    except ConfigError as exc:
        log.info('a device-side store asked for the GPU; this server has none usable (a GPU '
                 'placement %s)', exc)
        return None


def for_device(setting, ipc='auto'):
    """The storage for a KVPS_SERVER_DEVICE value: 'cpu' and 'cuda' put every key there
    (cuda fails at start without a GPU); 'auto' puts device-side stores' keys on a GPU when
    this server has one, probing (importing cupy) only when such a key arrives. KVPS_IPC
    ``ipc`` 'host' (tests) puts them in GPU shards emulated on the host instead, unless the
    setting is 'cpu'."""
    if ipc == 'host' and setting != 'cpu':
        return Storage(HostArrays(), HostStandIn())
    if setting == 'auto':
        return Storage(HostArrays(), probe=lambda: gpu_if_present(ipc))
    try:
        arrays = CudaArrays(ipc) if setting == 'cuda' else HostArrays()
    except ConfigError as exc:
        raise ConfigError(f'KVPS_SERVER_DEVICE=cuda: {exc}') from None
    return Storage(arrays, arrays)


def use_update_threads(setting):
    """Split big host updates over threads (KVPS_UPDATE_THREADS); 'auto': the cores this
    process may run on, at most 4 (the memory bandwidth a few cores reach). Returns the
    count."""
    if setting == 'auto':
        cores = (len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity')
                 else os.cpu_count() or 1)
        setting = min(4, cores)
    numpy_kernels.set_threads(setting)
    return setting
