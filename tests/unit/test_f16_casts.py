"""float16 casts through torch give numpy's values bit for bit, and never warn."""

import subprocess
import sys

import numpy as np
import pytest

from kvps.compression import f16


@pytest.fixture(autouse=True, params=['numpy', 'torch'])
def path(request):
    """Each test through numpy's casts (torch still loading) and through torch's."""
    if request.param == 'torch':
        f16._torch_module()
        f16._STATE['thread'].join(120)
        assert f16._STATE['torch'] is not None
        yield
    else:
        saved = dict(f16._STATE)
        f16._STATE.clear()
        f16._STATE['thread'] = None   # as while the import runs: torch not there yet
        yield
        f16._STATE.clear()
        f16._STATE.update(saved)


def same(a, b):
    """Bit for bit, except that any NaN equals any NaN (payload bits may differ)."""
    bits = f'u{a.itemsize}'
    return bool(np.all((a.view(bits) == b.view(bits)) | (np.isnan(a) & np.isnan(b))))


def test_float32_to_float16_rounds_every_kind_of_value_as_numpy():
    # a stride through every float32 bit pattern, and the edges of float16's range
    spread = np.arange(0, 1 << 32, 7919, dtype=np.uint64).astype(np.uint32).view(np.float32)
    edges = np.float32([65504, 65519.99, 65520, -65520, 6e-8, 2.98e-8, 2.9e-8, np.inf, np.nan])
    values = np.concatenate([spread, edges])
    with np.errstate(over='ignore', invalid='ignore'):
        assert same(f16.astype(values, np.dtype(np.float16)), values.astype(np.float16))


@pytest.mark.parametrize('wide', [np.float32, np.float64])
def test_float16_widens_exactly(wide):
    every = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16)
    assert same(f16.astype(every, np.dtype(wide)), every.astype(wide))


def test_float64_rounds_once_as_numpy_does():
    # torch would round these through float32 first: -890.74998 to -890.75, then to -891
    values = np.array([-890.74998212, -623.250016, 645.74998631] * 2000)
    assert same(f16.astype(values, np.dtype(np.float16)), values.astype(np.float16))


def test_a_read_only_payload_casts_without_a_warning():
    # a fresh process with warnings as errors: torch warns once a process, on the first
    # read-only array it is given (received payloads are read-only)
    code = ('import numpy as np; from kvps.compression import f16; '
            'f16._torch_module(); f16._STATE["thread"].join(); '
            'p = np.frombuffer(np.ones(10000, np.float16).tobytes(), np.float16); '
            'out = f16.cast_into(np.empty(p.size, np.float32), p); assert (out == 1).all()')
    subprocess.run([sys.executable, '-W', 'error', '-c', code], check=True, timeout=120)


@pytest.mark.parametrize('dtype', [np.float32, np.float16])
def test_the_fp16_codec_sends_and_keeps_the_same_bits_either_way(dtype):
    """The codec's encode (add to the residual, clip to +-65504, round, take what is sent off
    the residual) in torch's passes gives numpy's payload and residual bit for bit, NaN, inf,
    values past float16's range and blocks whose float16 sum overflows included, over pushes
    that carry residuals on."""
    from kvps.compression.half import Float16
    rng = np.random.default_rng(7)
    with np.errstate(over='ignore'):
        grads = [(rng.standard_normal(3 * f16.SMALL) * scale).astype(dtype)
                 for scale in (1e-3, 1.0, 3e4, 1e6)]
    grads[2][:4] = [np.inf, -np.inf, np.nan, 65519.0]
    grads[0][:3] = [65510.0, -65519.9, 65504.5]   # past the largest float16, rounding to it
    grads.append(np.full(3 * f16.SMALL, 4.0, dtype))   # each value in range, the sum not
    codec, residual = Float16(), np.zeros(grads[0].size, np.float32)
    for grad in grads:
        out = np.empty(2 * grad.size, np.uint8)
        with np.errstate(invalid='ignore', over='ignore'):   # (float16 grads of 1e6 are inf)
            codec.encode('k', 0, grad, out)
            residual += grad
            expected = np.clip(residual, -65504, 65504).astype(np.float16)
            residual -= expected.astype(np.float32)
        assert same(out.view(np.float16), expected)
        assert same(codec._residuals['k', 0], residual)


def test_a_process_that_exits_while_torch_loads_ends_cleanly():
    # a daemon thread still importing torch as the process finalizes can abort it (C++
    # frames unwound by pthread_exit): the exit waits for the import, and the process ends
    # with its own code, saying nothing
    code = ('import atexit, os; from kvps.compression import f16; '
            'atexit.register(lambda: os.write(1, b"alive" if f16._STATE["thread"].is_alive() '
            'else b"ended")); f16.prepare()')
    run = subprocess.run([sys.executable, '-c', code], capture_output=True, timeout=120)
    assert (run.returncode, run.stdout, run.stderr) == (0, b'ended', b'')
