#!/usr/bin/env python
"""Worker of bench_rows: times push of some rows of an embedding table + row_sparse_pull of them.

Run by bench_rows.py on every worker of a kvps job (DMLC_* variables set by the launcher), and
(``--system mxnet``) on every process of an MXNet ps-lite cluster under MXNet's python: the
same file, so that the two systems run the same steps from the same random ids.

One step of ``--mode rows``: push the gradient of B random row ids (repeats allowed) of a
V x D float32 table, then pull those rows (kvps: ``kv.push(key, kvps.RowSparse(ids, rows))``
and ``kv.row_sparse_pull``; MXNet: a RowSparseNDArray, whose ids must be sorted and unique, so
the worker sums repeated rows itself inside the timed step, as kvps does inside push).
``--mode dense`` (kvps only): push the whole table's gradient and pull the whole table, what
kvps users did before rows existed (the dense gradient is built before the timed rounds).

Before timing, one check round from a zero table: the rows pulled must equal the sum over
workers of their pushed rows (no optimizer), or -lr times it (server SGD, lazy). Every worker
draws every worker's ids from seeds (seed, round, rank), so each can compute that sum.
Writes <out>/worker<rank>.json.
"""
import argparse
import importlib
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402  (benchmarks/ is not a package; stdlib only, so MXNet's python too)

SETS = 4          # distinct random batches, cycled through the rounds


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument('--system', choices=['kvps', 'mxnet'], default='kvps')
    p.add_argument('--mode', choices=['rows', 'dense'], default='rows')
    p.add_argument('--num-rows', type=int, default=200000)
    p.add_argument('--width', type=int, default=64)
    p.add_argument('--batch', type=int, default=4096, help='row ids pushed per worker per step')
    p.add_argument('--rounds', type=int, default=30)
    p.add_argument('--warmup', type=int, default=3)
    p.add_argument('--optimizer', choices=['none', 'sgd'], default='none')
    p.add_argument('--lr', type=float, default=0.01)
    p.add_argument('--seed', type=int, default=1)
    p.add_argument('--out', required=True, help='directory for worker<rank>.json')
    return p.parse_args()


def batch(args, np, round_no, rank):
    """(ids with repeats, rows) a worker pushes in round ``round_no``: small integers, so
    sums are exact in float32."""
    rng = np.random.default_rng([args.seed, round_no, rank])
    ids = rng.integers(0, args.num_rows, args.batch, dtype=np.int64)
    rows = rng.integers(-4, 5, (args.batch, args.width)).astype(np.float32)
    return ids, rows


def expected_rows(args, np, round_no, nworkers, ids):
    """Rows ``ids`` (sorted, unique) of the sum over workers of their round's pushes."""
    total = np.zeros((args.num_rows, args.width), np.float32)
    for r in range(nworkers):
        i, v = batch(args, np, round_no, r)
        np.add.at(total, i, v)
    return total[ids]


def coalesce(np, ids, rows):
    """Sorted unique ids and the sum of each one's rows (MXNet wants them so)."""
    uniq, inverse = np.unique(ids, return_inverse=True)
    summed = np.zeros((uniq.size, rows.shape[1]), rows.dtype)
    np.add.at(summed, inverse, rows)
    return uniq, summed


class KvpsTable:
    """The table through kvps: rows, or (mode dense) the whole table each way."""

    def __init__(self, args, np):
        import kvps
        self.np, self.args, self.kvps = np, args, kvps
        self.kv = kvps.create('dist_sync')
        self.rank, self.nworkers = self.kv.rank, self.kv.num_workers
        shape = (args.num_rows, args.width)
        self.kv.init(0, np.zeros(shape, np.float32))
        if args.optimizer == 'sgd':
            import kvps.optimizer
            self.kv.set_optimizer(kvps.optimizer.create('sgd', learning_rate=args.lr,
                                                        lazy_update=True))
        self.table = np.zeros(shape, np.float32)

    def prepare(self, ids, rows):
        if self.args.mode == 'rows':
            return ids, rows
        dense = self.np.zeros_like(self.table)
        self.np.add.at(dense, ids, rows)
        return ids, dense

    def step(self, prepared):
        ids, value = prepared
        if self.args.mode == 'dense':
            self.kv.push(0, value)
            self.kv.pull(0, out=self.table)
            return
        self.kv.push(0, self.kvps.RowSparse(ids, value))
        self.kv.row_sparse_pull(0, out=self.table, row_ids=ids)

    def rows(self, ids):
        return self.table[ids]

    def barrier(self):
        self.kv.barrier()

    def close(self):
        self.kv.close()


class MxnetTable:
    """The table through MXNet's dist_sync KVStore as a row_sparse key."""

    def __init__(self, args, np):
        import mxnet as mx
        self.np, self.args, self.mx = np, args, mx
        self.kv = mx.kv.create('dist_sync')
        self.rank, self.nworkers = self.kv.rank, self.kv.num_workers
        self.shape = (args.num_rows, args.width)
        # every row present (zeros): MXNet refuses to init a row_sparse key without rows
        every = np.arange(args.num_rows, dtype=np.int64)
        self.kv.init(0, mx.nd.sparse.row_sparse_array(
            (np.zeros(self.shape, np.float32), every), shape=self.shape))
        if args.optimizer == 'sgd':
            self.kv.set_optimizer(mx.optimizer.SGD(learning_rate=args.lr, momentum=0.0, wd=0.0,
                                                   rescale_grad=1.0, lazy_update=True))
            self.kv._barrier()   # nobody pushes before the servers have it
        self.out = mx.nd.sparse.zeros('row_sparse', self.shape)

    def prepare(self, ids, rows):
        return ids, rows

    def step(self, prepared):
        mx = self.mx
        ids, rows = coalesce(self.np, *prepared)
        grad = mx.nd.sparse.row_sparse_array((rows, ids), shape=self.shape)
        self.kv.push(0, grad)
        self.kv.row_sparse_pull(0, out=self.out, row_ids=mx.nd.array(ids, dtype='int64'))
        self.out.wait_to_read()

    def rows(self, ids):
        got_ids = self.out.indices.asnumpy()
        data = self.out.data.asnumpy()
        where = self.np.searchsorted(got_ids, ids)
        if got_ids.size != ids.size or not (got_ids[where] == ids).all():
            return self.np.full((ids.size, self.args.width), self.np.nan, self.np.float32)
        return data[where]

    def barrier(self):
        self.kv._barrier()

    def close(self):
        self.mx.nd.waitall()


def main():
    args = parse_args()
    if args.system == 'mxnet' and os.environ.get('DMLC_ROLE', 'worker') != 'worker':
        importlib.import_module('mxnet')   # scheduler / server: runs until the workers end
        return 0
    t_start = time.perf_counter()
    import numpy as np
    store = (KvpsTable if args.system == 'kvps' else MxnetTable)(args, np)
    rank, nworkers = store.rank, store.nworkers
    t_connected = time.perf_counter()

    errors = []
    ids, rows = batch(args, np, 0, rank)     # the check round, from a zero table
    store.step(store.prepare(ids, rows))
    want_ids = np.unique(ids)
    want = expected_rows(args, np, 0, nworkers, want_ids)
    if args.optimizer == 'sgd':
        want = -args.lr * want
    worst = float(np.max(np.abs(store.rows(want_ids) - want)))
    if not worst <= 1e-4 * max(1.0, float(np.max(np.abs(want)))):
        errors.append(f'check round: max abs error {worst} over {want_ids.size} rows')

    prepared = [store.prepare(*batch(args, np, 1 + s, rank)) for s in range(SETS)]
    unique_rows = [np.unique(p[0]).size for p in prepared]
    for r in range(args.warmup):
        store.step(prepared[r % SETS])
    store.barrier()
    times = []
    for r in range(args.rounds):
        t0 = time.perf_counter()
        store.step(prepared[r % SETS])
        times.append(time.perf_counter() - t0)
    store.barrier()

    med = statistics.median(times)
    rec = {'system': args.system, 'mode': args.mode, 'rank': rank, 'num_workers': nworkers,
           'num_servers': int(os.environ.get('DMLC_NUM_SERVER', '0')),
           'num_rows': args.num_rows, 'width': args.width, 'batch': args.batch,
           'unique_rows_mean': statistics.mean(unique_rows), 'optimizer': args.optimizer,
           'rounds': args.rounds, 'round_times_s': times, 'median_step_s': med,
           'min_step_s': min(times), 'startup_s': t_connected - t_start,
           'correct': not errors, 'errors': errors, 'pid': os.getpid()}
    _common.write_worker_record(
        args.out, rank, rec, f'[{args.system} rows worker {rank}/{nworkers}] mode={args.mode} '
        f'opt={args.optimizer} median_step={med * 1e3:.2f} ms correct={rec["correct"]}')
    store.close()
    return 0 if not errors else 3


if __name__ == '__main__':
    sys.exit(main())
