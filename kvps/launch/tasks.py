"""Processes a runner (`kvps.launch.remote`) starts on another host, seen through the local
process that carries its output (ssh, srun, mpirun): their control lines and output lines.

A runner writes its child's output line by line (with a ``[name] `` tag when several runners
share one stream) and, between those lines, control lines that start with MARK: the child's
pid and host once started, the scheduler's port, formed and blame files as they appear, and
the child's wait status when it ended. The carrier's other lines (ssh's own errors, a remote
shell's) are output as well.
"""

import collections
import json

MARK = '\x1ekvps.launch '   # ASCII record separator: no program's output line starts so
# Files the scheduler writes beside its port file that a runner reports, by suffix.
MIRRORED = ('', '.formed', '.blame', '.done')


def control_line(task, event, **fields):
    """One control line (with its newline) about ``task`` (its name)."""
    return MARK + json.dumps({'task': task, 'event': event, **fields}) + '\n'


def parse_control(line):
    """The dict of a control line, or None when ``line`` is output (or a damaged control)."""
    if not line.startswith(MARK):
        return None
    try:
        fields = json.loads(line[len(MARK):])
    except ValueError:
        return None
    return fields if isinstance(fields, dict) and isinstance(fields.get('task'), str) else None


class Task:
    """A process started by a runner for this job, elsewhere, reached through its carrier (a
    local Child): the supervisor handles it as it does a local child; stopping, waiting and
    killing act on the carrier."""

    def __init__(self, spec, carrier, tail_lines):
        self.spec, self.carrier, self.name = spec, carrier, spec.name
        self.tail = collections.deque(maxlen=tail_lines)
        self.done = False        # set by the supervisor when it handled this task's exit
        self.remote_pid = None
        self.host = None
        self.status = None       # the child's wait status, as its runner reported it
        self.reported = False    # its exit event was queued (once)
        self.replacement = False   # as a Child's
        self.dropped = False

    @property
    def pid(self):
        return self.remote_pid if self.remote_pid is not None else self.carrier.pid

    @property
    def returncode(self):
        """The remote child's wait status; the carrier's own once it ended without one (ssh's
        255 when the connection failed)."""
        return self.status if self.status is not None else self.carrier.returncode

    @property
    def respawn(self):
        """The spec that starts this task again: its carrier's, when it carries only this."""
        return self.carrier.spec if len(self.carrier.tasks) == 1 else None


def route(carrier, line):
    """``(task, text)``: the task a carrier's output ``line`` belongs to (None: the carrier's
    own) and the text to print for it, prefixed."""
    tasks = carrier.tasks
    if len(tasks) == 1:
        return tasks[0], f'[{tasks[0].name}] {line}'
    if line.startswith('['):
        name, sep, rest = line[1:].partition('] ')
        for task in tasks:
            if sep and task.name == name:
                return task, line
    return None, f'[{carrier.name}] {line}'


def untagged(task, text):
    """The line as the task printed it (without the prefix ``route`` gave it)."""
    return text[len(task.name) + 3:]
