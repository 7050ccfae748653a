"""The numpy kernels against plain transcriptions of each published rule, and torch.optim."""

import math

import numpy as np
import pytest

from kvps.optimizer.kernels import (KERNEL_NAMES, kernels_for, multi_apply, numpy_blocks as B,
                                    numpy_kernels as K)
from kvps.optimizer.kernels import numpy_packing
from kvps.optimizer.kernels.numpy_packing import PACK_UP_TO, Slabs
from kvps.errors import DTypeError, ShapeError
import reference_rules as more

STEPS = 20
BASE = dict(lr=0.05, wd=0.01, rescale=0.5, clip=0.8)


# ---------------------------------------------------------------- reference rules (float64)
def prep(g, w, rescale, clip, wd, with_wd=True):
    g = g * rescale
    if clip is not None:
        g = np.clip(g, -clip, clip)
    return g + wd * w if with_wd else g


def ref_sgd(w, g, st, lr, wd, rescale, clip, t, momentum=0.0, nesterov=False):
    g = prep(g, w, rescale, clip, wd)
    if momentum == 0:
        return w - lr * g, st
    if nesterov:
        mom = momentum * st['mom'] + g
        return w - lr * (g + momentum * mom), {'mom': mom}
    mom = momentum * st['mom'] - lr * g
    return w + mom, {'mom': mom}


def ref_nag(w, g, st, lr, wd, rescale, clip, t, momentum=0.0):
    return ref_sgd(w, g, st, lr, wd, rescale, clip, t, momentum, nesterov=True)


def _moments(g, st, beta1, beta2):
    return beta1 * st['mean'] + (1 - beta1) * g, beta2 * st['var'] + (1 - beta2) * g * g


def ref_adam(w, g, st, lr, wd, rescale, clip, t, beta1=0.9, beta2=0.999, epsilon=1e-8):
    g = prep(g, w, rescale, clip, wd)
    m, v = _moments(g, st, beta1, beta2)
    lr_t = lr * math.sqrt(1 - beta2 ** t) / (1 - beta1 ** t)
    return w - lr_t * m / (np.sqrt(v) + epsilon), {'mean': m, 'var': v}


def ref_adamw(w, g, st, lr, wd, rescale, clip, t, beta1=0.9, beta2=0.999, epsilon=1e-8):
    g = prep(g, w, rescale, clip, wd, with_wd=False)
    m, v = _moments(g, st, beta1, beta2)
    denom = np.sqrt(v) / math.sqrt(1 - beta2 ** t) + epsilon
    return w * (1 - lr * wd) - lr / (1 - beta1 ** t) * m / denom, {'mean': m, 'var': v}


def ref_adagrad(w, g, st, lr, wd, rescale, clip, t, epsilon=1e-6):
    g = prep(g, w, rescale, clip, wd)
    h = st['history'] + g * g
    return w - lr * g / (np.sqrt(h) + epsilon), {'history': h}


def ref_rmsprop(w, g, st, lr, wd, rescale, clip, t, rho=0.9, momentum=0.9, epsilon=1e-8,
                centered=False, clip_weights=None):
    g = prep(g, w, rescale, clip, wd)
    var = rho * st['var'] + (1 - rho) * g * g
    if centered:
        mean = rho * st['mean'] + (1 - rho) * g
        mom = momentum * st['mom'] - lr * g / np.sqrt(np.maximum(var - mean * mean, 0) + epsilon)
        w, st = w + mom, {'var': var, 'mean': mean, 'mom': mom}
    else:
        w, st = w - lr * g / (np.sqrt(var) + epsilon), {'var': var}
    return (np.clip(w, -clip_weights, clip_weights) if clip_weights else w), st


def ref_lamb(w, g, st, lr, wd, rescale, clip, t, beta1=0.9, beta2=0.999, epsilon=1e-6,
             lower_bound=None, upper_bound=None, bias_correction=True):
    g = prep(g, w, rescale, clip, wd, with_wd=False)
    m, v = _moments(g, st, beta1, beta2)
    mh, vh = (m / (1 - beta1 ** t), v / (1 - beta2 ** t)) if bias_correction else (m, v)
    d = mh / (np.sqrt(vh) + epsilon) + wd * w
    r1, r2 = np.linalg.norm(w), np.linalg.norm(d)
    if lower_bound:
        r1 = max(r1, lower_bound)
    if upper_bound:
        r1 = min(r1, upper_bound)
    ratio = r1 / r2 if r1 > 0 and r2 > 0 else 1.0
    return w - lr * ratio * d, {'mean': m, 'var': v}


def ref_ftrl(w, g, st, lr, wd, rescale, clip, t, lamda1=0.01, beta=1.0):
    # MXNet 1.x's documented form, written differently from the kernel on purpose
    g = prep(g, w, rescale, clip, wd, with_wd=False)
    z = st['z'] + g - (np.sqrt(st['n'] + g * g) - np.sqrt(st['n'])) * w / lr
    n = st['n'] + g * g
    w = (np.sign(z) * lamda1 - z) / ((beta + np.sqrt(n)) / lr + wd) * (np.abs(z) > lamda1)
    return w, {'z': z, 'n': n}


def ref_signum(w, g, st, lr, wd, rescale, clip, t, momentum=0.9, wd_lh=0.0):
    if momentum == 0:
        g = prep(g, w, rescale, clip, wd, with_wd=False)
        return (1 - lr * (wd + wd_lh)) * w - lr * np.sign(g), st
    g = prep(g, w, rescale, clip, wd)
    mom = momentum * st['mom'] - (1 - momentum) * g
    return (1 - lr * wd_lh) * w + lr * np.sign(mom), {'mom': mom}


def ref_test(w, g, st, lr, wd, rescale, clip, t):
    return w + rescale * g, st


# name, kernel states in call order (None = not allocated), hyper-parameters
CASES = [
    ('sgd', ['mom'], dict(momentum=0.0)),
    ('sgd', ['mom'], dict(momentum=0.9)),
    ('sgd', ['mom'], dict(momentum=0.9, nesterov=True)),
    ('nag', ['mom'], dict(momentum=0.8)),
    ('adam', ['mean', 'var'], dict(beta1=0.9, beta2=0.99, epsilon=1e-8)),
    ('adamw', ['mean', 'var'], dict(beta1=0.85, beta2=0.995, epsilon=1e-7)),
    ('adagrad', ['history'], dict(epsilon=1e-6)),
    ('rmsprop', ['var', 'mean', 'mom'], dict(rho=0.9, epsilon=1e-8)),
    ('rmsprop', ['var', 'mean', 'mom'], dict(rho=0.95, momentum=0.8, epsilon=1e-6,
                                             centered=True, clip_weights=0.9)),
    ('lamb', ['mean', 'var'], dict(beta1=0.9, beta2=0.999, epsilon=1e-6)),
    ('lamb', ['mean', 'var'], dict(bias_correction=False, lower_bound=0.5, upper_bound=3.0)),
    ('ftrl', ['z', 'n'], dict(lamda1=0.01, beta=1.0)),
    ('signum', ['mom'], dict(momentum=0.9, wd_lh=0.01)),
    ('signum', ['mom'], dict(momentum=0.0, wd_lh=0.02)),
    ('test', [], {}),
] + more.CASES   # the rules of numpy_more, against reference_rules
NEEDS_T = {'adam', 'adamw', 'lamb'} | more.NEEDS_T
REFS = {name: globals()['ref_' + name] for name in ('sgd', 'nag', 'adam', 'adamw', 'adagrad',
                                                    'rmsprop', 'lamb', 'ftrl', 'signum', 'test')}
REFS.update(more.REFS)


def allocated(name, states, hyper):
    """Which states the optimizer allocates for this configuration."""
    if name in more.REFS:
        return more.allocated(name, states, hyper)
    if name in ('sgd', 'nag', 'signum') and hyper.get('momentum', 0.0) == 0.0:
        return []
    if name == 'rmsprop' and not hyper.get('centered'):
        return ['var']
    return states


def run_kernel(name, states, hyper, w, g_steps, base=BASE, dtype=np.float32):
    """STEPS updates through the kernel, in `dtype`; returns the final weight and states."""
    w = w.astype(dtype)
    live = allocated(name, states, hyper)
    st = {s: np.zeros_like(w) for s in live}
    fn = getattr(K, name + '_update')
    for t, g in enumerate(g_steps, start=1):
        extra = {'t': t} if name in NEEDS_T else {}
        fn(w, g.astype(dtype), *[st.get(s) for s in states], base['lr'], base['wd'],
           base['rescale'], base['clip'], **hyper, **extra)
    return w, st


def run_ref(name, states, hyper, w, g_steps, base=BASE):
    w = w.astype(np.float64)
    st = {s: np.zeros_like(w) for s in allocated(name, states, hyper)}
    for t, g in enumerate(g_steps, start=1):
        w, st = REFS[name](w, g.astype(np.float64), st, base['lr'], base['wd'],
                           base['rescale'], base['clip'], t, **hyper)
    return w, st


def data(n=1000, seed=0):
    rng = np.random.default_rng(seed)
    return rng.standard_normal(n), [rng.standard_normal(n) * 1.5 for _ in range(STEPS)]


@pytest.mark.parametrize('block', [K.BLOCK, 300])
@pytest.mark.parametrize('dtype,rtol', [(np.float64, 1e-6), (np.float32, 1e-5)])
@pytest.mark.parametrize('name,states,hyper', CASES,
                         ids=[f'{c[0]}-{i}' for i, c in enumerate(CASES)])
def test_kernel_matches_reference(name, states, hyper, dtype, rtol, block, monkeypatch):
    monkeypatch.setattr(K, 'BLOCK', block)  # 300: several blocks and a ragged last one
    w0, g_steps = data()
    w, st = run_kernel(name, states, hyper, w0, g_steps, dtype=dtype)
    w_ref, st_ref = run_ref(name, states, hyper, w0, g_steps)
    assert w.dtype == dtype
    np.testing.assert_allclose(w, w_ref, rtol=rtol, atol=rtol)
    for s in st_ref:
        np.testing.assert_allclose(st[s], st_ref[s], rtol=rtol, atol=rtol)


@pytest.mark.parametrize('block', [K.BLOCK, 300])
@pytest.mark.parametrize('dtype', [np.float32, np.float64])
@pytest.mark.parametrize('name,states,hyper', CASES,
                         ids=[f'{c[0]}-{i}' for i, c in enumerate(CASES)])
def test_a_grad_given_as_parts_is_their_sum_bit_for_bit(name, states, hyper, dtype, block,
                                                        monkeypatch):
    # A sync round's last pushes, handed unsummed: added block by block in the update's pass.
    monkeypatch.setattr(K, 'BLOCK', block)
    w0, g_steps = data()
    rng = np.random.default_rng(1)
    halves = [(g.astype(dtype), (rng.standard_normal(g.size) * 0.5).astype(dtype))
              for g in g_steps]
    summed, _ = run_kernel(name, states, hyper, w0, [a + b for a, b in halves], dtype=dtype)
    for a, b in halves:
        a.flags.writeable = b.flags.writeable = False   # receive buffers: never written
    live = allocated(name, states, hyper)
    w, st = w0.astype(dtype), {s: np.zeros(w0.size, dtype) for s in live}
    fn = getattr(K, name + '_update')
    for t, parts in enumerate(halves, start=1):
        extra = {'t': t} if name in NEEDS_T else {}
        fn(w, parts, *[st.get(s) for s in states], BASE['lr'], BASE['wd'], BASE['rescale'],
           BASE['clip'], **hyper, **extra)
    assert np.array_equal(w, summed)


def test_grad_parts_must_be_two_or_more_of_the_compute_dtype():
    w = np.ones(4, np.float32)
    with pytest.raises(DTypeError, match='float32'):
        K.sgd_update(w, (np.ones(4, np.float16), np.ones(4, np.float16)), None, 0.1, 0, 1, -1)
    with pytest.raises(ShapeError, match='two or more'):
        K.sgd_update(w, (np.ones(4, np.float32),), None, 0.1, 0, 1, -1)
    with pytest.raises(DTypeError, match='shape'):
        K.sgd_update(w, (np.ones(4, np.float32), np.ones(3, np.float32)), None, 0.1, 0, 1, -1)


def test_kernel_names_exist_in_both_modules():
    import inspect

    from kvps.optimizer.kernels import cuda_kernels   # imports no cupy until a launch
    for name in KERNEL_NAMES:
        assert inspect.signature(getattr(cuda_kernels, name)) == \
            inspect.signature(getattr(K, name)), name
    assert set(KERNEL_NAMES) <= set(K.__all__)


# ---------------------------------------------------------------- torch.optim where identical
torch = pytest.importorskip('torch')

TORCH_CASES = [
    # (kernel name, kernel hyper, torch optimizer, torch kwargs)
    ('sgd', dict(momentum=0.9), 'SGD', dict(momentum=0.9)),
    ('sgd', dict(momentum=0.9, nesterov=True), 'SGD', dict(momentum=0.9, nesterov=True)),
    ('nag', dict(momentum=0.7), 'SGD', dict(momentum=0.7, nesterov=True)),
    ('adam', dict(beta1=0.9, beta2=0.99, epsilon=0.0), 'Adam', dict(betas=(0.9, 0.99), eps=0.0)),
    ('adamw', dict(beta1=0.9, beta2=0.99, epsilon=1e-8), 'AdamW',
     dict(betas=(0.9, 0.99), eps=1e-8)),
    ('adagrad', dict(epsilon=1e-6), 'Adagrad', dict(eps=1e-6)),
    ('rmsprop', dict(rho=0.9, epsilon=1e-8), 'RMSprop', dict(alpha=0.9, eps=1e-8)),
    ('rmsprop', dict(rho=0.9, momentum=0.5, epsilon=0.0, centered=True), 'RMSprop',
     dict(alpha=0.9, eps=0.0, momentum=0.5, centered=True)),
]
KERNEL_STATES = {'sgd': ['mom'], 'nag': ['mom'], 'adam': ['mean', 'var'],
                 'adamw': ['mean', 'var'], 'adagrad': ['history'],
                 'rmsprop': ['var', 'mean', 'mom']}


@pytest.mark.parametrize('name,hyper,topt,tkw', TORCH_CASES,
                         ids=[f'{c[0]}-{c[2]}-{i}' for i, c in enumerate(TORCH_CASES)])
def test_kernel_matches_torch(name, hyper, topt, tkw):
    """Constant lr, rescale 1 and no clipping: where MXNet's rule and torch's coincide
    (Adam and centered RMSProp place epsilon differently, so eps=0 there)."""
    w0, g_steps = data(seed=3)
    base = dict(lr=0.01, wd=0.02, rescale=1.0, clip=None)
    w, _ = run_kernel(name, KERNEL_STATES[name], hyper, w0, g_steps, base, np.float64)
    p = torch.nn.Parameter(torch.tensor(w0, dtype=torch.float64))
    opt = getattr(torch.optim, topt)([p], lr=base['lr'], weight_decay=base['wd'], **tkw)
    for g in g_steps:
        p.grad = torch.tensor(g, dtype=torch.float64)
        opt.step()
    np.testing.assert_allclose(w, p.detach().numpy(), rtol=1e-6, atol=1e-9)


def test_centered_rmsprop_stays_finite_under_a_steady_gradient():
    # The same gradient every step leaves var == mean^2 in exact arithmetic; float32 rounding
    # put their difference below zero for ~10% of these elements, and the square root made
    # NaN weights (torch.optim.RMSprop(centered=True) does: it has no guard).
    n = 4096
    grad = np.random.default_rng(0).standard_normal(n).astype(np.float32) * 10
    w, var, mean, mom = (np.zeros(n, np.float32) for _ in range(4))
    for _ in range(300):
        K.rmsprop_update(w, grad.copy(), var, mean, mom, lr=0.01, wd=0.0, rescale_grad=1.0,
                         clip_gradient=None, centered=True)
    assert np.isfinite(w).all() and np.isfinite(mom).all()
    # steps settle at lr / sqrt(eps) * sign(g) per step, momentum-summed: |w| grows steadily
    assert (np.sign(w) == -np.sign(grad)).all()


# ---------------------------------------------------------------- bfloat16 and mixed dtypes
def test_bf16_conversion_matches_torch_round_to_nearest_even():
    rng = np.random.default_rng(1)
    x = np.concatenate([rng.standard_normal(10000).astype(np.float32) * 100,
                        np.array([0.0, -0.0, np.inf, -np.inf, 1e-40, -1e-40, 3.4e38,
                                  1.00390625, 1.01171875], np.float32)])  # ties both ways
    ours = K.f32_to_bf16(x)
    theirs = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    np.testing.assert_array_equal(ours, theirs)
    np.testing.assert_array_equal(K.bf16_to_f32(ours),
                                  torch.from_numpy(theirs.view(np.int16)).view(torch.bfloat16)
                                  .float().numpy())
    nan = K.f32_to_bf16(np.array([np.nan], np.float32))
    assert np.isnan(K.bf16_to_f32(nan))[0]


def test_bf16_sums_widen_to_float32_block_by_block_and_round_once():
    rng = np.random.default_rng(2)
    n = 2 * K.BLOCK + 77                                  # several blocks and a ragged end
    a, b = (K.f32_to_bf16(rng.standard_normal(n).astype(np.float32)) for _ in range(2))
    out = np.full(n, np.nan, np.float32)
    assert K.add_widened(a, b, out) is out
    np.testing.assert_array_equal(out, K.bf16_to_f32(a) + K.bf16_to_f32(b))
    K.add_widened(out, a, out)                            # accumulating in place
    np.testing.assert_array_equal(out, (K.bf16_to_f32(a) + K.bf16_to_f32(b)) + K.bf16_to_f32(a))
    rounded = K.narrow(out, np.empty(n, np.uint16))
    np.testing.assert_array_equal(rounded, K.f32_to_bf16(out))
    # torch's float32-accumulating sum of the same bfloat16 values rounds to the same bits
    as_torch = [torch.from_numpy(x.view(np.int16)).view(torch.bfloat16) for x in (a, b, a)]
    theirs = torch.stack(as_torch).sum(0).view(torch.int16).numpy().view(np.uint16)
    np.testing.assert_array_equal(rounded, theirs)
    np.testing.assert_array_equal(K.narrow(out, np.empty(n, np.float16)), out.astype(np.float16))


@pytest.mark.parametrize('wdtype', [np.float16, np.uint16])
def test_low_precision_weight_with_master_gets_rounded_master(wdtype):
    w0, g_steps = data(n=777)
    master = w0.astype(np.float32)
    weight = master.astype(np.float16) if wdtype == np.float16 else K.f32_to_bf16(master)
    master = weight.astype(np.float32) if wdtype == np.float16 else K.bf16_to_f32(weight)
    mom, mom_ref = np.zeros_like(master), np.zeros_like(master)
    ref = master.copy()
    for g in g_steps:
        K.sgd_update(weight, g.astype(np.float16), mom, 0.1, 0.01, 1.0, None, 0.9,
                     weight32=master)
        K.sgd_update(ref, g.astype(np.float16).astype(np.float32), mom_ref, 0.1, 0.01, 1.0,
                     None, 0.9)
        cast = master.astype(np.float16) if wdtype == np.float16 else K.f32_to_bf16(master)
        np.testing.assert_array_equal(weight, cast)
    np.testing.assert_array_equal(master, ref)  # the master sees exactly the fp32 update


def test_read_only_grad_is_not_written_and_mixed_dtypes_work():
    w = np.ones(5000)
    g = np.full(5000, 2.0, np.float32)
    g.flags.writeable = False
    K.adagrad_update(w, g, np.zeros_like(w), 0.1, 0.0, 1.0, None)
    assert (g == 2.0).all() and w.dtype == np.float64
    np.testing.assert_allclose(w, 1 - 0.1 * 2 / (2 + 1e-6))


def test_remembered_scalars_tell_a_zero_from_a_negative_zero():
    """The scalars of a call are remembered per set of values; 0.0 == -0.0 as dict keys, but
    the two round differently (-0 * g flips the sign of a zero), so each gets its own."""
    def step(lr):
        w = np.array([-0.0, 0.0, 1.0], np.float32)
        K.sgd_update(w, np.array([1.0, -1.0, 2.0], np.float32), None, lr, 0.0, 1.0, None)
        return w
    plus, minus = step(0.0), step(-0.0)
    np.testing.assert_array_equal(np.signbit(plus), np.signbit(np.float32([-0.0, 0.0, 1.0])
                                                                - np.float32(0.0)))
    np.testing.assert_array_equal(np.signbit(minus), np.signbit(np.float32([-0.0, 0.0, 1.0])
                                                                 - np.float32([-0.0, 0.0, -0.0])))
    assert np.signbit(plus).tolist() != np.signbit(minus).tolist()
    np.testing.assert_array_equal(np.signbit(step(0.0)), np.signbit(plus))


def test_scalars_remembered_are_bounded():
    w = np.ones(4, np.float32)
    for i in range(B.SCALARS_KEPT + 10):
        K.sgd_update(w, np.ones(4, np.float32), None, 1e-3 + i * 1e-6, 0.0, 1.0, None)
    assert len(B._SCALARS) <= B.SCALARS_KEPT


def test_threads_updating_at_once_use_their_own_block_buffers():
    """Block buffers are reused from call to call, one set per thread: kernels running in
    several threads at once (a local store's caller, a worker's updates) do not mix them."""
    import threading
    n = 3 * K.BLOCK + 7
    grads = [np.arange(n, dtype=np.float32) * (t + 1) for t in range(4)]
    results, failures = [None] * 4, []

    def run(t):
        try:
            w = np.zeros(n, np.float32)
            for _ in range(20):
                parts = (grads[t].copy(), grads[t].copy())
                for p in parts:
                    p.flags.writeable = False
                K.sgd_update(w, parts, None, 1.0, 0.0, 1.0, None)
            results[t] = w
        except Exception as exc:   # reported below: a thread's assert would go unseen
            failures.append(exc)
    threads = [threading.Thread(target=run, args=(t,)) for t in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not failures
    for t in range(4):
        expected = np.zeros(n, np.float32)
        for _ in range(20):
            expected -= grads[t] + grads[t]
        np.testing.assert_array_equal(results[t], expected)


def test_kernel_argument_errors():
    w = np.zeros(10, np.float32)
    with pytest.raises(ShapeError):
        K.sgd_update(w, np.zeros(11, np.float32), None, 0.1, 0, 1, None)
    with pytest.raises(DTypeError):
        K.sgd_update(np.zeros(10, np.int32), np.zeros(10, np.float32), None, 0.1, 0, 1, None)
    with pytest.raises(ShapeError):
        K.sgd_update(np.zeros((10, 10), np.float32)[:, ::2], np.zeros((10, 5), np.float32),
                     None, 0.1, 0, 1, None)
    with pytest.raises(DTypeError):
        kernels_for([1.0, 2.0])


def test_multi_apply_runs_every_call_in_order():
    ws = [np.zeros(n, np.float32) for n in (1, 10, 100)]
    calls = [('test_update', (w, np.ones_like(w)), dict(lr=0.1, wd=0.0, rescale_grad=2.0,
                                                       clip_gradient=None))
             for _ in range(2) for w in ws]  # a fresh grad per call: kernels clobber grads
    multi_apply(calls)
    assert all((w == 4.0).all() for w in ws)


def _packable_calls(name, states, hyper, sizes, wdtype, master, seed, lrs=(0.1,), parts=False):
    """One call per size of ``name``'s kernel with fresh random arrays: weights (with an fp32
    master copy when ``master``), states, a grad (two read-only parts when ``parts``), and
    lrs taken in turn (each lr its own pack)."""
    rng = np.random.default_rng(seed)
    live = allocated(name, states, hyper)
    calls = []
    cdt = np.float64 if wdtype == np.float64 else np.float32

    def values(n, dtype):   # bfloat16 as its bits (uint16), rounded from float32
        f32 = rng.standard_normal(n).astype(np.float32)
        return K.f32_to_bf16(f32) if dtype == np.uint16 else f32.astype(dtype)
    for i, n in enumerate(sizes):
        w32 = rng.standard_normal(n).astype(np.float32)
        w = values(n, wdtype)
        grads = [values(n, cdt if parts else wdtype) for _ in range(2)]
        for g in grads:
            g.flags.writeable = not parts
        grad = tuple(grads) if parts else grads[0]
        sdt = np.float32 if master else wdtype   # plausible states: var >= mean ** 2
        st = [None if s not in live else values(n, sdt) / 8 if s == 'mean' else
              np.abs(values(n, sdt)) + np.ones(1, sdt) for s in states]
        kwargs = dict(lr=lrs[i % len(lrs)], wd=0.01, rescale_grad=0.5, clip_gradient=2.0,
                      weight32=w32 if master else None, **hyper)
        if name in NEEDS_T:
            kwargs['t'] = 3
        calls.append((name + '_update', (w, grad, *st), kwargs))
    return calls


def _check_same_as_key_by_key(together, alone):
    """multi_update of ``together`` leaves exactly what one call per key of ``alone`` (the
    same calls on copies) does."""
    K.multi_update(together)
    for call in alone:
        K.multi_update([call])
    for got, want in zip(_outputs(together), _outputs(alone)):
        for g, w in zip(got, want):
            np.testing.assert_array_equal(g, w)


def _outputs(calls):
    return [[a.copy() for a in (args[0], *args[2:], kw['weight32']) if a is not None]
            for _, args, kw in calls]


@pytest.mark.parametrize('wdtype,master,parts', [(np.float32, False, False),
                                                 (np.float32, False, True),
                                                 (np.float64, False, True),
                                                 (np.float16, True, False),
                                                 (np.uint16, True, False)],
                         ids=['f32', 'f32-parts', 'f64-parts', 'f16-master', 'bf16-master'])
@pytest.mark.parametrize('name,states,hyper', CASES,
                         ids=[f'{c[0]}-{i}' for i, c in enumerate(CASES)])
def test_small_keys_updated_together_match_key_by_key_bit_for_bit(name, states, hyper, wdtype,
                                                                   master, parts):
    """multi_update packs small keys of one rule and equal scalars into one pass (LAMB, big
    keys and keys with other scalars run alone): every weight, state and master copy is
    exactly what one call per key gives, and it holds again when scratch is reused."""
    sizes = [1, 7, PACK_UP_TO, 300, PACK_UP_TO + 1, 64, 3]
    for seed in (1, 2):
        together = _packable_calls(name, states, hyper, sizes, wdtype, master, seed,
                                   lrs=(0.1, 0.05), parts=parts)
        alone = _packable_calls(name, states, hyper, sizes, wdtype, master, seed,
                                lrs=(0.1, 0.05), parts=parts)
        _check_same_as_key_by_key(together, alone)


def test_keys_whose_scalars_differ_only_in_the_sign_of_a_zero_are_not_packed_together():
    """0.0 == -0.0, but -0.0 * g flips the sign of a zero: keys with lr 0.0 and -0.0 must
    not share a packed pass (nor one kwargs dict: the updater's keys share them)."""
    def calls():
        w = [np.array([-0.0, 0.0, 2.0], np.float32) for _ in range(4)]
        g = [np.array([1.0, -1.0, 3.0], np.float32) for _ in range(4)]
        return [('sgd_update', (w[i], g[i], None),
                 dict(lr=(0.0, -0.0)[i % 2], wd=0.0, rescale_grad=1.0, clip_gradient=None,
                      weight32=None)) for i in range(4)]
    together, alone = calls(), calls()
    K.multi_update(together)
    for call in alone:
        K.multi_update([call])
    for (_, got, _), (_, want, _) in zip(together, alone):
        assert got[0].view(np.uint32).tolist() == want[0].view(np.uint32).tolist()
    assert together[0][1][0].view(np.uint32).tolist() != \
        together[1][1][0].view(np.uint32).tolist()


def PACKED(case):
    """Whether small keys of the case's rule are packed (not LAMB's, LARS's... norms)."""
    return case[0] + '_update' in numpy_packing.ELEMENTWISE


def _end_to_end(calls, weight_breaks=(), state_breaks=()):
    """``calls`` with each key's weight, states and master copy moved into buffers per
    kind, key after key (as a server lays out small keys: Slabs and its weight chunks), a
    new buffer at each index in ``*_breaks``."""
    def laid(column, breaks):
        if column[0] is None:
            return column
        views = []
        for a, b in zip((0, *breaks), (*breaks, len(column))):
            whole, at = np.concatenate([x.reshape(-1) for x in column[a:b]]), 0
            for x in column[a:b]:
                views.append(whole[at:at + x.size].reshape(x.shape))
                at += x.size
        return views
    args = [list(column) if i == 1 else laid(list(column), state_breaks if i else weight_breaks)
            for i, column in enumerate(zip(*[a for _, a, _ in calls]))]
    masters = laid([kw['weight32'] for _, _, kw in calls], state_breaks)
    return [(name, tuple(a[k] for a in args), dict(kw, weight32=masters[k]))
            for k, (name, _, kw) in enumerate(calls)]


@pytest.mark.parametrize('name,states,hyper', [c for c in CASES if PACKED(c)],
                         ids=[f'{c[0]}-{i}' for i, c in enumerate(CASES) if PACKED(c)])
@pytest.mark.parametrize('wdtype,master,parts', [(np.float32, False, True),
                                                 (np.float16, True, False),
                                                 (np.uint16, True, False)],
                         ids=['f32-parts', 'f16-master', 'bf16-master'])
@pytest.mark.parametrize('breaks', [((), ()), ((8,), (4, 12))], ids=['whole', 'stretches'])
def test_small_keys_lying_end_to_end_are_updated_in_place_bit_for_bit(
        name, states, hyper, wdtype, master, parts, breaks, monkeypatch):
    """Weights, states and master copies that lie end to end, whole or in stretches of many
    keys, are updated in place (only the grads are copied together), with exactly the bits
    of one call per key."""
    sizes = [1, 7, PACK_UP_TO, 300, 64, 3] * 3
    together = _end_to_end(_packable_calls(name, states, hyper, sizes, wdtype, master, 3,
                                           parts=parts), *breaks)
    alone = _packable_calls(name, states, hyper, sizes, wdtype, master, 3, parts=parts)
    copied = []
    real_cat, real_grads = numpy_packing._cat, numpy_packing._grads
    monkeypatch.setattr(numpy_packing, '_cat',
                        lambda column, slot: copied.append(slot) or real_cat(column, slot))
    monkeypatch.setattr(numpy_packing, '_grads',   # (float32 parts are summed there)
                        lambda column, weight: copied.append(1) or real_grads(column, weight))
    for _ in range(2):   # the second time from the layouts it remembers
        _check_same_as_key_by_key(together, alone)
    assert {slot if type(slot) is int else slot[0] for slot in copied} == {1}   # grads only


def _parts_calls(n_parts, dtype, sizes=(5, 300, 64, 1)):
    """SGD with momentum on small float32 keys, each grad in ``n_parts`` read-only parts."""
    rng = np.random.default_rng(7)
    calls = []
    for n in sizes:
        parts = tuple(rng.standard_normal(n).astype(dtype) for _ in range(n_parts))
        for p in parts:
            p.flags.writeable = False
        calls.append(('sgd_update', (rng.standard_normal(n).astype(np.float32), parts,
                                     np.zeros(n, np.float32)),
                      dict(lr=0.1, wd=0.01, rescale_grad=0.5, clip_gradient=None,
                           momentum=0.9, weight32=None)))
    return calls


def test_packed_grads_in_three_parts_are_summed_in_order_bit_for_bit():
    # A packed pass adds each key's parts before it runs, in the order the kernel adds them
    # block by block for a key alone: the same bits.
    _check_same_as_key_by_key(_parts_calls(3, np.float32), _parts_calls(3, np.float32))


def test_packed_grads_in_parts_of_another_dtype_get_the_kernels_error():
    with pytest.raises(DTypeError, match='float32'):
        K.multi_update(_parts_calls(2, np.float16))
    with pytest.raises(ShapeError, match='two or more'):
        K.multi_update(_parts_calls(1, np.float32))


def test_keys_scattered_in_memory_are_copied_in_and_out_bit_for_bit():
    sizes = [5, 6, 7] * 6
    scattered = _end_to_end(_packable_calls('adam', ['mean', 'var'], {}, sizes, np.float32,
                                            False, 4), tuple(range(1, 18, 2)))
    alone = _packable_calls('adam', ['mean', 'var'], {}, sizes, np.float32, False, 4)
    _check_same_as_key_by_key(scattered, alone)


def test_slabs_cut_arrays_end_to_end_per_name_and_dtype():
    slabs = Slabs()
    a, b = slabs.zeros('mean', (3,), np.float32), slabs.zeros('mean', (2, 2), np.float32)
    other = slabs.zeros('var', (3,), np.float32)
    wide = slabs.zeros('mean', (3,), np.float64)
    assert _address(b) == _address(a) + a.nbytes
    assert _address(other) != _address(b) + b.nbytes and wide.dtype == np.float64
    assert b.shape == (2, 2) and not (a.any() or b.any() or other.any() or wide.any())
    big = slabs.zeros('mean', (Slabs.CHUNK + 1,), np.float32)   # a chunk of its own
    after = slabs.zeros('mean', (1,), np.float32)
    assert big.size == Slabs.CHUNK + 1 and _address(after) != _address(big) + big.nbytes
    copy = slabs.copy('mean', np.arange(4, dtype=np.float32))
    assert _address(copy) == _address(after) + after.nbytes and copy.tolist() == [0, 1, 2, 3]


def _address(array):
    return array.__array_interface__['data'][0]


def test_a_key_given_twice_is_updated_twice_in_order():
    w = np.zeros(5, np.float32)
    calls = [('sgd_update', (w, np.full(5, v, np.float32), None),
              dict(lr=1.0, wd=0.0, rescale_grad=1.0, clip_gradient=None, weight32=None))
             for v in (1.0, 2.0)]
    K.multi_update(calls + [('sgd_update', (np.zeros(3, np.float32), np.ones(3, np.float32),
                                            None), calls[0][2])])
    np.testing.assert_array_equal(w, np.full(5, -3.0, np.float32))


def test_a_bad_key_among_small_ones_fails_with_its_own_error():
    good = ('sgd_update', (np.zeros(4, np.float32), np.ones(4, np.float32), None),
            dict(lr=1.0, wd=0.0, rescale_grad=1.0, clip_gradient=None, weight32=None))
    bad = ('sgd_update', (np.zeros(4, np.float32), np.ones(5, np.float32), None), good[2])
    with pytest.raises(ShapeError):
        K.multi_update([good, bad])
