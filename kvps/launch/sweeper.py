"""Outlives the launcher to remove the /dev/shm names its children left, even when it was killed.

A launcher's children die with it (PR_SET_PDEATHSIG), by SIGKILL: one killed while its segment
or arena still had a name (as the job starts) cannot remove it, nor can the launcher, dead too.
The launcher writes each child's pid to this process's stdin; at EOF (the launcher exited, or
was killed) it waits for those children to be gone and removes the names they left.
"""

import sys
import time

from ..wire.shm import remove_leftovers
from .processes import group_alive

# Children die with the launcher at once; one stuck in the kernel is not waited for long.
CHILDREN_GONE_S = 30.0
_POLL = 0.05


def sweep(pids, timeout=CHILDREN_GONE_S):
    """Once the process groups of ``pids`` are empty (or ``timeout`` passed), unlink their
    segments' names."""
    deadline = time.monotonic() + timeout
    while any(group_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(_POLL)
    for pid in pids:
        remove_leftovers(pid)


def main(lines):
    sweep([int(line) for line in lines if line.strip().isdigit()])


if __name__ == '__main__':
    main(sys.stdin)
