#!/usr/bin/env python
"""Worker of bench_hosts' DDP rows: torch DDP's gradient all-reduce of the push+pull model.

The torch anchor a user on a slow network picks: K parameters of about --total-bytes in all
(pushpull_worker's keys), each round a backward whose gradients are (rank + 1), all-reduced
by DistributedDataParallel over gloo, with ``--hook fp16`` through torch's
fp16_compress_hook (gradients travel as float16). The round is the backward, which waits for
every bucket's all-reduce; the forward reads the parameters once. Checked: every gradient is
the mean over ranks. Writes <out>/worker<rank>.json as pushpull_worker does. Started by
bench_hosts.py with RANK, WORLD_SIZE and KVPS_BENCH_RENDEZVOUS (a file for gloo's store).
"""
import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402  (benchmarks/ is not a package)


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument('--keys', type=int, default=16)
    p.add_argument('--total-bytes', type=int, default=64 << 20)
    p.add_argument('--rounds', type=int, default=5)
    p.add_argument('--warmup', type=int, default=2)
    p.add_argument('--hook', choices=['none', 'fp16'], default='none')
    p.add_argument('--out', required=True)
    return p.parse_args()


def main():
    args = parse_args()
    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    torch.set_num_threads(1)
    rank, world = int(os.environ['RANK']), int(os.environ['WORLD_SIZE'])
    dist.init_process_group('gloo', init_method='file://' + os.environ['KVPS_BENCH_RENDEZVOUS'],
                            rank=rank, world_size=world)
    n = max(1, args.total_bytes // (4 * args.keys))
    model = torch.nn.ParameterList([torch.nn.Parameter(torch.zeros(n))
                                    for _ in range(args.keys)])

    class Sum(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.params = model

        def forward(self, scale):
            return sum(p.sum() for p in self.params) * scale

    ddp = torch.nn.parallel.DistributedDataParallel(Sum())
    if args.hook == 'fp16':
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    scale = torch.tensor(float(rank + 1))
    expected = (world + 1) / 2.0          # DDP averages: the mean of rank + 1
    times = []
    for i in range(args.warmup + args.rounds):
        for p in model:
            p.grad = None
        loss = ddp(scale)
        start = time.perf_counter()
        loss.backward()
        if i >= args.warmup:
            times.append(time.perf_counter() - start)
    worst = max(float((p.grad - expected).abs().max()) for p in model)
    errors = [] if worst <= 1e-3 else [f'gradients off the mean {expected} by {worst}']
    dist.barrier()
    med = statistics.median(times)
    rec = {'system': f'ddp-{args.hook}', 'rank': rank, 'num_workers': world,
           'keys': args.keys, 'total_bytes': 4 * n * args.keys, 'rounds': args.rounds,
           'round_times_s': times, 'median_step_s': med, 'correct': not errors,
           'errors': errors}
    _common.write_worker_record(args.out, rank, rec, f'[ddp {args.hook} {rank}/{world}] '
                                f'median_step={med * 1e3:.2f} ms correct={not errors}')
    dist.destroy_process_group()
    return 0 if not errors else 3


if __name__ == '__main__':
    sys.exit(main())
