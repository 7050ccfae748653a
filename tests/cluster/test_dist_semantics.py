"""dist_sync / dist_async semantics through `python -m kvps.launch`, exact values."""

import pytest

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(180)]


SYNC_SCRIPT = '''
kv = kvps.create(os.environ['STORE'])
r, n = kv.rank, kv.num_workers
# rank 0's init value wins; a key above the bound is split over every server.
kv.init([3, 7, 9], [np.full(4, 10.0 * (r + 1), np.float32), np.zeros(3000, np.float32),
                    np.zeros(5, np.float16)])
import torch
kv.init(11, torch.zeros(5, dtype=torch.bfloat16))   # numpy has no bfloat16: servers widen
strs = kvps.create(os.environ['STORE'])
strs.init('w', np.full((2, 2), r + 1.0))          # float64, str keys in a second store
seen = {}
init = np.zeros(4, np.float32); kv.pull(3, out=init); seen['init'] = init.tolist()
for step in range(3):
    kv.push(3, np.full(4, step + r + 1.0, np.float32))
    kv.push(7, np.arange(3000, dtype=np.float32) * (r + 1))
    kv.push(9, np.full(5, 0.5 * (r + 1), np.float16))
    kv.push(11, torch.full((5,), 1.0 if r == 0 else 2.0 ** -8, dtype=torch.bfloat16))
    strs.push('w', np.full((2, 2), float(r)))
    a = np.zeros(4, np.float32); kv.pull(3, out=a)
    brain = torch.zeros(5, dtype=torch.bfloat16); kv.pull(11, out=brain)
    big = np.zeros(3000, np.float32); kv.pull(7, out=big)
    half = np.zeros(5, np.float16); kv.pull(9, out=half)
    w = np.zeros((2, 2)); strs.pull('w', out=w)
    seen[step] = [a.tolist(), float(big[0]), float(big[1]), float(big[-1]), half.tolist(),
                  w.tolist(), brain.tolist()]
kv.barrier()
report(rank=r, n=n, seen=seen, type=kv.type)
'''


@pytest.mark.parametrize('workers, servers, partition', [(2, 2, None), (3, 1, None),
                                                        (2, 2, '1000')])
def test_dist_sync_push_replaces_with_the_round_sum(job, workers, servers, partition):
    """partition: key 7 (12000 bytes) is cut into 12 parts, 6 on each server."""
    result = job(SYNC_SCRIPT, workers, servers,
                 env={'STORE': 'dist_sync', 'KVPS_BIGARRAY_BOUND': '1000',
                      **({'KVPS_PARTITION_BYTES': partition} if partition else {})})
    assert result.returncode == 0, result.output
    results = result.results()
    assert sorted(results) == list(range(workers))
    total = workers * (workers + 1) / 2            # sum of (r + 1) over ranks
    for rank, res in results.items():
        assert res['n'] == workers and res['type'] == 'dist_sync'
        seen = res['seen']
        assert seen['init'] == [10.0] * 4
        for step in range(3):
            a, big0, big1, big_last, half, w, brain = seen[str(step)]
            assert a == [workers * (step + 1) + workers * (workers - 1) / 2] * 4
            assert (big0, big1, big_last) == (0.0, total, 2999 * total)
            assert half == [0.5 * total] * 5
            assert w == [[workers * (workers - 1) / 2] * 2] * 2
            # summed in float32, rounded once: 1 + 2**-8 ties to 1.0, 1 + 2 * 2**-8 is exact
            assert brain == [{2: 1.0, 3: 1.0078125}[workers]] * 5


def test_device_type_names_run_on_cpu_arrays(job):
    result = job(SYNC_SCRIPT, 2, 2, env={'STORE': 'dist_sync_device',
                                         'KVPS_BIGARRAY_BOUND': '1000'})
    assert result.returncode == 0, result.output
    assert result.results()[1]['seen']['2'][0] == [2 * 3 + 1.0] * 4


ROUNDS_SCRIPT = '''
kv = kvps.create('dist_sync')
r = kv.rank
kv.init(0, np.zeros(3))
rounds = 6
if r == 0:
    # The fast worker pushes every round before anyone else has pushed the first.
    for i in range(rounds):
        kv.push(0, np.full(3, 1000.0 * (i + 1)))
got = []
for i in range(rounds):
    if r != 0:
        time.sleep(0.05 * r)
        kv.push(0, np.full(3, float(r * (i + 1))))
    out = np.zeros(3)
    kv.pull(0, out=out)      # rank 0 sees the result of its last push's round
    got.append(out[0])
report(rank=r, got=got)
'''


def test_sync_rounds_with_a_fast_and_slow_workers(job):
    result = job(ROUNDS_SCRIPT, 3, 1)
    assert result.returncode == 0, result.output
    res = result.results()
    expected = [1000.0 * (i + 1) + 3.0 * (i + 1) for i in range(6)]
    assert res[1]['got'] == expected and res[2]['got'] == expected
    assert res[0]['got'] == [expected[-1]] * 6


ASYNC_SCRIPT = '''
kv = kvps.create('dist_async')
r = kv.rank
kv.init('w', np.zeros(4))
kv.init('plain', np.zeros(2))
opt = kvps.optimizer.create('sgd', learning_rate=1.0)
kv.set_optimizer(opt)
for i in range(20):
    kv.push('w', np.full(4, float(r + 1)))
kv.barrier()                 # returns only after every worker's pushes are applied
out = np.zeros(4); kv.pull('w', out=out)
report(rank=r, w=out.tolist())
'''


def test_dist_async_applies_every_push_once(job):
    result = job(ASYNC_SCRIPT, 2, 2)
    assert result.returncode == 0, result.output
    for res in result.results().values():
        assert res['w'] == [-20.0 * (1 + 2)] * 4


SGD_SYNC_SCRIPT = '''
kv = kvps.create('dist_sync')
r = kv.rank
kv.init(1, np.ones(6, np.float32))
kv.set_optimizer(kvps.optimizer.create('sgd', learning_rate=0.5, momentum=0.5))
half = np.full(6, (r + 1) / 2, np.float32)
for i in range(4):   # odd rounds name the key twice in one push: one key, values summed
    kv.push(*((1, half * 2) if i % 2 == 0 else ([1, 1], [half, half])))
out = np.zeros(6, np.float32); kv.pull(1, out=out)
report(rank=r, w=out.tolist())
'''


def test_dist_sync_runs_the_optimizer_once_per_round_on_the_sum(job):
    result = job(SGD_SYNC_SCRIPT, 3, 2, env={'KVPS_BIGARRAY_BOUND': '4'})
    assert result.returncode == 0, result.output
    w, mom = 1.0, 0.0
    for _ in range(4):      # one update per round of the 3 workers' sum, 1 + 2 + 3
        mom = 0.5 * mom - 0.5 * 6.0
        w += mom
    for res in result.results().values():
        assert res['w'] == [w] * 6


COMPRESSED_SCRIPT = '''
import hashlib
kv = kvps.create(os.environ['STORE'])
r = kv.rank
sizes = [3000, 5, 1200000]       # key 0 split over both servers; key 2's parts in shared memory
kv.init([0, 1, 2], [np.zeros(3000, np.float32), np.zeros(5), np.zeros(1200000, np.float32)])
kv.set_optimizer(kvps.optimizer.create('test', rescale_grad=1.0))   # w += the pushed sum
kv.set_gradient_compression({'type': '2bit', 'threshold': 0.5})
rng = np.random.default_rng(r)
for step in range(3):
    kv.push([0, 1, 2], [rng.standard_normal(n).astype(np.float64 if n == 5 else np.float32)
                        for n in sizes])
kv.barrier()                       # async: every worker's pushes are applied after it
outs = [np.zeros(3000, np.float32), np.zeros(5), np.zeros(1200000, np.float32)]
kv.pull([0, 1, 2], out=outs)
report(rank=r, digests=[hashlib.sha256(o.tobytes()).hexdigest() for o in outs],
       head=[o[:5].tolist() for o in outs])
'''


@pytest.mark.parametrize('store', ['dist_sync', 'dist_async'])
def test_compressed_pushes_deliver_what_the_2bit_rule_sends(job, store):
    """Servers apply exactly what each worker's codec sends (test_compression pins the codec
    to the rule), with key 0's parts on two servers and key 2's through shared memory."""
    import hashlib

    import numpy as np
    from kvps import compression
    result = job(COMPRESSED_SCRIPT, 2, 2, env={'STORE': store, 'KVPS_BIGARRAY_BOUND': '1000'})
    assert result.returncode == 0, result.output
    sizes = [3000, 5, 1200000]
    want = [np.zeros(n, np.float64 if n == 5 else np.float32) for n in sizes]
    for rank in range(2):
        rng, codec = np.random.default_rng(rank), compression.parse({'type': '2bit'}).push
        for _ in range(3):
            for key, n in enumerate(sizes):
                grad = rng.standard_normal(n).astype(want[key].dtype)
                payload = codec.encode(key, 0, grad, np.empty(
                    compression.nbytes('2bit', n), np.uint8))
                want[key] += compression.decode('2bit', payload, n, str(want[key].dtype))
    digests = [hashlib.sha256(w.tobytes()).hexdigest() for w in want]
    results = result.results()
    assert sorted(results) == [0, 1]
    for res in results.values():
        assert res['head'] == [w[:5].tolist() for w in want] and res['digests'] == digests



# One store per type (each its own codec and residuals), each pulling its keys rounded and,
# through a plain store, exactly.
CODECS = [{'type': 'fp16', 'pull': 'fp16'}, {'type': 'bf16', 'pull': 'bf16'}, {'type': '1bit'},
          {'type': 'topk', 'ratio': 0.05, 'pull': 'fp16'}]
SIZES = [3000, 5, 200000]   # keys 0 and 2 split over both servers; payloads >= 1 KiB in shm
CODECS_SCRIPT = f'''
import json
codecs, sizes = {CODECS!r}, {SIZES!r}
plain = kvps.create(os.environ['STORE'])
r = plain.rank
stores, parts = [], {{}}
for t, params in enumerate(codecs):
    kv = kvps.create(os.environ['STORE'])
    keys = [10 * t + i for i in range(3)]
    kv.init(keys, [np.zeros(n, np.float64 if n == 5 else np.float32) for n in sizes])
    kv.set_gradient_compression(params)
    stores.append((kv, keys))
    parts.update({{k: kv._keys.parts(k) for k in keys}})
plain.set_optimizer(kvps.optimizer.create('test', rescale_grad=1.0))   # w += the pushed sum
for t, (kv, keys) in enumerate(stores):
    rng = np.random.default_rng([r, t])
    for step in range(3):
        kv.push(keys, [rng.standard_normal(n).astype(np.float64 if n == 5 else np.float32)
                       for n in sizes])
plain.barrier()                    # async: every worker's pushes are applied after it
for t, (kv, keys) in enumerate(stores):
    exact = [np.zeros(n, np.float64 if n == 5 else np.float32) for n in sizes]
    rounded = [np.zeros_like(e) for e in exact]
    plain.pull(keys, out=exact)
    kv.pull(keys, out=rounded)
    np.savez(os.path.join(os.environ['OUT'], f'{{r}}-{{t}}.npz'), *exact, *rounded)
report(rank=r, parts={{str(k): v for k, v in parts.items()}})
'''


@pytest.mark.parametrize('store', ['dist_sync', 'dist_async'])
def test_every_codec_delivers_what_it_sends_and_pulls_round(job, store, tmp_path):
    """Servers apply what each worker's codecs send, part by part as the worker splits keys
    (the codecs are replayed here on the parts the worker reports; test_compression_codecs
    pins them), up to the float32 sums' order; and a pull with 'pull' set is the exact
    value rounded to that type, the server keeping full precision."""
    import numpy as np
    from kvps import compression
    from kvps.optimizer.kernels.common import bf16_to_f32
    result = job(CODECS_SCRIPT, 2, 2, env={'STORE': store, 'KVPS_BIGARRAY_BOUND': '1000',
                                           'OUT': str(tmp_path)}, timeout=180)
    assert result.returncode == 0, result.output
    results = result.results()
    assert sorted(results) == [0, 1]
    parts = results[0]['parts']
    assert all(len(parts[str(10 * t + k)]) == 2 for t in range(4) for k in (0, 2))
    for t, params in enumerate(CODECS):
        want = [np.zeros(n) for n in SIZES]
        for rank in range(2):
            rng, codec = np.random.default_rng([rank, t]), compression.parse(params).push
            for _ in range(3):
                for i, n in enumerate(SIZES):
                    grad = rng.standard_normal(n).astype(np.float64 if n == 5 else np.float32)
                    for _, part, start, stop in parts[str(10 * t + i)]:
                        dtype = grad.dtype.name
                        payload = codec.encode(10 * t + i, part, grad[start:stop], np.empty(
                            codec.nbytes(stop - start, dtype), np.uint8))
                        want[i][start:stop] += compression.decode(codec.name, payload,
                                                                  stop - start, dtype)
        for rank in range(2):
            got = np.load(tmp_path / f'{rank}-{t}.npz')
            exact, rounded = [got[f'arr_{i}'] for i in range(3)], \
                [got[f'arr_{i}'] for i in range(3, 6)]
            for w, e, p in zip(want, exact, rounded):
                np.testing.assert_allclose(e, w, rtol=1e-5, atol=1e-5)
                pull = params.get('pull')
                if pull == 'fp16':
                    assert p.tolist() == e.astype(np.float16).astype(e.dtype).tolist()
                elif pull == 'bf16':
                    bits = compression.round_pulled(e, 'bf16')
                    assert p.tolist() == bf16_to_f32(bits).astype(e.dtype).tolist()
                else:
                    assert p.tolist() == e.tolist()

PUSHPULL_SCRIPT = '''
kv = kvps.create('dist_sync')
r, n = kv.rank, kv.num_workers
# 12 keys of 512 KiB (6 MiB: more than one wave of pull requests behind pushes on the
# socket), a small key, and a key split over both servers.
sizes = [1 << 17] * 12 + [3, 5000]
keys = list(range(len(sizes)))
kv.init(keys, [np.full(s, 1.0, np.float32) for s in sizes])
seen = []
for step in range(3):
    values = [np.full(s, (r + 1.0) * (step + 1) + k, np.float32) for k, s in zip(keys, sizes)]
    if step == 1:   # results land in a separate out, the pushed values stay as they were
        outs = [np.zeros(s, np.float32) for s in sizes]
        kv.pushpull(keys, values, out=outs)
        assert values[0][0] == (r + 1.0) * 2
    else:           # out=None: the results land in the pushed arrays
        kv.pushpull(keys, values)
        outs = values
    seen.append([[float(o.min()), float(o.max())] for o in outs])
kv.set_optimizer(kvps.optimizer.create('sgd', learning_rate=0.5))
w = [np.zeros(s, np.float32) for s in sizes]
kv.pushpull(keys, [np.full(s, 1.0, np.float32) for s in sizes], out=w)
seen.append([[float(o.min()), float(o.max())] for o in w])
report(rank=r, seen=seen)
'''


@pytest.mark.parametrize('shm', ['0', '1'])
def test_pushpull_returns_each_rounds_result_over_socket_and_shared_memory(job, shm):
    result = job('import kvps.optimizer\n' + PUSHPULL_SCRIPT, 2, 2,
                 env={'KVPS_SHM': shm, 'KVPS_BIGARRAY_BOUND': '4000'})
    assert result.returncode == 0, result.output
    results = result.results()
    assert sorted(results) == [0, 1]
    for res in results.values():
        steps = res['seen']
        for step in range(3):   # the round's sum: (1 + 2) * (step + 1) + 2 k
            assert steps[step] == [[3.0 * (step + 1) + 2 * k] * 2 for k in range(14)]
        # server SGD on the last sums: w - lr * (1 + 1)
        assert steps[3] == [[3.0 * 3 + 2 * k - 1.0] * 2 for k in range(14)]


PULL_BEGIN_SCRIPT = '''
import pathlib
kv = kvps.create('dist_sync')
r = kv.rank
keys = [0, 1, 2]
kv.init(keys, [np.zeros(5, np.float32)] * 3)
begun = pathlib.Path('begun')
if r == 0:
    for k in keys:
        kv.push(k, np.full(5, 1.0 + k, np.float32))
    outs = [np.zeros(5, np.float32) for _ in keys]
    # one call per key, as MXNet's Gluon Trainer loops; none waits: rank 1 has not pushed
    waits = [kv.pull_begin(k, out=out) for k, out in zip(keys, outs)]
    begun.write_text('')
    for wait in waits:
        wait()
else:
    while not begun.exists():   # (rank 0's pulls are under way before this worker pushes)
        time.sleep(0.01)
    for k in keys:
        kv.push(k, np.full(5, 10.0 * (k + 1), np.float32))
    outs = [np.zeros(5, np.float32) for _ in keys]
    kv.pull(keys, out=outs)
report(rank=r, got=[o.tolist() for o in outs])
'''


def test_pull_begin_returns_before_the_round_completes_and_its_wait_brings_the_result(job):
    result = job(PULL_BEGIN_SCRIPT, 2, 1)
    assert result.returncode == 0, result.output
    expected = [[1.0 + k + 10.0 * (k + 1)] * 5 for k in range(3)]
    assert {rank: res['got'] for rank, res in result.results().items()} == {0: expected,
                                                                            1: expected}


MANY_KEYS_SCRIPT = '''
import collections
kv = kvps.create('dist_sync')
r = kv.rank
sent = collections.Counter()
io = kv._backend.io
submit = io.submit
def counting(node, header, buffers, request):
    sent[header['op']] += 1
    submit(node, header, buffers, request)
io.submit = counting
# 3000 small keys of two shapes and one key split over both servers; rank 0's values win.
keys = list(range(3001))   # 3000: the big one
def value(k, rank):
    if k == 3000:
        return np.arange(1000, dtype=np.float32) + rank
    return np.full((2, 2) if k % 2 else 3, k + 1000 * rank, np.float32)
kv.init(keys, [value(k, r) for k in keys])
messages = dict(sent)
outs = [np.zeros_like(value(k, 0)) for k in keys]
kv.pull(keys, out=outs)
exact = all(np.array_equal(o, value(k, 0)) for k, o in zip(keys, outs))
# A worker whose view of one key among many differs from rank 0's is told which.
error = None
try:
    kv.init(list(range(5000, 5100)), [np.zeros(4 if k == 5050 and r else 3, np.float32)
                                      for k in range(5000, 5100)])
except kvps.errors.KVPSError as exc:
    error = [type(exc).__name__, str(exc)]
kv.barrier()
report(messages=messages, exact=exact, error=error)
'''


def test_init_of_many_keys_takes_a_message_per_server_and_names_a_mismatch(job):
    """Init lists many keys in a message (it took one per key part, and an answer each:
    20,000 keys took seconds); every value still arrives, and a worker whose shape of one
    key differs from rank 0's gets that key's ShapeError."""
    result = job(MANY_KEYS_SCRIPT, 2, 2, env={'KVPS_BIGARRAY_BOUND': '100'})
    assert result.returncode == 0, result.output
    results = result.results()
    assert results[0]['messages'] == {'init': 2, 'barrier': 1}
    assert results[1]['messages'] == {'check': 2, 'barrier': 1}
    assert results[0]['exact'] and results[1]['exact']
    assert results[0]['error'] is None
    kind, message = results[1]['error']
    assert kind == 'ShapeError' and 'key 5050' in message and '(4,)' in message, message


@pytest.mark.parametrize('store', ['dist_sync', 'dist_async'])
def test_all_sum_gives_every_worker_the_sum_and_a_mismatch_says_so(job, store):
    """A global accuracy: each worker brings its counts, every worker gets the job's, with
    the servers running an optimizer (no store key is used). Workers that meet with different
    calls (all_sum or init against barrier) all get a ConfigError, neither a hang nor calls
    that go on out of step."""
    result = job(f'''
        kv = kvps.create({store!r})
        kv.init(0, np.zeros(2, np.float32))
        kv.set_optimizer(kvps.optimizer.create('sgd', learning_rate=0.5))
        kv.push(0, np.ones(2, np.float32))
        correct, total = kv.all_sum([30 + kv.rank, 50])
        grid = kv.all_sum(np.full((2, 2), 0.25 * (kv.rank + 1)))
        most = kv.all_sum(np.arange(8192.0))   # the most one call takes (64 KiB)
        assert most.tolist() == (np.arange(8192.0) * 3).tolist()
        mismatch = []
        for call in ('all_sum', 'init'):
            try:
                if kv.rank > 0:
                    kv.barrier()
                elif call == 'all_sum':
                    kv.all_sum([1.0])
                else:
                    kv.init(1, np.zeros(2, np.float32))
                mismatch.append(None)
            except kvps.errors.ConfigError as exc:
                mismatch.append(str(exc))
        report(rank=kv.rank, counts=[correct, total], grid=grid.tolist(), mismatch=mismatch)
    ''', 3, 1, timeout=90)
    assert result.returncode == 0, result.output
    found = result.results()
    assert sorted(found) == [0, 1, 2], result.output
    for rank, values in found.items():
        assert values['counts'] == [93.0, 150.0]
        assert values['grid'] == [[1.5, 1.5], [1.5, 1.5]]
        # every worker is told, not only the one whose call it was
        with_all_sum, with_init = values['mismatch']
        assert 'rank 0 in all_sum, rank 1 in barrier, rank 2 in barrier' in with_all_sum, values
        assert 'rank 0 in init, rank 1 in barrier, rank 2 in barrier' in with_init, values
