"""The timeline's own pieces: recording into part files, merging with aligned clocks, the summary, the CLI."""

import json
import os
import signal
import threading
import time

import msgpack
import pytest

from kvps import timeline
from kvps.errors import ConfigError
from kvps.timeline import __main__ as cli, merge, phase, recording, summary
from kvps.timeline.recording import Recorder, clock_sample


@pytest.fixture
def path(tmp_path):
    return tmp_path / 'trace.json'


def job(path, offsets, hosts=None):
    """Recorders standing for a job's nodes ({name: clock offset onto the scheduler's}), each
    on a host of its own unless ``hosts`` ({name: host}) says otherwise."""
    nodes = {}
    for rank, (name, offset) in enumerate(offsets.items()):
        role = name.split()[0]
        nodes[name] = recorder = Recorder(path, role + str(rank))
        recorder.node({'role': role, 'rank': rank, 'name': name, 'pid': rank,
                       'host': (hosts or {}).get(name, f'host{rank}')})
        if role != 'scheduler':
            recorder.clock(offset, 10)
    return nodes


def put(recorder, name, cat, start, dur, args=None, flows=None):
    """A span at a chosen local time (the tests set clocks apart by hand)."""
    recorder._put(['X', name, cat, recorder._tid(), start, dur, args, flows])


def test_off_by_default_costs_a_check_and_starts_nothing():
    assert recording.RECORDER is None
    assert recording.start(None, 'worker') is None
    with phase('forward'):
        pass
    assert not any(t.name == 'kvps-timeline' for t in threading.enumerate())


def test_a_path_that_cannot_be_written_is_refused_at_start(tmp_path):
    blocker = tmp_path / 'file'
    blocker.write_text('')
    with pytest.raises(ConfigError, match='KVPS_TIMELINE=.*cannot write'):
        Recorder(blocker / 'trace.json', 'worker')


def test_spans_reach_the_part_file_and_survive_a_torn_tail(path):
    recorder = Recorder(path, 'worker')
    with recorder.timed('push', 'push', {'bytes': 8}):
        pass
    recorder.instant('lost', 'lost', {'who': 'server 1'})
    recorder.flush()   # what the writer thread does every FLUSH_SECONDS
    part_path, = merge.part_files([path])
    with open(part_path, 'ab') as f:   # a node killed in the middle of a write
        f.write(msgpack.packb(['X', 'pull', 'pull', 0, 1, 2, None, None])[:5])
    part = merge.read_part(part_path)
    assert [e[1] for e in part.events] == ['push', 'lost']
    assert part.events[0][6] == {'bytes': 8} and part.events[0][5] >= 0
    assert part.threads == {0: threading.current_thread().name}
    recorder.close()


def test_nodes_of_one_role_and_pid_keep_their_own_part_files(path, monkeypatch):
    """Pids repeat across hosts that share the timeline's directory (every pod's first
    process is pid 1): each node still writes a file of its own, and merge reads both."""
    monkeypatch.setattr(recording.os, 'getpid', lambda: 1)
    a, b = Recorder(path, 'worker'), Recorder(path, 'worker')
    for rank, recorder in enumerate((a, b)):
        recorder.name_node(rank, f'worker {rank}')
        recorder.instant('here', 'membership')
        recorder.close()
    parts = merge.part_files([path])
    assert len(parts) == 2 and all('worker-' in str(p) and '-1-' in str(p) for p in parts)
    assert sorted(merge.read_part(p).events[0][1] for p in parts) == ['here', 'here']


def test_a_forked_child_leaves_the_recording_to_its_node(path):
    """A worker's os.fork() child (a data loader) that exits normally runs the atexit close
    of the Recorder it inherited: it must not write the node's buffered events again."""
    recorder = Recorder(path, 'worker')
    recorder.instant('before', 'x')
    pid = os.fork()
    if pid == 0:   # the child: what its exit would do, then gone without pytest's exit
        recorder.instant('in the child', 'x')
        recorder.close()
        os._exit(0)
    assert os.waitpid(pid, 0)[1] == 0
    recorder.close()
    part_path, = merge.part_files([path])
    assert [e[1] for e in merge.read_part(part_path).events] == ['before']


def test_the_buffer_is_bounded_and_says_what_it_lost(path):
    recorder = Recorder(path, 'worker', capacity=8)
    recorder._stop.set()   # no writer: the buffer fills
    recorder._writer.join()
    for i in range(100):
        recorder.instant(f'e{i}', 'x')
    assert len(recorder._events) == 8
    recorder.close()
    part = merge.read_part(merge.part_files([path])[0])
    assert [e[1] for e in part.events] == [f'e{i}' for i in range(92, 100)]
    assert part.dropped >= 92 - 1   # (the thread name took a place in the buffer too)


def test_clock_sample_is_the_middle_of_the_round_trip():
    assert clock_sample(100, 1_000_150, 200) == (1_000_000, 50)


def test_merge_names_nodes_aligns_clocks_and_links_a_round_in_causal_order(path):
    # The server's clock runs 5 ms behind and the worker's 3 ms ahead of the scheduler's: by
    # their own readings the update comes before the push that caused it.
    nodes = job(path, {'scheduler': 0, 'server 0': 5_000_000, 'worker 0': -3_000_000})
    flow = [['f', 0, 'w', 0, 0]]
    put(nodes['worker 0'], 'push', 'push', 13_000_000, 1_000_000, {'keys': 1}, flow)
    put(nodes['server 0'], 'update', 'update', 7_000_000, 500_000, None, flow)
    put(nodes['worker 0'], 'pull', 'pull', 16_000_000, 400_000, None, flow)
    put(nodes['scheduler'], 'barrier', 'barrier', 10_000_000, 10, None, None)
    for recorder in nodes.values():
        recorder.close()
    other = merge.merge([path], path)
    trace = json.loads(path.read_text())
    assert other['nodes'] == ['scheduler', 'server 0', 'worker 0']
    assert other['clock_error_us'] == pytest.approx(0.01)
    named = {e['args']['name'] for e in trace['traceEvents'] if e['name'] == 'process_name'}
    assert named == {'scheduler', 'server 0', 'worker 0'}
    spans = {e['name']: e for e in trace['traceEvents'] if e['ph'] == 'X'}
    assert spans['push']['ts'] < spans['update']['ts'] < spans['pull']['ts']
    arrows = sorted((e for e in trace['traceEvents'] if e['ph'] in 'stf'),
                    key=lambda e: e['ts'])
    assert [a['ph'] for a in arrows] == ['s', 't', 'f']
    assert len({a['id'] for a in arrows}) == 1


def test_nodes_on_the_schedulers_host_share_its_clock(path):
    """Linux's monotonic clock is the machine's: a reading's round trip only blurs it."""
    nodes = job(path, {'scheduler': 0, 'worker 0': 7_000_000},
                hosts={'scheduler': 'same', 'worker 0': 'same'})
    put(nodes['worker 0'], 'push', 'push', 5_000_000, 1000)
    put(nodes['scheduler'], 'barrier', 'barrier', 4_000_000, 1000)
    for recorder in nodes.values():
        recorder.close()
    other = merge.merge([path], path)
    spans = {e['name']: e for e in json.loads(path.read_text())['traceEvents'] if e['ph'] == 'X'}
    assert spans['push']['ts'] - spans['barrier']['ts'] == 1000.0   # µs, unmoved
    assert other['clock_error_us'] == 0


def test_summary_and_cli_read_a_merged_trace(path, capsys):
    nodes = job(path, {'scheduler': 0, 'server 0': 0, 'worker 0': 0})
    worker, server = nodes['worker 0'], nodes['server 0']
    for step in range(3):
        base = step * 10_000_000
        flow = [['f', 0, 'w', 0, step]]
        put(worker, 'step', 'step', base, 6_000_000)
        put(worker, 'push', 'push', base + 1_000_000, 1_000_000,
            {'shm': 4_000_000}, flow)
        put(server, 'update', 'update', base + 2_000_000, 2_000_000, None, flow)
        put(worker, 'pull', 'pull', base + 4_000_000, 2_000_000,
            {'socket': 4_000_000}, flow)
        put(worker, 'wait', 'wait', base + 4_000_000, 1_500_000)
    for recorder in nodes.values():
        recorder.close()
    assert cli.main(['merge', str(path), '-o', str(path)]) == 0
    assert cli.main(['summary', str(path)]) == 0
    text = capsys.readouterr().out
    assert '2 steps, 10.00 ms on average' in text
    # per step: 4 ms outside kvps spans (compute), 1 ms push, 1.5 ms wait, 0.5 ms pull
    assert 'compute 4.00 (40%)' in text and 'wait 1.50' in text and 'update 2.00' in text
    assert 'push/push' in text and 'update/update' in text and 'pull/pull' in text
    assert 'shm      push 12.0 MB' in text and 'socket   pull 12.0 MB' in text   # whole job


def test_a_paused_gap_is_no_step_of_the_summary(path):
    nodes = job(path, {'scheduler': 0, 'server 0': 0, 'worker 0': 0})
    worker = nodes['worker 0']
    for start in (0, 10_000_000, 20_000_000, 500_000_000, 510_000_000):
        put(worker, 'push', 'push', start, 1_000_000)
    worker._put(['i', 'pause', 'timeline', worker._tid(), 25_000_000, 0, None, None])
    put(worker, 'wait', 'wait', 2_000_000, 3_000_000)     # in a step
    put(worker, 'wait', 'wait', 30_000_000, 50_000_000)   # in the gap (a barrier's, say)
    for recorder in nodes.values():
        recorder.close()
    merge.merge([path], path)
    view = summary.Timeline(summary.load(path))
    assert sorted(b - a for periods in view.steps.values() for a, b in periods) == [
        10_000.0, 10_000.0, 10_000.0]   # us: the 480 ms while paused is not a step
    (row, each), = [(r, e) for r, e in view.per_step().items() if r[0] == 'worker']
    assert each['wait'] == pytest.approx(1.0)   # ms per step: 3 ms over 3 steps, not 53


@pytest.fixture
def started(path):
    """This process recording into ``path`` as a worker does (kvps.timeline's functions),
    and off again afterwards, SIGUSR2 as it was."""
    handler = signal.getsignal(signal.SIGUSR2)
    yield recording.start(path, 'worker')
    recording.stop()
    signal.signal(signal.SIGUSR2, handler)


def recorded(path):
    """Names of the spans and instants of the one part file at ``path``, and its node."""
    part = merge.read_part(merge.part_files([path])[0])
    return [e[1] for e in part.events], part.info


def test_pause_and_resume_keep_the_trace_to_a_window(path, started):
    with phase('before'):
        pass
    timeline.pause()
    assert not timeline.enabled() and recording.RECORDER is None
    with phase('while paused'):
        pass
    recording.name_node(3, 'worker 3')   # a node is named whenever it learns its rank
    timeline.pause()                     # (twice is once)
    timeline.resume()
    assert timeline.enabled()
    with phase('after'):
        pass
    recording.stop()   # a paused recorder is written and closed as well
    names, info = recorded(path)
    assert names == ['before', 'pause', 'resume', 'after']
    assert info['name'] == 'worker 3' and info['rank'] == 3


def test_sigusr2_toggles_a_nodes_recording(path, started):
    def toggled_to(state):
        os.kill(os.getpid(), signal.SIGUSR2)
        for _ in range(500):   # (the handler runs in this, the main thread, between bytecodes)
            if timeline.enabled() is state:
                return True
            time.sleep(0.01)
        return False
    assert toggled_to(False)
    assert toggled_to(True)
    recording.stop()
    assert recorded(path)[0] == ['pause', 'resume']


def test_a_programs_own_sigusr2_handler_is_kept(path):
    def mine(signum, frame):
        pass
    before = signal.signal(signal.SIGUSR2, mine)
    try:
        recording.start(path, 'worker')
        assert signal.getsignal(signal.SIGUSR2) is mine
    finally:
        recording.stop()
        signal.signal(signal.SIGUSR2, before)


def test_merge_of_nothing_says_so(tmp_path, capsys):
    assert cli.main(['merge', str(tmp_path), '-o', str(tmp_path / 'out.json')]) == 1
    assert 'no timeline part files' in capsys.readouterr().err


def test_plot_draws_a_step(path, tmp_path):
    pytest.importorskip('matplotlib')
    nodes = job(path, {'scheduler': 0, 'worker 0': 0})
    for step in range(2):
        put(nodes['worker 0'], 'step', 'step', step * 1_000_000, 500_000)
    for recorder in nodes.values():
        recorder.close()
    merge.merge([path], path)
    from kvps.timeline.plot import plot
    plot(summary.load(path), tmp_path / 'step.png')
    assert (tmp_path / 'step.png').read_bytes()[:4] == b'\x89PNG'


def test_stats_lines_give_rates_since_the_last_line():
    import io
    from kvps.timeline.counters import Ticker
    counts = {'messages': 0, 'pushed_shm_bytes': 0}
    out = io.StringIO()
    ticker = Ticker(2.0, 'worker 0', lambda: (dict(counts), {'in_flight': 3}), out)
    ticker.tick(10.0)                      # the first tick only starts the clock
    counts.update(messages=50, pushed_shm_bytes=8_000_000)
    ticker.tick(11.0)                      # not yet due
    assert out.getvalue() == ''
    ticker.tick(12.0)
    assert out.getvalue() == ('kvps stats worker 0: messages 25.0/s, pushed_shm 4.0 MB/s, '
                              'in_flight 3\n')
    Ticker(0, 'off', None, out).tick(99.0)   # 0 seconds: never a line (and nothing read)


class _Blocked:
    """A stream whose writes block until ``go`` is set (a pipe nobody reads)."""

    def __init__(self):
        self.go, self.writing, self.text = threading.Event(), threading.Event(), []

    def write(self, text):
        self.writing.set()
        self.go.wait(10)
        self.text.append(text)

    def flush(self):
        pass


def test_lines_to_a_blocked_stderr_never_block_the_writer_and_say_what_they_dropped():
    from kvps.timeline import stderr
    stream = _Blocked()
    lines = stderr.Lines(stream)
    lines.write('first\n')
    assert stream.writing.wait(5)          # the thread is stuck in that write
    for n in range(stderr.MOST_WAITING + 5):   # each returns at once: 5 of them find no room
        lines.write(f'{n}\n')
    assert not lines.drain(0.1)            # (still waiting)
    stream.go.set()
    assert lines.drain(5)
    written = ''.join(stream.text).splitlines()
    assert written[:2] == ['first', 'kvps: 5 line(s) to stderr dropped while it was not read']
    assert written[2:] == [str(n) for n in range(stderr.MOST_WAITING)]
    lines.write('later\n')                 # the thread goes on
    assert lines.drain(5) and stream.text[-1] == 'later\n'


def test_a_local_store_counts_its_calls():
    import numpy as np
    import kvps
    kv = kvps.create('local')
    kv.init(0, np.zeros(4, np.float32))
    for _ in range(3):
        kv.push(0, np.ones(4, np.float32))
    kv.pull(0, out=np.zeros(4, np.float32))
    stats = kv.stats()
    assert stats['push_calls'] == 3 and stats['pull_calls'] == 1 and stats['rounds'] == 3
    assert stats['pushed_bytes'] == {'shm': 0, 'socket': 0, 'ipc': 0}
    assert stats['in_flight_requests'] == 0
