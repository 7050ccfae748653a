"""BytePS's scaled onebit codec: each element travels as its sign times one scale per part.

``{'type': '1bit'}``: the scale of a part (the worker's push to one server) is the mean of
|x| over the residual (kvps.compression.common) of that part, as BytePS's onebit compressor
with its default scaling (sum |x| / len over the tensor it is given; BytePS gives it one
partition). An element whose sign bit is set (negative, -0.0 and NaNs with the bit included)
travels as -scale, every other as +scale; error feedback keeps the difference, as BytePS's
error-feedback wrapper does. MXNet master's '1bit' is the unscaled form (+-1 against a
threshold); with error feedback the scale is what makes steps of a gradient's size.

Payload of one part of n elements (wire kind '1bit', ``nbytes`` 4 + ceil(n / 8)): the scale
as a little-endian float32, then one bit per element, element i in bit i%8 of byte i//8, 1 for
-scale (the bits after the last element are 0). For float16 and bfloat16 keys the scale is
first rounded to the key's dtype (float16: at most 65504), so the residual keeps exactly what
was not sent. A scale below 0 is refused; NaN and inf (a gradient's) travel as they are.
"""

import math

import numpy as np

from ..wire.codecs import ONE_BIT
from ..wire.protocol import nbytes
from .common import ErrorFeedback, header_scalar, held, payload_bytes, table_decode


class OneBit(ErrorFeedback):
    """One store's 1-bit codec: the residuals only."""

    name = ONE_BIT

    def _quantize(self, residual, kind, out):
        n = residual.size
        # numpy sums float32 pairwise: ~1e-7 log2(n) relative, as good as BytePS's double sum
        mean = float(np.abs(residual).sum()) / n if n else 0.0
        scale = held(mean, kind)
        out[:4] = np.frombuffer(np.array(scale, '<f4').tobytes(), np.uint8)
        out[4:] = np.packbits(np.signbit(residual), bitorder='little')
        np.subtract(residual, np.copysign(residual.dtype.type(scale), residual), out=residual)

    @staticmethod
    def decode(payload, n, dtype):
        """The gradient a '1bit' ``payload`` of ``n`` elements carries, as a new ``dtype``
        array; ProtocolError for a payload of the wrong size or with a negative scale."""
        raw = payload_bytes(ONE_BIT, payload, nbytes(ONE_BIT, n), n)
        scale = header_scalar(ONE_BIT, raw, 'scale', lambda v: v >= 0 or math.isnan(v),
                              '>= 0 (or a NaN)')
        bits = np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1,
                             bitorder='little')
        table = np.where(bits.astype(bool), np.float32(-scale), np.float32(scale))
        return table_decode(table, raw[4:], n, dtype)
