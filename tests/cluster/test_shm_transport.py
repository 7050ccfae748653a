"""Array payloads between a worker and the servers on its host go through shared memory (pushes
through the worker's segment, pulls out of the servers' arenas): exact values in dist_sync and
dist_async, with it off, with segments too small for every payload (the rest takes the
socket), in a container-sized /dev/shm, and nothing of the job left in /dev/shm."""

import glob
import subprocess

import pytest

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(180)]

# Keys above KVPS_BIGARRAY_BOUND (here 100k elements) are split over both servers; 'small' stays
# under the shared-memory threshold (kvps.wire.shm.MIN_BYTES, 1 KiB). Every push and pull of at
# least that size is counted by where its bytes went, by wrapping what the worker sends (pushes)
# and the answers it gets (pulls).
SCRIPT = '''
from kvps.optimizer import create as optimizer
from kvps.wire.shm import MIN_BYTES
MODE, STEPS = os.environ['MODE'], 4
SYNC = 'async' not in MODE
SHAPES = {'big': (300, 1000), 'wide': (120000,), 'small': (50,), 'f64': (70000,)}
DTYPES = {'big': np.float32, 'wide': np.float32, 'small': np.float32, 'f64': np.float64}

def grad(key, rank, step):
    return np.full(SHAPES[key], (rank + 1) * (step + 1), DTYPES[key])

kv = kvps.create(MODE)
io = kv._backend.io
counts = {'shm_push': 0, 'sock_push': 0, 'arena_pull': 0, 'shm_pull': 0, 'sock_pull': 0,
          'big_shm_push': 0}
def big(key, n):
    return n * np.dtype(DTYPES[key]).itemsize >= MIN_BYTES
submit, resolve = io.submit, io._pending.resolve
pulls = []   # the headers of pulls sent (the I/O thread gives each its id when it sends it)
def counted_submit(node, header, buffers, request):
    for item in header['keys'] if header['op'] == 'push' else ():
        if big(item.key, item.n):
            counts['shm_push' if item.at is not None else 'sock_push'] += 1
            counts['big_shm_push'] += item.key == 'big' and item.at is not None
    if header['op'] == 'pull':
        pulls.append(header)
    submit(node, header, buffers, request)
def counted_resolve(header, buffers):
    if header['op'] == 'data':   # it answers the pull's key parts in order
        asked = next(h for h in pulls if h.get('id') == header['id'])
        for item, answer in zip(asked['keys'], header['keys']):
            if item.key != 'small':   # every other key's parts have at least MIN_BYTES
                where = ('arena' if answer.lent is not None else
                         'shm' if answer.at is not None else 'sock')
                counts[where + '_pull'] += 1
    resolve(header, buffers)
io.submit, io._pending.resolve = counted_submit, counted_resolve
keys = list(SHAPES)
kv.init(keys, [np.full(SHAPES[k], 1, DTYPES[k]) for k in keys])
kv.set_optimizer(optimizer('test'))      # w += grad: exact, and order-free in dist_async
linked = io.staging is not None and os.path.exists(io.staging.segment.path)
seen = []
for step in range(STEPS):
    kv.push(keys, [grad(k, kv.rank, step) for k in keys])
    outs = [np.zeros(SHAPES[k], DTYPES[k]) for k in keys]
    kv.pull(keys, out=outs)
    if SYNC:
        want = 1 + sum((r + 1) * (s + 1) for r in range(kv.num_workers) for s in range(step + 1))
        seen.append(all((o == want).all() for o in outs))
kv.barrier()
outs = [np.zeros(SHAPES[k], DTYPES[k]) for k in keys]
kv.pull(keys, out=outs)
want = 1 + sum((r + 1) * (s + 1) for r in range(kv.num_workers) for s in range(STEPS))
job_pids = sorted(n['pid'] for n in io.welcome['nodes'])   # every worker and server
report(rank=kv.rank, pid=os.getpid(), job_pids=job_pids, rounds=seen,
       final=all((o == want).all() for o in outs),
       attached=sorted(io.staging.attached) if io.staging else None, linked=linked, **counts)
'''


def run(job, mode, env=None, wrapper=()):
    result = job(SCRIPT, workers=2, servers=2, wrapper=wrapper,
                 env={'MODE': mode, 'KVPS_BIGARRAY_BOUND': '100000', **(env or {})})
    assert result.returncode == 0, result.output
    results = result.results()
    assert sorted(results) == [0, 1], result.output
    for res in results.values():
        assert res['final'] and all(res['rounds']), res
        assert not glob.glob(f'/dev/shm/kvps-{res["pid"]}-*'), 'segment left in /dev/shm'
    # Segments are named kvps-<pid>-<hex>: only this job's workers' and servers' count, as
    # other kvps jobs may run on the box meanwhile (their segments come and go).
    job_pids = results[0]['job_pids']
    assert len(job_pids) == 4 and results[1]['job_pids'] == job_pids, results
    left = [path for pid in job_pids for path in glob.glob(f'/dev/shm/kvps-{pid}-*')]
    assert not left, f'a worker or server left its segment in /dev/shm: {left}'
    return results


@pytest.mark.parametrize('mode', ['dist_sync', 'dist_async'])
def test_big_payloads_go_through_shared_memory_with_exact_values(job, mode):
    for res in run(job, mode).values():
        assert res['attached'] == ['server 0', 'server 1']
        assert not res['linked']          # unlinked once mapped: a kill -9 leaves nothing
        # parts of 1 KiB and more: big's two (600 KB), wide's two (240 KB) and f64's one
        # (560 KB), per step (+ the last pull); small's 200 bytes take the socket
        assert (res['shm_push'], res['sock_push']) == (4 * 5, 0), res
        # every pull is copied straight out of the servers' arenas
        assert (res['arena_pull'], res['shm_pull'], res['sock_pull']) == (4 * 5 + 5, 0, 0), res


def test_shared_memory_off_sends_everything_through_the_socket(job):
    for res in run(job, 'dist_sync', {'KVPS_SHM': '0'}).values():
        assert res['attached'] is None and res['sock_pull'] == 4 * 5 + 5, res


def test_a_segment_too_small_for_a_step_sends_the_rest_through_the_socket(job):
    # 1.5 MiB: the 1.2 MB key fits, the rest of a step (about 2.4 MB more) does not.
    for res in run(job, 'dist_sync', {'KVPS_SHM_BYTES': str(3 << 19)}).values():
        assert res['shm_push'] and res['sock_push'], res
        assert res['arena_pull'] + res['shm_pull'] + res['sock_pull'] == 4 * 5 + 5, res


def test_a_value_bigger_than_the_segment_still_sends_parts_through_it(job):
    # 1 MiB segments; 'big' (1.2 MB) in 6 parts of 200 KB: a part is copied into a block of
    # its own, so those that fit take shared memory (the whole value never could).
    env = {'KVPS_SHM_BYTES': str(1 << 20), 'KVPS_PARTITION_BYTES': '200000'}
    for res in run(job, 'dist_sync', env).values():
        assert res['big_shm_push'] and res['sock_push'], res
        # every part pulled, each step and at the end: big's 6, wide's 4, f64's 4
        assert res['arena_pull'] + res['shm_pull'] + res['sock_pull'] == 5 * 14, res


# A container's /dev/shm: 64 MiB unless the operator says otherwise. A private mount namespace
# gives the job one of that size without touching the machine's.
SMALL_DEV_SHM = ('unshare', '-m', 'sh', '-c',
                 'mount -t tmpfs -o size=64m,mode=1777 tmpfs /dev/shm && exec "$@"', 'sh')


def _can_mount_a_small_dev_shm():
    try:
        return subprocess.run([*SMALL_DEV_SHM, 'true'], capture_output=True,
                              timeout=30).returncode == 0
    except OSError:
        return False


@pytest.mark.skipif(not _can_mount_a_small_dev_shm(),
                    reason='needs unshare -m and mount (root in a mount namespace)')
def test_a_containers_64_mib_dev_shm_still_carries_the_payloads(job):
    # W2 S2: each of the four processes takes 8 MiB, half of /dev/shm stays free; a step's
    # 2.2 MB of big payloads fits, so nothing takes the socket.
    for res in run(job, 'dist_sync', wrapper=SMALL_DEV_SHM).values():
        assert res['attached'] == ['server 0', 'server 1']
        assert (res['shm_push'], res['sock_push']) == (4 * 5, 0), res
        assert (res['arena_pull'], res['sock_pull']) == (4 * 5 + 5, 0), res
