"""The top-k codec: the largest-magnitude elements of each part travel as index and value.

``{'type': 'topk', 'ratio': r}`` (0 < r <= 1, default 0.01): of each part of a key (the
worker's push to one server) of n elements, the k = max(1, ceil(r * n)) elements of the
residual (kvps.compression.common) with the largest |x| are sent (ties between equal
magnitudes go to the lower index; NaNs count as the largest), the rest stay in the residual,
as BytePS's topk compressor with its error feedback.

Payload of one part (wire kind 'topk'; the push item's ``n`` counts the payload's bytes,
4 + k * (4 + the key's itemsize)): k as a little-endian uint32, then the k indices as uint32 in
increasing order, then the k values in the key's dtype (bfloat16 as its 16 bits), all
little-endian. The server refuses a payload whose size does not match its k, with more
indices than elements, or with indices out of order or out of range.
"""

import math

import numpy as np

from ..errors import ProtocolError
from ..optimizer.kernels.common import bf16_to_f32
from ..wire.codecs import TOP_K
from ..wire.protocol import ITEMSIZE
from .common import FP16_MAX, ErrorFeedback, in_key_dtype

MAX_ELEMENTS = 2 ** 32 - 1   # indices travel as uint32
SAMPLED = 1 << 16             # parts from this size find their candidates from a sample


class TopK(ErrorFeedback):
    """One store's top-k codec: the ratio, and the residuals (ErrorFeedback)."""

    name = TOP_K

    def __init__(self, ratio, residuals=None):
        super().__init__(residuals)
        self.ratio = ratio

    def count(self, n):
        """How many of ``n`` elements a part sends."""
        return 0 if n == 0 else min(n, max(1, math.ceil(self.ratio * n)))

    def nbytes(self, n, dtype):
        if n > MAX_ELEMENTS:
            raise ValueError(f'topk compression indexes parts of at most {MAX_ELEMENTS} '
                             f'elements, got one of {n}; split the key over more servers')
        return 4 + self.count(n) * (4 + ITEMSIZE[dtype])

    def _quantize(self, residual, kind, out):
        n = residual.size
        k = self.count(n)
        index = largest(residual, k)
        values = residual[index]
        if kind == 'float16':   # beyond float16's range: +-65504 travels, the rest is held
            values = np.clip(values, -FP16_MAX, FP16_MAX)
        values = in_key_dtype(values, kind)
        out[:4] = np.frombuffer(np.array(k, '<u4').tobytes(), np.uint8)
        out[4:4 + 4 * k] = index.astype('<u4').view(np.uint8)
        out[4 + 4 * k:] = values.view(np.uint8)
        residual[index] -= bf16_to_f32(values) if kind == 'bfloat16' else values

    @staticmethod
    def decode(payload, n, dtype):
        """The gradient a 'topk' ``payload`` carries, as a new ``dtype`` array of ``n``
        elements (zeros but at its indices); ProtocolError for a malformed payload."""
        raw = np.frombuffer(payload, np.uint8)
        size = ITEMSIZE[dtype]
        k = int(raw[:4].view('<u4')[0]) if raw.size >= 4 else -1
        if k < 0 or raw.size != 4 + k * (4 + size) or k > n:
            raise ProtocolError(f'topk payload of {raw.size} bytes for a part of {n} '
                                f'{dtype} elements: it must be 4 + k * {4 + size} bytes '
                                f'with k <= {n} (k = {k})')
        index = raw[4:4 + 4 * k].view('<u4')
        if k and (index[-1] >= n or np.any(index[1:] <= index[:-1])):
            raise ProtocolError(f'topk payload for a part of {n} elements with indices out '
                                'of order or range: they must increase, below n')
        grad = np.zeros(n, np.uint16 if dtype == 'bfloat16' else dtype)
        grad[index] = raw[4 + 4 * k:].view(grad.dtype)
        return grad


def largest(residual, k):
    """The indices, increasing, of the ``k`` elements of largest magnitude (the lower index
    first among equals; NaNs first of all)."""
    n = residual.size
    if k >= n:
        return np.arange(n)
    size = np.abs(residual)
    if n >= SAMPLED and k * 64 <= n and not math.isnan(size.max()):
        found = _candidates(size, k)
        if found is not None:
            return found
    return _exact(size, k)


def _candidates(size, k):
    """``_exact`` on the elements at or above a threshold a strided sample of 1 in 64 puts
    below about 2k of them: they hold every element at or above the k-th magnitude, so the
    answer is the same, for a scan of the part instead of a partition of it. None when fewer
    than k reach the threshold (the sample misjudged it)."""
    sample = size[::64]
    above = min(sample.size - 1, math.ceil(2 * k * sample.size / size.size))
    threshold = np.partition(sample, sample.size - 1 - above)[sample.size - 1 - above]
    candidates = np.flatnonzero(size >= threshold)
    if candidates.size < k:
        return None
    return candidates[_exact(size[candidates], k)]


def _exact(size, k):
    """One partition finds the k-th magnitude, two scans what lies above it and the equals
    that complete k: cheaper than argpartition, which sorts an index array along."""
    n = size.size
    kth = np.partition(size, n - k)[n - k]
    if math.isnan(kth):   # NaNs sort last: at least n - k + 1 of them, take the first k
        return np.flatnonzero(np.isnan(size))[:k]
    above = np.flatnonzero(size > kth)   # (NaNs compare false: add them)
    if above.size < k:
        nan = np.flatnonzero(np.isnan(size))
        if nan.size:
            above = np.union1d(above, nan)
    if above.size < k:
        equal = np.flatnonzero(size == kth)[:k - above.size]
        above = np.union1d(above, equal)
    return above
