"""The launcher's cluster flags (MXNet's tools/launch.py names), host files, and what each
launcher hands its processes: ssh's command line and message, srun's and mpirun's, the
runner's choice of task by rank. No process is started here."""

import json
import os
import re
import stat

import pytest

from kvps.errors import ConfigError
from kvps.launch import cli as launch, clusters, plan, remote, tasks
from kvps.launch.processes import ProcSpec


@pytest.fixture
def hostfile(tmp_path):
    path = tmp_path / 'hosts'
    path.write_text('# the cluster\nnode1 slots=4\n\n  me@node2:2222  # a comment\nnode3\n')
    return str(path)


def test_mxnet_flags_and_forms(hostfile):
    opts = launch.parse_args(['-n', '3', '-H', hostfile, '--launcher', 'ssh',
                              '--env-server', 'OMP_NUM_THREADS:3', '--env-worker', 'B=x:y=z',
                              '--env', 'PASSED', 'python', 'train.py'])
    assert (opts.num_workers, opts.num_servers) == (3, 3)   # -s defaults to -n, as MXNet's
    assert opts.launcher == 'ssh' and opts.hostfile == hostfile
    assert opts.hosts == [clusters.Host('node1'), clusters.Host('me@node2', '2222'),
                          clusters.Host('node3')]
    assert opts.host == 'node1'            # the scheduler's host, as everyone dials it
    assert opts.env_server == [('OMP_NUM_THREADS', '3')]
    assert opts.env_worker == [('B', 'x:y=z')] and opts.env == [('PASSED', None)]
    assert opts.workdir == os.getcwd() and opts.command == ['python', 'train.py']


def test_the_local_launcher_stays_the_default():
    opts = launch.parse_args(['-n', '1', 'cmd'])
    assert (opts.launcher, opts.host, opts.num_servers, opts.hosts) == ('local', '127.0.0.1',
                                                                      1, None)


@pytest.mark.parametrize('argv, message', [
    (['--launcher', 'ssh'], '--launcher ssh needs -H/--hostfile FILE'),
    (['--launcher', 'yarn'], "argument --launcher: invalid choice: 'yarn'"),
    (['-H', 'HOSTS'], '-H/--hostfile is for --launcher ssh or mpi, not local'),
    (['--launcher', 'slurm', '-H', 'HOSTS'], '-H/--hostfile is for --launcher ssh or mpi'),
    (['--launcher', 'mpi', '-i', 'key'], '-i/--identity is for --launcher ssh, not mpi'),
    (['--workdir', '/x'], '--workdir is for --launcher ssh, not local'),
    (['--ssh', 'ssh -p 22'], '--ssh is for --launcher ssh, not local'),
    (['--launcher', 'ssh', '-H', 'HOSTS', '--ssh', ''], 'an empty ssh command'),
    (['--launcher', 'ssh', '-H', 'HOSTS', '--ssh', "ssh -o 'x"], 'No closing quotation'),
    (['--launcher', 'slurm', '--restart-servers', '1'],
     '--restart-servers: one task of a slurm job cannot be started again'),
    (['--launcher', 'mpi', '--restart-servers', '2'], 'one task of a mpi job'),
    (['--launcher', 'ssh', '-H', 'MISSING'], 'MISSING: cannot read it'),
    (['--launcher', 'ssh', '-H', 'EMPTY'], 'EMPTY: no hosts in it'),
    (['--launcher', 'ssh', '-H', 'BAD'], "'node1:ssh' is not [user@]host[:port]"),
    (['--env-server', 'DMLC_ROLE=worker'], 'DMLC_ROLE is set by the launcher'),
    (['--env-worker', 'KVPS_RANK:2'], 'KVPS_RANK is set by the launcher'),
    (['--env-worker', '2X=1'], 'valid variable name'),
    (['--env', 'A B'], 'expected NAME=VALUE (or NAME:VALUE, or NAME'),
])
def test_bad_cluster_flags_are_usage_errors(argv, message, hostfile, tmp_path, capsys):
    (tmp_path / 'EMPTY').write_text('# nothing\n\n')
    (tmp_path / 'BAD').write_text('node1:ssh\n')
    paths = {'HOSTS': hostfile, 'MISSING': str(tmp_path / 'MISSING'),
             'EMPTY': str(tmp_path / 'EMPTY'), 'BAD': str(tmp_path / 'BAD')}
    with pytest.raises(SystemExit) as info:
        launch.parse_args(['-n', '1', *[paths.get(a, a) for a in argv], 'cmd'])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert 'usage:' in err and message.replace('MISSING', paths['MISSING']).replace(
        'EMPTY', paths['EMPTY']) in err, err


def test_env_server_and_env_worker_reach_their_role_only():
    opts = launch.parse_args(['-n', '1', '-s', '1', '--env', 'ALL=1', '--env-server', 'S:2',
                              '--env-worker', 'W=3', '--env-worker', 'HOME', 'cmd'])
    server, worker = launch.plan_nodes(opts, {'HOME': '/home/me'}, 9, node_argv=('node',))
    assert (server.env['ALL'], server.env['S'], 'W' not in server.env) == ('1', '2', True)
    assert (worker.env['ALL'], worker.env['W'], 'S' not in worker.env) == ('1', '3', True)
    assert worker.env['HOME'] == '/home/me'


def test_env_naming_a_variable_the_launcher_lacks_is_refused_before_anything_starts(capsys):
    opts = launch.parse_args(['-n', '1', '-s', '1', '--env', 'NOT_SET_HERE', 'true'])
    assert launch.run(opts, environ={'PATH': os.environ['PATH']}, node_argv=('false',)) == 2
    assert ("kvps.launch: --env NOT_SET_HERE: NOT_SET_HERE is not set in the launcher's "
            'environment') in capsys.readouterr().err


def _ssh_opts(hostfile, *extra):
    return launch.parse_args(['-n', '2', '-s', '1', '--launcher', 'ssh', '-H', hostfile,
                              '-i', '/keys/id', '--python', '/opt/py', '--workdir', '/w d',
                              '--env', 'GIVEN=1', *extra, 'python', 'train.py'])


def test_ssh_gets_no_secret_on_its_command_line_only_on_stdin(hostfile):
    opts = _ssh_opts(hostfile)
    environ = {'PATH': '/bin', 'HOME': '/home/me', 'KVPS_SECRET': 's3cret', 'KVPS_TIMEOUT': '9',
               'DMLC_INTERFACE': 'eth1', 'KVPS_ROLE': 'stale'}
    worker = launch.plan_nodes(opts, environ, 4242)[2]          # worker 1: the first host
    carrier = clusters.ssh_carrier(worker, opts.hosts, opts, environ)
    assert carrier.argv == ('ssh', '-o', 'BatchMode=yes', '-T', '-i', '/keys/id', 'node1',
                            "cd '/w d' && exec /opt/py -m kvps.launch.remote")
    assert 's3cret' not in ' '.join(carrier.argv) and 'KVPS_SECRET' not in carrier.env
    message = json.loads(carrier.stdin)
    assert message['watch_stdin'] and not message['report_port'] and message['grace'] == 5.0
    assert 'KVPS_ROLE' in message['unset'] and 'DMLC_PS_ROOT_PORT' in message['unset']
    [task] = message['tasks']
    assert (task['name'], task['argv']) == ('worker 1', ['python', 'train.py'])
    # kvps's settings and what the options set travel; this host's PATH and HOME do not
    assert task['env'] == {
        'KVPS_SECRET': 's3cret', 'KVPS_TIMEOUT': '9', 'DMLC_INTERFACE': 'eth1', 'GIVEN': '1',
        'DMLC_PS_ROOT_URI': 'node1', 'DMLC_NUM_WORKER': '2', 'DMLC_NUM_SERVER': '1',
        'DMLC_PS_ROOT_PORT': '4242', 'DMLC_ROLE': 'worker', 'KVPS_RANK': '1',
        'PYTHONUNBUFFERED': '1'}
    assert [(t.role, t.rank) for t in carrier.tasks] == [('worker', 1)]


def test_ssh_places_as_the_old_recipe_did_and_passes_the_hosts_ssh_port(hostfile):
    opts = _ssh_opts(hostfile)
    specs = [launch.plan_scheduler(opts, {}, None), *launch.plan_nodes(opts, {}, 1)]
    assert [clusters.host_of(opts.hosts, s, 1).target for s in specs] == [
        'node1', 'me@node2', 'node3', 'node1']      # scheduler, server 0, workers 0 and 1
    server = clusters.ssh_carrier(specs[1], opts.hosts, opts, {})
    assert server.argv[-4:-1] == ('-p', '2222', 'me@node2')
    scheduler = clusters.ssh_carrier(specs[0], opts.hosts, opts, {}, report_port=True)
    assert json.loads(scheduler.stdin)['report_port']


@pytest.mark.parametrize('launcher, head', [
    ('slurm', ['srun', '--ntasks=4', '--kill-on-bad-exit=1']),
    ('mpi', ['mpirun', '-n', '4', '--hostfile', 'HOSTS'])])
def test_one_srun_or_mpirun_carries_every_task_its_message_in_a_private_file(
        launcher, head, hostfile, tmp_path):
    argv = ['-n', '2', '-s', '1', '--launcher', launcher, '--python', '/opt/py']
    opts = launch.parse_args(argv + (['-H', hostfile] if launcher == 'mpi' else []) + ['cmd'])
    environ = {'KVPS_SECRET': 's3cret', 'PATH': '/bin'}
    base = clusters.rendezvous_base(str(tmp_path))
    specs = [launch.plan_scheduler(opts, environ, base + '.port'),
             *launch.plan_nodes(opts, environ, None)]
    carrier = clusters.batch_carrier(specs, base, opts, environ, wait=30.0)
    assert list(carrier.argv) == [a.replace('HOSTS', hostfile) for a in head] + [
        '/opt/py', '-m', 'kvps.launch.remote', '--spec', base + '.spec']
    assert 's3cret' not in ' '.join(carrier.argv) and 'KVPS_SECRET' not in carrier.env
    assert stat.S_IMODE(os.stat(base + '.spec').st_mode) == 0o600
    message = json.loads(open(base + '.spec').read())
    assert message['rendezvous'] == {'ranks': launcher, 'base': base, 'wait': 30.0}
    assert message['tag'] and [t['name'] for t in message['tasks']] == [
        'scheduler', 'server 0', 'worker 0', 'worker 1']
    sched = message['tasks'][0]['env']
    assert sched['KVPS_PORT_FILE'] == base + '.port' and sched['KVPS_SECRET'] == 's3cret'
    assert 'DMLC_PS_ROOT_URI' not in sched          # the scheduler's task finds its own
    assert 'DMLC_PS_ROOT_PORT' not in message['tasks'][2]['env']   # read from .port
    clusters.remove_rendezvous(base)
    assert not os.path.exists(base + '.spec')


@pytest.mark.parametrize('ranks, environ, name', [
    ('slurm', {'SLURM_PROCID': '0', 'SLURM_NTASKS': '3'}, 'scheduler'),
    ('slurm', {'SLURM_PROCID': '2', 'SLURM_NTASKS': '3'}, 'worker 0'),
    ('mpi', {'OMPI_COMM_WORLD_RANK': '1', 'OMPI_COMM_WORLD_SIZE': '3'}, 'server 0'),
    ('mpi', {'PMI_RANK': '2', 'PMI_SIZE': '3'}, 'worker 0'),
])
def test_a_runner_takes_the_task_of_its_rank(ranks, environ, name):
    spec = {'tasks': [{'name': n} for n in ('scheduler', 'server 0', 'worker 0')],
            'rendezvous': {'ranks': ranks}}
    assert remote.task_of(spec, environ)['name'] == name


@pytest.mark.parametrize('ranks, environ, message', [
    ('slurm', {}, 'no rank: none of SLURM_PROCID is set (is this task started by srun?)'),
    ('mpi', {'SLURM_PROCID': '0'}, 'none of OMPI_COMM_WORLD_RANK, PMI_RANK is set'),
    ('slurm', {'SLURM_PROCID': '1', 'SLURM_NTASKS': '5'},
     'SLURM_PROCID=1 SLURM_NTASKS=5, but the job has 3 processes'),
    ('mpi', {'PMI_RANK': '3'}, 'PMI_RANK=3 PMI_SIZE=unset, but the job has 3 processes'),
])
def test_a_runner_with_no_task_for_its_rank_says_why(ranks, environ, message):
    spec = {'tasks': [{'name': n} for n in ('scheduler', 'server 0', 'worker 0')],
            'rendezvous': {'ranks': ranks}}
    with pytest.raises(remote.RemoteError, match=re.escape(message)):
        remote.task_of(spec, environ)


def test_control_lines_and_output_lines_of_a_carrier_are_told_apart():
    class Carrier:
        name = 'srun'
        pid = returncode = None
        spec = None
    carrier = Carrier()
    carrier.tasks = [tasks.Task(ProcSpec(r, k, (), {}), carrier, 5)
                     for r, k in (('scheduler', None), ('worker', 0))]
    line = tasks.control_line('worker 0', 'exit', returncode=-9)
    assert tasks.parse_control(line) == {'task': 'worker 0', 'event': 'exit', 'returncode': -9}
    assert tasks.parse_control('[worker 0] hello\n') is None
    assert tasks.parse_control(tasks.MARK + '{not json\n') is None
    task, text = tasks.route(carrier, '[worker 0] hello\n')
    assert task is carrier.tasks[1] and tasks.untagged(task, text) == 'hello\n'
    assert tasks.route(carrier, 'srun: error: node2: task 3\n') == (
        None, '[srun] srun: error: node2: task 3\n')
    assert carrier.tasks[1].respawn is None      # one task of many cannot start again
    carrier.tasks = carrier.tasks[:1]
    assert tasks.route(carrier, 'ssh: connect to host x\n') == (
        carrier.tasks[0], '[scheduler] ssh: connect to host x\n')


def test_the_job_environment_a_remote_host_gets_is_kvps_settings_and_the_options_only():
    opts = launch.parse_args(['-n', '1', '--env-worker', 'ONLY_W=1', 'cmd'])
    env = {'PATH': '/bin', 'LD_LIBRARY_PATH': '/x', 'KVPS_X': '1', 'DMLC_Y': '2',
           'MXNET_KVSTORE_BIGARRAY_BOUND': '5', 'ONLY_W': '1', 'PYTHONUNBUFFERED': '1'}
    assert plan.for_elsewhere(env, opts, {}) == {
        'KVPS_X': '1', 'DMLC_Y': '2', 'MXNET_KVSTORE_BIGARRAY_BOUND': '5', 'ONLY_W': '1',
        'PYTHONUNBUFFERED': '1'}
    with pytest.raises(ConfigError, match='--env GONE: GONE is not set'):
        plan.for_elsewhere(env, launch.parse_args(['-n', '1', '--env', 'GONE', 'cmd']), {})
