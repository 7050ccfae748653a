"""Sending a server's replies: acks, errors, pulled values, optimizer states in pieces, rows."""

import logging
import traceback

from ..errors import KVPSError
from ..timeline import recording
from ..timeline.counters import ServerCounts
from ..wire import protocol as P
from ..wire.bundle import INDEX_BYTES, MAX_MESSAGES, bundle
from ..wire.identities import identity_label
from ..wire.pieces import continued, state_pieces
from .batch import Batch
from .records import ReplyKind

log = logging.getLogger('kvps.server')
ACK, DATA = ReplyKind.ACK, ReplyKind.DATA
_SPAN_NAMES = {kind: f'reply {kind.value}' for kind in ReplyKind}   # made once, not per reply
BUNDLE_BYTES = 1 << 20   # frames' bytes in one bundle of pulled values (the rest go alone)


class Replies:
    """A server's outgoing Replies: held until the loop flushes them (once the checkpoint
    that covers them is written), then each sent to its request; the replies to a Batch's
    keys become one answer once the batch is settled, and the pulled values a flush sends a
    worker go in one message (kvps.wire.bundle). ``lending`` says how pulled values travel;
    ``send_to(identity, frames, track)`` sends (the ROUTER's)."""

    def __init__(self, send_to, name, lending, max_message_bytes=None, counts=None):
        self._send_to, self._name, self._lending = send_to, name, lending
        self._counts = counts or ServerCounts()   # the server's (replies and their bytes)
        self._max_message_bytes = max_message_bytes
        self._held = []
        self._outbox = None   # while a flush runs: worker -> the _Bundle its DATA wait in
        self._senders = {ReplyKind.ACK: self._ack, ReplyKind.ERROR: self._error,
                         ReplyKind.DATA: self._data, ReplyKind.STATES: self._states,
                         ReplyKind.ROWS: self._rows}

    def hold(self, replies):
        """Keep ``replies`` until the next flush."""
        self._held += replies

    def flush(self):
        """Send every reply held. A worker's plain acks ride on the first pulled values sent
        to it in the same flush (a sync round answers its pushes and the pulls after them
        at once): one message instead of two, on both sides."""
        held, self._held = self._held, []
        outcomes = []
        for reply in held:
            owner, number = reply.token   # (a Batch, a key's index) or (identity, request id)
            if not isinstance(owner, Batch):
                outcomes.append(reply)
            elif owner.settle(number, reply):   # the last key of a batch
                outcomes.append(owner.outcome())
        riding = _riding_acks(outcomes)
        carried = set(riding)
        self._outbox = {}
        try:
            for reply in outcomes:
                identity = reply.token[0]
                if identity in carried and _plain_ack(reply):
                    continue   # it rides (or has ridden) on the first DATA to its worker
                self.send(reply, riding.pop(identity, None) if reply.kind is DATA else None)
        finally:
            outbox, self._outbox = self._outbox, None
            for identity, waiting in outbox.items():
                self._post(identity, waiting)

    def send(self, reply, acks=None):
        """Send one Reply now, to the request its token names (a DATA with the ids of the
        plain ``acks`` it carries)."""
        identity, req_id = reply.token
        recorder = recording.RECORDER
        start = recording.now() if recorder is not None else 0
        if acks is None:
            self._senders[reply.kind](identity, req_id, reply.payload)
        else:
            self._data(identity, req_id, reply.payload, acks)
        if recorder is not None:
            recorder.span(_SPAN_NAMES[reply.kind], 'reply', start,
                          {'to': identity_label(identity)})

    def _ack(self, identity, req_id, fields):
        self._send(identity, P.encode({'op': P.ACK, 'id': req_id, **(fields or {})}))

    def _error(self, identity, req_id, exc):
        # A caller's mistake speaks for itself; a server bug also carries its traceback.
        tb = '' if isinstance(exc, KVPSError) else ''.join(traceback.format_exception(exc))
        self._send(identity, P.encode(P.error_header(req_id, exc, self._name, tb)))

    def _rows(self, identity, req_id, rows):
        header = {'op': P.ROWS, 'id': req_id, 'epoch': rows.epoch, 'count': rows.count}
        self._send(identity, P.encode(header, [rows.data]))

    def _states(self, identity, req_id, blob):
        """The packed state ``blob``, in as many STATES as a message may carry."""
        pieces = state_pieces(blob, self._max_message_bytes)
        for header, piece in zip(continued({'op': P.STATES, 'id': req_id}, len(pieces)),
                                 pieces):
            self._send(identity, P.encode(header, [piece]))

    def _data(self, identity, req_id, answer, acks=None):
        """A PullAnswer, its values lent, placed or framed as the lending delivers them (the
        frames uncopied: their leases end when the transport is done with them)."""
        delivery = self._lending.deliver(answer)
        header = {'op': P.DATA, 'id': req_id, 'keys': delivery.items}
        if acks:
            header['acks'] = acks
        if delivery.lease is not None:
            header['lease'] = delivery.lease
        self._send(identity, P.encode(header, delivery.frames), bool(delivery.frames),
                   delivery.framed, may_bundle=True)

    def _send(self, identity, frames, track=False, leases=(), may_bundle=False):
        """Send ``frames`` to worker ``identity`` (``leases``: those of the frames sent in
        place, told when zmq lets go of them). During a flush a DATA (``may_bundle``) waits to
        go with the worker's next ones; anything else first sends what waits (order kept)."""
        outbox = self._outbox
        if outbox is not None:
            waiting = outbox.get(identity)
            if may_bundle:
                if waiting is not None and waiting.takes(frames, track, leases):
                    return
                if waiting is not None:
                    self._post(identity, waiting)
                outbox[identity] = _Bundle(frames, track, leases)
                return
            if waiting is not None:
                del outbox[identity]
                self._post(identity, waiting)
        self._transmit(identity, frames, track, leases)

    def _post(self, identity, waiting):
        if len(waiting.messages) == 1:
            self._transmit(identity, waiting.messages[0], waiting.track, waiting.leases)
        else:
            self._transmit(identity, bundle(waiting.messages), waiting.track, waiting.leases)

    def _transmit(self, identity, frames, track, leases):
        self._counts.replies += 1
        self._counts.reply_bytes += sum(memoryview(frame).nbytes for frame in frames)
        try:
            tracker = self._send_to(identity, frames, track)
        except KVPSError as exc:  # that worker is gone; liveness will report it
            log.info('%s: could not answer %r: %s', self._name, identity, exc)
            tracker = None
        for lease in leases:
            lease.tracker = tracker
            lease.released = tracker is None


class _Bundle:
    """DATA messages waiting to go to one worker as one (kvps.wire.bundle): the first, and
    those that fit with it in BUNDLE_BYTES of frames and the index's bytes of headers."""

    __slots__ = ('messages', 'track', 'leases', 'nbytes', 'header_bytes')

    def __init__(self, frames, track, leases):
        self.messages, self.track, self.leases = [frames], track, list(leases)
        self.nbytes = sum(memoryview(f).nbytes for f in frames[1:])
        self.header_bytes = len(frames[0])

    def takes(self, frames, track, leases):
        """Add the message ``frames`` (``track``, ``leases``: as Replies._send's) if it fits."""
        nbytes = sum(memoryview(f).nbytes for f in frames[1:])
        if (len(self.messages) == MAX_MESSAGES or self.nbytes + nbytes > BUNDLE_BYTES
                or self.header_bytes + len(frames[0]) > INDEX_BYTES):
            return False
        self.messages.append(frames)
        self.track = self.track or track
        self.leases += leases
        self.nbytes += nbytes
        self.header_bytes += len(frames[0])
        return True


def _riding_acks(outcomes):
    """Worker -> the ids of its plain acks among ``outcomes``, for each worker that is also
    sent pulled values (DATA) in them."""
    pulled = {reply.token[0] for reply in outcomes if reply.kind is DATA}
    riding = {identity: [] for identity in pulled}
    for reply in outcomes:
        if reply.token[0] in riding and _plain_ack(reply):
            riding[reply.token[0]].append(reply.token[1])
    return riding


def _plain_ack(reply):
    """An ACK with no fields of its own: it may ride on a DATA to the same worker."""
    return reply.kind is ACK and reply.payload is None
