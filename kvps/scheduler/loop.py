"""The scheduler process: owns the ROUTER socket and drives Membership from a poll loop."""

import dataclasses
import json
import logging
import secrets
import time

from ..atomic import write_atomically
from ..errors import ConfigError, KVPSError
from ..timeline import recording
from ..timeline.counters import SchedulerCounts, Ticker
from ..wire import protocol as P
from ..wire.link import decode_or_log
from ..wire.refusals import REFUSALS
from ..wire.transport import Poller, bind_host, job_router, new_context, resolve
from .elastic import Elastic, bounds
from .membership import Membership

log = logging.getLogger('kvps.scheduler')

# How long a worker's FINISH waits before its peers' rounds and barriers that it can never
# join fail: a worker leaving on sys.exit(3) finishes cleanly (an atexit hook cannot see the
# code), and its own exit must reach a launcher before the failures it causes, else a peer
# is named. A job whose last worker finishes ends at once.
FINISH_GRACE = 3.0


def _beat(header, config):
    """The heartbeat interval a registering node keeps (this scheduler's if it did not say,
    or said something that is not a positive number)."""
    beat = header.get('beat')
    ok = isinstance(beat, (int, float)) and not isinstance(beat, bool) and 0 < beat < 3600
    return float(beat) if ok else config.heartbeat_interval


class Scheduler:
    """Bootstraps the job, runs barriers, watches liveness and ends the job in order."""

    def __init__(self, config):
        self.config = config.require_cluster()
        # a node waiting for the job to form beats every interval it says it keeps: three
        # missed beats, and a process that claims its rank takes it (a cluster manager
        # restarted it)
        self.members = Membership(config.num_workers, config.num_servers, bounds(config),
                                  stale_after=3)
        self.elastic = Elastic(self)
        self.ctx = new_context()
        self.router = job_router(self.ctx, config)
        host = resolve(config.scheduler_host, config.connect_timeout)
        self.port = self.router.bind(bind_host(config, host), config.scheduler_port or 0,
                                     config.port_range)
        if config.port_file:
            self._publish_port(config.port_file)
        self.exit_code = None
        self.started = time.monotonic()
        self.job = secrets.token_hex(8)   # names this run in server checkpoints
        self._finishing = {}      # identity -> when its FINISH takes effect
        self._barrier_began = {}  # barrier number -> when its first worker came (timeline)
        self._last_barrier = (0, frozenset(), None)   # (seq, workers, answer) released last
        self.counts = SchedulerCounts()
        self.ticker = Ticker(config.stats_seconds, 'scheduler', lambda: (
            {**dataclasses.asdict(self.counts), 'refused': REFUSALS.total},
            {'nodes': len(self.members.nodes)}))
        recording.name_node(0, 'scheduler')
        log.info('scheduler listening on %s:%d', host, self.port)

    def _publish_port(self, path):
        """Write the bound port to KVPS_PORT_FILE, or fail naming it (and let the port go)."""
        try:
            write_atomically(path, str(self.port))
        except OSError as exc:
            self.router.close()
            self.ctx.term()
            raise ConfigError(f'KVPS_PORT_FILE={path!r}: cannot write the scheduler\'s port '
                              f'there: {exc.strerror or exc}') from None

    def run(self):
        """Serve until the job ends; return the process exit code."""
        poller = Poller()
        poller.register(self.router)
        tick = min(self.config.heartbeat_interval, 0.5)
        try:
            while self.exit_code is None:
                if poller.poll(tick):
                    identity, frames = self.router.recv_from()
                    self._handle(identity, frames)
                self._tick(time.monotonic())
        finally:
            self.router.close()
            self.ctx.term()
        return self.exit_code

    # -- messages -------------------------------------------------------------------------
    def _handle(self, identity, frames):
        decoded = decode_or_log(frames, self.config, identity)
        if decoded is None:
            return
        header, _ = decoded
        self.members.seen(identity, time.monotonic())
        handler = self._HANDLERS.get(header['op'])
        if handler is None:
            REFUSALS.refuse(identity, 'not a scheduler op',
                            'rejected %s from %r: not a scheduler op', header['op'], identity)
            return
        try:
            handler(self, identity, header)
        except KVPSError as exc:
            log.warning('refused %s from %r: %s', header['op'], identity, exc)
            self.send(identity, P.error_header(header.get('id', 0), exc, 'scheduler'))
        except Exception as exc:  # a scheduler bug: log it and keep the job running
            log.exception('%s from %r failed', header['op'], identity)
            self.send(identity, P.error_header(header.get('id', 0), exc, 'scheduler'))

    def _on_register(self, identity, header):
        if header.get('version') != P.VERSION:
            raise ConfigError(f'this node speaks kvps wire protocol {header.get("version")}, the '
                              f'scheduler speaks {P.VERSION}: install one kvps version everywhere')
        if self.members.ranked:
            if header['role'] == 'worker':
                self.elastic.join(identity, header)
            else:
                self._on_rejoin(identity, header)
            return
        stale = self.members.register(identity, header['role'], header['host'], header['port'],
                                      header.get('rank'), header.get('pid', 0),
                                      time.monotonic(), header.get('shared', {}),
                                      header.get('rank_from'), _beat(header, self.config))
        if stale is not None:
            self._dropped(stale)
        recording.note('register', 'register', {'role': header['role'], 'host': header['host']})
        log.info('registered %s (%d of %d nodes)', self.members.label(identity),
                 len(self.members.nodes), sum(self.members.want.values()))
        if self.members.complete:
            self.members.assign_ranks()
            if self.config.formed_file:   # before any welcome: no worker can be done earlier
                write_atomically(self.config.formed_file, 'formed')
            now = time.monotonic()
            for node in self.members.nodes.values():
                node.last_seen = now  # liveness counts from the start of the job
                self.welcome(node)
            log.info('all %d nodes registered: %s', len(self.members.nodes),
                     self.members.table())

    def _dropped(self, node):
        why = self.members.dropped[node.identity]
        log.warning('%s left the forming job: %s; %d of %d nodes registered',
                    self.members.describe_claim(node), why, len(self.members.nodes),
                    sum(self.members.want.values()))
        recording.note('lost', 'lost', {'node': node.describe(), 'reason': why})

    def _on_rejoin(self, identity, header):
        """A server registering into a running job replaces the server of its rank, which is
        lost or about to be found lost (a launcher restarts a server as soon as it dies)."""
        if not self.config.recovery_timeout:
            raise ConfigError('the job is already running; servers can rejoin only when the job '
                              'waits for lost servers (KVPS_RECOVERY_TIMEOUT > 0)')
        node, old = self.members.replace(identity, header['role'], header['host'],
                                         header['port'], header.get('rank'),
                                         header.get('pid', 0), time.monotonic(),
                                         header.get('rank_from'))
        if old.lost_since is None:   # if it still lives, it must not serve beside its successor
            self.send(old.identity, {'op': P.SHUTDOWN, 'id': 0, 'fenced': 'replaced',
                                      'reason': 'replaced by a server that rejoined with its rank'})
        self.welcome(node, restarted=True, checkpointed=node.checkpointed)
        for worker in self.members.of_role('worker'):
            if not worker.finished:
                self.send(worker.identity, {'op': P.SERVER_BACK, 'id': 0, 'rank': node.rank,
                                             'host': node.host, 'port': node.port})
        recording.note('rejoin', 'membership', {'node': node.describe()})
        log.warning('%s rejoined the job in place of pid %d', node.describe(), old.pid)

    def welcome(self, node, restarted=False, **fields):
        self.send(node.identity, {'op': P.WELCOME, 'id': 0, 'restarted': restarted, **fields,
                                   'clock': recording.now(),
                                   'recovery_timeout': self.config.recovery_timeout,
                                   'job': self.job,
                                   **self.members.welcome(node)})

    def _on_heartbeat(self, identity, header):
        self.counts.heartbeats += 1
        dropped = self.members.dropped.get(identity)
        if dropped is not None:   # it was not dead after all: it must not wait on
            self.send(identity, P.error_header(header.get('id', 0), ConfigError(
                f'this node left the forming job: {dropped}'), 'scheduler'))
        elif getattr(self.members.nodes.get(identity), 'lost_since', None) is not None:
            # a server taken for lost woke up: the workers wait for its replacement (and take
            # nothing more from it), which only its end lets a launcher start
            self.send(identity, {'op': P.SHUTDOWN, 'id': 0, 'fenced': 'lost',
                                  'reason': _taken_for_lost('server', 'waits for its replacement')})
        elif identity in self.members.nodes:
            if header.get('checkpointed'):   # (a server: a replacement of it will find a file)
                self.members.nodes[identity].checkpointed = True
            # (its clock: a node's timeline aligns its spans with it)
            self.send(identity, {'op': P.HEARTBEAT_ACK, 'id': header.get('id', 0),
                                  'clock': recording.now()})
        elif identity in self.members.replaced:   # it woke up after its successor came
            self.send(identity, {'op': P.SHUTDOWN, 'id': 0, 'fenced': 'replaced',
                                  'reason': 'another server has taken this rank'})
        elif any(node.identity == identity for node in self.members.lost_workers):
            self.send(identity, {'op': P.SHUTDOWN, 'id': 0,
                                  'reason': _taken_for_lost('worker', 'went on without it')})

    def _on_barrier(self, identity, header):
        node = self._worker(identity)
        seq, workers, answer = self._last_barrier
        if header['seq'] == seq and identity in workers:   # sent again: its answer was lost
            self.send(identity, answer)   # (in a reset connection: kvps.worker.resets)
            return
        if recording.RECORDER is not None:
            self._barrier_began.setdefault(header['seq'], recording.now())
        self.release(self.members.arrive(node.identity, header['seq'], header.get('digest'),
                                         header.get('sum'), header.get('call', 'barrier')))
        self._fail_blocked_barriers()

    def release(self, barriers):
        """Answer the workers of each completed barrier (Membership.releasable)."""
        for seq, workers, differs, summed in barriers:
            self.counts.barriers += 1
            began = self._barrier_began.pop(seq, None)
            recorder = recording.RECORDER
            if recorder is not None:
                recorder.span('barrier', 'barrier', recording.now() if began is None else began,
                              {'seq': seq, 'differs': differs})
            answer = {'op': P.BARRIER_DONE, 'id': seq, 'differs': differs, **summed}
            self._last_barrier = seq, frozenset(workers), answer
            for worker in workers:
                self.send(worker, answer)

    def _on_finish(self, identity, header):
        self._worker(identity)
        self.send(identity, {'op': P.ACK, 'id': header.get('id', 0)})
        grace = min(FINISH_GRACE, self.config.heartbeat_timeout / 2)
        self._finishing.setdefault(identity, time.monotonic() + grace)
        if all(n.finished or n.identity in self._finishing
               for n in self.members.of_role('worker')):
            for waiting in list(self._finishing):
                self._finished(waiting)

    def _finished(self, identity):
        """A worker's FINISH takes effect: servers fail the rounds it can never join, and
        so do the barriers; the job ends with its last worker."""
        del self._finishing[identity]
        node = self.members.nodes[identity]
        if self.members.elastic is not None:   # it leaves; the others go on without it
            self.elastic.leave(node)
            return
        self.members.finish(identity)
        recording.note('finish', 'membership', {'node': node.describe()})
        for server in self.members.of_role('server'):
            self.send(server.identity, {'op': P.FINISH, 'id': 0, 'rank': node.rank})
        self._fail_blocked_barriers()
        if self.members.all_workers_finished:
            self.end(0, 'all workers finished')

    def _on_abort(self, identity, header):
        """A member fails (a server that cannot start serving, say): end the job now with
        its reason; a replacement would only fail the same way."""
        node = self.members.nodes.get(identity)
        if node is None or not self.members.ranked:
            raise KVPSError('only members of a running job may abort it')
        self.lose(node, f'{node.describe()} failed: {header["reason"]}')

    def _on_ack(self, identity, header):
        node = self.members.nodes.get(identity)
        if node is None or node.role != 'server':   # (it would be ignored: say so, as for all)
            raise KVPSError('only servers acknowledge membership changes')
        self.elastic.acked(identity, header.get('id'))

    _HANDLERS = {P.REGISTER: _on_register, P.HEARTBEAT: _on_heartbeat,
                 P.BARRIER: _on_barrier, P.FINISH: _on_finish, P.ABORT: _on_abort,
                 P.ACK: _on_ack}

    def _worker(self, identity):
        node = self.members.nodes.get(identity)
        if node is None or node.role != 'worker' or node.rank is None:
            raise KVPSError('only registered workers may do this')
        return node

    def _fail_blocked_barriers(self):
        waiting, finished = self.members.blocked_barriers()
        for identity, seq in waiting:
            exc = KVPSError(f'barrier can never complete: {finished.describe()} has finished')
            # an answer to that barrier, not the end of the job: a worker that catches it may
            # still leave the job cleanly
            self.send(identity, P.error_header(seq, exc, 'scheduler'))

    # -- time -------------------------------------------------------------------------------
    def _tick(self, now):
        REFUSALS.tick(now)
        self.ticker.tick(now)
        if not self.members.ranked:
            for node in self.members.drop_silent(now, self.config.heartbeat_timeout):
                self._dropped(node)
            if now - self.started > self.config.connect_timeout:
                reason = (f'registration timed out after {self.config.connect_timeout:.0f} s: '
                          f'{self.members.missing()} (KVPS_CONNECT_TIMEOUT)')
                self._blame(self.members.missing_ranks(), reason)
                self.end(1, reason)
            return
        for lost in self.members.silent(now, self.config.heartbeat_timeout):
            reason = (f'{lost.describe()} is lost: no heartbeat for '
                      f'{now - lost.last_seen:.1f} s (KVPS_HEARTBEAT_TIMEOUT)')
            if lost.role == 'server' and self.config.recovery_timeout:
                self._await_replacement(lost, reason, now)
            elif not self.lose(lost, reason):
                return
        for identity in [i for i, when in self._finishing.items() if now >= when]:
            self._finished(identity)
        self.elastic.tick(now)
        for lost in self.members.overdue(now, self.config.recovery_timeout):
            self._lose(lost, f'{lost.describe()} is lost and was not replaced within '
                             f'{self.config.recovery_timeout:g} s (KVPS_RECOVERY_TIMEOUT)')
            return

    def _await_replacement(self, lost, reason, now):
        """Keep the job: workers hold their requests for this server until it rejoins."""
        lost.lost_since = now
        recording.note('lost', 'lost', {'node': lost.describe(), 'reason': reason})
        log.warning('%s; waiting up to %g s for a server to rejoin with rank %d',
                    reason, self.config.recovery_timeout, lost.rank)
        for worker in self.members.of_role('worker'):
            if not worker.finished:
                self.send(worker.identity, {'op': P.SERVER_LOST, 'id': 0, 'rank': lost.rank,
                                             'reason': reason})

    def lose(self, lost, reason):
        """A member is lost: an elastic job goes on without a worker while it has enough
        (returns True); else the job ends (False)."""
        if lost.role == 'worker' and self.members.elastic is not None:
            return self.elastic.leave(lost, reason)
        self._lose(lost, reason)
        return False

    def _lose(self, lost, reason, blamed=None):
        """A peer is gone for good: tell everyone who, and end the job (``blamed``: the
        ``(role, rank)`` nodes that ended it, if not only ``lost``)."""
        recording.note('lost', 'lost', {'node': lost.describe(), 'reason': reason})
        self._blame(blamed or [(lost.role, lost.rank)], reason)
        for node in self.members.nodes.values():
            if node is not lost:
                self.send(node.identity, {'op': P.PEER_LOST, 'id': 0, 'role': lost.role,
                                           'rank': lost.rank, 'host': lost.host,
                                           'reason': reason})
        self.end(1, reason)

    def _blame(self, nodes, reason):
        """Name the ``(role, rank)`` nodes that end the job to a launcher, before anyone is
        told: the processes it sees exit first are the ones we stop, not the cause (a
        stopped server, a worker that never registered, does not exit at all)."""
        if not self.config.blame_file:
            return
        try:
            write_atomically(self.config.blame_file,
                             json.dumps({'blame': [list(n) for n in nodes], 'reason': reason}))
        except OSError as exc:   # the launcher's directory is gone: nobody reads it anyway
            log.warning('could not write %s: %s', self.config.blame_file, exc)

    def end(self, code, reason):
        if code:
            log.error('ending the job: %s', reason)
        elif self.config.done_file:   # (a launcher's: see Config.done_file)
            write_atomically(self.config.done_file, 'done')
        for node in self.members.nodes.values():
            if node.role == 'server' or (code and not node.finished):
                self.send(node.identity, {'op': P.SHUTDOWN, 'id': 0, 'reason': reason})
        self.exit_code = code

    def send(self, identity, header):
        try:
            self.router.send_to(identity, P.encode(header))
        except KVPSError as exc:  # the peer is gone; liveness reports it
            log.warning('could not send %s to %r: %s', header['op'], identity, exc)


def _taken_for_lost(role, then):
    """Why a node that woke after the job took it for lost is told to go."""
    return (f'this {role} was silent for longer than KVPS_HEARTBEAT_TIMEOUT (stopped, suspended, '
            f'or its loop held up), so the job took it for lost and {then}')
