"""The generated CUDA kernels, run on the CPU: their C++ body compiled by g++ with CUDA's
names shimmed, each block one emulated thread walking its grid-stride loop, blocks one after
another, fed numpy memory through the real launch path (tables built and "uploaded", keys
found from the prefix of their block counts, LAMB's partial norms added up by each key's last
block). They must give the numpy reference kernels' results bit for bit (LAMB to rounding:
its norms are sums in another order), key by key and through multi-tensor apply, round after
round from kept launches, with the grad as one array or as two (a sync round's last pushes,
added as the kernel loads them, as numpy adds the tuple; never written). This checks the
arithmetic and the tables without a GPU; the block-wide sums of 256 threads and the atomics
run for real only in the `gpu` tests."""

import ctypes
import shutil
import subprocess
import types

import numpy as np
import pytest
from test_cuda_source import (BASE, CASES, DTYPES, NEEDS_T, TWO_GRADS, Device, current_stream,
                              every_plan, live_states, reduces, state_dtype)

from kvps.optimizer.kernels import (cuda_kernels as C, cuda_launch as L, cuda_rows as CR,
                                    cuda_source as src, numpy_kernels as K)


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
#define __shared__ static
static inline void __syncthreads() {}
static inline void __threadfence() {}
static inline unsigned int atomicAdd(unsigned int* at, unsigned int v) {
    unsigned int old = *at; *at = old + v; return old;
}
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
    """Every kernel of every rule and dtype, each layout, in one shared object."""
    return build(tmp_path_factory.mktemp('cuda_emulated'), definitions(every_plan()))


def definitions(plans):
    """The kernels of ``plans``, each layout, without the PREAMBLE."""
    kernels = {}
    for plan in plans:
        kernels.update((name, code[len(src.PREAMBLE):])
                       for name, code in src.kernels_of(plan).items())
    return list(kernels.values())


def build(where, kernels):
    """Kernel definitions (C after PREAMBLE) built for the CPU in directory ``where``."""
    body = [SHIM, src.PREAMBLE.replace(src.HALF_CONVERSIONS, HALF_ON_CPU)]
    body += [f'namespace k{i} {{\n{text}\n}}' for i, text in enumerate(kernels)]
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


class Dim3(ctypes.Structure):
    _fields_ = [('x', ctypes.c_uint), ('y', ctypes.c_uint), ('z', ctypes.c_uint)]


_C_TYPES = {np.int64: ctypes.c_longlong, np.int32: ctypes.c_int, np.float32: ctypes.c_float,
            np.float64: ctypes.c_double}


def _c(value):
    """A launch argument as C takes it: arrays by address, numpy scalars by value."""
    if isinstance(value, np.ndarray):
        return ctypes.c_void_p(value.ctypes.data)
    return _C_TYPES[type(value)](value)


class Emulated:
    """A compiled kernel run on the CPU: its blocks one after another, one thread each."""

    def __init__(self, library, name, log):
        self.fn, self.name, self.log = getattr(library, name), name, log
        self.dims = [Dim3.in_dll(library, d) for d in ('blockIdx', 'blockDim', 'gridDim')]

    def __call__(self, grid, block, args):
        self.log.append(self.name)
        block_idx, block_dim, grid_dim = self.dims
        block_dim.x, grid_dim.x = 1, grid[0]
        args = [_c(a) for a in args]
        for index in range(grid[0]):
            block_idx.x = index
            self.fn(*args)
        block_idx.x = 0


HOST_CUPY = types.SimpleNamespace(
    empty=lambda shape, dtype: on_host(np.empty(shape, dtype)),
    zeros=lambda shape, dtype: on_host(np.zeros(shape, dtype)),
    float64=np.float64, uint32=np.uint32, asarray=lambda a: on_host(np.array(a)),
    ascontiguousarray=lambda a: on_host(np.ascontiguousarray(a)),
    cuda=types.SimpleNamespace(get_current_stream=current_stream))


def _f64(array):
    return K.bf16_to_f32(array).astype(np.float64) if array.dtype == np.uint16 \
        else array.astype(np.float64)


@pytest.fixture
def emulated(library, monkeypatch):
    """cuda_kernels running on the CPU through ``library``; returns the kernels launched."""
    log = []
    monkeypatch.setattr(L, 'cupy', lambda: HOST_CUPY)
    monkeypatch.setattr(L, 'compiled', lambda code, name: Emulated(library, name, log))
    monkeypatch.setattr(L, '_KERNELS', {})
    monkeypatch.setattr(CR, '_KERNELS', {})   # (test_cuda_rows' kernel, from its library)
    return log


def _store(x, dtype):
    return K.f32_to_bf16(x.astype(np.float32)) if dtype == 'bfloat16' else x.astype(dtype)


def _key(rng, n, name, states, hyper, wdt, gdt, mp, grads=(1, 1, 1)):
    """(weight, {state: array}, master or None, [grads]) for one key; ``grads``: how many
    arrays each round's grad is (2: a tuple, of the compute dtype)."""
    w = _store(rng.standard_normal(n), wdt)
    master = (K.bf16_to_f32(w) if wdt == 'bfloat16' else w.astype(np.float32)) if mp else None
    sdt = state_dtype(name, wdt, mp)
    st = {s: np.zeros(n, np.uint16 if sdt == 'bfloat16' else sdt)
          for s in live_states(name, states, hyper)}
    compute = 'float64' if wdt == 'float64' and not mp else 'float32'
    return w, st, master, [_store(rng.standard_normal(n) * 1.5, gdt) if count == 1 else
                           tuple(_store(rng.standard_normal(n) * s, compute) for s in (1.5, .7))
                           for count in grads]


def _calls(name, states, hyper, keys, step, t):
    extra = {'t': t} if name in NEEDS_T else {}
    return [(name + '_update', (w, grads[step], *[st.get(s) for s in states]),
             dict(BASE, **hyper, **extra, weight32=master)) for w, st, master, grads in keys]


def _copy(keys, as_device):
    """Copies of ``keys`` for the CUDA kernels or numpy's; a grad's two arrays are read-only
    for numpy's (receive buffers: never written)."""
    wrap = on_host if as_device else np.copy

    def grad(g):
        if type(g) is not tuple:
            return wrap(g)
        parts = tuple(map(wrap, g))
        for part in parts if not as_device else ():
            part.flags.writeable = False
        return parts
    return [(wrap(w), {k: wrap(v) for k, v in st.items()},
             None if m is None else wrap(m), [grad(g) for g in grads])
            for w, st, m, grads in keys]


def _assert_same(near, got_keys, want_keys):
    """Bit for bit; to rounding where ``near`` (a rule that takes norms)."""
    for got, want in zip(got_keys, want_keys):
        pairs = [(got[0], want[0]), *((got[1][k], want[1][k]) for k in want[1]),
                 (got[2], want[2])]
        for a, b in pairs:
            if b is None:
                continue
            a, b = np.asarray(a), np.asarray(b)
            if near:   # the norms: numpy's pairwise sums against a plain sum
                tol = {'uint16': 8e-3, 'float16': 1e-3}.get(str(b.dtype), 1e-6)
                np.testing.assert_allclose(_f64(a), _f64(b), rtol=tol, atol=tol)
            else:
                np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))


# (dtypes, arrays per grad): every dtype combination with one grad; with two (a sync round's
# last pushes), those whose grads are of the compute dtype
FORMS = [(d, 1) for d in DTYPES] + [(d, 2) for d in TWO_GRADS]


@pytest.mark.parametrize('dtypes,grads', FORMS,
                         ids=['-'.join(map(str, d)) + f'-x{g}' for d, g in FORMS])
@pytest.mark.parametrize('name,states,hyper,_', CASES,
                         ids=[f'{c[0]}-{i}' for i, c in enumerate(CASES)])
def test_each_kernel_gives_the_numpy_result_bit_for_bit(emulated, name, states, hyper, _,
                                                        dtypes, grads):
    keys = [_key(np.random.default_rng(11), 3001, name, states, hyper, *dtypes, (grads,) * 3)]
    device, host = _copy(keys, True), _copy(keys, False)
    for step in range(3):
        for fn, args, kwargs in _calls(name, states, hyper, device, step, step + 1):
            getattr(C, fn)(*args, **kwargs)
        for fn, args, kwargs in _calls(name, states, hyper, host, step, step + 1):
            getattr(K, fn)(*args, **kwargs)
    _assert_same(reduces(name, hyper), device, host)
    assert emulated and all(('x2' in kernel) == (grads == 2) for kernel in emulated)
    _assert_only_read(device, keys)


def _assert_only_read(device, keys):
    """The two arrays of each grad are as they were made (a worker's blocks, read in place)."""
    for (*_, got), (*_, made) in zip(device, keys):
        for g, want in zip(got, made):
            if type(want) is tuple:
                for part, original in zip(g, want):
                    np.testing.assert_array_equal(np.asarray(part), original)


# (elements, dtypes) of a round's keys: float32, float64 and float16-with-master keys each share
# a launch, big keys (over the 65536 elements that used to go key by key) with small ones;
# the other dtype combinations have a key each, which runs the single layout
KEYS = [(1, DTYPES[0]), (70001, DTYPES[0]), (300, DTYPES[1]), (66000, DTYPES[1]),
        (7, DTYPES[2]), (2000, DTYPES[3]), (99, DTYPES[4]), (5, DTYPES[4]), (3, DTYPES[5]),
        (40, DTYPES[6])]
LAUNCHES = 7   # kernels (rule and dtypes) among KEYS


@pytest.mark.parametrize('name,states,hyper,_', CASES,
                         ids=[f'{c[0]}-{i}' for i, c in enumerate(CASES)])
def test_multi_tensor_apply_gives_the_numpy_results_round_after_round(emulated, name, states,
                                                                       hyper, _):
    """Three rounds over the same keys, new gradients and t each round: the first plans the
    launches, the others run them as kept."""
    rng = np.random.default_rng(5)
    keys = [_key(rng, n, name, states, hyper, *dtypes) for n, dtypes in KEYS]
    device, host = _copy(keys, True), _copy(keys, False)
    kept = {}
    for step in range(3):
        C.multi_update(_calls(name, states, hyper, device, step, step + 1), kept)
        K.multi_update(_calls(name, states, hyper, host, step, step + 1))
        passes = _passes(name, states, hyper)
        assert len(emulated) == LAUNCHES * passes
        assert sum(kernel.endswith(('_multi', '_multi_pass1')) for kernel in emulated) == \
            (LAUNCHES if passes > 1 else 3)
        emulated.clear()
    assert len(kept) == 1
    _assert_same(reduces(name, hyper), device, host)


def _passes(name, states, hyper):
    """How many passes (launches) an update of the rule makes."""
    keys = [_key(np.random.default_rng(0), 4, name, states, hyper, 'float32', 'float32', False)]
    fn, args, kwargs = _calls(name, states, hyper, keys, 0, 1)[0]
    return len(L.plan_of(L.describe(getattr(C, fn), args, kwargs)).passes)


@pytest.mark.parametrize('name,states,hyper,_', [CASES[4], CASES[9]], ids=['adam', 'lamb'])
def test_gradients_rewritten_in_place_are_read_again(emulated, name, states, hyper, _):
    """A shard may sum each round into the same buffers: the kept table's pointers stay, the
    values under them are new."""
    keys = [_key(np.random.default_rng(9), n, name, states, hyper, *dtypes)
            for n, dtypes in KEYS[:4]]
    device, host = _copy(keys, True), _copy(keys, False)
    buffers = [grads[0].copy() for _, _, _, grads in device]
    kept = {}
    for step in range(3):
        for buffer, (_, _, _, grads) in zip(buffers, device):
            np.copyto(buffer, grads[step])
        calls = _calls(name, states, hyper, device, step, step + 1)
        C.multi_update([(fn, (args[0], buffer, *args[2:]), kwargs)
                        for (fn, args, kwargs), buffer in zip(calls, buffers)], kept)
        K.multi_update(_calls(name, states, hyper, host, step, step + 1))
    _assert_same(reduces(name, hyper), device, host)


# keys whose grads come as two arrays in some rounds and as one in others
MIXED = [(1, DTYPES[0]), (70001, DTYPES[0]), (300, DTYPES[0]), (66000, DTYPES[1]),
         (7, DTYPES[1]), (2000, DTYPES[4]), (99, DTYPES[4])]


@pytest.mark.parametrize('name,states,hyper,_', CASES,
                         ids=[f'{c[0]}-{i}' for i, c in enumerate(CASES)])
def test_keys_with_two_grads_and_keys_with_one_share_kept_rounds(emulated, monkeypatch, name,
                                                                 states, hyper, _):
    """A call list whose keys alternate between a grad of two arrays and of one: the second
    round runs from the launches the first planned; the third swaps every key's kind (a
    kept launch would read a stale pointer, or one too few): planned anew."""
    rng = np.random.default_rng(8)
    kinds = [[2 - (i + (step == 2)) % 2 for step in range(3)] for i in range(len(MIXED))]
    keys = [_key(rng, n, name, states, hyper, *dtypes, kinds[i])
            for i, (n, dtypes) in enumerate(MIXED)]
    device, host = _copy(keys, True), _copy(keys, False)
    kept, made = {}, []

    class Counted(L.Round):
        def __init__(self, *args):
            made.append(1)
            super().__init__(*args)
    monkeypatch.setattr(L, 'Round', Counted)
    for step in range(3):
        C.multi_update(_calls(name, states, hyper, device, step, step + 1), kept)
        K.multi_update(_calls(name, states, hyper, host, step, step + 1))
        assert {'x2' in kernel for kernel in emulated} == {True, False}
        emulated.clear()
    assert len(made) == 2 and len(kept) == 1
    _assert_same(reduces(name, hyper), device, host)
    _assert_only_read(device, keys)


def _built_with(tmp_path_factory, ilp):
    """Every kernel built as with cuda_source.FORCED_ILP = ``ilp`` (bench_kernels --ilp)."""
    forced, src.FORCED_ILP = src.FORCED_ILP, ilp
    try:
        return build(tmp_path_factory.mktemp(f'cuda_ilp{ilp}'), definitions(every_plan()))
    finally:
        src.FORCED_ILP = forced


@pytest.fixture(scope='module')
def library_ilp1(tmp_path_factory):
    return _built_with(tmp_path_factory, 1)


@pytest.fixture(scope='module')
def library_ilp4(tmp_path_factory):
    return _built_with(tmp_path_factory, 4)


@pytest.mark.parametrize('name,states,hyper,_', CASES,
                         ids=[f'{c[0]}-{i}' for i, c in enumerate(CASES)])
def test_loading_four_elements_a_thread_at_once_changes_no_bit(library_ilp1, library_ilp4,
                                                               monkeypatch, name, states,
                                                               hyper, _):
    """The loop of _ilp_loop takes the elements in the plain loop's order: every rule, its
    norms too, gives the same bits loading 4 elements a thread at once as loading 1 (a size
    that 4 does not divide; a grad of two arrays, then of one)."""
    monkeypatch.setattr(L, 'cupy', lambda: HOST_CUPY)
    made = [_key(np.random.default_rng(5), 1003, name, states, hyper, *DTYPES[0], (2, 1, 2))]
    results = []
    for built in (library_ilp1, library_ilp4):
        monkeypatch.setattr(L, 'compiled', lambda code, kernel, lib=built: Emulated(lib, kernel,
                                                                                     []))
        monkeypatch.setattr(L, '_KERNELS', {})
        keys = _copy(made, True)
        for step in range(3):
            for fn, args, kwargs in _calls(name, states, hyper, keys, step, step + 1):
                getattr(C, fn)(*args, **kwargs)
        results.append(keys)
    _assert_same(False, *results)
