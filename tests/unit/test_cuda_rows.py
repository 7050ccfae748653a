"""GroupAdaGrad's CUDA kernel (cuda_rows) without a GPU: every dtype variant compiles with NVRTC,
and run on the CPU under g++ (one emulated thread walking the rows) it gives numpy_rows' bits,
through cuda_kernels.multi_update as the Updater calls it, with the grad as one array or two
(a sync round's last pushes). On a GPU (`gpu`), the same through the Updater, dense and by
rows."""

import numpy as np
import pytest
import test_cuda_emulated as E
from test_cuda_emulated import _gxx_has_float16, on_host
from test_cuda_source import compile_errors, needs_nvrtc

from kvps.optimizer import create
from kvps.optimizer.kernels import cuda_kernels as C, cuda_rows as CR, numpy_kernels as K
from kvps.optimizer.updater import Updater

# (compute, master weight, grad, history, low-precision weight under a master) storage names
emulated = E.emulated   # (the fixture, run on this module's library)
VARIANTS = [('float32', 'float32', 'float32', 'float32', None),
            ('float64', 'float64', 'float64', 'float64', None),
            ('float32', 'float16', 'float16', 'float32', None),
            ('float32', 'uint16', 'uint16', 'float32', None),
            ('float32', 'float32', 'float16', 'float32', 'float16'),
            ('float32', 'float32', 'uint16', 'float32', 'uint16')]
# ... and the kernel's arrays per grad: two (a sync round's last pushes), of the compute dtype
TWO = [('float32', 'float32', 'float32', 'float32', None, 2),
       ('float64', 'float64', 'float64', 'float64', None, 2),
       ('float32', 'float16', 'float32', 'float32', None, 2),
       ('float32', 'float32', 'float32', 'float32', 'uint16', 2)]
SCALARS = dict(lr=0.1, wd=0.0, rescale_grad=0.5, clip_gradient=0.8, epsilon=1e-3)
ROWS, WIDTH = 37, 11


@needs_nvrtc
@pytest.mark.parametrize('variant', VARIANTS + TWO, ids=lambda v: CR.kernel_name(*v))
def test_every_variant_compiles(variant):
    code = CR.source(*variant)
    assert f'void {CR.kernel_name(*variant)}(' in code
    assert compile_errors(code) == ''


@pytest.fixture(scope='module')
def library(tmp_path_factory):
    if not _gxx_has_float16():
        pytest.skip('needs g++ with _Float16')
    return E.build(tmp_path_factory.mktemp('cuda_rows'),   # (test_cuda_emulated's emulated
                   [CR.definition(*v) for v in VARIANTS + TWO])   # runs it)


def _arrays(variant, rng):
    """(weight, master or None, three rounds' grads, history); a variant of two grads gets
    pairs."""
    _, w, g, history, low, *grads = variant
    def made(dtype, scale=1.0):
        x = rng.standard_normal(ROWS * WIDTH) * scale
        return K.f32_to_bf16(x.astype(np.float32)) if dtype == 'uint16' else x.astype(dtype)
    weight = made(low or w)
    master = None if low is None else (K.bf16_to_f32(weight) if low == 'uint16'
                                       else weight.astype(np.float32))
    rounds = [made(g, 1.5) if not grads else (made(g, 1.5), made(g)) for _ in range(3)]
    return weight, master, rounds, np.zeros(ROWS, history)


@pytest.mark.parametrize('variant', VARIANTS + TWO, ids=lambda v: CR.kernel_name(*v))
def test_the_kernel_gives_numpys_bits(emulated, variant):
    rng = np.random.default_rng(5)
    weight, master, grads, history = _arrays(variant, rng)
    mine = [a if a is None else a.copy() for a in (weight, master, history)]
    dev = [a if a is None else on_host(a.copy()) for a in (weight, master, history)]
    for g in grads:
        two = type(g) is tuple
        K.group_adagrad_update(mine[0], g if two else g.copy(), mine[2], **SCALARS,
                               weight32=mine[1])
        C.multi_update([('group_adagrad_update', (dev[0], tuple(map(on_host, g)) if two
                                                  else on_host(g), dev[2]),
                         dict(SCALARS, weight32=dev[1]))])
    assert emulated == [CR.kernel_name(*variant)] * len(grads)
    for got, want in zip(dev, mine):
        if want is not None:
            np.testing.assert_array_equal(np.asarray(got), want)
    assert not np.array_equal(mine[0], weight)


def test_clip_and_rescale_off_give_numpys_bits(emulated):
    rng = np.random.default_rng(6)
    weight, _, grads, history = _arrays(VARIANTS[0], rng)
    plain = dict(SCALARS, rescale_grad=1.0, clip_gradient=None)
    mine, dev, hist = weight.copy(), on_host(weight.copy()), on_host(history.copy())
    for g in grads:
        K.group_adagrad_update(mine, g.copy(), history, **plain)
        CR.group_adagrad_update(dev, on_host(g), hist, **plain)
    np.testing.assert_array_equal(np.asarray(dev), mine)
    np.testing.assert_array_equal(np.asarray(hist), history)


@pytest.mark.gpu
@pytest.mark.parametrize('dtype,mp', [(np.float32, False), (np.float64, False),
                                      (np.float16, True), (np.float16, False)])
def test_on_a_gpu_the_updater_gives_the_hosts_bits(dtype, mp):
    cp = pytest.importorskip('cupy')
    try:
        if cp.cuda.runtime.getDeviceCount() == 0:
            pytest.skip('no CUDA device')
    except Exception:  # no driver
        pytest.skip('no CUDA device')
    rng = np.random.default_rng(7)
    shape = (ROWS, WIDTH)
    host = rng.standard_normal(ROWS * WIDTH).astype(dtype)
    device = cp.asarray(host)
    updaters = [Updater(create('groupadagrad', learning_rate=0.1, rescale_grad=0.5,
                               clip_gradient=0.8, multi_precision=mp),
                        lambda key, part: shape) for _ in range(2)]
    for step in range(4):
        grad = (rng.standard_normal(ROWS * WIDTH) * 1.5).astype(dtype)
        if step % 2:
            ids = np.array([1, 5, 30])
            rows = grad.reshape(shape)[ids]
            updaters[0].update_rows('w', 0, host, ids, rows.copy(), WIDTH)
            updaters[1].update_rows('w', 0, device, ids, cp.asarray(rows), WIDTH)
        else:
            updaters[0].update('w', host, grad.copy())
            updaters[1].update('w', device, cp.asarray(grad))
    np.testing.assert_array_equal(cp.asnumpy(device), host)
