"""`python -m kvps.launch.remote`: run one process of a job on this host for a launcher
elsewhere (through ssh, srun or mpirun), and report to it over stdout what becomes of it.

The job's description comes on stdin (ssh: one JSON line, the secret in it, never on a
command line) or in a file only its owner can read (``--spec FILE``, on the working directory
srun and mpirun tasks share, read by every task, which takes its part from its rank). Under
ssh it stops its child when stdin closes: the launcher closed it, or ssh died with the
connection, so nothing outlives a launcher that is stopped or killed.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

from ..atomic import write_atomically
from ..wire.shm import remove_leftovers
from .processes import exit_code, group_alive, pdeathsig_preexec
from .tasks import MIRRORED, control_line

# The rank and job size variables of each batch launcher, the first of them set wins.
RANK_VARS = {'slurm': (('SLURM_PROCID', 'SLURM_NTASKS'),),
             'mpi': (('OMPI_COMM_WORLD_RANK', 'OMPI_COMM_WORLD_SIZE'),
                     ('PMI_RANK', 'PMI_SIZE'))}
_POLL = 0.02
_CHUNK = 1 << 16


class RemoteError(Exception):
    """This task cannot start (said in its output, exit code 1)."""


class Output:
    """Lines to the launcher, whole (one writer at a time), never failing: a launcher gone
    takes its pipe with it, and this process must still stop its child."""

    def __init__(self, stream):
        self.stream, self.lock = stream, threading.Lock()

    def write(self, data):
        with self.lock:
            try:
                self.stream.write(data)
                self.stream.flush()
            except (OSError, ValueError):
                pass


def task_of(spec, environ):
    """The task this process runs: the only one (ssh), or the one of its rank (srun, mpirun)."""
    tasks = spec['tasks']
    if 'rendezvous' not in spec:
        return tasks[0]
    ranks = spec['rendezvous']['ranks']
    for rank_var, size_var in RANK_VARS[ranks]:
        if environ.get(rank_var, '').strip().isdigit():
            rank, size = int(environ[rank_var]), environ.get(size_var, '').strip()
            break
    else:
        names = ', '.join(v for pair in RANK_VARS[ranks] for v in pair[:1])
        raise RemoteError(f'no rank: none of {names} is set (is this task started by '
                          f'{"srun" if ranks == "slurm" else "mpirun"}?)')
    if size != str(len(tasks)) or rank >= len(tasks):
        raise RemoteError(f'{rank_var}={rank} {size_var}={size or "unset"}, but the job has '
                          f'{len(tasks)} processes (1 scheduler, servers, workers): start '
                          f'exactly {len(tasks)} tasks')
    return tasks[rank]


def own_address(env):
    """The address this host's scheduler binds and the others dial: DMLC_INTERFACE's, else
    the host's name."""
    interface = env.get('KVPS_INTERFACE') or env.get('DMLC_INTERFACE')
    if interface:
        from ..wire.transport import interface_address  # zmq only for this task
        return interface_address(interface)
    return socket.gethostname()


def meet(task, rendezvous, env, stopping):
    """Under srun or mpirun: the scheduler tells its address through the shared working
    directory and its port file; every other task waits for them there."""
    base = rendezvous['base']
    if task['role'] == 'scheduler':
        env.setdefault('DMLC_PS_ROOT_URI', own_address(env))
        write_atomically(base + '.host', env['DMLC_PS_ROOT_URI'])
        return
    deadline = time.monotonic() + rendezvous['wait']
    while not stopping.is_set():
        try:
            with open(base + '.port', encoding='ascii') as f:
                port = f.read().strip()
            with open(base + '.host', encoding='utf-8') as f:
                host = f.read().strip()
        except FileNotFoundError:
            port = host = None
        if port and host:
            env.update(DMLC_PS_ROOT_URI=host, DMLC_PS_ROOT_PORT=port)
            return
        if time.monotonic() >= deadline:
            raise RemoteError(f'the scheduler wrote no port to {base}.port within '
                              f'{rendezvous["wait"]:g} s (KVPS_CONNECT_TIMEOUT): does every '
                              'node share the working directory?')
        stopping.wait(0.1)
    raise RemoteError('stopped while waiting for the scheduler')


class Runner:
    """Starts one task's child, relays its output and what becomes of it, and stops it."""

    def __init__(self, spec, task, out):
        self.spec, self.task, self.out = spec, task, out
        self.name = task['name']
        self.tag = f'[{self.name}] '.encode() if spec.get('tag') else b''
        self.stopping = threading.Event()
        self.proc = None
        self.mirror_dir = None
        self.mirrored = set()

    def say(self, message):
        self.out.write(self.tag + f'kvps.launch.remote: {message}\n'.encode())

    def control(self, event, **fields):
        self.out.write(control_line(self.name, event, **fields).encode())

    def child_env(self, environ):
        env = {k: v for k, v in environ.items() if k not in self.spec.get('unset', ())}
        env.update(self.task['env'])
        if self.spec.get('report_port'):   # a scheduler whose port the launcher learns here
            self.mirror_dir = tempfile.mkdtemp(prefix='kvps-remote-')
            env['KVPS_PORT_FILE'] = os.path.join(self.mirror_dir, 'scheduler.port')
        return env

    def run(self, environ):
        """Run the task to its end; returns this process's exit code."""
        try:
            env = self.child_env(environ)
            if 'rendezvous' in self.spec:
                meet(self.task, self.spec['rendezvous'], env, self.stopping)
            return self._run(env)
        except (RemoteError, OSError) as exc:
            self.say(str(exc))
            self.control('exit', returncode=1)
            return 1
        finally:
            if self.mirror_dir:
                for name in os.listdir(self.mirror_dir):
                    os.unlink(os.path.join(self.mirror_dir, name))
                os.rmdir(self.mirror_dir)

    def _run(self, env):
        argv = self.task['argv']
        try:
            self.proc = subprocess.Popen(
                argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT, start_new_session=True,
                preexec_fn=pdeathsig_preexec())
        except OSError as exc:
            self.say(f'cannot start {self.name} ({argv[0]}): {exc}')
            code = 127 if isinstance(exc, FileNotFoundError) else 126
            self.control('exit', returncode=code)
            return code
        self.control('start', pid=self.proc.pid, host=socket.gethostname())
        pump = threading.Thread(target=self._pump, daemon=True)
        pump.start()
        self._wait()
        self._end_group(self.proc.pid)
        pump.join(timeout=2.0)
        remove_leftovers(self.proc.pid)
        self._mirror()
        self.control('exit', returncode=self.proc.returncode)
        return exit_code(self.proc.returncode)

    def _pump(self):
        stream = self.proc.stdout
        while True:
            line = stream.readline(_CHUNK)
            if not line:
                break
            self.out.write(self.tag + (line if line.endswith(b'\n') else line + b'\n'))
        stream.close()

    def _wait(self):
        """Until the child exits; once told to stop, SIGTERM its group, SIGKILL after the
        grace."""
        kill_at = None
        while True:
            try:
                self.proc.wait(timeout=_POLL)
                return
            except subprocess.TimeoutExpired:
                pass
            self._mirror()
            if self.stopping.is_set() and kill_at is None:
                _signal_group(self.proc.pid, signal.SIGTERM)
                kill_at = time.monotonic() + self.spec.get('grace', 5.0)
            elif kill_at is not None and time.monotonic() >= kill_at:
                _signal_group(self.proc.pid, signal.SIGKILL)

    def _end_group(self, pgid):
        """What the child started and left in its group goes too, as the launcher's would."""
        if not group_alive(pgid):
            return
        _signal_group(pgid, signal.SIGTERM)
        deadline = time.monotonic() + self.spec.get('grace', 5.0)
        while group_alive(pgid) and time.monotonic() < deadline:
            time.sleep(_POLL)
        _signal_group(pgid, signal.SIGKILL)

    def _mirror(self):
        """Report the scheduler's port, formed and blame files, each once, as they appear."""
        if not self.mirror_dir:
            return
        for suffix in MIRRORED:
            if suffix in self.mirrored:
                continue
            try:
                with open(os.path.join(self.mirror_dir, 'scheduler.port' + suffix),
                          encoding='utf-8', errors='replace') as f:
                    text = f.read()
            except FileNotFoundError:
                continue
            self.mirrored.add(suffix)
            self.control('file', suffix=suffix, text=text)


def _signal_group(pgid, signum):
    try:
        os.killpg(pgid, signum)
    except (ProcessLookupError, PermissionError):
        pass


def read_spec(argv, stdin):
    """The job's description: from ``--spec FILE``, else the first line of stdin."""
    if argv[:1] == ['--spec'] and len(argv) == 2:
        with open(argv[1], encoding='utf-8') as f:
            return json.load(f)
    if argv:
        raise SystemExit('usage: python -m kvps.launch.remote [--spec FILE]  (the job '
                         'description on stdin otherwise)')
    return json.loads(stdin.readline())


def _watch_stdin(stopping):
    """Stop at EOF: the launcher closed the pipe, or ssh died and took the connection. (On
    the descriptor, not sys.stdin: a thread blocked in a buffered read holds its lock, and
    the interpreter aborts when it finds it held at exit.)"""
    while os.read(0, _CHUNK):
        pass
    stopping.set()


def main(argv=None):
    spec = read_spec(sys.argv[1:] if argv is None else argv, sys.stdin.buffer)
    out = Output(sys.stdout.buffer)
    try:
        task = task_of(spec, os.environ)
    except RemoteError as exc:
        out.write(f'kvps.launch.remote: {exc}\n'.encode())
        return 1
    runner = Runner(spec, task, out)
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, lambda *_: runner.stopping.set())
    if spec.get('watch_stdin'):
        threading.Thread(target=_watch_stdin, args=(runner.stopping,), daemon=True).start()
    return runner.run(os.environ)


if __name__ == '__main__':
    sys.exit(main())
