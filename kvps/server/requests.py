"""A server's request handlers: each request of a worker made into Shard calls and Replies."""

import logging
import time

import msgpack

from ..errors import ConfigError, KVPSError, ProtocolError
from ..timeline import recording
from ..wire import protocol as P
from ..wire.identities import identity_label
from ..wire.pieces import joined
from . import ledger, row_store
from .batch import Batch
from .blobs import Blobs
from .records import PullAnswer, Reply, ReplyKind

log = logging.getLogger('kvps.server')

ACK, DATA, ERROR, STATES = ReplyKind.ACK, ReplyKind.DATA, ReplyKind.ERROR, ReplyKind.STATES
# Requests whose acknowledgement waits for a checkpoint that holds what they changed.
_DURABLE = (P.INIT, P.SET_OPTIMIZER, P.SET_STATES, P.COMMIT_STATES)
_SPAN_NAMES = {op: f'recv {op}' for op in P.OPS}   # made once, not per request


def durable(header):
    """Whether the request ``header`` changes what a restarted server must find in the
    checkpoint (a SET_STATES piece with more to come changes nothing yet)."""
    op = header['op']
    return op in _DURABLE and not (op == P.SET_STATES and header.get('more')) and not (
        op == P.SET_OPTIMIZER and header.get('check'))


class Requests:
    """Serves the job's workers' requests on ``shard``, with ``lending`` for the shared
    memory they name; ``resumed_from``: the checkpoint a new job resumed from (its inits
    must find their keys there), or None."""

    def __init__(self, shard, lending, name, resumed_from=None):
        self.shard, self.lending, self.name = shard, lending, name
        self.resumed_from = resumed_from
        self._state_pieces = {}      # worker -> the pieces of a SET_STATES it is sending
        self.blobs = Blobs()         # the job's named blobs (PUT_BLOB, GET_BLOB)

    def handle(self, identity, header, buffers):
        """The Replies to one request of worker ``identity``; a failure is its error reply."""
        recorder = recording.RECORDER
        if recorder is None:
            return self._handle(identity, header, buffers)
        start = recording.now()
        try:
            return self._handle(identity, header, buffers)
        finally:
            # (a push's handling is its keys merged into their rounds: its optimizer updates,
            # nested, are spans of their own; rounds that only replaced values end here)
            op = header['op']
            recorder.span(_SPAN_NAMES.get(op) or f'recv {op}', 'merge' if op == P.PUSH else 'recv',
                          start, {'from': identity_label(identity),
                                  'keys': len(header.get('keys', ()))},
                          self.shard.flows.closed())

    def _handle(self, identity, header, buffers):
        token = (identity, header.get('id', 0))
        handler = self._HANDLERS.get(header['op'])
        try:
            if handler is None:
                raise KVPSError(f'{header["op"]!r} is not a server operation')
            return handler(self, token, header, buffers)
        except KVPSError as exc:  # the caller's mistake: its message says it all
            return [Reply(ERROR, token, exc)]
        except Exception as exc:  # a server bug: log it, answer with its traceback, serve on
            log.exception('%s: %s failed', self.name, header['op'])
            return [Reply(ERROR, token, exc)]

    def forget(self, worker):
        """The worker left: drop what it was sending."""
        self._state_pieces.pop(worker, None)
        self.blobs.forget(worker)

    def _init(self, token, h, buffers):
        sync, device, scale_to = h['sync'], h.get('device', False), h.get('scale_to', 0)

        def init_one(item_token, item, buffer):
            if self.resumed_from is not None:
                self._refuse_misplaced_init(item.key, item.part)
            return self.shard.init(item_token, item.key, item.part, item.dtype, item.shape, sync,
                                   buffer, device, scale_to)
        return self._each_key(token, P.INIT, h['keys'], buffers, init_one)

    def _refuse_misplaced_init(self, key, part):
        """A key lands on the server with the least load so far, so a job that inits its
        keys in another order or number than the checkpointed one sends them to servers that
        do not hold them: they would start afresh while the checkpoint's sit unused."""
        if (key, part) in self.shard.entries:
            return
        unclaimed = list(dict.fromkeys(e.key for e in self.shard.entries.values() if e.restored))
        if unclaimed:
            raise ConfigError(
                f'{self.name} is asked to init key {key!r}, which its checkpoint '
                f'{self.resumed_from} does not hold, while the keys it does hold '
                f'({", ".join(map(repr, unclaimed))}) were never initialized: the keys were '
                "initialized in another order or number than the checkpointed job's (or split "
                'by another KVPS_BIGARRAY_BOUND or KVPS_PARTITION_BYTES); init them as that '
                'job did, or start afresh in '
                'another KVPS_CHECKPOINT_DIR')

    def _check(self, token, h, buffers):
        def check_one(item_token, item, _):
            return self.shard.check(item_token, item.key, item.part, item.dtype, item.shape,
                                    token[0])
        return self._each_key(token, P.CHECK, h['keys'], [None] * len(h['keys']), check_one)

    def _push(self, token, h, buffers):
        worker, sync, step, items = token[0], h['sync'], h.get('step', 0), h['keys']
        payloads = self.lending.payloads(worker, items, buffers)
        self.lending.saw(worker, h)   # before the updates: what the worker copied is free
        batch, push = Batch(worker, token[1], P.PUSH, len(items)), self.shard.push
        if recording.RECORDER is not None:
            self.shard.flows.pushed(worker, items[0], sync)

        def push_all():   # (_each_key's loop, written out: it runs for every key pushed)
            replies = []
            for index, (item, data) in enumerate(zip(items, payloads)):
                try:
                    if isinstance(data, ProtocolError):   # its shared-memory range is bad
                        raise data
                    replies += push((batch, index), worker, item.key, item.part, item.dtype,
                                    sync, data, item.seq, step)
                except KVPSError as exc:
                    replies.append(Reply(ERROR, (batch, index), exc))
            return replies
        return self.shard.together(push_all)

    def _pull(self, token, h, buffers):
        worker, codec = token[0], h.get('codec')
        reader = self.lending.saw(worker, h)
        entries = self.shard.ready_for(worker, h['keys'])
        places = None if entries is None else self.lending.places(worker, h['keys'], entries,
                                                                  codec)
        if places is not None:   # one reply now, without settling key by key
            pulled = [entry.pulled() for entry in entries]
            return [Reply(DATA, token, PullAnswer(reader, pulled, places, codec))]

        def pull_one(item_token, item, _):
            entry = self.shard.entries.get((item.key, item.part))
            if item.at is not None and entry is not None:   # (no entry: shard.pull says so)
                batch, index = item_token
                batch.places[index] = self.lending.place(worker, item.at, entry, codec)
            return self.shard.pull(item_token, worker, item.key, item.part)
        return self._each_key(token, P.PULL, h['keys'], [None] * len(h['keys']), pull_one,
                              reader, codec)

    def _pull_rows(self, token, h, buffers):
        asked = (buffers[0] if h.get('ids') else None), \
            row_store.LIVE if h.get('live') else h.get('since')
        return self.shard.pull(token, token[0], h['key'], h['part'], asked)

    def _each_key(self, token, op, items, buffers, handle, reader=None, codec=None):
        """Run ``handle`` per key of a multi-key message; one key's error does not stop the
        others, and the answers are gathered in a Batch (``reader``: the worker reads the
        arena, so the answer may lend weights in it; ``codec``: a PULL's)."""
        batch = Batch(token[0], token[1], op, len(items), reader, codec)
        replies = []
        for index, (item, buffer) in enumerate(zip(items, buffers)):
            try:
                replies += handle((batch, index), item, buffer)
            except KVPSError as exc:
                replies.append(Reply(ERROR, (batch, index), exc))
        return replies

    def _attach(self, token, h, buffers):
        return [Reply(ACK, token, self.lending.attach(token[0], h, time.monotonic()))]

    def _attach_device(self, token, h, buffers):
        return [Reply(ACK, token, self.lending.attach_device(token[0], h))]

    def _ask_device(self, token, h, buffers):
        self.lending.ask_device(token[0], h)
        return [Reply(ACK, token, None)]

    def _set_optimizer(self, token, h, buffers):
        # (a frame, not a header field: per-key options of many keys outgrow a header)
        spec = _map_in(buffers[0], 'set_optimizer: the spec')
        if h.get('check'):   # a worker asks before rank 0 sets it on any server
            return [Reply(ACK, token, {'whole': self.shard.optimizer.check_optimizer(spec)})]
        self.shard.set_optimizer(spec, h.get('step', 0))
        return [Reply(ACK, token, None)]

    def _get_states(self, token, h, buffers):
        blob = msgpack.packb(self.shard.get_states(h['dump'], h.get('step', 0)),
                             use_bin_type=True)
        return [Reply(STATES, token, blob)]

    def _set_states(self, token, h, buffers):
        worker, piece = token[0], h.get('piece', 0)
        pieces = self._state_pieces.pop(worker, []) if piece else []
        if piece != len(pieces):
            raise ConfigError(f'set_states: piece {piece} of the optimizer state came after '
                              f'{len(pieces)} piece(s) (this server restarted during the load?): '
                              'load the states again')
        pieces.append(buffers[0])
        if h.get('more'):   # one piece of a state too big for one message: wait for the rest
            self._state_pieces[worker] = pieces
            return [Reply(ACK, token, None)]
        states = _map_in(joined(pieces), 'set_states: the state')
        self.shard.set_states(states, stage=h.get('stage', False), step=h.get('step', 0))
        return [Reply(ACK, token, None)]

    def _commit_states(self, token, h, buffers):
        self.shard.commit_states(h.get('step', 0))
        return [Reply(ACK, token, None)]

    def _claim(self, token, h, buffers):
        return ledger.claim(self.shard, token, token[0], h)

    def _put_blob(self, token, h, buffers):
        self.blobs.put(token[0], h, buffers[0])
        return [Reply(ACK, token, None)]

    def _get_blob(self, token, h, buffers):
        return [Reply(STATES, token, self.blobs.get(h))]

    _HANDLERS = {P.INIT: _init, P.CHECK: _check, P.PUSH: _push, P.PULL: _pull,
                 P.PULL_ROWS: _pull_rows,
                 P.SET_OPTIMIZER: _set_optimizer, P.GET_STATES: _get_states,
                 P.SET_STATES: _set_states, P.COMMIT_STATES: _commit_states,
                 P.ATTACH: _attach, P.ATTACH_DEVICE: _attach_device,
                 P.ASK_DEVICE: _ask_device, P.PUT_BLOB: _put_blob,
                 P.GET_BLOB: _get_blob, P.CLAIM: _claim}


def _map_in(buffer, what):
    """The map a request's msgpack frame holds; ProtocolError or ConfigError naming ``what``."""
    try:
        value = msgpack.unpackb(buffer, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise ProtocolError(f'{what} is undecodable: {exc!r}') from None
    if not isinstance(value, dict):
        raise ConfigError(f'{what} must be a map')
    return value
