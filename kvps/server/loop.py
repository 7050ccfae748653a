"""The server process: polls the ROUTER workers talk to and its scheduler link, and dispatches."""

import dataclasses
import logging
import time

from ..errors import KVPSError, PeerLostError, ProtocolError
from ..timeline import recording
from ..timeline.counters import ServerCounts, Ticker
from ..wire import protocol as P
from ..wire.identities import identity_label, identity_salt, worker_identity
from ..wire.link import SchedulerLink, decoded_or_refusals
from ..wire.ordering import by_priority
from ..wire.refusals import REFUSALS
from ..wire.transport import Poller, bind_host, job_router, new_context
from . import checkpoint, members
from .lending import Lending
from .records import Reply, ReplyKind
from .recovery import Recovery
from .replies import Replies
from .requests import Requests, durable
from .shard import Shard
from .storage import for_device, use_update_threads

log = logging.getLogger('kvps.server')

BURST = 64   # requests handled between two checkpoint decisions / reply flushes
# Requests a restarted server serves before its workers have resumed (they involve no counts)
_SHARING = frozenset([P.ATTACH, P.ATTACH_DEVICE, P.ASK_DEVICE])


class Server:
    """Registers with the scheduler, then serves init/push/pull until told to stop: the
    Requests make the Shard's Replies, which wait for the checkpoint that covers them; a
    restarted server's Recovery holds requests until every worker resumed; the Lending
    maps the shared memory that requests and answers name."""

    def __init__(self, config):
        self.config = config.require_cluster()
        # before joining: a bad device fails alone
        storage = for_device(config.server_device, config.ipc)
        use_update_threads(config.update_threads)
        self.ctx = new_context()
        self.link = SchedulerLink(self.ctx, config, 'server')
        self.router = job_router(self.ctx, config)
        port = self.router.bind(bind_host(config, self.link.host), 0, config.port_range)
        welcome = self.link.register(port)
        try:
            self._join(config, welcome, storage)
        except KVPSError as exc:   # the job would only notice at the heartbeat timeout
            self.link.abort(f'{exc}')
            self._close_sockets()
            raise
        log.info('%s serving on %s:%d', self.name, self.link.host, port)

    def _join(self, config, welcome, storage):
        """Take the rank and shard the WELCOME gives; resume from the checkpoint."""
        self.rank = welcome['rank']
        self.name = f'server {self.rank}'
        recording.name_node(self.rank, self.name)
        elastic = welcome.get('elastic', False)
        self.shard = Shard(welcome['num_workers'], storage=storage, elastic=elastic)
        # Only the job's workers may talk to a server; anyone else is refused and logged.
        self.salt = identity_salt(config.secret_value(), welcome['job'])
        self.workers = set(members.identities(welcome['workers'], self.salt) if elastic else
                           (worker_identity(r, salt=self.salt)
                            for r in range(welcome['num_workers'])))
        self.lending = Lending.on_host(self.link.host, config, welcome, storage)
        self.counts = ServerCounts()
        self.replies = Replies(self.router.send_to, self.name, self.lending,
                               config.max_message_bytes, self.counts)
        self.ticker = Ticker(config.stats_seconds, self.name, self._stats)
        self.checkpointer, resuming = checkpoint.open_for(config, welcome, self.shard, self.name)
        if self.checkpointer is not None:   # before serving anything (see Checkpointer.load)
            self.link.heartbeat(checkpointed=True)
        self.requests = Requests(self.shard, self.lending, self.name,
                                 self.checkpointer.path if resuming else None)
        self.recovery = None
        if welcome.get('restarted'):
            finished = {worker_identity(r, salt=self.salt) for r in welcome.get('finished', ())}
            self.recovery = Recovery(self.name, self.workers - finished, finished)
            log.warning('%s rejoined the job; waiting for %d workers to resume', self.name,
                        len(self.recovery.awaiting))
            self._recovered_if_done()   # (every worker may have left already)
        self.exit_code = None
        self.fenced = False      # told it is no longer the job's server (SHUTDOWN fenced)

    def run(self):
        """Serve until SHUTDOWN (exit 0) or a lost peer (exit 1); return the exit code."""
        poller = Poller()
        poller.register(self.router)
        poller.register(self.link.socket)
        tick = min(self.config.heartbeat_interval, 0.5)
        try:
            while self.exit_code is None:
                for sock in poller.poll(tick):
                    if sock is self.router:
                        self._serve_burst()
                    else:
                        self._from_scheduler()
                self._tick()
                self._flush()
            if not self.fenced:
                self._checkpoint()   # a clean or aborted end keeps every applied round
                if self.checkpointer is not None:
                    self.checkpointer.release()
        except KVPSError as exc:   # (a checkpoint write failed) the job learns why at once
            self.link.abort(f'{exc}')
            raise
        finally:
            self.lending.close()
            self._close_sockets()
        return self.exit_code

    def _close_sockets(self):
        """Close both sockets (what they still hold is delivered within their linger)."""
        self.router.close()
        self.link.close()
        self.ctx.term()

    def _tick(self):
        now = time.monotonic()
        self.lending.tick(now)
        try:
            self.link.tick(now)
        except PeerLostError as exc:
            log.error('%s: %s', self.name, exc)
            self.exit_code = 1
        REFUSALS.tick(now)
        self.ticker.tick(now)

    def _stats(self):
        """The counts of a --stats line (requests, replies, their bytes, updates, refused
        messages), and the requests that wait in open rounds."""
        held = sum(len(entry.held) for entry in self.shard.entries.values())
        counts = {**dataclasses.asdict(self.counts), 'updates': self.shard.updates,
                  'refused': REFUSALS.total}
        return counts, {'held': held}

    def _flush(self):
        """Checkpoint if due, then send the replies: an acknowledged init or optimizer change
        is always in the checkpoint (a restarted server must have it), and with
        KVPS_CHECKPOINT_EVERY=1 so is every acknowledged update."""
        if self.checkpointer and not self.fenced and self.checkpointer.due(
                self.shard.updates, time.monotonic()):
            self._checkpoint()
        if self.fenced:   # its checkpoint is its successor's, and so are the workers
            return
        self.shard.storage.order()   # a device's copies out of the workers' blocks are done
        self.replies.flush()

    def _checkpoint(self):
        if self.checkpointer is None:
            return
        try:
            self.checkpointer.write(self.shard, time.monotonic())
        except checkpoint.Superseded as exc:   # it will be told so, or was while it slept
            log.error('%s: %s: it serves no more', self.name, exc)
            self.fenced = True
            self.exit_code = 0 if self.exit_code is None else self.exit_code

    def _from_scheduler(self):
        header = self.link.next_message()
        if header is None:
            return
        op = header['op']
        if op == P.FINISH:
            worker = worker_identity(header['rank'], salt=self.salt)
            if self.recovery is not None:
                self.recovery.finish(worker)
                self._recovered_if_done()
            else:
                self.lending.forget(worker)
                self.requests.forget(worker)
                self.replies.hold(members.worker_finished(self.shard, worker))
        elif op == P.MEMBERS:
            self._members_changed(header)
        elif op == P.SHUTDOWN and header.get('fenced'):
            # no longer the job's server: its checkpoint is its successor's to write, and
            # one taken for lost fails, so that a launcher starts that successor
            log.error('%s: %s', self.name, header.get('reason', ''))
            self.fenced, self.exit_code = True, int(header['fenced'] == 'lost')
        elif op == P.SHUTDOWN:
            log.info('%s: shutting down: %s', self.name, header.get('reason', ''))
            self.exit_code = 0
        elif op == P.PEER_LOST:
            log.error('%s: %s', self.name, header['reason'])
            self.exit_code = 1

    def _members_changed(self, header):
        """An elastic job's workers changed: rounds go on with the members (kvps.server.members);
        the scheduler welcomes a joiner once every server has acknowledged."""
        gone, joined = (members.identities(header[change], self.salt)
                        for change in ('gone', 'joined'))
        for worker in gone:
            self.workers.discard(worker)
            self.lending.forget(worker)
            self.requests.forget(worker)
            if self.recovery is not None:   # it will not resume (nor fail rounds: it left)
                self.recovery.awaiting.discard(worker)
        self.workers.update(joined)
        replies, discarded = members.change(self.shard, gone, joined)
        self.replies.hold(replies)
        for worker, rounds in discarded.items():
            log.warning('%s: %s left the job: its pushes to %d open round(s) were taken out',
                        self.name, identity_label(worker), rounds)
        if self.recovery is not None:
            self._recovered_if_done()
        self.link.send({'op': P.ACK, 'id': header['epoch']})

    # -- worker requests --------------------------------------------------------------------
    def _serve_burst(self):
        """Take the requests waiting (up to BURST), so one checkpoint covers them all, and
        serve them highest priority first (kvps.wire.ordering: each worker's requests of a
        key part keep their order)."""
        burst = []
        for _ in range(BURST):
            burst += self._admit(*self.router.recv_from())
            if not self.router.raw.poll(0):
                break
        for identity, header, buffers in by_priority(burst):
            self._serve(identity, header, buffers)

    def _admit(self, identity, frames):
        """The ``(identity, header, buffers)`` of each request a message from a worker of this
        job carries (a bundle's: several, kvps.wire.bundle); none for anything else (refused,
        or answered with why it cannot be read)."""
        if frames is None:           # authentication refused it, and said why
            return []
        self.counts.requests += 1
        self.counts.request_bytes += sum(len(frame) for frame in frames)
        if identity not in self.workers:
            REFUSALS.refuse(identity, 'not a worker of this job',
                            '%s: refused a message from %r: not a worker of this job',
                            self.name, identity)
            return []
        admitted = []
        for message, decoded in decoded_or_refusals(frames, self.config, identity):
            if isinstance(decoded, ProtocolError):   # tell the member why: it would wait
                req_id = P.request_id(message)
                if req_id is not None:
                    exc = ProtocolError(f'the server could not read this request: {decoded}')
                    self.replies.send(Reply(ReplyKind.ERROR, (identity, req_id), exc))
                continue
            admitted.append((identity, *decoded))
        return admitted

    def _serve(self, identity, header, buffers):
        """Serve one request: now, or once this restarted server's workers have resumed."""
        if header['op'] == P.RESUME:
            self._on_resume(identity, header)
        elif self.recovery is not None and header['op'] not in _SHARING:
            # Counts are not settled until every worker resumed (ATTACH involves none).
            self.recovery.park(identity, header, buffers)
        else:
            self._handle(identity, header, buffers)

    def _handle(self, identity, header, buffers):
        self.replies.hold(self.requests.handle(identity, header, buffers))
        if self.checkpointer is not None and durable(header):
            self.checkpointer.unsaved = True

    # -- rejoining a running job -----------------------------------------------------------
    def _on_resume(self, identity, header):
        if self.recovery is None or not self.recovery.awaits(identity):
            log.warning('%s: ignored a resume from %r: not waiting for it', self.name, identity)
            return
        self.recovery.resume(identity, header)
        self._recovered_if_done()

    def _recovered_if_done(self):
        """Once every worker resumed or left, settle the counts and serve what arrived
        meanwhile, in order."""
        if not self.recovery.done:
            return
        recovery, self.recovery = self.recovery, None
        finished, parked = recovery.settle(self.shard, self.workers)
        for worker in finished:
            self.replies.hold(members.worker_finished(self.shard, worker))
        for identity, header, buffers in parked:
            self._handle(identity, header, buffers)
