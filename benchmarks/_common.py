"""Shared helpers for kvps benchmarks: JSON lines out, kvps clusters, peer scripts, thread CPU.

Every benchmark under benchmarks/ prints one JSON object per line (and appends the same lines
to ``<out>/results.jsonl``). The peers (Apache MXNet ps-lite, torch.distributed gloo, the raw
ZeroMQ / memcpy ceilings) are never imported or copied: their own scripts under
``$KVPS_PEERS_DIR`` (default ../shared/peers beside the checkout) are run with the interpreters installed under
``$KVPS_ANCHORS`` (default /tmp/anchors); when those are absent a benchmark still measures
kvps and says so in its JSON.
"""

import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PY = os.environ.get('KVPS_BENCH_PYTHON', sys.executable)
# The peers live beside the checkout, in ../shared/peers.
PEERS_DIR = Path(os.environ.get('KVPS_PEERS_DIR',
                                Path(__file__).resolve().parents[2] / 'shared' / 'peers'))
ANCHORS = Path(os.environ.get('KVPS_ANCHORS', '/tmp/anchors'))
TAG_VAR = 'KVPS_BENCH_TAG'      # set in every process of a benchmark job, to find them in /proc
MiB = 1 << 20


# -- output ---------------------------------------------------------------------------------
class JsonLines:
    """Prints records as JSON lines to stdout and appends them to ``<out_dir>/results.jsonl``."""

    def __init__(self, out_dir, bench):
        self.bench = bench
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.out_dir / 'results.jsonl'
        self.records = []

    def emit(self, record):
        record = {'bench': self.bench, **record}
        self.records.append(record)
        line = json.dumps(record, sort_keys=False)
        print(line, flush=True)
        with open(self.path, 'a') as f:
            f.write(line + '\n')
        return record


def default_out_dir(name):
    return Path(tempfile.gettempdir()) / 'kvps-bench' / f'{name}-{time.strftime("%Y%m%d-%H%M%S")}'


def note(text):
    """Progress for humans, on stderr (stdout carries only JSON lines)."""
    print(f'# {text}', file=sys.stderr, flush=True)


def median(values):
    return statistics.median(values) if values else None


# -- peers -----------------------------------------------------------------------------------
def peer_pythons():
    """The interpreters the peers run under: {'mxnet': path, 'gloo': path}."""
    return {'mxnet': Path(os.environ.get('MX_PY', ANCHORS / 'mxvenv/bin/python')),
            'gloo': Path(os.environ.get('TORCH_PY', ANCHORS / 'torchvenv/bin/python'))}


def peers_status():
    """Which peers can run here: {'mxnet': bool, 'gloo': bool, 'ceilings': bool, 'why': str}."""
    pythons = peer_pythons()
    mx_py, torch_py = pythons['mxnet'], pythons['gloo']
    have = {
        'mxnet': mx_py.exists() and (PEERS_DIR / 'run_mxnet_bench.sh').exists(),
        'gloo': torch_py.exists() and (PEERS_DIR / 'run_gloo_bench.sh').exists(),
        'ceilings': torch_py.exists() and (PEERS_DIR / 'run_ceilings.sh').exists(),
    }
    missing = [k for k, v in have.items() if not v]
    have['why'] = ('' if not missing else
                   f'not runnable here: {", ".join(missing)} (need {PEERS_DIR}/run_*.sh and the '
                   f'venvs under {ANCHORS}; install with bash {PEERS_DIR}/install.sh)')
    return have


def run_peer_script(script, args, out_dir, timeout):
    """Run one of the peers' run_*.sh scripts; returns (rc, combined output, wall seconds)."""
    env = dict(os.environ, BENCH_TIMEOUT=str(int(timeout)), OMP_NUM_THREADS='1')
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    argv = ['bash', str(PEERS_DIR / script), *[str(a) for a in args]]
    return _run_bounded(argv, env, timeout + 30, Path(out_dir) / 'run.log')


def write_worker_record(out_dir, rank, record, summary):
    """A benchmark worker's end: its one-line ``summary`` and errors on stdout, and
    ``record`` as <out_dir>/worker<rank>.json (what read_worker_records reads)."""
    print(summary, flush=True)
    for error in record.get('errors', ()):
        print('  ERROR', error, flush=True)
    os.makedirs(out_dir, exist_ok=True)
    with open(Path(out_dir) / f'worker{rank}.json', 'w') as f:
        json.dump(record, f, indent=1)


def read_worker_records(out_dir, workers):
    """The per-worker JSON records (worker0.json ...) a benchmark cluster left in ``out_dir``."""
    records = []
    for rank in range(workers):
        path = Path(out_dir) / f'worker{rank}.json'
        if path.exists():
            with open(path) as f:
                records.append(json.load(f))
    return records


def run_ceilings(out_file, trials, tests, timeout=300):
    """The raw memcpy / pyzmq loopback ceilings: {test: median GB/s}, or {} if they failed."""
    rc, log, _ = run_peer_script('run_ceilings.sh', [out_file, '--trials', trials,
                                                     '--tests', tests],
                                 Path(out_file).parent, timeout)
    found = {}
    for line in log.splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if 'test' in rec:
            found[rec['test']] = rec['median_GBps']
    return found


# -- kvps clusters ---------------------------------------------------------------------------
_LAUNCHER_OK = None


def kvps_launcher_available():
    """True when ``python -m kvps.launch --help`` works (else the private starter is used)."""
    global _LAUNCHER_OK
    if _LAUNCHER_OK is None:
        try:
            _LAUNCHER_OK = subprocess.run([PY, '-m', 'kvps.launch', '--help'], cwd=REPO,
                                          capture_output=True, timeout=60).returncode == 0
        except (OSError, subprocess.TimeoutExpired):
            _LAUNCHER_OK = False
    return _LAUNCHER_OK


def run_kvps_job(workers, servers, worker_argv, out_dir, timeout, tag, wrap=(),
                 launcher_args=()):
    """Run one kvps job on 127.0.0.1 (1 scheduler, S servers, W workers running worker_argv).

    Uses ``python -m kvps.launch`` when it works, else starts the processes itself. ``wrap``
    prefixes the launcher command (e.g. py-spy record -s --), launcher mode only;
    ``launcher_args`` go to the launcher (e.g. --timeline PATH). Returns
    (rc, combined log text, wall seconds, launcher name).
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS='1', PYTHONUNBUFFERED='1', **{TAG_VAR: tag})
    if kvps_launcher_available():
        argv = [*wrap, PY, '-m', 'kvps.launch', '-n', str(workers), '-s', str(servers),
                '--timeout', str(int(timeout)), *launcher_args, '--', *worker_argv]
        rc, log, wall = _run_bounded(argv, env, timeout + 30, out_dir / 'launch.log')
        return rc, log, wall, 'kvps.launch'
    rc, log, wall = _private_cluster(workers, servers, worker_argv, env, out_dir, timeout)
    return rc, log, wall, 'private'


def _run_bounded(argv, env, timeout, log_path):
    """Run argv in its own process group with a hard time limit; log to ``log_path``."""
    t0 = time.monotonic()
    with open(log_path, 'w') as log:
        proc = subprocess.Popen(argv, env=env, cwd=REPO, stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _stop_group(proc)
            rc = 124
    return rc, Path(log_path).read_text(errors='replace'), time.monotonic() - t0


def _stop_group(proc, grace=5.0):
    """SIGTERM the process group we started, then SIGKILL what is left after ``grace``."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=grace)
            return
        except subprocess.TimeoutExpired:
            continue


def _private_cluster(workers, servers, worker_argv, env, out_dir, timeout):
    """Fallback until kvps.launch works: scheduler (OS-chosen port), servers, then workers."""
    t0 = time.monotonic()
    base = dict(env, DMLC_PS_ROOT_URI='127.0.0.1', DMLC_NUM_WORKER=str(workers),
                DMLC_NUM_SERVER=str(servers))
    port_file = out_dir / 'scheduler.port'
    procs, logs = [], []

    def start(name, argv, extra):
        log = open(out_dir / f'{name}.log', 'w')
        logs.append((name, log))
        procs.append(subprocess.Popen(argv, env=dict(base, **extra), cwd=REPO, stdout=log,
                                      stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                      start_new_session=True))
        return procs[-1]

    node = [PY, '-m', 'kvps.node']
    rc = 0
    try:
        start('scheduler', node, {'DMLC_ROLE': 'scheduler', 'DMLC_PS_ROOT_PORT': '0',
                                  'KVPS_PORT_FILE': str(port_file)})
        port = wait_port(port_file, procs[0], 60)
        common = {'DMLC_PS_ROOT_PORT': str(port)}
        for j in range(servers):
            start(f'server{j}', node, dict(common, DMLC_ROLE='server', KVPS_RANK=str(j)))
        wprocs = [start(f'worker_proc{i}', list(worker_argv),
                        dict(common, DMLC_ROLE='worker', KVPS_RANK=str(i)))
                  for i in range(workers)]
        deadline = time.monotonic() + timeout
        for p in wprocs:
            rc = rc or p.wait(timeout=max(1.0, deadline - time.monotonic()))
        for p in procs:  # servers and scheduler end by themselves once the workers finish
            p.wait(timeout=30)
    except (subprocess.TimeoutExpired, RuntimeError):
        rc = rc or 124
    finally:
        for p in procs:
            if p.poll() is None:
                _stop_group(p, grace=2.0)
        for _, log in logs:
            log.close()
    text = ''.join(f'[{name}] ' + line for name, _ in logs
                   for line in (out_dir / f'{name}.log').read_text(errors='replace')
                   .splitlines(keepends=True))
    return rc, text, time.monotonic() - t0


def wait_port(path, proc, timeout):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            text = Path(path).read_text().strip()
            if text:
                return int(text)
        except (OSError, ValueError):
            pass
        if proc.poll() is not None:
            raise RuntimeError(f'scheduler exited with {proc.returncode} before its port file')
        time.sleep(0.05)
    raise RuntimeError('scheduler wrote no port file in time')


# -- CPU accounting --------------------------------------------------------------------------
def _clk_tck():
    try:
        return os.sysconf('SC_CLK_TCK')
    except (ValueError, OSError):
        return 100


def job_thread_cpu(tag):
    """CPU seconds so far of every thread of every process carrying ``KVPS_BENCH_TAG=tag``.

    Returns {process label: {'pid': pid, 'threads': {tid: (thread class, seconds)}}}; the label
    is e.g. 'server0' / 'worker1' / 'scheduler'. Thread classes: 'main'; 'zmq_io' (libzmq's
    ZMQbg/* threads, where socket reads and writes happen); 'py_threads' (other Python
    threads, e.g. the worker's kvps I/O thread); 'other'.
    """
    tck = _clk_tck()
    found = {}
    needle = f'{TAG_VAR}={tag}'.encode()
    for pid in os.listdir('/proc'):
        if not pid.isdigit():
            continue
        try:
            environ = Path(f'/proc/{pid}/environ').read_bytes().split(b'\0')
            if needle not in environ:
                continue
            env = dict(e.split(b'=', 1) for e in environ if b'=' in e)
            role = env.get(b'DMLC_ROLE', b'').decode()
            if not role:
                continue   # the launcher or a wrapper, not a node
            label = role + env.get(b'KVPS_RANK', b'').decode()
            found[label] = {'pid': int(pid), 'threads': _threads_cpu(pid, tck)}
        except OSError:
            continue
    return found


def _threads_cpu(pid, tck):
    threads = {}
    for tid in os.listdir(f'/proc/{pid}/task'):
        try:
            comm = Path(f'/proc/{pid}/task/{tid}/comm').read_text().strip()
            fields = Path(f'/proc/{pid}/task/{tid}/stat').read_text().rsplit(')', 1)[1].split()
        except OSError:
            continue
        secs = (int(fields[11]) + int(fields[12])) / tck   # utime + stime
        kind = ('main' if tid == pid else 'zmq_io' if comm.startswith('ZMQbg')
                else 'py_threads' if comm.startswith('python') else 'other')
        threads[tid] = (kind, secs)
    return threads


THREAD_CLASSES = ('main', 'py_threads', 'zmq_io', 'other')


def cpu_seconds(delta):
    """The CPU seconds of every thread of every node in a cpu_delta."""
    return sum(v for u in delta.values() for k, v in u.items() if k != 'pid')


def cpu_delta(before, after):
    """CPU seconds spent between two job_thread_cpu snapshots, per process and thread class
    (threads present in both; a thread that ended in between is left out), plus the pid."""
    out = {}
    for label, now in after.items():
        if label not in before or before[label]['pid'] != now['pid']:
            continue
        sums = dict.fromkeys(THREAD_CLASSES, 0.0)
        for tid, (kind, secs) in now['threads'].items():
            if tid in before[label]['threads']:
                sums[kind] += secs - before[label]['threads'][tid][1]
        out[label] = {k: round(v, 3) for k, v in sums.items()}
        out[label]['pid'] = now['pid']
    return out


# -- py-spy ----------------------------------------------------------------------------------
def pyspy_stacks(raw_path):
    """Parse ``py-spy record -s -f raw`` output: {pid: [(frames root..leaf, samples)]}.

    Each line is ``process P:"cmd";[process C:"cmd";]frame;frame;... COUNT``; the innermost
    ``process`` frame names the process the stack belongs to.
    """
    by_pid = {}
    with open(raw_path, errors='replace') as f:
        for line in f:
            stack, _, count = line.rstrip('\n').rpartition(' ')
            if not count.isdigit():
                continue
            pid, frames = None, []
            for frame in stack.split(';'):
                if frame.startswith('process ') and ':' in frame:
                    head = frame[len('process '):].split(':', 1)[0]
                    pid, frames = (int(head), []) if head.isdigit() else (pid, frames)
                else:
                    frames.append(frame)
            if pid is not None:
                by_pid.setdefault(pid, []).append((frames, int(count)))
    return by_pid
