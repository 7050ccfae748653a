"""The CUDA kernels without a GPU: every variant's generated source compiles with NVRTC (the
`nvidia-cuda-nvrtc-cu12` wheel, a test dependency), and multi-tensor apply groups keys into
launches whose pointer tables match the source that reads them."""

import ctypes
import glob
import os
import types

import numpy as np
import pytest

from kvps.optimizer.kernels import cuda_kernels as C
from kvps.optimizer.kernels import cuda_source as src

BASE = dict(lr=0.05, wd=0.01, rescale_grad=0.5, clip_gradient=0.8)
# (optimizer, state names, hyper-parameters, whether the momentum-like state is live)
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


def live_states(name, states, hyper):
    """The state names an update really gets (None for the rest)."""
    live = states if hyper.get('momentum', 1.0) != 0.0 or name not in ('sgd', 'signum') else []
    return ['var'] if name == 'rmsprop' and not hyper.get('centered') else live


def state_dtype(name, wdt, mp):
    return 'float32' if mp or (name == 'lamb' and wdt in ('float16', 'bfloat16')) else wdt


def storage(dtype):
    return 'uint16' if dtype == 'bfloat16' else dtype


class Device:
    id = 0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class DeviceLike:
    """Enough of a cupy array for planning: dtype, shape, size, flags, a pointer, a device."""

    address = 1 << 20

    def __init__(self, shape, dtype):
        self.shape = tuple(shape) if isinstance(shape, (tuple, list)) else (shape,)
        self.size = int(np.prod(self.shape))
        self.dtype = np.dtype(dtype)
        self.flags = types.SimpleNamespace(c_contiguous=True)
        DeviceLike.address += 4096 + self.size * self.dtype.itemsize
        self.data = types.SimpleNamespace(ptr=DeviceLike.address)
        self.device = Device()


FAKE_CUPY = types.SimpleNamespace(empty=DeviceLike, float64=np.float64)


@pytest.fixture
def launches(monkeypatch):
    """Record launches instead of running them: ('one', plan) and ('multi', [plans])."""
    record = []
    monkeypatch.setattr(C, '_cupy', lambda: FAKE_CUPY)
    monkeypatch.setattr(C, '_sums_of_squares', lambda *arrays: DeviceLike(2, 'float64'))
    monkeypatch.setattr(C, '_run', lambda plan: record.append(('one', plan)))
    monkeypatch.setattr(C, '_run_multi', lambda plans: record.append(('multi', plans)))
    return record


def call(name, states, hyper, wdt, gdt, mp, n=1000):
    """(fn name, args, kwargs) of one update on stand-in device arrays."""
    weight, grad = DeviceLike(n, storage(wdt)), DeviceLike(n, storage(gdt))
    sdt = storage(state_dtype(name, wdt, mp))
    live = live_states(name, states, hyper)
    args = (weight, grad, *[DeviceLike(n, sdt) if s in live else None for s in states])
    kwargs = dict(BASE, **hyper, weight32=DeviceLike(n, 'float32') if mp else None)
    if name in NEEDS_T:
        kwargs['t'] = 3
    return name + '_update', args, kwargs


def every_plan(launches):
    for case in CASES:
        for dtypes in DTYPES:
            name, args, kwargs = call(*case[:3], *dtypes)
            getattr(C, name)(*args, **kwargs)
    return [plan for _, plan in launches]


# -- NVRTC ---------------------------------------------------------------------------------
def _nvrtc():
    try:
        import nvidia.cuda_nvrtc
    except ImportError:
        return None
    found = glob.glob(os.path.join(list(nvidia.cuda_nvrtc.__path__)[0], 'lib', 'libnvrtc.so*'))
    return ctypes.CDLL(sorted(found, key=len)[0]) if found else None


NVRTC = _nvrtc()


def compile_errors(code):
    """NVRTC's log for ``code`` compiled as cupy does, for a Volta-or-later GPU; '' if clean."""
    program = ctypes.c_void_p()
    assert NVRTC.nvrtcCreateProgram(ctypes.byref(program), code.encode(), b'kvps.cu', 0,
                                    None, None) == 0
    options = [b'--gpu-architecture=compute_75', *(o.encode() for o in C._OPTIONS)]
    status = NVRTC.nvrtcCompileProgram(program, len(options),
                                       (ctypes.c_char_p * len(options))(*options))
    size = ctypes.c_size_t()
    NVRTC.nvrtcGetProgramLogSize(program, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    NVRTC.nvrtcGetProgramLog(program, log)
    NVRTC.nvrtcDestroyProgram(ctypes.byref(program))
    text = log.value.decode(errors='replace')
    return text if status != 0 or 'warning' in text.replace('Architectures prior', '') else ''


needs_nvrtc = pytest.mark.skipif(NVRTC is None, reason='NVRTC (nvidia-cuda-nvrtc-cu12) missing')


@needs_nvrtc
def test_every_update_kernel_compiles_single_and_multi_tensor(launches):
    sources = {}
    for plan in every_plan(launches):
        sources[src.source(plan)] = plan.kernel_name()
        if not plan.raws:
            sources[src.source(plan, multi=True)] = plan.kernel_name(multi=True)
    assert len(sources) > 100            # every rule x dtype combination, both layouts
    for code, name in sources.items():
        assert f'void {name}(' in code
        assert compile_errors(code) == '', name


@needs_nvrtc
@pytest.mark.parametrize('dtype', sorted(src.CTYPES))
def test_the_lamb_norm_kernels_compile(dtype):
    code = src.sumsq_source(dtype)
    assert src.sumsq_name(dtype) in code and 'kvps_sum_rows' in code
    assert compile_errors(code) == ''


@needs_nvrtc
def test_a_broken_kernel_is_reported():
    assert 'error' in compile_errors('extern "C" __global__ void k() { undefined_name; }')


# -- planning and multi-tensor apply ----------------------------------------------------------
def test_small_keys_of_one_rule_share_a_launch_big_keys_and_lamb_go_alone(launches):
    small = [call('sgd', ['mom'], dict(momentum=0.9), 'float32', 'float32', False, n)
             for n in (1, 100, 5000)]
    other = call('adam', ['mean', 'var'], {}, 'float32', 'float32', False, 10)
    big = call('sgd', ['mom'], dict(momentum=0.9), 'float32', 'float32', False,
               C.MULTI_MAX + 1)
    lamb = call('lamb', ['mean', 'var'], {}, 'float32', 'float32', False, 10)
    C.multi_update([*small, other, big, lamb])
    kinds = [(kind, len(p) if kind == 'multi' else p.tag) for kind, p in launches]
    assert kinds.count(('multi', 3)) == 1                       # the three small sgd keys
    assert ('one', 'sgd_mom') in kinds and ('one', 'adam') in kinds   # big; alone in its kind
    assert [k for k in kinds if k[1] in ('lamb_phase1', 'lamb_phase2')] == [
        ('one', 'lamb_phase1'), ('one', 'lamb_phase2')]
    assert len(launches) == 5


def test_a_key_met_twice_is_flushed_before_its_second_update(launches):
    first = call('sgd', ['mom'], dict(momentum=0.9), 'float32', 'float32', False, 10)
    other = call('sgd', ['mom'], dict(momentum=0.9), 'float32', 'float32', False, 20)
    again = (first[0], first[1], dict(first[2], lr=0.5))
    C.multi_update([first, other, again])
    assert [kind for kind, _ in launches] == ['multi', 'one']
    assert launches[1][1].scalars[0] == ('lr', 0.5, False)


def test_the_pointer_table_matches_the_order_the_source_reads(monkeypatch):
    uploaded, launched = [], []

    class Kernel:
        def __call__(self, grid, block, args):
            launched.append((grid, block, args))
    monkeypatch.setattr(C, '_cupy', lambda: types.SimpleNamespace(
        asarray=lambda a: uploaded.append(a) or a))
    monkeypatch.setattr(C, '_compiled', lambda code, name: Kernel())
    monkeypatch.setattr(C, '_KERNELS', {})
    plans = []
    for n in (7, 3000):
        name, args, kwargs = call('adam', ['mean', 'var'], {}, 'float16', 'float16', True, n)
        plans += C._planned(getattr(C, name), args, kwargs)
    C._run_multi(plans)
    table, scalars = uploaded
    code = src.source(plans[0], multi=True)
    for plan, row, scal in zip(plans, table, scalars):
        assert row[0] == plan.n
        for index, (local, arr, _) in enumerate(plan.arrays, start=1):
            assert row[index] == arr.data.ptr and f'p_{local}_ = ' in code
            assert f'row[{index}]' in code.split(f'p_{local}_ = ')[1].split(';')[0]
        for index, (local, value, _) in enumerate(plan.scalars):
            assert scal[index] == value
            assert f"s_{local} = (KC)sc[{index}]" in code or f"s_{local}" not in plan.body
    (grid, block, _), = launched
    assert grid == (src.blocks_for(3000), 2) and block == (src.THREADS,)


def test_an_empty_key_launches_nothing(monkeypatch):
    compiled = []
    monkeypatch.setattr(C, '_compiled', lambda code, name: compiled.append(name))
    monkeypatch.setattr(C, '_KERNELS', {})
    name, args, kwargs = call('sgd', ['mom'], dict(momentum=0.9), 'float32', 'float32', False, 0)
    getattr(C, name)(*args, **kwargs)
    assert compiled == []
