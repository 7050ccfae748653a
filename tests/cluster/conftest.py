"""Run real kvps jobs on 127.0.0.1 (through the launcher or by hand) and check nothing is left."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest

from kvps.wire.shm import remove_leftovers

HERE = Path(__file__).resolve().parent


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items):
    """Every test here starts real processes: each is marked cluster, whether or not its
    file says so (tryfirst: before `-m` selects by marks)."""
    for item in items:
        if HERE in item.path.parents:
            item.add_marker(pytest.mark.cluster)


# Short bounds so that failure tests end quickly; generous enough for a loaded 2-core box.
FAST = {'KVPS_HEARTBEAT_INTERVAL': '0.5', 'KVPS_HEARTBEAT_TIMEOUT': '6',
        'KVPS_CONNECT_TIMEOUT': '30', 'KVPS_TIMEOUT': '60', 'OMP_NUM_THREADS': '1'}


class Job:
    """A finished job: exit code, combined output, and the RESULT lines workers printed."""

    def __init__(self, returncode, stdout, stderr):
        self.returncode, self.stdout, self.stderr = returncode, stdout, stderr

    @property
    def output(self):
        return self.stdout + self.stderr

    def results(self):
        """{rank: payload} from lines `[worker R] RESULT {...}`."""
        found = {}
        for line in self.stdout.splitlines():
            if '] RESULT ' in line:
                prefix, payload = line.split('] RESULT ', 1)
                found[int(prefix.rsplit(' ', 1)[1])] = json.loads(payload)
        return found


def processes_tagged(tag):
    """PIDs of live processes whose environment carries ``tag``."""
    pids = []
    for entry in Path('/proc').iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / 'environ').read_bytes()
            state = (entry / 'stat').read_text().split(') ', 1)[1][0]
        except OSError:
            continue
        if f'KVPS_TEST_TAG={tag}'.encode() in environ and state != 'Z':
            pids.append(int(entry.name))
    return pids


def assert_no_leftovers(tag, wait_s=10.0):
    deadline = time.monotonic() + wait_s
    while processes_tagged(tag) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = processes_tagged(tag)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, f'processes left behind: {left}'


@pytest.fixture
def job(tmp_path):
    """job(script, workers, servers, env=..., launcher_args=..., wrapper=...) -> Job, run by
    kvps.launch (inside ``wrapper``, a command prefix, when given). A job that has not ended
    within ``timeout`` s fails the test, saying ``ends_when`` (what should have ended it)."""
    tag = uuid.uuid4().hex

    def run(script, workers=2, servers=1, env=None, launcher_args=(), timeout=120, wrapper=(),
            ends_when=None):
        path = tmp_path / f'job_{uuid.uuid4().hex[:6]}.py'
        path.write_text(PRELUDE + textwrap.dedent(script))
        full_env = {**os.environ, **FAST, **(env or {}), 'KVPS_TEST_TAG': tag,
                    'PYTHONUNBUFFERED': '1'}
        cmd = [*wrapper, sys.executable, '-m', 'kvps.launch', '-n', str(workers),
               '-s', str(servers), *launcher_args, '--', sys.executable, str(path)]
        timed_out = None
        try:
            proc = subprocess.run(cmd, env=full_env, capture_output=True, text=True,
                                  timeout=timeout, cwd=tmp_path)
        except subprocess.TimeoutExpired as exc:   # the launcher is killed; its job dies too
            timed_out = exc
        if timed_out is not None:
            assert_no_leftovers(tag)
            output = b''.join(o or b'' for o in (timed_out.stdout, timed_out.stderr))
            pytest.fail(f'the job did not end within {timeout} s'
                        + (f' ({ends_when})' if ends_when else '') + '; its output:\n'
                        + output.decode(errors='replace'), pytrace=False)
        result = Job(proc.returncode, proc.stdout, proc.stderr)
        assert_no_leftovers(tag)
        return result

    yield run
    assert_no_leftovers(tag, wait_s=0)


@pytest.fixture
def running(tmp_path):
    """running(script, workers, servers) -> Popen of kvps.launch, left running for the test to
    act on (stdout piped, text); ``running.processes()``: the live processes of the job,
    launcher included. Anything of it still alive at the end is killed."""
    tag = uuid.uuid4().hex
    procs = []

    def start(script, workers=2, servers=1):
        path = tmp_path / f'job_{uuid.uuid4().hex[:6]}.py'
        path.write_text(PRELUDE + textwrap.dedent(script))
        env = {**os.environ, **FAST, 'KVPS_TEST_TAG': tag, 'PYTHONUNBUFFERED': '1'}
        proc = subprocess.Popen([sys.executable, '-m', 'kvps.launch', '-n', str(workers), '-s',
                                 str(servers), '--', sys.executable, str(path)], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                cwd=tmp_path)
        procs.append(proc)
        return proc

    start.processes = lambda: processes_tagged(tag)
    yield start
    _stop_all(procs, tag)


@pytest.fixture
def by_hand(tmp_path):
    """Start roles one process each, as a cluster operator would; every process is killed
    at the end of the test. A process runs ``python -m kvps.node``, a worker ``script``, or
    ``argv`` in ``cwd`` (the test's directory by default)."""
    tag = uuid.uuid4().hex
    procs = []

    def start(role, env, script=None, rank=None, argv=None, cwd=None):
        full_env = {**os.environ, **FAST, **env, 'DMLC_ROLE': role, 'KVPS_TEST_TAG': tag,
                    'PYTHONUNBUFFERED': '1'}
        if rank is not None:
            full_env['KVPS_RANK'] = str(rank)
        if script is not None:
            path = tmp_path / f'{role}_{uuid.uuid4().hex[:6]}.py'
            path.write_text(PRELUDE + textwrap.dedent(script))
            argv = [sys.executable, str(path)]
        argv = argv or [sys.executable, '-m', 'kvps.node']
        proc = subprocess.Popen(argv, env=full_env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, cwd=cwd or tmp_path)
        procs.append(proc)
        return proc

    def scheduler(num_workers, num_servers, extra=None):
        port_file = tmp_path / f'port_{uuid.uuid4().hex[:6]}'
        env = {'DMLC_PS_ROOT_URI': '127.0.0.1', 'DMLC_PS_ROOT_PORT': '0',
               'DMLC_NUM_WORKER': str(num_workers), 'DMLC_NUM_SERVER': str(num_servers),
               'KVPS_PORT_FILE': str(port_file), **(extra or {})}
        proc = start('scheduler', env)
        deadline = time.monotonic() + 30
        while not port_file.exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()
            time.sleep(0.05)
        return proc, {**env, 'DMLC_PS_ROOT_PORT': port_file.read_text()}

    start.scheduler = scheduler
    start.finish = finish
    yield start
    _stop_all(procs, tag, nodes=True)


def _stop_all(procs, tag, nodes=False):
    """Kill what is still alive of ``procs`` and check nothing of job ``tag`` is left.
    ``nodes``: they are kvps nodes themselves, whose shared memory a launcher would remove
    once they are killed; done here as it would."""
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)
        proc.stdout.close()
        if nodes:
            remove_leftovers(proc.pid)
    assert_no_leftovers(tag, wait_s=5)


def finish(proc, timeout=60, exits_when=None):
    """Wait for a hand-started process; return (exit code, output). One still running after
    ``timeout`` s is killed and fails the test, saying ``exits_when`` (what should have ended
    it). Tests reach it as ``by_hand.finish``: importing ``conftest`` by name would find
    tests/unit's."""
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        out = None
    if out is None:
        proc.kill()
        out, _ = proc.communicate(timeout=10)
        pytest.fail(f'pid {proc.pid} did not exit within {timeout} s'
                    + (f' ({exits_when})' if exits_when else '') + f'; its output:\n{out}',
                    pytrace=False)
    return proc.returncode, out


# Every job script starts with these imports and a helper to report results as JSON.
PRELUDE = '''\
import json, os, sys, time
import numpy as np
import kvps

def report(**values):
    print('RESULT', json.dumps(values), flush=True)

def job_pids(role):
    """The pids of this test's processes of ``role`` (their DMLC_ROLE), found in /proc."""
    tag = f'KVPS_TEST_TAG={os.environ["KVPS_TEST_TAG"]}'.encode()
    want = f'DMLC_ROLE={role}'.encode()
    found = []
    for pid in (int(d) for d in os.listdir('/proc') if d.isdigit()):
        try:
            environ = open(f'/proc/{pid}/environ', 'rb').read().split(b'\\0')
        except OSError:
            continue
        if tag in environ and want in environ:
            found.append(pid)
    return found

'''


# The start of the elastic jobs' scripts (test_elastic*.py): a dist_sync store with key 0, and
# one round of it (push ``value``, pull the round's result).
ELASTIC_ROUNDS = '''
import signal

def one_round(kv, value):
    kv.push(0, np.full(1, value, np.float32))
    out = np.zeros(1, np.float32)
    kv.pull(0, out=out)
    return float(out[0])

kv = kvps.create('dist_sync')
kv.init(0, np.zeros(1, np.float32))
'''
