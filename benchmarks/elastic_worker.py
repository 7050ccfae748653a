"""The worker program of bench_elastic.py: timed dist_sync push+pull rounds; in ``recover``
mode the last rank kills itself mid-job and the others time the round that waits for it."""

import json
import os
import signal
import statistics
import sys
import time

import numpy as np

import kvps

MODE, ROUNDS, KEYS, SIZE = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
KILL_AT = ROUNDS // 2

kv = kvps.create('dist_sync')
keys = list(range(KEYS))
kv.init(keys, [np.zeros(SIZE, np.float32) for _ in keys])
grads = [np.full(SIZE, kv.rank + 1, np.float32) for _ in keys]
outs = [np.zeros(SIZE, np.float32) for _ in keys]
last = kv.num_workers - 1
times = []
for step in range(ROUNDS):
    if MODE == 'recover' and step == KILL_AT and kv.rank == last:
        kv.push(keys, grads)
        time.sleep(0.3)
        os.kill(os.getpid(), signal.SIGKILL)
    start = time.perf_counter()
    kv.push(keys, grads)
    kv.pull(keys, out=outs)
    times.append(time.perf_counter() - start)
# (the killed worker's last round is whole; the next one waits until it is found lost)
steady = times[5:KILL_AT] + times[KILL_AT + 3:] if MODE == 'recover' else times[5:]
print('RESULT', json.dumps({'rank': kv.rank, 'step_s': statistics.median(steady),
                            'kill_round_s': max(times[KILL_AT:KILL_AT + 3])
                            if MODE == 'recover' else None,
                            'workers': kv.num_workers}), flush=True)
