"""Soak: thousands of push+pull rounds on a real cluster, with the RSS of every node sampled.

Starts the scheduler, the servers (``python -m kvps.node``) and the workers
(``benchmarks/soak_worker.py``) itself on 127.0.0.1 with an OS-chosen port and a fresh job
secret, so it knows every PID; samples VmRSS from /proc/<pid>/status every --interval
seconds. Prints JSON lines (and appends them to <out>/results.jsonl):

  {"bench": "soak", "kind": "sample", "node", "role", "pid", "t_s", "round", "rss_mb"}
  {"bench": "soak", "kind": "node", "node", "role", "rss_start_mb", "rss_end_mb", "rss_max_mb",
   "growth_mb", "rss_warm_mb", "growth_pct_after_warmup", "flat"}
  {"bench": "soak", "kind": "shm", "start_mb", "end_mb", "max_mb", "warm_mb", "flat"}
  {"bench": "soak", "kind": "summary", "rounds", "seconds", "steps_per_s", "flat", ...}

"start" is the first sample once every worker has initialized its keys (round -1 before);
"after warm-up" compares the last sample with the first one taken once every worker has
passed 10 % of the rounds (buffers, optimizer state and zmq pools are allocated by then);
a node is called flat when it grew by less than max(2 MiB, 2 %) after warm-up. The
bytes used in /dev/shm (the workers' segments and the servers' arenas, which reserve pages
as they need them) are sampled alike and judged by the same rule.

  .venv/bin/python benchmarks/bench_soak.py             # W=2 S=1, 3000 rounds, ~1-3 min
  .venv/bin/python benchmarks/bench_soak.py --quick     # ~20 s
  .venv/bin/python benchmarks/bench_soak.py --workers 2 --servers 2 --rounds 10000 \
      --keys 16 --bytes 4194304 --optimizer none --mode async --tracemalloc
"""

import argparse
import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
PY = os.environ.get('KVPS_BENCH_PYTHON', sys.executable)
FLAT_MB, FLAT_PCT = 2.0, 2.0


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--workers', type=int, default=2)
    p.add_argument('--servers', type=int, default=1)
    p.add_argument('--rounds', type=int, default=3000)
    p.add_argument('--keys', type=int, default=8)
    p.add_argument('--bytes', type=int, default=1 << 20, help='total over all keys')
    p.add_argument('--optimizer', choices=['sgd', 'none'], default='sgd')
    p.add_argument('--mode', choices=['sync', 'async'], default='sync')
    p.add_argument('--interval', type=float, default=1.0, help='seconds between RSS samples')
    p.add_argument('--quick', action='store_true', help='600 rounds, 0.5 s samples')
    p.add_argument('--tracemalloc', action='store_true',
                   help='workers report their Python allocations that grew after warm-up')
    p.add_argument('--timeout', type=float, default=900.0)
    p.add_argument('--out', default=None, help='directory for results.jsonl')
    args = p.parse_args(argv)
    if args.quick:
        args.rounds, args.interval = min(args.rounds, 600), 0.5
    return args


class Emitter:
    def __init__(self, out_dir):
        self.path = Path(out_dir) / 'results.jsonl'
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def __call__(self, record):
        line = json.dumps({'bench': 'soak', **record})
        print(line, flush=True)
        with open(self.path, 'a') as f:
            f.write(line + '\n')


def note(text):
    print(f'# {text}', file=sys.stderr, flush=True)


def rss_mb(pid):
    try:
        with open(f'/proc/{pid}/status') as f:
            for line in f:
                if line.startswith('VmRSS:'):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        return None
    return None


class Node:
    """One child process, its output read on a thread (worker progress lines parsed)."""

    def __init__(self, name, role, argv, env):
        self.name, self.role = name, role
        self.proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, cwd=REPO,
                                     start_new_session=True)
        self.pid = self.proc.pid
        self.round, self.lines, self.done, self.ready = 0, [], None, False
        self.samples = []            # (t_s, round, rss_mb)
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append(line)
            if line.startswith('SOAK ready'):
                self.ready = True
            elif line.startswith('SOAK round '):
                self.round = int(line.split()[2])
            elif line.startswith('SOAK done '):
                self.done = line.split()[2:]

    def tail(self, n=30):
        return ''.join(self.lines[-n:])

    def stop(self):
        if self.proc.poll() is None:
            try:
                os.killpg(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait(10)
        self._thread.join(5)


def start_cluster(args, tmp):
    secret = secrets.token_hex(32)
    port_file = Path(tmp) / 'port'
    base = {**os.environ, 'DMLC_PS_ROOT_URI': '127.0.0.1', 'DMLC_PS_ROOT_PORT': '0',
            'DMLC_NUM_WORKER': str(args.workers), 'DMLC_NUM_SERVER': str(args.servers),
            'KVPS_SECRET': secret, 'OMP_NUM_THREADS': '1', 'PYTHONUNBUFFERED': '1',
            'KVPS_BENCH_TAG': f'soak-{os.getpid()}',
            'PYTHONPATH': os.pathsep.join(filter(None, [str(REPO),
                                                        os.environ.get('PYTHONPATH')]))}
    nodes = [Node('scheduler', 'scheduler', [PY, '-m', 'kvps.node'],
                  {**base, 'DMLC_ROLE': 'scheduler', 'KVPS_PORT_FILE': str(port_file)})]
    deadline = time.monotonic() + 60
    while not port_file.exists():
        if nodes[0].proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f'scheduler did not start:\n{nodes[0].tail()}')
        time.sleep(0.05)
    env = {**base, 'DMLC_PS_ROOT_PORT': port_file.read_text().strip()}
    for i in range(args.servers):
        nodes.append(Node(f'server {i}', 'server', [PY, '-m', 'kvps.node'],
                          {**env, 'DMLC_ROLE': 'server', 'KVPS_RANK': str(i)}))
    soak = {'SOAK_ROUNDS': str(args.rounds), 'SOAK_KEYS': str(args.keys),
            'SOAK_BYTES': str(args.bytes), 'SOAK_OPTIMIZER': args.optimizer,
            'SOAK_MODE': args.mode, 'SOAK_EVERY': '25',
            'SOAK_TRACEMALLOC': '1' if args.tracemalloc else '0'}
    for i in range(args.workers):
        nodes.append(Node(f'worker {i}', 'worker', [PY, str(HERE / 'soak_worker.py')],
                          {**env, **soak, 'DMLC_ROLE': 'worker', 'KVPS_RANK': str(i)}))
    return nodes


def shm_used_mb():
    """Bytes in use in /dev/shm (the whole filesystem: this box runs the soak alone)."""
    vfs = os.statvfs('/dev/shm')
    return (vfs.f_blocks - vfs.f_bfree) * vfs.f_frsize / 2 ** 20


def sample_until_done(args, nodes, emit, shm):
    """Sample every node's RSS (into node.samples) and /dev/shm (into ``shm``) until the
    workers are done."""
    workers = [n for n in nodes if n.role == 'worker']
    started = time.monotonic()
    deadline = started + args.timeout
    while True:
        t = time.monotonic() - started
        # round -1: still starting (imports, registration, init); not part of the figures
        rnd = min(w.round for w in workers) if all(w.ready for w in workers) else -1
        if not any(w.done for w in workers):   # a worker done may be gone, and its segment
            shm.append((t, rnd, shm_used_mb()))
        for node in nodes:
            rss = rss_mb(node.pid) if node.proc.poll() is None else None
            if rss is None:
                continue
            node.samples.append((t, rnd, rss))
            emit({'kind': 'sample', 'node': node.name, 'role': node.role, 'pid': node.pid,
                  't_s': round(t, 2), 'round': rnd, 'rss_mb': round(rss, 2)})
        failed = [n for n in nodes if n.proc.poll() not in (None, 0)]
        if failed:
            raise RuntimeError(f'{failed[0].name} exited {failed[0].proc.returncode}:\n'
                               f'{failed[0].tail()}')
        if all(w.done for w in workers):
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f'soak did not finish within {args.timeout:.0f} s '
                               f'(round {rnd} of {args.rounds})')
        time.sleep(args.interval)


def growth(args, samples):
    """(samples used, start, end, max, value after warm-up, growth % after it, flat) of
    ``samples`` ((t_s, round, MiB), round -1 while starting), or None without any."""
    s = [x for x in samples if x[1] >= 0] or samples[-1:]
    if not s:
        return None
    mb = [x[2] for x in s]
    warm = next((x[2] for x in s if x[1] >= max(1, args.rounds // 10)), mb[-1])
    after = mb[-1] - warm
    pct = 100.0 * after / warm if warm else 0.0
    return len(s), mb[0], mb[-1], max(mb), warm, pct, after < max(FLAT_MB,
                                                                  FLAT_PCT / 100.0 * warm)


def summarize(args, nodes, shm, emit):
    all_flat = True
    for node in nodes:
        g = growth(args, node.samples)
        if g is None:
            continue
        count, start, end, most, warm, pct, flat = g
        all_flat &= flat
        emit({'kind': 'node', 'node': node.name, 'role': node.role, 'pid': node.pid,
              'samples': count, 'rss_start_mb': round(start, 2),
              'rss_end_mb': round(end, 2), 'rss_max_mb': round(most, 2),
              'growth_mb': round(end - start, 2), 'rss_warm_mb': round(warm, 2),
              'growth_pct_after_warmup': round(pct, 2), 'flat': flat})
    _, start, end, most, warm, pct, shm_flat = growth(args, shm)
    all_flat &= shm_flat
    emit({'kind': 'shm', 'start_mb': round(start, 2), 'end_mb': round(end, 2),
          'max_mb': round(most, 2), 'warm_mb': round(warm, 2),
          'growth_pct_after_warmup': round(pct, 2), 'flat': shm_flat})
    workers = [n for n in nodes if n.role == 'worker']
    seconds = max(float(w.done[1]) for w in workers)
    emit({'kind': 'summary', 'workers': args.workers, 'servers': args.servers,
          'rounds': args.rounds, 'keys': args.keys, 'bytes': args.bytes,
          'optimizer': args.optimizer, 'mode': args.mode, 'seconds': round(seconds, 2),
          'steps_per_s': round(args.rounds / seconds, 1) if seconds else None,
          'checked': sorted({w.done[2] for w in workers}), 'flat': all_flat,
          'flat_rule': f'growth after warm-up < max({FLAT_MB} MiB, {FLAT_PCT} %)'})
    for w in workers:
        for line in w.lines:
            if line.startswith('SOAK alloc '):
                note(f'{w.name}: {line[len("SOAK alloc "):].rstrip()}')
    return all_flat


def main(argv=None):
    args = parse_args(argv)
    out = args.out or Path(tempfile.gettempdir()) / 'kvps-bench' / \
        f'soak-{time.strftime("%Y%m%d-%H%M%S")}'
    emit = Emitter(out)
    note(f'soak: W={args.workers} S={args.servers} rounds={args.rounds} keys={args.keys} '
         f'bytes={args.bytes} optimizer={args.optimizer} mode={args.mode}; out={out}')
    with tempfile.TemporaryDirectory(prefix='kvps-soak-') as tmp:
        nodes, shm = start_cluster(args, tmp), []
        try:
            sample_until_done(args, nodes, emit, shm)
            for node in nodes:              # the job ends by itself: every exit code is 0
                code = node.proc.wait(60)
                if code != 0:
                    raise RuntimeError(f'{node.name} exited {code}:\n{node.tail()}')
        finally:
            for node in nodes:
                node.stop()
    summarize(args, nodes, shm, emit)
    return 0


if __name__ == '__main__':
    sys.exit(main())
