"""Server checkpoints: every key part's weight and the optimizer state, written atomically.

A server started with KVPS_CHECKPOINT_DIR resumes from its file (one per rank and job size):
restored keys keep their checkpointed values when workers `init` them again (shape and dtype
are checked), and the optimizer resumes with its state and update counts. Checkpoints are
taken between messages, so every key is at a round boundary; keys may differ by the rounds
applied since the last checkpoint when a server dies, which is why a clean shutdown always
checkpoints.
"""

import contextlib
import fcntl
import logging
import os
import re
import time

import msgpack

from ..atomic import write_atomically
from ..errors import ConfigError, KVPSError
from ..timeline.recording import traced

log = logging.getLogger('kvps.server')
# /2 added version and push counts, /3 the device wish, /4 the job that wrote it, /5 whether
# that job resumed it from an earlier job's file
FORMAT = 'kvps.server_checkpoint/5'
READABLE = ('kvps.server_checkpoint/2', 'kvps.server_checkpoint/3', 'kvps.server_checkpoint/4',
            FORMAT)


def path_for(directory, rank, num_servers):
    return os.path.join(directory, f'server-{rank}-of-{num_servers}.kvps')


_FILE_NAME = re.compile(r'server-(\d+)-of-(\d+)\.kvps')   # path_for's names: rank, servers


def snapshot(shard, job=None, resumed=False, writer=None):
    """The shard's weights and optimizer state as bytes; ``job``: the run writing it,
    ``resumed``: whether that run started from an earlier run's file, ``writer``: the
    server process writing it (Checkpointer.write)."""
    entries = [[e.key, e.part, e.dtype, list(e.shape), e.sync,
                e.arrays.to_host(e.weight).tobytes(), e.version, _applied_pushes(e), e.device,
                e.scale_to]
               for e in shard.entries.values()]
    updater = shard.updater.get_states(dump_optimizer=True) if shard.updater else None
    # The header comes first, so that _header reads it without the weights.
    return msgpack.packb({'format': FORMAT, 'job': job, 'resumed': resumed, 'writer': writer,
                          'entries': entries, 'updater': updater}, use_bin_type=True)


def _header(path):
    """The job that wrote the checkpoint at ``path``, whether it resumed it, and the server
    process that wrote it, read without the weights; (None, True, None) for a file older than
    /5 or one that cannot be read: from an earlier job."""
    header = {}
    try:
        with open(path, 'rb') as f:
            unpacker = msgpack.Unpacker(f, raw=False)
            for _ in range(unpacker.read_map_header()):
                name = unpacker.unpack()
                if name not in ('format', 'job', 'resumed', 'writer'):
                    break
                header[name] = unpacker.unpack()
    except (OSError, ValueError, msgpack.UnpackException):
        pass
    if header.get('format') != FORMAT:
        return None, True, None
    return header.get('job'), header.get('resumed'), header.get('writer')


def _applied_pushes(entry):
    """Per worker, its pushes that the weight holds: sync pushes of the open round are not
    in it (a restarted server learns the round from the workers)."""
    return {} if entry.sync else dict(entry.pushed)


def restore(shard, blob, rounds=False, job=None, path=None):
    """Load ``blob`` (from snapshot) into an empty shard; raise ConfigError if it is not one.
    With ``rounds`` (a server rejoining its running job ``job``) each key keeps its round and
    push counts, and the file must be that job's; a new job starts counting again.
    ``path``: the file's, for the error that says it cannot be read."""
    unreadable = 'unreadable server checkpoint' + (f' {path}' if path else '')
    try:
        state = msgpack.unpackb(blob, raw=False, strict_map_key=False)
        if state.get('format') not in READABLE:
            raise ValueError(f'format {state.get("format")!r}')
    except (ValueError, AttributeError, msgpack.UnpackException) as exc:
        raise ConfigError(f'{unreadable}: {exc!r}') from None
    if rounds and state.get('job') != job:
        # Another run's weights and counts would pass for this job's: the workers'
        # acknowledged pushes would silently be lost (or applied to the wrong values).
        raise ConfigError('the checkpoint was written by another job, not by the server this '
                          "one replaces: a rejoining server must find the lost server's own "
                          'file (is KVPS_CHECKPOINT_DIR the same directory, shared between '
                          'their hosts?)')
    try:
        for key, part, dtype, shape, sync, data, version, pushed, *rest in state['entries']:
            device = bool(rest and rest[0])   # a /2 file predates the device wish
            scale_to = rest[1] if len(rest) > 1 else 0   # (an older /5 file has no scale)
            entry = shard.new_entry(key, part, dtype, shape, sync, data, device, restored=True,
                                    scale_to=scale_to)
            if rounds:
                entry.version, entry.pushed = version, dict(pushed)
            shard.entries[(key, part)] = entry
    except (ValueError, KeyError, TypeError, AttributeError,
            msgpack.UnpackException) as exc:
        raise ConfigError(f'{unreadable}: {exc!r}') from None
    if state['updater'] is not None:   # (a new job's workers count push steps from 0 again)
        shard.set_states(state['updater'], step=None if rounds else 0)


def open_for(config, welcome, shard, name):
    """The Checkpointer of a server joining its job with ``welcome`` (None without
    KVPS_CHECKPOINT_DIR), after resuming ``shard`` from its file, and whether a new job
    resumed from it (``name``: the server's, for its log). A server writes its file at once,
    before it serves anything: a replacement always finds one of this job (of one lost before
    its first change too), never the previous job's counts; and once a replacement has, the
    server it replaced writes no more (Superseded), should it still live."""
    restarted = bool(welcome.get('restarted'))
    # The scheduler's KVPS_RECOVERY_TIMEOUT rules (set by hand, this server may lack it).
    problem = config.unrecoverable(welcome.get('recovery_timeout') or float(restarted))
    if problem:
        raise ConfigError(problem)
    if not config.checkpoint_dir:
        return None, False
    checkpointer = Checkpointer(config.checkpoint_dir, welcome['rank'], welcome['num_servers'],
                                config.checkpoint_every, config.checkpoint_seconds,
                                time.monotonic(), welcome.get('job'))
    checkpointer.claim()
    loaded = checkpointer.load(shard, rounds=restarted,
                               predecessor_wrote=welcome.get('checkpointed', True))
    if loaded and restarted:
        log.info('%s resumed %d key parts from %s', name, len(shard.entries), checkpointer.path)
    elif loaded:   # (seen by default: a user who meant to start afresh learns why not)
        log.warning('%s resumed %d key parts from %s, an earlier job\'s checkpoint in '
                    'KVPS_CHECKPOINT_DIR: inits of those keys keep its values and optimizer '
                    'state (another directory starts afresh)', name, len(shard.entries),
                    checkpointer.path)
    checkpointer.write(shard, time.monotonic())   # before anything is served: see above
    return checkpointer, loaded and not restarted


class Superseded(KVPSError):
    """This server's file was written by a replacement of it: it is the job's no more."""


class Checkpointer:
    """Decides when a checkpoint is due and writes it. ``unsaved``: a change (an init, the
    optimizer or its state) that must be in the file before it is acknowledged."""

    def __init__(self, directory, rank, num_servers, every=0, seconds=0.0, now=0.0, job=None):
        try:
            os.makedirs(directory, exist_ok=True)
        except OSError as exc:   # a KVPSError: the server tells the job why it cannot serve
            raise ConfigError(f'KVPS_CHECKPOINT_DIR={directory!r}: cannot create it: '
                              f'{exc.strerror or exc}') from None
        self.directory, self.num_servers = directory, num_servers
        self.path = path_for(directory, rank, num_servers)
        self.rank, self.job = rank, job
        self.resumed = False   # this job started from the file (an earlier job's)
        self.every, self.seconds = every, seconds
        self._last_updates, self._last_time = 0, now
        self.unsaved = False
        # This process's mark in its files: once it has written one, a file with another's is
        # its successor's (a server that took its rank while it was stopped): see write
        self.writer, self._wrote = os.urandom(8).hex(), False
        self._lock_fd = None   # the lock file's, while this server holds it (claim)

    def claim(self):
        """Hold this rank's lock file (``<file>.lock``) for the life of this process (the
        kernel lets go of it when the process ends), or raise ConfigError where a server of
        another job that still runs holds it: two jobs sharing KVPS_CHECKPOINT_DIR would
        resume from, and write over, each other's live files. A server of this job holding
        it (one this server replaces, stopped but alive) is fenced by the writer marks."""
        fd = os.open(self.path + '.lock', os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors='replace')
            os.close(fd)
            if holder != self.job:
                raise ConfigError(f'{self.path} is held by a server of another job that is '
                                  f'still running (run {holder}): two jobs cannot share '
                                  f'KVPS_CHECKPOINT_DIR={self.directory}; give each its own'
                                  ) from None
            return
        os.ftruncate(fd, 0)
        os.pwrite(fd, (self.job or '').encode(), 0)
        self._lock_fd = fd   # (kept open: closing it would let go of the lock)

    def release(self):
        """At this server's clean end, remove and let go of the lock file it holds (claim):
        the directory keeps only the checkpoints."""
        fd, self._lock_fd = self._lock_fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.unlink(self.path + '.lock')
            os.close(fd)

    def load(self, shard, rounds=False, predecessor_wrote=True):
        """Resume ``shard`` from this server's file if there is one; return whether it did.
        With ``rounds`` (rejoining this job) the file must be there, written by this job,
        unless no server of this rank wrote it (``predecessor_wrote``, as the scheduler heard:
        one lost as it joined served nothing, and its replacement starts empty)."""
        if not os.path.exists(self.path):
            if rounds and not predecessor_wrote:
                log.warning('server %d was lost before it wrote %s as it joined: it served '
                            'nothing, and this one starts empty', self.rank, self.path)
                return False
            if rounds:
                raise ConfigError(f'this server replaces a lost one but finds no checkpoint at '
                                  f'{self.path}, which every server writes as it joins: is '
                                  'KVPS_CHECKPOINT_DIR shared with the lost server\'s host?')
            self._refuse_other_sizes()
            self._refuse_half_resume()
            return False
        with open(self.path, 'rb') as f:
            restore(shard, f.read(), rounds, self.job, self.path)
        # A replacement goes on with the job's own file; a new job marks it as resumed.
        self.resumed = not rounds or _header(self.path)[1]
        self._last_updates = shard.updates
        return True

    def _refuse_other_sizes(self):
        """Keys are split and placed by the number of servers, so a job of another size
        cannot resume from the directory; starting afresh there would look like a resume."""
        named = [(name, _FILE_NAME.fullmatch(name)) for name in os.listdir(self.directory)]
        others = sorted(name for name, match in named
                        if match and int(match.group(2)) != self.num_servers)
        if others:
            raise ConfigError(f'{self.directory} holds checkpoints of a job with another number '
                              f'of servers ({", ".join(others)}), not of one with '
                              f'{self.num_servers} servers: start the job with as many servers '
                              'as wrote them (save_optimizer_states/load_optimizer_states move '
                              'optimizer state between job sizes), or use another '
                              'KVPS_CHECKPOINT_DIR')

    def _refuse_half_resume(self):
        """This server has no file, but the other servers of an earlier job of this size left
        theirs: they would resume their keys while this server's keys started afresh. Files
        this job wrote before this server got here are no earlier job's, unless resumed."""
        earlier = []
        for rank in range(self.num_servers):
            path = path_for(self.directory, rank, self.num_servers)
            if rank != self.rank and os.path.exists(path):
                job, resumed, _ = _header(path)
                if job != self.job or resumed:
                    earlier.append(os.path.basename(path))
        if earlier:
            raise ConfigError(f'{self.directory} holds checkpoints of an earlier job with '
                              f'{self.num_servers} servers ({", ".join(earlier)}) but none for '
                              f'server {self.rank} ({os.path.basename(self.path)} is missing): '
                              'its keys would start afresh while the other servers resume '
                              "theirs; restore that server's file, or start afresh in another "
                              '(or an emptied) KVPS_CHECKPOINT_DIR')

    def due(self, updates, now):
        """Whether to write now, with ``updates`` applied so far: a change is unsaved, or
        KVPS_CHECKPOINT_EVERY updates or KVPS_CHECKPOINT_SECONDS have passed since the last."""
        changed = updates > self._last_updates
        return self.unsaved or changed and (
            (self.every and updates - self._last_updates >= self.every) or
            (self.seconds and now - self._last_time >= self.seconds))

    @traced('checkpoint', 'checkpoint')
    def write(self, shard, now):
        """Write the checkpoint; ConfigError if the file system refuses (the previous file
        is left whole), Superseded if a replacement of this server wrote it since we did."""
        try:
            job, _, writer = _header(self.path) if self._wrote else (None, None, None)
            if writer not in (None, self.writer) and job != self.job:
                raise ConfigError(f'{self.path} was written by another job (run {job}) since '
                                  'this server last wrote it: two running jobs share '
                                  f'KVPS_CHECKPOINT_DIR={self.directory}; give each its own')
            if writer not in (None, self.writer):
                raise Superseded(f'{self.path} was written by another server of this rank (a '
                                 'replacement) since this one last wrote it')
            write_atomically(self.path, snapshot(shard, self.job, self.resumed, self.writer))
            self._wrote = True
        except OSError as exc:
            raise ConfigError(f'cannot write the checkpoint {self.path}: {exc}; the previous '
                              'checkpoint is kept, and nothing since it is acknowledged') from None
        self._last_updates, self._last_time = shard.updates, now
        self.unsaved = False
