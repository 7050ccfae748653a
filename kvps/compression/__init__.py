"""Gradient compression: codecs that encode pushes on the worker with error feedback and are
decoded on the server before merging, and pulls answered in 16 bits.

``kv.set_gradient_compression(params)`` takes ``{'type': T, ...}`` (settings.parse):

- '2bit' (MXNet's, ``threshold``), twobit.py;
- 'fp16' and 'bf16' (half precision), half.py;
- '1bit' (BytePS's scaled onebit), onebit.py;
- 'topk' (``ratio``), topk.py;

each with error feedback (common.ErrorFeedback): what a push did not send stays on the worker,
per key part, for the next. ``'pull': 'fp16'`` or ``'bf16'`` (with any type, 'none' included)
rounds the float32 and float64 values pulls answer with (half.py). Each codec module pins its
payload's layout; the servers decode before summing, so the sync and async rules are unchanged.
"""

from ..wire.codecs import GRADIENT_CODECS
from ..wire.protocol import nbytes
from .common import DECODABLE, ErrorFeedback, check_compressible
from .half import BFloat16, Float16, land_pulled, pulled_dtype, round_pulled
from .onebit import OneBit
from .settings import OFF, TYPES, Settings, parse
from .topk import TopK
from .twobit import TwoBit, sent_threshold

__all__ = ['parse', 'Settings', 'OFF', 'TYPES', 'CODECS', 'decode', 'nbytes',
           'check_compressible', 'DECODABLE', 'ErrorFeedback', 'TwoBit', 'Float16', 'BFloat16',
           'OneBit', 'TopK', 'sent_threshold', 'pulled_dtype', 'round_pulled', 'land_pulled']

CODECS = {codec.name: codec for codec in (TwoBit, Float16, BFloat16, OneBit, TopK)}
assert set(CODECS) == set(GRADIENT_CODECS) == set(TYPES)


def decode(kind, payload, n, dtype):
    """The gradient a ``kind`` payload (one of kvps.wire.protocol.GRADIENT_CODECS) carries
    for a part of ``n`` elements of a ``dtype`` key, in that key's storage; ProtocolError for
    a malformed payload."""
    return CODECS[kind].decode(payload, n, dtype)
