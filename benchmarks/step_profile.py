"""torch.profiler over a few training steps of one worker (bench_training --profile): where a
step's host time goes, op by op, which CUDA runtime calls block it, and how much GPU time the
process's own kernels and copies take.

kvps's timeline says how long a worker computes, waits and pushes; on a GPU that is not enough:
"compute" is also time the host spends blocked in a synchronise, or launching kernels one by
one while the GPU idles. This answers that, beside the same for DDP and for one process alone.
Imported by training_worker.py only when --profile is given (torch is imported here).
"""
import gzip
import json
import os
import shutil
import time

import torch
from torch.profiler import ProfilerActivity, profile

TOP = 15   # ops listed per table


def profiled(step, x, y, steps, device, trace_path=None):
    """Run ``steps`` more steps under torch.profiler; returns the summary (ms per step), and
    writes a gzipped Chrome trace to ``trace_path`` when given."""
    activities = [ProfilerActivity.CPU]
    if device != 'cpu':
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            step(x, y)
        wall = time.perf_counter() - start
    if trace_path:
        _write_trace(prof, trace_path)
    return summary(prof.key_averages(), steps, wall)


def summary(averages, steps, wall):
    """The host's ops (less the CUDA runtime's calls), the CUDA runtime's calls (the blocking
    ones among them: cudaStreamSynchronize, cudaEventSynchronize, cudaMemcpy...) and the GPU's
    ops: each one's total, and the ops sorted by time, in ms and calls per step."""
    def per_step(us):
        return round(us / 1e3 / steps, 3)

    def part(name, rows, time_of):   # {name}_ms, and name: the top TOP rows
        top = sorted(rows, key=time_of, reverse=True)[:TOP]
        return {f'{name}_ms': per_step(sum(map(time_of, rows))),
                name: [[row.key, per_step(time_of(row)), round(row.count / steps, 1)]
                       for row in top if time_of(row) > 0]}
    runtime = [row for row in averages if _is_runtime(row.key)]
    host = [row for row in averages if not _is_runtime(row.key)]
    return {'steps': steps, 'ms_step': round(wall * 1e3 / steps, 3),
            **part('host_ops', host, _cpu_time), **part('cuda_runtime', runtime, _cpu_time),
            **part('device_ops', averages, _device_time)}


def _is_runtime(name):
    # the CUDA runtime's and driver's API calls, as the profiler names them
    return name.startswith(('cuda', 'cu')) and not name.startswith('cutlass')


def _cpu_time(row):
    return row.self_cpu_time_total


def _device_time(row):
    return getattr(row, 'self_device_time_total', 0) or 0


def _write_trace(prof, path):
    raw = f'{path}.tmp'
    prof.export_chrome_trace(raw)
    with open(raw, 'rb') as src, gzip.open(path, 'wb') as dst:
        shutil.copyfileobj(src, dst)
    os.unlink(raw)


if __name__ == '__main__':   # a quick look at this module's output on the CPU
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))

    def step(x, y):
        model.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
    print(json.dumps(profiled(step, torch.randn(32, 64), torch.randn(32, 1), 3, 'cpu')))
