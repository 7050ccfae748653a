"""Optimizer update kernels: GB/s of each fused update against the same device's memory copy.

GB/s counts the bytes an update must move at the least: weight and each state read and
written, the gradient read (float32: 4 bytes x elements x (3 + 2 x states)), over the median
time of one update. copy_gbps is a copy of one array of the same element count on the same
device (read + write bytes over time), the ceiling a streaming kernel can approach.
One JSON line per (optimizer, device, size). Then, per device, many small keys (as a model's
biases and norms) updated key by key against `multi_update` (one multi-tensor launch per rule
on a GPU; packed passes on the CPU, in place where the keys' arrays lie end to end, as a
server lays out small keys), and its later rounds from the launches it keeps, as a server's
Updater runs them (with the host's share of that time alone).

With --grads 2 each update gets its gradient as two arrays, as a server hands a sync round's
last push with the sum so far: the kernels add them as they load them (one pass), against
adding them into a third array first and updating from that (what a GPU shard did before).

    python benchmarks/bench_kernels.py            # 1M and 16M float32 elements
    python benchmarks/bench_kernels.py --quick    # 1M only, few repetitions
    python benchmarks/bench_kernels.py --grads 2 --optimizers sgd adam lamb
"""

import argparse
import json
import statistics
import time

import numpy as np

from kvps.optimizer.kernels import cuda_kernels, numpy_kernels

# optimizer label -> (kernel, state count, hyper-parameters)
CONFIGS = {
    'sgd': ('sgd_update', 1, dict(momentum=0.9)),
    'nag': ('nag_update', 1, dict(momentum=0.9)),
    'adam': ('adam_update', 2, dict(t=3)),
    'adamw': ('adamw_update', 2, dict(t=3)),
    'adagrad': ('adagrad_update', 1, {}),
    'rmsprop': ('rmsprop_update', 3, dict(centered=True)),
    'lamb': ('lamb_update', 2, dict(t=3)),
    'ftrl': ('ftrl_update', 2, {}),
    'signum': ('signum_update', 1, {}),
    'test': ('test_update', 0, {}),
    'adadelta': ('adadelta_update', 2, {}),
    'adamax': ('adamax_update', 2, dict(t=3)),
    'nadam': ('nadam_update', 2, dict(t=3)),
    'ftml': ('ftml_update', 3, dict(t=3)),
    'lars': ('lars_update', 1, dict(momentum=0.9)),           # norms, then the step
    'lbsgd': ('lbsgd_update', 2, dict(momentum=0.9, batch_scale=2)),   # an update that applies
    'sgld': ('sgld_update', 0, dict(noise_hi=1, noise_lo=2)),  # the noise drawn in the kernel
    'dcasgd': ('dcasgd_update', 2, dict(momentum=0.9)),
    'adabelief': ('adabelief_update', 2, dict(t=3)),
    'lans': ('lans_update', 2, dict(t=3)),                    # three passes
}
BASE = dict(lr=0.01, wd=1e-4, rescale_grad=1.0, clip_gradient=None)


class Host:
    """numpy arrays, wall-clock timing."""
    name, mod = 'cpu', numpy_kernels

    def __init__(self):
        self.xp = np

    def time(self, fn, before):
        before()
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start


class Cuda:
    """cupy arrays, CUDA-event timing."""
    mod = cuda_kernels

    def __init__(self):
        import cupy
        self.xp = cupy
        self.name = f'cuda:{cupy.cuda.runtime.getDevice()}'
        # An idle GPU runs at a low clock for the first few hundred milliseconds of work:
        # without this, the first figure's copy ran at a quarter of the others' rate.
        a, b = cupy.ones(1 << 26, cupy.float32), cupy.empty(1 << 26, cupy.float32)
        for _ in range(2000):
            cupy.copyto(b, a)
        cupy.cuda.Device().synchronize()

    def time(self, fn, before):
        before()
        start, stop = self.xp.cuda.Event(), self.xp.cuda.Event()
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        return self.xp.cuda.get_elapsed_time(start, stop) / 1e3


def _median(dev, fn, before, reps):
    dev.time(fn, before)  # warm-up: kernel compilation, page faults
    return statistics.median(dev.time(fn, before) for _ in range(reps))


def _host_median(fn, reps):
    """Host time of one call (planning and launching; on a GPU the kernels may still run)."""
    fn()
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def bench(dev, label, n, reps, grads=1):
    if grads == 2:
        return bench_two(dev, label, n, reps)
    kernel, nstates, hyper = CONFIGS[label]
    xp = dev.xp
    rng = np.random.default_rng(0)
    w = xp.asarray(rng.standard_normal(n).astype(np.float32))
    g0 = xp.asarray(rng.standard_normal(n).astype(np.float32))
    g = xp.empty_like(g0)
    states = [xp.zeros_like(w) for _ in range(nstates)]
    if label == 'rmsprop':
        states[0] += 1.0  # centered: keep var - mean^2 positive
    fn = getattr(dev.mod, kernel)
    # the kernel clobbers grad: restore it outside the timed region (repeated squaring
    # in place would otherwise drift into denormals, which are slow on CPUs)
    seconds = _median(dev, lambda: fn(w, g, *states, **BASE, **hyper),
                      lambda: xp.copyto(g, g0), reps)
    src, dst = xp.asarray(g0), xp.empty_like(g0)
    copy_s = _median(dev, lambda: xp.copyto(dst, src), lambda: None, reps)
    moved = 4 * n * (3 + 2 * nstates)
    gbps, copy_gbps = moved / seconds / 1e9, 2 * 4 * n / copy_s / 1e9
    return {'bench': 'kernels', 'optimizer': label, 'device': dev.name, 'dtype': 'float32',
            'elements': n, 'gbps': round(gbps, 2), 'copy_gbps': round(copy_gbps, 2),
            'ratio_to_copy': round(gbps / copy_gbps, 3), 'ms': round(seconds * 1e3, 3)}


def bench_two(dev, label, n, reps):
    """One update of a gradient given as two arrays: added in the update's pass (fused)
    against added into a third array first (add_then_update); gbps counts the fused
    update's bytes (both arrays read)."""
    kernel, nstates, hyper = CONFIGS[label]
    xp, fn = dev.xp, getattr(dev.mod, kernel)
    rng = np.random.default_rng(0)
    w = xp.asarray(rng.standard_normal(n).astype(np.float32))
    parts = tuple(xp.asarray(rng.standard_normal(n).astype(np.float32)) for _ in range(2))
    summed = xp.empty_like(w)
    states = [xp.ones_like(w) for _ in range(nstates)]   # (rmsprop centered: var >= mean^2)

    def add_then_update():
        xp.add(*parts, out=summed)   # (a fresh sum each time: the update clobbers its grad)
        fn(w, summed, *states, **BASE, **hyper)
    fused = _median(dev, lambda: fn(w, parts, *states, **BASE, **hyper), lambda: None, reps)
    apart = _median(dev, add_then_update, lambda: None, reps)
    return {'bench': 'kernels', 'optimizer': label, 'device': dev.name, 'dtype': 'float32',
            'elements': n, 'grads': 2,
            'gbps': round(4 * n * (4 + 2 * nstates) / fused / 1e9, 2),
            'ms': round(fused * 1e3, 3), 'ms_add_then_update': round(apart * 1e3, 3),
            'speedup_fused': round(apart / fused, 2)}


def bench_many(dev, label, keys, n, reps, grads=1):
    """``keys`` keys of ``n`` elements: key by key against one multi_update call, with each
    key's arrays apart (copied into the packed pass and back on the CPU) and laid end to
    end as a server lays out small keys (weights and states updated in place). ``grads``
    2: bench_many_two."""
    if grads == 2:
        return bench_many_two(dev, label, keys, n, reps)
    kernel, nstates, hyper = CONFIGS[label]
    xp, fn = dev.xp, getattr(dev.mod, kernel)

    def calls(end_to_end):
        rng = np.random.default_rng(1)

        def column(fill):
            if end_to_end:
                whole = xp.asarray(fill(keys * n))
                return [whole[i * n:(i + 1) * n] for i in range(keys)]
            return [xp.asarray(fill(n)) for _ in range(keys)]
        normal = (lambda m: rng.standard_normal(m).astype(np.float32))
        weights, grads = column(normal), column(normal)
        states = [column(lambda m: np.ones(m, np.float32)) for _ in range(nstates)]
        return [(kernel, (weights[i], grads[i], *(s[i] for s in states)), dict(BASE, **hyper))
                for i in range(keys)]
    apart, laid = calls(False), calls(True)

    def one_by_one():
        for _, args, kwargs in apart:
            fn(*args, **kwargs)
    alone = _median(dev, one_by_one, lambda: None, reps)
    together = _median(dev, lambda: dev.mod.multi_update(apart), lambda: None, reps)
    in_place = _median(dev, lambda: dev.mod.multi_update(laid), lambda: None, reps)
    kept = {}   # as a server's Updater keeps them: the warm-up round plans, later rounds reuse
    reused = _median(dev, lambda: dev.mod.multi_update(laid, kept), lambda: None, reps)
    host = _host_median(lambda: dev.mod.multi_update(laid, kept), reps)
    return {'bench': 'kernels_many_keys', 'optimizer': label, 'device': dev.name,
            'dtype': 'float32', 'keys': keys, 'elements_per_key': n,
            'ms_key_by_key': round(alone * 1e3, 3), 'ms_multi_tensor': round(together * 1e3, 3),
            'ms_multi_tensor_end_to_end': round(in_place * 1e3, 3),
            'ms_multi_tensor_kept': round(reused * 1e3, 3),
            'host_ms_multi_tensor_kept': round(host * 1e3, 3),
            'speedup': round(alone / together, 2),
            'speedup_end_to_end': round(alone / in_place, 2)}


def bench_many_two(dev, label, keys, n, reps):
    """``keys`` keys of ``n`` elements laid end to end, each gradient two arrays, from kept
    launches as a server's rounds run: one multi_update adding each pair in its pass
    against a sum per key first (one add each, as a GPU shard launched them) then the
    multi_update of the sums; device time, and the host's share of it alone."""
    kernel, nstates, hyper = CONFIGS[label]
    xp = dev.xp
    rng = np.random.default_rng(1)

    def column(fill):
        whole = xp.asarray(fill(keys * n))
        return [whole[i * n:(i + 1) * n] for i in range(keys)]
    normal = (lambda m: rng.standard_normal(m).astype(np.float32))
    weights, firsts, lasts, sums = column(normal), column(normal), column(normal), column(normal)
    states = [column(lambda m: np.ones(m, np.float32)) for _ in range(nstates)]
    rest = [[s[i] for s in states] for i in range(keys)]
    fused_calls = [(kernel, (weights[i], (firsts[i], lasts[i]), *rest[i]), dict(BASE, **hyper))
                   for i in range(keys)]
    summed_calls = [(kernel, (weights[i], sums[i], *rest[i]), dict(BASE, **hyper))
                    for i in range(keys)]
    kept_fused, kept_summed = {}, {}

    def add_then_update():
        for first, last, out in zip(firsts, lasts, sums):
            xp.add(first, last, out=out)
        dev.mod.multi_update(summed_calls, kept_summed)
    fused = _median(dev, lambda: dev.mod.multi_update(fused_calls, kept_fused), lambda: None,
                    reps)
    apart = _median(dev, add_then_update, lambda: None, reps)
    return {'bench': 'kernels_many_keys', 'optimizer': label, 'device': dev.name,
            'dtype': 'float32', 'keys': keys, 'elements_per_key': n, 'grads': 2,
            'ms_multi_tensor_kept': round(fused * 1e3, 3),
            'ms_add_then_multi_tensor_kept': round(apart * 1e3, 3),
            'host_ms_multi_tensor_kept': round(_host_median(
                lambda: dev.mod.multi_update(fused_calls, kept_fused), reps) * 1e3, 3),
            'host_ms_add_then_multi_tensor_kept': round(_host_median(add_then_update, reps)
                                                        * 1e3, 3),
            'speedup_fused': round(apart / fused, 2)}


def devices(which):
    out = [Host()] if which in ('all', 'cpu') else []
    if which in ('all', 'cuda'):
        try:
            import cupy
            if cupy.cuda.runtime.getDeviceCount() > 0:
                out.append(Cuda())
        except Exception:  # no cupy or no GPU: numpy only
            pass
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument('--quick', action='store_true', help='1M elements, 3 repetitions')
    ap.add_argument('--sizes', type=int, nargs='+', default=None)
    ap.add_argument('--optimizers', nargs='+', default=list(CONFIGS), choices=list(CONFIGS))
    ap.add_argument('--device', choices=['all', 'cpu', 'cuda'], default='all')
    ap.add_argument('--reps', type=int, default=None)
    ap.add_argument('--many-keys', type=int, default=512, help='small keys for the multi-'
                    'tensor comparison (0: skip it)')
    ap.add_argument('--key-elements', type=int, default=4096)
    ap.add_argument('--grads', type=int, choices=[1, 2], default=1,
                    help='arrays per gradient: 2 times the update adding a pair in its pass '
                    'against adding it first')
    ap.add_argument('--ilp', type=int, default=None,
                    help='elements each CUDA thread loads at once, in every kernel (default: '
                    "kvps's own, cuda_source.ILP): the figures of another choice")
    args = ap.parse_args()
    if args.ilp is not None:
        from kvps.optimizer.kernels import cuda_source
        cuda_source.FORCED_ILP = args.ilp
    sizes = args.sizes or ([1 << 20] if args.quick else [1 << 20, 1 << 24])
    for dev in devices(args.device):
        for n in sizes:
            reps = args.reps or (3 if args.quick else (10 if n <= 1 << 22 else 5))
            for label in args.optimizers:
                record = bench(dev, label, n, reps, args.grads)
                if args.ilp is not None and dev.name != 'cpu':
                    record['ilp'] = args.ilp
                print(json.dumps(record), flush=True)
        for label in args.optimizers if args.many_keys else ():
            print(json.dumps(bench_many(dev, label, args.many_keys, args.key_elements,
                                        args.reps or 5, args.grads)), flush=True)


if __name__ == '__main__':
    main()
