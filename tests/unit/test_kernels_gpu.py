"""Every CUDA kernel against the numpy reference: bit for bit, except LAMB's reductions (1e-6)."""

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

cp = pytest.importorskip('cupy')
try:
    _DEVICES = cp.cuda.runtime.getDeviceCount()
except Exception:  # no driver, or a broken CUDA install: same as no GPU
    _DEVICES = 0
if _DEVICES == 0:
    pytest.skip('no CUDA device', allow_module_level=True)

from kvps._kernels import cuda_kernels as C  # noqa: E402
from kvps._kernels import kernels_for, multi_apply, numpy_kernels as K  # noqa: E402
from kvps.optimizer import create  # noqa: E402
from kvps.server.updater import Updater  # noqa: E402

BASE = dict(lr=0.05, wd=0.01, rescale_grad=0.5, clip_gradient=0.8)
CASES = [
    ('sgd', ['mom'], dict(momentum=0.0), False),
    ('sgd', ['mom'], dict(momentum=0.9), True),
    ('sgd', ['mom'], dict(momentum=0.9, nesterov=True), True),
    ('nag', ['mom'], dict(momentum=0.8), True),
    ('adam', ['mean', 'var'], dict(beta1=0.9, beta2=0.99, epsilon=1e-8), True),
    ('adamw', ['mean', 'var'], dict(beta1=0.85, beta2=0.995, epsilon=1e-7), True),
    ('adagrad', ['history'], dict(epsilon=1e-6), True),
    ('rmsprop', ['var', 'mean', 'mom'], dict(rho=0.9, epsilon=1e-8), True),
    ('rmsprop', ['var', 'mean', 'mom'], dict(rho=0.95, momentum=0.8, epsilon=1e-6,
                                             centered=True, clip_weights=0.9), True),
    ('lamb', ['mean', 'var'], dict(beta1=0.9, beta2=0.999, epsilon=1e-6), True),
    ('lamb', ['mean', 'var'], dict(bias_correction=False, lower_bound=0.5, upper_bound=3.0),
     True),
    ('ftrl', ['z', 'n'], dict(lamda1=0.01, beta=1.0), True),
    ('signum', ['mom'], dict(momentum=0.9, wd_lh=0.01), True),
    ('signum', ['mom'], dict(momentum=0.0, wd_lh=0.02), False),
    ('test', [], {}, False),
]
NEEDS_T = {'adam', 'adamw', 'lamb'}
# (weight storage, grad storage, fp32 master): 'bfloat16' is uint16 storage
DTYPES = [('float32', 'float32', False), ('float64', 'float64', False),
          ('float64', 'float32', False), ('float16', 'float16', False),
          ('float16', 'float16', True), ('bfloat16', 'float32', True),
          ('bfloat16', 'bfloat16', False)]


def _store(x, dtype):
    return K.f32_to_bf16(x.astype(np.float32)) if dtype == 'bfloat16' else x.astype(dtype)


def _states(name, states, hyper, like, dtype):
    live = states if hyper.get('momentum', 1.0) != 0.0 or name not in ('sgd', 'signum') else []
    live = ['var'] if name == 'rmsprop' and not hyper.get('centered') else live
    return {s: np.zeros(like.shape, np.uint16 if dtype == 'bfloat16' else dtype)
            for s in live}


def _run(mod, name, states, hyper, w, st, master, g_steps):
    to = cp.asarray if mod is C else np.copy
    w, st = to(w), {k: to(v) for k, v in st.items()}
    master = None if master is None else to(master)
    for t, g in enumerate(g_steps, start=1):
        extra = {'t': t} if name in NEEDS_T else {}
        getattr(mod, name + '_update')(w, to(g), *[st.get(s) for s in states], **BASE,
                                       **hyper, **extra, weight32=master)
    back = (lambda a: cp.asnumpy(a)) if mod is C else (lambda a: a)
    return back(w), {k: back(v) for k, v in st.items()}, None if master is None else back(master)


@pytest.mark.parametrize('wdt,gdt,mp', DTYPES, ids=['-'.join(map(str, d)) for d in DTYPES])
@pytest.mark.parametrize('name,states,hyper,_', CASES,
                         ids=[f'{c[0]}-{i}' for i, c in enumerate(CASES)])
def test_cuda_kernel_matches_numpy(name, states, hyper, _, wdt, gdt, mp):
    rng = np.random.default_rng(11)
    x = rng.standard_normal(70001)  # several numpy blocks, odd size for the GPU grid
    w = _store(x, wdt)
    master = (K.bf16_to_f32(w) if wdt == 'bfloat16' else w.astype(np.float32)) if mp else None
    sdt = 'float32' if mp or (name == 'lamb' and wdt in ('float16', 'bfloat16')) else wdt
    st = _states(name, states, hyper, w, sdt)
    g_steps = [_store(rng.standard_normal(x.size) * 1.5, gdt) for _ in range(5)]
    got = _run(C, name, states, hyper, w, st, master, g_steps)
    want = _run(K, name, states, hyper, w, st, master, g_steps)
    for a, b in zip([got[0], *got[1].values(), got[2]], [want[0], *want[1].values(), want[2]]):
        if a is None:
            continue
        if name == 'lamb':  # norms are reductions in another order: 1e-6, or an ulp of storage
            tol = {'uint16': 8e-3, 'float16': 1e-3}.get(str(a.dtype), 1e-6)
            a = K.bf16_to_f32(a) if a.dtype == np.uint16 else a
            b = K.bf16_to_f32(b) if b.dtype == np.uint16 else b
            np.testing.assert_allclose(a, b, rtol=tol, atol=tol)
        else:
            np.testing.assert_array_equal(a, b)


def test_kernels_for_and_multi_apply_on_device():
    ws = [cp.zeros(n, cp.float32) for n in (1, 100, 10000)]
    assert kernels_for(ws[0]) is C
    multi_apply([('test_update', (w, cp.ones_like(w)), dict(lr=0.1, wd=0.0, rescale_grad=2.0,
                                                           clip_gradient=None)) for w in ws])
    assert all(bool((w == 2).all()) for w in ws)


def test_widen_matches_numpy():
    x = K.f32_to_bf16(np.random.default_rng(0).standard_normal(1000).astype(np.float32))
    np.testing.assert_array_equal(cp.asnumpy(C.widen(cp.asarray(x))), K.widen(x))


def test_updater_on_device_with_checkpoint_round_trip():
    u = Updater(create('adam', multi_precision=True, learning_rate=0.01))
    w = cp.asarray(np.random.default_rng(1).standard_normal(5000).astype(np.float16))
    w_host = cp.asnumpy(w)
    h = Updater(create('adam', multi_precision=True, learning_rate=0.01))
    for _ in range(3):
        g = np.random.default_rng(2).standard_normal(5000).astype(np.float16)
        u.update('k', w, cp.asarray(g))
        h.update('k', w_host, g.copy())
    np.testing.assert_array_equal(cp.asnumpy(w), w_host)
    v = Updater(u.optimizer)
    v.set_states(u.get_states())  # host arrays move to the device on first use
    g = cp.ones(5000, cp.float16)
    w2 = w.copy()
    u.update('k', w, g.copy())
    v.update('k', w2, g.copy())
    np.testing.assert_array_equal(cp.asnumpy(w), cp.asnumpy(w2))
