"""Training steps of a torch model through kvps, through torch DDP (gloo), and alone, side by side.

What a user compares before adopting kvps: the time of one synchronous data-parallel step
(forward, backward, gradient exchange, SGD with momentum) with W workers on this host.
Systems: `kvps` (Trainer, SGD on the servers), `kvps-local` (Trainer with
update_on_kvstore=False: gradients summed through the servers, SGD on each worker), and when
named `kvps-torch` (`kvps-local` with torch.optim.SGD, DDP's optimizer, in the Trainer) and
`kvps-cb` (`kvps` with cross_barrier=True: each module's forward waits for its own weights
only), `ddp`
(DistributedDataParallel over gloo, the all-reduce torch users run) and `alone` (the same model
trained in one process on the global batch, W x batch, with no communication at all: the limit
the others are measured against). Models: `wide` (784-1024-1024-1024-10, 8 tensors, 11.6 MB),
`deep` (40 layers of 256, 82 tensors, 11 MB), `narrow` (200 layers of 64, 402 tensors, 3.5 MB:
a transformer's many small weights, biases and norms), `embed` (a 200000 x 64 embedding table,
51 MB, 16 rows read per sample, then a classifier), `embed-sparse` (the same with
nn.Embedding(sparse=True): kvps pushes the rows read and pulls the rows changed, DDP
all-reduces the sparse gradients), and, when named, two realistic models (models.py): `resnet`
(ResNet-18 on synthetic 3x32x32 images, 11.2M parameters) and `gpt` (a 6-layer GPT, 25.3M
parameters, on synthetic tokens), at full size on a GPU and smaller on the CPU (--size). One
JSON line per (model, system), a ratio line per model against DDP (kvps ms / DDP ms: below 1,
kvps is faster) and one against alone (each system's ms / alone's: 1 is the limit). Every
process runs torch with one thread, but alone on the CPU, which runs W.

    python benchmarks/bench_training.py                  # W=2 S=1, wide, deep, narrow, ~2 min
    python benchmarks/bench_training.py --workers 4 --servers 2 --models wide
    python benchmarks/bench_training.py --device cuda     # models and batches on the GPU
    python benchmarks/bench_training.py --device cuda --models resnet,gpt
    python benchmarks/bench_training.py --device cuda --mps   # every job under a CUDA MPS daemon
    python benchmarks/bench_training.py --device cuda --models gpt --profile 5   # torch.profiler
"""
import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402  (benchmarks/ is not a package)
import training_worker  # noqa: E402  (its tables; torch is imported by the worker only)

from kvps.errors import ConfigError  # noqa: E402
from kvps.launch import mps  # noqa: E402

SYSTEMS = training_worker.SYSTEMS
WORKER = str(Path(__file__).resolve().parent / 'training_worker.py')


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('--workers', type=int, default=2)
    p.add_argument('--servers', type=int, default=1)
    p.add_argument('--models', default='wide,deep,narrow',
                   help='comma list; also embed, embed-sparse, resnet, gpt')
    p.add_argument('--systems', default=','.join(s for s in SYSTEMS
                                                 if s not in ('kvps-cb', 'kvps-torch')),
                   help=f'comma list of {", ".join(SYSTEMS)} (default: all but kvps-cb and '
                        'kvps-torch)')
    p.add_argument('--steps', type=int, default=20)
    p.add_argument('--batch', type=int, default=None,
                   help='samples per worker (default: 64; resnet and gpt: their size\'s)')
    p.add_argument('--size', choices=['full', 'small'], default=None,
                   help='resnet and gpt: full (the default with a GPU) or small (on the CPU)')
    p.add_argument('--launches', type=int, default=1, help='runs per (model, system)')
    p.add_argument('--timeout', type=float, default=300.0)
    p.add_argument('--out', default=None, help='directory for results.jsonl')
    p.add_argument('--device', default='cpu', help='where the workers train: cpu or cuda')
    p.add_argument('--amp', action='store_true',
                   help='every system\'s forward under torch.autocast in bfloat16, as mixed '
                        'precision training runs on such GPUs (no loss scaling needed)')
    p.add_argument('--mps', action='store_true',
                   help='every job under a private CUDA MPS daemon: kvps through kvps.launch '
                        '--mps, ddp and alone through the same start and stop')
    p.add_argument('--timeline', action='store_true',
                   help='run each kvps system once more with the timeline on: where its step '
                        'goes, per role and thread (python -m kvps.timeline summary)')
    p.add_argument('--bucket-bytes', type=int, default=None,
                   help='the kvps Trainer\'s bucket_bytes (default: its own: 4 MiB on one host)')
    p.add_argument('--profile', type=int, default=0, metavar='N',
                   help='every worker runs N more steps under torch.profiler: where the host\'s '
                        'time goes op by op, the CUDA calls that block it, the GPU time of its '
                        'own kernels (rank 0\'s summary in the line, its Chrome trace in the '
                        'run\'s folder)')
    args = p.parse_args()
    args.size = args.size or training_worker.default_size(args.device)
    return args


def run_torch_job(ranks, argv, out_dir, timeout, name, use_mps=False):
    """``ranks`` torch processes (DDP's meet through a FileStore in ``out_dir``; alone is one),
    clients of a private MPS daemon when ``use_mps``, as kvps.launch --mps makes a kvps job's;
    returns (rc, log)."""
    try:
        with mps.running(use_mps, os.environ, _common.note) as variables:
            return _torch_processes(ranks, argv, out_dir, timeout, name, variables)
    except ConfigError as exc:   # no daemon: nothing started (the launcher's exit code)
        return 2, str(exc)


def _torch_processes(ranks, argv, out_dir, timeout, name, variables):
    rendezvous = Path(out_dir) / 'rendezvous'
    rendezvous.unlink(missing_ok=True)
    log_path = Path(out_dir) / f'{name}.log'
    procs = []
    with open(log_path, 'w') as log:
        for rank in range(ranks):
            env = dict(os.environ, **variables, RANK=str(rank), WORLD_SIZE=str(ranks),
                       KVPS_BENCH_RENDEZVOUS=str(rendezvous), GLOO_SOCKET_IFNAME='lo',
                       OMP_NUM_THREADS='1', PYTHONUNBUFFERED='1')
            procs.append(subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL, start_new_session=True))
        deadline = time.monotonic() + timeout
        rc = 0
        for proc in procs:
            try:
                rc = rc or proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                rc = 124
        for proc in procs:
            if proc.poll() is None:
                _common._stop_group(proc)
    return rc, log_path.read_text(errors='replace')


def run_one(args, model, system, out_dir, launcher_args=()):
    """ms per step on rank 0 (None if the run failed) for one (model, system), and the
    workers' records."""
    out_dir.mkdir(parents=True, exist_ok=True)
    argv = [_common.PY, WORKER, '--system', system, '--model', model, '--steps', str(args.steps),
            '--size', args.size, '--workers', str(args.workers), '--out', str(out_dir),
            '--device', args.device, *(['--batch', str(args.batch)] if args.batch else []),
            *(['--amp'] if args.amp else []),
            *(['--profile', str(args.profile)] if args.profile else []),
            *(['--bucket-bytes', str(args.bucket_bytes)] if args.bucket_bytes is not None
              else [])]
    ranks = 1 if system == 'alone' else args.workers
    if system in ('ddp', 'alone'):
        rc, log = run_torch_job(ranks, argv, out_dir, args.timeout, system, args.mps)
    else:
        rc, log, _, _ = _common.run_kvps_job(
            args.workers, args.servers, argv, out_dir, args.timeout, tag=f'training-{system}',
            launcher_args=(*launcher_args, *(['--mps'] if args.mps else [])))
    records = _common.read_worker_records(out_dir, ranks)
    if rc != 0 or len(records) != ranks:
        _common.note(f'{model}/{system} failed (rc {rc}):\n{log[-2000:]}')
        return None, records
    return records[0]['ms_step_median'], records
def traced(args, model, system, out_dir):
    """The timeline line of one (model, system): its step with the timeline on, and the
    summary's ms per step by role, thread and kind of span."""
    from kvps.timeline import summary
    trace = out_dir / 'trace.json'
    value, _ = run_one(args, model, system, out_dir, ('--timeline', str(trace)))
    record = {'model': model, 'system': system, 'kind': 'timeline', 'ms_step_traced': value,
              'trace': str(trace)}
    if trace.exists():
        view = summary.Timeline(summary.load(trace))
        record['ms_per_step'] = {f'{role} ({thread})': {k: round(v, 3) for k, v in kinds.items()}
                                 for (role, thread), kinds in view.per_step().items()}
    return record


def measure(args, model, system, out):
    """The line of one (model, system): rank 0's ms per step, the median over launches, and
    the seconds its launches took (a GPU session's budget is made of these)."""
    runs, records, start = [], [], time.monotonic()
    for launch in range(args.launches):
        value, got = run_one(args, model, system, out / f'{model}-{system}-{launch}')
        runs.append(value)
        records = got if value is not None else records   # a launch that ran
    first = records[0] if records else {}
    batch = first.get('batch', args.batch)
    return {'model': model, 'system': system, 'device': args.device, 'size': first.get('size'),
            'workers': args.workers,
            'servers': args.servers if system.startswith('kvps') else None,
            'params': first.get('params'), 'tensors': first.get('tensors'), 'batch': batch,
            'global_batch': batch and batch * args.workers,
            'ms_step': _common.median([r for r in runs if r is not None]), 'ms_step_runs': runs,
            'loss_first': first.get('loss_first'), 'loss_last': first.get('loss_last'),
            **({'profile': first['profile']} if 'profile' in first else {}),
            'wall_s': round(time.monotonic() - start, 1)}   # the launches, start to end


def ratios(model, ms):
    """A line per baseline that ran: every other system's ms over DDP's, then over alone's."""
    for base in ('ddp', 'alone'):
        if ms.get(base):
            yield {'model': model, 'kind': 'ratio', 'vs': base,
                   **{f'{s}_over_{base}': round(ms[s] / ms[base], 2)
                      for s in ms if s not in (base, 'alone') and ms[s]}}


def main():
    args = parse_args()
    out = Path(args.out or _common.default_out_dir('training'))
    lines = _common.JsonLines(out, 'training')

    def emit(record):   # every line says whether its jobs ran under MPS, and in bfloat16
        return lines.emit({**record, 'mps': args.mps, 'amp': args.amp})
    for model in args.models.split(','):
        ms = {}
        for system in args.systems.split(','):
            ms[system] = emit(measure(args, model, system, out))['ms_step']
        for system in args.systems.split(',') if args.timeline else ():
            if system.startswith('kvps'):
                emit(traced(args, model, system, out / f'{model}-{system}-traced'))
        for line in ratios(model, ms):
            emit(line)
    _common.note(f'results in {lines.path}')


if __name__ == '__main__':
    main()
