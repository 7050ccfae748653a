#!/usr/bin/env python
"""Push+pull throughput and step time of kvps dist_sync, beside MXNet ps-lite and gloo all-reduce.

One step = kv.push(every key) then kv.pull(every key); step_ms is the median over the timed
rounds (after warm-up) of each worker, then the median over workers. gbps_per_worker is
2 * total_bytes / step time (bytes pushed + bytes pulled per worker per second), the figure
the peers' benchmarks report. Configurations (W workers, S servers, float32 keys):

  w2s1-4mb   W=2 S=1, 40 keys, 4 MiB in all ("many small keys")
  w2s1-64mb  W=2 S=1, 16 keys, 64 MiB in all ("few large keys")
  w4s2-4mb   W=4 S=2, 40 keys, 4 MiB
  w4s2-64mb  W=4 S=2, 16 keys, 64 MiB
  w2s1-400keys  W=2 S=1, 400 keys, 4 MiB (a model's biases and norms, key by key)
  w2s1-256mb W=2 S=1, 1 key of 256 MiB (an LM head or a dense embedding table)

For each, in the same invocation: kvps (no optimizer and/or server-side SGD), MXNet dist_sync
(same optimizer), torch.distributed gloo all-reduce per tensor and over one flat buffer; then a
'ratios' line. Output: JSON lines on stdout and in <out>/results.jsonl; progress on stderr.
All processes share this box's cores (7 processes on 2 cores for W=4/S=2): figures are noisy,
compare the ratios of one run, not absolute values across runs.

  python benchmarks/bench_pushpull.py                  # full run (~10 min on 2 cores)
  python benchmarks/bench_pushpull.py --quick          # smoke run (~1 min)
  python benchmarks/bench_pushpull.py --configs w2s1-64mb --optimizer sgd --profile
"""
import argparse
import os
import sys
import uuid
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402
from _common import MiB  # noqa: E402

BENCH = 'pushpull'
WORKER = Path(__file__).resolve().parent / 'pushpull_worker.py'
CONFIGS = {  # name: (workers, servers, keys, total bytes)
    'w2s1-4mb': (2, 1, 40, 4 * MiB), 'w2s1-64mb': (2, 1, 16, 64 * MiB),
    'w4s2-4mb': (4, 2, 40, 4 * MiB), 'w4s2-64mb': (4, 2, 16, 64 * MiB),
    # a model's many small tensors (biases, norms): what a key costs beyond its bytes
    'w2s1-400keys': (2, 1, 400, 4 * MiB),
    # one huge tensor: what cutting keys into parts (KVPS_PARTITION_BYTES) is for
    'w2s1-256mb': (2, 1, 1, 256 * MiB),
}
GLOO_MODES = {'async': 'allreduce_per_tensor', 'coalesced': 'allreduce_flat'}
PEER_KEYS = {('mxnet', 'dist_sync'): 'mxnet', ('gloo', 'allreduce_per_tensor'): 'gloo_per_tensor',
             ('gloo', 'allreduce_flat'): 'gloo_flat'}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--quick', action='store_true',
                   help='smoke run: W=2/S=1 only, few rounds, no SGD variant, no ceilings')
    p.add_argument('--configs', default=None,
                   help=f'comma list of {", ".join(CONFIGS)} (default: all; --quick: w2s1-*)')
    p.add_argument('--rounds', type=int, default=None,
                   help='timed rounds per run (default 30 for 4 MiB, 10 for 64 MiB; quick 5/3)')
    p.add_argument('--warmup', type=int, default=None, help='warm-up rounds (default 2; quick 1)')
    p.add_argument('--optimizer', choices=['none', 'sgd', 'both'], default=None,
                   help='kvps/MXNet without optimizer, with server-side SGD, or both '
                        '(default both; quick none)')
    p.add_argument('--peers', default='mxnet,gloo',
                   help="peers to run beside kvps: comma list of mxnet, gloo, or 'none'")
    p.add_argument('--ceilings', action=argparse.BooleanOptionalAction, default=None,
                   help='also measure the raw memcpy / pyzmq ceilings (default: on; quick off)')
    p.add_argument('--launches', type=int, default=1,
                   help='fresh clusters per measurement; step_ms is the median over them')
    p.add_argument('--profile', action='store_true',
                   help='after measuring, rerun kvps for each config under py-spy and '
                        'report where worker and server time goes')
    p.add_argument('--pushpull', action='store_true',
                   help='kvps rounds as one kv.pushpull each (default: push then pull, as '
                        "MXNet's benchmark steps)")
    p.add_argument('--per-key', action='store_true',
                   help="kvps rounds of one call per key, as MXNet's Gluon Trainer makes them: "
                        'every push, then every pull_begin, then the waits (the peers keep '
                        'their own rounds)')
    p.add_argument('--timeline', action='store_true',
                   help='after measuring, run kvps for each config with its timeline recording '
                        'and paused in blocks of rounds (--launches launches): its cost, and '
                        'where a step goes')
    p.add_argument('--timeout', type=int, default=300, help='seconds allowed per cluster run')
    p.add_argument('--out', default=None, help='output directory (default /tmp/kvps-bench/...)')
    args = p.parse_args(argv)
    names = args.configs or ('w2s1-4mb,w2s1-64mb' if args.quick else ','.join(CONFIGS))
    args.configs = [c.strip().lower() for c in names.split(',') if c.strip()]
    bad = [c for c in args.configs if c not in CONFIGS]
    if bad:
        p.error(f'unknown config(s) {bad}; known: {", ".join(CONFIGS)}')
    if args.pushpull and args.per_key:
        p.error('--pushpull and --per-key are two kinds of rounds: give one')
    args.optimizer = args.optimizer or ('none' if args.quick else 'both')
    args.optimizers = ['none', 'sgd'] if args.optimizer == 'both' else [args.optimizer]
    args.warmup = args.warmup if args.warmup is not None else (1 if args.quick else 2)
    args.ceilings = (not args.quick) if args.ceilings is None else args.ceilings
    args.peers = set() if args.peers == 'none' else {x.strip() for x in args.peers.split(',')}
    args.out = Path(args.out) if args.out else C.default_out_dir(BENCH)
    return args


def rounds_for(args, total_bytes):
    if args.rounds:
        return args.rounds
    small = total_bytes <= 8 * MiB
    if args.quick:
        return 5 if small else 3
    return 30 if small else 10 if total_bytes <= 64 * MiB else 5


def optimizer_available():
    try:
        import kvps.optimizer as opt
        opt.create('sgd', learning_rate=0.1).to_spec()
        return True, ''
    except Exception as exc:  # being written concurrently: report, do not fail the run
        return False, f'kvps.optimizer not usable: {type(exc).__name__}: {exc}'


# -- one measurement per system --------------------------------------------------------------
def _summary(records, total_bytes, extra):
    steps = [r['median_step_s'] for r in records]
    step = C.median(steps)
    out = {'step_ms': round(step * 1e3, 3) if step else None,
           'gbps_per_worker': round(2 * total_bytes / step / 1e9, 4) if step else None,
           'step_ms_per_worker': [round(s * 1e3, 3) for s in steps],
           'correct': bool(records) and all(r.get('correct', False) for r in records)}
    out.update(extra)
    return out


def _median_of_launches(runs):
    """Combine launches: the run whose step is the median; all launch steps listed."""
    ok = sorted((r for r in runs if r.get('step_ms')), key=lambda r: r['step_ms'])
    if not ok:
        return runs[-1]
    best = dict(ok[(len(ok) - 1) // 2])
    best['launch_step_ms'] = [r['step_ms'] for r in ok]
    best['launches'] = len(runs)
    return best


def measure_kvps(args, cfg, opt, rounds, run_dir, wrap=(), launcher_args=(), worker_args=()):
    W, S, keys, total = CONFIGS[cfg]
    tag = uuid.uuid4().hex[:12]
    argv = [C.PY, str(WORKER), '--keys', str(keys), '--total-bytes', str(total),
            '--rounds', str(rounds), '--warmup', str(args.warmup), '--optimizer', opt,
            '--out', str(run_dir), '--tag', tag, '--check-rounds', '1' if args.quick else '2',
            *(['--pushpull'] if args.pushpull else []),
            *(['--per-key'] if args.per_key else []), *worker_args]
    rc, log, wall, launcher = C.run_kvps_job(W, S, argv, run_dir, args.timeout, tag, wrap,
                                             launcher_args)
    records = C.read_worker_records(run_dir, W)
    extra = {'launcher': launcher, 'rc': rc, 'wall_s': round(wall, 2)}
    if records:
        extra['push_ms'] = round(C.median([r['median_push_s'] for r in records]) * 1e3, 3)
        extra['pull_ms'] = round(C.median([r['median_pull_s'] for r in records]) * 1e3, 3)
        root = next((r for r in records if r.get('cpu_s')), None)
        if root:
            extra['cpu_ms_per_step'] = {
                label: {k: round(v * 1e3 / rounds, 2) for k, v in u.items() if k != 'pid'}
                for label, u in sorted(root['cpu_s'].items()) if label != 'scheduler'}
            busy = C.cpu_seconds(root['cpu_s'])
            extra['cpu_busy_fraction'] = round(busy / root['cpu_window_s'] / os.cpu_count(), 3)
    if rc != 0 or len(records) < W:
        extra['error'] = log[-1500:]
    return _summary(records, total, extra)


def measure_mxnet(args, cfg, opt, rounds, run_dir):
    W, S, keys, total = CONFIGS[cfg]
    rc, log, wall = C.run_peer_script(
        'run_mxnet_bench.sh', [W, S, run_dir, '--keys', keys, '--total-bytes', total,
                               '--rounds', rounds, '--warmup', args.warmup, '--optimizer', opt,
                               '--lr', 0.1],
        run_dir, args.timeout)
    return _peer_summary(run_dir, W, total, rc, log, wall)


def _peer_summary(run_dir, workers, total, rc, log, wall):
    """Summarize a peer run from its workers' records, with the log tail if it failed."""
    records = C.read_worker_records(run_dir, workers)
    extra = {'rc': rc, 'wall_s': round(wall, 2)}
    if rc != 0 or len(records) < workers:
        extra['error'] = log[-1500:]
    return _summary(records, records[0]['total_bytes'] if records else total, extra)


def measure_gloo(args, cfg, mode, rounds, run_dir):
    W, _, keys, total = CONFIGS[cfg]
    rc, log, wall = C.run_peer_script(
        'run_gloo_bench.sh', [W, run_dir, '--keys', keys, '--total-bytes', total,
                              '--rounds', rounds, '--warmup', args.warmup, '--mode', mode],
        run_dir, args.timeout)
    return _peer_summary(run_dir, W, total, rc, log, wall)


def _record(system, mode, cfg, opt, rounds, result, shape=None):
    W, S, keys, total = shape or CONFIGS[cfg]
    return {'kind': 'measurement', 'system': system, 'mode': mode, 'optimizer': opt,
            'config': cfg, 'workers': W, 'servers': S, 'keys': keys, 'total_bytes': total,
            'step_ms': result.pop('step_ms'), 'gbps_per_worker': result.pop('gbps_per_worker'),
            'rounds': rounds, **result}


def _launches(args, fn, *fargs, run_dir):
    runs = [fn(args, *fargs, run_dir / f'launch{i}') for i in range(args.launches)]
    return _median_of_launches(runs)


def ratios(cfg, opt, kvps_rec, peers, ceilings, shape=None):
    """kvps beside each peer for one configuration (``shape``: its (W, S, keys, bytes))."""
    W, S, keys, total = shape or CONFIGS[cfg]
    line = {'kind': 'ratios', 'config': cfg, 'optimizer': opt, 'workers': W, 'servers': S,
            'keys': keys, 'total_bytes': total, 'kvps_step_ms': kvps_rec['step_ms'],
            'kvps_gbps_per_worker': kvps_rec['gbps_per_worker']}
    k = kvps_rec['step_ms']
    for name, rec in peers.items():
        p = rec['step_ms'] if rec else None
        line[f'{name}_step_ms'] = p
        line[f'{name}_gbps_per_worker'] = rec['gbps_per_worker'] if rec else None
        line[f'speedup_vs_{name}'] = round(p / k, 3) if p and k else None   # >1: kvps faster
        line[f'ratio_vs_{name}'] = round(k / p, 3) if p and k else None     # >1: kvps slower
    if ceilings.get('zmq_echo') and kvps_rec['gbps_per_worker']:
        line['fraction_of_zmq_echo'] = round(kvps_rec['gbps_per_worker'] / ceilings['zmq_echo'], 3)
    return line


# -- profile -----------------------------------------------------------------------------
# Where a sampled Python stack's time goes: walking from the leaf towards the root, the first
# frame matching a rule (function name's last part or '', file substring) names the category;
# a kvps loop frame reached first means plain Python overhead; no loop frame at all: startup.
PROFILE_RULES = (
    ('_find_and_load', 'importlib', 'startup'),
    ('poll', 'zmq/sugar/poll.py', 'waiting (poll, Event.wait)'),
    ('wait', 'threading.py', 'waiting (poll, Event.wait)'),
    ('run', 'zmq/utils/garbage.py', 'waiting (poll, Event.wait)'),  # pyzmq GC thread's recv
    ('', 'updater.py', 'optimizer update'), ('', '_kernels', 'optimizer update'),
    ('flat_copy', 'arrays.py', 'copy: push value'), ('copy', 'placement.py', 'copy: pull snapshot'),
    ('_add_to_round', 'shard.py', 'copy/add: merge'), ('_apply', 'shard.py', 'copy/add: merge'),
    ('on_data', 'worker/messages.py', 'copy: pull into out'),
    ('_send_data', 'server/loop.py', 'copy: pull into shared memory'),
    ('', 'zmq/', 'zmq calls (send/recv, zero-copy GC)'),
    ('', 'transport.py', 'zmq calls (send/recv, zero-copy GC)'),
    ('', 'protocol.py', 'protocol (msgpack, validation)'),
    ('', 'pushpull_worker.py', 'benchmark harness (checks, fills)'),
)
LOOP_FRAMES = ('Server.run', 'WorkerIO.run', 'main.<locals>.one_round', 'KVStore.')
LOOP_FILES = ('pushpull_worker.py',)


def _category(frames):
    for frame in reversed(frames):
        name, _, where = frame.partition(' (')
        short = name.rsplit('.', 1)[-1]
        for want_name, want_file, category in PROFILE_RULES:
            if (not want_name or want_name == short) and want_file in where:
                return category
        if name.startswith(LOOP_FRAMES) or any(f in where for f in LOOP_FILES):
            return 'python overhead (API, queues, bookkeeping)'
    return 'startup'


def _leaf(frames):
    return frames[-1].rsplit(':', 1)[0] + ')' if frames else '?'


def profile(args, out, cfg, opt):
    """Rerun kvps for ``cfg`` under py-spy (every process, raw stacks) and summarize each node:
    sampled Python time by category, top leaf functions, and CPU per thread class."""
    spy = Path(C.PY).with_name('py-spy')
    if not spy.exists() or not C.kvps_launcher_available():
        out.emit({'kind': 'profile', 'config': cfg, 'skipped': 'needs py-spy beside the python '
                  'and a working kvps.launch'})
        return
    W, S, keys, total = CONFIGS[cfg]
    rounds = 3 * rounds_for(args, total)
    run_dir = args.out / cfg / f'profile-{opt}'
    raw = run_dir / 'pyspy.raw.txt'
    run_dir.mkdir(parents=True, exist_ok=True)
    C.note(f'{cfg} optimizer={opt}: kvps under py-spy ({rounds} rounds)')
    wrap = (str(spy), 'record', '-s', '-f', 'raw', '-r', '100',
            '-o', str(raw), '--')  # blocking: consistent stacks
    res = measure_kvps(args, cfg, opt, rounds, run_dir, wrap=wrap)
    cpu = next((r['cpu_s'] for r in C.read_worker_records(run_dir, W) if r.get('cpu_s')), {})
    labels = {u['pid']: label for label, u in cpu.items()}
    stacks = C.pyspy_stacks(raw) if raw.exists() else {}
    for pid, samples in sorted(stacks.items()):
        label = labels.get(pid)
        if label is None or label == 'scheduler':
            continue
        cats, leaves = {}, {}
        for frames, n in samples:
            cat = _category(frames)
            cats[cat] = cats.get(cat, 0) + n
            if cat != 'startup':
                leaves[_leaf(frames)] = leaves.get(_leaf(frames), 0) + n
        busy = sum(n for c, n in cats.items() if c != 'startup')
        out.emit({'kind': 'profile', 'config': cfg, 'optimizer': opt, 'process': label,
                  'rounds': rounds, 'step_ms_under_profiler': res.get('step_ms'),
                  'python_samples': busy,
                  'python_share': {c: round(n / busy, 3) for c, n in
                                   sorted(cats.items(), key=lambda x: -x[1])
                                   if c != 'startup' and busy},
                  'top_leaf_functions': sorted(leaves.items(), key=lambda x: -x[1])[:8],
                  'cpu_ms_per_step': {k: round(v * 1e3 / rounds, 2)
                                      for k, v in cpu[label].items() if k != 'pid'},
                  'raw_stacks': str(raw)})


def timeline(args, out, cfg, opt):
    """The timeline's cost and the summary of where a step goes (from the last launch).

    Each launch records its timeline and pauses and resumes it on every node in blocks of
    rounds (pushpull_worker --timeline-blocks): its rounds with and without recording ran in
    the same processes, so the launch-to-launch spread (several percent on a small box) is
    not in their ratio. The cost is the median of the launches' ratios."""
    from kvps.timeline import summary
    W, total = CONFIGS[cfg][0], CONFIGS[cfg][3]
    # short blocks, many of them: the box's pace drifts over seconds, and each state gets
    # its share of every stretch (the first rounds of a block are not counted)
    rounds, block = args.rounds or (2000 if total <= 8 * MiB else 200), 10
    per_launch, trace = [], None
    for i in range(args.launches):
        run_dir = args.out / cfg / f'timeline-{opt}' / f'launch{i}'
        trace = run_dir / 'trace.json'
        C.note(f'{cfg} optimizer={opt}: kvps, timeline on and paused in blocks of {block}')
        measure_kvps(args, cfg, opt, rounds, run_dir, launcher_args=('--timeline', str(trace)),
                     worker_args=('--timeline-blocks', str(block)))
        root = next((r for r in C.read_worker_records(run_dir, W) if r.get('rank') == 0), None)
        if root is not None and 'timeline_on' in root:
            per_launch.append(_timeline_launch(root))
    record = {'kind': 'timeline', 'config': cfg, 'optimizer': opt, 'rounds': rounds,
              'block': block, 'launches': per_launch, 'trace': str(trace)}
    if per_launch:
        record.update({key: C.median([p[key] for p in per_launch]) for key in (
            'step_ms_off', 'step_ms_on', 'cost', 'cpu_ms_per_round_off',
            'cpu_ms_per_round_on')})
        record['cpu_cost'] = round(record['cpu_ms_per_round_on']
                                   / record['cpu_ms_per_round_off'] - 1, 4)
    if trace is not None and trace.exists():
        view = summary.Timeline(summary.load(trace))
        record['ms_per_step'] = {f'{role} ({thread})': {cat: round(ms, 3)
                                                        for cat, ms in cats.items()}
                                 for (role, thread), cats in view.per_step().items()}
    out.emit(record)


def _timeline_launch(record):
    """One launch's rounds with the timeline on and paused: median steps, their ratio, and
    the job's CPU per round in each state."""
    steps = {state: C.median([t for t, on in zip(record['round_times_s'],
                                                 record['timeline_on']) if on is state])
             for state in (True, False)}
    cpu = record['timeline_cpu_ms_per_round']
    return {'step_ms_off': round(steps[False] * 1e3, 3), 'step_ms_on': round(steps[True] * 1e3, 3),
            'cost': round(steps[True] / steps[False] - 1, 4),
            'cpu_ms_per_round_off': cpu['off'], 'cpu_ms_per_round_on': cpu['on']}


# -- main ------------------------------------------------------------------------------------
def main(argv=None):
    args = parse_args(argv)
    out = C.JsonLines(args.out, BENCH)
    peers = C.peers_status()
    opt_ok, opt_why = optimizer_available()
    notes = []
    if args.peers and peers['why']:
        notes.append(f'peers {peers["why"]}; reporting kvps figures only for those')
    if 'sgd' in args.optimizers and not opt_ok:
        notes.append(f'sgd variant skipped: {opt_why}')
        args.optimizers = [o for o in args.optimizers if o != 'sgd']
    run_mx = 'mxnet' in args.peers and peers['mxnet']
    run_gloo = 'gloo' in args.peers and peers['gloo']
    out.emit({'kind': 'meta', 'configs': args.configs, 'optimizers': args.optimizers,
              'launcher': 'kvps.launch' if C.kvps_launcher_available() else 'private',
              'peers': {'mxnet': run_mx, 'gloo': run_gloo,
                        'ceilings': bool(args.ceilings and peers['ceilings'])},
              'anchors': str(C.ANCHORS), 'anchors_present': C.ANCHORS.exists(),
              'cpus': os.cpu_count(), 'python': sys.version.split()[0], 'quick': args.quick,
              'launches': args.launches, 'out_dir': str(args.out), 'notes': notes,
              'statistic': 'step_ms = median over workers of each worker\'s median timed round; '
                           'all processes share this box, so expect noise of 10-30%'})
    ceilings = {}
    if args.ceilings and peers['ceilings']:
        C.note('ceilings: memcpy, pyzmq push and echo over TCP loopback')
        ceilings = C.run_ceilings(args.out / 'ceilings.jsonl', 1 if args.quick else 3,
                                  'memcpy,zmq_push,zmq_echo')
        out.emit({'kind': 'ceilings', 'median_GBps': ceilings})
    for cfg in args.configs:
        W, S, keys, total = CONFIGS[cfg]
        rounds = rounds_for(args, total)
        gloo = {}
        results = {}
        for opt in args.optimizers:
            C.note(f'{cfg} optimizer={opt}: kvps')
            res = _launches(args, measure_kvps, cfg, opt, rounds,
                            run_dir=args.out / cfg / f'kvps-{opt}')
            mode = 'dist_sync, a call per key' if args.per_key else 'dist_sync'
            results[opt] = {'kvps': out.emit(_record('kvps', mode, cfg, opt, rounds, res))}
            if run_mx:
                C.note(f'{cfg} optimizer={opt}: mxnet')
                res = _launches(args, measure_mxnet, cfg, opt, rounds,
                                run_dir=args.out / cfg / f'mxnet-{opt}')
                results[opt]['mxnet'] = out.emit(
                    _record('mxnet', 'dist_sync', cfg, opt, rounds, res))
        if run_gloo:
            for mode, label in GLOO_MODES.items():
                C.note(f'{cfg}: gloo {mode}')
                res = _launches(args, measure_gloo, cfg, mode, rounds,
                                run_dir=args.out / cfg / f'gloo-{mode}')
                rec = _record('gloo', label, cfg, None, rounds, res)
                rec['servers'] = 0
                gloo[PEER_KEYS[('gloo', label)]] = out.emit(rec)
        for opt, recs in results.items():
            peer_recs = {'mxnet': recs.get('mxnet')} if run_mx else {}
            peer_recs.update(gloo)
            out.emit(ratios(cfg, opt, recs['kvps'], peer_recs, ceilings))
    if args.profile:
        for cfg in args.configs:
            profile(args, out, cfg, args.optimizers[-1])
    if args.timeline:
        for cfg in args.configs:
            timeline(args, out, cfg, args.optimizers[0])
    C.note(f'results in {out.path}')
    return 0


if __name__ == '__main__':
    sys.exit(main())
