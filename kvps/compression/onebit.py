"""The 1-bit codec: each element travels as its sign bit, and a chunk's scale for that sign.

``{'type': '1bit', 'chunk': c}`` (c >= 1, default 64): the residual (kvps.compression.common)
of each part is cut into chunks of c elements (the last may be shorter). In a chunk, an
element whose sign bit is clear travels as p, the mean of those elements, one whose sign bit
is set (negative, -0.0, NaNs with the bit) as -q, q the mean of their magnitudes: the two
values 1-bit SGD (Seide et al., CNTK) sends per column. Error feedback keeps the difference,
as BytePS's error-feedback wrapper does.

BytePS's onebit sends one scale, the mean |x| over the whole part, and MXNet master's '1bit'
sends +-1 against a threshold. Measured on examples/train_digits.py (4 workers, server SGD
with momentum, test accuracy over 5 seeds, 96.8 % uncompressed), one scale per part trains
to about 50 %, one per 64 elements to 95.3 %, and two per 64 elements to 97.0 %: a chunk
whose gradients are all zero (a unit that did not fire) then sends zeros, and the others
lose little. With bfloat16 scales that is 1.5 bits an element (21x fewer bytes than float32);
a bigger chunk sends fewer scales.

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
        starts = np.arange(0, n, chunk)
        negative = np.signbit(residual)
        count = np.add.reduceat(negative.view(np.uint8), starts, dtype=np.int64) \
            if n else np.zeros(0, np.int64)
        sizes = np.minimum(starts + chunk, n) - starts
        scales = np.empty((starts.size, 2), np.float32)
        if n:   # (abs: no -0.0 scale, whatever the sums of zeros)
            scales[:, 0] = np.abs(np.add.reduceat(np.maximum(residual, 0), starts)) / \
                np.maximum(sizes - count, 1)
            scales[:, 1] = np.abs(np.add.reduceat(np.minimum(residual, 0), starts)) / \
                np.maximum(count, 1)
        if kind == 'float16':
            np.minimum(scales, FP16_SCALE_MAX, out=scales)
        m = starts.size
        out[:4] = np.frombuffer(np.array(chunk, '<u4').tobytes(), np.uint8)
        out[4:4 + 4 * m] = f32_to_bf16(scales).reshape(-1).view(np.uint8)
        out[4 + 4 * m:] = np.packbits(negative, bitorder='little')
        self._take_off_sent(residual, out, kind)

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
        bits = np.unpackbits(raw[4 + 4 * m:], count=n, bitorder='little').view(bool)
        values = np.empty(n, np.float32)
        whole = n // chunk * chunk
        np.copyto(values[:whole].reshape(-1, chunk), scales[:whole // chunk, :1])
        np.copyto(values[:whole].reshape(-1, chunk), -scales[:whole // chunk, 1:],
                  where=bits[:whole].reshape(-1, chunk))
        if whole < n:
            values[whole:] = np.where(bits[whole:], -scales[-1, 1], scales[-1, 0])
        return in_key_dtype(values, dtype)


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

