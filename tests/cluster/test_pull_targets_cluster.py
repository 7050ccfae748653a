"""dist stores: a pull or pushpull with one bad target raises before anything is written or
pushed, also when pushpull goes out in several waves."""

import pytest

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(180)]

SCRIPT = '''
import torch
kv = kvps.create(os.environ['STORE'])
size = 300_000            # 1.2 MB a key: every key of a pushpull is a wave of its own
kv.init([0, 1, 2], [np.zeros(size, np.float32) for _ in range(3)])
kv.push([0, 1, 2], [np.full(size, k + 1.0, np.float32) for k in range(3)])
bad_targets = {'read-only': np.frombuffer(bytes(4 * size), np.float32),
               'share memory': torch.zeros(1).expand(size)}
seen = {}
for kind, bad in bad_targets.items():
    good = [np.full(size, -1.0, np.float32) for _ in range(3)]
    calls = [lambda: kv.pull(0, out=[good[0], bad]),
             lambda: kv.pull([0, 1, 2], out=[good[0], good[1], bad]),
             lambda: kv.pushpull([0, 1, 2], [np.ones(size, np.float32)] * 3,
                                 out=[good[0], good[1], [good[2], bad]])]
    for i, call in enumerate(calls):
        try:
            call()
            seen[f'{kind} {i}'] = 'no error'
        except ValueError as exc:
            seen[f'{kind} {i}'] = [str(exc)[:40], sorted({float(v) for g in good for v in g})]
stored = [np.zeros(size, np.float32) for _ in range(3)]
kv.pull([0, 1, 2], out=stored)
report(seen=seen, stored=[sorted(set(s.tolist())) for s in stored])
'''


@pytest.mark.parametrize('store', ['dist_sync', 'dist_sync_device'])
def test_one_bad_target_leaves_every_target_and_the_servers_unchanged(job, store):
    result = job(SCRIPT, 1, 2, env={'STORE': store, 'KVPS_SHM': '0'})
    assert result.returncode == 0, result.output
    res = result.results()[0]
    what = {'read-only': 'is read-only', 'share memory': 'of shape (300000,) has elements'}
    assert res['seen'] == {f'{kind} {i}': [f'key {key}: pull target {what[kind]}'[:40], [-1.0]]
                           for kind in what for i, key in enumerate([0, 2, 2])}
    assert res['stored'] == [[1.0], [2.0], [3.0]]   # pushpull pushed nothing


CASTS = '''
import torch
kv = kvps.create(os.environ['STORE'])
values = {'half': torch.tensor([1.5, 2.75, 100.25], dtype=torch.float16),
          'brain': torch.tensor([1.5, 2.75, 100.25], dtype=torch.bfloat16),
          'single': torch.tensor([1.5, 2.75, 100.3], dtype=torch.float32)}
kv.init(list(values), list(values.values()))
kv.push(list(values), list(values.values()))   # two workers: the sums are doubled
wide, narrow, ints = np.zeros(3, np.float32), torch.zeros(3, dtype=torch.float16), \\
    torch.zeros(3, dtype=torch.int32)
kv.pull(['half', 'brain', 'single', 'single'], out=[wide, ints, narrow, ints.clone()])
report(wide=wide.tolist(), ints=ints.tolist(), narrow=narrow.tolist())
'''


@pytest.mark.parametrize('store', ['dist_sync', 'dist_sync_device'])
def test_pulls_cast_into_targets_of_another_dtype(job, store):
    """As MXNet's CopyFromTo, through a job's servers (shared memory and the socket)."""
    result = job(CASTS, 2, 2, env={'STORE': store})
    assert result.returncode == 0, result.output
    for res in result.results().values():
        assert res['wide'] == [3.0, 5.5, 200.5]            # float16 sums into float32
        assert res['ints'] == [3, 5, 200]   # bfloat16 holds 100.25 as 100; 5.5 -> 5 (toward 0)
        assert res['narrow'] == [3.0, 5.5, 200.625]         # float32 200.6 -> float16
