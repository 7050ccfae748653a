"""2-bit compression of a push of several values: quantize their sum, or each value alone?

A `device` or `dist*_device` push may carry one gradient per GPU. MXNet's `dist*` stores sum
them and quantize the sum with one residual per key (as kvps does on every store); MXNet's
`device` store quantizes each GPU's gradient with a residual of its own and sums the results.
This trains the same model three ways from the same start, with ``--values`` gradients per
push, and prints per scheme (one JSON line each): the final training loss and accuracy, and
how far the weights drifted from the uncompressed run's (relative L2). The scheme that loses
less is the one kvps keeps (docs/api.md says which and why).

    python benchmarks/bench_compression.py                 # 4 values, 4 thresholds, ~10 s
    python benchmarks/bench_compression.py --steps 200     # shorter
"""

import argparse
import os
import sys

import numpy as np
import torch

from kvps import compression

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import JsonLines, default_out_dir, note  # noqa: E402  (benchmarks/: no package)


def make_data(samples, features, classes, seed):
    """A classification task a small MLP learns well: labels from a random teacher."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, features, generator=gen)
    teacher = torch.randn(features, classes, generator=gen)
    return x, (x @ teacher).argmax(1)


def make_model(features, classes, seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(features, 256), torch.nn.ReLU(),
                               torch.nn.Linear(256, classes))


class Scheme:
    """What a push of ``values`` gradients of one key delivers: exact, the quantized sum
    (kvps; MXNet's dist stores) or the sum of each value quantized alone (MXNet's device
    store), the residuals kept between steps."""

    def __init__(self, name, threshold):
        self.name = name
        self.codec = compression.TwoBit(threshold) if name != 'none' else None

    def deliver(self, key, values):
        if self.codec is None:
            return np.sum(values, axis=0)
        if self.name == 'sum_first':
            return self._sent((key, 0), np.sum(values, axis=0))
        return np.sum([self._sent((key, i), v) for i, v in enumerate(values)], axis=0)

    def _sent(self, slot, grad):
        out = np.empty(compression.nbytes('2bit', grad.size), np.uint8)
        self.codec.encode(slot, 0, grad.ravel(), out)
        return compression.decode('2bit', out, grad.size, 'float32').reshape(grad.shape)


def train(scheme, data, args):
    """SGD on the mean gradient of ``args.values`` equal shares of each batch."""
    x, y = data
    model = make_model(x.shape[1], args.classes, args.seed)
    params = list(model.parameters())
    gen = torch.Generator().manual_seed(args.seed + 1)
    for _ in range(args.steps):
        batch = torch.randint(0, len(x), (args.batch,), generator=gen)
        grads = []
        for share in batch.chunk(args.values):
            model.zero_grad()
            torch.nn.functional.cross_entropy(model(x[share]), y[share]).backward()
            grads.append([p.grad.numpy().copy() for p in params])
        with torch.no_grad():
            for key, p in enumerate(params):
                total = scheme.deliver(key, [g[key] for g in grads])
                p -= args.lr / args.values * torch.from_numpy(total)
    with torch.no_grad():
        logits = model(x)
        loss = torch.nn.functional.cross_entropy(logits, y).item()
        accuracy = (logits.argmax(1) == y).float().mean().item()
    return loss, accuracy, torch.cat([p.detach().ravel() for p in params])


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument('--values', type=int, default=4, help='gradients per push (GPUs)')
    ap.add_argument('--thresholds', type=float, nargs='+', default=[1.0, 0.5, 0.1, 0.01])
    ap.add_argument('--steps', type=int, default=1000)
    ap.add_argument('--batch', type=int, default=128)
    ap.add_argument('--lr', type=float, default=0.1)
    ap.add_argument('--classes', type=int, default=10)
    ap.add_argument('--seed', type=int, default=0)
    ap.add_argument('--out', default=default_out_dir('compression'))
    args = ap.parse_args()
    out = JsonLines(args.out, 'compression')
    torch.set_num_threads(1)
    data = make_data(8192, 64, args.classes, args.seed)
    loss, accuracy, exact = train(Scheme('none', None), data, args)
    out.emit({'scheme': 'none', 'values': args.values, 'steps': args.steps,
              'loss': round(loss, 4), 'accuracy': round(accuracy, 4)})
    for threshold in args.thresholds:
        for name in ('sum_first', 'per_value'):
            note(f'{name}, threshold {threshold}')
            loss, accuracy, weights = train(Scheme(name, threshold), data, args)
            drift = float((weights - exact).norm() / exact.norm())
            out.emit({'scheme': name, 'threshold': threshold, 'values': args.values,
                      'steps': args.steps, 'loss': round(loss, 4),
                      'accuracy': round(accuracy, 4), 'drift_from_exact': round(drift, 4)})


if __name__ == '__main__':
    main()
