"""The generated CUDA kernels, run on the CPU: their C++ body compiled by g++ with CUDA's
names shimmed, one emulated thread walking each grid-stride loop, fed numpy memory. They must
give the numpy reference kernels' results bit for bit (LAMB to rounding: its norms come from
numpy here), key by key and through multi-tensor apply. This checks the arithmetic and the
pointer tables without a GPU; the `gpu` tests check the same on a device."""

import ctypes
import shutil
import subprocess
import types

import numpy as np
import pytest

from kvps.optimizer.kernels import cuda_kernels as C
from kvps.optimizer.kernels import cuda_source as src
from kvps.optimizer.kernels import numpy_kernels as K
from test_cuda_source import (BASE, CASES, DTYPES, FAKE_CUPY, NEEDS_T, Device, DeviceLike,
                              every_plan, live_states, state_dtype)


def _gxx_has_float16():
    """g++ 12+ on x86-64 has _Float16, which stands in for CUDA's half conversions."""
    if shutil.which('g++') is None:
        return False
    probe = subprocess.run(['g++', '-x', 'c++', '-fsyntax-only', '-'], capture_output=True,
                           input=b'_Float16 h = (_Float16)1.5f;\n', timeout=60)
    return probe.returncode == 0


pytestmark = pytest.mark.skipif(not _gxx_has_float16(), reason='needs g++ with _Float16')

SHIM = r'''
#include <cmath>
#include <cstring>
#define __device__
#define __forceinline__ inline
#define __global__
struct kv_dim3 { unsigned int x, y, z; };
extern "C" { kv_dim3 blockIdx = {0, 0, 0}, threadIdx = {0, 0, 0}, blockDim = {1, 1, 1},
                     gridDim = {1, 1, 1}; }
static inline float __uint_as_float(unsigned int u) { float f; std::memcpy(&f, &u, 4); return f; }
static inline unsigned int __float_as_uint(float f) {
    unsigned int u; std::memcpy(&u, &f, 4); return u;
}
using std::sqrt; using std::fabs; using std::isfinite;
'''
HALF_ON_CPU = r'''
static inline float kv_f16_to_f32(unsigned short h) {
    _Float16 v; std::memcpy(&v, &h, 2); return (float)v;
}
static inline unsigned short kv_f32_to_f16(float f) {
    _Float16 v = (_Float16)f; unsigned short h; std::memcpy(&h, &v, 2); return h;
}
'''


@pytest.fixture(scope='module')
def library(tmp_path_factory):
    """Every kernel variant of every rule and dtype, in one shared object."""
    record = []
    patch = pytest.MonkeyPatch()
    patch.setattr(C, '_cupy', lambda: FAKE_CUPY)
    patch.setattr(C, '_sums_of_squares', lambda *arrays: DeviceLike(2, 'float64'))
    patch.setattr(C, '_run', lambda plan: record.append(('one', plan)))
    try:
        plans = every_plan(record)
    finally:
        patch.undo()
    kernels = {}
    for plan in plans:
        kernels[plan.kernel_name()] = src.definition(plan)
        if not plan.raws:
            kernels[plan.kernel_name(multi=True)] = src.definition(plan, multi=True)
    body = [SHIM, src.PREAMBLE.replace(src.HALF_CONVERSIONS, HALF_ON_CPU)]
    body += [f'namespace k{i} {{\n{text}\n}}' for i, text in enumerate(kernels.values())]
    where = tmp_path_factory.mktemp('cuda_emulated')
    (where / 'kernels.cpp').write_text('\n'.join(body))
    subprocess.run(['g++', '-std=c++17', '-O1', '-ffp-contract=off', '-fno-fast-math',
                    '-shared', '-fPIC', '-o', str(where / 'kernels.so'),
                    str(where / 'kernels.cpp')], check=True, capture_output=True, timeout=300)
    return ctypes.CDLL(str(where / 'kernels.so'))


class HostDevice(np.ndarray):
    """numpy memory dressed as a cupy array for the kernels' Python side."""

    @property
    def device(self):
        return Device()

    @property
    def data(self):
        return types.SimpleNamespace(ptr=self.ctypes.data)


def on_host(array):
    return np.ascontiguousarray(array).view(HostDevice)


def _pointer(array):
    return ctypes.c_void_p(array.ctypes.data)


def _scalar(value, wide, compute):
    return ctypes.c_double(value) if wide or compute == 'float64' else ctypes.c_float(value)


def _f64(array):
    return K.bf16_to_f32(array).astype(np.float64) if array.dtype == np.uint16 \
        else array.astype(np.float64)


@pytest.fixture
def emulated(library, monkeypatch):
    """cuda_kernels running on the CPU through ``library``; returns the launch log."""
    log = []

    def run(plan):
        if plan.n == 0:
            return
        log.append(('one', plan.tag))
        args = [ctypes.c_longlong(plan.n), *(_pointer(a) for _, a, _ in plan.arrays),
                *(_pointer(r) for _, r in plan.raws),
                *(_scalar(v, wide, plan.compute) for _, v, wide in plan.scalars)]
        getattr(library, plan.kernel_name())(*args)

    def run_multi(plans):
        log.append(('multi', len(plans)))
        table = np.array([[p.n] + [a.ctypes.data for _, a, _ in p.arrays] for p in plans],
                         np.int64)
        scal = np.ascontiguousarray([[float(v) for _, v, _ in p.scalars] for p in plans],
                                    np.float64)
        block = ctypes.c_uint.in_dll(library, 'blockIdx')   # its first field is x
        y = ctypes.c_uint.from_address(ctypes.addressof(block) + 4)
        for row in range(len(plans)):
            y.value = row
            getattr(library, plans[0].kernel_name(multi=True))(_pointer(table), _pointer(scal))
        y.value = 0

    monkeypatch.setattr(C, '_cupy', lambda: types.SimpleNamespace(
        empty=lambda shape, dtype: on_host(np.empty(shape, dtype))))
    monkeypatch.setattr(C, '_sums_of_squares', lambda *arrays: on_host(
        np.array([np.sum(_f64(a) ** 2) for a in arrays])))
    monkeypatch.setattr(C, '_run', run)
    monkeypatch.setattr(C, '_run_multi', run_multi)
    return log


def _store(x, dtype):
    return K.f32_to_bf16(x.astype(np.float32)) if dtype == 'bfloat16' else x.astype(dtype)


def _key(rng, n, name, states, hyper, wdt, gdt, mp):
    """(weight, {state: array}, master or None, [grads]) for one key."""
    w = _store(rng.standard_normal(n), wdt)
    master = (K.bf16_to_f32(w) if wdt == 'bfloat16' else w.astype(np.float32)) if mp else None
    sdt = state_dtype(name, wdt, mp)
    st = {s: np.zeros(n, np.uint16 if sdt == 'bfloat16' else sdt)
          for s in live_states(name, states, hyper)}
    return w, st, master, [_store(rng.standard_normal(n) * 1.5, gdt) for _ in range(3)]


def _calls(name, states, hyper, keys, step, t):
    extra = {'t': t} if name in NEEDS_T else {}
    return [(name + '_update', (w, grads[step], *[st.get(s) for s in states]),
             dict(BASE, **hyper, **extra, weight32=master)) for w, st, master, grads in keys]


def _copy(keys, as_device):
    wrap = on_host if as_device else np.copy
    return [(wrap(w), {k: wrap(v) for k, v in st.items()},
             None if m is None else wrap(m), [wrap(g) for g in grads])
            for w, st, m, grads in keys]


def _assert_same(name, got_keys, want_keys):
    for got, want in zip(got_keys, want_keys):
        pairs = [(got[0], want[0]), *((got[1][k], want[1][k]) for k in want[1]),
                 (got[2], want[2])]
        for a, b in pairs:
            if b is None:
                continue
            a, b = np.asarray(a), np.asarray(b)
            if name == 'lamb':   # the norms: numpy's pairwise sums against a plain sum
                tol = {'uint16': 8e-3, 'float16': 1e-3}.get(str(b.dtype), 1e-6)
                np.testing.assert_allclose(_f64(a), _f64(b), rtol=tol, atol=tol)
            else:
                np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))


@pytest.mark.parametrize('wdt,gdt,mp', DTYPES, ids=['-'.join(map(str, d)) for d in DTYPES])
@pytest.mark.parametrize('name,states,hyper,_', CASES,
                         ids=[f'{c[0]}-{i}' for i, c in enumerate(CASES)])
def test_each_kernel_gives_the_numpy_result_bit_for_bit(emulated, name, states, hyper, _, wdt,
                                                        gdt, mp):
    keys = [_key(np.random.default_rng(11), 3001, name, states, hyper, wdt, gdt, mp)]
    device, host = _copy(keys, True), _copy(keys, False)
    for step in range(3):
        for fn, args, kwargs in _calls(name, states, hyper, device, step, step + 1):
            getattr(C, fn)(*args, **kwargs)
        for fn, args, kwargs in _calls(name, states, hyper, host, step, step + 1):
            getattr(K, fn)(*args, **kwargs)
    _assert_same(name, device, host)


@pytest.mark.parametrize('name,states,hyper,_', CASES,
                         ids=[f'{c[0]}-{i}' for i, c in enumerate(CASES)])
def test_multi_tensor_apply_gives_the_numpy_results(emulated, name, states, hyper, _):
    rng = np.random.default_rng(5)
    sizes = [1, 7, 300, 2000, C.MULTI_MAX + 3, 2, 99, 5]
    keys = [_key(rng, n, name, states, hyper, *dtypes)
            for n, dtypes in zip(sizes, DTYPES + DTYPES[:1])]
    device, host = _copy(keys, True), _copy(keys, False)
    for step in range(3):
        C.multi_update(_calls(name, states, hyper, device, step, step + 1))
        K.multi_update(_calls(name, states, hyper, host, step, step + 1))
    _assert_same(name, device, host)
    if name != 'lamb':    # the two float32 keys of this rule share a launch
        assert ('multi', 2) in emulated
