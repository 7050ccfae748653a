"""Every CUDA kernel against the numpy reference: bit for bit, except LAMB's reductions (1e-6);
one launch per kernel for many keys, from kept launches, against one launch per key; with the
grad as one array or as two (a sync round's last pushes, added by the kernel as it loads them)."""

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

from test_cuda_source import (BASE, CASES, DTYPES, NEEDS_T, TWO_GRADS, live_states,  # noqa
                              reduces, state_dtype)

from kvps.optimizer import create  # noqa: E402
from kvps.optimizer.kernels import (cuda_kernels as C, kernels_for, multi_apply,  # noqa: E402
                                    numpy_kernels as K)
from kvps.optimizer.updater import Updater  # noqa: E402


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
        grad = tuple(map(to, g)) if type(g) is tuple else to(g)
        getattr(mod, name + '_update')(w, grad, *[st.get(s) for s in states], **BASE,
                                       **hyper, **extra, weight32=master)
    back = (lambda a: cp.asnumpy(a)) if mod is C else (lambda a: a)
    return back(w), {k: back(v) for k, v in st.items()}, None if master is None else back(master)


# (dtypes, arrays per grad): every combination with one grad; with two (a sync round's last
# pushes), float32 and float64 keys, those a server hands so (test_cuda_emulated: the others)
FORMS = [(d, 1) for d in DTYPES] + [(d, 2) for d in TWO_GRADS[:2]]


@pytest.mark.parametrize('dtypes,grads', FORMS,
                         ids=['-'.join(map(str, d)) + f'-x{g}' for d, g in FORMS])
@pytest.mark.parametrize('name,states,hyper,_', CASES,
                         ids=[f'{c[0]}-{i}' for i, c in enumerate(CASES)])
def test_cuda_kernel_matches_numpy(name, states, hyper, _, dtypes, grads):
    wdt, gdt, mp = dtypes
    rng = np.random.default_rng(11)
    x = rng.standard_normal(70001)  # several numpy blocks, odd size for the GPU grid
    w = _store(x, wdt)
    master = (K.bf16_to_f32(w) if wdt == 'bfloat16' else w.astype(np.float32)) if mp else None
    sdt = state_dtype(name, wdt, mp)
    st = _states(name, states, hyper, w, sdt)
    g_steps = [_store(rng.standard_normal(x.size) * 1.5, gdt) if grads == 1 else
               (_store(rng.standard_normal(x.size) * 1.5, gdt), _store(x * 0.3, gdt))
               for _ in range(5)]
    got = _run(C, name, states, hyper, w, st, master, g_steps)
    want = _run(K, name, states, hyper, w, st, master, g_steps)
    for a, b in zip([got[0], *got[1].values(), got[2]], [want[0], *want[1].values(), want[2]]):
        if a is None:
            continue
        if reduces(name, hyper):  # norms: reductions in another order, 1e-6 or an ulp
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


# (elements, dtypes): keys of one kernel share a launch, big ones (beyond the 65536 elements
# that used to go key by key, one of 3M: MAX_BLOCKS blocks striding) with small ones
MULTI_KEYS = [(1, DTYPES[0]), (7, DTYPES[0]), (70001, DTYPES[0]), (3 << 20, DTYPES[0]),
              (300, DTYPES[1]), (66000, DTYPES[1]), (5000, DTYPES[2]), (99, DTYPES[3]),
              (2, DTYPES[4]), (65536, DTYPES[4]), (40, DTYPES[5]), (12345, DTYPES[6])]


def _multi_keys(name, states, hyper, seed=5, two=False):
    """MULTI_KEYS' keys, three rounds of grads each; ``two``: every other key's grad is two
    arrays of its compute dtype in the first two rounds, the other keys' in the third."""
    rng, keys = np.random.default_rng(seed), []
    for i, (n, (wdt, gdt, mp)) in enumerate(MULTI_KEYS):
        w = _store(rng.standard_normal(n), wdt)
        master = (K.bf16_to_f32(w) if wdt == 'bfloat16' else w.astype(np.float32)) if mp \
            else None
        compute = 'float64' if wdt == 'float64' and not mp else 'float32'
        keys.append((w, _states(name, states, hyper, w, state_dtype(name, wdt, mp)), master,
                     [tuple(_store(rng.standard_normal(n), compute) for _ in range(2))
                      if two and (i + (step == 2)) % 2 else _store(rng.standard_normal(n), gdt)
                      for step in range(3)]))
    return keys


def _calls(name, states, copies, step, hyper):
    """Step ``step``'s calls over ``copies`` (as _multi_keys makes them, on either side)."""
    extra = {'t': step + 1} if name in NEEDS_T else {}
    return [(name + '_update', (w, grads[step], *[st.get(s) for s in states]),
             dict(BASE, **hyper, **extra, weight32=m))
            for w, st, m, grads in copies]


def _on_device(keys):
    return [(cp.asarray(w), {k: cp.asarray(v) for k, v in st.items()},
             None if m is None else cp.asarray(m),
             [tuple(map(cp.asarray, g)) if type(g) is tuple else cp.asarray(g) for g in grads])
            for w, st, m, grads in keys]


def _arrays(copies):
    return [cp.asnumpy(a) for w, st, m, _ in copies for a in (w, *st.values(), m)
            if a is not None]


@pytest.mark.parametrize('name,states,hyper,_', CASES,
                         ids=[f'{c[0]}-{i}' for i, c in enumerate(CASES)])
def test_one_launch_per_kernel_matches_key_by_key(name, states, hyper, _):
    """Keys of mixed sizes and dtypes, one launch per kernel from launches kept over three
    rounds, give bit for bit what one launch per key gives; LAMB too (a key's norms are
    summed over the same blocks, in the same order, either way)."""
    _fused_matches_key_by_key(name, states, hyper)


# the rules of one pass and the rules of several, which read the two grads in each
TWO_CASES = [CASES[i] for i in (1, 4, 9, 19, 23, 28)]


@pytest.mark.parametrize('name,states,hyper,_', TWO_CASES,
                         ids=[f'{c[0]}-{i}' for i, c in enumerate(TWO_CASES)])
def test_keys_with_two_grads_in_one_launch_match_key_by_key(name, states, hyper, _):
    """As above with keys whose grads are two arrays beside keys of one, the kinds swapped in
    the third round (planned anew, not run from a kept launch)."""
    _fused_matches_key_by_key(name, states, hyper, two=True)


def _fused_matches_key_by_key(name, states, hyper, two=False):
    keys = _multi_keys(name, states, hyper, two=two)
    fused, alone, kept = _on_device(keys), _on_device(keys), {}
    for step in range(3):
        C.multi_update(_calls(name, states, fused, step, hyper), kept)
        for fn, args, kwargs in _calls(name, states, alone, step, hyper):
            getattr(C, fn)(*args, **kwargs)
    assert len(kept) == 1
    for a, b in zip(_arrays(fused), _arrays(alone)):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize('hyper', [CASES[9][2], CASES[10][2]], ids=['bias', 'bounds'])
def test_lamb_in_one_launch_matches_numpy(hyper):
    """LAMB's first pass sums the norms per block and each key's last block finishes them
    (atomics, 256-thread sums, 8192 blocks on the 3M key): 1e-6 of numpy, and the same bits
    on a second run."""
    keys = _multi_keys('lamb', ['mean', 'var'], hyper, seed=8)
    runs = [_on_device(keys), _on_device(keys)]
    host = [(w.copy(), {k: v.copy() for k, v in st.items()}, None if m is None else m.copy(),
             grads) for w, st, m, grads in keys]
    for step in range(3):
        for copies in runs:
            C.multi_update(_calls('lamb', ['mean', 'var'], copies, step, hyper), {})
        K.multi_update(_calls('lamb', ['mean', 'var'], host, step, hyper))
    got, again = _arrays(runs[0]), _arrays(runs[1])
    want = [a for w, st, m, _ in host for a in (w, *st.values(), m) if a is not None]
    for a, b, c in zip(got, again, want):
        np.testing.assert_array_equal(a, b)
        tol = {'uint16': 8e-3, 'float16': 1e-3}.get(str(a.dtype), 1e-6)
        a = K.bf16_to_f32(a) if a.dtype == np.uint16 else a
        c = K.bf16_to_f32(c) if c.dtype == np.uint16 else c
        np.testing.assert_allclose(a, c, rtol=tol, atol=tol)


def test_kept_launches_follow_new_arrays_and_streams():
    """A weight reallocated and another stream plan the round anew (cuda_launch.Round)."""
    hyper = dict(momentum=0.9)
    keys = _multi_keys('sgd', ['mom'], hyper)[:4]
    fused, alone, kept = _on_device(keys), _on_device(keys), {}
    C.multi_update(_calls('sgd', ['mom'], fused, 0, hyper), kept)
    fused[2] = (fused[2][0].copy(), *fused[2][1:])
    with cp.cuda.Stream():
        C.multi_update(_calls('sgd', ['mom'], fused, 1, hyper), kept)
    C.multi_update(_calls('sgd', ['mom'], fused, 2, hyper), kept)
    for step in range(3):
        for fn, args, kwargs in _calls('sgd', ['mom'], alone, step, hyper):
            getattr(C, fn)(*args, **kwargs)
    cp.cuda.Device().synchronize()
    for a, b in zip(_arrays(fused), _arrays(alone)):
        np.testing.assert_array_equal(a, b)


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


@pytest.mark.parametrize('name,params', [
    ('dcasgd', dict(momentum=0.9)), ('sgld', dict(seed=3)), ('lars', dict(momentum=0.9)),
    ('lbsgd', dict(batch_scale=2, momentum=0.9, warmup_strategy='lars')), ('nadam', {}),
    ('adadelta', {}), ('lans', dict(wd=0.01))])
def test_new_optimizers_on_device_update_as_on_the_host(name, params):
    """Through the Updater: DCASGD's previous weight made on the device from the weight,
    SGLD's noise by key and count, LARS's names, LBSGD's sums; norms to 1e-6."""
    rng = np.random.default_rng(4)
    for mp, dtype in ((False, np.float32), (True, np.float16)):
        device = Updater(create(name, multi_precision=mp, learning_rate=0.05, **params))
        host = Updater(create(name, multi_precision=mp, learning_rate=0.05, **params))
        w = rng.standard_normal(70001).astype(dtype)
        on_device = cp.asarray(w)
        for _ in range(4):
            g = rng.standard_normal(70001).astype(dtype)
            device.update('fc_weight', on_device, cp.asarray(g))
            host.update('fc_weight', w, g.copy())
        got = cp.asnumpy(on_device)
        if name in ('lars', 'lbsgd', 'lans'):
            np.testing.assert_allclose(got.astype(np.float32), w.astype(np.float32),
                                       rtol=1e-3 if mp else 1e-6, atol=1e-3 if mp else 1e-6)
        else:
            np.testing.assert_array_equal(got, w)
