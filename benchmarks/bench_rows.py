#!/usr/bin/env python
"""Push+pull of some rows of a big embedding table: kvps rows beside MXNet's row_sparse KVStore.

One step per worker = push the gradient of B random row ids (repeats allowed) of a V x D
float32 table, then pull those same rows; dist_sync, with no optimizer and with server-side
SGD (lazy update: only the rows pushed change). Systems, one fresh cluster each:

  kvps_rows    kv.push(0, kvps.RowSparse(ids, rows)) + kv.row_sparse_pull(0, out, row_ids=ids)
  mxnet_rows   Apache MXNet 1.9 ps-lite, a row_sparse key: push a RowSparseNDArray (ids summed
               and sorted by the worker, inside the step) + kv.row_sparse_pull
  kvps_dense   kv.push(0, whole-table gradient) + kv.pull(0, out=table): what kvps did before
               rows existed (the dense gradient is built outside the timed step)

Configs: w2s1 and w2s2 (W workers, S servers; V=200000, D=64: 51 MB; B=4096 per worker).
step_ms is the median over workers of each worker's median timed step, then the median
launch (3 fresh clusters per system, systems in turns); bytes_per_step is the
payload one worker sends plus receives per step (ids as int64 and float32 rows; the dense
table both ways), not counting message headers. Then a 'ratios' line per (config, optimizer):
kvps_rows vs mxnet_rows and kvps_rows vs kvps_dense (>1: kvps_rows is faster). Every cluster
shares this box's cores; expect 10-30% noise. The MXNet cluster runs in a network namespace
of its own (loopback only) where ``unshare -n`` works. JSON lines on stdout and in
<out>/results.jsonl; progress on stderr.

MXNet 1.9.1 without a server optimizer fails the check (its servers answer the pull with
other values than the round's sum of a row_sparse push; with SGD it is right): its
optimizer 'none' line says correct: false, and its time is not a like-for-like figure.

  python benchmarks/bench_rows.py                 # both configs, both optimizers (~4 min)
  python benchmarks/bench_rows.py --quick         # w2s1, no optimizer, few rounds (~1 min)
  python benchmarks/bench_rows.py --configs w2s2 --optimizer sgd --systems kvps_rows,mxnet_rows
"""
import argparse
import os
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402

BENCH = 'rows'
WORKER = str(Path(__file__).resolve().parent / 'rows_worker.py')
CONFIGS = {'w2s1': (2, 1), 'w2s2': (2, 2)}    # name: (workers, servers)
SYSTEMS = ('kvps_rows', 'mxnet_rows', 'kvps_dense')
ID_BYTES, VALUE_BYTES = 8, 4


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--quick', action='store_true',
                   help='smoke run: w2s1 only, no optimizer, few rounds')
    p.add_argument('--configs', default=None, help=f'comma list of {", ".join(CONFIGS)}')
    p.add_argument('--systems', default=','.join(SYSTEMS))
    p.add_argument('--optimizer', choices=['none', 'sgd', 'both'], default=None,
                   help='default both; quick none')
    p.add_argument('--num-rows', type=int, default=200000)
    p.add_argument('--width', type=int, default=64)
    p.add_argument('--batch', type=int, default=4096)
    p.add_argument('--lr', type=float, default=0.01)
    p.add_argument('--rounds', type=int, default=None,
                   help='timed steps (default 30 rows / 8 dense; quick 10 / 3)')
    p.add_argument('--launches', type=int, default=None,
                   help='fresh clusters per system, taken in turns; step_ms is the launch with '
                        'the median step (default 3; quick 1)')
    p.add_argument('--timeout', type=int, default=180, help='seconds allowed per cluster run')
    p.add_argument('--out', default=None, help='output directory (default /tmp/kvps-bench/...)')
    args = p.parse_args(argv)
    args.configs = (args.configs or ('w2s1' if args.quick else ','.join(CONFIGS))).split(',')
    args.systems = args.systems.split(',')
    bad = [c for c in args.configs if c not in CONFIGS] + [s for s in args.systems
                                                           if s not in SYSTEMS]
    if bad:
        p.error(f'unknown {bad}; configs: {", ".join(CONFIGS)}; systems: {", ".join(SYSTEMS)}')
    optimizer = args.optimizer or ('none' if args.quick else 'both')
    args.optimizers = ['none', 'sgd'] if optimizer == 'both' else [optimizer]
    args.launches = args.launches or (1 if args.quick else 3)
    args.out = Path(args.out) if args.out else C.default_out_dir(BENCH)
    return args


def rounds_for(args, system):
    if args.rounds:
        return args.rounds
    dense = system == 'kvps_dense'
    return (3 if dense else 10) if args.quick else (8 if dense else 30)


# -- MXNet cluster -----------------------------------------------------------------------------
def netns_works():
    try:
        return subprocess.run(['unshare', '-n', 'true'], capture_output=True,
                              timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def run_mxnet_job(workers, servers, worker_args, out_dir, timeout):
    """One MXNet ps-lite cluster running rows_worker.py under MXNet's python (every process
    the same script, the role from DMLC_ROLE), in a loopback-only network namespace when
    ``unshare -n`` works. Returns (rc, log text, wall seconds, netns used)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    inner = [C.PY, os.path.abspath(__file__), '--mxnet-cluster', str(workers), str(servers),
             str(out_dir), str(timeout), '--', *worker_args]
    netns = netns_works()
    if netns:
        inner = ['unshare', '-n', 'bash', '-c', 'ip link set lo up && exec "$0" "$@"', *inner]
    env = dict(os.environ, OMP_NUM_THREADS='1', PYTHONUNBUFFERED='1')
    rc, log, wall = C._run_bounded(inner, env, timeout + 30, out_dir / 'cluster.log')
    return rc, log, wall, netns


def mxnet_cluster(workers, servers, out_dir, timeout, worker_args):
    """Inside the namespace: scheduler, servers and workers on 127.0.0.1 at a port the OS
    chose; waits for the workers, then makes sure every process has ended."""
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        port = s.getsockname()[1]
    env = dict(os.environ, DMLC_PS_ROOT_URI='127.0.0.1', DMLC_PS_ROOT_PORT=str(port),
               DMLC_NUM_SERVER=str(servers), DMLC_NUM_WORKER=str(workers),
               DMLC_NODE_HOST='127.0.0.1', DMLC_INTERFACE='lo')
    argv = [str(C.peer_pythons()['mxnet']), WORKER, '--system', 'mxnet', *worker_args]
    roles = ['scheduler'] + ['server'] * servers + ['worker'] * workers
    procs, rc = [], 0
    try:
        for i, role in enumerate(roles):
            with open(Path(out_dir) / f'{role}{i}.log', 'w') as log:
                procs.append(subprocess.Popen(argv, env=dict(env, DMLC_ROLE=role), stdout=log,
                                              stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                              start_new_session=True))
        deadline = time.monotonic() + timeout
        for proc in procs[1 + servers:]:
            rc = rc or proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        for proc in procs[:1 + servers]:   # they end once the workers have finalized
            proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        rc = rc or 124
    finally:
        for proc in procs:
            if proc.poll() is None:
                C._stop_group(proc, grace=2.0)
    for path in sorted(Path(out_dir).glob('*.log')):
        if path.name != 'cluster.log':
            print(f'--- {path.name}\n{path.read_text(errors="replace")[-1500:]}')
    return rc


# -- one measurement -----------------------------------------------------------------------------
def measure(args, cfg, system, opt, run_dir):
    W, S = CONFIGS[cfg]
    rounds = rounds_for(args, system)
    worker_args = ['--mode', 'dense' if system == 'kvps_dense' else 'rows',
                   '--num-rows', str(args.num_rows), '--width', str(args.width),
                   '--batch', str(args.batch), '--rounds', str(rounds),
                   '--warmup', '1' if args.quick else '3', '--optimizer', opt,
                   '--lr', str(args.lr), '--out', str(run_dir)]
    extra = {}
    if system == 'mxnet_rows':
        rc, log, wall, netns = run_mxnet_job(W, S, worker_args, run_dir, args.timeout)
        extra['netns'] = netns
    else:
        argv = [C.PY, WORKER, '--system', 'kvps', *worker_args]
        rc, log, wall, launcher = C.run_kvps_job(W, S, argv, run_dir, args.timeout,
                                                 tag=uuid.uuid4().hex[:12])
        extra['launcher'] = launcher
    records = C.read_worker_records(run_dir, W)
    step = C.median([r['median_step_s'] for r in records])
    unique = C.median([r['unique_rows_mean'] for r in records])
    rec = {'kind': 'measurement', 'system': system, 'config': cfg, 'optimizer': opt,
           'workers': W, 'servers': S, 'num_rows': args.num_rows, 'width': args.width,
           'batch': args.batch, 'unique_rows_per_worker': unique, 'rounds': rounds,
           'step_ms': round(step * 1e3, 3) if step else None,
           'step_ms_per_worker': [round(r['median_step_s'] * 1e3, 3) for r in records],
           'bytes_per_step': bytes_per_step(args, system, unique) if records else None,
           'correct': len(records) == W and all(r['correct'] for r in records),
           'rc': rc, 'wall_s': round(wall, 2), **extra}
    if rc != 0 or len(records) < W or not rec['correct']:
        rec['error'] = log[-1500:] + ''.join(e for r in records for e in r['errors'])
    return rec


def median_launch(runs):
    """The launch whose step is the median (the lower of the middle two), with every
    launch's step listed; a launch that failed makes the whole record say so."""
    timed = sorted((r for r in runs if r['step_ms']), key=lambda r: r['step_ms'])
    rec = dict(timed[(len(timed) - 1) // 2] if timed else runs[-1])
    rec['launch_step_ms'] = [r['step_ms'] for r in runs]
    rec['correct'] = all(r['correct'] for r in runs)
    return rec


def bytes_per_step(args, system, unique_rows):
    """Payload one worker sends + receives per step: rows pushed (ids and values), the ids
    asked for and the rows received; or the whole table both ways."""
    row = ID_BYTES + VALUE_BYTES * args.width
    if system == 'kvps_dense':
        return 2 * VALUE_BYTES * args.width * args.num_rows
    return int(unique_rows * (2 * row + ID_BYTES))


def ratios(cfg, opt, recs):
    """kvps_rows beside MXNet's rows and beside kvps's dense push+pull (>1: kvps_rows faster)."""
    mine = recs.get('kvps_rows', {}).get('step_ms')
    line = {'kind': 'ratios', 'config': cfg, 'optimizer': opt,
            **{f'{s}_step_ms': r.get('step_ms') for s, r in recs.items()},
            'correct': {s: r.get('correct') for s, r in recs.items()}}
    for other in ('mxnet_rows', 'kvps_dense'):
        theirs = recs.get(other, {}).get('step_ms')
        line[f'speedup_vs_{other}'] = round(theirs / mine, 3) if mine and theirs else None
    dense, rows = recs.get('kvps_dense', {}), recs.get('kvps_rows', {})
    if dense.get('bytes_per_step') and rows.get('bytes_per_step'):
        line['bytes_fraction_of_dense'] = round(rows['bytes_per_step'] /
                                                dense['bytes_per_step'], 4)
    return line


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ['--mxnet-cluster']:   # the MXNet cluster, started by run_mxnet_job
        workers, servers, out_dir, timeout = argv[1:5]
        return mxnet_cluster(int(workers), int(servers), out_dir, float(timeout), argv[6:])
    args = parse_args(argv)
    out = C.JsonLines(args.out, BENCH)
    notes = []
    if 'mxnet_rows' in args.systems and not C.peer_pythons()['mxnet'].exists():
        notes.append(f'mxnet_rows skipped: no {C.peer_pythons()["mxnet"]} '
                     f'(bash {C.PEERS_DIR}/install.sh installs it)')
        args.systems.remove('mxnet_rows')
    out.emit({'kind': 'meta', 'configs': args.configs, 'systems': args.systems,
              'optimizers': args.optimizers, 'num_rows': args.num_rows, 'width': args.width,
              'batch': args.batch, 'table_bytes': VALUE_BYTES * args.width * args.num_rows,
              'lr': args.lr, 'cpus': os.cpu_count(), 'quick': args.quick,
              'out_dir': str(args.out), 'notes': notes,
              'launches': args.launches,
              'statistic': 'step_ms = median over workers of each worker\'s median timed step, '
                           'then the median launch; the box is shared: expect 10-30% noise'})
    for cfg in args.configs:
        for opt in args.optimizers:
            runs = {system: [] for system in args.systems}
            for launch in range(args.launches):   # in turns: drift of the box hits all alike
                for system in args.systems:
                    C.note(f'{cfg} optimizer={opt}: {system} (launch {launch + 1})')
                    runs[system].append(measure(args, cfg, system, opt, args.out / cfg /
                                                f'{system}-{opt}' / f'launch{launch}'))
            recs = {system: out.emit(median_launch(r)) for system, r in runs.items()}
            out.emit(ratios(cfg, opt, recs))
    C.note(f'results in {out.path}')
    return 0


if __name__ == '__main__':
    sys.exit(main())
