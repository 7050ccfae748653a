"""Data-parallel training of a small MLP on scikit-learn's bundled digits, through a kvps Trainer.

    python -m kvps.launch -n 4 -s 2 python examples/train_digits.py     # 4 workers, 2 servers
    python examples/train_digits.py                                      # one process, no servers
    KVPS_KVSTORE=dist_async python -m kvps.launch -n 2 -s 1 python examples/train_digits.py
    python -m kvps.launch -n 2 -s 1 python examples/train_digits.py --device cuda   # on a GPU
    python -m kvps.launch -n 4 -s 2 python examples/train_digits.py --gc-type 1bit   # compressed
    python -m kvps.launch -n 2 -s 1 python examples/train_digits.py --torch-optimizer

Each worker trains on its own shard of the training split (rank::num_workers); rank 0's initial
weights are broadcast to all, the servers sum the gradients, and every rank prints the final
test accuracy. Nothing is downloaded: the digits ship inside scikit-learn.
"""

import argparse
import math
import os
import sys
import time

import numpy as np
import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

try:
    from tqdm import tqdm   # the `examples` extra installs it; without it there is no bar
except ImportError:
    tqdm = None

import kvps
from kvps import Trainer


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--epochs', type=int, default=10)
    parser.add_argument('--batch-size', type=int, default=16, help='per worker')
    parser.add_argument('--lr', type=float, default=0.1)
    parser.add_argument('--hidden', type=int, default=64)
    parser.add_argument('--kvstore', default=os.environ.get('KVPS_KVSTORE'),
                        help='default dist_sync, or dist_sync_device with --device cuda')
    parser.add_argument('--device', default='cpu', help="where the model trains: cpu or cuda "
                        "(cuda:N); CUDA parameters need a device store")
    parser.add_argument('--update-on-kvstore', choices=('auto', 'yes', 'no'), default='auto')
    parser.add_argument('--torch-optimizer', action='store_true',
                        help='torch.optim.SGD in place of kvps\'s sgd: the servers only sum and '
                             'every worker updates with it, as under DDP')
    # MXNet's example scripts' names for gradient compression (kvps.compression)
    parser.add_argument('--gc-type', default='none',
                        help='gradient compression: none, 2bit, fp16, bf16, 1bit or topk')
    parser.add_argument('--gc-threshold', type=float, default=0.5, help='2bit\'s threshold')
    parser.add_argument('--gc-ratio', type=float, default=0.01, help='topk\'s share sent')
    parser.add_argument('--gc-pull', default='none', help='pulls in fp16 or bf16 (or none)')
    return parser.parse_args()


def compression_params(args):
    """The Trainer's compression_params from --gc-* (None: no compression)."""
    if args.gc_type == 'none' and args.gc_pull == 'none':
        return None
    params = {'type': args.gc_type, 'pull': args.gc_pull}
    if args.gc_type == '2bit':
        params['threshold'] = args.gc_threshold
    elif args.gc_type == 'topk':
        params['ratio'] = args.gc_ratio
    return params


def store_name(requested, on_gpu):
    """The store to use: a dist_* store needs a job (kvps.launch sets DMLC_*/KVPS_* for us);
    parameters on a GPU need a device-side store (sums on the GPU, pinned transfers)."""
    requested = requested or ('dist_sync_device' if on_gpu else 'dist_sync')
    in_job = any(name in os.environ for name in ('DMLC_ROLE', 'KVPS_ROLE'))
    if requested.startswith('dist') and not in_job:
        alone = 'device' if on_gpu else 'local'
        print(f'no kvps job found (DMLC_ROLE is unset): training in this process alone with a '
              f"{alone!r} store instead of {requested!r}. Start a job with "
              '`python -m kvps.launch -n 4 -s 2 python examples/train_digits.py`', flush=True)
        return alone
    return requested


def load_split():
    """The same train/test split on every worker (fixed seed), pixels scaled to [0, 1]."""
    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    return train_test_split(x, digits.target, test_size=0.25, random_state=0,
                            stratify=digits.target)


def make_model(hidden, rank, device):
    # Seeded per rank on purpose: the Trainer replaces every worker's weights with rank 0's.
    torch.manual_seed(1234 + rank)
    return torch.nn.Sequential(torch.nn.Linear(64, hidden), torch.nn.ReLU(),
                               torch.nn.Linear(hidden, 10)).to(device)


def progress(enabled, epoch, epochs, steps):
    """Rank 0's tqdm bar for one epoch (None: no bar). On a terminal tqdm redraws it in place;
    in a log (under kvps.launch every process writes to a pipe) it stays silent and
    ``finish`` prints the finished bar once, one line per epoch."""
    if not enabled or tqdm is None:
        return None
    quiet = not sys.stdout.isatty()
    return tqdm(total=steps, desc=f'epoch {epoch}/{epochs}', file=sys.stdout,
                delay=math.inf if quiet else 0)


def finish(bar):
    if bar is not None:
        bar.close()
        if bar.delay:   # silent so far: the log's one line
            print(bar, flush=True)


def train(args, model, trainer, x, y, num_workers):
    rank = trainer.kvstore.rank if trainer.kvstore is not None else 0
    # Every worker makes the same number of steps: a sync round needs a push from each.
    steps = (len(x) // num_workers) // args.batch_size
    shard_x = torch.from_numpy(x[rank::num_workers]).to(args.device)
    shard_y = torch.from_numpy(y[rank::num_workers]).to(args.device)
    rng = np.random.default_rng(rank)
    loss_fn = torch.nn.CrossEntropyLoss(reduction='sum')
    for epoch in range(1, args.epochs + 1):
        order = torch.from_numpy(rng.permutation(len(shard_x))).to(args.device)
        total = 0.0
        bar = progress(rank == 0, epoch, args.epochs, steps)
        for step in range(1, steps + 1):
            idx = order[(step - 1) * args.batch_size: step * args.batch_size]
            trainer.zero_grad()
            # (phases show in a timeline: python -m kvps.launch --timeline trace.json ...)
            with kvps.timeline.phase('forward'):
                loss = loss_fn(model(shard_x[idx]), shard_y[idx])
            with kvps.timeline.phase('backward'):
                loss.backward()
            # The servers sum over workers: normalizing by the combined batch makes one step
            # equal to a single-process step on every worker's samples together (counted
            # now: an elastic job's workers come and go, docs/elastic.md).
            kv = trainer.kvstore
            trainer.step(args.batch_size * (kv.num_workers if kv is not None else 1))
            total += loss.item() / args.batch_size
            if bar is not None:
                bar.set_postfix(loss=f'{total / step:.3f}', refresh=False)
                bar.update()
        finish(bar)


def accuracy(model, x, y, device):
    with torch.no_grad():
        predicted = model(torch.from_numpy(x).to(device)).argmax(dim=1).cpu().numpy()
    return float((predicted == y).mean())


def main():
    args = parse_args()
    on_gpu = torch.device(args.device).type == 'cuda'
    if on_gpu and not torch.cuda.is_available():
        sys.exit(f'--device {args.device}: this torch sees no CUDA device (a CPU-only build, '
                 'or no GPU); train on the CPU with --device cpu')
    torch.set_num_threads(1)  # workers share the machine's cores; a tiny MLP gains nothing more
    name = store_name(args.kvstore, on_gpu)
    kv = kvps.create(name)
    uok = {'auto': None, 'yes': True, 'no': False}[args.update_on_kvstore]
    x_train, x_test, y_train, y_test = load_split()
    model = make_model(args.hidden, kv.rank, args.device)
    compression = compression_params(args)
    if args.torch_optimizer:   # (the same rule: torch's SGD with momentum and weight decay)
        optimizer, params = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9,
                                            weight_decay=1e-4), None
    else:
        optimizer, params = 'sgd', {'learning_rate': args.lr, 'momentum': 0.9, 'wd': 1e-4}
    trainer = Trainer(model.named_parameters(), optimizer, params, kvstore=kv,
                      update_on_kvstore=uok,
                      compression_params=compression if name != 'local' else None)
    if kv.rank == 0:
        print(f'{name}: {kv.num_workers} worker(s), {len(x_train)} training digits, '
              f'update_on_kvstore={trainer.update_on_kvstore}, compression={compression}',
              flush=True)
    start = time.monotonic()
    train(args, model, trainer, x_train, y_train.astype(np.int64), kv.num_workers)
    acc = accuracy(model, x_test, y_test, args.device)
    print(f'rank {kv.rank}: test accuracy {acc:.4f} ({time.monotonic() - start:.1f} s)',
          flush=True)
    kv.close()
    return 0


if __name__ == '__main__':
    sys.exit(main())
