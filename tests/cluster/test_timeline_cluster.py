"""A traced job (python -m kvps.launch --timeline) gives one Chrome trace of every node that the summary reads."""

import fcntl
import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvps.timeline import summary
from kvps.timeline.recording import SUFFIX, parts_dir

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(180)]

ROUNDS = '''
kv = kvps.create('dist_sync')
kv.init(['small', 'big'], [np.zeros(10, np.float32), np.zeros(3000, np.float32)])
out = [np.zeros(10, np.float32), np.zeros(3000, np.float32)]
for step in range(5):
    kv.push(['small', 'big'], [np.ones(10, np.float32), np.ones(3000, np.float32)])
    kv.pull(['small', 'big'], out=out)
'''


def traced(job, tmp_path, script, workers=2, servers=2, env=None):
    path = tmp_path / 'trace.json'
    result = job(script, workers, servers, launcher_args=['--timeline', str(path)],
                 env={'KVPS_BIGARRAY_BOUND': '1000', **(env or {})})
    return result, path


@pytest.mark.parametrize('optimizer', [None, 'sgd'])
def test_a_traced_job_gives_one_trace_with_every_node_and_its_rounds(job, tmp_path, optimizer):
    setup = '' if optimizer is None else (
        "kv = kvps.create('dist_sync')\n"
        f"kv.set_optimizer(kvps.optimizer.create({optimizer!r}, learning_rate=0.1))\n")
    result, path = traced(job, tmp_path, setup + ROUNDS + 'report(ok=True)\n')
    assert result.returncode == 0, result.output
    assert f'timeline of 5 nodes written to {path}' in result.stderr
    trace = json.loads(path.read_text())
    timeline = summary.Timeline(trace)
    assert sorted(timeline.names.values()) == ['scheduler', 'server 0', 'server 1',
                                               'worker 0', 'worker 1']
    # Every round of every worker: its push, the server's update of that round, the pull
    # that brought it back, in that order once the clocks are aligned (within their error).
    slack = (trace['otherData']['clock_error_us'] or 0) * 2
    chains = timeline.chains()
    by_worker = {}
    for chain in chains:
        roles = [timeline.names[span['pid']].split()[0] for span in chain]
        assert roles == ['worker', 'server', 'worker'], roles
        # (without an optimizer a round ends in the span of the message that completed it)
        closing = 'merge' if optimizer is None else 'update'
        assert [s['cat'] for s in chain] == ['push', closing, 'pull'], chain
        ends = [s['ts'] + s['dur'] for s in chain]
        assert chain[0]['ts'] <= chain[1]['ts'] + slack and ends[1] <= ends[2] + slack, chain
        by_worker.setdefault(timeline.names[chain[0]['pid']], 0)
        by_worker[timeline.names[chain[0]['pid']]] += 1
    # each worker's 5 rounds, on each server its messages reach (both keys: 'big' is split)
    assert by_worker == {'worker 0': 10, 'worker 1': 10}, by_worker
    text = subprocess.run([sys.executable, '-m', 'kvps.timeline', 'summary', str(path)],
                          capture_output=True, text=True, timeout=60)
    assert text.returncode == 0, text.stderr
    assert '5 nodes' in text.stdout and 'worker' in text.stdout and 'server' in text.stdout
    assert 'bytes by route' in text.stdout


def test_a_killed_workers_trace_keeps_its_spans_up_to_the_kill(job, tmp_path):
    script = ROUNDS + '''
if kv.rank == 1:
    time.sleep(1.0)     # past a flush of the timeline's writer
    os.kill(os.getpid(), 9)
kv.barrier()
'''
    result, path = traced(job, tmp_path, script)
    assert result.returncode != 0
    assert 'worker 1' in result.stderr and path.exists(), result.output
    timeline = summary.Timeline(json.loads(path.read_text()))
    killed = [pid for pid, name in timeline.names.items() if name == 'worker 1']
    pushes = [s for s in timeline.spans if s['pid'] in killed and s['cat'] == 'push'
              and s['name'] == 'push']
    assert len(pushes) == 5


PAUSING = ROUNDS + """
import signal

def switch(to):
    if kv.rank == 0:   # one SIGUSR2 per node pauses, the next resumes
        for pid in [*job_pids('server'), *job_pids('worker')]:
            os.kill(pid, signal.SIGUSR2)
    while kvps.timeline.enabled() is not to:   # (each worker waits for its own)
        time.sleep(0.01)
    kv.barrier()

switch(False)
for step in range(4):   # not recorded
    kv.push(['small', 'big'], [np.ones(10, np.float32), np.ones(3000, np.float32)])
    kv.pull(['small', 'big'], out=out)
switch(True)
kv.push(['small', 'big'], [np.ones(10, np.float32), np.ones(3000, np.float32)])
kv.pull(['small', 'big'], out=out)
report(total=float(out[1][0]))
"""


def test_sigusr2_pauses_and_resumes_the_nodes_recording(job, tmp_path):
    result, path = traced(job, tmp_path, PAUSING)
    assert result.returncode == 0, result.output
    assert all(got['total'] == 2.0 for got in result.results().values())
    trace = json.loads(path.read_text())
    timeline = summary.Timeline(trace)
    by_name = {name: pid for pid, name in timeline.names.items()}
    for name in ('worker 0', 'worker 1'):   # 5 rounds before the pause and 1 after it
        pushes = [s for s in timeline.spans if s['pid'] == by_name[name] and s['name'] == 'push']
        assert len(pushes) == 6, (name, len(pushes))
    for name in ('server 0', 'server 1', 'worker 0', 'worker 1'):
        marks = [e['name'] for e in trace['traceEvents'] if e.get('ph') == 'i'
                 and e.get('cat') == 'timeline' and e['pid'] == by_name[name]]
        assert marks == ['pause', 'resume'], (name, marks)
    # a server pauses when its signal lands: it recorded fewer of the 20 pushes it handled
    handled = [s for s in timeline.spans if s['pid'] == by_name['server 0']
               and s['name'] == 'recv push']
    assert 0 < len(handled) < 20, len(handled)
    # the summary's steps (push to push) leave out the one with the paused gap
    assert sorted(len(periods) for periods in timeline.steps.values()) == [4, 4]


def test_a_path_that_cannot_be_written_is_refused_before_anything_starts(job, tmp_path):
    blocker = tmp_path / 'a-file'
    blocker.write_text('')
    result = job('report(ran=True)\n', 1, 1,
                 launcher_args=['--timeline', str(blocker / 'trace.json')])
    assert result.returncode == 2
    assert '--timeline' in result.stderr and 'cannot write there' in result.stderr
    assert 'RESULT' not in result.stdout


def test_a_worker_started_with_a_bad_path_says_so(job, tmp_path):
    blocker = tmp_path / 'a-file'
    blocker.write_text('')
    script = '''
try:
    kvps.create('dist_sync')
except kvps.ConfigError as exc:
    report(error=str(exc))
    sys.exit(3)
'''
    result = job(script, 1, 1, env={'KVPS_TIMELINE': str(blocker / 'trace.json')})
    assert result.returncode != 0
    assert 'KVPS_TIMELINE=' in result.output and 'cannot write the timeline' in result.output


def test_off_means_no_file_and_no_extra_thread(job, tmp_path):
    script = ROUNDS + '''
import threading
report(threads=sorted(t.name for t in threading.enumerate()), on=kvps.timeline.enabled())
'''
    result = job(script, 1, 1)
    assert result.returncode == 0, result.output
    got = result.results()[0]
    assert got['on'] is False and 'kvps-timeline' not in got['threads']
    assert not list(tmp_path.rglob(f'*{SUFFIX}')) and not list(tmp_path.glob('*.d'))
    assert parts_dir('x') == 'x.d'


def test_kv_stats_count_calls_rounds_and_every_byte_by_route(job):
    script = ROUNDS + '''
kv.barrier()
report(**kv.stats())
'''
    result = job(script, 2, 2, env={'KVPS_BIGARRAY_BOUND': '1000'})
    assert result.returncode == 0, result.output
    for stats in result.results().values():
        assert stats['push_calls'] == stats['pull_calls'] == stats['rounds'] == 5
        # 5 rounds of 10 + 3000 float32: the small key's 40 bytes are under shared memory's
        # 1 KiB floor (the socket), the big key's two parts of 6000 bytes go through it
        assert stats['pushed_bytes'] == {'shm': 60000, 'socket': 200, 'ipc': 0}, stats
        assert sum(stats['pulled_bytes'].values()) == 60200, stats
        assert stats['answers'] == stats['messages'] > 0 and stats['retries'] == 0
        assert stats['in_flight_requests'] == 0 and stats['in_flight_push_bytes'] >= 0


def test_stats_lines_come_from_every_node(job):
    script = ROUNDS + '''
time.sleep(1.5)
kv.barrier()
'''
    result = job(script, 1, 1, launcher_args=['--stats', '0.5'])
    assert result.returncode == 0, result.output
    for node in ('scheduler', 'server 0', 'worker 0'):
        assert f'kvps stats {node}: ' in result.output, result.output


def test_stats_lines_nobody_reads_stall_no_node(by_hand):
    """Every node writes --stats lines into a pipe that nobody reads while the job runs (a
    paused terminal, `| less` left unscrolled): the pipes fill, and the nodes' loops go on,
    heartbeats and all, where a loop blocked on its line was declared lost."""
    def unread(proc):   # a pipe of one page, never read until the job ends
        fcntl.fcntl(proc.stdout.fileno(), fcntl.F_SETPIPE_SZ, 4096)
        return proc
    fast = {'KVPS_STATS': '0.005', 'KVPS_HEARTBEAT_TIMEOUT': '2'}
    scheduler, env = by_hand.scheduler(1, 1, extra=fast)
    unread(scheduler)
    server = unread(by_hand('server', env))
    worker = unread(by_hand('worker', env, script=ROUNDS + '''
start = time.monotonic()
while time.monotonic() - start < 4:   # twice the heartbeat timeout, the pipes full
    kv.push('big', np.ones(3000, np.float32))
    kv.pull('big', out=out[1])
    time.sleep(0.05)
kv.barrier()
report(pulled=float(out[1][0]))
'''))
    code, out = by_hand.finish(worker)
    assert code == 0 and 'RESULT' in out, out
    assert 'kvps stats worker 0: ' in out
    for proc in (server, scheduler):
        code, out = by_hand.finish(proc)
        assert code == 0, out


def test_a_job_started_by_hand_writes_part_files_that_merge_joins(by_hand, tmp_path):
    path = tmp_path / 'trace.json'
    traced = {'KVPS_TIMELINE': str(path)}
    scheduler, env = by_hand.scheduler(1, 1, extra=traced)
    server = by_hand('server', env)
    worker = by_hand('worker', env, script=ROUNDS + 'kv.barrier()\n')
    for proc in (worker, server, scheduler):
        code, out = by_hand.finish(proc)
        assert code == 0, out
    parts = sorted(p.name.split('-')[0] for p in Path(parts_dir(path)).glob(f'*{SUFFIX}'))
    assert parts == ['scheduler', 'server', 'worker']
    merged = subprocess.run([sys.executable, '-m', 'kvps.timeline', 'merge', str(path) + '.d',
                             '-o', str(path)], capture_output=True, text=True, timeout=60)
    assert merged.returncode == 0, merged.stderr
    names = summary.Timeline(json.loads(path.read_text())).names.values()
    assert sorted(names) == ['scheduler', 'server 0', 'worker 0']
