"""A dist store shared by the threads of each worker: every push counted once, exact values."""

import pytest

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(180)]


THREADS_SCRIPT = '''
import threading
kv = kvps.create(os.environ['STORE'])
r, n = kv.rank, kv.num_workers
optimizer = os.environ['OPT'] == '1'
THREADS, ROUNDS = 3, 20
# One small key, one whose payloads go through shared memory, one split over both servers.
SIZES = [5, 700, 3000]
keys = [[10 * t + j for j in range(len(SIZES))] for t in range(THREADS)]   # disjoint per thread
FROZEN = 99                  # pulled by its own thread while the others push, never pushed
kv.init([k for ks in keys for k in ks] + [FROZEN],
        [np.zeros(s, np.float32) for _ in keys for s in SIZES] + [np.full(4, 7.0, np.float32)])
if optimizer:
    kv.set_optimizer(kvps.optimizer.create('test', rescale_grad=1.0))   # w += the pushed sum

def grad(rank, t, j, i):
    return (rank + 1) * (i + 1) + 100.0 * t + 10 * j + np.arange(SIZES[j], dtype=np.float32) % 5

def round_sum(t, j, i):
    return sum(grad(rank, t, j, i) for rank in range(n))

def expected(t, j, upto):
    """What key (t, j) holds after rounds [0, upto]: the last round's sum, or all of them."""
    if not optimizer:
        return round_sum(t, j, upto)
    return sum(round_sum(t, j, i) for i in range(upto + 1))

errors, bad, reads = [], [], [0]
pushing = threading.Event()

def train(t):
    try:
        for i in range(ROUNDS):
            kv.push(keys[t], [grad(r, t, j, i) for j in range(len(SIZES))])
            outs = [np.zeros(s, np.float32) for s in SIZES]
            kv.pull(keys[t], out=outs)
            if os.environ['STORE'] == 'dist_sync':   # async: other workers' pushes may lag
                bad.extend([t, j, i] for j, out in enumerate(outs)
                           if not np.array_equal(out, expected(t, j, i)))
    except Exception as exc:
        errors.append(repr(exc))

def read():
    try:
        while pushing.is_set() or reads[0] < 5:
            out = np.zeros(4, np.float32)
            kv.pull(FROZEN, out=out)
            if out.tolist() != [7.0] * 4:
                bad.append(['frozen', out.tolist()])
            reads[0] += 1
    except Exception as exc:
        errors.append(repr(exc))

pushing.set()
threads = [threading.Thread(target=train, args=(t,)) for t in range(THREADS)]
reader = threading.Thread(target=read)
for thread in threads + [reader]:
    thread.start()
for thread in threads:
    thread.join()
pushing.clear()
reader.join()
kv.barrier()                 # every worker's pushes are applied after it (async too)
final = []
for t in range(THREADS):
    outs = [np.zeros(s, np.float32) for s in SIZES]
    kv.pull(keys[t], out=outs)
    final.extend([t, j] for j, out in enumerate(outs)
                 if not np.array_equal(out, expected(t, j, ROUNDS - 1)))
report(rank=r, errors=errors, bad=bad[:5], final=final, reads=reads[0])
'''


@pytest.mark.parametrize('store, optimizer', [('dist_sync', '0'), ('dist_sync', '1'),
                                              ('dist_async', '1')])
def test_threads_of_a_worker_push_and_pull_their_own_keys_exactly(job, store, optimizer):
    """Each worker's threads push disjoint keys at once while another thread pulls a key
    nobody pushes; with a push window smaller than one push, so that threads wait for room
    (a thread waiting for another's dist_sync push once deadlocked the workers)."""
    result = job(THREADS_SCRIPT, 2, 2, env={
        'STORE': store, 'OPT': optimizer, 'KVPS_BIGARRAY_BOUND': '1000',
        'KVPS_MAX_INFLIGHT_BYTES': '4096'})
    assert result.returncode == 0, result.output
    results = result.results()
    assert sorted(results) == [0, 1], result.output
    for res in results.values():
        assert res['errors'] == [] and res['bad'] == [] and res['final'] == [], res
        assert res['reads'] >= 5


CLOSE_SCRIPT = '''
import threading
kv = kvps.create('dist_async')
kv.init(0, np.zeros(700, np.float32))
kv.barrier()
if kv.rank == 1:
    # Stays in the job until rank 0 has closed, without meeting rank 0's second barrier (and
    # without finishing, which would fail that barrier on the scheduler's side).
    while not os.path.exists('closed'):
        time.sleep(0.02)
    report(rank=1)
    sys.exit(0)
busy, ended = threading.Event(), {}

def train():
    grad, out = np.ones(700, np.float32), np.zeros(700, np.float32)
    for i in range(10 ** 6):
        kv.push(0, grad)
        kv.pull(0, out=out)
        if i == 20:      # the barrier thread, started first, is waiting by now
            busy.set()

def calling(name, target):
    def run():
        try:
            target()
        except Exception as exc:
            ended[name] = type(exc).__name__
        busy.set()
    return threading.Thread(target=run)

threads = [calling('barrier', kv.barrier), calling('train', train)]   # rank 1 never comes
for thread in threads:
    thread.start()
busy.wait()
kv.close()                   # while one thread is in a barrier, the other mid-push or mid-pull
for thread in threads:
    thread.join()
open('closed', 'w').close()
report(rank=0, ended=ended)
'''


def test_closing_a_store_another_thread_uses_fails_its_calls_clearly(job):
    """close() is not meant to race with calls, but a thread still calling gets
    StoreClosedError at once: not a wait for KVPS_TIMEOUT (a barrier nobody else joins),
    nor an error from inside the I/O machinery."""
    result = job(CLOSE_SCRIPT, 2, 1)
    assert result.returncode == 0, result.output
    results = result.results()
    assert sorted(results) == [0, 1], result.output
    assert results[0]['ended'] == {'barrier': 'StoreClosedError', 'train': 'StoreClosedError'}


def test_a_forked_child_is_told_it_cannot_use_the_store_and_leaves_the_job_alone(job):
    # The child has no I/O thread: its calls would wait for answers until KVPS_TIMEOUT. It
    # is told at once; when it exits (atexit runs), it does not end the parent's job either.
    script = '''
    kv = kvps.create('dist_sync')
    kv.init('w', np.zeros(2, np.float32))
    read, write = os.pipe()
    child = os.fork()
    if child == 0:
        os.close(read)
        try:
            kv.push('w', np.ones(2, np.float32))
            said = 'no error'
        except kvps.errors.StoreClosedError as exc:
            said = str(exc)
        kv.close()
        os.write(write, said.encode())
        sys.exit(0)   # atexit runs in the child too
    os.close(write)
    _, status = os.waitpid(child, 0)
    said = os.read(read, 4096).decode()
    kv.push('w', np.full(2, kv.rank + 1.0, np.float32))
    out = np.zeros(2, np.float32)
    kv.pull('w', out=out)
    report(child_exit=os.waitstatus_to_exitcode(status), said=said, w=out.tolist())
    '''
    result = job(script, 2, 1)
    assert result.returncode == 0, result.output
    for rank, res in result.results().items():
        assert res['child_exit'] == 0 and res['w'] == [3.0, 3.0], res
        assert res['said'].startswith('this process (') and 'was forked from the worker' in \
            res['said'] and 'call kvps from the worker process' in res['said'], res
