"""What each compression type does to training: examples/train_digits.py's task, simulated.

One process plays the example's job (--workers workers, each its shard and its batches, the
same model, SGD with momentum and weight decay on the summed gradient as the servers run
it): each worker's gradient of each key goes through kvps's codec with its residual, the
server sums what they decode. Prints one JSON line per scheme: the test accuracy for each
seed and their mean, beside uncompressed training. 'onebit-per-part' is BytePS's onebit (one
scale, the mean |x| of the part) for comparison, and the same with one scale per 64
elements; kvps's 1bit sends two scales per chunk (of 64 elements unless said).

    python benchmarks/bench_codec_training.py                 # 5 seeds, ~3 min on 2 cores
    python benchmarks/bench_codec_training.py --seeds 2 --schemes none,1bit
"""

import argparse
import os
import statistics
import sys

import numpy as np
import torch

from kvps import compression

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), 'examples'))
from _common import JsonLines, default_out_dir, note  # noqa: E402  (benchmarks/: no package)
from train_digits import load_split  # noqa: E402

SCHEMES = {
    'none': None, 'fp16': {'type': 'fp16'}, 'bf16': {'type': 'bf16'},
    '2bit': {'type': '2bit', 'threshold': 0.5}, '1bit': {'type': '1bit'},
    '1bit-chunk4096': {'type': '1bit', 'chunk': 4096}, 'onebit-per-part': ('onebit', None),
    'onebit-per-64': ('onebit', 64),
    'topk-0.01': {'type': 'topk', 'ratio': 0.01}, 'topk-0.1': {'type': 'topk', 'ratio': 0.1},
}


class Worker:
    """One worker's codec (its residuals), or BytePS's onebit (one mean |x| per part, or per
    chunk of ``params[1]``) with a residual of its own."""

    def __init__(self, params):
        self.codec = compression.parse(params).push if isinstance(params, dict) else None
        self.onebit = params if isinstance(params, tuple) else None
        self.residuals = {}

    def sent(self, key, grad):
        """What the server gets for this worker's push of ``grad`` (flat float32)."""
        if self.onebit:
            residual = self.residuals.setdefault(key, np.zeros_like(grad))
            residual += grad
            chunk = self.onebit[1] or residual.size
            starts = np.arange(0, residual.size, chunk)
            means = np.add.reduceat(np.abs(residual), starts) / np.diff([*starts, residual.size])
            out = np.copysign(np.repeat(means, chunk)[:residual.size], residual)
            residual -= out
            return out
        if self.codec is None:
            return grad
        payload = np.empty(self.codec.nbytes(grad.size, 'float32'), np.uint8)
        self.codec.encode(key, 0, grad, payload)
        return compression.decode(self.codec.name, payload, grad.size, 'float32')


def train(scheme, seed, args):
    """Test accuracy after the example's training, with its defaults."""
    x_train, x_test, y_train, y_test = load_split()
    torch.manual_seed(1234 + seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, args.hidden), torch.nn.ReLU(),
                                torch.nn.Linear(args.hidden, 10))
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=args.lr, momentum=0.9, weight_decay=1e-4)
    w = args.workers
    workers = [Worker(SCHEMES[scheme]) for _ in range(w)]
    shards = [(torch.from_numpy(x_train[r::w]), torch.from_numpy(y_train[r::w].astype(np.int64)))
              for r in range(w)]
    rngs = [np.random.default_rng(100 * seed + r) for r in range(w)]
    loss_fn = torch.nn.CrossEntropyLoss(reduction='sum')
    steps = (len(x_train) // w) // args.batch_size
    for _ in range(args.epochs):
        orders = [torch.from_numpy(rng.permutation(len(s[0]))) for rng, s in zip(rngs, shards)]
        for step in range(steps):
            total = [np.zeros(p.numel(), np.float32) for p in params]
            for worker, (x, y), order in zip(workers, shards, orders):
                idx = order[step * args.batch_size:(step + 1) * args.batch_size]
                model.zero_grad()
                loss_fn(model(x[idx]), y[idx]).backward()
                for key, p in enumerate(params):
                    total[key] += worker.sent(key, p.grad.numpy().ravel().copy())
            for p, summed in zip(params, total):
                p.grad = torch.from_numpy(summed.reshape(p.shape)) / (args.batch_size * w)
            opt.step()
    with torch.no_grad():
        predicted = model(torch.from_numpy(x_test)).argmax(1).numpy()
    return float((predicted == y_test).mean())


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument('--schemes', default=','.join(SCHEMES))
    ap.add_argument('--seeds', type=int, default=5)
    ap.add_argument('--workers', type=int, default=4)
    ap.add_argument('--epochs', type=int, default=10)
    ap.add_argument('--batch-size', type=int, default=16)
    ap.add_argument('--lr', type=float, default=0.1)
    ap.add_argument('--hidden', type=int, default=64)
    ap.add_argument('--out', default=default_out_dir('codec_training'))
    args = ap.parse_args()
    out = JsonLines(args.out, 'codec_training')
    torch.set_num_threads(1)
    for scheme in args.schemes.split(','):
        note(scheme)
        accuracies = [round(train(scheme, seed, args), 4) for seed in range(args.seeds)]
        out.emit({'scheme': scheme, 'workers': args.workers, 'epochs': args.epochs,
                  'lr': args.lr, 'accuracy': accuracies,
                  'mean': round(statistics.mean(accuracies), 4)})


if __name__ == '__main__':
    main()
