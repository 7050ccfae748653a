"""A stand-in for NVIDIA's nvidia-cuda-mps-control, put first on PATH by the `mps_control`
fixture, so that `kvps.launch --mps` runs whole without a GPU.

As the real one: `-d` forks a daemon and returns; the daemon makes `control` in
CUDA_MPS_PIPE_DIRECTORY and serves there; `quit` on a front-end's stdin reaches it through that
file (no daemon there: the front-end fails, saying so) and the daemon exits. Every invocation,
and the daemon's start and end, append a JSON line to a log: argv, stdin, the two MPS
variables, pid, and the live processes of the test's job (those with a DMLC_ROLE and the
test's KVPS_TEST_TAG) at that moment. The daemon ends by itself after 300 s, whatever happens.
"""

import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest

SCRIPT = r'''#!{python}
import json, os, select, subprocess, sys, time
LOG, FAIL = {log!r}, {fail!r}
PIPE, LOGDIR = 'CUDA_MPS_PIPE_DIRECTORY', 'CUDA_MPS_LOG_DIRECTORY'


def job_processes():
    tag = os.environ.get('KVPS_TEST_TAG', '').encode()
    found = []
    for entry in filter(str.isdigit, os.listdir('/proc')):
        try:
            env = open(f'/proc/{{entry}}/environ', 'rb').read().split(b'\0')
        except OSError:
            continue
        if (tag and b'KVPS_TEST_TAG=' + tag in env and alive(entry)
                and any(v.startswith(b'DMLC_ROLE=') for v in env)):
            found.append(int(entry))
    return found


def alive(pid):
    try:
        return open(f'/proc/{{pid}}/stat', 'rb').read().rsplit(b')', 1)[1].split()[0] != b'Z'
    except (OSError, IndexError):
        return False


def record(**fields):
    pipe = os.environ.get(PIPE)
    with open(LOG, 'a') as f:
        f.write(json.dumps({{
            'pid': os.getpid(), 'pipe': pipe, 'log': os.environ.get(LOGDIR),
            'secret': 'KVPS_SECRET' in os.environ, 'job': job_processes(),
            'mode': oct(os.stat(os.path.dirname(pipe)).st_mode & 0o777) if pipe else None,
            **fields}}) + '\n')


args = sys.argv[1:]
control = os.path.join(os.environ.get(PIPE, '/tmp/nvidia-mps'), 'control')
if args == ['--daemon']:
    os.mkfifo(control)
    fd = os.open(control, os.O_RDWR)   # a reader the front-ends find, never at EOF
    record(argv=args)
    deadline, said = time.monotonic() + 300, b''
    while b'quit' not in said and time.monotonic() < deadline:
        if select.select([fd], [], [], 1.0)[0]:
            said += os.read(fd, 4096)
    record(argv=args, ended=True)
    os.unlink(control)
elif args == ['-d']:
    record(argv=args)
    if FAIL or os.path.exists(control):
        print('An instance of this daemon is already running' if not FAIL else
              'stand-in: no CUDA-capable device', file=sys.stderr)
        sys.exit(1)
    subprocess.Popen([sys.executable, __file__, '--daemon'], start_new_session=True,
                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                     stderr=subprocess.DEVNULL)
else:
    text = sys.stdin.read()
    record(argv=args, stdin=text)
    if os.environ.get('FAKE_MPS_QUIT_HANGS'):
        time.sleep(60)
    try:
        fd = os.open(control, os.O_WRONLY | os.O_NONBLOCK)
    except OSError:
        print('Cannot find MPS control daemon process')
        sys.exit(1)
    os.write(fd, text.encode())
    os.close(fd)
    daemon = [r['pid'] for r in map(json.loads, open(LOG)) if r['argv'] == ['--daemon']][-1]
    deadline = time.monotonic() + 10   # as the real quit: back once the daemon is gone
    while alive(daemon) and time.monotonic() < deadline:
        time.sleep(0.02)
'''


class MPSControl:
    """One stand-in: ``path`` (PATH with it first), ``calls()`` (the log's records)."""

    def __init__(self, folder, fail=False):
        folder.mkdir()
        self.log = folder / 'calls.jsonl'
        binary = folder / 'nvidia-cuda-mps-control'
        binary.write_text(SCRIPT.format(python=sys.executable, log=str(self.log), fail=fail))
        binary.chmod(0o755)
        self.path = f'{folder}{os.pathsep}{os.environ.get("PATH", os.defpath)}'

    def calls(self, argv=None):
        """The records, or those of the invocations with ``argv`` (['-d'], [], ['--daemon'])."""
        if not self.log.exists():
            return []
        records = [json.loads(line) for line in self.log.read_text().splitlines()]
        return [r for r in records if argv is None or r['argv'] == argv]

    def daemons_alive(self):
        """Pids of stand-in daemons still running (zombies count as gone)."""
        return [r['pid'] for r in self.calls(['--daemon']) if _alive(r['pid'])]


def _alive(pid):
    try:
        state = Path(f'/proc/{pid}/stat').read_bytes().rsplit(b')', 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != b'Z'


def gone_within(check, seconds):
    """Whether ``check()`` turns empty within ``seconds`` (a bound for a loaded box)."""
    deadline = time.monotonic() + seconds
    while check() and time.monotonic() < deadline:
        time.sleep(0.05)
    return not check()


@pytest.fixture
def mps_control(tmp_path):
    """mps_control(fail=False) -> MPSControl; any daemon of it left at the end is killed
    (the test says whether one was)."""
    made = []

    def make(fail=False):
        made.append(MPSControl(tmp_path / f'mps-bin-{len(made)}', fail))
        return made[-1]

    yield make
    for control in made:
        for pid in control.daemons_alive():
            os.kill(pid, signal.SIGKILL)
