#!/usr/bin/env python
"""Push+pull across emulated hosts: kvps, MXNet and gloo when each host's link is the limit.

bench_pushpull.py runs every process on one loopback, where a parameter server moves twice
a ring all-reduce's bytes through the one shared "network" and the CPU decides. A real
cluster is bounded by each host's link instead. Here H hosts are network namespaces on one
bridge, each behind a full-duplex link limited to --rate (tc tbf, both directions; see
_netns.py). The workers are bench_pushpull.py's and the peers' own programs, with the same
checks; the scheduler sits on host 0. Two layouts:

  hN-*     N hosts, each running one worker and one server of kvps (a worker reaches its own
           host's server through shared memory, as on a real machine) or of MXNet ps-lite,
           or one gloo rank;
  h4+4-*   BytePS's layout: 4 worker hosts and 4 more hosts (CPU machines) for the servers;
           gloo runs on the 4 worker hosts (an all-reduce has no use for the others).

Compression for slow links (--compression, default fp16): kvps-fp16 pushes and pulls in
float16, as push then pull and as one pushpull (kvps-pushpull-fp16); 1bit adds
kvps-pushpull-1bit (1bit pushes, float16 pulls). The torch anchors (--peers ddp) are
DistributedDataParallel's all-reduce of the same tensors, plain and with fp16_compress_hook
(ddp_worker.py), on the worker hosts.

``link_bound_ms`` is the least step time the links allow, per system: a ring all-reduce, and
a parameter server with one server beside each worker, must carry 2 (N-1)/N of the model
each way over every link; with servers on hosts of their own a worker's link carries the
model once each way, each scaled by the share of the bytes its compression sends.
``of_link_bound``: the share of that bound a system reaches (1.0: the link is the only cost;
TCP/IP headers alone take ~4%).

With --training, each layout instead times training steps of bench_training.py's models:
kvps.Trainer (server SGD; workers updating) beside torch DDP over gloo on the worker hosts.
Every measurement carries ``link_drops``, the packets the links' queues dropped during it.
The hosts' TCP uses cubic, Linux's default (--tcp; 'host' keeps this machine's own, which here
is bbr: under it a parameter server's fan-in, several servers sending into one worker's link
at once, leaves links partly idle, see RESULTS.md).
All hosts share this box's cores: a run at a rate no link reaches (--rate 40gbit) shows
what the CPU alone costs.

  sudo python benchmarks/bench_hosts.py                       # 1 Gbit/s links, ~11 min
  sudo python benchmarks/bench_hosts.py --configs h4-64mb --rate 2gbit --launches 3
  sudo python benchmarks/bench_hosts.py --training wide,deep --configs h4-64mb,h4+4-64mb

Needs root and iproute2; prints a 'skipped' line and exits 0 where it cannot run.
"""
import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402
import _netns  # noqa: E402
import bench_pushpull as PP  # noqa: E402
import training_worker  # noqa: E402
from _common import MiB  # noqa: E402

BENCH = 'hosts'
TRAINING_WORKER = training_worker.__file__
DDP_WORKER = Path(__file__).resolve().parent / 'ddp_worker.py'
CONFIGS = {  # name: (workers, servers, servers on hosts of their own, keys, total bytes)
    'h2-4mb': (2, 2, False, 40, 4 * MiB), 'h2-64mb': (2, 2, False, 16, 64 * MiB),
    'h4-4mb': (4, 4, False, 40, 4 * MiB), 'h4-64mb': (4, 4, False, 16, 64 * MiB),
    # BytePS's layout: 4 more hosts (CPU machines) run the servers; gloo cannot use them
    'h4+4-4mb': (4, 4, True, 40, 4 * MiB), 'h4+4-64mb': (4, 4, True, 16, 64 * MiB),
}
RATE_UNITS = {'kbit': 1e3 / 8, 'mbit': 1e6 / 8, 'gbit': 1e9 / 8}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--configs', default=','.join(CONFIGS), help=f'comma list of {", ".join(CONFIGS)}')
    p.add_argument('--rate', default='1gbit', help='each host link, each way (tc rate: 500mbit, 2gbit)')
    p.add_argument('--tcp', default='cubic', metavar='CONGESTION',
                   help="the hosts' TCP congestion control (default cubic, Linux's default; "
                        "'host': this machine's own, e.g. bbr)")
    p.add_argument('--rounds', type=int, default=None, help='timed rounds (default 20 / 10 for 4 / 64 MiB)')
    # 5: a compressing kvps worker pauses 10 s before its warm-up (--settle), and the first
    # rounds after that pause ran up to 100 ms slower at 64 MiB (h4 fp16: 473-504 ms with 2
    # warm-up rounds, 455-481 with 6); every system gets the same
    p.add_argument('--warmup', type=int, default=5)
    p.add_argument('--optimizer', choices=['none', 'sgd', 'both'], default='none')
    p.add_argument('--peers', default='mxnet,gloo,ddp',
                   help="comma list of mxnet, gloo, ddp (DDP plain and with fp16_compress_hook), "
                        "or 'none'")
    p.add_argument('--compression', default='fp16',
                   help="comma list of fp16, 1bit (kvps systems that compress), or 'none'")
    p.add_argument('--launches', type=int, default=1, help='fresh clusters per measurement')
    p.add_argument('--training', default=None, metavar='MODELS',
                   help='time training steps instead (comma list of bench_training.py\'s '
                        'models: wide, deep, narrow): kvps.Trainer with server SGD and with '
                        'workers updating, beside torch DDP over gloo; the configs\' layouts '
                        'are used, their sizes are the models\'')
    p.add_argument('--bucket-bytes', type=int, default=None,
                   help='with --training: the kvps Trainer\'s bucket_bytes (default: its own, '
                        '1 MiB across hosts)')
    p.add_argument('--timeout', type=int, default=300, help='seconds allowed per cluster run')
    p.add_argument('--out', default=None, help='output directory (default /tmp/kvps-bench/...)')
    args = p.parse_args(argv)
    args.configs = [c.strip().lower() for c in args.configs.split(',') if c.strip()]
    bad = [c for c in args.configs if c not in CONFIGS]
    if bad:
        p.error(f'unknown config(s) {bad}; known: {", ".join(CONFIGS)}')
    match = re.fullmatch(r'(\d+(?:\.\d+)?)(kbit|mbit|gbit)', args.rate.lower())
    if not match:
        p.error(f'--rate {args.rate!r}: give a number and kbit, mbit or gbit (e.g. 1gbit)')
    args.rate_bytes = float(match.group(1)) * RATE_UNITS[match.group(2)]
    args.optimizers = ['none', 'sgd'] if args.optimizer == 'both' else [args.optimizer]
    args.training = [m.strip() for m in args.training.split(',')] if args.training else None
    models = [*training_worker.MODELS, *training_worker.EMBEDS]
    unknown = [m for m in args.training or () if m not in models]
    if unknown:
        p.error(f'unknown model(s) {unknown}; known: {", ".join(models)}')
    args.peers = set() if args.peers == 'none' else {x.strip() for x in args.peers.split(',')}
    args.compression = set() if args.compression == 'none' else {
        x.strip() for x in args.compression.split(',')}
    if args.compression - set(COMPRESSED_BY):
        p.error(f'--compression: known are {", ".join(COMPRESSED_BY)}')
    args.out = Path(args.out) if args.out else C.default_out_dir(BENCH)
    return args


def shape(cfg):
    """The (W, S, keys, bytes) bench_pushpull's records and ratios take."""
    workers, servers, _, keys, total = CONFIGS[cfg]
    return workers, servers, keys, total


def host_count(cfg):
    workers, servers, apart = CONFIGS[cfg][:3]
    return workers + servers if apart else workers


def server_host(cfg, j):
    workers, _, apart = CONFIGS[cfg][:3]
    return workers + j if apart else j


def rounds_for(args, total):
    return args.rounds or (20 if total <= 8 * MiB else 10)


def link_bound_ms(system, cfg, rate_bytes):
    """The least step time a host's link allows: 2 (W-1)/W of the model each way for a ring
    all-reduce and for servers beside the workers; with S = W servers on hosts of their own,
    a worker's link carries the model once each way (push out, pull in)."""
    workers, servers, apart, _, total = CONFIGS[cfg]
    if apart and system not in ('gloo', *DDP_SYSTEMS):
        share = max(1.0, workers / servers)
    else:
        share = 2 * (workers - 1) / workers
    return share * WIRE_SHARE.get(system, 1.0) * total / rate_bytes * 1e3


# -- processes on the hosts ------------------------------------------------------------------
class Job:
    """The processes of one cluster run, each inside its host, logging to ``out_dir``."""

    def __init__(self, hosts, out_dir, env):
        self.hosts, self.out_dir, self.env = hosts, Path(out_dir), env
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.procs, self.logs = [], []

    def start(self, name, host, argv, **extra):
        log = open(self.out_dir / f'{name}.log', 'w')
        self.logs.append((name, log))
        proc = subprocess.Popen(self.hosts.command(host, [str(a) for a in argv]),
                                env=dict(self.env, **extra), cwd=C.REPO, stdout=log,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
        self.procs.append(proc)
        return proc

    def free_port(self, host):
        """A port the OS gives on ``host`` (for systems that need one fixed up front)."""
        code = 'import socket; s = socket.socket(); s.bind(("", 0)); print(s.getsockname()[1])'
        done = subprocess.run(self.hosts.command(host, [sys.executable, '-c', code]),
                              capture_output=True, text=True, check=True)
        return int(done.stdout)

    def finish(self, waited, timeout):
        """Wait for ``waited`` (the workers), give the rest 30 s to end, stop what is left."""
        rc = 0
        deadline = time.monotonic() + timeout
        try:
            for proc in waited:
                rc = rc or proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            for proc in self.procs:
                proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            rc = rc or 124
        finally:
            for proc in self.procs:
                if proc.poll() is None:
                    C._stop_group(proc, grace=2.0)
            for _, log in self.logs:
                log.close()
        return rc

    def text(self):
        return ''.join(f'[{name}] {line}' for name, _ in self.logs
                       for line in (self.out_dir / f'{name}.log').read_text(errors='replace')
                       .splitlines(keepends=True))


def run_kvps(hosts, job, cfg, worker_argv):
    workers, servers = shape(cfg)[:2]
    common = {'DMLC_PS_ROOT_URI': hosts.address(0), 'DMLC_NUM_WORKER': str(workers),
              'DMLC_NUM_SERVER': str(servers), 'KVPS_SECRET': os.urandom(16).hex()}
    node = [C.PY, '-m', 'kvps.node']
    port_file = job.out_dir / 'scheduler.port'
    port_file.unlink(missing_ok=True)   # an earlier run's in the same directory names a dead port
    sched = job.start('scheduler', 0, node, **common, DMLC_ROLE='scheduler',
                      DMLC_PS_ROOT_PORT='0', KVPS_PORT_FILE=str(port_file),
                      DMLC_NODE_HOST=hosts.address(0))
    common['DMLC_PS_ROOT_PORT'] = str(C.wait_port(port_file, sched, 60))
    for j in range(servers):
        at = server_host(cfg, j)
        job.start(f'server{j}', at, node, **common, DMLC_ROLE='server', KVPS_RANK=str(j),
                  DMLC_NODE_HOST=hosts.address(at))
    return [job.start(f'worker_proc{i}', i, worker_argv, **common, DMLC_ROLE='worker',
                      KVPS_RANK=str(i), DMLC_NODE_HOST=hosts.address(i))
            for i in range(workers)]


def run_mxnet(hosts, job, cfg, worker_argv):
    workers, servers = shape(cfg)[:2]
    common = {'DMLC_PS_ROOT_URI': hosts.address(0), 'DMLC_PS_ROOT_PORT': str(job.free_port(0)),
              'DMLC_NUM_WORKER': str(workers), 'DMLC_NUM_SERVER': str(servers),
              'DMLC_INTERFACE': 'eth0'}
    job.start('scheduler', 0, worker_argv, **common, DMLC_ROLE='scheduler',
              DMLC_NODE_HOST=hosts.address(0))
    for j in range(servers):
        at = server_host(cfg, j)
        job.start(f'server{j}', at, worker_argv, **common, DMLC_ROLE='server',
                  DMLC_NODE_HOST=hosts.address(at))
    return [job.start(f'worker_proc{i}', i, worker_argv, **common, DMLC_ROLE='worker',
                      DMLC_NODE_HOST=hosts.address(i)) for i in range(workers)]


def run_gloo(hosts, job, cfg, worker_argv):
    workers = shape(cfg)[0]   # an all-reduce has no use for the server hosts
    common = {'MASTER_ADDR': hosts.address(0), 'MASTER_PORT': str(job.free_port(0)),
              'WORLD_SIZE': str(workers), 'GLOO_SOCKET_IFNAME': 'eth0'}
    return [job.start(f'rank{i}', i, worker_argv, **common, RANK=str(i), LOCAL_RANK=str(i))
            for i in range(workers)]


def run_ddp(hosts, job, cfg, worker_argv):
    workers = shape(cfg)[0]   # like gloo: the server hosts stay idle
    common = {'WORLD_SIZE': str(workers), 'GLOO_SOCKET_IFNAME': 'eth0',
              'KVPS_BENCH_RENDEZVOUS': str(job.out_dir / 'rendezvous')}
    return [job.start(f'rank{i}', i, worker_argv, **common, RANK=str(i))
            for i in range(workers)]


def worker_argv(system, cfg, opt, rounds, args, run_dir):
    keys, total = CONFIGS[cfg][3:]
    body = ['--keys', keys, '--total-bytes', total, '--rounds', rounds,
            '--warmup', args.warmup, '--out', run_dir]
    peers = C.peer_pythons()
    if system in KVPS_SYSTEMS or system in COMPRESSED:
        pushpull = ['--pushpull'] if 'pushpull' in system else []
        return [C.PY, PP.WORKER, *body, '--optimizer', opt, *pushpull,
                *COMPRESSED.get(system, ())]
    if system in DDP_SYSTEMS:
        return [C.PY, DDP_WORKER, *body, '--hook', DDP_SYSTEMS[system]]
    if system == 'mxnet':
        return [peers['mxnet'], C.PEERS_DIR / 'mxnet_bench.py', *body, '--optimizer', opt,
                '--lr', 0.1]
    return [peers['gloo'], C.PEERS_DIR / 'gloo_bench.py', *body, '--mode', 'coalesced']


# kvps as MXNet's benchmark steps (kv.push, then kv.pull), and with one kv.pushpull
KVPS_SYSTEMS = ('kvps', 'kvps-pushpull')
# kvps compressing (pushpull_worker's flags), each with the --compression name that adds it
COMPRESSED = {'kvps-fp16': ['--compress', 'fp16', '--compress-pull', 'fp16'],
              'kvps-pushpull-fp16': ['--compress', 'fp16', '--compress-pull', 'fp16'],
              'kvps-pushpull-1bit': ['--compress', '1bit', '--compress-pull', 'fp16']}
COMPRESSED_BY = {'fp16': ('kvps-fp16', 'kvps-pushpull-fp16'), '1bit': ('kvps-pushpull-1bit',)}
DDP_SYSTEMS = {'ddp': 'none', 'ddp-fp16': 'fp16'}   # --hook of ddp_worker.py
# The share of an uncompressed step's bytes a system sends (push and pull alike): 1bit sends
# 1.5 bits an element (64 elements: 64 sign bits, two bfloat16 scales), then pulls float16.
WIRE_SHARE = {'kvps-fp16': 0.5, 'kvps-pushpull-fp16': 0.5, 'ddp-fp16': 0.5,
              'kvps-pushpull-1bit': (1.5 / 32 + 0.5) / 2}
STARTERS = {'kvps': run_kvps, 'kvps-pushpull': run_kvps, 'mxnet': run_mxnet, 'gloo': run_gloo,
            **{s: run_kvps for s in COMPRESSED}, **{s: run_ddp for s in DDP_SYSTEMS}}


def measure(args, hosts, system, cfg, opt, run_dir):
    workers, _, _, total = shape(cfg)
    rounds = rounds_for(args, total)
    job = Job(hosts, run_dir, dict(os.environ, OMP_NUM_THREADS='1', PYTHONUNBUFFERED='1'))
    t0, drops = time.monotonic(), hosts.drops()
    try:
        waited = STARTERS[system](hosts, job, cfg, worker_argv(system, cfg, opt, rounds, args,
                                                               run_dir))
    except (RuntimeError, subprocess.CalledProcessError) as exc:
        job.finish([], 0)
        return {'step_ms': None, 'gbps_per_worker': None, 'correct': False, 'error': str(exc)}
    rc = job.finish(waited, args.timeout)
    result = PP._peer_summary(run_dir, workers, total, rc, job.text(), time.monotonic() - t0)
    return dict(result, link_drops=hosts.drops() - drops)


# -- training --------------------------------------------------------------------------
TRAINING_SYSTEMS = {'kvps': run_kvps, 'kvps-local': run_kvps, 'ddp': run_ddp}


def measure_training(args, hosts, system, cfg, model, run_dir):
    """Median over workers of each worker's median step (ms), or an error."""
    argv = [C.PY, TRAINING_WORKER, '--system', system, '--model', model,
            '--steps', args.rounds or 10, '--out', run_dir,
            *(['--bucket-bytes', args.bucket_bytes] if args.bucket_bytes is not None else [])]
    job = Job(hosts, run_dir, dict(os.environ, OMP_NUM_THREADS='1', PYTHONUNBUFFERED='1'))
    drops = hosts.drops()
    rc = job.finish(TRAINING_SYSTEMS[system](hosts, job, cfg, argv), args.timeout)
    records = C.read_worker_records(run_dir, shape(cfg)[0])
    if rc != 0 or len(records) < shape(cfg)[0]:
        return {'step_ms': None, 'rc': rc, 'error': job.text()[-1500:]}
    return {'step_ms': C.median([r['ms_step_median'] for r in records]),
            'params': records[0]['params'], 'tensors': records[0]['tensors'],
            'link_drops': hosts.drops() - drops}


def training(args, out, cfg, hosts):
    for model in args.training:
        steps = {}
        for system in TRAINING_SYSTEMS:
            C.note(f'{cfg} at {args.rate}: training {model} through {system}')
            runs = [measure_training(args, hosts, system, cfg, model,
                                     args.out / cfg / f'{model}-{system}' / f'launch{i}')
                    for i in range(args.launches)]
            res = PP._median_of_launches(runs)
            steps[system] = res.get('step_ms')
            workers, servers = shape(cfg)[:2]
            out.emit({'kind': 'training', 'config': cfg, 'model': model, 'system': system,
                      'workers': workers, 'servers': 0 if system == 'ddp' else servers,
                      'rate': args.rate, **res})
        ddp = steps.get('ddp')
        out.emit({'kind': 'training_ratios', 'config': cfg, 'model': model, 'rate': args.rate,
                  **{f'{s}_over_ddp': round(steps[s] / ddp, 3) if steps[s] and ddp else None
                     for s in ('kvps', 'kvps-local')}})


# -- main ------------------------------------------------------------------------------------
def main(argv=None):
    args = parse_args(argv)
    out = C.JsonLines(args.out, BENCH)
    why = _netns.unavailable()
    if why:
        out.emit({'kind': 'skipped', 'why': why})
        return 0
    _netns.remove_leftovers()
    peers = C.peers_status()
    systems = [*KVPS_SYSTEMS, *(s for s in ('mxnet', 'gloo') if s in args.peers and peers[s]),
               *(s for c in sorted(args.compression) for s in COMPRESSED_BY[c]),
               *(DDP_SYSTEMS if 'ddp' in args.peers else ())]
    if args.training:
        systems = list(TRAINING_SYSTEMS)
    congestion = chosen_congestion(args.tcp)
    out.emit({'kind': 'meta', 'configs': args.configs, 'rate': args.rate, 'tcp': congestion,
              'optimizers': args.optimizers, 'systems': systems, 'launches': args.launches,
              'training': args.training, 'cpus': os.cpu_count(), 'out_dir': str(args.out),
              'notes': [f'peers {peers["why"]}'] if args.peers and peers['why'] else []})
    for cfg in args.configs:
        with _netns.EmulatedHosts(host_count(cfg), args.rate, congestion=congestion) as hosts:
            if args.training:
                training(args, out, cfg, hosts)
            else:
                pushpull(args, out, cfg, hosts, systems)
    C.note(f'results in {out.path}')
    return 0


def chosen_congestion(tcp):
    """The congestion control ``--tcp`` names ('host': this machine's); exits for one this
    kernel does not offer (with the ones it does)."""
    offered, own = _netns.congestion_controls()
    congestion = own if tcp == 'host' else tcp
    if congestion not in offered:
        sys.exit(f'bench_hosts.py: --tcp {tcp}: this kernel offers {", ".join(offered)}')
    return congestion


def pushpull(args, out, cfg, hosts, systems):
    """Every system's push+pull rounds on ``hosts``, then a ratios line per kvps step (a
    compressing one also beside uncompressed kvps)."""
    total = CONFIGS[cfg][-1]
    once = {}   # no optimizer in an all-reduce: gloo and DDP are measured once per config
    for opt in args.optimizers:
        recs = {}
        for system in systems:
            if system in once:
                recs[system] = once[system]
                continue
            C.note(f'{cfg} at {args.rate}: {system} optimizer={opt}')
            res = PP._median_of_launches([
                measure(args, hosts, system, cfg, opt,
                        args.out / cfg / f'{system}-{opt}' / f'launch{i}')
                for i in range(args.launches)])
            if res.get('step_ms'):
                bound = link_bound_ms(system, cfg, args.rate_bytes)
                res['of_link_bound'] = round(bound / res['step_ms'], 3)
            recs[system] = out.emit(_record(system, cfg, opt, rounds_for(args, total), res))
            if system == 'gloo' or system in DDP_SYSTEMS:
                once[system] = recs[system]
        bounds = {s: round(link_bound_ms(s, cfg, args.rate_bytes), 2) for s in systems}
        kvps = [s for s in systems if s in KVPS_SYSTEMS or s in COMPRESSED]
        peer_recs = {_peer_name(k): v for k, v in recs.items() if k not in kvps}
        for kvps_system in kvps:
            peers = dict(peer_recs, **({s: recs[s] for s in KVPS_SYSTEMS}
                                       if kvps_system in COMPRESSED else {}))
            line = PP.ratios(cfg, opt, recs[kvps_system], peers, {}, shape(cfg))
            out.emit(dict(line, kvps_step=kvps_system, rate=args.rate, link_bound_ms=bounds))


def _record(system, cfg, opt, rounds, res):
    if system == 'gloo':
        return dict(PP._record('gloo', 'allreduce_flat', cfg, None, rounds, res, shape(cfg)),
                    servers=0)
    if system in DDP_SYSTEMS:
        return dict(PP._record(system, 'ddp_allreduce', cfg, None, rounds, res, shape(cfg)),
                    servers=0)
    return PP._record(system, 'dist_sync', cfg, opt, rounds, res, shape(cfg))


def _peer_name(system):
    return 'gloo_flat' if system == 'gloo' else system


if __name__ == '__main__':
    sys.exit(main())
