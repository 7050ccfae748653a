"""Run generic process specs, prefix their output, stop them all on the first failure, reap all."""

import codecs
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time

from ..wire.shm import remove_leftovers
from .processes import Child, describe, exit_code, pdeathsig_preexec, stopped
from .tasks import MIRRORED, Task, parse_control, route, untagged

TAIL_LINES = 20
_READ_CHUNK = 1 << 16
_POLL = 0.05
# How long the other workers may take to exit too once one left before the job formed: all
# of them exiting 0 is a job that never meant to join (nothing failed); any still running
# after that wait for a peer that is gone.
UNJOINED_GRACE = 10.0

class Supervisor:
    """Starts specs, prints their output prefixed, and turns the first failure into a teardown.

    Events (child exits, signals to the launcher) arrive on one queue and are handled only in
    the thread that created the Supervisor, which must also be the thread that calls start().
    """

    def __init__(self, out=None, err=None, grace=5.0, tail_lines=TAIL_LINES, restarts=None,
                 primary_role='worker', formed_file=None, unjoined_grace=UNJOINED_GRACE,
                 blame_file=None, sweeper=None, tolerated=(), mirror_to=None, blame_wait=0.0,
                 done_file=None):
        self.out = out if out is not None else sys.stdout
        self.err = err if err is not None else sys.stderr
        self.grace = grace
        self.tail_lines = tail_lines
        self.children = []       # what the job is made of: local children and remote tasks
        self.procs = []          # the local processes: children, and carriers of tasks
        self.stopped = None      # exit code once the job has been stopped
        self._events = queue.SimpleQueue()  # put() is reentrant: safe from signal handlers
        self._lock = threading.Lock()       # one writer at a time on out and err
        self._failure = None                # (child, why) of the root cause
        self.restarts = dict(restarts or {})  # role -> restarts left over the whole job
        self.primary_role = primary_role
        # Written once every node has registered; until then, a primary child exiting 0 left
        # without joining and the others can never start.
        self.formed_file = formed_file
        self.unjoined_grace = unjoined_grace
        self._unjoined = None              # (first such child, when the others must be done)
        # JSON {'blame': [[role, rank], ...], 'reason': ...}, written by the job's coordinator
        # when a child ends the job without exiting first (found lost, never registered)
        self.blame_file = blame_file
        # Written by the coordinator when the job ends with every primary child finished: a
        # replacement still starting then can never join it (Config.done_file)
        self.done_file = done_file
        self._late = None                  # when such replacements are stopped
        self.sweeper = sweeper             # a Sweeper: told each child, closed at stop
        # Roles whose failures the job survives (an elastic job's workers): the coordinator
        # ends the job if it cannot go on, naming them in the blame file
        self.tolerated = frozenset(tolerated)
        # The local port file whose counterparts a remote scheduler's runner reports (written
        # here as they come), and how long a failure waits for a blame file that comes from
        # afar: the exit of a node the scheduler stopped may arrive first.
        self.mirror_to = mirror_to
        self.blame_wait = blame_wait

    # -- output --------------------------------------------------------------------------

    def _write(self, stream, text):
        with self._lock:
            try:
                stream.write(text)
                stream.flush()
            # reader gone, stream closed (None: started so) or disk full: keep draining pipes
            except (OSError, ValueError, AttributeError):
                pass

    def say(self, message):
        """One line from the launcher itself, on err."""
        self._write(self.err, f'kvps.launch: {message}\n')

    def _pump(self, child):
        """Copy a child's merged stdout+stderr to out, one prefixed line at a time."""
        decoder = codecs.getincrementaldecoder('utf-8')(errors='replace')
        stream = child.proc.stdout
        while True:
            chunk = stream.readline(_READ_CHUNK)
            text = decoder.decode(chunk, final=not chunk)
            if text:
                line = text if text.endswith('\n') else text + '\n'
                if child.tasks:
                    self._carried(child, line)
                else:
                    child.tail.append(line)
                    self._write(self.out, f'[{child.name}] {line}')
            if not chunk:
                break
        stream.close()

    def _carried(self, carrier, line):
        """A line from a carrier: a runner's control line, or a task's (or its own) output."""
        control = parse_control(line)
        if control is None:
            task, text = route(carrier, line)
            (task or carrier).tail.append(untagged(task, text) if task else line)
            self._write(self.out, text)
            return
        task = next((t for t in carrier.tasks if t.name == control['task']), None)
        if task is not None:
            self._on_control(task, control)

    def _on_control(self, task, control):
        event = control.get('event')
        if event == 'start':
            task.remote_pid, task.host = control.get('pid'), control.get('host')
        elif event == 'exit' and isinstance(control.get('returncode'), int):
            task.status = control['returncode']
            self._report_exit(task)
        elif event == 'file' and control.get('suffix') in MIRRORED and self.mirror_to:
            try:   # whole, like the scheduler's own: readers never see half a file
                tmp = f'{self.mirror_to}{control["suffix"]}.tmp'
                with open(tmp, 'w', encoding='utf-8') as f:
                    f.write(str(control.get('text', '')))
                os.replace(tmp, self.mirror_to + control['suffix'])
            except OSError as exc:
                self.say(f'cannot write {self.mirror_to}{control["suffix"]}: {exc}')

    def _report_exit(self, task):
        with self._lock:
            if task.reported:
                return
            task.reported = True
        self._events.put(('exit', task))

    # -- starting ------------------------------------------------------------------------

    def start(self, spec):
        """Start one spec; returns its child (a carrier's first task), or None (reported, job
        stopped) if it cannot run."""
        try:
            proc = subprocess.Popen(
                list(spec.argv), env=spec.env,
                stdin=subprocess.DEVNULL if spec.stdin is None else subprocess.PIPE,
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                start_new_session=True, preexec_fn=pdeathsig_preexec())
        except OSError as exc:
            self.say(f'cannot start {spec.name} ({spec.argv[0]}): {exc}')
            self.stop(127 if isinstance(exc, FileNotFoundError) else 126)
            return None
        child = Child(spec, proc, self.tail_lines)
        child.tasks = [Task(task, child, self.tail_lines) for task in spec.tasks]
        self.procs.append(child)
        self.children.extend(child.tasks or [child])
        if spec.stdin is not None:
            try:
                proc.stdin.write(spec.stdin)
                proc.stdin.flush()
            except OSError:   # it exited at once: its exit and output say why
                child.close_stdin()
        if self.sweeper is not None:
            self.sweeper.watch(child.pid)
        child.reader = threading.Thread(target=self._pump, args=(child,), daemon=True,
                                        name=f'kvps-out-{child.name}')
        child.reader.start()
        threading.Thread(target=self._await_exit, args=(child,), daemon=True,
                         name=f'kvps-wait-{child.name}').start()
        return (child.tasks or [child])[0]

    def _await_exit(self, child):
        child.proc.wait()
        if not child.tasks:
            self._events.put(('exit', child))
            return
        child.reader.join(timeout=2.0)   # the runners' last control lines first
        for task in child.tasks:         # those that said nothing ended with their carrier
            self._report_exit(task)

    # -- events --------------------------------------------------------------------------

    def on_signal(self, signum, frame=None):
        """Signal handler: forward through the event queue (handled in the supervising thread)."""
        self._events.put(('signal', signum))

    def _next_event(self, timeout):
        try:
            return self._events.get(timeout=timeout)
        except queue.Empty:
            return None

    def poll(self, timeout):
        """Handle at most one event within `timeout` s; returns the exit code if the job stopped."""
        event = self._next_event(timeout)
        if event is None or self.stopped is not None:
            return self.stopped
        kind, what = event
        if kind == 'signal':
            self.say(f'got {signal.Signals(what).name}; stopping all processes')
            return self.stop(128 + what)
        what.done = True
        if what.returncode != 0 and not what.dropped:
            # this exit may only be the job ending because of another child
            blamed = self._blamed(self.blame_wait) or self._stopped_peer(what)
            if blamed is not None:
                return self.fail(*blamed)
            if not self._restart(what) and not self._tolerate(what):
                return self.fail(what)
        if what.returncode == 0 and self._unjoined is None and self._left_unformed(what):
            self._unjoined = (what, time.monotonic() + self.unjoined_grace)
        return self.stopped

    def _left_unformed(self, child):
        return (child.spec.role == self.primary_role and self.formed_file is not None
                and not os.path.exists(self.formed_file))

    def _check_unjoined(self):
        """Once a primary child left before the job formed: stop with 0 when every primary
        child did (they never meant to join), else fail it when the others outlast the grace
        (they wait for it in vain)."""
        child, deadline = self._unjoined
        if os.path.exists(self.formed_file):   # it had registered after all: liveness decides
            self._unjoined = None
        elif all(c.done for c in self.children if c.spec.role == self.primary_role):
            self.say(f'no {self.primary_role} joined the job (none created a distributed '
                     'kvstore); stopping the rest')
            self.stop(0)
        elif time.monotonic() >= deadline:
            self.fail(child, 'exited with exit code 0 without joining the job (it never '
                             'created a distributed kvstore), so the job can never start')

    def _blamed(self, wait=0.0):
        """``(child, why)`` for the child the coordinator named in the blame file, if any
        (waiting up to ``wait`` s for one)."""
        if self.blame_file is None:
            return None
        deadline = time.monotonic() + wait
        while not os.path.exists(self.blame_file) and time.monotonic() < deadline:
            time.sleep(_POLL)
        try:
            with open(self.blame_file, encoding='utf-8') as f:
                verdict = json.load(f)
            named, reason = verdict['blame'], str(verdict['reason'])
        except FileNotFoundError:
            return None
        except (OSError, ValueError, TypeError, KeyError) as exc:
            self.say(f'ignored {self.blame_file}: {exc!r}')
            return None
        for child in reversed(self.children):   # a restarted spec's latest process
            if [child.spec.role, child.spec.rank] in named:
                return child, f'the scheduler ended the job: {reason}'
        return None

    def _stopped_peer(self, failed):
        """``(child, why)`` for a local child that is stopped as ``failed`` ends (its peers,
        the scheduler first, may not tell: a stopped scheduler writes no blame), or None."""
        for child in self.procs:
            if child is not failed and child.returncode is None and stopped(child.pid):
                return child, ('stopped (SIGSTOP, or a debugger) while the job ran: the others '
                               'found it silent')
        return None

    def _restart(self, child):
        """Start a failed child's spec again if its role has restarts left and the job is still
        running (some primary child is); return whether it did."""
        left = self.restarts.get(child.spec.role, 0)
        if left <= 0 or child.respawn is None or all(
                c.done for c in self.children if c.spec.role == self.primary_role):
            return False
        self.restarts[child.spec.role] = left - 1
        self.say(f'{child.name} (pid {child.pid}) failed: {describe(child.returncode)}; '
                 f'restarting it ({left - 1} restart(s) left)')
        started = self.start(child.respawn)
        if started is not None:
            started.replacement = True
        return started is not None

    def _stop_late_replacements(self):
        """Once every primary child is done and the job ended well (the done file): the
        replacements still running were restarted as it ended and can never rejoin it. They
        get the grace to end on their own (one that rejoined was told to), then are stopped;
        nothing failed."""
        if self.done_file is None or not os.path.exists(self.done_file):
            return
        late = [c for c in self.children if c.replacement and not (c.done or c.dropped)]
        if late and self._late is None:
            self._late = time.monotonic() + self.grace
        elif late and time.monotonic() >= self._late:
            for child in late:
                child.dropped = True
                self.say(f'{child.name} (pid {child.pid}) was restarted as the job ended, which '
                         'it can no longer join; stopping it')
                # (a replacement on another host is its own carrier's only task)
                getattr(child, 'carrier', child).signal_group(signal.SIGTERM)

    def _tolerate(self, child):
        """Let the job go on without a failed child of a tolerated role; return whether so."""
        if child.spec.role not in self.tolerated or self._left_unformed(child):
            return False   # (a worker that fails before the job formed: it can never form)
        self.say(f'{child.name} (pid {child.pid}) failed: {describe(child.returncode)}; the '
                 'elastic job goes on without it')
        return True

    def fail(self, child, why=None):
        """Stop the job because `child` failed; it is the root cause if nothing failed before."""
        if self.stopped is not None:  # already stopping: later exits are consequences
            return self.stopped
        why = why or describe(child.returncode)
        self._failure = (child, why)
        self.say(f'{child.name} (pid {child.pid}) failed first: {why}; '
                 f'stopping the other processes')
        code = child.returncode   # None: still running (stopped, or never joined the job)
        return self.stop((exit_code(code) if code is not None else 0) or 1)

    # -- waiting -------------------------------------------------------------------------

    def wait_for_port(self, child, path, timeout):
        """Wait for `child` to write a port number to `path`; returns it, or None (job stopped)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            port = _read_port(path)
            if port is not None:
                return port
            if child.done and child.returncode == 0:
                self.fail(child, 'exited with exit code 0 before writing its port file')
                return None
            if self.poll(_POLL) is not None:
                return None
        # as a failure: its output (what it was stuck on) is shown after the teardown
        self.fail(child, f'did not write its port file within {timeout:g} s (--connect-timeout)')
        return None

    def supervise(self, shutdown_timeout):
        """Run until every child has exited; returns the launcher's exit code.

        When every `primary_role` child has exited 0 the others must exit on their own within
        `shutdown_timeout` s; any that do not are reported and killed (exit code 1).
        """
        primary_role = self.primary_role
        deadline = None
        while self.stopped is None:
            running = [c for c in self.children if not c.done]
            if not running:
                return self.stop(0)
            if self._unjoined is not None:
                self._check_unjoined()
                if self.stopped is not None:
                    break
            if deadline is None and all(c.done for c in self.children
                                        if c.spec.role == primary_role):
                deadline = time.monotonic() + shutdown_timeout
            if deadline is not None:
                self._stop_late_replacements()
            if deadline is not None and time.monotonic() >= deadline:
                for child in running:
                    self.say(f'{child.name} did not exit within {shutdown_timeout:g} s '
                             f'after all {primary_role}s finished')
                return self.stop(1)
            left = _POLL if deadline is None else deadline - time.monotonic()
            self.poll(max(0.0, min(_POLL, left)))
        return self.stopped

    # -- stopping ------------------------------------------------------------------------

    def stop(self, code):
        """Terminate every child's process group, kill what outlives the grace, reap, report."""
        if self.stopped is not None:
            return self.stopped
        self.stopped = code
        self._terminate_all()
        for child in self.procs:
            try:
                child.proc.wait(timeout=self.grace + 5.0)
            except subprocess.TimeoutExpired:  # unkillable (stuck in the kernel): don't hang
                self.say(f'{child.name} (pid {child.pid}) survived SIGKILL')
        deadline = time.monotonic() + 2.0  # a setsid'd grandchild may hold a pipe open
        for child in self.procs:
            child.reader.join(timeout=max(0.0, deadline - time.monotonic()))
            remove_leftovers(child.pid)   # a worker killed while its segment had a name
        if self.sweeper is not None:
            self.sweeper.close()
        self._report()
        return code

    def _terminate_all(self):
        for child in self.procs:
            child.signal_group(signal.SIGTERM)
        deadline = time.monotonic() + self.grace
        while time.monotonic() < deadline and any(c.group_alive() for c in self.procs):
            event = self._next_event(min(_POLL, max(0.0, deadline - time.monotonic())))
            if event is not None and event[0] == 'signal':
                self.say(f'got {signal.Signals(event[1]).name} again; killing all processes')
                break
        for child in self.procs:
            if child.group_alive():
                child.signal_group(signal.SIGKILL)

    def _report(self):
        if self._failure is None:
            return
        child, why = self._failure
        lines = list(child.tail)
        text = f'kvps.launch: {child.name} (pid {child.pid}) failed first: {why}\n'
        if lines:
            text += f'kvps.launch: output of {child.name}, last {len(lines)} lines:\n'
            text += ''.join(f'[{child.name}] {line}' for line in lines)
        else:
            text += f'kvps.launch: {child.name} printed nothing\n'
        self._write(self.err, text)


def _read_port(path):
    """The port in `path`, or None while it is absent, incomplete or not yet a valid port."""
    try:
        with open(path, encoding='ascii', errors='replace') as f:
            text = f.read().strip()
    except FileNotFoundError:
        return None
    return int(text) if text.isdigit() and 0 < int(text) < 65536 else None
