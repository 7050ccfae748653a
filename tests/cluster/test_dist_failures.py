"""Clear errors on the caller, dead and missing peers, and hand-started clusters."""

import glob
import importlib.util
import json
import os
import re
import signal
import time

import pytest


pytestmark = [pytest.mark.cluster, pytest.mark.timeout(180)]


# Records the kvps error each call raises, by name.
EXPECT = '''
from kvps.errors import *
errors = {}
def expect(name, fn):
    try:
        fn()
    except KVPSError as exc:
        errors[name] = type(exc).__name__
'''

ERRORS_SCRIPT = EXPECT + '''
kv = kvps.create('dist_sync')
r = kv.rank
kv.init(0, np.zeros(4, np.float32))
expect('duplicate', lambda: kv.init(0, np.zeros(4, np.float32)))
expect('pull_before_init', lambda: kv.pull(5, out=np.zeros(4, np.float32)))
expect('push_before_init', lambda: kv.push(5, np.zeros(4, np.float32)))
expect('shape', lambda: kv.push(0, np.zeros(5, np.float32)))
expect('dtype', lambda: kv.push(0, np.zeros(4, np.float64)))
expect('key_kind', lambda: kv.push('zero', np.zeros(4, np.float32)))
# A worker whose value disagrees with rank 0's shape is told so at init.
expect('init_mismatch', lambda: kv.init(1, np.zeros(3 if r == 0 else 6, np.float32)))
# The servers still serve: a full round works afterwards.
kv.push(0, np.full(4, r + 1.0, np.float32))
out = np.zeros(4, np.float32); kv.pull(0, out=out)
report(rank=r, errors=errors, after=out.tolist())
'''


def test_bad_calls_raise_clear_errors_and_servers_keep_serving(job):
    result = job(ERRORS_SCRIPT, 2, 2)
    assert result.returncode == 0, result.output
    for rank, res in result.results().items():
        expected = {'duplicate': 'DuplicateInitError', 'pull_before_init':
                    'KeyNotInitializedError', 'push_before_init': 'KeyNotInitializedError',
                    'shape': 'ShapeError', 'dtype': 'DTypeError', 'key_kind': 'KeyTypeError'}
        if rank == 1:
            expected['init_mismatch'] = 'ShapeError'
        assert res['errors'] == expected
        assert res['after'] == [3.0] * 4


REFUSALS_SCRIPT = EXPECT + '''
kv = kvps.create(os.environ['STORE'])
r = kv.rank
kv.init([0, 1], [np.zeros(4, np.float32), np.zeros((0, 3), np.float32)])
# The servers refuse what is sent: every rank is told, and barriers stay in step.
expect('refused_optimizer', lambda: kv.set_optimizer({'name': 'no_such_optimizer'}))
saver = kvps.create('local')          # states without their optimizer, which servers lack
saver.init(0, np.zeros(4, np.float32))
saver.set_optimizer(kvps.optimizer.create('sgd', momentum=0.9))
saver.push(0, np.ones(4, np.float32))
saver.save_optimizer_states(f'states{r}')
expect('refused_states', lambda: kv.load_optimizer_states(f'states{r}'))
kv.barrier()
expect('big_key', lambda: kv.init(2 ** 64, np.zeros(1)))
# A second store of this process shares the job's keys.
again = kvps.create(os.environ['STORE'])
expect('init_again', lambda: again.init(0, np.zeros(4, np.float32)))
kv.set_optimizer(kvps.optimizer.create('adam', learning_rate=0.5))
# A size-0 key (a zero-width layer) updates alongside the others in one message.
again.push([0, 1], [np.ones(4, np.float32), np.zeros((0, 3), np.float32)])
kv.barrier()
out = np.zeros(4, np.float32); again.pull(0, out=out)
kv.close()
expect('push_closed', lambda: again.push(0, out))
expect('pull_closed', lambda: kv.pull(0, out=out))
expect('create_closed', lambda: kvps.create(os.environ['STORE']))
report(rank=r, errors=errors, after=out.tolist())
'''


@pytest.mark.parametrize('store', ['dist_sync', 'dist_async'])
def test_refusals_reach_every_rank_and_a_closed_store_says_so(job, store):
    result = job(REFUSALS_SCRIPT, 2, 1, env={'STORE': store})
    assert result.returncode == 0, result.output
    results = result.results()
    assert sorted(results) == [0, 1]
    for rank, res in results.items():
        # an optimizer that is not kvps's own is checked by every rank with the servers, so
        # each raises their ConfigError; a refused load: rank 0 raises the servers' own error,
        # the others hear of it
        assert res['errors'] == {
            'refused_optimizer': 'ConfigError',
            'refused_states': 'ConfigError' if rank == 0 else 'RemoteError',
            'big_key': 'KeyTypeError',
            'init_again': 'DuplicateInitError', 'push_closed': 'StoreClosedError',
            'pull_closed': 'StoreClosedError', 'create_closed': 'StoreClosedError'}
        # each adam step moves every element by about lr, whatever the gradient's size: one
        # step for the sync round's sum, one per push in async
        steps = 1 if store == 'dist_sync' else 2
        assert res['after'] == pytest.approx([-0.5 * steps] * 4, rel=1e-5)


CAUGHT_BARRIER_SCRIPT = '''
kv = kvps.create('dist_sync')
kv.init(0, np.zeros(2))
if kv.rank == 1:
    try:
        kv.barrier()                      # rank 0 has left: this barrier can never complete
    except kvps.KVPSError as exc:
        report(caught=str(exc))
'''


def test_a_worker_that_catches_a_failed_barrier_still_leaves_the_job_cleanly(job):
    result = job(CAUGHT_BARRIER_SCRIPT, 2, 1)
    assert result.returncode == 0, result.output
    assert 'can never complete' in result.results()[1]['caught']


KILLED_SCRIPT = '''
kv = kvps.create('dist_sync')
kv.init(0, np.zeros(2))
for step in range(1000):
    if kv.rank == 1 and step == 3:
        os.kill(os.getpid(), 9)          # dies mid-run without a word
    kv.push(0, np.ones(2))
    kv.pull(0, out=np.zeros(2))
'''


def test_worker_killed_mid_run_ends_the_job_with_a_clear_error(job):
    # FAST's KVPS_TIMEOUT is 60 s: the job must end on the death itself, not on a timeout
    result = job(KILLED_SCRIPT, 2, 1, timeout=45,
                 ends_when='the launcher stops the job when worker 1 dies')
    assert result.returncode == 128 + signal.SIGKILL
    assert 'worker 1' in result.stderr and 'failed first' in result.stderr
    assert 'SIGKILL' in result.stderr


def test_worker_error_exit_code_is_the_jobs(job):
    result = job('kv = kvps.create("dist_sync")\nraise SystemExit(3)\n', 2, 1)
    assert result.returncode == 3
    assert 'failed first: exit code 3' in result.stderr


def test_a_job_whose_workers_never_join_ends_when_they_do(job):
    """A script that makes no distributed store: the launcher stops the scheduler and
    servers at once (not after KVPS_CONNECT_TIMEOUT, blaming a server); one whose workers
    joined finishes without that word."""
    never = job('report(local=kvps.create("local").type)', 2, 1, timeout=60,
                env={'KVPS_CONNECT_TIMEOUT': '120'},
                ends_when='the launcher stops the scheduler and servers once the workers have '
                          'exited, not after KVPS_CONNECT_TIMEOUT (120 s)')
    assert never.returncode == 0, never.output
    assert 'no worker joined the job' in never.stderr and len(never.results()) == 2
    joined = job('kv = kvps.create("dist_sync")\nreport(rank=kv.rank)', 2, 1)
    assert joined.returncode == 0 and 'joined' not in joined.stderr, joined.output


def test_a_worker_whose_job_wide_settings_differ_is_refused_at_registration(job):
    # else its keys are placed where no server holds them: 'not initialized' errors later
    result = job('if os.environ["KVPS_RANK"] == "1":\n'
                 '    os.environ["KVPS_BIGARRAY_BOUND"] = "1000"\n'
                 'kvps.create("dist_sync")\n', 2, 2)
    assert result.returncode == 1 and 'failed first' in result.stderr
    # whichever registered second is refused, naming both values
    assert re.search(r'ConfigError: KVPS_BIGARRAY_BOUND=(1000|1000000) here, but '
                     r'KVPS_BIGARRAY_BOUND=(1000000|1000) on the worker pid \d+ that joined first',
                     result.stderr), result.stderr


ONE_SIDED_SCRIPT = '''
kv = kvps.create('dist_sync')
kv.init(1, np.zeros(4, np.float32))
if kv.rank == 0:
    kv.push(1, np.ones(4, np.float32))   # rank 1 never pushes key 1: its round stays open
try:
    kv.barrier()
except kvps.KVPSError as exc:
    report(rank=kv.rank, type=type(exc).__name__, message=str(exc))
if kv.rank == 1:
    open('reported', 'w').close()
else:   # leave after rank 1's barrier timed out: its leaving would end that barrier
    while not os.path.exists('reported'):
        time.sleep(0.05)
'''


def test_a_round_some_worker_never_pushes_times_out_saying_why(job):
    result = job(ONE_SIDED_SCRIPT, 2, 1, env={'KVPS_TIMEOUT': '3'})
    assert sorted(result.results()) == [0, 1], result.output   # the open round fails at exit
    pusher, other = result.results()[0], result.results()[1]
    assert pusher['type'] == other['type'] == 'RequestTimeout'
    assert pusher['message'].startswith('push of key 1: no answer from server 0 within 3 s')
    assert 'once every worker has pushed that key in the round' in pusher['message']
    assert other['message'].startswith('barrier: no answer from scheduler within 3 s')
    assert 'every worker has called it' in other['message']


def test_a_close_that_cannot_flush_ends_the_job_at_once_with_its_reason(job):
    """Worker 1 pushes once more than worker 0, which finishes: worker 1's close() raises, and
    its script catches that and ends normally. The job ends with that reason, naming worker
    1, not when the others find it silent."""
    script = '''
    kv = kvps.create('dist_sync')
    kv.init(0, np.zeros(4, np.float32))
    for _ in range(kv.rank + 1):
        kv.push(0, np.ones(4, np.float32))
    try:
        kv.close()
    except kvps.KVPSError as exc:
        report(close=str(exc))
    '''
    result = job(script, 2, 1)
    assert result.returncode != 0, result.output
    assert result.results()[1]['close'].startswith('a sync round of key 0 can never complete')
    assert re.search(r'^kvps.launch: worker 1 \(pid \d+\) failed first: the scheduler ended the '
                     r'job: worker 1 .* failed: could not finish: a sync round of key 0 can never '
                     r'complete', result.stderr, re.M), result.stderr


RAISING_SCRIPT = '''
kv = kvps.create('dist_sync')
kv.init(0, np.zeros(2))
for step in range(1000):
    if kv.rank == 1 and step == 3:
        print('worker 1 leaves', flush=True)
        raise RuntimeError('boom in worker 1') if os.environ['HOW'] == 'raise' else SystemExit(3)
    kv.push(0, np.ones(2))
    kv.pull(0, out=np.zeros(2))
'''


@pytest.mark.parametrize('how, code', [('raise', 1), ('exit', 3)])
def test_a_worker_that_fails_is_the_one_blamed(job, how, code):
    # Its peers' rounds, which it can never join, must not fail before its own exit reaches
    # the launcher, which names whoever exits first with an error. A raising worker leaves
    # without finishing; sys.exit(3) finishes cleanly (atexit cannot see the code), and the
    # scheduler holds a FINISH back a moment before acting on it.
    for _ in range(2):
        result = job(RAISING_SCRIPT, 2, 1, env={'HOW': how})
        assert result.returncode == code
        assert 'worker 1 (pid' in result.stderr and 'failed first' in result.stderr, \
            result.stderr
        assert ('boom in worker 1' if how == 'raise' else 'worker 1 leaves') in result.stderr


def test_missing_server_is_named_within_the_connect_bound(by_hand, tmp_path):
    # The scheduler's 3 s bound starts with it: the worker is up before it and joins once told
    # the port, else a worker slow to start on a loaded box came after the scheduler had
    # given up, and timed out on its own without hearing why.
    port = tmp_path / 'port'
    bound = {'KVPS_CONNECT_TIMEOUT': '3'}
    worker = by_hand('worker', {'DMLC_PS_ROOT_URI': '127.0.0.1', 'DMLC_NUM_WORKER': '1',
                                'DMLC_NUM_SERVER': '1', 'PORT': str(port), **bound}, script='''
        print('READY', flush=True)
        while not os.path.exists(os.environ['PORT']):
            time.sleep(0.01)
        os.environ['DMLC_PS_ROOT_PORT'] = open(os.environ['PORT']).read()
        kvps.create("dist_sync")
    ''')
    _wait_ready(worker)
    _, env = by_hand.scheduler(num_workers=1, num_servers=1, extra=bound)
    (tmp_path / 'port.tmp').write_text(env['DMLC_PS_ROOT_PORT'])
    (tmp_path / 'port.tmp').replace(port)
    code, out = by_hand.finish(worker)
    assert code != 0
    assert '1 of 1 servers never registered' in out


def test_a_worker_started_with_another_job_size_is_refused_naming_it(by_hand):
    # else it waited out KVPS_CONNECT_TIMEOUT and heard only that a worker never registered
    _, env = by_hand.scheduler(num_workers=2, num_servers=1)
    worker = by_hand('worker', {**env, 'DMLC_NUM_WORKER': '1'},
                     script='kvps.create("dist_sync")\n')
    code, out = by_hand.finish(worker)
    assert code != 0
    assert 'ConfigError: DMLC_NUM_WORKER=1 here, but DMLC_NUM_WORKER=2 on the scheduler' in out, \
        out


def test_a_port_file_that_cannot_be_written_is_named(by_hand, tmp_path):
    # else a FileNotFoundError traceback named only a temporary file beside it
    scheduler = by_hand('scheduler', {
        'DMLC_PS_ROOT_URI': '127.0.0.1', 'DMLC_PS_ROOT_PORT': '0', 'DMLC_NUM_WORKER': '1',
        'DMLC_NUM_SERVER': '1', 'KVPS_PORT_FILE': str(tmp_path / 'no_such_dir' / 'port')})
    code, out = by_hand.finish(scheduler)
    assert code == 1 and 'Traceback' not in out, out
    assert re.search(r"scheduler failed: KVPS_PORT_FILE='[^']*no_such_dir/port': cannot write "
                     r"the scheduler's port there: .*No such file", out), out


def test_absent_scheduler_is_a_timeout_naming_it(by_hand):
    env = {'DMLC_PS_ROOT_URI': '127.0.0.1', 'DMLC_PS_ROOT_PORT': '9',  # nothing listens
           'DMLC_NUM_WORKER': '1', 'DMLC_NUM_SERVER': '1', 'KVPS_CONNECT_TIMEOUT': '2'}
    worker = by_hand('worker', env, script='kvps.create("dist_sync")\n')
    code, out = by_hand.finish(worker)
    assert code != 0 and 'RequestTimeout' in out and '127.0.0.1:9' in out


@pytest.mark.parametrize('signum', [signal.SIGTERM, signal.SIGHUP])
def test_a_server_ended_by_a_signal_leaves_no_shared_memory(by_hand, signum):
    # What Slurm, a dropped ssh session or the ssh recipe's cleanup send: the server's arena
    # (256 MiB, named until every local worker has pulled once) must not outlive it.
    _, env = by_hand.scheduler(num_workers=1, num_servers=1)
    server = by_hand('server', env)
    worker = by_hand('worker', env, script="""
kv = kvps.create('dist_sync')
kv.init(0, np.zeros(2))
print('READY', flush=True)
time.sleep(120)
""")
    _wait_ready(worker)
    arena = f'/dev/shm/kvps-{server.pid}-*'
    deadline = time.monotonic() + 30
    while not glob.glob(arena) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert glob.glob(arena), 'the server made no arena'
    server.send_signal(signum)
    assert server.wait(30) == 128 + signum
    assert glob.glob(arena) == []


LONG_SCRIPT = '''
from kvps.errors import PeerLostError
kv = kvps.create('dist_sync')
kv.init(0, np.zeros(2))
print('READY', flush=True)
try:
    for step in range(100000):
        kv.push(0, np.ones(2))
        kv.pull(0, out=np.zeros(2))
        time.sleep(0.01)
except PeerLostError as exc:
    report(error=str(exc), role=exc.role, rank=exc.rank)
    sys.exit(7)
'''


def _wait_ready(proc):
    for line in proc.stdout:
        if 'READY' in line:
            return


@pytest.mark.parametrize('stop', ['kill', 'sigstop'])
def test_lost_server_is_named_on_every_worker(by_hand, stop):
    _, env = by_hand.scheduler(num_workers=1, num_servers=2)
    servers = [by_hand('server', env, rank=i) for i in range(2)]
    worker = by_hand('worker', env, script=LONG_SCRIPT)
    _wait_ready(worker)
    os.kill(servers[1].pid, signal.SIGKILL if stop == 'kill' else signal.SIGSTOP)
    code, out = by_hand.finish(worker, timeout=30, exits_when='the heartbeat bound (6 s here) '
                               'names the lost server, before KVPS_TIMEOUT (60 s)')
    assert code == 7, out
    assert 'server 1' in out and 'lost' in out
    assert servers[0].wait(30) != 0                   # the job ends everywhere


def test_lost_scheduler_is_named(by_hand):
    sched, env = by_hand.scheduler(num_workers=1, num_servers=1)
    by_hand('server', env)
    worker = by_hand('worker', env, script=LONG_SCRIPT)
    _wait_ready(worker)
    sched.kill()
    code, out = by_hand.finish(worker)
    assert code == 7, out
    assert 'scheduler' in out


RAISING_BY_HAND = '''
from kvps.errors import PeerLostError
kv = kvps.create('dist_sync')
kv.init(0, np.zeros(2))
if kv.rank == 1:
    raise RuntimeError('boom in worker 1')
try:
    for step in range(100000):
        kv.push(0, np.ones(2))
        kv.pull(0, out=np.zeros(2))
except PeerLostError as exc:
    report(error=str(exc), role=exc.role, rank=exc.rank)
    sys.exit(7)
'''


def test_a_worker_failing_by_hand_ends_the_job_with_its_reason(by_hand):
    # No launcher sees its exit: it tells the scheduler why it fails (ABORT), so the others
    # learn it at once, not a lost heartbeat later (or a round timing out with no reason).
    sched, env = by_hand.scheduler(num_workers=2, num_servers=1)
    server = by_hand('server', env)
    workers = [by_hand('worker', env, script=RAISING_BY_HAND, rank=r) for r in range(2)]
    code, out = by_hand.finish(workers[1])
    assert code == 1 and 'RuntimeError: boom in worker 1' in out, out
    code, out = by_hand.finish(workers[0])
    assert code == 7, out
    report = json.loads(out.split('RESULT ', 1)[1].splitlines()[0])
    assert (report['role'], report['rank']) == ('worker', 1)
    assert re.match(r'worker 1 \(host 127.0.0.1, pid \d+\) failed: uncaught RuntimeError: boom '
                    r'in worker 1$', report['error']), report
    assert sched.wait(30) == 1 and server.wait(30) != 0   # the job ends everywhere


HAND_SCRIPT = '''
kv = kvps.create('dist_sync')
kv.init(0, np.zeros(3))
kv.push(0, np.full(3, kv.rank + 1.0))
out = np.zeros(3); kv.pull(0, out=out)
report(rank=kv.rank, out=out.tolist())
'''


def test_hand_started_cluster_runs_and_every_process_exits(by_hand):
    sched, env = by_hand.scheduler(num_workers=2, num_servers=2)
    servers = [by_hand('server', env, rank=i) for i in range(2)]
    workers = [by_hand('worker', env, script=HAND_SCRIPT) for _ in range(2)]
    for proc in workers:
        code, out = by_hand.finish(proc)
        assert code == 0 and '"out": [3.0, 3.0, 3.0]' in out, out
    for proc in servers + [sched]:
        assert proc.wait(30) == 0


BACKPRESSURE_SCRIPT = '''
kv = kvps.create('dist_async')
kv.init(0, np.zeros(1000, np.float32))          # 4000 bytes: the window holds one push
print('READY', flush=True)
while not os.path.exists(os.environ['GO']):
    time.sleep(0.02)
for i in range(50):
    kv.push(0, np.full(1000, i + 1.0, np.float32))
    with open(os.environ['COUNT'], 'w') as f:
        f.write(str(i + 1))
out = np.zeros(1000, np.float32); kv.pull(0, out=out)
report(last=float(out[0]))
'''


def test_a_stalled_server_holds_pushes_back_instead_of_queueing_them(by_hand, tmp_path):
    _, env = by_hand.scheduler(num_workers=1, num_servers=1)
    server = by_hand('server', env)
    go, count = tmp_path / 'go', tmp_path / 'count'
    worker = by_hand('worker', {**env, 'GO': str(go), 'COUNT': str(count),
                                'KVPS_MAX_INFLIGHT_BYTES': '4000'}, script=BACKPRESSURE_SCRIPT)
    _wait_ready(worker)
    os.kill(server.pid, signal.SIGSTOP)
    try:
        go.write_text('')
        deadline = time.monotonic() + 30    # its first push (a loaded box may take a while)
        while not (count.exists() and count.read_text()) and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(2)                       # the worker pushes as fast as the window allows
        assert count.read_text() == '1'     # one push in flight, the second one waits
    finally:
        os.kill(server.pid, signal.SIGCONT)
    code, out = by_hand.finish(worker)
    assert code == 0 and '"last": 50.0' in out, out
    assert count.read_text() == '50'


def test_list_calls_of_small_keys_keep_within_a_lowered_message_limit(job):
    # 300 keys of 4 KB each (1.2 MB in all) over the socket, every node taking messages of up
    # to 100 kB: small keys share messages only up to that limit, so each call goes through.
    script = '''
    keys = list(range(300))
    kv = kvps.create('dist_sync')
    kv.init(keys, [np.full(1000, k, np.float32) for k in keys])
    outs = [np.zeros(1000, np.float32) for _ in keys]
    kv.pull(keys, out=outs)
    first = all((o == k).all() for k, o in zip(keys, outs))
    kv.push(keys, [np.full(1000, 2 * k, np.float32) for k in keys])
    kv.pull(keys, out=outs)
    second = all((o == 2 * k).all() for k, o in zip(keys, outs))
    kv.pushpull(keys, [np.full(1000, 3 * k, np.float32) for k in keys], out=outs)
    third = all((o == 3 * k).all() for k, o in zip(keys, outs))
    report(first=first, second=second, third=third, messages=kv.stats()['messages'])
    '''
    result = job(script, 1, 1, env={'KVPS_MAX_MESSAGE_BYTES': '100000', 'KVPS_SHM': '0'})
    assert result.returncode == 0, result.output
    res = result.results()[0]
    assert res['first'] and res['second'] and res['third'], res
    assert res['messages'] >= 5 * 1200000 // 100000, res   # (init, pull, push, pushpull)


def test_an_answer_refused_as_too_big_still_answers_the_pushes_riding_on_it(job):
    # Worker 0 alone takes answers of up to 100 kB. Its pull's 2 MB answer, which carries the
    # ack of the push before it (both are answered as worker 1's push closes the round), is
    # refused: the pull fails saying why, and the push counts as answered, so close() does
    # not wait KVPS_TIMEOUT for an ack that came.
    script = '''
    if os.environ['KVPS_RANK'] == '0':
        os.environ['KVPS_MAX_MESSAGE_BYTES'] = '100000'
    kv = kvps.create('dist_sync')
    kv.init(0, np.zeros(500000, np.float32))
    if kv.rank == 1:
        time.sleep(1)   # (so that worker 0's pull waits for the round with its push)
    kv.push(0, np.ones(500000, np.float32))
    out = np.zeros(500000, np.float32)
    try:
        kv.pull(0, out=out)
        pulled = float(out[0])
    except kvps.errors.ProtocolError as exc:
        pulled = str(exc)
    kv.close()
    report(pulled=pulled)
    '''
    result = job(script, 2, 1, env={'KVPS_SHM': '0'})
    assert result.returncode == 0, result.output
    results = result.results()
    assert results[1]['pulled'] == 2.0, results
    assert results[0]['pulled'].startswith('the answer of server 0 could not be read: data: '
                                           '2000000 bytes exceeds the limit of 100000'), results


def test_a_server_asked_for_gpu_shards_without_a_gpu_says_so(by_hand):
    if importlib.util.find_spec('cupy') is not None:   # then it may well keep GPU shards
        pytest.skip('cupy is installed')
    _, env = by_hand.scheduler(num_workers=1, num_servers=1)
    server = by_hand('server', {**env, 'KVPS_SERVER_DEVICE': 'cuda'})
    code, out = by_hand.finish(server)
    assert code == 1 and 'KVPS_SERVER_DEVICE=cuda: needs cupy and a CUDA GPU' in out


def test_a_message_over_the_size_limit_fails_its_call_at_once_saying_why(job):
    # The servers take messages of up to 2 MB: a 4 MiB init is refused by the server; this
    # worker takes up to 1 MB (its own setting), so the server's 1.2 MB answer to a pull
    # over the socket is refused here. Each call fails with the reason, neither waits for
    # KVPS_TIMEOUT.
    script = '''
    errors = {}
    os.environ['KVPS_MAX_MESSAGE_BYTES'] = '1000000'
    kv = kvps.create('dist_sync')
    try:
        kv.init('big', np.zeros(1 << 20, np.float32))
    except Exception as exc:
        errors['init'] = f'{type(exc).__name__}: {exc}'
    kv.init('w', np.zeros(300000, np.float32))
    try:
        kv.pull('w', out=np.zeros(300000, np.float32))
    except Exception as exc:
        errors['pull'] = f'{type(exc).__name__}: {exc}'
    report(**errors)
    '''
    result = job(script, 1, 1, env={'KVPS_MAX_MESSAGE_BYTES': '2000000', 'KVPS_SHM': '0'})
    assert result.returncode == 0, result.output
    errors = result.results()[0]
    assert errors['init'].startswith('ProtocolError: the server could not read this request: '
                                     'init: 4194304 bytes exceeds the limit of 2000000 '
                                     '(KVPS_MAX_MESSAGE_BYTES)'), errors
    assert errors['pull'].startswith('ProtocolError: the answer of server 0 could not be read: '
                                     'data: 1200000 bytes exceeds the limit of 1000000 '
                                     '(KVPS_MAX_MESSAGE_BYTES)'), errors
