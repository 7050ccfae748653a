"""A server lost during a job rejoins with its rank and resumes from its checkpoint: by the
launcher's --restart-servers, or by hand; without a replacement the job ends naming it."""

import os
import signal
import sys

import pytest


# KVPS_CHECKPOINT_EVERY=1: every acknowledged update is in the checkpoint, so a restart loses
# nothing and the values below are exact. Keys 'big' and 'huge' are split over both servers;
# huge's parts travel through shared memory, and the requests a lost server left unanswered
# are resent to its replacement (which has not mapped the segment) as data frames; then the
# replacement maps each worker's segment (through /proc: its name is long gone) and offers its
# own arena, and payloads go through shared memory again.
RECOVERY = {'KVPS_CHECKPOINT_EVERY': '1', 'KVPS_BIGARRAY_BOUND': '100'}

# Each worker pushes gradients that depend on (rank, step); rank 0 kills server 1 with SIGKILL
# right after its push of step KILL_AT, mid-round. The expected weights come from a local
# store fed the same per-round sums (sync) or the same pushes (async), in this process.
# VALUE(array), TO_HOST(value): what is pushed and pulled into, and its host copy (GPU values
# in test_ipc_route_cluster.py and test_gpu_jobs.py); ``at_after``: where huge's part in this
# worker's last push to server 1 lay (None: a frame).
TRAIN = '''
import signal
from kvps.optimizer import create as optimizer
MODE, STEPS, KILL_AT = os.environ['MODE'], 12, 5
SYNC = 'async' not in MODE
SHAPES = {'small': (3,), 'big': (10, 30), 'huge': (300, 1000)}   # huge: in shared memory
value, host = globals().get('VALUE', lambda a: a), globals().get('TO_HOST', np.asarray)

def grad(key, rank, step):
    base = np.arange(np.prod(SHAPES[key]), dtype=np.float32).reshape(SHAPES[key])
    return (base % 7 + rank + 1) * (step + 1) / 8

def kill_server(kv, rank):
    pid = next(n['pid'] for n in kv._backend.io.welcome['nodes']
               if n['role'] == 'server' and n['rank'] == rank)
    os.kill(pid, signal.SIGKILL)

def zeros():
    return [value(np.zeros(s, dtype=np.float32)) for s in SHAPES.values()]

kv = kvps.create(MODE)
io = kv._backend.io
last_push_at = {}    # server -> where huge's part in this worker's last push to it lay
submit = io.submit
def noting_submit(node, header, buffers, request):
    for item in header['keys'] if header['op'] == 'push' else ():
        if item.key == 'huge':
            last_push_at[node] = item.at
    submit(node, header, buffers, request)
io.submit = noting_submit
spec = optimizer('sgd', learning_rate=0.1, momentum=0.9) if SYNC else optimizer('test')
kv.init(list(SHAPES), [value(np.ones(s, dtype=np.float32)) for s in SHAPES.values()])
kv.set_optimizer(spec)
for step in range(STEPS):
    kv.push(list(SHAPES), [value(grad(k, kv.rank, step)) for k in SHAPES])
    if step == KILL_AT and kv.rank == 0:
        kill_server(kv, 1)
    if SYNC:
        kv.pull(list(SHAPES), out=zeros())
kv.barrier()
outs = zeros()
kv.pull(list(SHAPES), out=outs)

local = kvps.create('local')
local.init(list(SHAPES), [np.ones(s, dtype=np.float32) for s in SHAPES.values()])
local.set_optimizer(spec)
for step in range(STEPS):
    for rank in [None] if SYNC else range(kv.num_workers):
        grads = [grad(k, rank, step) if rank is not None else
                 sum(grad(k, r, step) for r in range(kv.num_workers)) for k in SHAPES]
        local.push(list(SHAPES), grads)
want = [np.zeros(s, dtype=np.float32) for s in SHAPES.values()]
local.pull(list(SHAPES), out=want)
staging = io.staging
report(exact=all(np.array_equal(host(o), w) for o, w in zip(outs, want)),
       diff=max(float(np.abs(host(o) - w).max()) for o, w in zip(outs, want)),
       remapped='server 1' in staging.attached and 'server 1' in staging.arenas,
       device_remapped=staging.device is not None and 'server 1' in staging.device.attached,
       at_after=last_push_at['server 1'] if SYNC else -1)
'''


@pytest.mark.parametrize('mode', ['dist_sync', 'dist_async'])
def test_a_killed_server_is_restarted_and_no_update_is_lost_or_doubled(job, tmp_path, mode):
    env = {**RECOVERY, 'MODE': mode, 'KVPS_CHECKPOINT_DIR': str(tmp_path / 'ckpt')}
    result = job(TRAIN, workers=2, servers=2, env=env, launcher_args=['--restart-servers', '1'])
    assert result.returncode == 0, result.output
    assert 'server 1' in result.stderr and 'restarting it' in result.stderr
    assert 'rejoined' in result.output
    # After the rejoin the replacement mapped both workers' segments and they map its arena;
    # in sync mode the pushes after it (each step waits for its pull) went through them.
    assert sorted(result.results()) == [0, 1]
    for report in result.results().values():
        assert report['exact'] and report['diff'] == 0.0 and report['remapped'], report
        assert report['at_after'] is not None, report   # (-1 in async: not asked)


@pytest.mark.parametrize('mode', ['dist_sync', 'dist_async'])
def test_pushes_held_back_when_the_server_is_restarted_are_applied_once(job, tmp_path, mode):
    """The launcher restarts a killed server before the scheduler declares it lost, while the
    workers go on pushing through the socket: zmq takes nothing for the dead server, so the
    workers hold their later pushes (KVPS_SOCKET_QUEUE). Every push numbered then, held or
    queued, counts as unanswered in the RESUME and reaches the replacement: none is taken
    for acknowledged and dropped, none applied twice."""
    script = """
    import signal
    SYNC = 'async' not in os.environ['MODE']
    SHAPES = {'a': (5,), 'b': (40, 30), 'c': (200, 300)}
    kv = kvps.create(os.environ['MODE'])
    kv.init(list(SHAPES), [np.ones(s, np.float32) for s in SHAPES.values()])
    kv.set_optimizer(kvps.optimizer.create('test'))   # w += each push (sync: each round's sum)
    for step in range(120):
        kv.push(list(SHAPES), [np.full(s, (kv.rank + 1) * (step + 1), np.float32)
                               for s in SHAPES.values()])
        if step == 30 and kv.rank == 0:
            os.kill(next(n['pid'] for n in kv._backend.io.welcome['nodes']
                         if n['role'] == 'server'), signal.SIGKILL)
    kv.barrier()
    outs = [np.zeros(s, np.float32) for s in SHAPES.values()]
    kv.pull(list(SHAPES), out=outs)
    want = 1 + sum((r + 1) * (s + 1) for r in range(kv.num_workers) for s in range(120))
    report(got=sorted({float(v) for o in outs for v in o.ravel()}), want=want,
           held=kv.stats()['held'])
    """
    env = {**RECOVERY, 'MODE': mode, 'KVPS_CHECKPOINT_DIR': str(tmp_path / 'ckpt'),
           'KVPS_SHM': '0', 'KVPS_SOCKET_QUEUE': str(64 << 10)}
    result = job(script, workers=2, servers=1, env=env, launcher_args=['--restart-servers', '1'])
    assert result.returncode == 0, result.output
    assert 'restarting it' in result.stderr and 'rejoined' in result.output
    reports = result.results()
    assert sorted(reports) == [0, 1], result.output
    for report in reports.values():
        assert report['got'] == [report['want']], report
    assert any(report['held'] for report in reports.values()), reports   # (the case at stake)


def test_a_worker_with_many_long_keys_on_the_restarted_server_resumes_them_all(job, tmp_path):
    """1500 keys of 1000-character names: every push, pull and answer lists them in several
    messages (one would exceed the header limit), and so does the worker's RESUME to the
    replacement (1.5 MB of its counts)."""
    script = """
    import signal
    KEYS = [f'{i:04}' + 'k' * 1000 for i in range(1500)]
    kv = kvps.create('dist_sync')
    kv.init(KEYS, [np.full(2, i, np.float32) for i in range(len(KEYS))])
    kv.set_optimizer(kvps.optimizer.create('test'))   # w += sum of the round's pushes
    outs = [np.zeros(2, np.float32) for _ in KEYS]
    for step in range(3):
        kv.push(KEYS, [np.ones(2, np.float32)] * len(KEYS))
        if step == 1 and kv.rank == 0:
            pid = next(n['pid'] for n in kv._backend.io.welcome['nodes'] if n['role'] == 'server')
            os.kill(pid, signal.SIGKILL)
        kv.pull(KEYS, out=outs)
    want = [[i + 3.0 * kv.num_workers] * 2 for i in range(len(KEYS))]
    report(exact=[o.tolist() for o in outs] == want)
    """
    env = {**RECOVERY, 'KVPS_CHECKPOINT_DIR': str(tmp_path / 'ckpt')}
    result = job(script, workers=2, servers=1, env=env, launcher_args=['--restart-servers', '1'])
    assert result.returncode == 0, result.output
    assert 'rejoined' in result.output
    assert result.results() == {0: {'exact': True}, 1: {'exact': True}}, result.output


def test_restarts_are_bounded_by_the_launcher_option(job, tmp_path):
    script = """
    import signal
    killed = set()

    def kill_the_server():
        for pid in job_pids('server'):
            if pid not in killed:
                killed.add(pid)
                os.kill(pid, signal.SIGKILL)
                return

    kv = kvps.create('dist_sync')
    kv.init(0, np.zeros(2))
    for round in range(2):
        kill_the_server()
        kv.push(0, np.ones(2))
        kv.pull(0, out=np.zeros(2))
        print('SURVIVED', round, flush=True)
    """
    env = {**RECOVERY, 'KVPS_CHECKPOINT_DIR': str(tmp_path / 'ckpt')}
    result = job(script, workers=1, servers=1, env=env, launcher_args=['--restart-servers', '1'])
    assert 'SURVIVED 0' in result.stdout and 'SURVIVED 1' not in result.stdout
    assert result.stderr.count('restarting it') == 1
    assert result.returncode != 0 and 'server 0' in result.stderr and 'failed first' in result.stderr


@pytest.mark.parametrize('shm', ['1', '0'])
def test_a_server_woken_after_the_job_took_it_for_lost_gives_way_to_its_replacement(
        job, tmp_path, shm):
    """Stopped past the heartbeat timeout (a paused VM, a swap storm), then woken: the job has
    taken it for lost and waits for a replacement. The workers take no answer of it (one lent
    from its arena crashed them), the scheduler tells it to go, it exits without writing its
    checkpoint, the launcher starts its replacement, and nothing is lost or doubled."""
    script = """
    import signal, threading
    kv = kvps.create('dist_sync')
    kv.init('w', np.zeros(1000, np.float32))   # 4 KB: pulls answered from the server's arena
    kv.set_optimizer(kvps.optimizer.create('test'))
    out = np.zeros(1000, np.float32)
    for step in range(6):
        kv.push('w', np.ones(1000, np.float32))
        if step == 2 and kv.rank == 0:
            pid, = job_pids('server')
            os.kill(pid, signal.SIGSTOP)
            threading.Timer(4, os.kill, (pid, signal.SIGCONT)).start()
        kv.pull('w', out=out)
    report(value=sorted(set(out.tolist())))
    """
    env = {**RECOVERY, 'KVPS_CHECKPOINT_DIR': str(tmp_path / 'ckpt'), 'KVPS_SHM': shm,
           'KVPS_HEARTBEAT_TIMEOUT': '2'}
    result = job(script, workers=2, servers=1, env=env, launcher_args=['--restart-servers', '1'])
    assert result.returncode == 0, result.output
    assert 'so the job took it for lost and waits for its replacement' in result.output
    assert 'failed: exit code 1; restarting it' in result.stderr
    assert result.results() == {0: {'value': [12.0]}, 1: {'value': [12.0]}}, result.output


def test_a_server_lost_before_its_first_change_is_replaced_too(job, tmp_path):
    """Every server writes its file as it joins, before anything changes: one killed then
    (here before any init reached it) has a replacement that finds the file, where it found
    none and ended the job."""
    script = """
    import signal
    kv = kvps.create('dist_sync')
    if kv.rank == 0:
        path = os.path.join(os.environ['KVPS_CHECKPOINT_DIR'], 'server-0-of-1.kvps')
        deadline = time.monotonic() + 30
        while not os.path.exists(path) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert os.path.exists(path), 'the server wrote no file as it joined'
        os.kill(next(n['pid'] for n in kv._backend.io.welcome['nodes']
                     if n['role'] == 'server'), signal.SIGKILL)
    kv.init('a', np.zeros(3, np.float32))
    kv.set_optimizer(kvps.optimizer.create('test'))
    out = np.zeros(3, np.float32)
    for step in range(3):
        kv.push('a', np.ones(3, np.float32))
        kv.pull('a', out=out)
    report(value=out.tolist())
    """
    env = {**RECOVERY, 'KVPS_CHECKPOINT_DIR': str(tmp_path / 'ckpt')}
    result = job(script, workers=2, servers=1, env=env, launcher_args=['--restart-servers', '1'])
    assert result.returncode == 0, result.output
    assert 'restarting it' in result.stderr and 'rejoined' in result.output
    assert result.results() == {0: {'value': [6.0] * 3}, 1: {'value': [6.0] * 3}}


def test_a_server_lost_as_the_workers_finish_ends_nothing(job, tmp_path):
    """Every round done, a server dies as the workers exit: the launcher restarts it, but the
    job ends (every worker finished) before the replacement can rejoin. The replacement is
    stopped after the grace, not waited for until a timeout, and the job succeeds."""
    script = """
    import signal
    kv = kvps.create('dist_sync')
    kv.init(0, np.zeros(4, np.float32))
    kv.set_optimizer(kvps.optimizer.create('test'))
    for step in range(10):
        kv.push(0, np.ones(4, np.float32))
    kv.barrier()
    out = np.zeros(4, np.float32)
    kv.pull(0, out=out)
    report(value=out.tolist())
    kv.barrier()
    if kv.rank == 0:
        os.kill(next(n['pid'] for n in kv._backend.io.welcome['nodes']
                     if n['role'] == 'server'), signal.SIGKILL)
    """
    env = {**RECOVERY, 'KVPS_CHECKPOINT_DIR': str(tmp_path / 'ckpt')}
    result = job(script, workers=2, servers=1, env=env,
                 launcher_args=['--restart-servers', '1', '--timeout', '60'], timeout=50,
                 ends_when='the job ends with its workers')
    assert result.returncode == 0, result.output
    assert result.results() == {0: {'value': [20.0] * 4}, 1: {'value': [20.0] * 4}}
    if 'restarting it' in result.stderr:   # (else the job ended before the launcher saw it)
        assert 'was restarted as the job ended, which it can no longer join' in result.stderr


def test_restart_needs_a_checkpoint_directory(job):
    result = job('kv = kvps.create("dist_sync")\n', workers=1, servers=1,
                 launcher_args=['--restart-servers', '2'])
    assert result.returncode == 2
    assert 'KVPS_CHECKPOINT_DIR' in result.stderr


def test_restart_needs_a_checkpoint_written_during_the_job(job, tmp_path):
    # Without an interval the file holds only the inits: a restarted server would go back to
    # the initial weights, and every acknowledged update would be lost without a word.
    result = job('kv = kvps.create("dist_sync")\n', workers=1, servers=1,
                 env={'KVPS_CHECKPOINT_DIR': str(tmp_path / 'ckpt')},
                 launcher_args=['--restart-servers', '2'])
    assert result.returncode == 2
    assert 'KVPS_CHECKPOINT_EVERY=1' in result.stderr and 'lose every update' in result.stderr


HAND_TRAIN = '''
kv = kvps.create('dist_sync')
kv.init(0, np.zeros(4, dtype=np.float32))
print('READY', flush=True)
for step in range(int(os.environ['STEPS'])):
    kv.push(0, np.full(4, step + 1, dtype=np.float32))
    out = np.zeros(4, dtype=np.float32)
    kv.pull(0, out=out)
    if step == 2:
        print('WAITING', flush=True)
        while not os.path.exists(os.environ['GO']):
            time.sleep(0.05)
report(value=out.tolist())
'''


def _wait_for(proc, word):
    for line in proc.stdout:
        if word in line:
            return
    raise AssertionError(f'{word} never printed')


def _job_losing_server_1(by_hand, tmp_path, recovery_s, how=signal.SIGKILL, **extra):
    """A job started by hand, one worker and two servers (key 0 is split over both), whose
    server 1 is killed (signal ``how``) mid-training while the worker waits for the file
    ``go``. ``extra``: more settings of every node."""
    env = {'KVPS_RECOVERY_TIMEOUT': recovery_s, 'KVPS_CHECKPOINT_DIR': str(tmp_path / 'ckpt'),
           'KVPS_CHECKPOINT_EVERY': '1', 'KVPS_BIGARRAY_BOUND': '2', **extra}
    _, env = by_hand.scheduler(num_workers=1, num_servers=2, extra=env)
    servers = [by_hand('server', env, rank=i) for i in range(2)]
    go = tmp_path / 'go'
    worker = by_hand('worker', {**env, 'STEPS': '6', 'GO': str(go)}, script=HAND_TRAIN)
    _wait_for(worker, 'WAITING')
    os.kill(servers[1].pid, how)
    if how == signal.SIGKILL:
        servers[1].wait(10)
    return env, servers, worker, go


def test_a_server_restarted_by_hand_with_its_rank_rejoins(by_hand, tmp_path):
    env, servers, worker, go = _job_losing_server_1(by_hand, tmp_path, '60')
    replacement = by_hand('server', env, rank=1)
    go.touch()
    code, out = by_hand.finish(worker)
    assert code == 0, out
    assert '"value": [6.0, 6.0, 6.0, 6.0]' in out    # the last round replaces the value
    assert by_hand.finish(replacement)[0] == 0 and by_hand.finish(servers[0])[0] == 0


# A server that dies as it joins: welcomed into the job, gone before it wrote its checkpoint
# file (a kill in those milliseconds, made certain here). (Its role is taken from its settings:
# importing kvps as a server would serve.)
DIES_AS_IT_JOINS = '''
import os
os.environ.pop('DMLC_ROLE')
from kvps.config import Config
from kvps.wire.link import SchedulerLink
from kvps.wire.transport import new_context
SchedulerLink(new_context(), Config.from_env().require_cluster(), 'server').register(port=1)
os._exit(0)
'''


def test_a_server_lost_before_it_wrote_its_file_is_replaced_by_one_that_starts_empty(
        by_hand, tmp_path):
    """The scheduler hears from each server once it has written its file as it joined: the
    replacement of one lost before (which served nothing) starts empty, where it found no file
    and ended the job."""
    env = {'KVPS_RECOVERY_TIMEOUT': '60', 'KVPS_CHECKPOINT_DIR': str(tmp_path / 'ckpt'),
           'KVPS_CHECKPOINT_EVERY': '1'}
    _, env = by_hand.scheduler(num_workers=1, num_servers=1, extra=env)
    lost = by_hand('server', env, argv=[sys.executable, '-c', DIES_AS_IT_JOINS])
    worker = by_hand('worker', {**env, 'STEPS': '3', 'GO': str(tmp_path)}, script=HAND_TRAIN)
    assert by_hand.finish(lost)[0] == 0
    replacement = by_hand('server', env, rank=0)
    code, out = by_hand.finish(worker)
    assert code == 0, out
    assert '"value": [3.0, 3.0, 3.0, 3.0]' in out
    code, out = by_hand.finish(replacement)
    assert code == 0 and 'it served nothing, and this one starts empty' in out, out


def test_a_server_replaced_while_it_lived_leaves_the_checkpoint_to_its_successor(
        by_hand, tmp_path):
    """Server 1 is stopped, and a replacement takes its rank before the job finds it lost;
    woken after the job, it serves what was queued for it, but finds (by the scheduler, or
    by its file, which its successor wrote) that it was replaced, and exits 0 without writing
    its stale checkpoint over its successor's."""
    env, servers, worker, go = _job_losing_server_1(by_hand, tmp_path, '60', signal.SIGSTOP)
    replacement = by_hand('server', env, rank=1)
    go.touch()
    code, out = by_hand.finish(worker)
    assert code == 0 and '"value": [6.0, 6.0, 6.0, 6.0]' in out, out
    assert by_hand.finish(replacement)[0] == 0 and by_hand.finish(servers[0])[0] == 0
    successors = (tmp_path / 'ckpt' / 'server-1-of-2.kvps').read_bytes()
    os.kill(servers[1].pid, signal.SIGCONT)
    code, out = by_hand.finish(servers[1])
    assert code == 0 and ('replaced by a server that rejoined with its rank' in out
                          or 'written by another server of this rank' in out), out
    assert (tmp_path / 'ckpt' / 'server-1-of-2.kvps').read_bytes() == successors


def test_a_lost_server_not_replaced_in_time_ends_the_job_naming_it(by_hand, tmp_path):
    _, servers, worker, go = _job_losing_server_1(by_hand, tmp_path, '2')
    go.touch()
    code, out = by_hand.finish(worker)
    assert code != 0
    assert 'server 1' in out and 'not replaced within 2 s' in out
    assert servers[0].wait(30) != 0


def test_a_call_that_times_out_waiting_for_a_lost_server_says_the_job_waits_for_it(
        by_hand, tmp_path):
    """KVPS_TIMEOUT shorter than the wait for a replacement: the worker's call times out
    naming the lost server the job waits for, not a round some worker did not push into."""
    _, _, worker, go = _job_losing_server_1(by_hand, tmp_path, '60', KVPS_TIMEOUT='5',
                                            KVPS_HEARTBEAT_TIMEOUT='2')
    go.touch()
    code, out = by_hand.finish(worker)
    assert code != 0 and 'RequestTimeout' in out, out
    assert ('the job lost server 1 and waits for a replacement (KVPS_RECOVERY_TIMEOUT, here '
            'longer than KVPS_TIMEOUT)') in out, out
    assert 'is some worker not pushing' not in out


def test_a_rejoining_server_without_the_lost_ones_checkpoint_ends_the_job_saying_so(
        by_hand, tmp_path):
    # Say, restarted on another host whose directory is not shared: serving from the initial
    # weights would lose every acknowledged update.
    env, _, worker, go = _job_losing_server_1(by_hand, tmp_path, '60')
    replacement = by_hand('server', {**env, 'KVPS_CHECKPOINT_DIR': str(tmp_path / 'empty')},
                          rank=1)
    go.touch()
    code, out = by_hand.finish(worker)
    assert code != 0 and 'server 1' in out and 'finds no checkpoint' in out, out
    assert by_hand.finish(replacement)[0] != 0


def test_a_server_that_cannot_start_serving_ends_the_job_with_its_reason(by_hand, tmp_path):
    # It registered, then failed (here: the job waits for lost servers, and this one has no
    # checkpoint directory): the others learn why at once, not as a lost heartbeat later.
    _, env = by_hand.scheduler(num_workers=1, num_servers=1,
                               extra={'KVPS_RECOVERY_TIMEOUT': '60'})
    server = by_hand('server', env)
    worker = by_hand('worker', env, script='kvps.create("dist_sync")\n')
    code, out = by_hand.finish(worker)
    assert code != 0 and 'server 0' in out and 'failed' in out, out
    assert 'KVPS_CHECKPOINT_DIR' in out and 'no heartbeat' not in out, out
    assert by_hand.finish(server)[0] != 0
