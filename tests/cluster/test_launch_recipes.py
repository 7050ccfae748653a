"""The cluster recipes in launch/ start real jobs: ssh_launch.sh through an ssh stand-in that
runs the remote command here, slurm.sbatch through srun and scontrol stand-ins that start its
tasks here as Slurm would (SLURM_PROCID per task, --label prefixes, --kill-on-bad-exit).

Each job's scheduler binds a port the OS picks (the recipes' port 0) and the recipe tells the
others: a port picked here and handed over could be taken by another process meanwhile."""

import os
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest

from conftest import FAST, PRELUDE, Job, assert_no_leftovers

LAUNCH = Path(__file__).resolve().parents[2] / 'launch'

TRAIN = '''
kv = kvps.create('dist_sync')
kv.init('w', np.zeros(3, np.float32))
kv.push('w', np.full(3, kv.rank + 1.0, np.float32))
out = np.zeros(3, np.float32)
kv.pull('w', out=out)
if kv.rank == int(os.environ.get('FAIL_RANK', -1)):
    sys.exit(3)
report(rank=kv.rank, workers=kv.num_workers, w=out.tolist())
'''

# ssh [options] host command: the command runs here, as the remote shell would run it.
FAKE_SSH = '''#!/usr/bin/env bash
while [[ $1 == -* ]]; do [[ $1 == -o ]] && shift; shift; done
shift
exec bash -c "$*"
'''

# srun [options] argv...: SLURM_NTASKS copies of argv, each with its SLURM_PROCID, output lines
# prefixed 'N: ' (--label); the first to fail stops the others (--kill-on-bad-exit).
FAKE_SRUN = '''#!{python}
import os, subprocess, sys, threading
argv = sys.argv[1:]
while argv[0].startswith('-'):
    argv.pop(0)
tasks = []
for rank in range(int(os.environ['SLURM_NTASKS'])):
    env = dict(os.environ, SLURM_PROCID=str(rank))
    tasks.append(subprocess.Popen(argv, env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True))
def relay(rank, proc):
    for line in proc.stdout:
        sys.stdout.write(f'{{rank}}: {{line}}')
readers = [threading.Thread(target=relay, args=item) for item in enumerate(tasks)]
for reader in readers:
    reader.start()
code = 0
left = set(tasks)
while left:
    pid, status = os.wait()
    done = next((t for t in left if t.pid == pid), None)
    if done is None:
        continue
    left.discard(done)
    done.returncode = os.waitstatus_to_exitcode(status)
    if done.returncode and not code:
        code = done.returncode
        for other in left:
            other.kill()
for reader in readers:
    reader.join()
sys.exit(code)
'''


def _executable(path, text):
    path.write_text(text)
    path.chmod(0o755)
    return path


@pytest.fixture
def recipe(tmp_path):
    """recipe(argv, env) -> Job: run a launch/ script with the job's environment, and check
    that nothing of the job is left behind."""
    tag = uuid.uuid4().hex
    script = tmp_path / 'train.py'
    script.write_text(PRELUDE + textwrap.dedent(TRAIN))

    def run(argv, env):
        full_env = {**os.environ, **FAST, 'KVPS_TEST_TAG': tag, 'PYTHON': sys.executable,
                    'GRACE': '2', **env}
        proc = subprocess.run([str(a) for a in argv], env=full_env, capture_output=True,
                              text=True, timeout=120, cwd=tmp_path)
        assert_no_leftovers(tag)
        return Job(proc.returncode, proc.stdout, proc.stderr)

    run.train = [sys.executable, str(script)]
    yield run
    assert_no_leftovers(tag, wait_s=0)


def _ssh_job(recipe, tmp_path, workers, servers, env=None, options=()):
    hostfile = tmp_path / 'hosts'
    hostfile.write_text('# the scheduler runs on the first host\n127.0.0.1\n\n127.0.0.1\n')
    ssh = _executable(tmp_path / 'ssh', FAKE_SSH)
    return recipe([LAUNCH / 'ssh_launch.sh', '-H', hostfile, '-n', workers, '-s', servers,
                   '-p', 0, '-d', tmp_path, *options, '--', *recipe.train],
                  {'SSH': str(ssh), **(env or {})})


def _port_files(tmp_path):
    """The port files (and the files beside them) a recipe's scheduler wrote in its directory
    and the recipe left there."""
    return sorted(p.name for p in tmp_path.iterdir() if '.port' in p.name)


def test_ssh_launch_runs_a_job_over_its_hosts(recipe, tmp_path):
    secret = tmp_path / 'job.secret'   # as launch/README says: every process reads one file
    secret.write_text('0123456789abcdef' * 4)
    result = _ssh_job(recipe, tmp_path, workers=2, servers=2,
                      options=['-e', f'KVPS_SECRET_FILE={secret}'])
    assert result.returncode == 0, result.output
    # (results() reads the lines by their '[worker N]' prefixes)
    assert result.results() == {r: {'rank': r, 'workers': 2, 'w': [3.0] * 3} for r in (0, 1)}
    assert _port_files(tmp_path) == []


def test_ssh_launch_stops_everything_when_a_worker_fails(recipe, tmp_path):
    result = _ssh_job(recipe, tmp_path, workers=2, servers=1, env={'FAIL_RANK': '1'})
    assert result.returncode != 0
    assert 'failed first' in result.stderr, result.output
    assert set(result.results()) <= {0}
    assert _port_files(tmp_path) == []


def test_ssh_launch_names_a_scheduler_that_fails_before_telling_its_port(recipe, tmp_path):
    result = _ssh_job(recipe, tmp_path, workers=1, servers=1,
                      options=['-e', 'KVPS_TIMEOUT=never'])
    assert result.returncode == 1, result.output
    assert 'ssh_launch: scheduler on 127.0.0.1 failed first: exit code 1' in result.stderr
    assert "[scheduler] kvps.errors.ConfigError: KVPS_TIMEOUT='never'" in result.stdout
    assert '[server 0]' not in result.stdout and '[worker 0]' not in result.stdout
    assert _port_files(tmp_path) == []


def test_slurm_batch_script_gives_each_task_its_role(recipe, tmp_path):
    bin_dir = tmp_path / 'bin'
    bin_dir.mkdir()
    _executable(bin_dir / 'srun', FAKE_SRUN.format(python=sys.executable))
    _executable(bin_dir / 'scontrol', '#!/bin/sh\necho 127.0.0.1\necho 127.0.0.2\n')
    env = {'PATH': f'{bin_dir}:{os.environ["PATH"]}', 'SLURM_NTASKS': '5',
           'SLURM_JOB_NODELIST': 'node[1-2]', 'SLURM_JOB_ID': '4242', 'NUM_SERVERS': '2',
           'KVPS_PORT': '0'}
    result = recipe(['bash', LAUNCH / 'slurm.sbatch', *recipe.train], env)
    assert result.returncode == 0, result.output
    assert f'kvps: scheduler 127.0.0.1 (its port written to {tmp_path}/kvps-4242.port), ' \
           '2 servers, 2 workers' in result.stdout, result.output
    # Task 3 and 4 are workers 0 and 1; their lines carry srun's labels.
    assert '3: RESULT' in result.stdout and '4: RESULT' in result.stdout, result.output
    found = {}
    for line in result.stdout.splitlines():
        if ': RESULT ' in line:
            payload = line.split(': RESULT ', 1)[1]
            found[int(line.split(':', 1)[0])] = payload
    assert sorted(found) == [3, 4]
    assert all('"w": [3.0, 3.0, 3.0]' in payload for payload in found.values())
    assert _port_files(tmp_path) == []
