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

from kvps.optimizer.kernels import cuda_kernels as C  # noqa: E402
from kvps.optimizer.kernels import kernels_for, multi_apply, numpy_kernels as K  # noqa: E402
from kvps.optimizer import create  # noqa: E402
from kvps.optimizer.updater import Updater  # noqa: E402

from test_cuda_source import BASE, CASES, DTYPES, NEEDS_T, live_states, state_dtype  # noqa: E402,E501


def _store(x, dtype):
    return K.f32_to_bf16(x.astype(np.float32)) if dtype == 'bfloat16' else x.astype(dtype)


def _states(name, states, hyper, like, dtype):
    return {s: np.zeros(like.shape, np.uint16 if dtype == 'bfloat16' else dtype)
            for s in live_states(name, states, hyper)}


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
    sdt = state_dtype(name, wdt, mp)
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


@pytest.mark.parametrize('name,states,hyper,_', CASES,
                         ids=[f'{c[0]}-{i}' for i, c in enumerate(CASES)])
def test_multi_tensor_apply_matches_key_by_key(name, states, hyper, _):
    """Many keys of mixed sizes and dtypes in multi-tensor launches give, bit for bit, what
    one launch per key gives (LAMB and keys over MULTI_MAX go key by key anyway)."""
    rng = np.random.default_rng(5)
    keys = []
    for n, (wdt, gdt, mp) in zip([1, 7, 300, 5000, C.MULTI_MAX, C.MULTI_MAX + 3, 2, 99],
                                 DTYPES + DTYPES[:1]):
        w = _store(rng.standard_normal(n), wdt)
        master = (K.bf16_to_f32(w) if wdt == 'bfloat16' else w.astype(np.float32)) if mp \
            else None
        keys.append((w, _states(name, states, hyper, w, state_dtype(name, wdt, mp)), master,
                     _store(rng.standard_normal(n), gdt)))

    def calls(copies):
        out = []
        for w, st, master, g in copies:
            extra = {'t': 2} if name in NEEDS_T else {}
            out.append((name + '_update', (w, g, *[st.get(s) for s in states]),
                        dict(BASE, **hyper, **extra, weight32=master)))
        return out

    def on_device():
        return [(cp.asarray(w), {k: cp.asarray(v) for k, v in st.items()},
                 None if m is None else cp.asarray(m), cp.asarray(g)) for w, st, m, g in keys]
    fused, alone = on_device(), on_device()
    for _ in range(3):
        C.multi_update(calls(fused))
        for fn, args, kwargs in calls(alone):
            getattr(C, fn)(*args, **kwargs)
    for (w1, st1, m1, _), (w2, st2, m2, _) in zip(fused, alone):
        np.testing.assert_array_equal(cp.asnumpy(w1), cp.asnumpy(w2))
        for k in st1:
            np.testing.assert_array_equal(cp.asnumpy(st1[k]), cp.asnumpy(st2[k]))
        if m1 is not None:
            np.testing.assert_array_equal(cp.asnumpy(m1), cp.asnumpy(m2))


def test_widen_matches_numpy():
    x = K.f32_to_bf16(np.random.default_rng(0).standard_normal(1000).astype(np.float32))
    np.testing.assert_array_equal(cp.asnumpy(C.widen(cp.asarray(x))), K.widen(x))


def test_bf16_sums_and_rounding_match_numpy():
    rng = np.random.default_rng(3)
    a, b = (K.f32_to_bf16(rng.standard_normal(5000).astype(np.float32) * 50) for _ in range(2))
    wide = cp.empty(5000, cp.float32)
    C.add_widened(cp.asarray(a), cp.asarray(b), wide)
    C.add_widened(wide, cp.asarray(a), wide)
    want = K.add_widened(K.add_widened(a, b, np.empty(5000, np.float32)), a,
                         np.empty(5000, np.float32))
    np.testing.assert_array_equal(cp.asnumpy(wide), want)
    wide[:3] = cp.asarray([np.nan, np.inf, 1.00390625], cp.float32)
    want[:3] = [np.nan, np.inf, 1.00390625]
    np.testing.assert_array_equal(cp.asnumpy(C.narrow(wide, cp.empty(5000, cp.uint16))),
                                  K.narrow(want, np.empty(5000, np.uint16)))


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
