"""The optimizer runs that test_more_optimizers compares with MXNet 1.9.1, torch and the float64
references, as plain data (numpy only: mxnet_anchors.py reads it from MXNet's environment)."""

import zlib

import numpy as np

STEPS = 30
# (id, optimizer, its parameters, a FactorScheduler's (step, factor) or None, the key)
CONFIGS = [
    ('adadelta', 'adadelta', dict(wd=0.01, rescale_grad=0.5, clip_gradient=0.8,
                                  learning_rate=0.3), None, 0),
    ('adadelta-rho', 'adadelta', dict(rho=0.95, epsilon=1e-4), None, 0),
    ('adamax', 'adamax', dict(wd=0.01, rescale_grad=0.5, clip_gradient=0.8,
                              learning_rate=0.002), (10, 0.5), 0),
    ('adamax-betas', 'adamax', dict(beta1=0.8, beta2=0.99, learning_rate=0.01), None, 0),
    ('nadam', 'nadam', dict(wd=0.01, rescale_grad=0.5, clip_gradient=0.8,
                            learning_rate=0.001), (10, 0.5), 0),
    ('nadam-decay', 'nadam', dict(beta1=0.8, beta2=0.99, epsilon=1e-6, schedule_decay=0.1,
                                  learning_rate=0.01), None, 0),
    ('ftml', 'ftml', dict(wd=0.01, rescale_grad=0.5, clip_gradient=0.8, learning_rate=0.05),
     None, 0),
    ('ftml-betas', 'ftml', dict(beta1=0.5, beta2=0.99, epsilon=1e-6, learning_rate=0.02),
     (10, 0.5), 0),
    ('lars', 'lars', dict(momentum=0.9, eta=0.01, eps=1e-6, wd=0.01, rescale_grad=0.5,
                          clip_gradient=0.8, learning_rate=0.5), (10, 0.5), 0),
    ('lars-uncorrected', 'lars', dict(momentum=0.9, momentum_correction=False,
                                      learning_rate=0.5), (10, 0.5), 0),
    ('lars-bias', 'lars', dict(momentum=0.9, learning_rate=0.1), None, 'fc_bias'),
    ('lbsgd', 'lbsgd', dict(momentum=0.9, batch_scale=3, warmup_epochs=2, updates_per_epoch=5,
                            wd=0.01, rescale_grad=0.5, clip_gradient=0.8, learning_rate=0.1),
     (10, 0.5), 0),
    ('lbsgd-sqrt', 'lbsgd', dict(warmup_strategy='sqrt', batch_scale=4, warmup_epochs=3,
                                 updates_per_epoch=4, begin_epoch=1, learning_rate=0.05), None, 0),
    ('lbsgd-power2', 'lbsgd', dict(momentum=0.5, warmup_strategy='power2', batch_scale=2,
                                   warmup_epochs=4, updates_per_epoch=5), None, 0),
    ('lbsgd-lars', 'lbsgd', dict(momentum=0.9, warmup_strategy='lars', batch_scale=2, wd=0.01,
                                 learning_rate=0.01), None, 0),
    ('sgld', 'sgld', dict(wd=0.01, rescale_grad=0.5, clip_gradient=0.8, learning_rate=0.01),
     (10, 0.5), 'w'),
    ('dcasgd', 'dcasgd', dict(lamda=0.1, wd=0.01, rescale_grad=0.5, clip_gradient=0.8,
                              learning_rate=0.1), (10, 0.5), 0),
    ('dcasgd-momentum', 'dcasgd', dict(momentum=0.9, lamda=0.04, learning_rate=0.05), None, 0),
    ('ccsgd', 'ccsgd', dict(momentum=0.9, wd=0.01, rescale_grad=0.5, learning_rate=0.1), None,
     0),
    ('adabelief', 'adabelief', dict(wd=0.01, rescale_grad=0.5, clip_gradient=0.8,
                                    learning_rate=0.01), (10, 0.5), 0),
    ('adabelief-uncorrected', 'adabelief', dict(correct_bias=False, epsilon=1e-3, beta1=0.8,
                                                beta2=0.99), None, 0),
    ('lans', 'lans', dict(wd=0.01, rescale_grad=0.5, clip_gradient=0.8, learning_rate=0.01),
     (10, 0.5), 0),
    ('lans-bounds', 'lans', dict(lower_bound=0.5, upper_bound=2.0, beta1=0.8, beta2=0.99,
                                 epsilon=1e-5, learning_rate=0.02), None, 0),
]
BY_ID = {c[0]: c for c in CONFIGS}
# MXNet 1.9.1 has neither (MXNet 2 does); it fails DCASGD with momentum (it tests an array's
# truth value)
NOT_IN_MXNET_19 = {'adabelief', 'adabelief-uncorrected', 'lans', 'lans-bounds',
                   'dcasgd-momentum'}


def problem(config_id, n, steps=STEPS):
    """The starting weight and the gradients of a run: float32, from the id alone."""
    rng = np.random.default_rng(zlib.crc32(config_id.encode()))
    w0 = rng.standard_normal(n).astype(np.float32)
    return w0, [(rng.standard_normal(n) * 1.5).astype(np.float32) for _ in range(steps)]


def draws(n, steps=STEPS):
    """Standard normal draws that stand in for SGLD's noise in the runs compared with MXNet
    (whose generator kvps cannot reproduce): the same numbers on both sides."""
    rng = np.random.default_rng(2024)
    return [rng.standard_normal(n) for _ in range(steps)]

# GroupAdaGrad's runs (MXNet 1.9 contrib), on a weight of GROUP_SHAPE: (id, parameters, a
# FactorScheduler's (step, factor) or None, how the gradients go: 'dense' (MXNet's Python
# rule), 'rows' (every row as row_sparse: MXNet's fused kernel) or 'some' (group_rows(step)
# only, row_sparse), multi_precision on a float16 weight)
GROUP_SHAPE = (6, 5)
GROUP_CONFIGS = [
    ('groupadagrad', dict(rescale_grad=0.5, clip_gradient=0.8, learning_rate=0.1), (10, 0.5),
     'dense', False),
    ('groupadagrad-rows', dict(rescale_grad=0.5, clip_gradient=0.8, learning_rate=0.1),
     (10, 0.5), 'rows', False),
    ('groupadagrad-some', dict(eps=1e-3, learning_rate=0.05), None, 'some', False),
    ('groupadagrad-mp', dict(learning_rate=0.1, multi_precision=True), None, 'some', True),
]


def group_rows(step):
    """The rows of GROUP_SHAPE that a 'some' run's gradient ``step`` has (sorted)."""
    return sorted({step % GROUP_SHAPE[0], (3 * step + 1) % GROUP_SHAPE[0]})


def group_problem(config_id):
    """A GroupAdaGrad run's starting weight and gradients, of GROUP_SHAPE, float32."""
    w0, grads = problem(config_id, GROUP_SHAPE[0] * GROUP_SHAPE[1])
    return w0.reshape(GROUP_SHAPE), [g.reshape(GROUP_SHAPE) for g in grads]
