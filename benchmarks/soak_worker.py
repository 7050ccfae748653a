"""The worker program of bench_soak.py: thousands of push+pull rounds, progress on stdout.

Settings come from the environment (bench_soak.py sets them): SOAK_ROUNDS, SOAK_KEYS,
SOAK_BYTES (total over all keys), SOAK_OPTIMIZER (sgd|none), SOAK_MODE (sync|async),
SOAK_EVERY (progress line every N rounds), SOAK_TRACEMALLOC (1: report the Python allocations
that grew between the end of warm-up and the end, top 15, on stdout).

Lines on stdout: ``SOAK pid <pid>``, ``SOAK ready``, ``SOAK round <n> <t_s>``,
``SOAK done <rounds> <seconds> <checked>``, and with tracemalloc ``SOAK alloc <text>``.
"""

import os
import sys
import time
import tracemalloc

import numpy as np

import kvps


def say(*parts):
    print('SOAK', *parts, flush=True)


def main():
    rounds = int(os.environ.get('SOAK_ROUNDS', '3000'))
    nkeys = int(os.environ.get('SOAK_KEYS', '8'))
    total = int(os.environ.get('SOAK_BYTES', str(1 << 20)))
    optimizer = os.environ.get('SOAK_OPTIMIZER', 'sgd')
    mode = os.environ.get('SOAK_MODE', 'sync')
    every = int(os.environ.get('SOAK_EVERY', '50'))
    trace = os.environ.get('SOAK_TRACEMALLOC') == '1'
    say('pid', os.getpid())

    kv = kvps.create('dist_sync' if mode == 'sync' else 'dist_async')
    n = max(1, total // (4 * nkeys))
    keys = list(range(nkeys))
    kv.init(keys, [np.zeros(n, np.float32) for _ in keys])
    if optimizer == 'sgd':
        kv.set_optimizer(kvps.optimizer.create('sgd', learning_rate=0.5))
    grads = [np.full(n, 1.0 + k, np.float32) for k in keys]
    outs = [np.empty(n, np.float32) for _ in keys]
    say('ready')

    warm = max(1, rounds // 10)
    snapshot = None
    started = time.monotonic()
    for r in range(1, rounds + 1):
        kv.push(keys, grads)
        kv.pull(keys, out=outs)
        if r % every == 0 or r == rounds:
            say('round', r, f'{time.monotonic() - started:.3f}')
        if trace and r == warm:
            tracemalloc.start(10)
            snapshot = tracemalloc.take_snapshot()
    elapsed = time.monotonic() - started
    kv.barrier()
    # A plain exact check for sync mode: sum over workers each round, replace or sgd step.
    checked = 'skip'
    if mode == 'sync':
        kv.pull(keys, out=outs)
        workers = kv.num_workers
        for k, out in zip(keys, outs):
            step = (1.0 + k) * workers
            want = -0.5 * step * rounds if optimizer == 'sgd' else step
            checked = 'ok' if np.allclose(out, want, rtol=1e-4) and checked != 'bad' else 'bad'
    if trace and snapshot is not None:
        stats = tracemalloc.take_snapshot().compare_to(snapshot, 'traceback')
        for stat in stats[:15]:
            frame = stat.traceback.format()[-2:] if stat.traceback else ['?']
            say('alloc', f'{stat.size_diff / 1024:+.1f} KiB {stat.count_diff:+d} blocks',
                ' | '.join(line.strip() for line in frame))
    say('done', rounds, f'{elapsed:.3f}', checked)
    return 0 if checked != 'bad' else 3


if __name__ == '__main__':
    sys.exit(main())
