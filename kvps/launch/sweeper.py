"""Outlives the launcher to remove the /dev/shm names its children left, even when it was killed,
and to stop the MPS daemon it started (--mps) if it could not.

A launcher's children die with it (PR_SET_PDEATHSIG), by SIGKILL: one killed while its segment
or arena still had a name (as the job starts) cannot remove it, nor can the launcher, dead too.
The launcher writes each child's pid to this process's stdin; at EOF (the launcher exited, or
was killed) it waits for those children to be gone and removes the names they left.
"""

import json
import os
import sys
import time

from ..wire.shm import remove_leftovers
from . import mps
from .processes import group_alive

# Children die with the launcher at once; one stuck in the kernel is not waited for long.
CHILDREN_GONE_S = 30.0
# A launcher that ends normally stops its MPS daemon (removing its directory) just after it
# closed this process's stdin; a merged timeline may come between the two.
LAUNCHER_GONE_S = 120.0
_POLL = 0.05


def sweep(pids, timeout=CHILDREN_GONE_S):
    """Once the process groups of ``pids`` are empty (or ``timeout`` passed), unlink their
    segments' names."""
    deadline = time.monotonic() + timeout
    while any(group_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(_POLL)
    for pid in pids:
        remove_leftovers(pid)


def stop_left(daemons, launcher, timeout=LAUNCHER_GONE_S):
    """Stop the daemons the launcher (pid ``launcher``, this process's parent) left: those
    whose directory is still there once it is gone. One it removed was stopped already.
    (Its pid comes on the command line: one killed while this still imports kvps would have
    left it an orphan already, whose parent is someone else.)"""
    deadline = time.monotonic() + timeout
    while daemons and time.monotonic() < deadline:
        daemons = [d for d in daemons if os.path.isdir(d.root)]
        if os.getppid() != launcher:   # it died: nobody else will stop them
            for daemon in daemons:
                mps.stop(daemon, lambda _: None)
            return
        time.sleep(_POLL)


def main(lines, launcher):
    pids, daemons = [], []
    for line in lines:
        if line.startswith('mps '):
            daemons.append(mps.Daemon(*json.loads(line[4:])))
        elif line.strip().isdigit():
            pids.append(int(line))
    sweep(pids)
    stop_left(daemons, launcher)


if __name__ == '__main__':
    main(sys.stdin, int(sys.argv[1]))
