"""The fp16, bf16, 1bit and topk codecs: exact round trips where the arithmetic is exact, error
feedback that loses nothing, their payloads' bytes, and the server's refusal of malformed ones
(test_compression.py holds MXNet's 2bit and the parameters)."""

import numpy as np
import pytest

from kvps import compression
from kvps.compression.topk import _exact, largest
from kvps.errors import ProtocolError
from kvps.optimizer.kernels.common import bf16_to_f32, f32_to_bf16
from kvps.wire import protocol as P

TYPES = [{'type': 'fp16'}, {'type': 'bf16'}, {'type': '1bit'}, {'type': 'topk', 'ratio': 0.1}]
NAMES = [t['type'] for t in TYPES]


def codec_of(kind, **more):
    params = next(t for t in TYPES if t['type'] == kind)
    return compression.parse({**params, **more}).push


def storage(values, dtype):
    """``values`` in a ``dtype`` key's storage (bfloat16 as its bits)."""
    values = np.asarray(values, np.float32 if dtype == 'bfloat16' else dtype)
    return f32_to_bf16(values) if dtype == 'bfloat16' else values


def wide(array):
    """A key's storage as float64 (bfloat16 bits widened)."""
    return (bf16_to_f32(array) if array.dtype == np.uint16 else array).astype(np.float64)


def sent(codec, grad, key='k', part=0):
    """(payload, what the server decodes) of one push of ``grad``."""
    dtype = 'bfloat16' if grad.dtype == np.uint16 else grad.dtype.name
    out = np.empty(codec.nbytes(grad.size, dtype), np.uint8)
    payload = codec.encode(key, part, grad, out)
    assert payload is out
    return payload, compression.decode(codec.name, memoryview(payload), grad.size, dtype)


# -- exact round trips --------------------------------------------------------------------------
@pytest.mark.parametrize('kind, values', [
    ('fp16', [0.0, 1.0, -2.5, 65504.0, -65504.0, 2.0 ** -24, 1000.5, 3.0 / 1024]),
    ('bf16', [0.0, 1.0, -2.5, 2.0 ** 100, -(2.0 ** -100), 3.0, 1.0 + 2 ** -7]),
    ('1bit', [0.75, -0.25, -0.25, 0.75, 0.75, 0.75, -0.25, 0.75, -0.25]),
    ('topk', [0.0] * 30 + [5.0, 0.0, -2.0] + [0.0] * 7),   # 3 of 40 are non-zero, k = 4
])
@pytest.mark.parametrize('dtype', ['float32', 'float64'])
def test_values_the_codec_can_carry_arrive_exactly_and_leave_no_residual(kind, values, dtype):
    codec = codec_of(kind)
    grad = np.array(values, dtype)
    _, got = sent(codec, grad)
    assert got.dtype == grad.dtype and got.tolist() == grad.tolist()
    assert not codec._residuals[('k', 0)].any()


def test_topk_with_ratio_1_is_exact_for_any_values():
    codec = compression.parse({'type': 'topk', 'ratio': 1}).push
    grad = np.random.default_rng(0).standard_normal(33).astype(np.float32)
    assert sent(codec, grad)[1].tolist() == grad.tolist()


@pytest.mark.parametrize('kind', ['fp16', 'bf16'])
def test_a_half_push_sends_the_rounding_of_the_residual_and_keeps_the_rest(kind):
    half = np.float16 if kind == 'fp16' else None
    codec = codec_of(kind)
    third = np.float32(1 / 3)
    _, got = sent(codec, np.array([third], np.float32))
    want = np.float32(half(third)) if half else bf16_to_f32(f32_to_bf16(np.array([third])))[0]
    assert got.tolist() == [want] and want != third
    assert codec._residuals[('k', 0)].tolist() == [third - want]   # sent with the next push


def test_fp16_sends_what_is_beyond_its_range_as_the_largest_half_and_holds_the_rest():
    codec = codec_of('fp16')
    _, got = sent(codec, np.array([70000.0, -1e9, 1.0], np.float32))
    assert got.tolist() == [65504.0, -65504.0, 1.0]
    held = np.float32([70000, -1e9]) - np.float32([65504, -65504])
    assert codec._residuals[('k', 0)].tolist() == [*held.tolist(), 0.0]


# -- error feedback -------------------------------------------------------------------------------
def dyadic(rng, n, step):
    """Values on a grid of ``step`` below 4 in magnitude: their sums stay exact in float32."""
    return (rng.integers(-4 / step, 4 / step, n) * step).astype(np.float32)


@pytest.mark.parametrize('kind, step', [('fp16', 2.0 ** -20), ('bf16', 2.0 ** -20),
                                        ('1bit', 2.0 ** -12), ('topk', 2.0 ** -16)])
@pytest.mark.parametrize('dtype', ['float32', 'float64'])
def test_error_feedback_loses_nothing_over_many_pushes_exactly(kind, step, dtype):
    """What was sent plus what is held equals what was pushed, to the last bit: on this grid
    every sum the codec and the server make is exact (1bit's scales, means, travel rounded to
    bfloat16, and the residual takes off exactly those)."""
    rng = np.random.default_rng(7)
    codec = codec_of(kind)
    grads = [dyadic(rng, 500, step).astype(dtype) for _ in range(60)]
    total = sum(wide(sent(codec, g)[1]) for g in grads)
    held = codec._residuals[('k', 0)]
    assert held.any()                                  # something is held back...
    np.testing.assert_array_equal(total + held, sum(g.astype(np.float64) for g in grads))


@pytest.mark.parametrize('dtype, tolerance', [('float32', 2e-5), ('float64', 1e-12)])
def test_1bit_error_feedback_loses_nothing_to_the_precision_of_the_residual(dtype, tolerance):
    """A 1bit scale (a mean) is not on the gradients' grid, so each subtraction from the
    residual rounds once: within ``tolerance`` of every element's pushed sum (|sum| ~ 10)."""
    rng = np.random.default_rng(3)
    codec = codec_of('1bit')
    grads = [rng.standard_normal(500).astype(dtype) for _ in range(60)]
    total = sum(wide(sent(codec, g)[1]) for g in grads)
    held = codec._residuals[('k', 0)]
    np.testing.assert_allclose(total + held, sum(g.astype(np.float64) for g in grads),
                               rtol=0, atol=tolerance)


@pytest.mark.parametrize('kind', NAMES)
@pytest.mark.parametrize('dtype', ['float16', 'bfloat16'])
def test_low_precision_keys_hold_exactly_what_the_server_adds(kind, dtype):
    """The residual (float32) takes off what the server decodes into the key's dtype (a
    float16 key's topk values, a bfloat16 key's fp16 payload are rounded again there)."""
    rng = np.random.default_rng(11)
    codec = codec_of(kind)
    grads = [storage(dyadic(rng, 200, 2.0 ** -8), dtype) for _ in range(30)]
    got = [sent(codec, g)[1] for g in grads]
    assert all(g.dtype == grads[0].dtype for g in got)
    held = codec._residuals[('k', 0)].astype(np.float64)
    np.testing.assert_allclose(sum(wide(g) for g in got) + held, sum(wide(g) for g in grads),
                               rtol=0, atol=1e-5 if kind == '1bit' else 0)


def test_each_key_part_keeps_its_own_residual():
    codec = codec_of('topk', ratio=0.5)
    grad = np.array([1.0, 2.0], np.float32)
    assert sent(codec, grad, part=0)[1].tolist() == [0.0, 2.0]
    assert sent(codec, grad, part=1)[1].tolist() == [0.0, 2.0]
    assert sent(codec, grad, part=0)[1].tolist() == [2.0, 0.0]    # 1 + 1 held ties 0 + 2
    assert codec._residuals[('k', 0)].tolist() == [0.0, 2.0]
    assert codec._residuals[('k', 1)].tolist() == [1.0, 0.0]


# -- payloads, byte by byte -----------------------------------------------------------------------
def test_the_fp16_payload_is_n_little_endian_halves():
    codec = codec_of('fp16')
    grad = np.array([1.0, -2.5, 0.099975586], np.float32)
    payload, _ = sent(codec, grad)
    assert compression.nbytes('fp16', 3) == codec.nbytes(3, 'float32') == 6
    assert payload.tobytes() == np.array(grad, '<f2').tobytes() == bytes.fromhex('003c00c1662e')


def test_the_bf16_payload_is_the_upper_half_of_each_float32():
    codec = codec_of('bf16')
    payload, _ = sent(codec, np.array([1.0, -2.5, 2.0 ** 100], np.float32))
    assert compression.nbytes('bf16', 3) == 6
    assert payload.tobytes() == bytes.fromhex('803f20c08071')


def test_the_1bit_payload_is_the_chunk_then_two_scales_a_chunk_then_a_sign_bit_each():
    """Chunks of 4: [1, -3, 2, -2] travel as 1.5 (the mean of 1 and 2) and -2.5, [0, -1, 3,
    -1] as 1.5 and -1, [5] as 5 (no negative: q = 0); bit i % 8 of byte i // 8 is set for -q,
    the bits after the last element are 0."""
    codec = codec_of('1bit', chunk=4)
    grad = np.array([1, -3, 2, -2, 0, -1, 3, -1, 5], np.float32)
    payload, got = sent(codec, grad)
    assert codec.nbytes(9, 'float32') == 4 + 3 * 4 + 2
    scales = np.array([1.5, 2.5, 1.5, 1, 5, 0], '<f4').view('<u4') >> 16
    assert payload.tobytes() == (np.array(4, '<u4').tobytes() + scales.astype('<u2').tobytes()
                                 + bytes([0b10101010, 0]))
    assert got.tolist() == [1.5, -2.5, 1.5, -2.5, 1.5, -1, 1.5, -1, 5]
    assert codec._residuals[('k', 0)].tolist() == [-0.5, -0.5, 0.5, 0.5, -1.5, 0, 1.5, 0, 0]


def test_1bit_scales_are_rounded_to_bfloat16_and_a_zero_chunk_sends_zeros():
    codec = codec_of('1bit', chunk=3)
    _, got = sent(codec, np.array([1.0, 0.0, 0.0, 0.0, 0.0, 0.0], np.float32))
    third = bf16_to_f32(f32_to_bf16(np.array([1 / 3], np.float32)))[0]   # the mean of 1, 0, 0
    assert got.tolist() == [third] * 3 + [0.0] * 3
    assert codec._residuals[('k', 0)].tolist() == [1 - third, -third, -third, 0, 0, 0]


@pytest.mark.parametrize('dtype, width', [('float32', '<f4'), ('float64', '<f8'),
                                          ('float16', '<f2')])
def test_the_topk_payload_is_k_then_increasing_indices_then_values_of_the_key(dtype, width):
    """k = ceil(0.25 * 8) = 2: |-4| first, then the tie of 3 and -3 goes to the lower index."""
    codec = codec_of('topk', ratio=0.25)
    grad = np.array([0.5, -4, 1, 3, -3, 0, 2, 0.25], dtype)
    payload, got = sent(codec, grad)
    size = np.dtype(dtype).itemsize
    assert codec.nbytes(8, dtype) == len(payload) == 4 + 2 * (4 + size)
    assert payload.tobytes() == (np.array(2, '<u4').tobytes() + np.array([1, 3], '<u4').tobytes()
                                 + np.array([-4, 3], width).tobytes())
    assert got.tolist() == [0, -4, 0, 3, 0, 0, 0, 0]


def test_topk_counts_k_per_part_rounding_up():
    codec = compression.parse({'type': 'topk', 'ratio': 0.1}).push
    assert [codec.count(n) for n in (0, 1, 9, 10, 11, 30, 1000)] == [0, 1, 1, 1, 2, 3, 100]
    assert compression.parse({'type': 'topk', 'ratio': 1}).push.count(7) == 7


def test_topk_takes_nans_first_then_magnitudes_then_the_lower_index():
    residual = np.array([1.0, np.nan, -2.0, 2.0, np.nan, 2.0], np.float32)
    assert largest(residual, 1).tolist() == [1]
    assert largest(residual, 3).tolist() == [1, 2, 4]
    assert largest(residual, 4).tolist() == [1, 2, 3, 4]
    assert largest(residual, 6).tolist() == list(range(6))



@pytest.mark.parametrize('shape', ['normal', 'ties', 'nan', 'sparse'])
def test_topk_of_a_big_part_finds_from_a_sample_what_a_full_partition_finds(shape):
    """From 2**16 elements candidates come from a sample's threshold; the choice must be
    the same, ties and NaNs included."""
    rng = np.random.default_rng(len(shape))
    x = rng.standard_normal(1 << 17).astype(np.float32)
    if shape == 'ties':
        x = np.round(x * 4) / 4
    elif shape == 'nan':
        x[rng.integers(0, x.size, 5)] = np.nan
    elif shape == 'sparse':
        x[:] = 0
        x[rng.integers(0, x.size, 300)] = 1.0
    for k in (1, 500, 2047):
        assert largest(x, k).tolist() == _exact(np.abs(x), k).tolist()

def test_the_wire_takes_every_kind_as_a_push_dtype_only():
    for kind, n, size in [('fp16', 5, 10), ('bf16', 5, 10), ('1bit', 18, 18), ('topk', 20, 20)]:
        push = {'op': P.PUSH, 'id': 1, 'sync': True, 'keys': [[0, 0, kind, n, None, 0]]}
        P.decode(P.encode(push, [bytes(size)]))
        with pytest.raises(ProtocolError, match=f'need {size}'):
            P.decode(P.encode(push, [bytes(size + 1)]))
        with pytest.raises(ProtocolError, match='dtype'):
            P.validate_header({'op': P.INIT, 'id': 1, 'sync': True,
                               'keys': [[0, 0, kind, n, [n]]]})


@pytest.mark.parametrize('codec, ok', [('fp16', True), ('bf16', True), ('2bit', False),
                                       ('float16', False), (16, False), (['fp16'], False)])
def test_a_pull_may_ask_for_a_16_bit_answer_only(codec, ok):
    pull = {'op': P.PULL, 'id': 1, 'keys': [[0, 0, None]], 'codec': codec}
    if ok:
        P.validate_header(pull)
    else:
        with pytest.raises(ProtocolError, match='codec must be one of fp16, bf16'):
            P.validate_header(pull)


# -- malformed payloads ---------------------------------------------------------------------------
def u32(value):
    return np.array(value, '<u4').tobytes()


def bf16(*values):
    return f32_to_bf16(np.array(values, np.float32)).astype('<u2').tobytes()


@pytest.mark.parametrize('kind, payload, n, message', [
    ('fp16', bytes(9), 5, 'fp16 payload of 9 bytes for 5 elements; expected 10'),
    ('bf16', bytes(12), 5, 'bf16 payload of 12 bytes for 5 elements; expected 10'),
    ('1bit', b'\x01', 9, r'1bit payload of 1 bytes for 9 elements.*\(chunk = 0\)'),
    ('1bit', u32(0) + bytes(6), 9, r'with a chunk >= 1 \(chunk = 0\)'),
    ('1bit', u32(8) + bytes(9), 9, r'of 13 bytes for 9 elements: it must be 4 \+ 4 \* ceil'),
    ('1bit', u32(16) + bf16(1.0, -1.0) + bytes(2), 9, 'a scale below 0'),
    ('1bit', u32(16) + bf16(-np.inf, 1.0) + bytes(2), 9, 'a scale below 0'),
    ('topk', b'', 5, 'topk payload of 0 bytes'),
    ('topk', b'\x01\x00', 5, 'topk payload of 2 bytes'),
    ('topk', np.array([1, 0], '<u4').tobytes(), 5, r'4 \+ k \* 8 bytes with k <= 5 \(k = 1\)'),
    ('topk', np.array([6, *range(6)], '<u4').tobytes() + bytes(24), 5, 'k <= 5'),
    ('topk', np.array([2, 3, 3], '<u4').tobytes() + bytes(8), 5, 'out of order or range'),
    ('topk', np.array([2, 3, 1], '<u4').tobytes() + bytes(8), 5, 'out of order or range'),
    ('topk', np.array([1, 5], '<u4').tobytes() + bytes(4), 5, 'out of order or range'),
])
def test_the_server_refuses_malformed_payloads(kind, payload, n, message):
    with pytest.raises(ProtocolError, match=message):
        compression.decode(kind, payload, n, 'float32')


def test_a_1bit_scale_may_carry_a_gradients_nan_or_inf():
    nan = compression.decode('1bit', u32(2) + bf16(np.nan, np.nan) + b'\x01', 2, 'float32')
    assert np.isnan(nan).all()
    assert compression.decode('1bit', u32(2) + bf16(np.inf, np.inf) + b'\x01', 2,
                              'float32').tolist() == [-np.inf, np.inf]
