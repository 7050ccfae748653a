"""What each process of a job is given: its role, rank and environment (pure: options in, specs
out), the same for every launcher; where it runs is the launcher's business."""

import sys

from ..config import VARS
from ..errors import ConfigError
from .processes import ProcSpec

DEFAULT_RECOVERY_TIMEOUT = '60'   # seconds the job waits for a restarted server to rejoin

BY_FIELD = {var.field: var for var in VARS}

# Variables the launcher sets in every child. Inherited values under any of their names are
# removed first: a stale KVPS_ROLE would win over the DMLC_ROLE set here (KVPS_* names win).
CONTRACT = ('role', 'scheduler_host', 'scheduler_port', 'num_workers', 'num_servers',
            'rank', 'port_file')
CONTRACT_NAMES = tuple(n for field in CONTRACT for n in BY_FIELD[field].names)

# Options passed down to every child as the native KVPS_* variable of a Config field.
PASSED_DOWN = ('timeout', 'connect_timeout', 'heartbeat_interval', 'heartbeat_timeout',
               'log_level')

# Of the launcher's own environment, what reaches processes on other hosts (whose environment
# is theirs, not this one's): kvps's settings, by any of their names.
_KVPS_NAMES = frozenset(n for var in VARS for n in var.names)
_KVPS_PREFIXES = ('KVPS_', 'DMLC_')


def name(field):
    """The name the launcher sets for a contract field: ps-lite's DMLC_* where there is one
    (a rank's other names are cluster managers', each with a meaning of its own)."""
    names = BY_FIELD[field].names
    return names[0] if field == 'rank' else names[-1]


def kvps_node(python=None):
    """How a scheduler or server starts: ``python -m kvps.node``."""
    return (python or sys.executable, '-m', 'kvps.node')


def _assigned(pairs, environ):
    """``{NAME: VALUE}`` of --env style pairs; a value of None is the launcher's own."""
    env = {}
    for key, value in pairs:
        if value is None:
            if key not in environ:
                raise ConfigError(f'--env {key}: {key} is not set in the launcher\'s '
                                  'environment (give --env NAME=VALUE)')
            value = environ[key]
        env[key] = value
    return env


def common_env(opts, environ):
    """Environment shared by every process of the job."""
    env = {k: v for k, v in environ.items() if k not in CONTRACT_NAMES}
    env.update(_assigned(opts.env, environ))
    for field in PASSED_DOWN:
        value = getattr(opts, field)
        if value is not None:
            for alias in BY_FIELD[field].names:
                env.pop(alias, None)
            env[BY_FIELD[field].names[0]] = value
    if opts.timeline:
        env[BY_FIELD['timeline'].names[0]] = opts.timeline
    for field in ('stats_seconds', 'min_workers', 'max_workers'):
        if getattr(opts, field) is not None:
            env[BY_FIELD[field].names[0]] = getattr(opts, field)
    if opts.restart_servers and not env.get('KVPS_RECOVERY_TIMEOUT'):
        env['KVPS_RECOVERY_TIMEOUT'] = DEFAULT_RECOVERY_TIMEOUT
    if opts.host:
        env[name('scheduler_host')] = opts.host
    env.update({
        name('num_workers'): str(opts.num_workers),
        name('num_servers'): str(opts.num_servers),
        'PYTHONUNBUFFERED': '1',  # so the prefixed output arrives line by line, as printed
    })
    return env


def for_elsewhere(env, opts, environ):
    """Of a process's environment, what a process on another host is given: kvps's settings
    and what the options set (the rest is that host's own)."""
    given = {*_assigned(opts.env, environ), *_assigned(opts.env_server, environ),
             *_assigned(opts.env_worker, environ), 'PYTHONUNBUFFERED'}
    return {k: v for k, v in env.items()
            if k in given or k in _KVPS_NAMES or k.startswith(_KVPS_PREFIXES)}


def plan_scheduler(opts, environ, port_file, node_argv=None):
    """The scheduler's spec: port 0 (the OS picks) and the file it reports the port through
    (None: its runner elsewhere chooses one)."""
    env = common_env(opts, environ)
    env.update({name('role'): 'scheduler', name('scheduler_port'): '0'})
    if port_file:
        env[name('port_file')] = port_file
    return ProcSpec('scheduler', None, tuple(node_argv or kvps_node()), env)


def plan_nodes(opts, environ, port, node_argv=None):
    """Specs of the servers, then the workers, with ranks in launch order, dialing `port`
    (None: told later)."""
    common = common_env(opts, environ)
    if port is not None:
        common[name('scheduler_port')] = str(port)
    specs = []
    node = tuple(node_argv or kvps_node())
    for role, count, argv, extra in (('server', opts.num_servers, node, opts.env_server),
                                     ('worker', opts.num_workers, opts.command,
                                      opts.env_worker)):
        for rank in range(count):
            env = dict(common, **{name('role'): role, name('rank'): str(rank)})
            env.update(_assigned(extra, environ))
            if role == 'server' and opts.server_plugins:
                _add_plugins(env, opts.server_plugins)
            specs.append(ProcSpec(role, rank, tuple(argv), env))
    return specs


def _add_plugins(env, plugins):
    """--server-plugin modules after those KVPS_SERVER_PLUGINS already names."""
    var = BY_FIELD['server_plugins'].names[0]
    env[var] = ','.join(filter(None, (env.get(var, '').strip(), *plugins)))
