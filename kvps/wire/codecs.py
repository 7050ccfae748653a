"""The wire kinds of compressed values (kvps.compression encodes and decodes them) and their
sizes: PUSH item dtypes of gradients, and the types a PULL's answer may be rounded to."""

# Compressed gradients, PUSH item dtypes only (each codec module of kvps.compression pins its
# layout); all little-endian, the item's `n` counts the part's elements unless said otherwise:
TWO_BIT = '2bit'   # a float32 threshold, then four 2-bit codes per byte
FP16 = 'fp16'      # n float16
BF16 = 'bf16'      # n bfloat16 (the upper 16 bits of float32)
ONE_BIT = '1bit'   # `n` counts bytes: a uint32 chunk, two bfloat16 scales a chunk, sign bits
TOP_K = 'topk'     # `n` counts bytes: a uint32 count k, k uint32 indices, k values of the key
GRADIENT_CODECS = (TWO_BIT, FP16, BF16, ONE_BIT, TOP_K)
# Pulls answered in 16 bits (a PULL's `codec`), and the dtype their values then travel in.
PULL_DTYPES = {FP16: 'float16', BF16: 'bfloat16'}
PULL_CODECS = tuple(PULL_DTYPES)

_BYTES = {TWO_BIT: lambda n: 4 + (n + 3) // 4, FP16: lambda n: 2 * n, BF16: lambda n: 2 * n,
          ONE_BIT: lambda n: n, TOP_K: lambda n: n}


def coded_nbytes(kind, n):
    """Bytes of a ``kind`` payload whose PUSH item says ``n``."""
    return _BYTES[kind](n)
