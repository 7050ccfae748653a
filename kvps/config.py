"""The only reader of os.environ: one frozen Config from KVPS_* names and ps-lite's DMLC_* names."""

import dataclasses
import difflib
import logging
import os

from . import env_parsers as parse
from .env_parsers import Var
from .errors import ConfigError
from .rank_sources import SOURCES as RANK_SOURCES, rank_hint

# How kvps's own log lines look, on nodes and in workers.
LOG_FORMAT = '%(asctime)s %(name)s %(levelname)s %(message)s'

# Every variable kvps reads. README's table is generated from the same facts; keep docs here true.
VARS = (
    Var('role', ('KVPS_ROLE', 'DMLC_ROLE'), parse.role, None,
        'This process\'s role: worker, server or scheduler.'),
    Var('scheduler_host', ('KVPS_SCHEDULER_HOST', 'DMLC_PS_ROOT_URI'), parse.text, None,
        'IP or hostname of the scheduler (resolved with retry until `KVPS_CONNECT_TIMEOUT`; '
        'the first failure is logged once as a warning).'),
    Var('scheduler_port', ('KVPS_SCHEDULER_PORT', 'DMLC_PS_ROOT_PORT'), parse.port, None,
        'TCP port of the scheduler (0 on the scheduler: the OS picks one).'),
    Var('num_workers', ('KVPS_NUM_WORKERS', 'DMLC_NUM_WORKER'), parse.positive_int, None,
        'Number of worker processes in the job.'),
    Var('num_servers', ('KVPS_NUM_SERVERS', 'DMLC_NUM_SERVER'), parse.positive_int, None,
        'Number of server processes in the job.'),
    Var('interface', ('KVPS_INTERFACE', 'DMLC_INTERFACE'), parse.text, None,
        'Network interface whose IPv4 address this node advertises (e.g. eth0).'),
    Var('node_host', ('KVPS_NODE_HOST', 'DMLC_NODE_HOST'), parse.text, None,
        'Address this node advertises to peers (overrides the interface).'),
    Var('use_kubernetes', ('KVPS_USE_KUBERNETES', 'DMLC_USE_KUBERNETES'), parse.flag, False,
        'Scheduler and servers bind 0.0.0.0 (the advertised name is a Service, not a local IP).'),
    # Read by rank_sources.rank_hint, in this order of precedence (they must agree); the
    # launcher removes every one of them from what its children inherit, as it gives ranks.
    Var('rank', RANK_SOURCES, parse.nonneg_int, None,
        'This process\'s rank within its role (the launcher sets `KVPS_RANK`); else ranks '
        'follow the order of registration. The first set of these gives it and the others '
        'must agree: the ps-lite/BytePS/dmlc-tracker ids (`DMLC_WORKER_ID` on workers, '
        '`DMLC_SERVER_ID` on servers), Kubeflow\'s `MX_CONFIG` and TensorFlow\'s `TF_CONFIG` '
        '(`task.index`), a Kubernetes Indexed Job\'s index, and the dmlc tracker\'s task '
        'index, workers first ([launching.md](launching.md#ranks)).'),
    Var('bigarray_bound', ('KVPS_BIGARRAY_BOUND', 'MXNET_KVSTORE_BIGARRAY_BOUND'), parse.positive_int,
        1_000_000, 'Arrays with at least this many elements are split across all servers.'),
    Var('partition_bytes', ('KVPS_PARTITION_BYTES', 'BYTEPS_PARTITION_BYTES'), parse.positive_int,
        16 << 20, 'Arrays of more bytes are cut into parts of at most this size, spread over '
        'the servers (as BytePS): servers sum, update and answer one part while the next '
        'arrives.'),
    Var('timeout', ('KVPS_TIMEOUT',), parse.positive_float, 600.0,
        'Seconds any single wait (reply, barrier, shutdown) may take before RequestTimeout.'),
    Var('connect_timeout', ('KVPS_CONNECT_TIMEOUT',), parse.positive_float, 120.0,
        'Seconds for every node to register with the scheduler.'),
    Var('heartbeat_interval', ('KVPS_HEARTBEAT_INTERVAL',), parse.positive_float, 1.0,
        'Seconds between heartbeats from each node to the scheduler.'),
    Var('heartbeat_timeout', ('KVPS_HEARTBEAT_TIMEOUT',), parse.positive_float, 30.0,
        'Seconds of silence after which a node is declared lost (PeerLostError).'),
    Var('server_plugins', ('KVPS_SERVER_PLUGINS',), parse.modules, None,
        'Servers: modules (comma-separated, installed on their hosts) imported at start, whose '
        'registered optimizers they then run; one that fails stops its server at start '
        '(`kvps.launch --server-plugin`; [plugins.md](plugins.md)).'),
    Var('server_device', ('KVPS_SERVER_DEVICE',), parse.device, 'auto',
        'Where servers keep shards: auto (keys of device-side stores on the GPU when the '
        'server has one, others in host memory), cpu, or cuda (all on the GPU; needs cupy). '
        'Every process logs at INFO, once, the route its GPU values take (`device values: '
        '...`; docs/shared-memory.md).'),
    Var('update_threads', ('KVPS_UPDATE_THREADS',), parse.count_or_auto, 1,
        'Threads a server splits the host update of one key (or part) of 256 Ki elements or '
        'more over, bit for bit as one thread would (numpy releases the GIL). For hosts whose '
        'cores idle while servers update (GPU workers, servers on hosts of their own); where '
        'workers compute on the same cores it slows them. auto: the cores this process may '
        'run on, at most 4.'),
    Var('log_level', ('KVPS_LOG_LEVEL',), parse.log_level, 'WARNING',
        'Python logging level of kvps\'s messages, on nodes and in workers (DEBUG, INFO, ...).'),
    Var('log_refusals', ('KVPS_LOG_REFUSALS',), parse.count_or_all, 3,
        'Refused messages (no or a wrong secret, malformed, from a stranger) of each sender '
        'that a node logs in full; the rest are counted (`refused` in its stats) and summed '
        'up in one line every 10 s, so strangers cannot flood its log. all: log every one.'),
    Var('port_file', ('KVPS_PORT_FILE',), parse.text, None,
        'Scheduler only: write the bound port to this file (the launcher uses it).'),
    Var('port_range', ('KVPS_PORT_RANGE',), parse.port_range, None,
        'Ports LO-HI (both included) the scheduler and servers bind when the port is theirs to '
        'pick (firewalls); one finding all taken fails saying so. Unset: any the OS picks.'),
    Var('checkpoint_dir', ('KVPS_CHECKPOINT_DIR',), parse.text, None,
        'Servers checkpoint weights and optimizer state here and resume from it on start.'),
    Var('checkpoint_every', ('KVPS_CHECKPOINT_EVERY',), parse.nonneg_int, 0,
        'Checkpoint after this many applied updates (0: off; shutdown always checkpoints).'),
    Var('checkpoint_seconds', ('KVPS_CHECKPOINT_SECONDS',), parse.nonneg_float, 0.0,
        'Checkpoint when this many seconds passed since the last one and something changed.'),
    Var('recovery_timeout', ('KVPS_RECOVERY_TIMEOUT',), parse.nonneg_float, 0.0,
        'Seconds the job waits for a lost server to rejoin with its rank (0: a lost server '
        'ends the job). Servers then need KVPS_CHECKPOINT_DIR.'),
    Var('min_workers', ('KVPS_MIN_WORKERS',), parse.positive_int, None, 'Makes the job elastic: '
        'it goes on while at least this many workers are members ([elastic.md](elastic.md)).'),
    Var('max_workers', ('KVPS_MAX_WORKERS',), parse.positive_int, None,
        'Elastic jobs: at most this many member workers at once (default: `DMLC_NUM_WORKER`).'),
    Var('secret', ('KVPS_SECRET',), parse.text, None,
        'Job secret: every message is authenticated with it (the launcher makes one).'),
    Var('secret_file', ('KVPS_SECRET_FILE',), parse.text, None,
        'File holding the job secret (for clusters started by hand).'),
    Var('auth_payload', ('KVPS_AUTH_PAYLOAD',), parse.flag, False,
        'Also authenticate array payloads, not only headers (costs a hash of every byte).'),
    Var('max_inflight_bytes', ('KVPS_MAX_INFLIGHT_BYTES',), parse.positive_int, 1 << 29,
        'Back-pressure: a push waits while this worker has more unacknowledged push bytes.'),
    Var('pushpull_credit', ('KVPS_PUSHPULL_CREDIT',), parse.bytes_or_auto, 'auto',
        'Bytes of a pushpull\'s pushes that may be on the socket before the results of its '
        'earlier waves are back, so that results do not queue behind a whole model\'s '
        'pushes on a slow link (pushes through shared memory take none). 0: no limit. auto: '
        '6 MiB while pushes are compressed (a sign the link is slow), else no limit.'),
    Var('socket_queue', ('KVPS_SOCKET_QUEUE',), parse.nonneg_int, 4 << 20,
        'Bytes of a worker\'s pushes that may wait in its sockets\' queues (to all servers '
        'together, whose connections share its link); more wait in the worker, so that pulls '
        'asked for meanwhile leave ahead of them and results come back while later keys are '
        'pushed (a push then pull loop across a slow link runs as a pushpull; pushes through '
        'shared memory take none). 0: no limit.'),
    Var('max_message_bytes', ('KVPS_MAX_MESSAGE_BYTES',), parse.positive_int, 1 << 31,
        'Largest message a node accepts; larger ones are rejected and logged.'),
    Var('shm', ('KVPS_SHM',), parse.flag, True,
        'Move array payloads of 1 KiB and more between a worker and the servers on its host '
        'through shared memory (/dev/shm) instead of the socket (0: always the socket).'),
    Var('shm_bytes', ('KVPS_SHM_BYTES',), parse.count_or_auto, 'auto',
        'Size of each worker\'s shared-memory segment (made at start, when a server shares '
        'its host) and of each server\'s arena for the weights its local workers pull (made '
        'when the first attaches); the pages of both are reserved 16 MiB at a time as blocks '
        'need them, and what finds no room goes the way it would without. auto: half of '
        '/dev/shm split among the job\'s processes on the host (none under 2 MiB).'),
    Var('ipc', ('KVPS_IPC',), parse.ipc, 'auto',
        'GPU values between a worker and GPU shards on its host: auto (through CUDA IPC, no '
        'host copy, where every server of the job is on the host with GPU shards on a device '
        'the worker\'s reaches; else through shared memory), off (always shared memory or the '
        'socket), cuda (as auto), host (a stand-in on the host for tests without a GPU: '
        'servers keep device-store keys in emulated GPU shards; '
        '[shared-memory.md](shared-memory.md#cuda-ipc)).'),
    Var('ipc_bytes', ('KVPS_IPC_BYTES',), parse.positive_int, 256 << 20,
        'Size of each GPU worker\'s device buffer for the CUDA IPC route (made at its first '
        'GPU push or pull, and only once every server has said it would map it: host shards '
        'and servers on other hosts cost no GPU memory); what finds no room in it takes '
        'shared memory.'),
    Var('malloc_trim_bytes', ('KVPS_MALLOC_TRIM_BYTES',), parse.nonneg_int, 1 << 30,
        'Servers and the workers of a distributed store ask glibc to keep up to this many '
        'freed bytes per heap (and to serve chunks up to 32 MiB from its heaps) instead of '
        'returning message buffers to the kernel and faulting them in again every round (0: '
        'leave malloc as it is).'),
    Var('timeline', ('KVPS_TIMELINE',), parse.text, None,
        'Record a timeline of this node\'s spans into the directory PATH.d (every node of '
        'the job: `python -m kvps.launch --timeline PATH` sets it and merges the nodes\' '
        'files into the Chrome trace PATH; by hand, `python -m kvps.timeline merge`).'),
    Var('stats_seconds', ('KVPS_STATS',), parse.nonneg_float, 0.0,
        'Every node prints a line of its counters (bytes and messages per second, requests '
        'waiting) every this many seconds (0: off; `python -m kvps.launch --stats`).'),
)

_BY_FIELD = {v.field: v for v in VARS}


def variable(field):
    """The variables that set Config field ``field``, as error messages name them."""
    return ' or '.join(_BY_FIELD[field].names)


@dataclasses.dataclass(frozen=True)
class Config:
    """Settings of one kvps process; build with `Config.from_env()` or `Config(**fields)`."""
    role: str = None
    scheduler_host: str = None
    scheduler_port: int = None
    num_workers: int = None
    num_servers: int = None
    interface: str = None
    node_host: str = None
    use_kubernetes: bool = False
    rank: int = None
    # which setting gave the rank ('DMLC_WORKER_ID=3'), as messages name it; not a setting
    rank_from: str = dataclasses.field(default=None, compare=False)
    bigarray_bound: int = 1_000_000
    partition_bytes: int = 16 << 20
    timeout: float = 600.0
    connect_timeout: float = 120.0
    heartbeat_interval: float = 1.0
    heartbeat_timeout: float = 30.0
    server_plugins: tuple = None
    server_device: str = 'auto'
    update_threads: object = 1
    log_level: str = 'WARNING'
    log_refusals: object = 3
    port_file: str = None
    port_range: range = None
    checkpoint_dir: str = None
    checkpoint_every: int = 0
    checkpoint_seconds: float = 0.0
    recovery_timeout: float = 0.0
    min_workers: int = None
    max_workers: int = None
    secret: str = None
    secret_file: str = None
    auth_payload: bool = False
    max_inflight_bytes: int = 1 << 29
    pushpull_credit: object = 'auto'
    socket_queue: int = 4 << 20
    max_message_bytes: int = 1 << 31
    shm: bool = True
    shm_bytes: object = 'auto'
    ipc: str = 'auto'
    ipc_bytes: int = 256 << 20
    malloc_trim_bytes: int = 1 << 30
    timeline: str = None
    stats_seconds: float = 0.0

    def __repr__(self):  # never print the secret in logs or tracebacks
        fields = ', '.join(f'{f.name}={"***" if f.name == "secret" and self.secret else getattr(self, f.name)!r}'
                           for f in dataclasses.fields(self))
        return f'Config({fields})'

    def secret_value(self):
        """The job secret from KVPS_SECRET or KVPS_SECRET_FILE, or None (no authentication)."""
        if self.secret:
            return self.secret
        if self.secret_file:
            try:
                with open(self.secret_file, encoding='utf-8') as f:
                    text = f.read().strip()
            except OSError as exc:
                raise ConfigError(f'KVPS_SECRET_FILE={self.secret_file!r}: {exc}') from None
            if not text:
                raise ConfigError(f'KVPS_SECRET_FILE={self.secret_file!r} is empty')
            return text
        return None

    @classmethod
    def from_env(cls, environ=None, fields=None):
        """Read every variable in VARS (or those of ``fields``); the KVPS_ name wins over its
        aliases."""
        env = os.environ if environ is None else environ
        if fields is not None and 'rank' in fields:   # a rank is one within a role
            fields = {*fields, 'role', 'num_workers'}
        values = {}
        for var in VARS:
            if (fields is not None and var.field not in fields) or var.field == 'rank':
                continue
            for name in var.names:
                raw = env.get(name)
                if raw is not None and raw.strip() != '':
                    try:
                        values[var.field] = var.parse(raw)
                    except ValueError as exc:
                        raise ConfigError(f'{name}={raw!r}: {exc}') from None
                    break
        if fields is None or 'rank' in fields:
            try:
                values['rank'], values['rank_from'] = rank_hint(
                    env, values.get('role'), values.get('num_workers'))
            except ValueError as exc:
                raise ConfigError(str(exc)) from None
        if fields is None:
            _warn_misspelled(env)
        config = cls(**values)
        if config.heartbeat_interval >= config.heartbeat_timeout:
            raise ConfigError(
                f'KVPS_HEARTBEAT_INTERVAL={config.heartbeat_interval:g} must be below '
                f'KVPS_HEARTBEAT_TIMEOUT={config.heartbeat_timeout:g} (several beats per '
                'timeout), else every node is declared lost between two heartbeats')
        return config

    def shared_settings(self, role):
        """The settings every node of ``role`` must share with the job's others, by variable
        name (sent at registration, compared by the scheduler): a worker alone with another
        bound places keys elsewhere ("not initialized" errors), a node alone signing
        payloads has every message refused as forged. The job size is compared with the
        scheduler's: a node started by hand with another one is refused at once, instead of
        the job timing out on a node that 'never registered'."""
        shared = {'KVPS_AUTH_PAYLOAD': bool(self.auth_payload)}
        for name, count in (('DMLC_NUM_WORKER', self.num_workers),
                            ('DMLC_NUM_SERVER', self.num_servers)):
            if count is not None:
                shared[name] = count
        if role == 'worker':
            shared['KVPS_BIGARRAY_BOUND'] = self.bigarray_bound
            shared['KVPS_PARTITION_BYTES'] = self.partition_bytes
        return shared

    def unrecoverable(self, recovery_timeout=None):
        """Why a server lost during this job could not rejoin as KVPS_RECOVERY_TIMEOUT asks
        (None: it can; ``recovery_timeout``: the job's, when not this node's own). It resumes
        from its checkpoint; one written only at init and at the end would take it back to
        the initial weights, every acknowledged update lost."""
        if not (self.recovery_timeout if recovery_timeout is None else recovery_timeout):
            return None
        if not self.checkpoint_dir:
            return ('the job waits for lost servers to rejoin (KVPS_RECOVERY_TIMEOUT), so every '
                    'server needs KVPS_CHECKPOINT_DIR to resume from')
        if not (self.checkpoint_every or self.checkpoint_seconds):
            return ('a server that rejoins resumes from its checkpoint, which without '
                    'KVPS_CHECKPOINT_EVERY or KVPS_CHECKPOINT_SECONDS holds only the inits: it '
                    'would go back to the initial weights and lose every update; set '
                    'KVPS_CHECKPOINT_EVERY=1 (no acknowledged update lost) or an interval')
        return None

    @property
    def formed_file(self):
        """The file the scheduler writes once every node has registered (beside the port
        file; None without one): the launcher tells by it whether a worker that exited had
        joined the job."""
        return None if not self.port_file else self.port_file + '.formed'

    @property
    def done_file(self):
        """The file the scheduler writes when the job ends with every worker finished (beside
        the port file; None without one): a server a launcher restarted as the job ended can
        never rejoin it, and is stopped rather than waited for."""
        return None if not self.port_file else self.port_file + '.done'

    @property
    def blame_file(self):
        """The file the scheduler writes when a node ends the job (lost, failed, never
        registered), naming it (beside the port file; None without one): the processes a
        launcher sees exit first are only told to stop because of it."""
        return None if not self.port_file else self.port_file + '.blame'

    def require_worker(self):
        """Raise ConfigError unless this process may join the job as a worker (DMLC_ROLE
        unset or worker). A scheduler or server process runs its role at ``import kvps`` (as
        MXNet's does) and never gets here, unless its role was set after that import; joining
        as a worker then would take a real worker's place and leave the job a node short."""
        if self.role not in (None, 'worker'):
            raise ConfigError(
                f'DMLC_ROLE={self.role} (or KVPS_ROLE), but this process creates a distributed '
                'store, which only workers do. A scheduler or server runs its role when kvps '
                'is imported (or with `python -m kvps.node`): was the role set after '
                '`import kvps`? Start the training script with DMLC_ROLE=worker')
        return self

    def require_cluster(self):
        """Raise ConfigError naming every variable a distributed node still lacks."""
        needed = ['scheduler_host', 'scheduler_port', 'num_workers', 'num_servers']
        missing = [_BY_FIELD[f].names for f in needed if getattr(self, f) is None]
        if missing:
            names = ', '.join(' or '.join(n[::-1]) for n in missing)
            raise ConfigError(
                f'a distributed kvstore needs {names}; start the job with '
                f'`python -m kvps.launch -n W -s S ...` or set the DMLC_* variables')
        return self

    def to_env(self):
        """The KVPS_* variables that reproduce this Config in a child process."""
        env = {}
        for var in VARS:
            value = getattr(self, var.field)
            if value is not None and value != var.default:
                env[var.names[0]] = (','.join(value) if isinstance(value, tuple) else
                                     parse.port_range_text(value) if isinstance(value, range)
                                     else str(int(value) if isinstance(value, bool) else value))
        return env


_warned = set()   # misspelled names already reported by this process


def _warn_misspelled(env):
    """Warn (once per process) of KVPS_* variables kvps does not read that look like ones it
    does: a typo must not silently leave a setting at its default (KVPS_CHECKPOINT_EVRY=1
    would lose updates a crash). Other KVPS_* names (tools' own) are left alone."""
    known = [name for var in VARS for name in var.names]
    for name in env:
        if name.startswith('KVPS_') and name not in known and name not in _warned:
            close = difflib.get_close_matches(name, known, n=1, cutoff=0.85)
            if close:
                _warned.add(name)
                logging.getLogger('kvps.config').warning(
                    '%s is not a kvps setting and is ignored; did you mean %s?', name, close[0])


def markdown_table():
    """README's table of environment variables, generated so it cannot drift from VARS."""
    rows = ['| variable | ps-lite / MXNet / BytePS name | default | meaning |', '|---|---|---|---|']
    for var in VARS:
        alias = ', '.join(f'`{n}`' for n in var.names[1:]) or '—'
        default = var.default
        text = ('—' if default is None else str(int(default)) if isinstance(default, bool)
                else f'{default:g}' if isinstance(default, float) else str(default))
        rows.append(f'| `{var.names[0]}` | {alias} | {text} | {var.doc} |')
    return '\n'.join(rows)
