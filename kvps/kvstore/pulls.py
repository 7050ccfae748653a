"""Where a pull writes: each key's targets checked, the one the backend fills (or a GPU
landing, or a host buffer), and the copies onto the rest, cast where their dtype differs."""

import numpy as np

from .. import arrays, devices, rows
from ..wire.protocol import DTYPES


def plan(keys, backend, key, out):
    """``(landings, backend items)`` for a pull into ``out``, every target checked first
    (a pull raises before it writes any of them); see _plan. A pull that StoreKeys.plain_call
    takes, into writable C-contiguous arrays (most pulls of many keys, and of one), skips its
    checks and landings: the backend writes each array itself."""
    plain = keys.plain_call(key, out)
    if plain is not None and all(t.flags.writeable and t.flags.c_contiguous for t in plain[1]):
        return [], list(zip(*plain))
    return _plan(keys, backend, key, out)


def _plan(keys, backend, key, out):
    """Every target checked first (a pull raises before it writes any of them). A key whose
    targets are all on GPUs is written onto them straight from the backend's page-locked
    shared memory, where it has some (a devices.Landing: landing ``(it, targets)``); other
    GPU targets are pulled into a pinned host buffer of the key's dtype and copied (cast)
    onto each device from there: landing ``(buffer, targets)``; host targets are pulled into
    the first of the key's dtype (a scratch array if none is), which feeds the rest, cast
    where their dtype differs: landing ``(None, [(numpy view, its dtype)], that first view,
    the key's dtype)``."""
    landings, items, straight, group = [], [], None, None
    for k, targets in keys.pairs(key, out):
        shape, dtype = keys.known(k)
        names = []
        for t in targets:
            if rows.is_row_sparse(t):
                raise TypeError(f'key {k!r}: pull into dense arrays or tensors (row-sparse '
                                'values are for push; row_sparse_pull pulls some rows)')
            names.append(arrays.check_pull_target(t, shape, dtype, k))
        gpu = keys.on_gpu(k, targets)   # first: it names the device store types
        views = devices.check_targets(targets, k)
        if gpu:
            on_gpus = all(view is None for view in views)
            if on_gpus and straight is None:
                straight = devices.direct(backend)
            if on_gpus and straight:
                group = group or devices.Landings()
                landing = devices.Landing(targets, dtype, group)
                items.append((k, landing, dtype))
            else:
                landing = devices.pull_buffer(targets, dtype)
                items.append((k, arrays.as_numpy(landing), dtype))
            landings.append((landing, targets))
            continue
        first = next((v for v, name in zip(views, names) if name == dtype), None)
        if first is None:
            first = np.empty(shape, DTYPES[dtype])
        landings.append((None, list(zip(views, names)), first, dtype))
        items.append((k, first, dtype))
    return landings, items


def landed_after(wait, landings):
    """What a pull_begin returns: ``wait`` for the answers, then ``land`` them (``wait``
    itself where nothing is left to land: one call less per pull of a loop of one-key
    calls)."""
    if not landings:
        return wait

    def landed():
        wait()
        land(landings)
    return landed


def land(landings):
    """Copy what a pull wrote into its first target or host buffer onto the rest."""
    for landing in landings:
        if landing[0] is not None:
            devices.land(*landing)
            continue
        _, targets, first, dtype = landing
        for view, name in targets:
            if view is first:
                continue
            if name == dtype:
                view[...] = first
            else:
                arrays.cast_into(view, name, first, dtype)
