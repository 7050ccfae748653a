"""A launcher killed with SIGKILL (no chance to stop or sweep anything) leaves no process and no
shared-memory segment of its job behind: its children die with it (PR_SET_PDEATHSIG), and its
sweeper removes the names they had no chance to remove. A server killed likewise."""

import glob
import json
import os
import signal
import time

import pytest

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(180)]

# Workers push and pull big arrays forever (through shared memory), until something kills them.
LOOPING_SCRIPT = '''
kv = kvps.create('dist_sync')
kv.init(0, np.zeros(1 << 20, np.float32))
out = np.zeros(1 << 20, np.float32)
kv.push(0, np.ones(1 << 20, np.float32))
kv.pull(0, out=out)
nodes = kv._backend.io.welcome['nodes']
print('READY', json.dumps(sorted(n['pid'] for n in nodes)), flush=True)
while True:
    kv.push(0, np.ones(1 << 20, np.float32))
    kv.pull(0, out=out)
'''


def segments_of(pids):
    return [path for pid in pids for path in glob.glob(f'/dev/shm/kvps-{pid}-*')]


def wait_until_ready(proc, workers):
    """The pids of the job's workers and servers, once every worker is in its loop."""
    ready, lines = [], []
    while len(ready) < workers:
        line = proc.stdout.readline()
        assert line, 'the job ended before its workers were ready:\n' + ''.join(lines)
        lines.append(line)
        if '] READY ' in line:
            ready.append(json.loads(line.split('] READY ', 1)[1]))
    assert all(pids == ready[0] for pids in ready), ready
    return ready[0]


def test_a_killed_launcher_leaves_no_process_and_no_segment_of_its_job(running):
    proc = running(LOOPING_SCRIPT, workers=2, servers=1)
    nodes = wait_until_ready(proc, workers=2)
    job = running.processes()   # the launcher, its sweeper, the scheduler, the server, the workers
    assert len(nodes) == 3 and set(nodes) <= set(job) and len(job) == 6, (nodes, job)
    proc.kill()
    proc.wait(30)
    deadline = time.monotonic() + 30   # a bound for a loaded box, not a measurement
    while (running.processes() or segments_of(job)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert running.processes() == [], 'processes of the job outlived the launcher'
    assert segments_of(job) == [], 'segments of the job left in /dev/shm'


# The job stops as it starts: the server's arena keeps its name in /dev/shm until every worker
# on the host has read a pull from it (or ARENA_NAME_SECONDS pass), and these workers never
# pull. A process SIGKILLed then cannot remove the name itself.
STARTING_SCRIPT = '''
kv = kvps.create('dist_sync')
kv.init(0, np.zeros(1 << 20, np.float32))
nodes = kv._backend.io.welcome['nodes']
print('READY', json.dumps(sorted(n['pid'] for n in nodes if n['role'] != 'scheduler')),
      flush=True)
time.sleep(600)
'''


def wait_until_gone(running, job):
    deadline = time.monotonic() + 30   # a bound for a loaded box, not a measurement
    while (running.processes() or segments_of(job)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert running.processes() == [], 'processes of the job outlived it'
    assert segments_of(job) == [], 'segments of the job left in /dev/shm'


def test_a_launcher_killed_while_its_job_starts_leaves_no_segment_behind(running):
    proc = running(STARTING_SCRIPT, workers=2, servers=1)
    nodes = wait_until_ready(proc, workers=2)
    job = running.processes()
    assert segments_of(nodes), 'the arena was expected to have its name still'
    proc.kill()
    proc.wait(30)
    wait_until_gone(running, job)


def test_a_server_killed_while_the_job_starts_leaves_no_segment_behind(running):
    proc = running(STARTING_SCRIPT, workers=2, servers=1)
    nodes = wait_until_ready(proc, workers=2)
    job = running.processes()
    assert segments_of(nodes), 'the arena was expected to have its name still'
    arena, = segments_of(nodes)                      # the server's: kvps-<its pid>-<random>
    os.kill(int(os.path.basename(arena).split('-')[1]), signal.SIGKILL)
    assert proc.wait(60) != 0
    wait_until_gone(running, job)
