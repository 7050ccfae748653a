"""What every gradient codec shares: the error-feedback residual per key part, the values a
key's dtype holds, and the checks and table decoding of a payload a server receives."""

import numpy as np

from ..errors import DTypeError, ProtocolError
from ..optimizer.kernels.common import bf16_to_f32, dtype_name, f32_to_bf16
from ..wire.protocol import nbytes
from . import f16

DECODABLE = ('float16', 'bfloat16', 'float32', 'float64')
FP16_MAX = np.float32(f16.FP16_MAX)   # the largest finite float16


class ErrorFeedback:
    """A codec with error feedback, one per store: before a push each part of a gradient is
    added to its residual (what earlier pushes did not send), the sum is encoded, and what
    the server will decode is taken off the residual. Nothing is lost, only delayed. The
    residual is float64 for float64 gradients, float32 for the others.

    A codec names its wire kind (``name``, one of kvps.wire.protocol.GRADIENT_CODECS) and
    implements ``_quantize`` (encode the residual into ``out``, take what is sent off it; or
    ``encode`` itself, as the half codecs do block by block) and the static ``decode`` (a
    payload back into the key's dtype, on the server)."""

    name = None

    def __init__(self, residuals=None):
        # owned by the store, so that setting compression again (or off, then on, or another
        # type) keeps what earlier pushes have not sent yet, as MXNet's per-key residual
        # buffers do
        self._residuals = {} if residuals is None else residuals

    def nbytes(self, n, dtype):
        """Bytes of the payload of ``n`` elements of a ``dtype`` key."""
        return nbytes(self.name, n)

    def encode(self, key, part, grad, out):
        """Encode flat ``grad`` (+ the residual of (key, part)) into ``out``, a uint8 array of
        ``nbytes(grad.size, its dtype)``; the residual keeps what was not sent. A uint16
        ``grad`` holds bfloat16 bits (kvps's storage of bfloat16). Returns ``out``."""
        kind = dtype_name(grad)
        self._quantize(self._accumulated(key, part, grad, kind), kind, out)
        return out

    def _accumulated(self, key, part, grad, kind):
        """The residual of (key, part) with ``grad`` added."""
        residual = self._residual(key, part, grad.size, kind)
        np.add(residual, bf16_to_f32(grad) if kind == 'bfloat16' else grad, out=residual,
               casting='unsafe')
        return residual

    def _residual(self, key, part, n, kind):
        """The residual of (key, part): ``n`` zeros the first time."""
        # float64 gradients keep a float64 residual, as MXNet's (the gradient's dtype): in
        # float32 an element just below a 2bit threshold would round up to it and be sent
        wide = np.float64 if kind == 'float64' else np.float32
        residual = self._residuals.get((key, part))
        if residual is None or residual.size != n or residual.dtype != wide:
            residual = self._residuals[(key, part)] = np.zeros(n, wide)
        return residual

    def _quantize(self, residual, kind, out):
        raise NotImplementedError

    def _take_off_sent(self, residual, out, kind):
        """Take what the server decodes from payload ``out`` off ``residual``: exactly what
        it adds, whatever rounding its decoding into the key's dtype makes."""
        sent = self.decode(out, residual.size, kind)
        np.subtract(residual, bf16_to_f32(sent) if kind == 'bfloat16' else sent, out=residual)

    @staticmethod
    def decode(payload, n, dtype):
        raise NotImplementedError


def held(value, dtype):
    """``value`` as a server adds it to a ``dtype`` key, in float32: rounded to float16 (at
    most the largest finite one) or bfloat16 for those keys, so that a residual takes off
    exactly what was sent."""
    value = np.float32(value)
    if dtype == 'float16':
        return np.float32(np.float16(min(value, FP16_MAX)))
    if dtype == 'bfloat16':
        return bf16_to_f32(f32_to_bf16(np.array([value])))[0]
    return value


def check_compressible(key, dtype, kind='2bit'):
    """DTypeError unless ``kind`` can compress a ``dtype`` key's gradient (floats only)."""
    if dtype not in DECODABLE:
        raise DTypeError(f'key {key!r}: {kind} gradient compression handles float16, '
                         f'bfloat16, float32 and float64 gradients, not {dtype}')


def payload_bytes(kind, payload, expected, n):
    """``payload`` as uint8, ProtocolError unless it has the ``expected`` size."""
    raw = np.frombuffer(payload, np.uint8)
    if raw.size != expected:
        raise ProtocolError(f'{kind} payload of {raw.size} bytes for {n} elements; expected '
                            f'{expected}')
    return raw


def header_scalar(kind, raw, what, valid, rule):
    """The float32 at the head of a payload (a threshold, a scale); ProtocolError naming
    ``rule`` unless ``valid(value)``."""
    value = float(raw[:4].view('<f4')[0])
    if not valid(value):
        raise ProtocolError(f'{kind} payload with {what} {value!r}; it must be {rule}')
    return value


def in_key_dtype(values, dtype):
    """float32 (or float64) ``values`` in the storage of a ``dtype`` key (bfloat16 as bits)."""
    return f32_to_bf16(values) if dtype == 'bfloat16' else f16.astype(values, np.dtype(dtype))


def table_decode(table, codes, n, dtype):
    """Decode a payload of codes packed several to a byte: ``table`` (256 rows, one column
    per code in a byte, float32) holds the values each byte stands for."""
    table = in_key_dtype(table.astype(np.float64) if dtype == 'float64' else table, dtype)
    return table[codes].reshape(-1)[:n]

