"""Encode and decode speed of every gradient codec, in GB/s of float32 gradient on one core.

A worker encodes each push (error feedback included: the residual is added, the payload
written, what was sent taken off) and a server decodes it before summing. Compression pays
only where the link between them is slower than these rates; a memory copy of the same
bytes (np.copyto) is the ceiling each is printed against, and the payload's size says what
the link then carries. One JSON line per codec and size:

    python benchmarks/bench_codecs.py                     # 4 MB and 64 MB, ~1 min
    python benchmarks/bench_codecs.py --sizes-mb 16 --reps 9
"""

import argparse
import os
import sys
import time

import numpy as np

from kvps import compression
from kvps.compression import f16

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import JsonLines, default_out_dir, note  # noqa: E402  (benchmarks/: no package)

TYPES = [{'type': '2bit', 'threshold': 0.5}, {'type': 'fp16'}, {'type': 'bf16'},
         {'type': '1bit'}, {'type': 'topk', 'ratio': 0.01}]


def timed(fn, reps):
    """The least seconds of ``reps`` calls of ``fn`` (after one untimed call): on a shared
    box the calls that other processes did not slow down."""
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def measure(params, grad, reps):
    codec = compression.parse(params).push
    out = np.empty(codec.nbytes(grad.size, 'float32'), np.uint8)
    encode = timed(lambda: codec.encode('k', 0, grad, out), reps)
    decode = timed(lambda: compression.decode(codec.name, out, grad.size, 'float32'), reps)
    return {'type': params['type'], 'payload_ratio': round(out.nbytes / grad.nbytes, 4),
            'encode_GBps': round(grad.nbytes / encode / 1e9, 3),
            'decode_GBps': round(grad.nbytes / decode / 1e9, 3)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument('--sizes-mb', type=int, nargs='+', default=[4, 64])
    ap.add_argument('--reps', type=int, default=9)
    ap.add_argument('--out', default=default_out_dir('codecs'))
    args = ap.parse_args()
    out = JsonLines(args.out, 'codecs')
    f16.loaded(120)   # float16 casts load torch in the background: time them once it is there
    rng = np.random.default_rng(0)
    for mb in args.sizes_mb:
        grad = rng.standard_normal((mb << 20) // 4).astype(np.float32)
        copy = np.empty_like(grad)
        ceiling = grad.nbytes / timed(lambda: np.copyto(copy, grad), args.reps) / 1e9
        for params in TYPES:
            note(f'{params["type"]}, {mb} MB')
            out.emit({'size_MB': mb, **measure(params, grad, args.reps),
                      'copy_GBps': round(ceiling, 3)})


if __name__ == '__main__':
    main()
