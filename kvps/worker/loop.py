"""The worker's I/O thread: owns every socket, sends queued requests, routes replies.

API threads never touch a socket: they append ``(node, header, buffers, request)`` to a queue
and wake this thread, which takes them in order of priority (kvps.wire.ordering), assigns the
request id, sends, and later completes the request's Operation from the reply. Many requests
are in flight at once (pipelining), and replies from different servers are handled as they
arrive.
"""

import collections
import logging
import threading
import time

from ..errors import KVPSError, PeerLostError, ProtocolError, StoreClosedError
from ..timeline import recording
from ..timeline.counters import Ticker, WorkerCounts
from ..wire import budget, protocol as P
from ..wire.bundle import bundle
from ..wire.identities import own_identity
from ..wire.link import SchedulerLink, decoded_or_refusals
from ..wire.ordering import PriorityOrder
from ..wire.pieces import continued
from ..wire.transport import Dealer, Poller, Waker, guard_from, new_context
from .holdback import POLL_S, Holdback, pushed_bytes
from .joined import join_pushes, riders
from .joining import membership_of
from .messages import fuse_bytes, server_name
from .pending import Attaching, PendingTable, PushCounts, Request
from .resets import Resets
from .staging import Staging
from .tracing import MessageTrace

log = logging.getLogger('kvps.worker')

SCHEDULER = 'scheduler'

MEMBERSHIP_CHANGES_KEPT = 1024   # changes not yet told to the API threads (the oldest go)


class WorkerIO(threading.Thread):
    """Registers with the scheduler, connects to every server and moves messages."""

    def __init__(self, config, counts=None):
        super().__init__(name='kvps-worker-io', daemon=True)
        self.config = config
        self.counts = counts or WorkerCounts()   # the worker's (kv.stats())
        self.ctx = new_context()
        self.waker = Waker(self.ctx)
        self.ready = threading.Event()
        self.welcome = None
        self.fatal = None           # the error that ended this worker's link to the job
        self._queue = collections.deque()   # submitted, not yet taken in by this thread
        self._order = PriorityOrder()       # taken in, waiting to be sent (this thread only)
        self._holdback = Holdback(config.socket_queue)   # taken, held (socket pushes)
        self._fuse_bytes = fuse_bytes(config)   # what one message of fused requests carries
        self._wake_pending = False
        self._pending = PendingTable()
        self._scheduler_requests = {}   # (barrier, finish...: by their own sequence numbers)
        self._stopping = False
        self._abort_reason = None   # set when this process is failing: told to the scheduler
        self._servers = {}          # node name ('server N') -> Dealer
        self._by_socket = {}        # Dealer -> node name, to say where a bad reply came from
        self._lost = set()          # servers the job waits for: requests to them are held
        self.push_counts = PushCounts()   # each push's seq, numbered as API threads queue it
        self._resets = Resets(self._pending, self._scheduler_requests, self._lost, SCHEDULER)
        self._poller = Poller()
        self.staging = None         # this worker's shared-memory segment, if it has one
        # (epoch, ranks): the job's member workers, as the last WELCOME or MEMBERS told
        self.membership = (0, [], [])
        # every MEMBERS since the API threads last looked, in order: two changes between two
        # store calls (a join and a leave) are still two calls of on_membership_change
        self.membership_changes = collections.deque(maxlen=MEMBERSHIP_CHANGES_KEPT)
        self.trace = None           # the messages' spans, while the timeline records
        self._ticker = Ticker(0, 'worker', None)   # --stats lines, from the welcome on

    # -- API side (any thread) --------------------------------------------------------------
    def submit(self, node, header, buffers, request):
        """Queue one message for ``node`` ('server N' or 'scheduler'); never blocks."""
        if self.fatal is not None:
            request.op.fail(self.fatal)
            return
        self._queue.append((node, header, buffers, request))
        if self.fatal is not None:   # the thread ended after the check above: none will send it
            self._fail_queued()
            return
        if not self._wake_pending:   # one wake-up per batch, not one per message
            self._wake_pending = True
            self.waker.wake()

    def stop(self, timeout):
        self._stopping = self._resets.leaving = True   # (the job's end resets connections)
        self.waker.wake()
        self.join(timeout)

    def abort(self, reason, timeout):
        """Stop, telling the scheduler first that this process is failing and why: the job
        ends at once with that reason instead of the others waiting for us to go silent."""
        self._abort_reason = reason
        self.stop(timeout)

    # -- the thread -------------------------------------------------------------------------
    def run(self):
        try:
            self._link = SchedulerLink(self.ctx, self.config, 'worker')
            self.welcome = self._link.register()
            self.membership = membership_of(self.welcome)
            if recording.RECORDER is not None:
                self.trace = MessageTrace(self.welcome['rank'])
            self._ticker = Ticker(self.config.stats_seconds, f'worker {self.welcome["rank"]}',
                                  self._stats)
            self._connect_servers(self.welcome)
            self.staging = Staging.for_job(self.config, self.welcome, self._link.host)
            for node in self._servers:
                self._attach(node)
        except Exception as exc:  # reported to the API thread waiting on `ready`
            self.fatal = exc
            self.ready.set()
            self._close()
            return
        self.ready.set()
        try:
            self._serve()
        except Exception as exc:  # never die silently: every waiter learns why
            log.exception('worker I/O thread failed')
            self._die(exc if isinstance(exc, KVPSError) else KVPSError(f'I/O thread: {exc!r}'))
        finally:
            if self._abort_reason is not None and self.fatal is None:   # else the job is over
                self._link.abort(self._abort_reason)   # closing the link delivers it
            self._end()
            self._close()

    def _end(self):
        """Fail what is still waiting when the thread stops: a call another API thread made
        while this worker was closing would otherwise wait for KVPS_TIMEOUT for an answer that
        can no longer come."""
        if self.fatal is None:
            self.fatal = StoreClosedError('this worker has left the job (kv.close() or '
                                          'interpreter exit): a call made while it was closing '
                                          'cannot complete')
        self._fail_everything()
        self._fail_queued()
        while self._order:   # taken in by this thread and not sent
            self._order.pop()[3].op.fail(self.fatal)
        for entry in self._holdback.release_all():
            entry[3].op.fail(self.fatal)

    def _fail_queued(self):
        """Fail every queued request (the thread is gone). Any thread: popleft hands each
        one to exactly one caller."""
        while True:
            try:
                request = self._queue.popleft()[3]
            except IndexError:
                return
            request.op.fail(self.fatal)

    def _connect_servers(self, welcome):
        self._poller.register(self.waker.socket)
        self._poller.register(self._link.socket)
        self._resets.watch(SCHEDULER, self._link.socket, self._poller)
        for rank, (host, port) in enumerate(welcome['servers']):
            self._connect(rank, host, port)

    def _connect(self, rank, host, port):
        identity = own_identity(self.welcome, self.config.secret_value())
        dealer = Dealer(self.ctx, identity, guard_from(self.config))
        dealer.connect(host, port)
        self._servers[server_name(rank)] = dealer
        self._by_socket[dealer] = server_name(rank)
        self._poller.register(dealer)
        self._resets.watch(server_name(rank), dealer, self._poller)

    def _serve(self):
        tick = min(self.config.heartbeat_interval, 0.5)
        while not (self._stopping and not self._queue and not self._order and not self._holdback):
            for sock in self._poller.poll(POLL_S if self._holdback else tick):
                if sock is self.waker.socket:
                    # Drain, then clear the flag, then send the queue (below): a submit before
                    # the clear is already queued; one after it wakes us again. Clearing first
                    # would let this drain swallow that wake-up and strand the next message.
                    self.waker.drain()
                    self._wake_pending = False
                elif sock is self._link.socket:
                    self._from_scheduler()
                elif sock in self._by_socket:   # not closed by a rejoin earlier in this pass
                    self._from_server(sock)
                elif sock in self._resets:
                    self._resets.event(sock)
            self._send_queued()
            if self.fatal is None:
                now = time.monotonic()
                try:
                    self._link.tick(now)
                except PeerLostError as exc:
                    self._die(exc)
                self._ticker.tick(now)

    def _send_queued(self):
        """Send every queued request, highest priority first. Requests queued meanwhile join
        the order before each send, so that one of a higher priority goes ahead of those still
        waiting (kvps.wire.ordering). A thread's pushes queued back to back share a request,
        and requests queued back to back a message (kvps.worker.joined). Socket pushes beyond
        what zmq may queue, and what must follow them, are held (kvps.worker.holdback) until
        they may go, ahead of the rest."""
        queue, order, holdback = self._queue, self._order, self._holdback
        while True:
            while queue:
                entry = queue.popleft()
                order.add(entry[0], entry[1], entry)
            entry = holdback.next_ready(self._stopping) if holdback else None
            if entry is None:
                entry = order.pop()
                if entry is None:
                    return
                entry = join_pushes(entry, order, self.counts, self._fuse_bytes)
                if not (self._stopping or entry[0] in self._lost
                        or holdback.admit(entry, pushed_bytes(*entry[1:]))):
                    self.counts.held += 1
                    continue
            self._send(entry, riders(entry, order, holdback, self._fuse_bytes))

    def _send(self, entry, more=()):
        """Send the request ``entry``, with ``more`` (requests for the same server) in the same
        message (kvps.wire.bundle); fail them if this worker's link to the job is broken."""
        node, request = entry[0], entry[3]
        messages = [m for m in (self._prepared(*each) for each in (entry, *more)) if m]
        if messages and node not in self._lost:
            taken = None if more else self._holdback.on_taken(
                node, pushed_bytes(*request.message, request), self.waker.wake)
            self._servers[node].send(bundle(messages) if more else messages[0], on_taken=taken)
            self.counts.messages += len(messages)   # (requests: a bundle carries several)

    def _prepared(self, node, header, buffers, request):
        """The frames of one request to a server, made ready to send now; None for one that
        goes another way (to the scheduler, or failed since this worker's link is broken)."""
        if self.fatal is not None:
            request.op.fail(self.fatal)
            return None
        if node == SCHEDULER:
            self._scheduler_requests[header['id']] = request
            request.message = (header, ())   # (sent again after a reset: kvps.worker.resets)
            request.op.waiting_on.add(SCHEDULER)
            self._link.send(header)
            return None
        header['id'] = self._pending.add(request)
        arena = None if self.staging is None else self.staging.arenas.get(node)
        if arena is not None and header['op'] in (P.PUSH, P.PULL):
            # What was lent to us is copied (replies are handled before this send): the
            # server may reuse it; and it may lend more.
            header['seen'] = arena.seen
        start = recording.now() if self.trace is not None else 0
        device = self._ready(node, request, header, buffers)
        if self.trace is not None and header['op'] in (P.PUSH, P.PULL) and node not in self._lost:
            self.trace.sent(start, node, *request.message, request.keep, device is not None)
        return P.encode(*request.message)

    @property
    def lost_servers(self):
        """The servers the job waits for to rejoin, by name (for API threads: a copy)."""
        return sorted(frozenset(self._lost))

    @property
    def in_flight(self):
        """Requests sent and awaiting their answers."""
        return len(self._pending)

    def _stats(self):
        """The counts of a --stats line, and the gauges: requests awaiting answers, and
        those queued for this thread to send."""
        return self.counts.rates(), {'in_flight': self.in_flight, 'queued': len(self._queue)
                                     + len(self._order) + len(self._holdback)}

    def _ready(self, node, request, header, buffers):
        """Make ``request``'s message readable by ``node`` as it is now; where it names blocks
        of the device segment, its answer waits for the server's work on them. Returns the
        device segment's DeviceStaging, or None."""
        request.message = self._readable(node, header, buffers)
        device = None if self.staging is None else self.staging.device
        request.after = None if device is None else device.answer_of(node, request.message[0])
        return device

    def _readable(self, node, header, buffers):
        """The message with its shared-memory items made frames if ``node`` lost the segment."""
        if self.staging is None:
            return header, buffers
        return self.staging.readable(node, header, buffers)

    def _from_server(self, sock):
        node = self._by_socket[sock]
        if node in self._lost:   # taken for lost: its requests wait for its replacement
            sock.recv()
            return
        for frames, decoded in decoded_or_refusals(sock.recv(), self.config, node):
            if isinstance(decoded, ProtocolError):
                # Its call would wait for it until KVPS_TIMEOUT: fail it now, saying why.
                self._pending.refused(frames, ProtocolError(
                    f'the answer of {node} could not be read: {decoded}'))
                continue
            self.counts.answers += 1 + len(decoded[0].get('acks', ()))   # (acks riding on it)
            self._pending.resolve(*decoded)
            if 'lease' in decoded[0] and self.staging is not None:
                self.staging.copied(node, decoded[0]['lease'])

    def _attach(self, node):
        """Queue the ATTACH that asks ``node`` to map this worker's segment (if it has one);
        the answer's handler maps ``node``'s arena if it offers one."""
        if self.staging is not None:
            self._queue.append((node, self.staging.attach_header(node), (), Request(
                Attaching(f'attach to {node}', self.staging.answered, node), node,
                lambda header, _: self.staging.map_arena(node, header))))
            device = self.staging.device
            if device is not None:   # (a restarted server: maps the device segment anew)
                self._queue.append((node, device.attach_header(), (),
                                    device.attach_request(node)))

    def _from_scheduler(self):
        header = self._link.next_message()
        if header is None:
            return
        op = header['op']
        if op in (P.BARRIER_DONE, P.ACK, P.ERROR) and header.get('id') in self._scheduler_requests:
            request = self._scheduler_requests.pop(header['id'])
            if op == P.ERROR:
                try:
                    self._link.raise_if_fatal(header)
                except KVPSError as exc:
                    request.op.fail(exc)
            else:
                if request.on_data is not None:
                    request.on_data(header, [])
                request.op.part_done()
        elif op == P.SERVER_LOST:
            log.warning('%s; its requests wait for it to rejoin', header['reason'])
            self._lost.add(server_name(header['rank']))
            self._unhold(server_name(header['rank']))
            if self.staging is not None:
                self.staging.detach(server_name(header['rank']))
        elif op == P.MEMBERS:   # (an elastic job's: read by the API threads' next call)
            if header['epoch'] > self.membership[0]:
                self.membership = membership_of(header)
                self.membership_changes.append(self.membership)
        elif op == P.SERVER_BACK:
            self._rejoin(header['rank'], header['host'], header['port'])
        elif op in (P.PEER_LOST, P.SHUTDOWN, P.ERROR):
            try:
                self._link.raise_if_fatal(header)
            except KVPSError as exc:
                self._die(exc)

    def _rejoin(self, rank, host, port):
        """A server rejoined (restarted from its checkpoint): connect to it, tell it which of
        our pushes it acknowledged before it was lost, and send every unanswered request
        again (it applies each push once)."""
        name = server_name(rank)
        if not 0 <= rank < len(self._servers):
            log.warning('ignored the return of unknown %s', name)
            return
        old = self._servers[name]
        self._poller.unregister(old)
        del self._by_socket[old]
        old.close(linger_s=0)
        self._connect(rank, host, port)
        if self.staging is not None:   # the new process has not mapped our segment (yet)
            self.staging.detach(name)
        with self.push_counts.lock:
            # Every push numbered so far is queued: take them in as unanswered, none sent (it
            # counts as lost here even where restarted before we were told of its loss: a push
            # sent before the RESUME, or held back again, would count as acknowledged).
            self._lost.add(name)
            self._unhold(name)
            self._send_queued()
            counts = self.push_counts.copy(name)
        self._lost.discard(name)
        waiting = self._pending.of_node(name)
        self._resume(name, self.push_counts.resumed(name, counts, waiting))
        for request in waiting:
            self._ready(name, request, *request.message)
            self._servers[name].send(P.encode(*request.message))
        self.counts.retries += len(waiting)
        self._attach(name)   # it maps our segment through /proc: later payloads go there again
        log.warning('%s is back at %s:%d; sent %d unanswered requests again', name, host, port,
                    len(waiting))

    def _unhold(self, name):
        """Take the requests held for lost server ``name`` in as unanswered, in their order."""
        for entry in self._holdback.release(name):
            self._send(entry)

    def _resume(self, name, items):
        """Send ``name`` the RESUME of ``items`` (ResumeItem), in as many messages as needed."""
        runs = budget.within_budget(items)
        for header, run in zip(continued({'op': P.RESUME, 'id': 0}, len(runs)), runs):
            self._servers[name].send(P.encode({**header, 'keys': run}))

    def _die(self, exc):
        """The job is broken for this worker: fail everything now and everything later."""
        if self.fatal is None:
            log.error('%s', exc)
            self.fatal = exc
        self._fail_everything()

    def _fail_everything(self):
        """Fail every request sent and unanswered with ``self.fatal``."""
        self._pending.fail_all(self.fatal)
        for request in self._scheduler_requests.values():
            request.op.fail(self.fatal)
        self._scheduler_requests.clear()

    def _close(self):
        if self.staging is not None:
            self.staging.close()
        self._resets.close()
        for dealer in self._servers.values():
            dealer.close(linger_s=0.5)
        if getattr(self, '_link', None) is not None:
            self._link.close()
        self.waker.close()
        self.ctx.term()

