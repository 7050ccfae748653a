"""An elastic job's changes of workers: losses and finishes leave, registrations join, and
every change is announced to servers and workers as a new membership epoch."""

import logging
import time

from ..errors import ConfigError
from ..timeline import recording
from ..wire import protocol as P

log = logging.getLogger('kvps.scheduler')


def bounds(config):
    """``(min, max)`` members of an elastic job (None: a fixed job); ConfigError for bounds
    that do not hold the job's own size."""
    least, most, size = config.min_workers, config.max_workers, config.num_workers
    if least is None:
        if most is not None:
            raise ConfigError('KVPS_MAX_WORKERS is set but KVPS_MIN_WORKERS is not: only an '
                              'elastic job (KVPS_MIN_WORKERS) takes more workers')
        return None
    most = size if most is None else most
    if not least <= (size or most) <= most:
        raise ConfigError(f'KVPS_MIN_WORKERS={least}, DMLC_NUM_WORKER={size}, '
                          f'KVPS_MAX_WORKERS={most}: need min <= workers <= max')
    return least, most


class Elastic:
    """The scheduler's side of elastic workers (docs/elastic.md), driving its Membership and
    sending through it (``scheduler.send``, ``welcome``, ``release``, ``lose``, ``end``)."""

    def __init__(self, scheduler):
        self.scheduler = scheduler
        self.members = scheduler.members
        self._waiting = {}   # identity -> (REGISTER header, since): joiners with no rank yet
        self._admitting = {}  # epoch -> (joining Node, servers that have not acked yet)

    # -- leaving ----------------------------------------------------------------------------
    def leave(self, node, reason=None):
        """``node`` (a worker) is lost (with a ``reason``) or finished: the job goes on
        without it if enough members remain (returns True), else ends naming the lost."""
        lost = reason is not None
        self.members.leave(node.identity, lost)
        recording.note('lost' if lost else 'finish', 'membership', {'node': node.describe()})
        for _, servers in self._admitting.values():
            servers.discard(node.identity)   # (a joiner waits for no lost node)
        if lost and self.members.too_few_workers:
            least = self.members.elastic[0]
            lost_ones = self.members.lost_workers
            named = ', '.join(n.describe() for n in lost_ones)
            self.scheduler._lose(node, f'{reason}; the elastic job has '
                                 f'{len(self.members.of_role("worker"))} worker(s) left, fewer '
                                 f'than its minimum of {least} (KVPS_MIN_WORKERS); lost: {named}',
                                 blamed=[('worker', n.rank) for n in lost_ones])
            return False
        if lost:
            log.warning('%s; the elastic job goes on with %d workers', reason,
                        len(self.members.of_role('worker')))
        self._announce(gone=[[node.rank, node.incarnation]])
        self.scheduler.release(self.members.releasable())
        if not self.members.of_role('worker') and not self._waiting and not self._admitting:
            self.scheduler.end(0, 'all workers finished')
        else:
            self._admit_waiting()
        return True

    # -- joining ----------------------------------------------------------------------------
    def join(self, identity, header):
        """A worker registers into the running job: it gets a rank now, or waits for one."""
        self.members._check_shared('worker', header.get('pid', 0), header.get('shared', {}))
        if not self._try_join(identity, header):
            self._waiting[identity] = (header, time.monotonic())
            log.info('a worker (pid %s) waits for a free rank to join', header.get('pid'))

    def _try_join(self, identity, header):
        node = self.members.join(identity, header['host'], header['port'], header.get('rank'),
                                 header.get('pid', 0), time.monotonic(), header.get('rank_from'))
        if node is None:
            return False
        servers = {s.identity for s in self.members.of_role('server')}
        self._admitting[node.incarnation] = (node, servers)
        for server in servers:   # the joiner is welcomed once every server knows it
            self.scheduler.send(server, self._members_header(joined=[[node.rank,
                                                                      node.incarnation]]))
        return True

    def acked(self, identity, epoch):
        """A server has taken the membership of ``epoch``; the joiner of that epoch is
        welcomed once every server has."""
        admitting = self._admitting.get(epoch)
        if admitting is None:
            return
        node, servers = admitting
        servers.discard(identity)
        if servers:
            return
        del self._admitting[epoch]
        if node.identity not in self.members.nodes:   # it was lost meanwhile
            return
        self.scheduler.welcome(node)
        recording.note('join', 'membership', {'node': node.describe()})
        log.warning('%s joined the elastic job (%d workers)', node.describe(),
                    len(self.members.of_role('worker')))
        header = self._members_header(joined=[[node.rank, node.incarnation]])
        for worker in self.members.of_role('worker'):
            if worker is not node:
                self.scheduler.send(worker.identity, header)

    def _admit_waiting(self):
        for identity, (header, _) in list(self._waiting.items()):
            if self._try_join(identity, header):
                del self._waiting[identity]

    def tick(self, now):
        """Refuse joiners that waited for a rank longer than KVPS_CONNECT_TIMEOUT."""
        bound = self.scheduler.config.connect_timeout
        for identity, (header, since) in list(self._waiting.items()):
            if now - since > bound:
                del self._waiting[identity]
                rank = header.get('rank')
                held = (f'rank {rank} stayed taken' if rank is not None else
                        f'all {self.members.elastic[1]} ranks stayed taken (KVPS_MAX_WORKERS)')
                exc = ConfigError(f'could not join the elastic job: {held} for '
                                  f'{bound:.0f} s (KVPS_CONNECT_TIMEOUT)')
                self.scheduler.send(identity, P.error_header(0, exc, 'scheduler'))

    # -- announcing -------------------------------------------------------------------------
    def _members_header(self, gone=(), joined=()):
        members = self.members
        return {'op': P.MEMBERS, 'id': members.epoch, 'epoch': members.epoch,
                'workers': members.worker_members(), 'gone': list(gone), 'joined': list(joined)}

    def _announce(self, gone):
        """Tell every server and worker the new membership."""
        header = self._members_header(gone=gone)
        for node in list(self.members.nodes.values()):
            self.scheduler.send(node.identity, header)
