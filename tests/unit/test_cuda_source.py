"""The CUDA kernels without a GPU: every variant's generated source compiles with NVRTC (the
`nvidia-cuda-nvrtc-cu12` wheel, a test dependency), and multi-tensor apply groups keys into
launches whose tables match the source that reads them. Also the stand-ins the other CUDA
tests share: arrays that look like cupy's (DeviceLike) and a cupy that records launches."""

import ctypes
import glob
import os
import types

import numpy as np
import pytest

from kvps.errors import ShapeError
from kvps.optimizer.kernels import cuda_kernels as C, cuda_launch as L, cuda_source as src

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
    ('adadelta', ['acc_g', 'acc_delta'], dict(rho=0.9, epsilon=1e-5), True),
    ('adamax', ['mean', 'u'], dict(beta1=0.9, beta2=0.99), True),
    ('nadam', ['mean', 'var'], dict(beta1=0.9, beta2=0.99, epsilon=1e-8, schedule_decay=0.004),
     True),
    ('ftml', ['d', 'v', 'z'], dict(beta1=0.6, beta2=0.999, epsilon=1e-8), True),
    ('lars', ['mom'], dict(momentum=0.9, eta=0.01, eps=1e-6), True),
    ('lars', ['mom'], dict(momentum=0.0, lars=False), False),
    ('lbsgd', ['mom', 'cum'], dict(momentum=0.9, batch_scale=2, apply=False), True),
    ('lbsgd', ['mom', 'cum'], dict(momentum=0.9, batch_scale=2, lr_scale=1.5), True),
    ('lbsgd', ['mom', 'cum'], dict(lars=True), False),
    ('sgld', [], dict(noise_hi=12345, noise_lo=678), False),
    ('dcasgd', ['mom', 'prev'], dict(momentum=0.9, lamda=0.04), True),
    ('dcasgd', ['mom', 'prev'], dict(lamda=0.1), False),
    ('adabelief', ['mean', 'var'], dict(beta1=0.9, beta2=0.99, epsilon=1e-6), True),
    ('lans', ['mean', 'var'], dict(beta1=0.9, beta2=0.999, epsilon=1e-6), True),
    ('lans', ['mean', 'var'], dict(lower_bound=0.5, upper_bound=3.0), True),
]
NEEDS_T = {'adam', 'adamw', 'lamb', 'adamax', 'nadam', 'ftml', 'adabelief', 'lans'}
FP32_STATES = {'lamb', 'lans', 'adadelta'}   # float32 states for low-precision weights


def reduces(name, hyper):
    """Whether the rule takes norms (a reduction in another order on a GPU: equal to
    rounding, not to the bit)."""
    return name in ('lamb', 'lans') or (name == 'lars' and hyper.get('lars', True)) or \
        (name == 'lbsgd' and hyper.get('lars', False) and hyper.get('apply', True))
# (weight storage, grad storage, fp32 master): 'bfloat16' is uint16 storage
DTYPES = [('float32', 'float32', False), ('float64', 'float64', False),
          ('float64', 'float32', False), ('float16', 'float16', False),
          ('float16', 'float16', True), ('bfloat16', 'float32', True),
          ('bfloat16', 'bfloat16', False)]
# ... of keys whose grad comes as two arrays (a sync round's last pushes): of the compute dtype
TWO_GRADS = [('float32', 'float32', False), ('float64', 'float64', False),
             ('float16', 'float32', True), ('bfloat16', 'float32', False)]


def live_states(name, states, hyper):
    """The state names an update really gets (None for the rest)."""
    if name == 'rmsprop' and not hyper.get('centered'):
        return ['var']
    live = [s for s in states if s != 'mom' or hyper.get('momentum', 1.0) != 0.0]
    return [s for s in live if s != 'cum' or hyper.get('batch_scale', 1) > 1]


def state_dtype(name, wdt, mp):
    return 'float32' if mp or (name in FP32_STATES and wdt in ('float16', 'bfloat16')) else wdt


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


def uploaded(host):
    """cupy.asarray of a host array: a DeviceLike that keeps a copy of what was sent."""
    out = DeviceLike(np.shape(host), np.asarray(host).dtype)
    out.host = np.array(host, copy=True)
    return out


STREAM = types.SimpleNamespace(ptr=0)   # the current stream's handle; a test may set another


def current_stream():
    """cupy.cuda.get_current_stream(): a Stream object with the current handle."""
    return types.SimpleNamespace(ptr=STREAM.ptr)


FAKE_CUPY = types.SimpleNamespace(
    empty=DeviceLike, zeros=DeviceLike, float64=np.float64, uint32=np.uint32,
    asarray=uploaded, ascontiguousarray=lambda a: DeviceLike(a.shape, a.dtype),
    cuda=types.SimpleNamespace(get_current_stream=current_stream))


class Recorder:
    """A compiled kernel that records its launches: (kernel name, grid, block, args)."""

    def __init__(self, name, log):
        self.name, self.log = name, log

    def __call__(self, grid, block, args):
        self.log.append((self.name, grid, block, args))


def recording(monkeypatch):
    """cuda_launch on FAKE_CUPY, launches recorded instead of run; returns the record."""
    record = []
    monkeypatch.setattr(L, 'cupy', lambda: FAKE_CUPY)
    monkeypatch.setattr(L, 'compiled', lambda code, name: Recorder(name, record))
    monkeypatch.setattr(L, '_KERNELS', {})
    monkeypatch.setattr(STREAM, 'ptr', 0)
    return record


@pytest.fixture
def launches(monkeypatch):
    return recording(monkeypatch)


def call(name, states, hyper, wdt, gdt, mp, n=1000, grads=1):
    """(fn name, args, kwargs) of one update on stand-in device arrays (``grads``: 2, the
    grad a tuple of two arrays)."""
    weight = DeviceLike(n, storage(wdt))
    grad = tuple(DeviceLike(n, storage(gdt)) for _ in range(grads))
    grad = grad if grads > 1 else grad[0]
    sdt = storage(state_dtype(name, wdt, mp))
    live = live_states(name, states, hyper)
    args = (weight, grad, *[DeviceLike(n, sdt) if s in live else None for s in states])
    kwargs = dict(BASE, **hyper, weight32=DeviceLike(n, 'float32') if mp else None)
    if name in NEEDS_T:
        kwargs['t'] = 3
    return name + '_update', args, kwargs


def plan_of(name, args, kwargs):
    return L.plan_of(L.describe(getattr(C, name), args, kwargs))


def every_plan():
    """The plan of every rule and hyper-parameter case in every dtype combination, with one
    grad and with two."""
    return [plan_of(*call(*case[:3], *dtypes, grads=grads)) for case in CASES
            for grads, combos in ((1, DTYPES), (2, TWO_GRADS)) for dtypes in combos]



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
    options = [b'--gpu-architecture=compute_75', *(o.encode() for o in L.OPTIONS)]
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
def test_every_update_kernel_compiles_in_each_layout():
    sources = {}
    for plan in every_plan():
        sources.update(src.kernels_of(plan))
    assert len(sources) > 150            # every rule x dtype combination, each layout
    lamb = [name for name in sources if name.startswith('kvps_lamb_')]
    assert lamb and all(name.endswith(('_multi_pass1', '_multi_pass2')) for name in lamb)
    for name, code in sources.items():
        assert f'void {name}(' in code
        assert compile_errors(code) == '', name


@needs_nvrtc
@pytest.mark.parametrize('ilp', [1, 4])
def test_every_rule_compiles_loading_one_or_four_elements_a_thread_at_once(monkeypatch, ilp):
    """Every rule's loop compiles as kvps builds it (4 elements a thread) and as bench_kernels
    --ilp 1 does (cuda_source.FORCED_ILP): float32, float16 with a master copy, a grad of two
    arrays."""
    monkeypatch.setattr(src, 'FORCED_ILP', None if ilp == src.ILP else ilp)
    sources = {}
    for case in CASES:
        for grads, dtypes in ((1, DTYPES[0]), (1, DTYPES[4]), (2, TWO_GRADS[2])):
            sources.update(src.kernels_of(plan_of(*call(*case[:3], *dtypes, grads=grads))))
    for name, code in sources.items():
        assert ('kv_at += 4 * kv_stride' in code) == (ilp == 4), name
        assert compile_errors(code) == '', name


@needs_nvrtc
def test_a_broken_kernel_is_reported():
    assert 'error' in compile_errors('extern "C" __global__ void k() { undefined_name; }')


# -- planning and multi-tensor apply ----------------------------------------------------------
def sgd(n, dtype='float32'):
    return call('sgd', ['mom'], dict(momentum=0.9), dtype, dtype, False, n)


def test_keys_of_one_kernel_share_one_launch_whatever_their_sizes(launches):
    sizes = (1, 100, 5000, (1 << 16) + 1, 1 << 20)
    alone = call('adam', ['mean', 'var'], {}, 'float32', 'float32', False, 10)
    lamb = call('lamb', ['mean', 'var'], {}, 'float32', 'float32', False, 10)
    C.multi_update([sgd(n) for n in sizes] + [alone, lamb])
    names = [name for name, *_ in launches]
    assert names == ['kvps_sgd_mom_f32_f32_f32_f32_multi', 'kvps_adam_f32_f32_f32_f32_f32',
                     'kvps_lamb_f32_f32_f32_f32_f32_multi_pass1',
                     'kvps_lamb_f32_f32_f32_f32_f32_multi_pass2']
    assert launches[0][1] == (sum(src.blocks_for(n) for n in sizes),)
    assert launches[1][1] == (1,) and launches[1][3][0] == 10     # by value: n first
    assert launches[2][3] == launches[3][3]     # LAMB's passes: one table, one scratch


def test_a_key_met_twice_waits_for_the_launch_before(launches):
    first, other = sgd(10), sgd(20)
    again = (first[0], first[1], dict(first[2], lr=0.5))
    C.multi_update([first, other, again])
    assert [name.endswith('_multi') for name, *_ in launches] == [True, False]
    plan = plan_of(*again)
    lr = 1 + len(plan.arrays) + [s[0] for s in plan.scalars].index('lr')
    assert launches[1][3][lr] == np.float32(0.5)


def test_the_table_matches_what_the_source_reads(launches):
    sizes = (7, 3000, 70000)
    calls = [call('adam', ['mean', 'var'], {}, 'float16', 'float16', True, n) for n in sizes]
    calls[1][2]['lr'] = 0.25
    C.multi_update(calls)
    (name, grid, block, (table, nkeys)), = launches
    plans = [plan_of(*c) for c in calls]
    rows_at, width, scalars_at, count, total = src.table_words(
        3, len(plans[0].arrays), len(plans[0].scalars))
    words = table.host
    assert len(words) == total and nkeys == 3 and block == (src.THREADS,)
    assert list(words[:4]) == list(np.cumsum([0] + [src.blocks_for(n) for n in sizes]))
    assert grid == (words[3],)
    code = src.source(plans[0], multi=True)
    rows = words[rows_at:scalars_at].reshape(3, width)
    scalars = words[scalars_at:].view(np.float64).reshape(3, count)
    for (_, args, kwargs), plan, row, scal in zip(calls, plans, rows, scalars):
        assert row[0] == plan.n
        for slot, (local, arr) in enumerate(plan.arrays, start=1):
            want = args[1] if local == 'g' else (arr if local != 'weight' else args[0])
            assert row[slot] == want.data.ptr
            assert f'p_{local}_ = ' in code
            assert f'row[{slot}]' in code.split(f'p_{local}_ = ')[1].split(';')[0]
        for slot, (local, value, _) in enumerate(plan.scalars):
            assert scal[slot] == value
            assert f's_{local} = (KC)sc[{slot}]' in code or f's_{local}' not in code
    assert scalars[1][0] == 0.25 and scalars[0][0] == BASE['lr']


def test_an_empty_key_launches_nothing(launches):
    C.sgd_update(*sgd(0)[1], **sgd(0)[2])
    C.multi_update([sgd(0), sgd(5)])
    assert [name for name, *_ in launches] == ['kvps_sgd_mom_f32_f32_f32_f32']


def test_every_call_is_checked_before_anything_is_launched(launches):
    bad = sgd(5)
    bad = (bad[0], (bad[1][0], DeviceLike(6, 'float32'), bad[1][2]), bad[2])
    with pytest.raises(ShapeError, match='grad has shape'):
        C.multi_update([sgd(5), sgd(7), bad])
    assert launches == []
