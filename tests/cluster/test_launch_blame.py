"""Whom the launcher names when a job ends because of a node that did not exit first."""

import re

import pytest


pytestmark = [pytest.mark.cluster, pytest.mark.timeout(180)]


STOPPING_SCRIPT = '''
import signal
kv = kvps.create('dist_sync')
kv.init(0, np.zeros(2))
if kv.rank == 0:
    nodes = kv._backend.io.welcome['nodes']
    server = next(n['pid'] for n in nodes if (n['role'], n['rank']) == ('server', 1))
    os.kill(server, signal.SIGSTOP)   # alive but silent: it will never exit by itself
for step in range(100000):
    kv.push(0, np.ones(2))
    kv.pull(0, out=np.zeros(2))
    time.sleep(0.01)
'''


def test_a_stopped_server_is_blamed_not_the_first_process_to_exit(job):
    # The scheduler finds it lost and ends the job; the others then exit 1, first.
    result = job(STOPPING_SCRIPT, 2, 2, launcher_args=('--grace', '1'))
    assert result.returncode == 1, result.output
    blamed = re.findall(r'^kvps.launch: (.*) \(pid \d+\) failed first: (.*)$', result.stderr,
                        re.M)
    assert blamed and {who for who, _ in blamed} == {'server 1'}, result.stderr
    assert re.match(r'the scheduler ended the job: server 1 \(host 127.0.0.1, pid \d+\) is '
                    r'lost: no heartbeat for [\d.]+ s \(KVPS_HEARTBEAT_TIMEOUT\)', blamed[0][1])


def test_a_stopped_scheduler_is_blamed_not_the_node_that_lost_it(job):
    """Nobody writes the blame when the scheduler is the one stopped: the launcher finds it
    stopped as the nodes that lost it exit."""
    script = '''
import signal
kv = kvps.create('dist_sync')
kv.init(0, np.zeros(2))
if kv.rank == 0:
    os.kill(*job_pids('scheduler'), signal.SIGSTOP)
for step in range(100000):
    kv.push(0, np.ones(2))
    kv.pull(0, out=np.zeros(2))
    time.sleep(0.01)
'''
    result = job(script, 2, 1, env={'KVPS_HEARTBEAT_TIMEOUT': '2'},
                 launcher_args=('--grace', '1'))
    assert result.returncode == 1, result.output
    assert re.search(r'^kvps.launch: scheduler \(pid \d+\) failed first: stopped \(SIGSTOP, or '
                     r'a debugger\) while the job ran', result.stderr, re.M), result.stderr


NEVER_JOINING_SCRIPT = '''
if os.environ['KVPS_RANK'] == '1':
    time.sleep(170)        # busy elsewhere: never creates its store (the launcher stops it)
kvps.create('dist_sync')
'''


def test_a_worker_that_never_registers_is_named(job):
    result = job(NEVER_JOINING_SCRIPT, 2, 1, env={'KVPS_CONNECT_TIMEOUT': '8'},
                 launcher_args=('--grace', '1'))
    assert result.returncode == 1, result.output
    assert re.search(r'^kvps.launch: worker 1 \(pid \d+\) failed first: the scheduler ended the '
                     r'job: registration timed out after 8 s: 1 of 2 workers never registered '
                     r'\(missing: worker 1; registered: ', result.stderr, re.M), result.stderr
    assert 'worker 0 (pid' not in result.stderr
