"""`python -m kvps.launch`: plan a job on this host (scheduler, servers, workers), run it, watch it.

Planning is pure (arguments -> process specs); running and supervising generic specs lives in
`kvps.launch.supervise`, which does not need kvps itself to be runnable.
"""

import argparse
import math
import os
import re
import socket
import sys
import tempfile

from ..config import VARS, Config
from ..errors import ConfigError
from ..scheduler.elastic import bounds as elastic_bounds
from ..timeline import merge as timeline_merge, recording as timeline_recording
from ..wire.auth import new_secret
from .processes import ProcSpec, Sweeper
from .supervise import Supervisor, forwarding_signals

NODE_ARGV = (sys.executable, '-m', 'kvps.node')
DEFAULT_HOST = '127.0.0.1'
DEFAULT_GRACE = 5.0
DEFAULT_RECOVERY_TIMEOUT = '60'   # seconds the job waits for a restarted server to rejoin

_BY_FIELD = {var.field: var for var in VARS}

# Variables the launcher sets in every child. Inherited values under any of their names are
# removed first: a stale KVPS_ROLE would win over the DMLC_ROLE set here (KVPS_* names win).
_CONTRACT = ('role', 'scheduler_host', 'scheduler_port', 'num_workers', 'num_servers',
             'rank', 'port_file')

# Options passed down to every child as the native KVPS_* variable of a Config field.
_PASSED_DOWN = ('timeout', 'connect_timeout', 'heartbeat_interval', 'heartbeat_timeout',
                'log_level')


def _name(field):
    """The name the launcher sets for a contract field: ps-lite's DMLC_* where there is one
    (a rank's other names are cluster managers', each with a meaning of its own)."""
    names = _BY_FIELD[field].names
    return names[0] if field == 'rank' else names[-1]


def _checked(field, convert=False):
    """An argparse type validating with the config parser, so the CLI and nodes agree."""
    var = _BY_FIELD[field]

    def parse(text):
        try:
            value = var.parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f'{text!r}: {exc}') from None
        return value if convert else text.strip()
    parse.__name__ = field
    return parse


def _servers(text):
    value = _checked('num_servers', convert=True)
    try:
        return value(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f'{text!r}: need at least one server') from None


def _host(text):
    """--host, resolved here, on the host where the scheduler binds it: a name that does not
    resolve would only make the scheduler retry for the whole --connect-timeout while the
    launcher waits for its port, and then say nothing of why."""
    host = _checked('scheduler_host')(text)
    try:
        socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)
    except (OSError, UnicodeError) as exc:   # gaierror is an OSError; idna refuses some names
        raise argparse.ArgumentTypeError(
            f'{host!r}: cannot resolve it to an IPv4 address on this host, where the scheduler '
            f'binds it ({exc})') from None
    return host


def _grace(text):
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    # inf would make every wait for a stopped child endless (the launcher must never hang)
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f'{text!r}: must be a finite number >= 0')
    return value


def _plugin(text):
    names = _checked('server_plugins', convert=True)(text)
    if len(names) != 1:
        raise argparse.ArgumentTypeError(f'{text!r}: one module name per --server-plugin')
    return names[0]


def _count(text):
    if not text.strip().isdigit():
        raise argparse.ArgumentTypeError(f'{text!r}: expected a whole number >= 0')
    return int(text)


_ENV_NAME = re.compile(r'[A-Za-z_][A-Za-z0-9_]*')


def _assignment(text):
    name, sep, value = text.partition('=')
    if not sep:
        raise argparse.ArgumentTypeError(f'{text!r}: expected NAME=VALUE')
    # a shell could never export such a name, and most tools would not see it
    if not _ENV_NAME.fullmatch(name):
        raise argparse.ArgumentTypeError(
            f'{name!r}: expected NAME=VALUE with NAME a valid variable name '
            '(letters, digits and _, not starting with a digit)')
    owned = {n for field in _CONTRACT for n in _BY_FIELD[field].names}
    if name in owned:
        raise argparse.ArgumentTypeError(f'{name} is set by the launcher for each process')
    return name, value


def build_parser():
    """The argument parser of `python -m kvps.launch` (MXNet/dmlc-style long names accepted)."""
    p = argparse.ArgumentParser(
        prog='python -m kvps.launch', allow_abbrev=False,
        description='Start a kvps job on this host: one scheduler, S servers and W workers '
                    'running COMMAND; print their output prefixed; stop everything on the '
                    'first failure.')
    p.add_argument('-n', '--num-workers', dest='num_workers', required=True,
                   type=_checked('num_workers', convert=True), metavar='W')
    p.add_argument('-s', '--num-servers', dest='num_servers', required=True, type=_servers,
                   metavar='S')
    p.add_argument('--host', default=DEFAULT_HOST, type=_host,
                   help=f'address the scheduler binds and everyone dials (default {DEFAULT_HOST})')
    for field in _PASSED_DOWN:
        var = _BY_FIELD[field]
        p.add_argument('--' + field.replace('_', '-'), dest=field, type=_checked(field),
                       metavar='SEC' if field != 'log_level' else 'LEVEL',
                       help=f'{var.doc} Passed down as {var.names[0]}.')
    p.add_argument('--env', dest='env', action='append', default=[], type=_assignment,
                   metavar='NAME=VALUE', help='set NAME=VALUE for every process (repeatable)')
    p.add_argument('--server-plugin', dest='server_plugins', action='append', default=[],
                   type=_plugin, metavar='MODULE',
                   help='a module every server imports at start, whose registered optimizers '
                        'it may then run (repeatable; added to KVPS_SERVER_PLUGINS, which only '
                        'servers are given)')
    p.add_argument('--no-auth', dest='auth', action='store_false',
                   help='do not generate a job secret (by default every message of the job is '
                        'authenticated with a fresh KVPS_SECRET, unless one is already set)')
    p.add_argument('--restart-servers', dest='restart_servers', type=_count, default=0,
                   metavar='N',
                   help='restart a server that dies, up to N times in all; it rejoins with its '
                        'rank and resumes from its checkpoint (needs KVPS_CHECKPOINT_DIR; sets '
                        f'KVPS_RECOVERY_TIMEOUT={DEFAULT_RECOVERY_TIMEOUT} unless given)')
    p.add_argument('--min-workers', dest='min_workers', type=_checked('min_workers'),
                   metavar='M', help='make the job elastic: it goes on while at least M workers '
                                     'are members; workers may leave and join (KVPS_MIN_WORKERS; '
                                     'docs/elastic.md)')
    p.add_argument('--max-workers', dest='max_workers', type=_checked('max_workers'),
                   metavar='X', help='elastic jobs: at most X workers at once (default: -n; '
                                     'KVPS_MAX_WORKERS)')
    p.add_argument('--restart-workers', dest='restart_workers', type=_count, default=0,
                   metavar='N', help='elastic jobs: restart a worker that dies, up to N times in '
                                     'all; it rejoins as a new member')
    p.add_argument('--timeline', metavar='PATH', type=os.path.abspath,
                   help='every node records a timeline of its spans (KVPS_TIMELINE); at the end '
                        'they are merged into the Chrome trace PATH (open it in Perfetto, or '
                        'read it with python -m kvps.timeline summary PATH)')
    p.add_argument('--stats', dest='stats_seconds', type=_checked('stats_seconds'),
                   metavar='SEC', help='every node prints a line of counters every SEC '
                                       'seconds (KVPS_STATS)')
    p.add_argument('--grace', type=_grace, default=DEFAULT_GRACE, metavar='SEC',
                   help='seconds between SIGTERM and SIGKILL when stopping (default 5)')
    p.add_argument('command', nargs=argparse.REMAINDER,
                   help='the worker command, e.g. python train.py (after an optional --)')
    return p


def parse_args(argv=None):
    """Parse the launcher's command line; exits with usage (code 2) on a bad one."""
    parser = build_parser()
    opts = parser.parse_args(argv)
    if opts.command and opts.command[0] == '--':
        opts.command = opts.command[1:]
    if not opts.command:
        parser.error('missing the command each worker runs (e.g. -- python train.py)')
    if opts.min_workers is None and (opts.max_workers or opts.restart_workers):
        parser.error('--max-workers and --restart-workers need --min-workers (an elastic job)')
    return opts


def _common_env(opts, environ):
    """Environment shared by every process of the job."""
    env = dict(environ)
    for field in _CONTRACT:
        for name in _BY_FIELD[field].names:
            env.pop(name, None)
    env.update(opts.env)
    for field in _PASSED_DOWN:
        value = getattr(opts, field)
        if value is not None:
            for name in _BY_FIELD[field].names:
                env.pop(name, None)
            env[_BY_FIELD[field].names[0]] = value
    if opts.timeline:
        env[_BY_FIELD['timeline'].names[0]] = opts.timeline
    for field in ('stats_seconds', 'min_workers', 'max_workers'):
        if getattr(opts, field) is not None:
            env[_BY_FIELD[field].names[0]] = getattr(opts, field)
    if opts.restart_servers and not env.get('KVPS_RECOVERY_TIMEOUT'):
        env['KVPS_RECOVERY_TIMEOUT'] = DEFAULT_RECOVERY_TIMEOUT
    env.update({
        _name('scheduler_host'): opts.host,
        _name('num_workers'): str(opts.num_workers),
        _name('num_servers'): str(opts.num_servers),
        'PYTHONUNBUFFERED': '1',  # so the prefixed output arrives line by line, as printed
    })
    return env


def plan_scheduler(opts, environ, port_file, node_argv=NODE_ARGV):
    """The scheduler's spec: port 0 (the OS picks) and the file it reports the port through."""
    env = _common_env(opts, environ)
    env.update({_name('role'): 'scheduler', _name('scheduler_port'): '0',
                _name('port_file'): port_file})
    return ProcSpec('scheduler', None, tuple(node_argv), env)


def plan_nodes(opts, environ, port, node_argv=NODE_ARGV):
    """Specs of the servers, then the workers, with ranks in launch order, dialing `port`."""
    common = _common_env(opts, environ)
    common[_name('scheduler_port')] = str(port)
    specs = []
    for role, count, argv in (('server', opts.num_servers, node_argv),
                              ('worker', opts.num_workers, opts.command)):
        for rank in range(count):
            env = dict(common, **{_name('role'): role, _name('rank'): str(rank)})
            if role == 'server' and opts.server_plugins:
                _add_plugins(env, opts.server_plugins)
            specs.append(ProcSpec(role, rank, tuple(argv), env))
    return specs


def _add_plugins(env, plugins):
    """--server-plugin modules after those KVPS_SERVER_PLUGINS already names."""
    name = _BY_FIELD['server_plugins'].names[0]
    env[name] = ','.join(filter(None, (env.get(name, '').strip(), *plugins)))


def run(opts, environ=None, node_argv=NODE_ARGV, out=None, err=None):
    """Start the job planned from `opts`, supervise it, and return the launcher's exit code."""
    environ = os.environ.copy() if environ is None else dict(environ)
    if opts.auth and not any(environ.get(n) for n in ('KVPS_SECRET', 'KVPS_SECRET_FILE')):
        environ['KVPS_SECRET'] = new_secret()   # one secret for the whole job
    with tempfile.TemporaryDirectory(prefix='kvps-launch-') as tmp:
        port_file = os.path.join(tmp, 'scheduler.port')
        scheduler = plan_scheduler(opts, environ, port_file, node_argv)
        try:  # catch a bad inherited KVPS_* value here, not in every child
            config = Config.from_env(scheduler.env)
            elastic = elastic_bounds(config) is not None
        except ConfigError as exc:
            print(f'kvps.launch: {exc}', file=err or sys.stderr, flush=True)
            return 2
        problem = config.unrecoverable() or _timeline_problem(opts.timeline)
        if problem:
            flag = '--restart-servers: ' if opts.restart_servers else ''
            print(f'kvps.launch: {flag}{problem}', file=err or sys.stderr, flush=True)
            return 2
        supervisor = Supervisor(out=out, err=err, grace=opts.grace,
                                restarts={'server': opts.restart_servers,
                                          'worker': opts.restart_workers},
                                tolerated={'worker'} if elastic else (),
                                formed_file=config.formed_file,
                                blame_file=config.blame_file, sweeper=Sweeper())
        with forwarding_signals(supervisor):
            try:
                return _run_job(supervisor, opts, environ, scheduler, config, node_argv)
            finally:  # whatever happened (even a bug here), leave no process behind
                supervisor.stop(1 if supervisor.stopped is None else supervisor.stopped)
                if opts.timeline:   # every node has exited: their part files are whole
                    _merge_timeline(opts.timeline, supervisor.say)


def _timeline_problem(path):
    """Why --timeline PATH cannot be written (None if it can): said now, not at the end.
    Part files of an earlier run there go, so the merge joins this job's only."""
    if not path:
        return None
    parts = timeline_recording.parts_dir(path)
    try:
        os.makedirs(parts, exist_ok=True)
        for name in os.listdir(parts):
            if name.endswith(timeline_recording.SUFFIX):
                os.unlink(os.path.join(parts, name))
        with tempfile.TemporaryFile(dir=os.path.dirname(path)):
            pass
    except OSError as exc:
        return f'--timeline {path}: cannot write there ({exc.strerror or exc})'
    return None


def _merge_timeline(path, say):
    """Join the nodes' part files into the trace at ``path``."""
    try:
        other = timeline_merge.merge([path], path)
    except (ConfigError, OSError) as exc:
        say(f'the timeline could not be merged: {exc}')
        return
    say(f'timeline of {len(other["nodes"])} nodes written to {path} '
        f'(python -m kvps.timeline summary {path})')


def _run_job(supervisor, opts, environ, scheduler, config, node_argv):
    child = supervisor.start(scheduler)
    if child is None:
        return supervisor.stopped
    port_file = scheduler.env[_name('port_file')]
    port = supervisor.wait_for_port(child, port_file, config.connect_timeout)
    if port is None:
        return supervisor.stopped
    for spec in plan_nodes(opts, environ, port, node_argv):
        if supervisor.start(spec) is None:
            return supervisor.stopped
    return supervisor.supervise(shutdown_timeout=config.timeout)


def main(argv=None, node_argv=NODE_ARGV):
    """Entry point of `python -m kvps.launch`; returns the exit code."""
    opts = parse_args(argv)
    try:  # a child's undecodable bytes were replaced; never crash printing them
        sys.stdout.reconfigure(errors='replace')
    except AttributeError:
        pass
    return run(opts, node_argv=node_argv)

