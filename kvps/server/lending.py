"""Shared memory as requests meet it: ATTACH, pushes read in place, pulled values lent, placed."""

from typing import NamedTuple

import numpy as np

from ..compression.half import ROUNDED, pulled_dtype, round_pulled
from ..errors import ConfigError, ProtocolError
from ..wire import protocol as P
from ..wire.identities import identity_label, members_on, worker_rank
from ..wire.items import DataItem, new
from ..wire.shm import segment_bytes
from .regions import Regions

IN_FRAME = DataItem(at=None, lent=None)


class Delivery(NamedTuple):
    """How the values of one DATA answer travel."""
    items: list          # a DataItem per key part, in the order asked
    frames: list         # the values sent as data frames (uncopied), in the items' order
    framed: list         # the Leases of those frames (the transport's tracker ends them)
    lease: object        # the number of the lent values' lease (the header's), or None


class Lending:
    """The workers' segments and the server's arena (Regions) as requests use them; new
    host arrays of ``storage`` come from the arena once there is one."""

    def __init__(self, regions, storage, hosts=None):
        """``hosts``: ``(this server's host, {worker rank: its host})`` as the job's welcome
        lists them (None: unknown), which decides whose device handles it opens."""
        self.regions, self._storage, self._hosts = regions, storage, hosts

    @classmethod
    def on_host(cls, host, config, welcome, storage):
        """The Lending of a server on ``host`` in the job ``welcome`` describes: its arena
        takes its share of /dev/shm among the job's processes on this host when
        KVPS_SHM_BYTES=auto (it reserves pages only as weights fill it; weights it cannot
        hold are copied into a worker's segment for every pull)."""
        workers = members_on(welcome, host, 'worker')
        size = segment_bytes(config.shm_bytes, workers + members_on(welcome, host, 'server'))
        hosts = {n['rank']: n['host'] for n in welcome.get('nodes', ()) if n['role'] == 'worker'}
        return cls(Regions(config.shm, arena_bytes=size, neighbours=workers), storage,
                   (host, hosts))

    def attach(self, identity, header, now):
        """Map the segment an ATTACH names (releasing the one it replaces, once the copies
        from it are done); returns the ACK's fields (the arena, if any)."""
        self._storage.settle()
        arena = self.regions.attach(identity, header, now)
        self._storage.use_arena(self.regions.arena)
        return None if arena is None else {'arena': arena}

    def attach_device(self, identity, header):
        """Map the device segment an ATTACH_DEVICE names, for a worker on this host only (its
        handles are capabilities); ConfigError or ProtocolError (the worker's payloads then
        take shared memory). Returns the ACK's fields: this server's event, which the worker
        waits for before it reuses or reads a block this server's answer is about."""
        self.ask_device(identity, {'kind': header.get('kind')}, mapped=False)
        self._storage.settle()   # (copies from a segment it replaces are done)
        self.regions.attach_device(identity, header, self._storage.sharing)
        return {'event': self._storage.order_event().handle}

    def ask_device(self, identity, header, mapped=True):
        """Whether this server would map a device segment of ``identity``'s (ASK_DEVICE's
        ``kind`` of memory): ConfigError unless the worker is on this host and the device
        store's keys are in GPU shards that share that kind (``mapped``: checked here;
        else the mapping checks it)."""
        if self._hosts is not None:
            host, hosts = self._hosts
            theirs = hosts.get(worker_rank(identity), host)   # (a joiner: its handle decides)
            if theirs != host:
                raise ConfigError(f'{identity_label(identity)} is on {theirs}, not on this '
                                  f'server\'s host {host}: device handles are opened only '
                                  f'from workers on it')
        sharing = self._storage.sharing
        if sharing is None:
            raise ConfigError('this server keeps no GPU shards that could map a device segment')
        if mapped and sharing.name != header['kind']:
            raise ConfigError(f'this server\'s GPU shards share {sharing.name!r} memory, not '
                              f'{header["kind"]!r}')

    def payloads(self, identity, items, frames):
        """Regions.payloads: a PUSH's payload per item, in a frame or the worker's segment."""
        return self.regions.payloads(identity, items, frames)

    def saw(self, identity, header):
        """Note what a request says the worker has seen of the arena (its ``seen``); returns
        the worker's Reader then (the answer may lend values there), else None."""
        return self.regions.saw(identity, header)

    def place(self, worker, at, entry, codec=None):
        """``(at, view)``: where in ``worker``'s segment a pulled ``entry`` is asked for, in
        the dtype a pull with ``codec`` carries it (ProtocolError if that range is not the
        worker's)."""
        size = entry.weight.nbytes if codec is None else \
            P.nbytes(pulled_dtype(codec, entry.dtype), entry.n)
        return at, self.regions.view(worker, at, size)

    def places(self, worker, items, entries, codec=None):
        """``place`` of each pulled key (None: in a frame or lent); None if some offset is
        bad (that key then gets its error alone)."""
        try:
            return [None if item.at is None else self.place(worker, item.at, entry, codec)
                    for item, entry in zip(items, entries)]
        except ProtocolError:
            return None

    def deliver(self, answer):
        """The Delivery of a PullAnswer: weights in the arena are lent to a worker that reads
        it, values are written into the worker's segment where it asked, and the rest go as
        frames; the leases tell the shard when the worker (arena) or the transport (frames)
        is done with each. A device's weights are copied out (into the segment, or a pinned
        frame) and their leases end now: a copy into host memory is waited for here, one into
        a worker's device segment ordered (kvps.server.transfers), and the weights' next
        writes run behind either on the device's stream."""
        items, frames, framed, lent, copied = [], [], [], [], []
        codec = answer.codec
        device = self._storage.on_device   # (asked per key only where some keys are)
        for pulled, place in zip(answer.pulled, answer.places):
            # a compressed pull rounds a copy of the weight, on the host: nothing to lend or
            # lease
            rounded = codec is not None and pulled.entry.dtype in ROUNDED
            if device and not rounded and pulled.entry.arrays.on_device:
                copied.append(pulled)
                items.append(_copy_out(pulled, place, frames))
                continue
            offset = None if answer.reader is None or rounded else \
                self.regions.lendable(pulled.array)
            if offset is not None:
                lent.append(pulled)
                items.append(new(DataItem, (None, offset)))
            elif place is None:
                if rounded:
                    frames.append(_rounded(pulled, codec))
                    pulled.lease.released = True
                else:
                    frames.append(pulled.array)
                    framed.append(pulled.lease)
                items.append(IN_FRAME)
            else:
                at, view = place
                if rounded:
                    np.frombuffer(view, np.uint16)[...] = _rounded(pulled, codec).view(np.uint16)
                else:
                    np.frombuffer(view, pulled.array.dtype)[...] = pulled.array   # (copyto: 4x)
                pulled.lease.released = True
                items.append(new(DataItem, (at, None)))
        if copied:
            self._storage.order()   # (the weights' next writes run behind the copies)
            for pulled in copied:
                pulled.lease.released = True
        number = None
        if lent:
            number = self.regions.lend(answer.reader, [pulled.array for pulled in lent])
            for pulled in lent:
                pulled.lease.reader, pulled.lease.number = answer.reader, number
        return Delivery(items, frames, framed, number)

    def forget(self, worker):
        """The worker left: nothing it was lent needs keeping; its segment is released once
        the copies from it are done."""
        self._storage.settle()
        self.regions.forget(worker)

    def tick(self, now):
        self.regions.tick(now)

    def close(self):
        self._storage.settle()
        self.regions.close()


def _copy_out(pulled, place, frames):
    """Copy a device's pulled weight out (settle waits for it): into the worker's segment
    where it asked (``place``), else into a pinned buffer appended to ``frames``; its item."""
    arrays = pulled.entry.arrays
    if place is None:
        frames.append(arrays.framed(pulled.array))
        return IN_FRAME
    arrays.copy_out(pulled.array, place[1])
    return new(DataItem, (place[0], None))


def _rounded(pulled, codec):
    """The pulled weight rounded to ``codec`` (kvps.compression.half), made once per version
    of the weight: in sync every worker pulls the same round's value."""
    entry = pulled.entry
    cached = entry.rounded
    if cached is None or cached[0] != entry.version or cached[1] is not entry.weight or \
            cached[2] != codec:
        cached = entry.rounded = (entry.version, entry.weight, codec,
                                  round_pulled(entry.arrays.to_host(pulled.array), codec))
    return cached[3]

