"""Gaussian noise for SGLD, counter-based: the same bits from numpy on a CPU and CUDA on a GPU.

A server draws the noise of element ``i`` of a key at its ``count``-th update from a 64-bit
stream number (made from the optimizer's ``seed``, the key and the count, see ``stream``) and
``i`` alone: no generator state is kept or saved, a job is reproducible, the noise does not
depend on the order of keys, on threads or on launch sizes, and a restarted job (its counts
restored) draws what the uninterrupted one would have.

Each pair of elements (2j, 2j + 1) takes the two normals of one draw of Marsaglia's polar
method, on uniforms from splitmix64 seeded with the stream number at counters made of (j,
attempt), in double precision with only IEEE-exact operations (+ - * / sqrt and exact bit
manipulation): the logarithm is a fixed series rather than the platform's ``log``, whose last
bits differ between glibc and CUDA. numpy and the C below do the same operations in the same
order (no FMA contraction), so they agree bit for bit.
"""

import hashlib
import math

import numpy as np

ATTEMPTS = 64   # polar draws per element before giving up (then 0): (1 - pi/4)**64 < 1e-42
_GOLDEN, _MIX1, _MIX2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
# log(m) = 2 atanh(f), f = (m - 1) / (m + 1), for m in [sqrt(1/2), sqrt(2)): |f| < 0.172, so
# 12 terms of 2 f (1 + f^2/3 + f^4/5 + ...) leave under 1e-20 of it
_LOG_TERMS = [1.0 / (2 * k + 1) for k in range(12)]
_LN2, _SQRT_HALF = math.log(2.0), math.sqrt(0.5)


def stream(seed, key, count):
    """The stream number of ``key``'s ``count``-th update under ``seed``, as two 32-bit
    halves (each exact in a double: they travel as kernel scalars). Keys are int or str,
    hashed with their type, so every process finds the same number."""
    kind, name = (b's', key.encode()) if isinstance(key, str) else (b'i', b'%d' % int(key))
    digest = hashlib.blake2b(b'%d|%d|%s|%s' % (int(seed), int(count), kind, name),
                             digest_size=8, person=b'kvps.sgld').digest()
    number = int.from_bytes(digest, 'little')
    return number >> 32, number & 0xFFFFFFFF


CHUNK = 1 << 14   # elements drawn at once: the temporaries stay in cache


def _mix(x):
    """splitmix64's step and finalizer on uint64 arrays (wrapping arithmetic)."""
    x = x + np.uint64(_GOLDEN)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(_MIX1)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(_MIX2)
    return x ^ (x >> np.uint64(31))


def _uniform(number, counter):
    """A double in [-1, 1): output ``counter`` of splitmix64 seeded with the stream number."""
    bits = _mix(counter * np.uint64(_GOLDEN) + number)
    return (bits >> np.uint64(11)).astype(np.float64) * (2.0 ** -52) - 1.0


def _log(s):
    """The natural logarithm of doubles in (0, 1], from exact operations only."""
    m, e = np.frexp(s)
    low = m < _SQRT_HALF
    m = np.where(low, m * 2.0, m)
    e = (e - low).astype(np.float64)
    f = (m - 1.0) / (m + 1.0)
    f2 = f * f
    series = np.full_like(f, _LOG_TERMS[-1])
    for term in reversed(_LOG_TERMS[:-1]):
        series = series * f2 + term
    return e * _LN2 + (2.0 * f) * series


def _polar(number, counter):
    """One polar draw per counter: (accepted, its two normals where accepted)."""
    v1 = _uniform(number, counter)
    v2 = _uniform(number, counter + np.uint64(1))
    s = v1 * v1 + v2 * v2
    ok = (s > 0.0) & (s < 1.0)
    with np.errstate(all='ignore'):   # the rejected draws' values are thrown away
        scale = np.sqrt((-2.0 * _log(s)) / s)
    return ok, v1 * scale, v2 * scale


def gaussian(hi, lo, start, n):
    """Standard normal doubles for elements ``start``..``start + n`` of the stream (hi, lo).
    Elements 2j and 2j + 1 take the two normals of one polar draw (counters from j)."""
    number = np.uint64((int(hi) << 32) | int(lo))
    first, end = start // 2, (start + n + 1) // 2   # the pairs that hold the elements
    out = np.zeros(2 * (end - first), np.float64)
    for at in range(first, end, CHUNK):
        base = np.arange(at, min(at + CHUNK, end), dtype=np.uint64) * np.uint64(2 * ATTEMPTS)
        pairs = out[2 * (at - first):2 * (at - first + base.size)].reshape(-1, 2)
        todo = np.arange(base.size)
        for attempt in range(ATTEMPTS):   # about one pair in five draws again, further on
            ok, z1, z2 = _polar(number, base[todo] + np.uint64(2 * attempt))
            pairs[todo[ok], 0], pairs[todo[ok], 1] = z1[ok], z2[ok]
            todo = todo[~ok]
            if not todo.size:
                break
    return out[start - 2 * first:start - 2 * first + n]


def _c_double(value):
    return repr(float(value))


# The same, in CUDA C for the kernels (kv_normal(hi, lo, i): element i of stream (hi, lo);
# each thread draws its element's pair and keeps its half).
C_SOURCE = r'''
__device__ __forceinline__ unsigned long long kv_mix64(unsigned long long x) {
    x += GOLDENull;
    x = (x ^ (x >> 30)) * MIX1ull;
    x = (x ^ (x >> 27)) * MIX2ull;
    return x ^ (x >> 31);
}
__device__ __forceinline__ double kv_uniform(unsigned long long number, unsigned long long c) {
    return (double)(kv_mix64(c * GOLDENull + number) >> 11) * TWO_M52 - 1.0;
}
__device__ __forceinline__ double kv_log01(double s) {
    int e;
    double m = frexp(s, &e);
    if (m < SQRT_HALF) { m = m * 2.0; e = e - 1; }
    const double f = (m - 1.0) / (m + 1.0), f2 = f * f;
    double series = LAST_TERM;
SERIES    return (double)e * LN2 + (2.0 * f) * series;
}
__device__ double kv_normal(double hi, double lo, long long i) {
    const unsigned long long number =
        ((unsigned long long)hi << 32) | (unsigned long long)lo;
    for (int attempt = 0; attempt < ATTEMPTS; ++attempt) {
        const unsigned long long c = (unsigned long long)(i >> 1) * (2ull * ATTEMPTS)
                                     + 2ull * (unsigned long long)attempt;
        const double v1 = kv_uniform(number, c), v2 = kv_uniform(number, c + 1ull);
        const double s = v1 * v1 + v2 * v2;
        if (s > 0.0 && s < 1.0) {
            const double scale = sqrt((-2.0 * kv_log01(s)) / s);
            return (i & 1) ? v2 * scale : v1 * scale;
        }
    }
    return 0.0;
}
'''
for _name, _value in (('GOLDEN', hex(_GOLDEN)), ('MIX1', hex(_MIX1)), ('MIX2', hex(_MIX2)),
                      ('TWO_M52', _c_double(2.0 ** -52)), ('SQRT_HALF', _c_double(_SQRT_HALF)),
                      ('LAST_TERM', _c_double(_LOG_TERMS[-1])), ('LN2', _c_double(_LN2)),
                      ('ATTEMPTS', str(ATTEMPTS)),
                      ('SERIES', ''.join(f'    series = series * f2 + {_c_double(t)};\n'
                                         for t in reversed(_LOG_TERMS[:-1])))):
    C_SOURCE = C_SOURCE.replace(_name, _value)
