"""MXNet's 2-bit codec: each element travels as +threshold, -threshold or 0.

``{'type': '2bit', 'threshold': t}``: elements of the residual (kvps.compression.common) at or
above ``t`` travel as +t, at or below -t as -t, the rest as 0; what was not sent stays in the
residual for the next push.

Payload of one part of n elements (wire kind '2bit', ``nbytes`` 4 + ceil(n / 4)): the
threshold as a little-endian float32, then the codes, four per byte (element i in bits
2*(i%4) of byte i//4): 0 for 0, 2 for -t, 3 for +t (1 decodes to 0). For float16 and bfloat16
keys t is first rounded to the key's dtype (what the server will add), so the residual keeps
exactly what was not sent.
"""

import math

import numpy as np

from ..wire.codecs import TWO_BIT
from ..wire.protocol import nbytes
from .common import ErrorFeedback, header_scalar, held, payload_bytes, table_decode

_ZERO, _MINUS, _PLUS = 0, 2, 3


class TwoBit(ErrorFeedback):
    """One store's 2-bit codec: the threshold, and the residuals (ErrorFeedback)."""

    name = TWO_BIT

    def __init__(self, threshold, residuals=None):
        super().__init__(residuals)
        self.threshold = threshold

    def _quantize(self, residual, kind, out):
        t = sent_threshold(self.threshold, kind)
        wide = residual.dtype
        plus, minus = residual >= t, residual <= -t
        sign = plus.view(np.int8) - minus.view(np.int8)
        np.subtract(residual, np.multiply(sign, t, dtype=wide), out=residual)
        # codes (0, 2 = -t, 3 = +t) in bytes, then four bytes folded into one: element 4j+k
        # sits at bit 8k of little-endian word j and moves to bits 2k of byte j
        codes = np.zeros(-(-residual.size // 4) * 4, np.uint8)
        np.bitwise_or(plus, minus, out=codes[:residual.size].view(bool))
        codes <<= 1
        codes[:residual.size] |= plus.view(np.uint8)
        words = codes.view('<u4')
        out[:4] = np.frombuffer(np.array(t, '<f4').tobytes(), np.uint8)
        out[4:] = ((words & 3) | ((words >> 6) & 0xC) | ((words >> 12) & 0x30) |
                   ((words >> 18) & 0xC0))

    @staticmethod
    def decode(payload, n, dtype):
        """The gradient a '2bit' ``payload`` of ``n`` elements carries, as a new ``dtype``
        array; ProtocolError for a payload of the wrong size or with a bad threshold."""
        raw = payload_bytes(TWO_BIT, payload, nbytes(TWO_BIT, n), n)
        t = header_scalar(TWO_BIT, raw, 'threshold', lambda v: math.isfinite(v) and v > 0,
                          'finite and > 0')
        table = np.zeros((256, 4), np.float32)
        byte = np.arange(256)
        for slot in range(4):
            code = (byte >> (2 * slot)) & 3
            table[code == _PLUS, slot] = t
            table[code == _MINUS, slot] = -t
        return table_decode(table, raw[4:], n, dtype)


def sent_threshold(threshold, dtype):
    """``threshold`` as a server adds it to a ``dtype`` key, in float32: rounded to float16
    or bfloat16 for those keys, so the residual takes off exactly what was sent."""
    t = np.float32(threshold)
    if dtype == 'float16':
        t = np.float32(np.float16(t))   # (inf beyond float16's range: refused below)
    elif dtype == 'bfloat16':
        t = held(t, dtype)
    if not (math.isfinite(t) and t > 0):
        raise ValueError(f'2bit threshold {threshold!r} is {t} in a {dtype} key; choose one '
                         f'that {dtype} can hold')
    return t
