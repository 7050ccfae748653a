"""`python -m kvps.launch`: its command line (MXNet's tools/launch.py flags and kvps's own),
checked whole before anything starts.

Planning the processes is `kvps.launch.plan`, placing them on hosts `kvps.launch.clusters`,
running and watching them `kvps.launch.job` and `kvps.launch.supervise`.
"""

import argparse
import math
import os
import re
import shlex
import socket
import sys

from .clusters import DEFAULT_SSH, read_hostfile
from .job import run
from .plan import BY_FIELD, CONTRACT_NAMES, PASSED_DOWN, plan_nodes, plan_scheduler

__all__ = ['build_parser', 'main', 'parse_args', 'plan_nodes', 'plan_scheduler', 'run']

DEFAULT_HOST = '127.0.0.1'
DEFAULT_GRACE = 5.0
LAUNCHERS = ('local', 'ssh', 'slurm', 'mpi')
# Options that only mean something to some launchers: said at once when given to another.
_ONLY_FOR = {'hostfile': ('ssh', 'mpi'), 'identity': ('ssh',), 'ssh': ('ssh',),
             'workdir': ('ssh',)}


def _checked(field, convert=False):
    """An argparse type validating with the config parser, so the CLI and nodes agree."""
    var = BY_FIELD[field]

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


def _resolves(host):
    """Why ``host`` cannot be bound here (None: it can). Only the local launcher asks: its
    scheduler runs here, and a name that does not resolve would only make it retry for the
    whole --connect-timeout while the launcher waits for its port, saying nothing of why."""
    try:
        socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)
    except (OSError, UnicodeError) as exc:   # gaierror is an OSError; idna refuses some names
        return (f'argument --host: {host!r}: cannot resolve it to an IPv4 address on this '
                f'host, where the scheduler binds it ({exc})')
    return None


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


_ASSIGNMENT = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)(?:[=:](.*))?', re.ASCII | re.DOTALL)


def _assignment(text):
    """NAME=VALUE, MXNet's NAME:VALUE, or NAME alone: the launcher's own value of it.
    A name cannot hold = or :, so the first of them ends it."""
    match = _ASSIGNMENT.fullmatch(text)
    if not match:
        raise argparse.ArgumentTypeError(
            f'{text!r}: expected NAME=VALUE (or NAME:VALUE, or NAME to pass on the launcher\'s '
            'own value) with NAME a valid variable name (letters, digits and _, not starting '
            'with a digit)')
    if match[1] in CONTRACT_NAMES:
        raise argparse.ArgumentTypeError(f'{match[1]} is set by the launcher for each process')
    return match[1], match[2]


def _hostfile(text):
    try:
        return text, read_hostfile(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _ssh(text):
    try:
        argv = shlex.split(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f'{text!r}: {exc}') from None
    if not argv:
        raise argparse.ArgumentTypeError('an empty ssh command')
    return text


def _environment_options(p):
    p.add_argument('--env', dest='env', action='append', default=[], type=_assignment,
                   metavar='NAME=VALUE',
                   help='set NAME=VALUE for every process (repeatable; NAME:VALUE as MXNet '
                        'writes it; NAME alone passes on the launcher\'s own value)')
    for role in ('server', 'worker'):
        p.add_argument(f'--env-{role}', dest=f'env_{role}', action='append', default=[],
                       type=_assignment, metavar='NAME=VALUE',
                       help=f'the same, for every {role} only (MXNet\'s --env-{role})')


def _cluster_options(p):
    p.add_argument('--launcher', choices=LAUNCHERS, default='local',
                   help='where the processes run: this host (default); ssh to the hosts of '
                        '-H; the tasks of one srun inside a Slurm allocation; the ranks of '
                        'one mpirun')
    p.add_argument('-H', '--hostfile', type=_hostfile, metavar='FILE',
                   help='hosts, one a line ([user@]host[:ssh-port]); ssh: the scheduler on '
                        'the first, servers then workers round robin; mpi: given to mpirun')
    p.add_argument('-i', '--identity', metavar='FILE',
                   help='ssh: the private key ssh logs in with (ssh -i)')
    p.add_argument('--ssh', type=_ssh, default=DEFAULT_SSH, metavar='COMMAND',
                   help=f'ssh: the ssh command and its options (default "{DEFAULT_SSH}")')
    p.add_argument('--workdir', metavar='DIR',
                   help='ssh: the directory every process runs in on its host (default: this '
                        'one; a shared file system, or the same path everywhere)')
    p.add_argument('--python', metavar='PATH', default=sys.executable,
                   help='ssh, slurm, mpi: the interpreter that runs kvps on the hosts '
                        '(default: this launcher\'s, %(default)s)')


def build_parser():
    """The argument parser of `python -m kvps.launch` (MXNet/dmlc-style long names accepted)."""
    p = argparse.ArgumentParser(
        prog='python -m kvps.launch', allow_abbrev=False,
        description='Start a kvps job: one scheduler, S servers and W workers running '
                    'COMMAND, here or on a cluster; print their output prefixed; stop '
                    'everything on the first failure.')
    p.add_argument('-n', '--num-workers', dest='num_workers', required=True,
                   type=_checked('num_workers', convert=True), metavar='W')
    p.add_argument('-s', '--num-servers', dest='num_servers', type=_servers, metavar='S',
                   help='number of servers (default: W, as MXNet\'s launcher)')
    _cluster_options(p)
    p.add_argument('--host', metavar='ADDR',
                   help=f'address the scheduler binds and everyone dials (default '
                        f'{DEFAULT_HOST}; ssh: the first host; slurm, mpi: the host of the '
                        'first task)')
    for field in PASSED_DOWN:
        var = BY_FIELD[field]
        p.add_argument('--' + field.replace('_', '-'), dest=field, type=_checked(field),
                       metavar='SEC' if field != 'log_level' else 'LEVEL',
                       help=f'{var.doc} Passed down as {var.names[0]}.')
    _environment_options(p)
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
                        'KVPS_RECOVERY_TIMEOUT=60 unless given; local and ssh)')
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
    p.add_argument('--mps', action='store_true',
                   help='run a private CUDA MPS control daemon for the job, so that the '
                        'kernels of its processes sharing a GPU run side by side (local only; '
                        'an MPS daemon named by CUDA_MPS_PIPE_DIRECTORY is used instead)')
    p.add_argument('--grace', type=_grace, default=DEFAULT_GRACE, metavar='SEC',
                   help='seconds between SIGTERM and SIGKILL when stopping (default 5)')
    p.add_argument('command', nargs=argparse.REMAINDER,
                   help='the worker command, e.g. python train.py (after an optional --)')
    return p


def _problem(opts):
    """What is wrong with a whole command line (None: nothing), as its usage error says."""
    for dest, launchers in _ONLY_FOR.items():
        given = getattr(opts, dest)
        if given not in (None, DEFAULT_SSH) and opts.launcher not in launchers:
            flag = {'hostfile': '-H/--hostfile', 'identity': '-i/--identity'}.get(
                dest, '--' + dest)
            return f'{flag} is for --launcher {" or ".join(launchers)}, not {opts.launcher}'
    if opts.mps and opts.launcher != 'local':
        return ('--mps starts an MPS daemon on this host only (--launcher local); with '
                f'--launcher {opts.launcher} run MPS on each host, as cluster admins do '
                '(docs/launching.md#cuda-mps-several-processes-on-one-gpu)')
    if opts.launcher == 'ssh' and opts.hostfile is None:
        return '--launcher ssh needs -H/--hostfile FILE (the hosts to start processes on)'
    if opts.min_workers is None and (opts.max_workers or opts.restart_workers):
        return '--max-workers and --restart-workers need --min-workers (an elastic job)'
    for flag in ('restart_servers', 'restart_workers'):
        if getattr(opts, flag) and opts.launcher in ('slurm', 'mpi'):
            return (f'--{flag.replace("_", "-")}: one task of a {opts.launcher} job cannot be '
                    'started again (use --launcher local or ssh)')
    if opts.launcher == 'local' and opts.host is not None:
        return _resolves(opts.host)
    return None


def parse_args(argv=None):
    """Parse the launcher's command line; exits with usage (code 2) on a bad one."""
    parser = build_parser()
    opts = parser.parse_args(argv)
    if opts.command and opts.command[0] == '--':
        opts.command = opts.command[1:]
    if not opts.command:
        parser.error('missing the command each worker runs (e.g. -- python train.py)')
    problem = _problem(opts)
    if problem:
        parser.error(problem)
    if opts.num_servers is None:
        opts.num_servers = opts.num_workers
    opts.hostfile, opts.hosts = opts.hostfile or (None, None)
    if opts.host is None and opts.launcher == 'local':
        opts.host = DEFAULT_HOST
    elif opts.host is None and opts.launcher == 'ssh':
        opts.host = opts.hosts[0].address
    opts.workdir = opts.workdir or os.getcwd()
    return opts


def main(argv=None, node_argv=None):
    """Entry point of `python -m kvps.launch`; returns the exit code."""
    opts = parse_args(argv)
    try:  # a child's undecodable bytes were replaced; never crash printing them
        sys.stdout.reconfigure(errors='replace')
    except AttributeError:
        pass
    return run(opts, node_argv=node_argv)
