#!/usr/bin/env python
"""Worker of bench_pushpull: times kv.push(all keys) + kv.pull(all keys) rounds in dist_sync.

Run by bench_pushpull.py on every worker of a kvps job (DMLC_* variables set by the launcher).
Mirrors the peers' MXNet benchmark step for step so that the figures compare:

  1. kv = kvps.create('dist_sync'); init K float32 keys totalling about --total-bytes;
  2. optionally a server-side SGD (kv.set_optimizer(kvps.optimizer.create('sgd', ...))), and
     compression of pushes (--compress) and pulls (--compress-pull);
  3. correctness rounds with round-dependent values, checked against the expected sum (no
     optimizer) or w0 - lr * sum (SGD); compressing, a pause until every node's float16
     casts have loaded torch (--settle);
  4. warm-up rounds, a barrier, then --rounds timed rounds; one round = kv.push(keys, values)
     then kv.pull(keys, out=outs) (the pull returns once the round's result is in ``outs``),
     or with --pushpull one kv.pushpull(keys, values, out=outs);
  5. writes <out>/worker<rank>.json: per-round times, median, push+pull GB/s per worker, and
     (rank 0) the CPU seconds every thread of every node of the job spent in the timed window.

kvps never modifies a pushed array, so unlike MXNet no refill is needed between rounds; the
copy kvps makes of every pushed value is inside the timed region (it is part of its cost).
"""
import argparse
import os
import signal
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402  (benchmarks/ is not a package)


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument('--keys', type=int, default=40)
    p.add_argument('--total-bytes', type=int, default=4 << 20)
    p.add_argument('--rounds', type=int, default=10)
    p.add_argument('--warmup', type=int, default=2)
    p.add_argument('--check-rounds', type=int, default=2)
    p.add_argument('--optimizer', choices=['none', 'sgd'], default='none')
    p.add_argument('--lr', type=float, default=0.1)
    p.add_argument('--out', required=True, help='directory for worker<rank>.json')
    p.add_argument('--tag', default='', help='KVPS_BENCH_TAG of this job (for CPU accounting)')
    p.add_argument('--compress', default='none',
                   help='push compression type (kv.set_gradient_compression): fp16, 1bit, ...')
    p.add_argument('--compress-pull', default='none', help='pulls in fp16 or bf16')
    p.add_argument('--settle', type=float, default=None,
                   help='seconds from the first compressed push to the warm-up rounds '
                        '(default 10 with --compress/--compress-pull, else 0): float16 casts '
                        'load torch in the background at a node\'s first one, a few seconds '
                        'that a job pays once and a timed round must not')
    p.add_argument('--timeline-blocks', type=int, default=0, metavar='N',
                   help='in a job that records its timeline (and has --tag): pause and resume '
                        "every node's recording (SIGUSR2) every N timed rounds, so that one run "
                        'times rounds with and without it')
    p.add_argument('--pushpull', action='store_true',
                   help='one kv.pushpull(keys, values, out=outs) per round instead of push '
                        'then pull (pull requests follow the pushes closely)')
    p.add_argument('--per-key', action='store_true',
                   help="one call per key, as MXNet's Gluon Trainer drives a store: kv.push(k) "
                        'for every key, then kv.pull_begin(k) for every key, then the waits')
    return p.parse_args()


class TimelineBlocks:
    """Rounds timed with the job's timeline recording and paused, in blocks, within one run.

    At each switch rank 0 sends SIGUSR2 (kvps.timeline's pause/resume) to every node of the
    job (found by its KVPS_BENCH_TAG) and reads their CPU counters; a barrier then lets the
    signals land before the block's rounds. The first SETTLE rounds of a block are not
    counted: a node may take its signal a moment late."""

    SETTLE = 2

    def __init__(self, kv, tag, rank):
        import kvps.timeline
        if not tag or not kvps.timeline.enabled():
            raise SystemExit('--timeline-blocks needs --tag and a job that records its '
                             'timeline (kvps.launch --timeline PATH)')
        self.kv, self.tag, self.rank, self.timeline = kv, tag, rank, kvps.timeline
        self.flags = []                          # per timed round: recorded, or None (settling)
        self.cpu_s = {True: 0.0, False: 0.0}     # the job's CPU seconds in each state (rank 0)
        self.rounds = {True: 0, False: 0}
        self._cpu, self._on = None, True

    def switch(self):
        if self.rank == 0:
            nodes = _common.job_thread_cpu(self.tag)
            if self._cpu is not None:
                self.cpu_s[self._on] += _common.cpu_seconds(_common.cpu_delta(self._cpu, nodes))
            self._cpu = nodes
            for node in nodes.values():
                os.kill(node['pid'], signal.SIGUSR2)
        self.kv.barrier()
        self._on = self.timeline.enabled()

    def count(self, index_in_block):
        self.flags.append(self._on if index_in_block >= self.SETTLE else None)
        self.rounds[self._on] += 1

    def record(self):
        return {'timeline_on': self.flags,
                'timeline_cpu_ms_per_round': {
                    state: round(self.cpu_s[on] * 1e3 / max(1, self.rounds[on]), 3)
                    for state, on in (('on', True), ('off', False))}}


def main():
    args = parse_args()
    t_start = time.perf_counter()
    import numpy as np
    import kvps

    kv = kvps.create('dist_sync')
    rank, nworkers = kv.rank, kv.num_workers
    t_connected = time.perf_counter()

    n = max(1, args.total_bytes // (4 * args.keys))
    keys = list(range(args.keys))
    actual_bytes = 4 * n * args.keys
    w0 = 0.5
    kv.init(keys, [np.full(n, w0, dtype=np.float32) for _ in keys])
    if args.optimizer == 'sgd':
        import kvps.optimizer
        kv.set_optimizer(kvps.optimizer.create('sgd', learning_rate=args.lr))
    if args.compress != 'none' or args.compress_pull != 'none':
        # the values pushed are exact in every type; pulls in 16 bits are rounded
        kv.set_gradient_compression({'type': args.compress, 'pull': args.compress_pull})
    tolerance = 1e-4 if args.compress_pull == 'none' else 1e-3
    push_vals = [np.full(n, float(rank + 1), dtype=np.float32) for _ in keys]
    outs = [np.zeros(n, dtype=np.float32) for _ in keys]
    sum_ranks = nworkers * (nworkers + 1) / 2.0
    state = {'w': w0}
    errors = []

    def one_round(vals):
        t0 = time.perf_counter()
        if args.pushpull:
            kv.pushpull(keys, vals, out=outs)
            t1 = t0   # one call: its time counts as the pull's
        elif args.per_key:
            for k in keys:
                kv.push(k, vals[k])
            t1 = time.perf_counter()
            for wait in [kv.pull_begin(k, outs[k]) for k in keys]:
                wait()
        else:
            kv.push(keys, vals)
            t1 = time.perf_counter()
            kv.pull(keys, out=outs)
        t2 = time.perf_counter()
        return t1 - t0, t2 - t1

    def expect(scale):
        if args.optimizer == 'none':
            return scale * sum_ranks
        state['w'] -= args.lr * scale * sum_ranks
        return state['w']

    def check(expected, what):
        worst = max(float(np.max(np.abs(o - expected))) for o in outs)
        if worst > tolerance * max(1.0, abs(expected)):
            errors.append(f'{what}: expected {expected}, max abs err {worst}')

    first_push = time.monotonic()
    for c in range(args.check_rounds):
        scale = float(c + 3)
        one_round([np.full(n, scale * (rank + 1), dtype=np.float32) for _ in keys])
        check(expect(scale), f'check round {c}')
    compressing = args.compress != 'none' or args.compress_pull != 'none'
    settle = args.settle if args.settle is not None else 10.0 * compressing
    time.sleep(max(0.0, first_push + settle - time.monotonic()))   # every node's casts ready
    for _ in range(args.warmup):
        one_round(push_vals)
        expect(1.0)

    # (checked before the barrier: rank 0's first switch may pause this process after it)
    blocks = TimelineBlocks(kv, args.tag, rank) if args.timeline_blocks else None
    kv.barrier()
    cpu0 = _common.job_thread_cpu(args.tag) if rank == 0 and args.tag else None
    w0_wall = time.perf_counter()
    times, push_t, pull_t = [], [], []
    for r in range(args.rounds):
        if blocks is not None and r % args.timeline_blocks == 0:
            blocks.switch()
        tp, tl = one_round(push_vals)
        expect(1.0)
        push_t.append(tp)
        pull_t.append(tl)
        times.append(tp + tl)
        if blocks is not None:
            blocks.count(r % args.timeline_blocks)
    check(sum_ranks if args.optimizer == 'none' else state['w'], 'after timed rounds')
    if blocks is not None:
        blocks.switch()   # (the last block's CPU counted)
    kv.barrier()
    window = time.perf_counter() - w0_wall
    cpu = None
    if cpu0 is not None:
        cpu = _common.cpu_delta(cpu0, _common.job_thread_cpu(args.tag))
    kv.barrier()   # nobody closes (ending its threads) before rank 0 has read the counters

    med = statistics.median(times)
    rec = {
        'system': 'kvps-dist_sync', 'pushpull': args.pushpull, 'per_key': args.per_key,
        'kvps_version': kvps.__version__, 'pid': os.getpid(),
        'compress': args.compress, 'compress_pull': args.compress_pull,
        'rank': rank, 'num_workers': nworkers,
        'num_servers': int(os.environ.get('DMLC_NUM_SERVER', '0')),
        'keys': args.keys, 'floats_per_key': n, 'total_bytes': actual_bytes,
        'optimizer': args.optimizer, 'rounds': args.rounds,
        'round_times_s': times, 'push_times_s': push_t, 'pull_times_s': pull_t,
        'median_step_s': med, 'min_step_s': min(times),
        'median_push_s': statistics.median(push_t), 'median_pull_s': statistics.median(pull_t),
        'per_worker_algbw_GBps': 2 * actual_bytes / med / 1e9,
        'startup_s': t_connected - t_start, 'correct': not errors, 'errors': errors,
        'cpu_window_s': window, 'cpu_s': cpu,
    }
    if blocks is not None:
        rec.update(blocks.record())
    _common.write_worker_record(
        args.out, rank, rec, f'[kvps worker {rank}/{nworkers}] keys={args.keys} '
        f'bytes={actual_bytes} opt={args.optimizer} median_step={med * 1e3:.2f} ms '
        f'algbw={rec["per_worker_algbw_GBps"]:.3f} GB/s correct={rec["correct"]}')
    kv.close()
    return 0 if not errors else 3


if __name__ == '__main__':
    sys.exit(main())
