"""The 1-bit codec: each element travels as its sign bit, and a chunk's scale for that sign.

``{'type': '1bit', 'chunk': c}`` (c >= 1, default 64): the residual (kvps.compression.common)
of each part is cut into chunks of c elements (the last may be shorter). In a chunk, an
element whose sign bit is clear travels as p, the mean of those elements, one whose sign bit
is set (negative, -0.0, NaNs with the bit) as -q, q the mean of their magnitudes: the two
values 1-bit SGD (Seide et al., CNTK) sends per column. Error feedback keeps the difference,
as BytePS's error-feedback wrapper does.

BytePS's onebit sends one scale, the mean |x| over the whole part, and MXNet master's '1bit'
sends +-1 against a threshold. On examples/train_digits.py's task (benchmarks/
bench_codec_training.py: 4 workers, server SGD with momentum, mean test accuracy over 5 seeds,
96.7 % uncompressed) one scale per part trains to about 70 % (runs differ widely), one per 64
elements to 96.1 %, two per 64 elements to 96.5 %: a chunk whose gradients are all zero (a
unit that did not fire) then sends zeros, and the others lose little. With bfloat16 scales
that is 1.5 bits an element (21x fewer bytes than float32); a bigger chunk sends fewer scales
(4096: 62 %).

Payload of one part of n elements (wire kind '1bit'; the push item's ``n`` counts its bytes,
4 + 4 * ceil(n / c) + ceil(n / 8)): c as a little-endian uint32; then per chunk p and q as
bfloat16 (little-endian uint16, the upper half of the float32); then one bit per element,
element i in bit i%8 of byte i//8, 1 for -q (the bits after the last element are 0). For
float16 keys the scales are at most 65280 (the largest bfloat16 a float16 holds). The server
refuses a chunk of 0, a size that does not match, and scales below 0 (NaN and inf, a
gradient's, travel as they are).
"""

import numpy as np

from ..errors import ProtocolError
from ..optimizer.kernels.common import bf16_to_f32, f32_to_bf16
from ..wire.codecs import ONE_BIT
from .common import ErrorFeedback, in_key_dtype

FP16_SCALE_MAX = np.float32(65280.0)   # the largest bfloat16 that float16 holds
MAX_CHUNK = 2 ** 32 - 1                # chunk travels as a uint32
BLOCK = 1 << 17                        # about how many elements are encoded at a time


class OneBit(ErrorFeedback):
    """One store's 1-bit codec: the chunk, and the residuals (ErrorFeedback)."""

    name = ONE_BIT

    def __init__(self, chunk, residuals=None):
        super().__init__(residuals)
        self.chunk = chunk

    def nbytes(self, n, dtype):
        return payload_nbytes(n, self.chunk)

    def _quantize(self, residual, kind, out):
        n, chunk = residual.size, self.chunk
        m = -(-n // chunk)
        out[:4] = np.frombuffer(np.array(chunk, '<u4').tobytes(), np.uint8)
        scales, bits = out[4:4 + 4 * m].view('<u2').reshape(m, 2), out[4 + 4 * m:]
        # block by block (whole chunks, a multiple of 8 elements): the temporaries stay small
        # and warm, where whole-part ones would cost a page fault every 4 KiB
        step = chunk * max(8, BLOCK // chunk // 8 * 8)
        for start in range(0, n, step):
            block = residual[start:start + step]
            negative = np.signbit(block)
            packed = np.packbits(negative, bitorder='little')
            bits[start // 8:start // 8 + packed.size] = packed
            held = scales[start // chunk:start // chunk + -(-block.size // chunk)]
            held[...] = f32_to_bf16(_scales(block, negative, packed, chunk, kind))
            # what the server decodes is taken off: exactly, whatever the roundings
            sent = _spread(negative, bf16_to_f32(held), chunk)
            np.subtract(block, in_key_dtype(sent, kind) if kind == 'float16' else sent, out=block)

    @staticmethod
    def decode(payload, n, dtype):
        """The gradient a '1bit' ``payload`` of ``n`` elements carries, as a new ``dtype``
        array; ProtocolError for a malformed payload."""
        raw = np.frombuffer(payload, np.uint8)
        chunk = int(raw[:4].view('<u4')[0]) if raw.size >= 4 else 0
        if chunk < 1 or raw.size != payload_nbytes(n, chunk):
            raise ProtocolError(f'1bit payload of {raw.size} bytes for {n} elements: it must '
                                'be 4 + 4 * ceil(n / chunk) + ceil(n / 8) bytes, with a chunk '
                                f'>= 1 (chunk = {chunk})')
        m = -(-n // chunk)
        scales = bf16_to_f32(raw[4:4 + 4 * m].view('<u2')).reshape(m, 2)
        if (scales < 0).any():
            raise ProtocolError('1bit payload with a scale below 0; they must be >= 0 (or a '
                                "gradient's NaN)")
        negative = np.unpackbits(raw[4 + 4 * m:], count=n, bitorder='little').view(bool)
        return in_key_dtype(_spread(negative, scales, chunk), dtype)


def _scales(block, negative, packed, chunk, kind):
    """(p, q) of each chunk of ``block``, float32 (float16 keys: at most FP16_SCALE_MAX)."""
    count = _negatives(negative, packed, chunk)
    sizes = np.full(count.size, chunk)
    sizes[-1] = block.size - (count.size - 1) * chunk
    scales = np.empty((count.size, 2), np.float32)
    # (abs: no -0.0 scale, whatever the sums of zeros)
    scales[:, 0] = np.abs(_sums(np.maximum(block, 0), chunk)) / np.maximum(sizes - count, 1)
    scales[:, 1] = np.abs(_sums(np.minimum(block, 0), chunk)) / np.maximum(count, 1)
    if kind == 'float16':
        np.minimum(scales, FP16_SCALE_MAX, out=scales)
    return scales


def _sums(values, chunk):
    """The sum of each chunk of ``values`` (the last one may be shorter)."""
    whole = values.size // chunk * chunk
    sums = np.einsum('ij->i', values[:whole].reshape(-1, chunk))   # (4-6x .sum(axis=1))
    return sums if whole == values.size else np.append(sums, values[whole:].sum())


def _negatives(negative, packed, chunk):
    """How many elements of each chunk have their sign bit set (``packed``: the bits)."""
    if chunk % 8:
        return np.add.reduceat(negative.view(np.uint8), np.arange(0, negative.size, chunk),
                               dtype=np.int64)
    per_byte = np.bitwise_count(packed)
    return np.add.reduceat(per_byte, np.arange(0, per_byte.size, chunk // 8), dtype=np.int64)


def _spread(negative, scales, chunk):
    """Each element's value, float32: its chunk's p, or -q where its sign bit is set. Chosen
    bit by bit (p's bits, flipped to -q's where the sign is set), so that inf and NaN scales
    stay what they are."""
    n = negative.size
    p = np.ascontiguousarray(scales[:, 0]).view(np.uint32)
    flip = p ^ np.ascontiguousarray(-scales[:, 1]).view(np.uint32)
    values = np.empty(n, np.uint32)
    full = n // chunk
    spread = values[:full * chunk].reshape(full, chunk)
    np.multiply(negative[:full * chunk].reshape(full, chunk), flip[:full, None], out=spread)
    np.bitwise_xor(spread, p[:full, None], out=spread)
    if full * chunk < n:
        values[full * chunk:] = np.where(negative[full * chunk:], flip[-1] ^ p[-1], p[-1])
    return values.view(np.float32)


def payload_nbytes(n, chunk):
    """Bytes of the '1bit' payload of ``n`` elements in chunks of ``chunk``."""
    return 4 + 4 * -(-n // chunk) + (n + 7) // 8


def checked_chunk(value):
    """The ``chunk`` parameter, or ValueError."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or \
            not 1 <= value <= MAX_CHUNK:
        raise ValueError(f'1bit compression needs a chunk (elements per pair of scales) that '
                         f'is an int from 1 to {MAX_CHUNK}, got {value!r}')
    return int(value)

