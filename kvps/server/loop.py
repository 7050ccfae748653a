"""The server process: owns the ROUTER that workers talk to and feeds their requests to a Shard."""

import logging
import time
import traceback

import msgpack
import numpy as np

from ..errors import ConfigError, KVPSError, PeerLostError, ProtocolError
from ..wire import protocol as P
from ..wire.items import DataItem
from ..wire.link import SchedulerLink, decode_or_refusal
from ..wire.shm import segment_bytes
from ..wire.transport import Poller, Router, bind_host, guard_from, new_context
from . import row_store
from .batch import Batch
from .checkpoint import Checkpointer
from .regions import Regions
from .shard import Shard
from .storage import for_device, use_update_threads

log = logging.getLogger('kvps.server')

BURST = 64   # requests handled between two checkpoint decisions / reply flushes
# acknowledged only once checkpointed
_DURABLE = (P.INIT, P.SET_OPTIMIZER, P.SET_STATES, P.COMMIT_STATES)


class Recovery:
    """A restarted server waits for every active worker's RESUME before serving anything:
    only then does it know which rounds the job has completed."""

    def __init__(self, awaiting, finished):
        self.awaiting = set(awaiting)    # worker identities not yet resumed
        self.finished = set(finished)    # workers that left the job
        self.acked = {}                  # worker -> RESUME items
        self.parked = []                 # (identity, header, buffers) held until resumed


class Server:
    """Registers with the scheduler, then serves init/push/pull until told to stop."""

    def __init__(self, config):
        self.config = config.require_cluster()
        storage = for_device(config.server_device)   # before joining: a bad device fails alone
        use_update_threads(config.update_threads)
        self.ctx = new_context()
        self.link = SchedulerLink(self.ctx, config, 'server')
        self.router = Router(self.ctx, guard_from(config))
        port = self.router.bind(bind_host(config, self.link.host), 0)
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
        self.shard = Shard(welcome['num_workers'], storage=storage)
        # Only the job's workers may talk to a server; anyone else is refused and logged.
        self.workers = {P.worker_identity(r) for r in range(welcome['num_workers'])}
        self.regions = self._regions(config, welcome)
        self._outbox = []            # replies, sent once the checkpoint that covers them is written
        self._state_pieces = {}      # worker -> the pieces of a SET_STATES it is sending
        self._unsaved = False        # an init or optimizer change that no checkpoint holds yet
        self._resuming = False       # a new job resuming from an earlier job's checkpoint
        self.checkpointer = self._resume_from_checkpoint(welcome)
        self.recovery = None
        if welcome.get('restarted'):
            finished = {P.worker_identity(r) for r in welcome.get('finished', ())}
            self.recovery = Recovery(self.workers - finished, finished)
            log.warning('%s rejoined the job; waiting for %d workers to resume', self.name,
                        len(self.recovery.awaiting))
            if not self.recovery.awaiting:   # every worker has already left
                self._resumed(None)
        self.exit_code = None

    def _regions(self, config, welcome):
        """The workers' segments and this server's arena, which takes its share of /dev/shm
        among the job's processes on this host when KVPS_SHM_BYTES=auto (it reserves pages
        only as weights fill it; weights it cannot hold are copied into a worker's segment
        for every pull)."""
        host = self.link.host
        workers = P.members_on(welcome, host, 'worker')
        size = segment_bytes(config.shm_bytes, workers + P.members_on(welcome, host, 'server'))
        return Regions(config.shm, arena_bytes=size, neighbours=workers)

    def _resume_from_checkpoint(self, welcome):
        """The Checkpointer (None without KVPS_CHECKPOINT_DIR), after loading this rank's file."""
        config = self.config
        restarted = bool(welcome.get('restarted'))
        # The scheduler's KVPS_RECOVERY_TIMEOUT rules (set by hand, this server may lack it).
        problem = config.unrecoverable(welcome.get('recovery_timeout') or float(restarted))
        if problem:
            raise ConfigError(problem)
        if not config.checkpoint_dir:
            return None
        checkpointer = Checkpointer(config.checkpoint_dir, self.rank, welcome['num_servers'],
                                    config.checkpoint_every, config.checkpoint_seconds,
                                    time.monotonic(), welcome.get('job'))
        if checkpointer.load(self.shard, rounds=restarted):
            log.info('%s resumed %d key parts from %s', self.name, len(self.shard.entries),
                     checkpointer.path)
            # A new job counts rounds from 0: rewrite the file at once, so that a server
            # replacing this one never reads the previous job's counts.
            self._unsaved = self._resuming = not restarted
        return checkpointer

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
            self._checkpoint()   # a clean or aborted end keeps every applied round
        except KVPSError as exc:   # (a checkpoint write failed) the job learns why at once
            self.link.abort(f'{exc}')
            raise
        finally:
            self.regions.close()
            self._close_sockets()
        return self.exit_code

    def _close_sockets(self):
        """Close both sockets (what they still hold is delivered within their linger)."""
        self.router.close()
        self.link.close()
        self.ctx.term()

    def _tick(self):
        now = time.monotonic()
        self.regions.tick(now)
        try:
            self.link.tick(now)
        except PeerLostError as exc:
            log.error('%s: %s', self.name, exc)
            self.exit_code = 1

    def _flush(self):
        """Checkpoint if due, then send the replies: an acknowledged init or optimizer change
        is always in the checkpoint (a restarted server must have it), and with
        KVPS_CHECKPOINT_EVERY=1 so is every acknowledged update."""
        if self.checkpointer and (self._unsaved or self.checkpointer.due(self.shard.updates,
                                                                          time.monotonic())):
            self._checkpoint()
        outbox, self._outbox = self._outbox, []
        for kind, (identity, req_id), payload in outbox:
            if not isinstance(identity, Batch):
                self._answer(identity, req_id, kind, payload)
            elif identity.settle(req_id, kind, payload):   # the last key of a batch
                self._answer(identity.identity, identity.req_id, *identity.outcome())

    def _checkpoint(self):
        if self.checkpointer is not None:
            self.checkpointer.write(self.shard, time.monotonic())
            self._unsaved = False

    def _from_scheduler(self):
        header = self.link.next_message()
        if header is None:
            return
        op = header['op']
        if op == P.FINISH:
            worker = P.worker_identity(header['rank'])
            if self.recovery is not None:
                self.recovery.finished.add(worker)
                self._resumed(worker)
            else:
                self.regions.forget(worker)
                self._state_pieces.pop(worker, None)
                self._reply_all(self.shard.worker_finished(worker))
        elif op == P.SHUTDOWN:
            log.info('%s: shutting down: %s', self.name, header.get('reason', ''))
            self.exit_code = 0
        elif op == P.PEER_LOST:
            log.error('%s: %s', self.name, header['reason'])
            self.exit_code = 1

    # -- worker requests --------------------------------------------------------------------
    def _serve_burst(self):
        """Handle the requests waiting (up to BURST), so one checkpoint covers them all."""
        for _ in range(BURST):
            self._serve(*self.router.recv_from())
            if not self.router.raw.poll(0):
                return

    def _serve(self, identity, frames):
        if frames is None:           # authentication refused it, and said why
            return
        if identity not in self.workers:
            log.warning('%s: refused a message from %r: not a worker of this job',
                        self.name, identity)
            return
        decoded = decode_or_refusal(frames, self.config, identity)
        if isinstance(decoded, ProtocolError):   # tell the member why rather than leave it waiting
            req_id = P.request_id(frames)
            if req_id is not None:
                exc = ProtocolError(f'the server could not read this request: {decoded}')
                self._send(identity, P.encode(P.error_header(req_id, exc, self.name)))
            return
        header, buffers = decoded
        if header['op'] == P.RESUME:
            self._on_resume(identity, header)
        elif self.recovery is not None and header['op'] != P.ATTACH:
            # Counts are not settled until every worker resumed (ATTACH involves none).
            self.recovery.parked.append((identity, header, buffers))
        else:
            self._handle(identity, header, buffers)

    def _handle(self, identity, header, buffers):
        token = (identity, header.get('id', 0))
        handler = self._HANDLERS.get(header['op'])
        try:
            if handler is None:
                raise KVPSError(f'{header["op"]!r} is not a server operation')
            replies = handler(self, token, header, buffers)
        except KVPSError as exc:  # the caller's mistake: its message says it all
            replies = [('error', token, exc)]
        except Exception as exc:  # a server bug: log it, answer with its traceback, serve on
            log.exception('%s: %s failed', self.name, header['op'])
            replies = [('error', token, exc)]
        piece = header['op'] == P.SET_STATES and header.get('more')   # (changes nothing yet)
        if header['op'] in _DURABLE and not piece:
            self._unsaved = True
        self._reply_all(replies)

    # -- rejoining a running job -----------------------------------------------------------
    def _on_resume(self, identity, header):
        if self.recovery is None or identity not in self.recovery.awaiting:
            log.warning('%s: ignored a resume from %r: not waiting for it', self.name, identity)
            return
        self.recovery.acked.setdefault(identity, []).extend(header['keys'])
        if not header.get('more'):
            self._resumed(identity)

    def _resumed(self, worker):
        """``worker`` resumed or finished; once all have, settle the counts and serve what
        arrived meanwhile, in order."""
        recovery = self.recovery
        recovery.awaiting.discard(worker)
        if recovery.awaiting:
            return
        self.recovery = None
        lost = self.shard.rebase(recovery.acked, self.workers)
        if lost:
            log.warning('%s: its checkpoint is %d update(s) behind what the workers saw '
                        'acknowledged (KVPS_CHECKPOINT_EVERY/SECONDS): those are lost; %s',
                        self.name, sum(lost.values()),
                        ', '.join(f'{k!r} part {p}: {n}' for (k, p), n in list(lost.items())[:5]))
        for worker in sorted(recovery.finished):
            self._reply_all(self.shard.worker_finished(worker))
        log.warning('%s: every worker resumed; serving %d requests held meanwhile', self.name,
                    len(recovery.parked))
        for identity, header, buffers in recovery.parked:
            self._handle(identity, header, buffers)

    def _init(self, token, h, buffers):
        sync, device = h['sync'], h.get('device', False)

        def init_one(item_token, item, buffer):
            if self._resuming:
                self._refuse_misplaced_init(item.key, item.part)
            return self.shard.init(item_token, item.key, item.part, item.dtype, item.shape, sync,
                                   buffer, device)
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
                f'{self.checkpointer.path} does not hold, while the keys it does hold '
                f'({", ".join(map(repr, unclaimed))}) were never initialized: the keys were '
                "initialized in another order or number than the checkpointed job's (or split "
                'by another KVPS_BIGARRAY_BOUND or KVPS_PARTITION_BYTES); init them as that '
                'job did, or start afresh in '
                'another KVPS_CHECKPOINT_DIR')

    def _check(self, token, h, buffers):
        def check_one(item_token, item, _):
            return self.shard.check(item_token, item.key, item.part, item.dtype, item.shape)
        return self._each_key(token, P.CHECK, h['keys'], [None] * len(h['keys']), check_one)

    def _push(self, token, h, buffers):
        sync, step = h['sync'], h.get('step', 0)

        def push_one(item_token, item, buffer):
            if isinstance(buffer, ProtocolError):   # its shared-memory range is bad
                raise buffer
            return self.shard.push(item_token, token[0], item.key, item.part, item.dtype, sync,
                                   buffer, item.seq, step)
        payloads = self.regions.payloads(token[0], h['keys'], buffers)
        self.regions.saw(token[0], h)   # before the updates: what the worker copied is free
        return self.shard.together(
            lambda: self._each_key(token, P.PUSH, h['keys'], payloads, push_one))

    def _pull(self, token, h, buffers):
        reader = self.regions.saw(token[0], h)
        entries = self.shard.ready_for(token[0], h['keys'])
        places = None if entries is None else self._places(token[0], h['keys'], entries)
        if places is not None:   # one reply now, without settling key by key
            lend = self.shard.lend
            return [('data', token, (reader, [(entry, *lend(entry), place)
                                              for entry, place in zip(entries, places)]))]

        def pull_one(item_token, item, _):
            entry = self.shard.entries.get((item.key, item.part))
            if item.at is not None and entry is not None:   # (no entry: shard.pull says so)
                batch, index = item_token
                batch.places[index] = self._place(token[0], item.at, entry)
            return self.shard.pull(item_token, token[0], item.key, item.part)
        return self._each_key(token, P.PULL, h['keys'], [None] * len(h['keys']), pull_one,
                              reader)

    def _place(self, worker, at, entry):
        """``(at, view)``: where in ``worker``'s shared memory a pulled ``entry`` is asked
        for (ProtocolError if that range is not the worker's)."""
        return at, self.regions.view(worker, at, entry.weight.nbytes)

    def _places(self, worker, items, entries):
        """``_place`` of each pulled key (None: in a frame or lent); None if some offset is
        bad (that key then gets its error alone)."""
        try:
            return [None if item.at is None else self._place(worker, item.at, entry)
                    for item, entry in zip(items, entries)]
        except ProtocolError:
            return None

    def _pull_rows(self, token, h, buffers):
        asked = (buffers[0] if h.get('ids') else None), \
            row_store.LIVE if h.get('live') else h.get('since')
        return self.shard.pull(token, token[0], h['key'], h['part'], asked)

    def _each_key(self, token, op, items, buffers, handle, reader=None):
        """Run ``handle`` per key of a multi-key message; one key's error does not stop the
        others, and the answers are gathered in a Batch (``reader``: the worker reads the
        arena, so the answer may lend weights in it)."""
        batch = Batch(token[0], token[1], op, len(items), reader)
        replies = []
        for index, (item, buffer) in enumerate(zip(items, buffers)):
            try:
                replies += handle((batch, index), item, buffer)
            except KVPSError as exc:
                replies.append(('error', (batch, index), exc))
        return replies

    def _attach(self, token, h, buffers):
        arena = self.regions.attach(token[0], h, time.monotonic())
        self.shard.storage.use_arena(self.regions.arena)
        return [('ack', token, None if arena is None else {'arena': arena})]

    def _set_optimizer(self, token, h, buffers):
        # (a frame, not a header field: per-key options of many keys outgrow a header)
        self.shard.set_optimizer(_map_in(buffers[0], 'set_optimizer: the spec'))
        return [('ack', token, None)]

    def _get_states(self, token, h, buffers):
        blob = msgpack.packb(self.shard.get_states(h['dump']), use_bin_type=True)
        return [('states', token, blob)]

    def _set_states(self, token, h, buffers):
        piece = h.get('piece', 0)
        pieces = self._state_pieces.pop(token[0], []) if piece else []
        if piece != len(pieces):
            raise ConfigError(f'set_states: piece {piece} of the optimizer state came after '
                              f'{len(pieces)} piece(s) (this server restarted during the load?): '
                              'load the states again')
        pieces.append(buffers[0])
        if h.get('more'):   # one piece of a state too big for one message: wait for the rest
            self._state_pieces[token[0]] = pieces
            return [('ack', token, None)]
        states = _map_in(P.joined(pieces), 'set_states: the state')
        self.shard.set_states(states, stage=h.get('stage', False))
        return [('ack', token, None)]

    def _commit_states(self, token, h, buffers):
        self.shard.commit_states()
        return [('ack', token, None)]

    _HANDLERS = {P.INIT: _init, P.CHECK: _check, P.PUSH: _push, P.PULL: _pull,
                 P.PULL_ROWS: _pull_rows,
                 P.SET_OPTIMIZER: _set_optimizer, P.GET_STATES: _get_states,
                 P.SET_STATES: _set_states, P.COMMIT_STATES: _commit_states,
                 P.ATTACH: _attach}

    def _reply_all(self, replies):
        self._outbox += replies

    def _answer(self, identity, req_id, kind, payload):
        """Send one reply: 'ack', 'states' (bytes), 'data' (the parts of a pull) or 'error'."""
        if kind == 'data':
            self._send_data(identity, req_id, payload)
            return
        if kind == 'states':
            self._send_states(identity, req_id, payload)
            return
        if kind == 'error':
            # A caller's mistake speaks for itself; a server bug also carries its traceback.
            tb = '' if isinstance(payload, KVPSError) else ''.join(
                traceback.format_exception(payload))
            frames = P.encode(P.error_header(req_id, payload, self.name, tb))
        elif kind == 'rows':
            epoch, count, data = payload
            frames = P.encode({'op': P.ROWS, 'id': req_id, 'epoch': epoch, 'count': count},
                              [data])
        else:
            frames = P.encode({'op': P.ACK, 'id': req_id, **(payload or {})})
        self._send(identity, frames)

    def _send_states(self, identity, req_id, blob):
        """The packed state ``blob``, in as many STATES as a message may carry."""
        pieces = P.state_pieces(blob, self.config.max_message_bytes)
        for header, piece in zip(P.continued({'op': P.STATES, 'id': req_id}, len(pieces)),
                                 pieces):
            self._send(identity, P.encode(header, [piece]))

    def _send_data(self, identity, req_id, payload):
        """Lend weights in the arena to a worker that reads it, write others into the
        worker's shared memory where it asked, and send the rest without copying them; the
        leases tell the shard when the worker (arena) or zmq (frames) is done with them."""
        reader, parts = payload
        header = {'op': P.DATA, 'id': req_id, 'keys': []}
        frames, sent, in_arena = [], [], []
        for _, array, lease, place in parts:
            at = lent = None
            if reader is not None:
                lent = self.regions.lendable(array)
            if lent is not None:
                in_arena.append((array, lease))
            elif place is None:
                frames.append(array)
                sent.append(lease)
            else:
                at, view = place
                np.frombuffer(view, array.dtype)[...] = array   # (np.copyto: 4x the overhead)
                lease.released = True
            header['keys'].append(DataItem(at, lent))
        if in_arena:
            header['lease'] = self.regions.lend(reader, [array for array, _ in in_arena])
            for _, lease in in_arena:
                lease.reader, lease.number = reader, header['lease']
        tracker = self._send(identity, P.encode(header, frames), track=bool(frames))
        for lease in sent:
            lease.tracker = tracker
            lease.released = tracker is None

    def _send(self, identity, frames, track=False):
        try:
            return self.router.send_to(identity, frames, track)
        except KVPSError as exc:  # that worker is gone; liveness will report it
            log.info('%s: could not answer %r: %s', self.name, identity, exc)
            return None


def _map_in(buffer, what):
    """The map a request's msgpack frame holds; ProtocolError or ConfigError naming ``what``."""
    try:
        value = msgpack.unpackb(buffer, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise ProtocolError(f'{what} is undecodable: {exc!r}') from None
    if not isinstance(value, dict):
        raise ConfigError(f'{what} must be a map')
    return value
