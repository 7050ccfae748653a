#!/usr/bin/env python
"""Worker of bench_training: times training steps of a torch MLP, through kvps or torch DDP.

Systems (--system):
  kvps        kvps.Trainer on dist_sync, SGD with momentum on the servers (update_on_kvstore)
  kvps-local  kvps.Trainer on dist_sync, gradients summed through the servers, SGD on the worker
  ddp         torch.nn.parallel.DistributedDataParallel over gloo, torch.optim.SGD locally
With --device cuda the model and batches live on the GPU: kvps uses dist_sync_device (sums
and staging on the GPU, pinned transfers), DDP all-reduces CUDA tensors over gloo (NCCL
refuses two ranks on one GPU, and a one-GPU box is what this measures).
kvps workers are started by `python -m kvps.launch`; DDP workers by bench_training.py with
RANK, WORLD_SIZE and KVPS_BENCH_RENDEZVOUS (a file for gloo's FileStore: no fixed port).

One step = forward, backward, and the optimizer step on every worker (synchronous data
parallel training, the same arithmetic in the three systems). Writes <out>/worker<rank>.json
with the per-step times after warm-up.
"""
import argparse
import json
import os
import statistics
import time

MODELS = {   # name -> layer widths: 'wide' has few big tensors, 'deep' and 'narrow' many small ones
    'wide': [784, 1024, 1024, 1024, 10],
    'deep': [784] + [256] * 40 + [10],
    'narrow': [784] + [64] * 200 + [10],
}
# An embedding table (rows x width, 51 MB) read 16 rows per sample, mean-pooled, then a
# classifier: a recommender's or a language model's input layer. 'embed-sparse' is the same
# with nn.Embedding(sparse=True): gradients of the rows read only.
EMBED_ROWS, EMBED_WIDTH, EMBED_TOKENS = 200_000, 64, 16
EMBEDS = {'embed': False, 'embed-sparse': True}


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument('--system', choices=['kvps', 'kvps-local', 'ddp'], required=True)
    p.add_argument('--model', choices=sorted([*MODELS, *EMBEDS]), default='wide')
    p.add_argument('--batch', type=int, default=64, help='samples per worker and step')
    p.add_argument('--steps', type=int, default=20)
    p.add_argument('--warmup', type=int, default=3)
    p.add_argument('--out', required=True)
    p.add_argument('--device', default='cpu')
    return p.parse_args()


def build(name, torch):
    if name in EMBEDS:
        return Bag(torch, EMBEDS[name])
    widths = MODELS[name]
    layers = []
    for fan_in, fan_out in zip(widths, widths[1:]):
        layers += [torch.nn.Linear(fan_in, fan_out), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers[:-1])


def Bag(torch, sparse):
    class Bag(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(EMBED_ROWS, EMBED_WIDTH, sparse=sparse)
            self.out = torch.nn.Linear(EMBED_WIDTH, 10)

        def forward(self, ids):
            return self.out(self.emb(ids).mean(1))
    return Bag()


def inputs(args, gen, torch):
    """One batch of this worker's (the same every step)."""
    if args.model in EMBEDS:
        x = torch.randint(0, EMBED_ROWS, (args.batch, EMBED_TOKENS), generator=gen)
    else:
        x = torch.randn(args.batch, MODELS[args.model][0], generator=gen)
    return x, torch.randint(0, 10, (args.batch,), generator=gen)


def ddp_step_fn(args, model, torch):
    import torch.distributed as dist
    dist.init_process_group('gloo', init_method='file://' + os.environ['KVPS_BENCH_RENDEZVOUS'],
                            rank=int(os.environ['RANK']),
                            world_size=int(os.environ['WORLD_SIZE']))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)

    def step(x, y):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
        finish(args, torch)
    return step, dist.get_rank(), dist.barrier


def kvps_step_fn(args, model, torch):
    import kvps
    kv = kvps.create('dist_sync_device' if args.device != 'cpu' else 'dist_sync')
    trainer = kvps.Trainer(model.named_parameters(), 'sgd',
                           {'learning_rate': 0.01, 'momentum': 0.9}, kvstore=kv,
                           update_on_kvstore=args.system == 'kvps')

    def step(x, y):
        trainer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y, reduction='sum').backward()
        trainer.step(args.batch * kv.num_workers)
        finish(args, torch)
    return step, kv.rank, kv.barrier


def finish(args, torch):
    """A step ends when the GPU has done it (a local optimizer step is only queued)."""
    if args.device != 'cpu':
        torch.cuda.synchronize(args.device)


def main():
    args = parse_args()
    import torch
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = build(args.model, torch).to(args.device)
    make = ddp_step_fn if args.system == 'ddp' else kvps_step_fn
    step, rank, barrier = make(args, model, torch)
    gen = torch.Generator().manual_seed(rank)
    x, y = (t.to(args.device) for t in inputs(args, gen, torch))
    for _ in range(args.warmup):
        step(x, y)
    barrier()
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        step(x, y)
        times.append(time.perf_counter() - start)
    barrier()
    params = sum(p.numel() for p in model.parameters())
    record = {'rank': rank, 'system': args.system, 'model': args.model, 'params': params,
              'device': args.device,
              'tensors': len(list(model.parameters())), 'batch': args.batch,
              'ms_step_median': round(statistics.median(times) * 1e3, 3),
              'ms_steps': [round(t * 1e3, 3) for t in times]}
    with open(os.path.join(args.out, f'worker{rank}.json'), 'w') as f:
        json.dump(record, f)


if __name__ == '__main__':
    main()
