"""CUDA MPS for a job whose processes share a GPU: a private control daemon, started before the
job's first process and stopped after its last (`kvps.launch --mps`, and the benchmarks)."""

import contextlib
import dataclasses
import os
import shutil
import subprocess
import tempfile
import time

from ..errors import ConfigError

BINARY = 'nvidia-cuda-mps-control'
PIPE = 'CUDA_MPS_PIPE_DIRECTORY'   # where the daemon, its servers and its clients meet
LOG = 'CUDA_MPS_LOG_DIRECTORY'
NEEDS = (f'--mps needs the NVIDIA driver\'s utilities ({BINARY} on PATH) and a GPU on this '
         'host')
# -d returns once the daemon has forked; its control socket may come a moment later, and a
# process whose CUDA starts before it runs without MPS (CUDA falls back silently).
READY_S = 5.0
START_S = 30.0   # -d itself: it only forks, but never wait forever on a driver tool
STOP_S = 5.0     # quit: then give up with a warning (the directory goes all the same)
_POLL = 0.05
_TAIL = 400      # characters of the tool's output quoted in an error


@dataclasses.dataclass(frozen=True)
class Daemon:
    """A control daemon this module started: the tool's path and the private directory that
    holds its pipe and log directories (and the tool's own output)."""
    binary: str
    root: str

    @property
    def variables(self):
        """What every process of the job is given to find the daemon."""
        return {PIPE: os.path.join(self.root, 'pipe'), LOG: os.path.join(self.root, 'log')}

    def control(self, args, stdin, timeout, environ=None):
        """Run the tool with the daemon's variables; None, or what went wrong. Its own session:
        a Ctrl-C at the terminal must not cut a quit short."""
        out = os.path.join(self.root, 'control.out')
        env = {**(os.environ if environ is None else environ), **self.variables}
        env.pop('KVPS_SECRET', None)   # the job's secret is no business of the driver's tools
        try:
            with open(out, 'wb') as f:   # a file, not a pipe: a daemon may keep it open
                proc = subprocess.Popen([self.binary, *args], env=env, stdout=f,
                                        stderr=subprocess.STDOUT, start_new_session=True,
                                        stdin=subprocess.PIPE if stdin else subprocess.DEVNULL)
                try:
                    proc.communicate(stdin, timeout=timeout)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    with contextlib.suppress(subprocess.TimeoutExpired):   # (stuck in the
                        proc.wait(STOP_S)                                  # kernel: go on)
                    return f'no answer within {timeout:g} s'
        except OSError as exc:
            return str(exc)
        if proc.returncode != 0:
            said = _tail(out) or _tail(os.path.join(self.variables[LOG], 'control.log'))
            return f'exit code {proc.returncode}' + (f': {said}' if said else '')
        return None


def _tail(path):
    try:
        with open(path, 'rb') as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - _TAIL))
            return ' '.join(f.read().decode(errors='replace').split())
    except OSError:
        return ''


def start(environ, say, ready_s=READY_S):
    """Start a private daemon for a job whose environment is ``environ``; None when
    ``environ`` already names one (CUDA_MPS_PIPE_DIRECTORY: the user's or the cluster's),
    which is then used as it is. Raises ConfigError, having left nothing, when it cannot."""
    if environ.get(PIPE):
        say(f'MPS on: the daemon of {PIPE}={environ[PIPE]} (started and stopped by others)')
        return None
    binary = shutil.which(BINARY, path=environ.get('PATH', os.defpath))
    if binary is None:
        raise ConfigError(f'--mps: {BINARY} is not on PATH; {NEEDS}')
    daemon = Daemon(binary, tempfile.mkdtemp(prefix='kvps-mps-'))   # 0700: this user's only
    try:
        for path in daemon.variables.values():
            os.mkdir(path, 0o700)
        problem = daemon.control(['-d'], None, START_S, environ)
    except BaseException:
        shutil.rmtree(daemon.root, ignore_errors=True)
        raise
    if problem:
        stop(daemon, lambda _: None, environ)   # in case it forked before it failed
        raise ConfigError(f'--mps: {BINARY} -d failed ({problem}); {NEEDS}')
    pipe = daemon.variables[PIPE]
    if not _appears(os.path.join(pipe, 'control'), ready_s):
        say(f'warning: the MPS daemon made no control socket in {pipe} within {ready_s:g} s; '
            'processes whose CUDA starts before it does run without MPS')
    say(f'MPS on: a private control daemon, {PIPE}={pipe}')
    return daemon


def _appears(path, timeout):
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() >= deadline:
            return False
        time.sleep(_POLL)
    return True


def stop(daemon, say, environ=None, timeout=STOP_S):
    """Tell the daemon to quit, wait for that (at most ``timeout`` s), remove its directory."""
    problem = daemon.control([], b'quit\n', timeout, environ)
    if problem:
        say(f'warning: the MPS daemon of {daemon.variables[PIPE]} did not quit cleanly '
            f'({problem}); going on')
    shutil.rmtree(daemon.root, ignore_errors=True)


@contextlib.contextmanager
def running(on, environ, say, started=None):
    """While the block runs, a daemon for a job whose environment is ``environ`` (when ``on``):
    yields the variables its processes are to be given ({} when off or given already).
    ``started(daemon)``: told of a daemon this started (the launcher's sweeper)."""
    daemon = start(environ, say) if on else None
    try:
        if daemon is not None and started is not None:
            started(daemon)
        yield daemon.variables if daemon is not None else {}
    finally:
        if daemon is not None:
            stop(daemon, say, environ)
