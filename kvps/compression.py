"""Gradient compression (MXNet's 2-bit scheme): quantize with error feedback on the worker, decode on the server.

``set_gradient_compression({'type': '2bit', 'threshold': t})``: before a push, each part of a
gradient is added to its residual (what earlier pushes did not send); elements at or above
``t`` travel as +t, at or below -t as -t, the rest as 0, and what was not sent stays in the
residual for the next push. Nothing is lost, only delayed. Pulls are not compressed.

Wire payload of one part of n elements (protocol dtype '2bit'): the threshold as a
little-endian float32, then the codes, four per byte (element i in bits 2*(i%4) of byte
i//4): 0 for 0, 2 for -t, 3 for +t. The server checks the threshold and decodes into the
key's dtype before merging, so the sync and async rules are unchanged. For float16 and
bfloat16 keys t is first rounded to the key's dtype (what the server will add), so the
residual keeps exactly what was not sent.
"""

import math

import numpy as np

from .errors import DTypeError, ProtocolError
from .optimizer.kernels.common import bf16_to_f32, dtype_name, f32_to_bf16
from .wire.protocol import TWO_BIT, nbytes  # noqa: F401  (nbytes: the payload size, for callers)

TYPES = (TWO_BIT,)
_ZERO, _MINUS, _PLUS = 0, 2, 3
DECODABLE = ('float16', 'bfloat16', 'float32', 'float64')


class TwoBit:
    """One store's 2-bit codec: the threshold and a residual per (key, part) (float64 for
    float64 gradients, float32 for the others)."""

    name = TWO_BIT

    def __init__(self, threshold, residuals=None):
        self.threshold = threshold
        # owned by the store, so that setting compression again (or off, then on) keeps
        # what earlier pushes have not sent yet, as MXNet's per-key residual buffers do
        self._residuals = {} if residuals is None else residuals

    def encode(self, key, part, grad, out):
        """Quantize flat ``grad`` (+ the residual of (key, part)) into ``out``, a uint8 array
        of ``nbytes('2bit', grad.size)``; the residual keeps what was not sent. A uint16
        ``grad`` holds bfloat16 bits (kvps's storage of bfloat16)."""
        kind = dtype_name(grad)
        t = sent_threshold(self.threshold, kind)
        # float64 gradients keep a float64 residual, as MXNet's (the gradient's dtype): in
        # float32 an element just below t would round up to t and be sent
        wide = np.float64 if kind == 'float64' else np.float32
        residual = self._residuals.get((key, part))
        if residual is None or residual.size != grad.size:
            residual = self._residuals[(key, part)] = np.zeros(grad.size, wide)
        np.add(residual, bf16_to_f32(grad) if kind == 'bfloat16' else grad, out=residual,
               casting='unsafe')
        plus, minus = residual >= t, residual <= -t
        sign = plus.view(np.int8) - minus.view(np.int8)
        np.subtract(residual, np.multiply(sign, t, dtype=wide), out=residual)
        # codes (0, 2 = -t, 3 = +t) in bytes, then four bytes folded into one: element 4j+k
        # sits at bit 8k of little-endian word j and moves to bits 2k of byte j
        codes = np.zeros(-(-grad.size // 4) * 4, np.uint8)
        np.bitwise_or(plus, minus, out=codes[:grad.size].view(bool))
        codes <<= 1
        codes[:grad.size] |= plus.view(np.uint8)
        words = codes.view('<u4')
        out[:4] = np.frombuffer(np.array(t, '<f4').tobytes(), np.uint8)
        out[4:] = ((words & 3) | ((words >> 6) & 0xC) | ((words >> 12) & 0x30) |
                   ((words >> 18) & 0xC0))
        return out


def parse(params, residuals=None):
    """The codec for ``set_gradient_compression`` params (None turns compression off),
    keeping its residuals in ``residuals`` (a dict) when given."""
    if params is None:
        return None
    if not isinstance(params, dict):
        raise TypeError(f'compression params must be a dict such as {{"type": "2bit", '
                        f'"threshold": 0.5}}, got {type(params).__name__}')
    unknown = set(params) - {'type', 'threshold'}
    if unknown:
        raise ValueError(f'unknown gradient compression parameters {sorted(unknown)}; '
                         'expected type and threshold')
    kind = str(params.get('type', '')).lower()
    if kind in ('', 'none'):
        return None
    if kind not in TYPES:
        raise ValueError(f'gradient compression type {params.get("type")!r} is not '
                         f'supported; kvps has {", ".join(TYPES)}')
    threshold = params.get('threshold', 0.5)
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or \
            not math.isfinite(threshold) or threshold <= 0:
        raise ValueError(f'2bit compression needs a finite threshold > 0, got {threshold!r}')
    return TwoBit(float(threshold), residuals)


def sent_threshold(threshold, dtype):
    """``threshold`` as a server adds it to a ``dtype`` key, in float32: rounded to float16
    or bfloat16 for those keys, so the residual takes off exactly what was sent."""
    t = np.float32(threshold)
    if dtype == 'float16':
        t = np.float32(np.float16(t))
    elif dtype == 'bfloat16':
        t = bf16_to_f32(f32_to_bf16(np.array([t])))[0]
    if not (math.isfinite(t) and t > 0):
        raise ValueError(f'2bit threshold {threshold!r} is {t} in a {dtype} key; choose one '
                         f'that {dtype} can hold')
    return t


def check_compressible(key, dtype):
    if dtype not in DECODABLE:
        raise DTypeError(f'key {key!r}: 2bit gradient compression handles float16, bfloat16, '
                         f'float32 and float64 gradients, not {dtype}')


def decode(payload, n, dtype):
    """The gradient a '2bit' ``payload`` of ``n`` elements carries, as a new ``dtype`` array;
    ProtocolError for a payload of the wrong size or with a bad threshold."""
    raw = np.frombuffer(payload, np.uint8)
    if raw.size != nbytes(TWO_BIT, n):
        raise ProtocolError(f'2bit payload of {raw.size} bytes for {n} elements; expected '
                            f'{nbytes(TWO_BIT, n)}')
    t = float(raw[:4].view('<f4')[0])
    if not math.isfinite(t) or t <= 0:
        raise ProtocolError(f'2bit payload with threshold {t!r}; it must be finite and > 0')
    table = np.zeros((256, 4), np.float32 if dtype == 'bfloat16' else dtype)
    byte = np.arange(256)
    for slot in range(4):
        code = (byte >> (2 * slot)) & 3
        table[code == _PLUS, slot] = t
        table[code == _MINUS, slot] = -t
    if dtype == 'bfloat16':
        table = f32_to_bf16(table)
    return table[raw[4:]].reshape(-1)[:n]
