"""Logistic regression with the raw KVStore API and numpy alone: MXNet's KVStore loop, on kvps.

    python -m kvps.launch -n 2 -s 2 python examples/logreg_kvstore.py         # 2 workers, 2 servers
    python -m kvps.launch -n 2 -s 1 python examples/logreg_kvstore.py --kvstore dist_async
    python examples/logreg_kvstore.py                                          # one process

No torch and no Trainer: each worker computes the gradient of the logistic loss on its shard of
scikit-learn's bundled breast-cancer data (rank::num_workers), pushes it under str keys, and
pulls the weights the servers' optimizer made of every worker's pushes. At the end rank 0 saves
the weights and the servers' optimizer state (`--save PREFIX`: PREFIX.npz and PREFIX.states),
from which a later job goes on (`--resume PREFIX`), and every rank prints the test accuracy.
Nothing is downloaded.
"""

import argparse
import os
import sys

import numpy as np
from sklearn.datasets import load_breast_cancer
from sklearn.model_selection import train_test_split

import kvps

KEYS = ['weight', 'bias']


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--epochs', type=int, default=20)
    parser.add_argument('--batch-size', type=int, default=32, help='per worker')
    parser.add_argument('--optimizer', default='adam', help="a kvps optimizer name: 'sgd', ...")
    parser.add_argument('--lr', type=float, default=0.05)
    parser.add_argument('--kvstore', default=os.environ.get('KVPS_KVSTORE', 'dist_sync'))
    parser.add_argument('--save', metavar='PREFIX',
                        help="save the weights and the servers' optimizer state at the end")
    parser.add_argument('--resume', metavar='PREFIX', help='go on from what --save wrote')
    return parser.parse_args()


def store_name(requested):
    """A dist_* store needs a job (kvps.launch sets the DMLC_*/KVPS_* variables)."""
    if requested.startswith('dist') and not any(v in os.environ for v in ('DMLC_ROLE',
                                                                         'KVPS_ROLE')):
        print(f"no kvps job found (DMLC_ROLE is unset): a 'local' store instead of "
              f'{requested!r}', flush=True)
        return 'local'
    return requested


def load_split():
    """The same split and scaling on every worker: standardized with the training split's
    statistics, float32."""
    data = load_breast_cancer()
    x_train, x_test, y_train, y_test = train_test_split(
        data.data, data.target, test_size=0.25, random_state=0, stratify=data.target)
    mean, std = x_train.mean(axis=0), x_train.std(axis=0)

    def scale(x):
        return ((x - mean) / std).astype(np.float32)
    return scale(x_train), scale(x_test), y_train.astype(np.float32), y_test


def gradients(weight, bias, x, y):
    """The summed logistic-loss gradient over the rows of ``x`` (the servers' rescale_grad
    turns the sum over every worker into a mean), and the summed loss."""
    p = 1.0 / (1.0 + np.exp(-(x @ weight + bias)))
    loss = -np.sum(y * np.log(p + 1e-7) + (1 - y) * np.log(1 - p + 1e-7))
    error = (p - y).astype(np.float32)
    return [x.T @ error, np.array([error.sum()], np.float32)], float(loss)


def train(kv, args, x, y):
    if args.resume:
        saved = np.load(args.resume + '.npz')
        weight, bias = saved['weight'], saved['bias']
    else:
        weight, bias = np.zeros(x.shape[1], np.float32), np.zeros(1, np.float32)
    # Collective: every worker inits the same keys; rank 0's values are stored.
    kv.init(KEYS, [weight, bias])
    combined = args.batch_size * kv.num_workers
    kv.set_optimizer(kvps.optimizer.create(args.optimizer, learning_rate=args.lr,
                                           rescale_grad=1.0 / combined))
    if args.resume:
        kv.load_optimizer_states(args.resume + '.states')   # collective: every worker calls it
    shard_x, shard_y = x[kv.rank::kv.num_workers], y[kv.rank::kv.num_workers]
    # Every worker makes the same number of pushes per epoch: a dist_sync round needs each.
    steps = (len(x) // kv.num_workers) // args.batch_size
    rng = np.random.default_rng(kv.rank)
    for epoch in range(1, args.epochs + 1):
        order, total = rng.permutation(len(shard_x)), 0.0
        for step in range(steps):
            rows = order[step * args.batch_size:(step + 1) * args.batch_size]
            kv.pull(KEYS, out=[weight, bias])      # the weights after the last round
            grads, loss = gradients(weight, bias, shard_x[rows], shard_y[rows])
            kv.push(KEYS, grads)                   # returns at once; the servers update
            total += loss
        if kv.rank == 0 and (epoch % 5 == 0 or epoch == args.epochs):
            print(f'epoch {epoch}/{args.epochs} loss {total / (steps * args.batch_size):.4f}',
                  flush=True)
    kv.pull(KEYS, out=[weight, bias])
    return weight, bias


def main():
    args = parse_args()
    kv = kvps.create(store_name(args.kvstore))
    x_train, x_test, y_train, y_test = load_split()
    if kv.rank == 0:
        print(f'{kv.type}: {kv.num_workers} worker(s), {len(x_train)} training rows, '
              f'{args.optimizer} in the store', flush=True)
    weight, bias = train(kv, args, x_train, y_train)
    if args.save:
        kv.barrier()   # every push applied: the state saved is the final one
        if kv.rank == 0:
            np.savez(args.save + '.npz', weight=weight, bias=bias)
            kv.save_optimizer_states(args.save + '.states')
            print(f'weights and optimizer state saved to {args.save}.npz/.states', flush=True)
    accuracy = float((((x_test @ weight + bias) > 0) == y_test).mean())
    print(f'rank {kv.rank}: test accuracy {accuracy:.4f}', flush=True)
    kv.close()
    return 0


if __name__ == '__main__':
    sys.exit(main())
