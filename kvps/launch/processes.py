"""The launcher's processes one by one: what to start (ProcSpec), how each exit reads, the
parent-death signal, process groups, and the sweeper that outlives the launcher."""

import collections
import contextlib
import ctypes
import dataclasses
import json
import os
import signal
import subprocess
import sys

PR_SET_PDEATHSIG = 1


@dataclasses.dataclass(frozen=True)
class ProcSpec:
    """One process to start: its role, rank within the role (None for the scheduler), argv, env.

    A carrier (ssh, srun, mpirun starting runners elsewhere) also has ``tasks``: the specs of
    the processes it carries, which the supervisor watches instead of it; and ``stdin``:
    bytes written to it at start, the pipe then left open (a runner under ssh stops its child
    when that pipe closes)."""
    role: str
    rank: object
    argv: tuple
    env: dict
    stdin: bytes = None
    tasks: tuple = ()

    @property
    def name(self):
        return self.role if self.rank is None else f'{self.role} {self.rank}'


class Sweeper:
    """The launcher's side of kvps.launch.sweeper: a process in a session of its own, not
    killed with the launcher, told each child's pid (children have process groups of their
    own: pgid == pid)."""

    def __init__(self):
        try:
            self.proc = subprocess.Popen(
                [sys.executable, '-m', 'kvps.launch.sweeper', str(os.getpid())],
                stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        except OSError:   # the launcher still sweeps when it stops; only a SIGKILL escapes
            self.proc = None

    def watch(self, pid):
        self._write(f'{pid}\n'.encode())

    def watch_mps(self, daemon):
        """An MPS daemon (kvps.launch.mps.Daemon) to stop should the launcher die first."""
        self._write(f'mps {json.dumps([daemon.binary, daemon.root])}\n'.encode())

    def _write(self, data):
        try:
            self.proc.stdin.write(data)
            self.proc.stdin.flush()
        except (AttributeError, OSError, ValueError):   # none, or it died: best effort
            pass

    def close(self):
        """EOF: the sweeper removes what the (reaped) children left, and exits."""
        if self.proc is not None:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()


def exit_code(returncode):
    """The shell-style exit code of a child: its own code, or 128+signum if a signal killed it."""
    return 128 - returncode if returncode < 0 else returncode


def describe(returncode):
    """'exit code 3' or 'killed by signal SIGKILL'."""
    if returncode >= 0:
        return f'exit code {returncode}'
    try:
        return f'killed by signal {signal.Signals(-returncode).name}'
    except ValueError:
        return f'killed by signal {-returncode}'


def pdeathsig_preexec():
    """A preexec_fn making the kernel SIGKILL the child when the launcher dies (Linux), or None.

    Everything is looked up before fork: the child runs only the prctl call and getppid, because
    other threads (output readers) may hold locks at fork time. The kernel fires the signal when
    the *thread* that forked exits, so children must be spawned from a long-lived thread (main).
    """
    if not sys.platform.startswith('linux'):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    prctl.argtypes = [ctypes.c_int] + [ctypes.c_ulong] * 4
    prctl.restype = ctypes.c_int
    parent, sigkill = os.getpid(), int(signal.SIGKILL)

    def preexec():
        prctl(PR_SET_PDEATHSIG, sigkill, 0, 0, 0)
        if os.getppid() != parent:  # the launcher died before prctl took effect
            os._exit(1)
    return preexec


def _stat(pid):
    """The fields of /proc/<pid>/stat after the command name (state first, pgid third), or
    [] for a process gone (or no /proc)."""
    try:
        with open(f'/proc/{pid}/stat', 'rb') as f:
            return f.read().rsplit(b')', 1)[1].split()
    except (OSError, IndexError):
        return []


def stopped(pid):
    """Whether process ``pid`` is stopped (SIGSTOP, a debugger): alive, and running nothing."""
    fields = _stat(pid)
    return bool(fields) and fields[0] in (b'T', b't')


def group_alive(pgid):
    """Whether any non-zombie process remains in process group `pgid`.

    kill(-pgid, 0) alone is not enough: orphaned zombies count, and a container's PID 1 may
    never reap them, so on Linux a hit is confirmed by scanning /proc.
    """
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # only a foreign process could be there; nothing of ours is left
        return False
    if not os.path.isdir('/proc'):
        return True
    for entry in os.listdir('/proc'):
        fields = _stat(entry) if entry.isdigit() else []
        if len(fields) > 2 and int(fields[2]) == pgid and fields[0] != b'Z':
            return True
    return False


class Child:
    """A started process: its Popen, the thread pumping its output, and the tail of that output."""

    def __init__(self, spec, proc, tail_lines):
        self.spec, self.proc, self.pid = spec, proc, proc.pid
        self.name = spec.name
        self.tail = collections.deque(maxlen=tail_lines)
        self.done = False        # set by the supervisor when it handled this child's exit
        self.group_gone = False  # once empty a process group can never gain members again
        self.reader = None
        self.tasks = []          # a carrier's Tasks
        self.respawn = spec      # what starts it again
        self.replacement = False   # started again after it failed (--restart-*)
        self.dropped = False       # stopped as one that can no longer join: no failure

    def close_stdin(self):
        """Close the pipe to its stdin; whether it had one open (its way to be stopped)."""
        stdin, self.proc.stdin = self.proc.stdin, None
        if stdin is None:
            return False
        with contextlib.suppress(OSError):
            stdin.close()
        return True

    @property
    def returncode(self):
        return self.proc.returncode

    def signal_group(self, signum):
        if self.group_gone:
            return
        # a runner under ssh is stopped by closing the pipe: ssh forwards the EOF and stays,
        # bringing back what its child prints as it stops (SIGKILL still kills ssh)
        if signum == signal.SIGTERM and self.close_stdin():
            return
        if self.proc.returncode is not None and not group_alive(self.pid):
            self.group_gone = True
            return
        try:
            os.killpg(self.pid, signum)
        except (ProcessLookupError, PermissionError):
            pass

    def group_alive(self):
        if self.proc.returncode is None:
            return True
        if not self.group_gone and not group_alive(self.pid):
            self.group_gone = True
        return not self.group_gone
