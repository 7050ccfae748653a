"""Print MXNet 1.9.1's weights after the runs of optimizer_configs, the literals that
test_more_optimizers bakes in (tests never import mxnet). Run from tests/unit with MXNet's
Python: ``python mxnet_anchors.py``."""

import mxnet as mx
import numpy as np
from optimizer_configs import (CONFIGS, GROUP_CONFIGS, NOT_IN_MXNET_19, STEPS, draws,
                               group_problem, group_rows, problem)

N = 16   # elements of each run's weight


def run(name, params, sched, key, config_id):
    params = dict(params)
    if sched:
        params['lr_scheduler'] = mx.lr_scheduler.FactorScheduler(step=sched[0], factor=sched[1])
    if name == 'lars' and isinstance(key, str):   # LARS reads names (they set no wd_mult
        params['param_idx2name'] = {0: key}      # here: the run has no wd)
    opt = mx.optimizer.create(name, **params)
    updater = mx.optimizer.get_updater(opt)
    w0, grads = problem(config_id, N)
    weight = mx.nd.array(w0, dtype='float32')
    for g in grads:
        updater(0, mx.nd.array(g, dtype='float32'), weight)
    return weight.asnumpy()


def stand_in_noise():
    """SGLD's draws replaced by optimizer_configs.draws, in order (kvps's test does the same)."""
    pending = list(draws(N))

    def normal(loc, scale, shape, dtype, ctx):
        return mx.nd.array((scale * pending.pop(0)).astype(np.float32), ctx=ctx, dtype=dtype)
    mx.optimizer.optimizer.normal = normal


def two_keys():
    """Nadam on two keys, updated in turn: MXNet's one momentum schedule for both."""
    opt = mx.optimizer.create('nadam', learning_rate=0.01)
    updater = mx.optimizer.get_updater(opt)
    runs = [problem(f'nadam-key{k}', N) for k in (0, 1)]
    weights = [mx.nd.array(w0) for w0, _ in runs]
    for step in range(STEPS):
        for k in (0, 1):
            updater(k, mx.nd.array(runs[k][1][step]), weights[k])
    return [w.asnumpy() for w in weights]


def main():
    print(f'# MXNet {mx.__version__}: weights after {STEPS} updates of {N} elements')
    print('MXNET = {')
    for config_id, name, params, sched, key in CONFIGS:
        if config_id in NOT_IN_MXNET_19:
            continue
        if name == 'sgld':
            stand_in_noise()
        values = ', '.join('%.9g' % v for v in run(name, params, sched, key, config_id))
        print(f'    {config_id!r}: [{values}],')
    for k, weight in enumerate(two_keys()):
        print(f"    'nadam-key{k}': [{', '.join('%.9g' % v for v in weight)}],")
    print('}')


def group_run(params, sched, grads_as, mp, config_id):
    """A GroupAdaGrad run of optimizer_configs.GROUP_CONFIGS in MXNet."""
    params = dict(params)
    if sched:
        params['lr_scheduler'] = mx.lr_scheduler.FactorScheduler(step=sched[0], factor=sched[1])
    updater = mx.optimizer.get_updater(mx.optimizer.create('groupadagrad', **params))
    w0, grads = group_problem(config_id)
    dtype = 'float16' if mp else 'float32'
    weight = mx.nd.array(w0, dtype=dtype)
    for step, g in enumerate(grads):
        if grads_as == 'dense':
            updater(0, mx.nd.array(g, dtype=dtype), weight)
            continue
        rows = list(range(g.shape[0])) if grads_as == 'rows' else group_rows(step)
        updater(0, mx.nd.sparse.row_sparse_array((g[rows], rows), shape=g.shape, dtype=dtype),
                weight)
    return weight.asnumpy().reshape(-1)


def main_group():
    print(f'# MXNet {mx.__version__}: GroupAdaGrad weights after {STEPS} updates')
    print('MXNET_GROUP = {')
    for config_id, params, sched, grads_as, mp in GROUP_CONFIGS:
        values = ', '.join('%.9g' % v for v in group_run(params, sched, grads_as, mp, config_id))
        print(f'    {config_id!r}: [{values}],')
    print('}')


if __name__ == '__main__':
    main()
    main_group()
