"""A worker's connection to a server reset under it (a TCP reset; a NAT or firewall that dropped
the flow): ZeroMQ connects again by itself, but what was in flight on the old connection is lost,
both ways, and nothing says so: the calls waiting on it would wait out KVPS_TIMEOUT, blaming a
stalled worker. Each server's Dealer is watched (a ZeroMQ socket monitor); once it is connected
again, the requests still unanswered go again where a second copy is harmless (a server applies
a push once: its number tells whether it has it; a pull or a read is answered again, and the
second answer is ignored), and the others fail, saying why. So do the barriers (and the finish)
waiting on the scheduler: it answers a barrier it has released again.

A server that died is not this: the scheduler finds it lost, and its replacement gets the
unanswered requests (WorkerIO._rejoin)."""

import logging

from ..errors import PeerLostError
from ..wire import protocol as P
from ..wire.transport import Monitor
from .messages import server_rank

log = logging.getLogger('kvps.worker')

# What a server may be sent twice (see the module)
RESENDABLE = frozenset([P.PUSH, P.PULL, P.PULL_ROWS, P.CHECK, P.GET_STATES, P.GET_BLOB])


class _Monitor(Monitor):
    """A Dealer's connection events, and whose they are."""

    def __init__(self, node, dealer):
        super().__init__(dealer)
        self.node, self.dealer = node, dealer


class Resets:
    """The monitors of a WorkerIO's Dealers, to its servers and to the scheduler (node
    ``scheduler``): ``pending`` (its PendingTable), ``scheduler_requests`` (id -> Request) and
    ``lost`` (servers the job waits for) are its own."""

    def __init__(self, pending, scheduler_requests, lost, scheduler='scheduler'):
        self._pending, self._lost = pending, lost
        self._scheduler_requests, self._scheduler = scheduler_requests, scheduler
        self._monitors = {}   # node -> _Monitor
        self.broken = set()   # nodes whose connection reset and is not back yet
        self.leaving = False  # this worker is leaving the job: its end closes connections
        # The shared-memory blocks of pulls sent again, kept while this worker lives: should
        # both copies be answered, the second writes its block after the first answer let
        # the worker go on (and reuse the block for another transfer). Bounded by the resets.
        self._kept = []

    def __contains__(self, sock):
        return type(sock) is _Monitor

    def watch(self, node, dealer, poller):
        """Watch ``dealer``, ``node``'s (in place of a Dealer it had before)."""
        self.forget(node, poller)
        monitor = self._monitors[node] = _Monitor(node, dealer)
        poller.register(monitor)

    def forget(self, node, poller):
        monitor = self._monitors.pop(node, None)
        self.broken.discard(node)
        if monitor is not None:
            poller.unregister(monitor)
            monitor.close()

    def event(self, monitor):
        """Take the event ``monitor`` has: a reset is noted; a connection back after one sends
        the node's unanswered requests again."""
        event, node = monitor.event(), monitor.node
        if event == 'reset' and node not in self._lost and not self.leaving:
            self.broken.add(node)
            log.warning('the connection to %s was reset; what was in flight on it goes again '
                        'once it is back', self._label(node))
        elif event == 'up' and node in self.broken:
            self.broken.discard(node)
            if node not in self._lost:   # (a server found lost meanwhile: its rejoin resends)
                self._resend(monitor)

    def _resend(self, monitor):
        node, again = monitor.node, 0
        scheduler = node == self._scheduler
        for request in (self._scheduler_requests.values() if scheduler
                        else self._pending.of_node(node)):
            header = request.message[0]
            if scheduler or header['op'] in RESENDABLE:
                monitor.dealer.send(P.encode(*request.message))
                if header['op'] == P.PULL and request.keep:
                    self._kept.append(request.keep)
                again += 1
            else:
                self._pending.fail(header['id'], PeerLostError(
                    f'the connection to {node} was reset while this {header["op"]} request was '
                    'in flight: whether the server carried it out is unknown', 'server',
                    server_rank(node)))
        log.warning('the connection to %s is back; sent %d unanswered requests again',
                    self._label(node), again)

    def _label(self, node):
        return 'the scheduler' if node == self._scheduler else node

    def close(self):
        for monitor in self._monitors.values():
            monitor.close()
        self._monitors.clear()
        self._kept.clear()
