"""Pushes in waves across real processes: push then pull and pushpull of keys bigger than a
wave, compressed or not, each part over the socket or shared memory, give each round's sum,
also when a credit of one byte holds every wave until the results of the one before are
back (KVPS_PUSHPULL_CREDIT)."""

import pytest

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(180)]

WAVES_SCRIPT = '''
import os
import kvps.kvstore.keys
kv = kvps.create('dist_sync')
r = kv.rank
if os.environ['TEST_COMPRESS'] == '1':
    kv.set_gradient_compression({'type': 'fp16', 'pull': 'fp16'})
# 4 keys whose fp16 payloads each fill a wave (split over both servers), and small keys that
# share one; every value is exact in float16.
big = kvps.kvstore.keys.ENCODE_WAVE_BYTES // 2
sizes = [big] * 4 + [7, 300, 5]
keys = list(range(len(sizes)))
kv.init(keys, [np.zeros(s, np.float32) for s in sizes])
seen = []
for step in range(3):
    values = [np.full(s, (r + 1.0) * (step + 1) + k, np.float32) for k, s in zip(keys, sizes)]
    outs = [np.zeros(s, np.float32) for s in sizes]
    if step == 1:
        kv.pushpull(keys, values, out=outs)
    else:
        kv.push(keys, values)
        kv.pull(keys, out=outs)
    seen.append([[float(o.min()), float(o.max())] for o in outs])
report(rank=r, seen=seen)
'''


@pytest.mark.parametrize('shm, compress, credit', [
    ('0', '1', 'auto'), ('1', '1', 'auto'), ('0', '1', '1'), ('0', '0', '1')])
def test_waves_give_each_rounds_sum(job, shm, compress, credit):
    result = job(WAVES_SCRIPT, 2, 2, env={'KVPS_SHM': shm, 'KVPS_BIGARRAY_BOUND': '4000',
                                          'TEST_COMPRESS': compress,
                                          'KVPS_PUSHPULL_CREDIT': credit})
    assert result.returncode == 0, result.output
    results = result.results()
    assert sorted(results) == [0, 1]
    for res in results.values():
        for step, got in enumerate(res['seen']):   # (1 + 2) * (step + 1) + 2 k
            assert got == [[3.0 * (step + 1) + 2 * k] * 2 for k in range(7)]
