#!/usr/bin/env python
"""Worker of bench_training: times training steps of a torch model, through kvps, torch DDP, or
one process alone.

Systems (--system):
  kvps        kvps.Trainer on dist_sync, SGD with momentum on the servers (update_on_kvstore)
  kvps-local  kvps.Trainer on dist_sync, gradients summed through the servers, SGD on the worker
  kvps-torch  as kvps-local, with torch.optim.SGD on the worker (DDP's optimizer) in the Trainer
  kvps-cb     kvps as above with cross_barrier=True: the step returns once its pushes are sent,
              and the next forward waits for each module's weights as it reaches it (BytePS's
              cross-barrier)
  ddp         torch.nn.parallel.DistributedDataParallel over gloo, torch.optim.SGD locally
  alone       one process on the global batch (the --workers workers' batches together),
              torch.optim.SGD, no communication at all: the limit the others are measured
              against (on the CPU it runs --workers torch threads, the cores the workers use)
With --device cuda the model and batches live on the GPU and fp32 matmuls and convolutions run
in TF32, as fp32 training on such GPUs usually does: kvps uses dist_sync_device (sums and
staging on the GPU, pinned transfers), DDP all-reduces CUDA tensors over gloo (NCCL refuses
two ranks on one GPU, and a one-GPU box is what this measures).
kvps workers are started by `python -m kvps.launch`; DDP workers (and the lone process) by
bench_training.py with RANK, WORLD_SIZE and KVPS_BENCH_RENDEZVOUS (a file for gloo's
FileStore: no fixed port).

One step = forward, backward, and the optimizer step on every worker (synchronous data
parallel training, the same arithmetic in every system: the mean loss over the global batch).
Every worker's batch is drawn once from a generator seeded by its rank. Writes
<out>/worker<rank>.json with the per-step times after warm-up and the loss of the first and
the last step (it must go down: the model learns its fixed batch); with --profile N, also
the summary of N more steps under torch.profiler.
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
# Realistic models, built in models.py (imported only when one runs): per size, the
# constructor's arguments and the batch per worker. 'full' is issue 30's size, the default on
# a GPU: ResNet-18 at width 64 (11.2M parameters) on 64 images; the GPT at 25.3M parameters
# on 8 sequences of 256 tokens (2048 tokens a worker, a few ms of TF32 on an H100), a 12288
# token vocabulary making its tied embedding a quarter of the weights, as in small GPTs.
# 'small', the default on the CPU, keeps the shapes (62 and 76 tensors) at a step of tens of
# ms on one thread: width 16 (0.70M), and d 128 over 64 tokens of 2048 (1.46M).
NETS = {
    'resnet': {'full': {'width': 64, 'batch': 64}, 'small': {'width': 16, 'batch': 32}},
    'gpt': {'full': {'vocab': 12288, 'seq': 256, 'dim': 512, 'heads': 8, 'layers': 6,
                     'batch': 8},
            'small': {'vocab': 2048, 'seq': 64, 'dim': 128, 'heads': 4, 'layers': 6,
                      'batch': 8}},
}
SYSTEMS = ('kvps', 'kvps-local', 'kvps-torch', 'kvps-cb', 'ddp', 'alone')
DEFAULT_BATCH = 64   # per worker, for the MLPs and the embedding tables


def default_size(device):
    """The realistic models' size on ``device``: the issue's on a GPU, small on the CPU."""
    return 'small' if device == 'cpu' else 'full'


def default_batch(model, size):
    return NETS[model][size]['batch'] if model in NETS else DEFAULT_BATCH


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument('--system', choices=SYSTEMS, required=True)
    p.add_argument('--model', choices=sorted([*MODELS, *EMBEDS, *NETS]), default='wide')
    p.add_argument('--batch', type=int, default=None,
                   help='samples per worker and step (default: the model\'s)')
    p.add_argument('--size', choices=['full', 'small'], default=None,
                   help='resnet and gpt: full (default on a GPU) or small (on the CPU)')
    p.add_argument('--workers', type=int, default=1,
                   help='alone: the workers whose batches it trains on together')
    p.add_argument('--steps', type=int, default=20)
    p.add_argument('--warmup', type=int, default=3)
    p.add_argument('--out', required=True)
    p.add_argument('--device', default='cpu')
    p.add_argument('--amp', action='store_true', help='the forward in bfloat16 (autocast)')
    p.add_argument('--bucket-bytes', type=int, default=None,
                   help='kvps: the Trainer\'s bucket_bytes (default: its own, by the hosts)')
    p.add_argument('--profile', type=int, default=0, metavar='N',
                   help='then N more steps under torch.profiler (step_profile.py): its summary '
                        'in the record, rank 0\'s Chrome trace in torch-trace.json.gz')
    args = p.parse_args()
    args.size = args.size or default_size(args.device)
    args.batch = args.batch or default_batch(args.model, args.size)
    return args


def build(args, torch):
    if args.model in NETS:
        import models   # torch-only, and beside this file
        return models.build(args.model, NETS[args.model][args.size])
    if args.model in EMBEDS:
        return Bag(torch, EMBEDS[args.model])
    widths = MODELS[args.model]
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
    """One batch of one worker's (the same every step)."""
    if args.model in NETS:
        import models
        return models.batch(args.model, NETS[args.model][args.size], args.batch, gen)
    if args.model in EMBEDS:
        x = torch.randint(0, EMBED_ROWS, (args.batch, EMBED_TOKENS), generator=gen)
    else:
        x = torch.randn(args.batch, MODELS[args.model][0], generator=gen)
    return x, torch.randint(0, 10, (args.batch,), generator=gen)


def data(args, rank, torch):
    """This worker's batch, drawn from a generator seeded by its rank; alone's is the batches
    of ranks 0 to --workers - 1 together."""
    ranks = range(args.workers) if args.system == 'alone' else [rank]
    parts = [inputs(args, torch.Generator().manual_seed(r), torch) for r in ranks]
    return [torch.cat(tensors).to(args.device) for tensors in zip(*parts)]


def loss_of(args, model, x, y, torch, reduction='mean'):
    """Cross-entropy over every prediction: a class per sample, or the next token per
    position (the sequence models' outputs and targets are flattened). With --amp the
    forward runs under autocast in bfloat16 (float32 weights and gradients: no loss scaling)."""
    with torch.autocast(torch.device(args.device).type, torch.bfloat16, enabled=args.amp):
        out = model(x)
    return torch.nn.functional.cross_entropy(out.float().flatten(0, -2), y.flatten(),
                                             reduction=reduction)


def torch_step_fn(args, model, opt, torch):
    """A step of torch's own: the mean loss, backward (DDP all-reduces in it), opt.step()."""
    def step(x, y):
        opt.zero_grad()
        loss = loss_of(args, model, x, y, torch)
        loss.backward()
        opt.step()
        finish(args, torch)
        return loss.detach()
    return step


def ddp_step_fn(args, model, torch):
    import torch.distributed as dist
    dist.init_process_group('gloo', init_method='file://' + os.environ['KVPS_BENCH_RENDEZVOUS'],
                            rank=int(os.environ['RANK']),
                            world_size=int(os.environ['WORLD_SIZE']))
    # each rank keeps its own BatchNorm statistics, as kvps's workers do: the same work
    ddp = torch.nn.parallel.DistributedDataParallel(model, broadcast_buffers=False)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
    return torch_step_fn(args, ddp, opt, torch), dist.get_rank(), dist.barrier


def alone_step_fn(args, model, torch):
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    return torch_step_fn(args, model, opt, torch), 0, lambda: None


def kvps_step_fn(args, model, torch):
    import kvps
    kv = kvps.create('dist_sync_device' if args.device != 'cpu' else 'dist_sync')
    cross_barrier = args.system == 'kvps-cb'   # (it hooks the modules' forwards)
    if args.system == 'kvps-torch':   # the optimizer DDP's workers run, in the Trainer
        optimizer, params = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9), None
    else:
        optimizer, params = 'sgd', {'learning_rate': 0.01, 'momentum': 0.9}
    trainer = kvps.Trainer(model if cross_barrier else model.named_parameters(), optimizer,
                           params, kvstore=kv,
                           update_on_kvstore=args.system not in ('kvps-local', 'kvps-torch'),
                           cross_barrier=cross_barrier, bucket_bytes=args.bucket_bytes)

    def step(x, y):
        trainer.zero_grad()
        loss = loss_of(args, model, x, y, torch, reduction='sum')
        loss.backward()
        trainer.step(y.numel() * kv.num_workers)   # the mean over the global batch
        finish(args, torch)
        return loss.detach() / y.numel()
    return step, kv.rank, kv.barrier


STEP_FNS = {'kvps': kvps_step_fn, 'kvps-local': kvps_step_fn, 'kvps-torch': kvps_step_fn,
            'kvps-cb': kvps_step_fn, 'ddp': ddp_step_fn, 'alone': alone_step_fn}


def finish(args, torch):
    """A step ends when the GPU has done it (a local optimizer step is only queued)."""
    if args.device != 'cpu':
        torch.cuda.synchronize(args.device)


def timed_steps(args, step, barrier, x, y):
    """Seconds of each step after the warm-up, and the loss of the first and the last step."""
    times, losses = [], []
    for i in range(args.warmup + args.steps):
        if i == args.warmup:
            barrier()
        start = time.perf_counter()
        losses.append(step(x, y))
        times.append(time.perf_counter() - start)
    barrier()
    return times[args.warmup:], losses[0].item(), losses[-1].item()


def profile_steps(args, rank, step, barrier, x, y):
    """The summary of --profile more steps under torch.profiler (after the timed ones, which
    it does not slow), every worker alike (a sync job's workers step together)."""
    import step_profile   # torch.profiler, beside this file
    trace = os.path.join(args.out, 'torch-trace.json.gz') if rank == 0 else None
    summary = step_profile.profiled(step, x, y, args.profile, args.device, trace)
    barrier()
    return summary


def main():
    args = parse_args()
    import torch
    alone_on_cpu = args.system == 'alone' and args.device == 'cpu'
    torch.set_num_threads(args.workers if alone_on_cpu else 1)
    if args.device != 'cpu':
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    torch.manual_seed(0)
    model = build(args, torch).to(args.device)
    step, rank, barrier = STEP_FNS[args.system](args, model, torch)
    x, y = data(args, rank, torch)
    times, loss_first, loss_last = timed_steps(args, step, barrier, x, y)
    profiled = profile_steps(args, rank, step, barrier, x, y) if args.profile else None
    params = sum(p.numel() for p in model.parameters())
    record = {'rank': rank, 'system': args.system, 'model': args.model, 'params': params,
              'device': args.device, 'size': args.size if args.model in NETS else None,
              'tensors': len(list(model.parameters())), 'batch': args.batch,
              'ms_step_median': round(statistics.median(times) * 1e3, 3),
              'ms_steps': [round(t * 1e3, 3) for t in times],
              'loss_first': round(loss_first, 4), 'loss_last': round(loss_last, 4),
              **({'profile': profiled} if profiled else {})}
    with open(os.path.join(args.out, f'worker{rank}.json'), 'w') as f:
        json.dump(record, f)


if __name__ == '__main__':
    main()
