"""Half-precision codecs: pushes as float16 or bfloat16 with the rounding kept in the residual,
and pulls answered rounded to them.

``{'type': 'fp16'}`` / ``{'type': 'bf16'}``: the residual (kvps.compression.common) is rounded
to nearest even; what the server decodes is taken off it, so the rounding of one push is sent
with the next. In fp16, elements beyond float16's range travel as +-65504 and the rest stays
in the residual. A float64 residual is rounded to bfloat16 through float32.

Payload of one part of n elements (wire kind 'fp16' or 'bf16', ``nbytes`` 2n): n little-endian
float16, or n bfloat16 (the upper 16 bits of the float32, little-endian uint16). The server
decodes it into the key's dtype (rounding again for a float16 key's bf16 payload, or a
bfloat16 key's fp16 one; the residual takes that into account too).

Pulls (``'pull': 'fp16'`` or ``'bf16'``, a PULL's ``codec``): the server answers a float32 or
float64 key with its weight rounded to nearest even in that type (float16 overflows to +-inf
beyond 65504, as a cast does), and the worker widens it exactly into the target. The server's
weight keeps its full precision; other dtypes are pulled as they are.
"""

import numpy as np

from ..optimizer.kernels.common import bf16_to_f32, dtype_name, f32_to_bf16
from ..wire.codecs import BF16, FP16, PULL_DTYPES
from . import f16
from .common import FP16_MAX, ErrorFeedback, in_key_dtype, payload_bytes

ROUNDED = ('float32', 'float64')   # the key dtypes a compressed pull rounds
BLOCK = 1 << 17                    # elements encoded at a time


class Half(ErrorFeedback):
    """One store's fp16 or bf16 codec (a subclass per type): the residuals only."""

    def encode(self, key, part, grad, out):
        """As ErrorFeedback.encode, block by block: each block of the gradient is added to
        its residual and rounded while it is in cache (whole-part temporaries would cost a
        page fault every 4 KiB)."""
        kind = dtype_name(grad)
        # fp16 of a float32 or float16 key: the server decodes exactly the float16 values
        # sent, so torch's passes (f16.round_off) may take them off the residual
        in_torch = self.name == FP16 and kind in ('float32', 'float16')
        residual = self._residual(key, part, grad.size, kind)
        for start in range(0, residual.size, BLOCK):
            block, payload = residual[start:start + BLOCK], out[2 * start:2 * (start + BLOCK)]
            added = grad[start:start + BLOCK]
            if in_torch and f16.round_off(block, payload.view('<f2'), added):
                continue
            np.add(block, bf16_to_f32(added) if kind == 'bfloat16' else added, out=block,
                   casting='unsafe')
            self._quantize_block(block, kind, payload)
        return out

    def _quantize_block(self, block, kind, payload):
        """Encode one block of the residual into ``payload`` (numpy); take what is sent off."""
        if self.name == FP16:
            lo, hi = block.min(), block.max()
            # (NaN compares false: it travels as NaN)
            clipped = block if -FP16_MAX <= lo and hi <= FP16_MAX else \
                np.clip(block, -FP16_MAX, FP16_MAX)
            f16.cast_into(payload.view('<f2'), clipped)
        else:
            f32_to_bf16(block, payload.view('<u2'))
        self._take_off_sent(block, payload, kind)

    @classmethod
    def decode(cls, payload, n, dtype):
        """The gradient a payload of ``n`` elements carries, in the storage of a ``dtype``
        key (a view of ``payload`` where that is its own type); ProtocolError for a payload
        of the wrong size."""
        raw = payload_bytes(cls.name, payload, 2 * n, n)
        if cls.name == FP16:
            return in_key_dtype(raw.view('<f2'), dtype)
        bits = raw.view('<u2')
        return bits if dtype == 'bfloat16' else in_key_dtype(bf16_to_f32(bits), dtype)


class Float16(Half):
    name = FP16


class BFloat16(Half):
    name = BF16


def pulled_dtype(codec, dtype):
    """The dtype in which a pull with ``codec`` (None: uncompressed) carries a ``dtype`` key."""
    return PULL_DTYPES[codec] if codec is not None and dtype in ROUNDED else dtype


def round_pulled(weight, codec):
    """A float32 or float64 ``weight`` as a pull with ``codec`` carries it: float16 (beyond
    65504: inf, as documented), or bfloat16 bits."""
    return f16.astype(weight, np.float16) if codec == FP16 else f32_to_bf16(weight)


def land_pulled(target, values):
    """Write pulled ``values`` (as the wire carried them: numpy views) into ``target`` of the
    key's dtype, widening a compressed pull's float16 or bfloat16 (uint16 bits) exactly."""
    if values.dtype == np.uint16 and target.dtype != np.uint16:
        values = bf16_to_f32(values)
    if values.dtype == np.float16 and target.dtype != np.float16:
        f16.cast_into(target, values.reshape(target.shape))
    else:
        target[...] = values
