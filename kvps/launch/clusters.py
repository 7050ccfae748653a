"""Where a job's processes run beyond this host: over ssh on the hosts of a host file, or as the
tasks of one srun or mpirun. Each is a `python -m kvps.launch.remote` told its part in a
message no command line holds (the job secret is in it): on ssh's stdin, or in a file only
its owner can read on the working directory the tasks share."""

import dataclasses
import json
import os
import shlex
import uuid

from ..atomic import write_atomically
from .plan import CONTRACT_NAMES, for_elsewhere
from .processes import ProcSpec

BATCH = {'slurm': 'srun', 'mpi': 'mpirun'}
DEFAULT_SSH = 'ssh -o BatchMode=yes'


@dataclasses.dataclass(frozen=True)
class Host:
    """One line of a host file: what ssh is given, its ssh port, the name others dial."""
    target: str
    port: str = None

    @property
    def address(self):
        return self.target.rpartition('@')[2]


def parse_host(text):
    """``[user@]host[:port]`` (dmlc's host files give the ssh port after a colon)."""
    target, sep, port = text.partition(':')
    if sep and not port.isdigit() or not target.rpartition('@')[2]:
        raise ValueError(f'{text!r} is not [user@]host[:port]')
    return Host(target, port or None)


def read_hostfile(path):
    """The hosts of a host file: one per line, its first word; blank lines and # comments
    skipped (words after the first, such as MPI's slots=4, are not ssh's business)."""
    try:
        with open(path, encoding='utf-8') as f:
            lines = f.read().splitlines()
    except (OSError, UnicodeError) as exc:
        raise ValueError(f'{path}: cannot read it ({exc})') from None
    hosts = [parse_host(line.split('#', 1)[0].split()[0]) for line in lines
             if line.split('#', 1)[0].strip()]
    if not hosts:
        raise ValueError(f'{path}: no hosts in it')
    return hosts


def host_of(hosts, spec, num_servers):
    """The scheduler on the first host, server r on host r+1 and worker r on host S+1+r,
    round robin (the placement of the old ssh recipe, and of dmlc's tracker after it)."""
    index = {'scheduler': 0, 'server': 1, 'worker': 1 + num_servers}[spec.role]
    return hosts[(index + (spec.rank or 0)) % len(hosts)]


def runner(python):
    return (python, '-m', 'kvps.launch.remote')


def _task(spec, opts, environ):
    return {'name': spec.name, 'role': spec.role, 'rank': spec.rank, 'argv': list(spec.argv),
            'env': for_elsewhere(spec.env, opts, environ)}


def _carrier_env(environ):
    """The local ssh / srun / mpirun process's environment: the launcher's, less the secret
    (the runners have it from their message)."""
    return {k: v for k, v in environ.items() if k != 'KVPS_SECRET'}


def _carried(*specs):
    return tuple(ProcSpec(s.role, s.rank, (), {}) for s in specs)


def ssh_carrier(spec, hosts, opts, environ, report_port=False):
    """The ssh process that runs ``spec`` on its host, its message on stdin."""
    host = host_of(hosts, spec, opts.num_servers)
    message = {'tasks': [_task(spec, opts, environ)], 'grace': opts.grace, 'unset':
               CONTRACT_NAMES, 'watch_stdin': True, 'report_port': report_port}
    remote = (f'cd {shlex.quote(opts.workdir)} && exec '
              + ' '.join(shlex.quote(a) for a in runner(opts.python)))
    argv = [*shlex.split(opts.ssh), '-T', *(['-i', opts.identity] if opts.identity else []),
            *(['-p', host.port] if host.port else []), host.target, remote]
    return ProcSpec(spec.role, spec.rank, tuple(argv), _carrier_env(environ),
                    stdin=(json.dumps(message) + '\n').encode(), tasks=_carried(spec))


def rendezvous_base(directory):
    """Files of one job in the shared working directory: .spec (the message), .host and
    .port (the scheduler's address and port), .port.formed and .port.blame."""
    return os.path.join(directory, f'.kvps-launch-{uuid.uuid4().hex[:12]}')


def batch_carrier(specs, base, opts, environ, wait):
    """The one srun or mpirun that starts every process of the job, each taking its part
    by its rank; tasks that are not the scheduler wait up to ``wait`` s for its port."""
    message = {'tasks': [_task(s, opts, environ) for s in specs], 'grace': opts.grace,
               'unset': CONTRACT_NAMES, 'tag': True,
               'rendezvous': {'ranks': opts.launcher, 'base': base, 'wait': wait}}
    write_atomically(base + '.spec', json.dumps(message))   # mode 0600, as mkstemp makes
    count = str(len(specs))
    if opts.launcher == 'slurm':
        head = ['srun', f'--ntasks={count}', '--kill-on-bad-exit=1']
    else:
        head = ['mpirun', '-n', count, *(['--hostfile', opts.hostfile] if opts.hostfile else [])]
    argv = [*head, *runner(opts.python), '--spec', base + '.spec']
    return ProcSpec(BATCH[opts.launcher], None, tuple(argv), _carrier_env(environ),
                    tasks=_carried(*specs))


def remove_rendezvous(base):
    for suffix in ('.spec', '.host', '.port', '.port.formed', '.port.blame', '.port.done'):
        try:
            os.unlink(base + suffix)
        except FileNotFoundError:
            pass
