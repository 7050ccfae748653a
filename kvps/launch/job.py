"""Run a planned job with any launcher and watch it with one Supervisor: local children, or
runners on other hosts reached through ssh, srun or mpirun, whose processes it watches the
same way (first failure, blame, exit code, output prefixed by role and rank)."""

import os
import sys
import tempfile

from ..config import Config
from ..errors import ConfigError
from ..scheduler.elastic import bounds as elastic_bounds
from ..timeline import merge as timeline_merge, recording as timeline_recording
from ..wire.auth import new_secret
from . import clusters, mps
from .plan import kvps_node, plan_nodes, plan_scheduler
from .processes import Sweeper
from .forwarding import forwarding_signals
from .supervise import Supervisor

# How long a failure waits for the scheduler's blame file when it comes from another host
# (reported by its runner, or read on a shared directory): the exit of a node it stopped
# may arrive first.
REMOTE_BLAME_WAIT = 1.0


def run(opts, environ=None, node_argv=None, out=None, err=None):
    """Start the job planned from `opts`, supervise it, and return the launcher's exit code."""
    environ = os.environ.copy() if environ is None else dict(environ)
    if opts.auth and not any(environ.get(n) for n in ('KVPS_SECRET', 'KVPS_SECRET_FILE')):
        environ['KVPS_SECRET'] = new_secret()   # one secret for the whole job
    node_argv = node_argv or kvps_node(None if opts.launcher == 'local' else opts.python)

    def say(text):
        print(f'kvps.launch: {text}', file=err or sys.stderr, flush=True)
    with tempfile.TemporaryDirectory(prefix='kvps-launch-') as tmp:
        port_file = os.path.join(tmp, 'scheduler.port')
        if opts.launcher in clusters.BATCH:   # on the directory every task shares
            port_file = clusters.rendezvous_base(os.getcwd()) + '.port'
        try:  # catch a bad inherited KVPS_* value here, not in every child
            config = Config.from_env(plan_scheduler(opts, environ, port_file, node_argv).env)
            elastic = elastic_bounds(config) is not None
        except ConfigError as exc:
            say(exc)
            return 2
        problem = config.unrecoverable() or _timeline_problem(opts.timeline)
        if problem:
            say(('--restart-servers: ' if opts.restart_servers else '') + problem)
            return 2
        local = opts.launcher == 'local'
        supervisor = Supervisor(out=out, err=err, grace=opts.grace,
                                restarts={'server': opts.restart_servers,
                                          'worker': opts.restart_workers},
                                tolerated={'worker'} if elastic else (),
                                formed_file=config.formed_file, blame_file=config.blame_file,
                                done_file=config.done_file,
                                sweeper=Sweeper(), mirror_to=port_file if not local else None,
                                blame_wait=0.0 if local else REMOTE_BLAME_WAIT)
        # from here a signal is an event of the supervisor's: one that comes while the MPS
        # daemon starts or stops (each bounded) is acted on after that
        with forwarding_signals(supervisor):
            try:
                with mps.running(opts.mps, environ, supervisor.say,
                                 started=supervisor.sweeper.watch_mps) as variables:
                    environ.update(variables)   # every process, restarted ones too
                    return _supervised(supervisor, opts, environ, port_file, config, node_argv)
            except ConfigError as exc:   # --mps, and no daemon: no process has started
                say(exc)
                return supervisor.stop(2)
            finally:
                supervisor.stop(1 if supervisor.stopped is None else supervisor.stopped)
                if opts.launcher in clusters.BATCH:
                    clusters.remove_rendezvous(port_file[:-len('.port')])
                if opts.timeline:   # every node has exited: their part files are whole
                    _merge_timeline(opts.timeline, supervisor.say)


def _supervised(supervisor, opts, environ, port_file, config, node_argv):
    """Run the job with its launcher; every process has exited when this returns."""
    try:
        if opts.launcher in clusters.BATCH:
            return _run_batch(supervisor, opts, environ, port_file, config, node_argv)
        return _run_job(supervisor, opts, environ, port_file, config, node_argv)
    except ConfigError as exc:   # --env NAME of a variable the launcher lacks
        supervisor.say(exc)
        return supervisor.stop(2)
    finally:  # whatever happened (even a bug here), leave no process behind
        supervisor.stop(1 if supervisor.stopped is None else supervisor.stopped)


def _timeline_problem(path):
    """Why --timeline PATH cannot be written (None if it can): said now, not at the end.
    Part files of an earlier run there go, so the merge joins this job's only."""
    if not path:
        return None
    parts = timeline_recording.parts_dir(path)
    try:
        os.makedirs(parts, exist_ok=True)
        for entry in os.listdir(parts):
            if entry.endswith(timeline_recording.SUFFIX):
                os.unlink(os.path.join(parts, entry))
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


def _placed(spec, opts, environ, report_port=False):
    """The spec itself (local), or the ssh process that runs it on its host."""
    if opts.launcher == 'local':
        return spec
    return clusters.ssh_carrier(spec, opts.hosts, opts, environ, report_port)


def _run_job(supervisor, opts, environ, port_file, config, node_argv):
    """local and ssh: the scheduler first; once it told its port, the others."""
    scheduler = plan_scheduler(opts, environ, port_file if opts.launcher == 'local' else None,
                               node_argv)
    nodes = plan_nodes(opts, environ, 0, node_argv)
    if opts.launcher == 'ssh':
        supervisor.say('over ssh: ' + ', '.join(
            f'{s.name} on {clusters.host_of(opts.hosts, s, opts.num_servers).target}'
            for s in [scheduler, *nodes]))
    child = supervisor.start(_placed(scheduler, opts, environ, report_port=True))
    if child is None:
        return supervisor.stopped
    port = supervisor.wait_for_port(child, port_file, config.connect_timeout)
    if port is None:
        return supervisor.stopped
    for spec in plan_nodes(opts, environ, port, node_argv):
        if supervisor.start(_placed(spec, opts, environ)) is None:
            return supervisor.stopped
    return supervisor.supervise(shutdown_timeout=config.timeout)


def _run_batch(supervisor, opts, environ, port_file, config, node_argv):
    """slurm and mpi: one srun or mpirun starts every process; the scheduler tells the others
    its address and port through the shared working directory."""
    specs = [plan_scheduler(opts, environ, port_file, node_argv),
             *plan_nodes(opts, environ, None, node_argv)]
    carrier = clusters.batch_carrier(specs, port_file[:-len('.port')], opts, environ,
                                     config.connect_timeout)
    if supervisor.start(carrier) is None:
        return supervisor.stopped
    return supervisor.supervise(shutdown_timeout=config.timeout)

