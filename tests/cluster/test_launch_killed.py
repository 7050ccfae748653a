"""A launcher killed with SIGKILL (no chance to stop or sweep anything) leaves no process and no
shared-memory segment of its job behind: its children die with it (PR_SET_PDEATHSIG)."""

import glob
import json
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
    job = running.processes()          # the launcher, the scheduler, the servers, the workers
    assert len(nodes) == 3 and set(nodes) <= set(job) and len(job) == 5, (nodes, job)
    proc.kill()
    proc.wait(30)
    deadline = time.monotonic() + 30   # a bound for a loaded box, not a measurement
    while (running.processes() or segments_of(job)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert running.processes() == [], 'processes of the job outlived the launcher'
    assert segments_of(job) == [], 'segments of the job left in /dev/shm'
