"""Pure cluster membership: registration, rank assignment, barriers, liveness and finishing."""

import collections
import dataclasses

import numpy as np

from ..errors import ConfigError


@dataclasses.dataclass
class Node:
    identity: bytes
    role: str
    host: str
    port: int
    pid: int
    rank_hint: object
    last_seen: float
    rank: int = None
    finished: bool = False
    lost_since: float = None     # a lost server the job is waiting for, since this time
    rank_from: str = None        # the setting that asked for rank_hint ('DMLC_WORKER_ID=3')
    incarnation: int = 0         # elastic: the epoch this worker joined at (0: it formed the job)
    first_barrier: int = 1       # the first barrier this worker is counted at
    beat: float = None           # the heartbeat interval it said it keeps (s), if it did
    checkpointed: bool = False   # a server of this rank has written its checkpoint file

    def describe(self):
        rank = '?' if self.rank is None else self.rank
        return f'{self.role} {rank} (host {self.host}, pid {self.pid})'

    def as_entry(self):
        return {'role': self.role, 'rank': self.rank, 'host': self.host, 'port': self.port,
                'pid': self.pid}


def _registered_label(node):
    rank = '' if node.rank_hint is None else f' {node.rank_hint}'
    return f'{node.role}{rank} (host {node.host}, pid {node.pid})'


def _claim(node):
    """A node that asked for a rank, with the setting that asked (KVPS_RANK unless told)."""
    return (f'{node.role} {node.rank_hint} (host {node.host}, pid {node.pid}, rank from '
            f'{_rank_source(node.rank_hint, node.rank_from)})')


def _rank_source(rank, rank_from):
    return rank_from or f'KVPS_RANK={rank}'


def _listed(items, most=20):
    """Items joined by commas, at most ``most`` of them (a big job's message stays readable)."""
    more = f', and {len(items) - most} more' if len(items) > most else ''
    return ', '.join(items[:most]) + more


class Membership:
    """Who is in the job, with which rank, and who is waiting at which barrier."""

    def __init__(self, num_workers, num_servers, elastic=None, stale_after=None):
        self.want = {'worker': num_workers, 'server': num_servers}
        # a registered node that waits for the job to form heartbeats: one silent longer
        # than this many of its beats (or s, if it did not say its interval) gives up its
        # rank to a new claim of it (None: never)
        self.stale_after = stale_after
        self.dropped = {}          # identity -> why it left before the job formed
        # (min, max) members of an elastic job, or None: a fixed job (a lost worker ends it)
        self.elastic = elastic
        self.epoch = 0             # elastic: bumped by every change of the workers
        self.lost_workers = []     # elastic: the worker Nodes lost so far
        self.nodes = {}            # identity -> Node
        self.replaced = set()      # identities of servers that others have replaced
        self.ranked = False
        self.hosts = None          # how many hosts the workers and servers were on at forming
        self._barrier = {}         # seq -> {worker identity arrived: its digest or None}
        self._brought = {}         # seq -> {worker identity arrived: (its call, all_sum values)}
        self._last_digests = {}    # the digests of the last completed barrier
        self.barriers_done = 0
        self.refusals = collections.deque(maxlen=3)   # the last registrations refused, why
        # setting name -> (value, who set it first): the job size is the scheduler's
        self._shared = {'DMLC_NUM_WORKER': (num_workers, 'the scheduler'),
                        'DMLC_NUM_SERVER': (num_servers, 'the scheduler')}

    # -- registration ------------------------------------------------------------------
    def register(self, identity, role, host, port, rank_hint, pid, now, shared=None,
                 rank_from=None, beat=None):
        """Add a node; raise ConfigError for a bad role, a full role, a taken rank or a
        ``shared`` setting (name -> value) that differs from the first node's that sent it.
        ``rank_from`` names the setting that gave ``rank_hint`` (KVPS_RANK when None). A
        refusal is also kept: the job may end on the node it leaves missing. Returns the node
        that held the rank asked for and has been silent past ``stale_after`` (it gave the
        rank up: a process restarted in its place, as a cluster manager restarts a pod),
        or None."""
        node = Node(identity, role, host, port, pid, rank_hint, now, rank_from=rank_from,
                    beat=beat)
        try:
            stale = self._admit(node, shared or {}, now)
        except ConfigError as exc:
            self.refusals.append(str(exc))
            raise
        self.nodes[identity] = node
        return stale

    def _admit(self, node, shared, now):
        role = node.role
        if role not in self.want:
            raise ConfigError(f'cannot register role {role!r}: expected worker or server')
        if node.identity in self.nodes:
            raise ConfigError(f'{role} with this identity is already registered')
        holder = None
        if node.rank_hint is not None and not self.ranked:
            self._check_rank(role, node.rank_hint, node.rank_from)
            holder = next((n for n in self.of_role(role) if n.rank_hint == node.rank_hint),
                          None)
            if holder is not None and not self._stale(holder, now):
                raise ConfigError(f'{role} rank {node.rank_hint} is claimed twice: '
                                  f'{_claim(holder)} has it, so {_claim(node)} is refused; '
                                  f'give every {role} its own rank')
        full = self.count(role) - (holder is not None) >= self.want[role]
        if self.ranked or full:
            raise ConfigError(f'the job already has its {self.want[role]} {role}(s)')
        self._check_shared(role, node.pid, shared)
        if holder is not None:
            self.drop(holder, f'{_claim(node)} took its rank after {now - holder.last_seen:.1f} '
                      's of its silence')
        return holder

    def _stale(self, node, now):
        if self.stale_after is None:
            return False
        return now - node.last_seen > self.stale_after * (node.beat or 1.0)

    def drop(self, node, why):
        """Before the job forms: ``node`` leaves it (gone, or replaced), its place free."""
        del self.nodes[node.identity]
        self.dropped[node.identity] = why

    def drop_silent(self, now, timeout):
        """Before the job forms: the registered nodes not heard from within ``timeout``
        leave it (they died waiting); returns them."""
        gone = [n for n in self.nodes.values() if now - n.last_seen > timeout]
        for node in gone:
            self.drop(node, f'nothing heard from it for {now - node.last_seen:.1f} s while '
                            'the job formed (KVPS_HEARTBEAT_TIMEOUT)')
        return gone

    def _check_shared(self, role, pid, shared):
        for name, value in shared.items():
            first, who = self._shared.setdefault(
                name, (value, f'the {role} pid {pid} that joined first'))
            if value != first:
                raise ConfigError(f'{name}={value!r} here, but {name}={first!r} on {who}: '
                                  'every node of a job must have the same')

    def replace(self, identity, role, host, port, rank_hint, pid, now, rank_from=None):
        """A server rejoins a running job with a rank (or takes the one lost server's rank);
        return ``(new node, the node it replaces)``. Only servers can rejoin: their state is
        in checkpoints, a worker's is in its training loop."""
        if role != 'server':
            raise ConfigError(f'the job is running with its {self.want.get(role, 0)} {role}(s); '
                              'only a server can rejoin a running job')
        if identity in self.nodes:
            raise ConfigError('a node with this identity is already registered')
        rank = rank_hint if rank_hint is not None else self._only_lost_rank()
        self._check_rank(role, rank, rank_from)
        old = next(n for n in self.of_role('server') if n.rank == rank)
        del self.nodes[old.identity]
        self.replaced.add(old.identity)
        # (its file is the rank's: written by any server that held it, this one's to load)
        node = Node(identity, role, host, port, pid, rank_hint, now, rank=rank,
                    rank_from=rank_from, checkpointed=old.checkpointed)
        self.nodes[identity] = node
        return node, old

    def _check_rank(self, role, rank, rank_from=None):
        want = self.want[role]
        if not isinstance(rank, int) or not 0 <= rank < want:
            variable = 'DMLC_NUM_WORKER' if role == 'worker' else 'DMLC_NUM_SERVER'
            raise ConfigError(f'{_rank_source(rank, rank_from)} is out of range: the job has '
                              f'{want} {role}s ({variable}), ranks 0..{want - 1}')

    def _only_lost_rank(self):
        lost = [n.rank for n in self.of_role('server') if n.lost_since is not None]
        if len(lost) != 1:
            raise ConfigError(f'{len(lost)} servers are lost: a rejoining server must give its '
                              'rank (KVPS_RANK)')
        return lost[0]

    def label(self, identity):
        """A registered node as logs name it: role, the rank it asked for and from which
        setting, host and pid."""
        return self.describe_claim(self.nodes[identity])

    @staticmethod
    def describe_claim(node):
        return _claim(node) if node.rank_hint is not None else _registered_label(node)

    def table(self):
        """Every node of a ranked job, by role and rank, with the address it advertised."""
        nodes = sorted(self.nodes.values(), key=lambda n: (n.role != 'server', n.role, n.rank))
        return _listed([f'{n.role} {n.rank} at {n.host}' + (f':{n.port}' if n.port else '')
                        + f' (pid {n.pid})' for n in nodes])

    def count(self, role):
        return sum(1 for n in self.nodes.values() if n.role == role)

    def of_role(self, role):
        return [n for n in self.nodes.values() if n.role == role]

    @property
    def complete(self):
        return all(self.count(role) == want for role, want in self.want.items())

    def missing(self):
        """A sentence naming how many of each role have not arrived, which ones where that
        can be told, and who did arrive (so a user can tell who is missing)."""
        parts = [f'{want - self.count(role)} of {want} {role}s'
                 for role, want in self.want.items() if self.count(role) < want]
        if not parts:
            return ''
        named = [f'{role} {rank}' for role, rank in self.missing_ranks()]
        came = [_registered_label(n) for n in self.nodes.values()]
        refused = ''.join(f'; refused: {why}' for why in self.refusals)
        return (' and '.join(parts) + ' never registered ('
                + (f'missing: {_listed(named)}; ' if named else '')
                + f'registered: {_listed(came) or "none"}{refused})')

    def missing_ranks(self):
        """``(role, rank)`` of every node that never registered, for the roles whose
        registered nodes all asked for a rank (a launcher gives each one); in the others,
        ranks follow arrival order, so who is missing has no rank yet."""
        found = []
        for role, want in self.want.items():
            nodes = self.of_role(role)
            if any(n.rank_hint is None for n in nodes):
                continue
            taken = {n.rank_hint for n in nodes}
            found += [(role, rank) for rank in range(want) if rank not in taken]
        return found

    def assign_ranks(self):
        """Requested ranks are kept; the rest fill the free ranks in order of arrival."""
        for role in self.want:
            nodes = self.of_role(role)
            taken = {n.rank_hint for n in nodes if n.rank_hint is not None}
            free = iter(r for r in range(self.want[role]) if r not in taken)
            for node in nodes:  # dicts keep insertion (arrival) order
                node.rank = node.rank_hint if node.rank_hint is not None else next(free)
        self.ranked = True
        if self.hosts is None:   # (fixed then: a joiner is told what the first members were)
            self.hosts = len({node.host for node in self.nodes.values()})

    def welcome(self, node):
        servers = sorted(self.of_role('server'), key=lambda n: n.rank)
        welcome = {'rank': node.rank, 'num_workers': self.want['worker'],
                   'num_servers': self.want['server'],
                   'servers': [[s.host, s.port] for s in servers], 'hosts': self.hosts,
                   'nodes': [n.as_entry() for n in self.nodes.values()],
                   'finished': [n.rank for n in self.of_role('worker') if n.finished]}
        if self.elastic is not None:
            workers = self.worker_members()
            welcome.update(num_workers=len(workers), workers=workers, epoch=self.epoch,
                           elastic=True, incarnation=node.incarnation,
                           barriers=node.first_barrier - 1)
        return welcome

    # -- elastic jobs: workers leave and join ----------------------------------------------
    def worker_members(self):
        """``[[rank, incarnation]]`` of the member workers, by rank."""
        return sorted([n.rank, n.incarnation] for n in self.of_role('worker'))

    def leave(self, identity, lost):
        """Take a worker out of an elastic job (``lost``: not finished); a new epoch."""
        node = self.nodes.pop(identity)
        for arrived in (*self._barrier.values(), *self._brought.values()):
            arrived.pop(identity, None)
        if lost:
            self.lost_workers.append(node)
        self.epoch += 1
        return node

    def join(self, identity, host, port, rank_hint, pid, now, rank_from=None):
        """A worker registering into a running elastic job: its Node, with the lowest free
        rank (or ``rank_hint``), counted from the next barrier that no member reached; None
        while that rank is held, or every rank is (it may ask again when a worker leaves)."""
        if self.elastic is None:
            raise ConfigError('the job is running with its '
                              f'{self.want["worker"]} worker(s) and is not elastic: start it '
                              'with --min-workers (KVPS_MIN_WORKERS) to let workers join')
        most = self.elastic[1]
        if rank_hint is not None and not (isinstance(rank_hint, int) and 0 <= rank_hint < most):
            raise ConfigError(f'{_rank_source(rank_hint, rank_from)} is out of range: the '
                              f'elastic job takes ranks 0..{most - 1} (KVPS_MAX_WORKERS={most})')
        taken = {n.rank for n in self.of_role('worker')}
        free = [r for r in range(most) if r not in taken]
        rank = rank_hint if rank_hint is not None else (free[0] if free else None)
        if rank is None or rank in taken:
            return None
        self.epoch += 1
        started = bool(self._barrier.get(self.barriers_done + 1))
        node = Node(identity, 'worker', host, port, pid, rank_hint, now, rank=rank,
                    incarnation=self.epoch, first_barrier=self.barriers_done + 1 + started,
                    rank_from=rank_from)
        self.nodes[identity] = node
        return node

    @property
    def too_few_workers(self):
        """Whether an elastic job has lost workers below its minimum."""
        return len(self.of_role('worker')) < self.elastic[0]

    # -- barriers and finishing -------------------------------------------------------------
    def arrive(self, identity, seq, digest=None, values=None, call='barrier'):
        """Record a worker at barrier ``seq``, with what it asks everyone to agree on, the
        values it adds to theirs (all_sum: float64 bytes) and the call it came from (every
        worker must come from the same); return the barriers to release (``releasable``).
        Workers meet at one barrier at a time, so only the next one may be waited at."""
        first = self.nodes[identity].first_barrier
        if seq != max(self.barriers_done + 1, first):
            raise ConfigError(f'barrier {seq} is out of step: the job is at barrier '
                              f'{self.barriers_done + 1}')
        self._barrier.setdefault(seq, {})[identity] = digest
        self._brought.setdefault(seq, {})[identity] = (call, values)
        return self.releasable()

    def releasable(self):
        """``[(seq, identities released, ranks that disagree, fields of the sum)]`` of the
        barriers now complete (a worker arrived, or one that the others waited for left an
        elastic job); the fields: barrier_sum's."""
        released = []
        while True:
            seq = self.barriers_done + 1
            arrived = self._barrier.get(seq, {})
            if self.elastic is None:
                done = len(arrived) >= self.want['worker']
            else:   # the members counted at this barrier have all come
                done = bool(arrived) and all(n.identity in arrived for n in self.of_role('worker')
                                             if n.first_barrier <= seq)
            if not done:
                return released
            del self._barrier[seq]
            self.barriers_done = seq
            self._last_digests = arrived
            brought = {self.nodes[i].rank: each for i, each in self._brought.pop(seq, {}).items()}
            released.append((seq, sorted(arrived), self.disagreeing(), met(seq, brought)))

    def disagreeing(self):
        """Ranks whose digest at the last completed barrier differs from rank 0's."""
        by_rank = {self.nodes[i].rank: d for i, d in self._last_digests.items()}
        return sorted(rank for rank, d in by_rank.items() if d != by_rank.get(0))

    def blocked_barriers(self):
        """(identity, barrier seq) of the workers waiting at a barrier that a finished worker
        can never reach."""
        finished = [n for n in self.of_role('worker') if n.finished]
        if not finished:
            return [], None
        waiting = sorted((i, seq) for seq, ids in self._barrier.items() for i in ids)
        self._barrier.clear()
        self._brought.clear()
        return waiting, finished[0]

    def finish(self, identity):
        self.nodes[identity].finished = True

    @property
    def all_workers_finished(self):
        return all(n.finished for n in self.of_role('worker'))

    # -- liveness -------------------------------------------------------------------------
    def seen(self, identity, now):
        node = self.nodes.get(identity)
        if node is not None:
            node.last_seen = now

    def silent(self, now, timeout):
        """Nodes that are still in the job but have not been heard from within ``timeout``
        (lost servers the job is waiting for are not counted again)."""
        return [n for n in self.nodes.values()
                if not n.finished and n.lost_since is None and now - n.last_seen > timeout]

    def overdue(self, now, timeout):
        """Lost servers that have not been replaced within ``timeout``."""
        return [n for n in self.of_role('server')
                if n.lost_since is not None and now - n.lost_since > timeout]


def met(seq, brought):
    """The BARRIER_DONE fields of barrier ``seq`` from what the workers brought (rank ->
    (call, all_sum values or None)): a mismatch where they came from different calls (one's
    init met another's barrier: each would go on out of step), else barrier_sum's."""
    calls = {rank: call for rank, (call, _) in brought.items()}
    if len(set(calls.values())) > 1:
        where = ', '.join(f'rank {rank} in {call}' for rank, call in sorted(calls.items()))
        return {'mismatch': f'the workers met at barrier {seq} from different calls ({where}): '
                            'collective calls (init, set_optimizer, barrier, agree, all_sum, '
                            'optimizer states) must come in the same order on every worker'}
    return barrier_sum(values for _, values in brought.values())


def barrier_sum(values):
    """The BARRIER_DONE fields of a barrier whose workers brought ``values`` (float64 bytes
    each, or None): none where no one did; their total where all did, alike in length; else
    why there is none (they met there with different calls)."""
    values = list(values)
    given = [v for v in values if v is not None]
    if not given:
        return {}
    if len(given) < len(values) or len({len(v) for v in given}) > 1:
        return {'sum_error': 'the workers met at this barrier with different calls: all_sum '
                             'of different lengths, or all_sum where another called barrier '
                             'or agree'}
    total = np.zeros(len(given[0]) // 8)
    for each in given:
        total += np.frombuffer(each, '<f8')
    return {'sum': total.tobytes()}
