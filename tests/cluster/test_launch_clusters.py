"""`python -m kvps.launch --launcher ssh|slurm|mpi` runs real jobs through stand-ins of ssh,
srun and mpirun (tests/cluster/standins.py) that start the processes on this machine as the
real ones would on a cluster's hosts, and the ssh ones again through a real OpenSSH server
on 127.0.0.1 (tests/cluster/real_sshd.py; skipped where sshd is not installed). Every node
still binds 127.0.0.1 (--host 127.0.0.1)."""

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
import uuid

import pytest
import real_sshd
import standins
from conftest import FAST, PRELUDE, Job, assert_no_leftovers, processes_tagged

pytestmark = pytest.mark.timeout(180)

TRAIN = '''
kv = kvps.create('dist_sync')
kv.init('w', np.zeros(3, np.float32))
kv.push('w', np.full(3, kv.rank + 1.0, np.float32))
out = np.zeros(3, np.float32)
kv.pull('w', out=out)
if kv.rank == int(os.environ.get('FAIL_RANK', -1)):
    sys.exit(3)
hold = os.environ.get('HOLD')   # worker 0 waits while this file exists (60 s at most)
if hold and kv.rank == 0:
    open(hold, 'w').close()
    deadline = time.time() + 60
    while os.path.exists(hold) and time.time() < deadline:
        time.sleep(0.05)
report(rank=kv.rank, workers=kv.num_workers, w=out.tolist(),
       authenticated=bool(os.environ.get('KVPS_SECRET')))
'''
SECRET = 'f00d' * 16
HOSTS = ('alpha', 'beta', 'gamma')
BLAME = re.compile(r'kvps\.launch: (\w+ \d+) \(pid \d+\) failed first: (.*)')


@pytest.fixture
def cluster(tmp_path):
    """cluster(launcher_args, env) -> Popen of kvps.launch with ssh, srun and mpirun stand-ins
    on PATH; ``cluster.finish(proc)`` -> Job; the ssh stand-in's calls in ``cluster.ssh_calls``.
    Nothing of the job may be left behind."""
    tag = uuid.uuid4().hex
    bin_dir = tmp_path / 'bin'
    bin_dir.mkdir()
    standins.ssh(bin_dir)
    standins.srun(bin_dir)
    script = tmp_path / 'train.py'
    script.write_text(PRELUDE + textwrap.dedent(TRAIN))
    (tmp_path / 'hosts').write_text('# three hosts, all this machine\n' + '\n'.join(HOSTS))
    ssh_log = tmp_path / 'ssh.log'
    procs = []

    def start(launcher_args, env=None, workers=2, servers=2):
        full_env = {**os.environ, **FAST, 'KVPS_TEST_TAG': tag, 'KVPS_SECRET': SECRET,
                    'PATH': f'{bin_dir}:{os.environ["PATH"]}', 'FAKE_SSH_LOG': str(ssh_log),
                    **(env or {})}
        proc = subprocess.Popen(
            [sys.executable, '-m', 'kvps.launch', '-n', str(workers), '-s', str(servers),
             '--host', '127.0.0.1', '--grace', '2', *launcher_args, '--', sys.executable,
             str(script)], env=full_env, cwd=tmp_path, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True)
        procs.append(proc)
        return proc

    def finish(proc, timeout=120):
        out, err = proc.communicate(timeout=timeout)
        assert_no_leftovers(tag)
        return Job(proc.returncode, out, err)

    def run(launcher_args, env=None, **sizes):
        return finish(start(launcher_args, env, **sizes))

    start.run, start.finish, start.bin_dir, start.tag = run, finish, bin_dir, tag
    start.ssh_calls = lambda: [json.loads(line) for line in ssh_log.read_text().splitlines()]
    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert_no_leftovers(tag, wait_s=5)
    # the shared files of srun and mpirun jobs are gone
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith('.kvps-launch')]


@pytest.fixture(scope='session')
def sshd(tmp_path_factory):
    """A real sshd reached as the hosts of the host file (skips where none is installed)."""
    missing = real_sshd.available()
    if missing:
        pytest.skip(missing)
    daemon = real_sshd.Daemon(tmp_path_factory.mktemp('sshd'), HOSTS).start()
    yield daemon
    daemon.stop()


SSH_KINDS = ['ssh stand-in', 'real sshd']


def _over_ssh(kind, request):
    args = ['--launcher', 'ssh', '-H', 'hosts']
    if kind == 'real sshd':
        args += ['--ssh', request.getfixturevalue('sshd').command]
    return args


@pytest.fixture(params=SSH_KINDS)
def over_ssh(request):
    """The launcher's arguments for a job over ssh to the three hosts: through the stand-in,
    then through a real sshd."""
    return _over_ssh(request.param, request)


def _wait_for(path, proc, timeout=60):
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, f'{path} never appeared'
        time.sleep(0.05)


def _command_lines():
    """Every process's command line, as ps would show it."""
    lines = []
    for entry in os.listdir('/proc'):
        try:
            with open(f'/proc/{entry}/cmdline', 'rb') as f:
                lines.append(f.read().replace(b'\0', b' ').decode(errors='replace'))
        except OSError:
            pass
    return lines


def _expected_results(workers):
    total = float(sum(range(1, workers + 1)))
    return {r: {'rank': r, 'workers': workers, 'w': [total] * 3, 'authenticated': True}
            for r in range(workers)}


def test_ssh_job_over_three_hosts_keeps_the_secret_off_every_command_line(cluster, tmp_path,
                                                                          over_ssh):
    hold = tmp_path / 'hold'
    proc = cluster([*over_ssh, '--env', 'HOLD'], {'HOLD': str(hold)})
    _wait_for(hold, proc)          # the whole job runs: every process is up
    assert not [line for line in _command_lines() if SECRET in line]
    hold.unlink()
    result = cluster.finish(proc)
    assert result.returncode == 0, result.output
    assert result.results() == _expected_results(2)   # '[worker N] RESULT ...' lines
    # the placement of the old ssh recipe: scheduler first host, servers then workers round
    # robin; over ssh with no tty, the runner its command, nothing else
    placed = 'scheduler on alpha, server 0 on beta, server 1 on gamma, worker 0 on alpha, ' \
             'worker 1 on beta'
    assert f'kvps.launch: over ssh: {placed}' in result.stderr
    if '--ssh' in over_ssh:   # a real sshd: its clients' argv were on the command lines above
        return
    calls = cluster.ssh_calls()
    assert sorted(c[-2] for c in calls) == ['alpha', 'alpha', 'beta', 'beta', 'gamma']
    assert all('-T' in c and c[-1].endswith('-m kvps.launch.remote') for c in calls), calls
    assert not [c for c in calls if SECRET in ' '.join(c)]


def _blames(result):
    return [m.groups() for m in map(BLAME.match, result.stderr.splitlines()) if m]


@pytest.mark.parametrize('launcher', [*SSH_KINDS, 'mpi'])
def test_a_failing_worker_is_blamed_as_the_local_launcher_blames_it(cluster, launcher,
                                                                    request):
    launcher = (['--launcher', 'mpi'] if launcher == 'mpi' else _over_ssh(launcher, request))
    # (mpirun giving MPICH's PMI_RANK here; Open MPI's ranks are the next test's)
    standins.mpirun(cluster.bin_dir, 'mpich')
    env = {'FAIL_RANK': '1'}
    local = cluster.run(['--env-worker', 'FAIL_RANK'], env)
    remote = cluster.run([*launcher, '--env-worker', 'FAIL_RANK'], env)
    assert local.returncode == remote.returncode == 3, remote.output
    expected = [('worker 1', 'exit code 3; stopping the other processes'),
                ('worker 1', 'exit code 3')]
    assert _blames(local) == _blames(remote) == expected, remote.output


def test_ctrl_c_stops_every_remote_process(cluster, tmp_path, over_ssh):
    hold = tmp_path / 'hold'
    proc = cluster([*over_ssh, '--env', 'HOLD'], {'HOLD': str(hold)})
    _wait_for(hold, proc)
    # what must go: the launcher, and on the "hosts" 5 runners and their 5 nodes (the real
    # sshd's sessions carry the tag too: ssh sends it, sshd accepts it)
    assert len(processes_tagged(cluster.tag)) >= 11
    proc.send_signal(signal.SIGINT)
    result = cluster.finish(proc)   # and nothing of the job is left: ssh, runners, nodes
    assert result.returncode == 130, result.output
    assert 'got SIGINT; stopping all processes' in result.stderr


def test_slurm_gives_each_task_its_role_from_its_rank(cluster):
    result = cluster.run(['--launcher', 'slurm'], {'SLURM_JOB_ID': '4242'}, workers=3,
                         servers=1)
    assert result.returncode == 0, result.output
    assert result.results() == _expected_results(3)
    assert '[scheduler]' not in result.stderr


def test_mpirun_gives_each_rank_its_role(cluster):
    standins.mpirun(cluster.bin_dir, 'openmpi')
    result = cluster.run(['--launcher', 'mpi', '-H', 'hosts'], servers=1)
    assert result.returncode == 0, result.output
    assert result.results() == _expected_results(2)


def test_a_host_where_the_runner_cannot_start_is_named_before_anything_else_starts(cluster):
    result = cluster.run(['--launcher', 'ssh', '-H', 'hosts', '--python', '/no/such/python'])
    assert result.returncode == 127, result.output
    assert _blames(result) == [] and 'kvps.launch: scheduler (pid ' in result.stderr
    assert 'failed first: exit code 127' in result.stderr
    assert '[scheduler] ' in result.stdout and '/no/such/python' in result.stdout
    assert '[server 0]' not in result.output and '[worker 0]' not in result.output
