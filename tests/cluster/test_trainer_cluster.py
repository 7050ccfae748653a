"""kvps.trainer.Trainer across real processes: MXNet's trainer check, sync equivalence, async
digits, states, mismatches."""

import textwrap
from pathlib import Path

import pytest

pytest.importorskip('torch')

pytestmark = pytest.mark.cluster

EXAMPLE = Path(__file__).resolve().parents[2] / 'examples' / 'train_digits.py'

# Imported by every job script after conftest's PRELUDE.
TORCH = '''
import copy
import torch
from kvps import Trainer
torch.set_num_threads(1)
'''


def script(body, **consts):
    """A job script: TORCH's imports, then ``NAME = value`` lines, then ``body`` dedented."""
    lines = ''.join(f'{name} = {value!r}\n' for name, value in consts.items())
    return TORCH + lines + textwrap.dedent(body)


@pytest.mark.timeout(120)
def test_a_tensor_of_most_of_the_model_is_split_over_the_servers_and_steps_exactly(job):
    """Under MXNet's bound (1e6 elements) a 300,000-element weight would sit whole on one
    server, which would carry 2x the other's bytes; the Trainer splits it."""
    result = job(script('''
        kv = kvps.create('dist_sync')
        w = torch.nn.Parameter(torch.ones(600, 500))
        b = torch.nn.Parameter(torch.ones(500))
        trainer = Trainer([w, b], 'sgd', {'learning_rate': 1.0}, kvstore=kv)
        for _ in range(2):
            trainer.zero_grad()
            ((kv.rank + 1) * (w.sum() + b.sum())).backward()
            trainer.step(1)
        report(w=sorted(set(w.detach().flatten().tolist())), b=sorted(set(b.tolist())),
               servers=sorted({s for s, _, _, _ in kv._keys.parts(0)}),
               b_parts=len(kv._keys.parts(1)))
    '''), workers=2, servers=2, timeout=90)
    assert result.returncode == 0, result.output
    found = result.results()
    assert sorted(found) == [0, 1], result.output
    for values in found.values():
        assert values['w'] == values['b'] == [1.0 - 2 * 3]   # two steps of the sum 1 + 2
        assert values['servers'] == [0, 1] and values['b_parts'] == 1


@pytest.mark.timeout(120)
@pytest.mark.parametrize('workers', [2, 3])
def test_step_sums_every_workers_gradient(job, workers):
    """MXNet's test_gluon_trainer_step: x = ones(10, 1), loss (rank+1)*x, sgd lr 1, step(1)."""
    result = job(script('''
        kv = kvps.create('dist_sync')
        x = torch.nn.Parameter(torch.ones(10, 1))
        trainer = Trainer([x], 'sgd', {'learning_rate': 1.0, 'multi_precision': False},
                          kvstore=kv)
        ((kv.rank + 1) * x).sum().backward()
        trainer.step(1)
        report(x=x.detach().flatten().tolist(), uok=trainer.update_on_kvstore)
    '''), workers=workers, servers=2, timeout=90)
    assert result.returncode == 0, result.output
    expected = 1 - workers * (workers + 1) / 2
    found = result.results()
    assert sorted(found) == list(range(workers)), result.output
    for rank, values in found.items():
        assert values['uok'] is True
        assert values['x'] == [expected] * 10, (rank, values)


@pytest.mark.timeout(120)
@pytest.mark.parametrize('uok', [True, False])
def test_no_sync_accumulates_micro_batches_and_the_last_backward_sends_the_sums(job, uok):
    """DDP's gradient accumulation: two backward passes in no_sync(), a third outside it,
    then step; each worker's .grad sums its three, the servers sum the workers'."""
    result = job(script('''
        kv = kvps.create('dist_sync')
        x = torch.nn.Parameter(torch.ones(10, 1))
        trainer = Trainer([x], 'sgd', {'learning_rate': 1.0}, kvstore=kv,
                          update_on_kvstore=UOK)
        seen = []
        for _ in range(2):
            trainer.zero_grad()
            with trainer.no_sync():
                for _ in range(2):
                    ((kv.rank + 1) * x).sum().backward()
            ((kv.rank + 1) * x).sum().backward()
            trainer.step(1)
            seen.append(sorted(set(x.detach().flatten().tolist())))
        report(seen=seen)
    ''', UOK=uok), workers=2, servers=1, timeout=90)
    assert result.returncode == 0, result.output
    found = result.results()
    assert sorted(found) == [0, 1], result.output
    for values in found.values():   # each step: 3 passes x (1 + 2) over the two workers
        assert values['seen'] == [[1.0 - 9], [1.0 - 18]]


@pytest.mark.timeout(120)
def test_a_torch_optimizer_updates_every_worker_alike_on_the_sums(job):
    """kvps as DDP is used: torch's SGD with momentum on each worker, on the sums of both
    workers' gradients; bit for bit torch alone on the same sums (two gradients add alike in
    either order) over the combined batch."""
    result = job(script('''
        kv = kvps.create('dist_sync')
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2))
        ref = copy.deepcopy(net)
        trainer = Trainer(net, torch.optim.SGD(net.parameters(), lr=0.25, momentum=0.5),
                          kvstore=kv)
        opt = torch.optim.SGD(ref.parameters(), lr=0.25, momentum=0.5)
        x = [torch.linspace(-1, 1, 16).reshape(4, 4) * (r + 1) for r in range(2)]
        same = []
        for step in range(3):
            trainer.zero_grad()
            net(x[kv.rank] + step).sum().backward()
            trainer.step(8)
            opt.zero_grad()
            for r in range(2):
                ref(x[r] + step).sum().backward()
            torch._foreach_mul_([p.grad for p in ref.parameters()], 1 / 8)
            opt.step()
            same.append(all(map(torch.equal, net.parameters(), ref.parameters())))
        report(same=same, uok=trainer.update_on_kvstore)
    '''), workers=2, servers=1, timeout=90)
    assert result.returncode == 0, result.output
    found = result.results()
    assert sorted(found) == [0, 1], result.output
    for values in found.values():
        assert values == {'same': [True] * 3, 'uok': False}


SYNC_VS_SINGLE = '''
    kv = kvps.create('dist_sync')
    rank, nw = kv.rank, kv.num_workers
    torch.manual_seed(rank)          # differs per rank: the Trainer must broadcast rank 0's
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    trainer = Trainer(model.named_parameters(), 'sgd',
                      {'learning_rate': 0.1, 'momentum': 0.9, 'wd': 1e-3},
                      kvstore=kv, update_on_kvstore=UOK)
    # The reference: plain torch on the combined batch (same rule: momentum buffer = -mom/lr).
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3)
    loss_fn = torch.nn.CrossEntropyLoss(reduction='sum')

    def batch(step):
        g = torch.Generator().manual_seed(100 + step)
        return torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)

    def train(start, stop, reference=False):
        for step in range(start, stop):
            x, y = batch(step)
            # beside the reference, odd steps keep the last step's gradients and add to
            # them, as torch.optim users may: each worker's own, not the summed ones
            accumulate = reference and step % 2 == 1
            if not accumulate:
                trainer.zero_grad()
            loss_fn(model(x[rank::nw]), y[rank::nw]).backward()
            trainer.step(len(x))
            if reference:
                if not accumulate:
                    ref_opt.zero_grad()
                (loss_fn(ref(x), y) / len(x)).backward()
                ref_opt.step()

    def snapshot():
        return [p.detach().clone() for p in model.parameters()]

    def distance(a, b):
        return max(float((x - y).abs().max()) for x, y in zip(a, b))

    train(0, 5, reference=True)
    diff = distance(snapshot(), [p.detach() for p in ref.parameters()])
    checksum = float(sum(p.detach().double().sum() for p in model.parameters()))
    # States round trip: save after 5 steps, train 3 more, restore, replay the same 3 steps.
    trainer.save_states(f'a{rank}.states')
    at5 = snapshot()
    train(5, 8)
    at8 = snapshot()
    replay = None
    if not UOK:                      # the weights live on the workers: restore and replay
        for p, w in zip(model.parameters(), at5):
            p.data.copy_(w)
        trainer.load_states(f'a{rank}.states')
        train(5, 8)
        replay = distance(snapshot(), at8)
    trainer.load_states(f'a{rank}.states')
    trainer.save_states(f'b{rank}.states')
    from kvps.optimizer import states
    same = states.read_file(f'a{rank}.states') == states.read_file(f'b{rank}.states')
    keys = len(states.read_file(f'a{rank}.states')['keys'])
    report(diff=diff, checksum=checksum, replay=replay, same=same, keys=keys,
           uok=trainer.update_on_kvstore)
'''


@pytest.mark.timeout(120)
@pytest.mark.parametrize('uok', [True, False])
def test_dist_sync_matches_single_process_and_states_round_trip(job, uok):
    result = job(script(SYNC_VS_SINGLE, UOK=uok), workers=2, servers=2, timeout=90)
    assert result.returncode == 0, result.output
    found = result.results()
    assert sorted(found) == [0, 1], result.output
    for rank, values in found.items():
        assert values['uok'] is uok
        assert values['diff'] < 1e-5, (rank, values)        # same weights as one process
        assert values['same'] and values['keys'] == 4, (rank, values)
        if not uok:
            assert values['replay'] < 1e-6, (rank, values)
    assert found[0]['checksum'] == found[1]['checksum']      # workers identical


@pytest.mark.timeout(120)
@pytest.mark.parametrize('args', [['--kvstore', 'dist_async'], ['--torch-optimizer']])
def test_the_digits_example_reaches_accuracy(job, args):
    """examples/train_digits.py with 2 workers, in dist_async, and in dist_sync with torch's
    SGD on the workers: >= 90% test accuracy (about 96% in dist_sync with 4 workers)."""
    result = job(f'''
        import runpy
        sys.argv = ['train_digits.py', *{args!r}, '--epochs', '8']
        try:
            runpy.run_path({str(EXAMPLE)!r}, run_name='__main__')
        except SystemExit as exc:
            assert not exc.code, exc.code
    ''', workers=2, servers=1, timeout=100)
    assert result.returncode == 0, result.output
    accuracies = [float(line.split('test accuracy ')[1].split()[0])
                  for line in result.stdout.splitlines() if 'test accuracy' in line]
    assert len(accuracies) == 2, result.output
    assert min(accuracies) >= 0.90, result.output
    assert 'epoch 8/8' in result.stdout                       # rank 0's progress bar


@pytest.mark.timeout(120)
@pytest.mark.parametrize('mode', ['dist_sync', 'dist_async'])
def test_workers_with_different_parameters_get_a_clear_error(job, mode):
    """Rank 1's shape and rank 2's name differ from rank 0's: every worker gets the error."""
    result = job(script('''
        kv = kvps.create(MODE)
        shape = (4, 3) if kv.rank == 1 else (4, 2)
        name = 'v' if kv.rank == 2 else 'w'
        try:
            Trainer({name: torch.nn.Parameter(torch.ones(shape))}, 'sgd', kvstore=kv)
            report(error=None)
        except kvps.KVPSError as exc:
            report(error=type(exc).__name__, message=str(exc))
    ''', MODE=mode), workers=3, servers=1, timeout=90)
    assert result.returncode == 0, result.output
    found = result.results()
    assert sorted(found) == [0, 1, 2], result.output
    for values in found.values():
        assert values['error'] == 'ParameterMismatchError', found
    assert "differ from rank 0's" in found[1]['message'] and 'w: (4, 3)' in found[1]['message']
    assert "differ from rank 0's" in found[2]['message'] and 'v: (4, 2)' in found[2]['message']
    assert '2 worker(s) of this job (ranks 1, 2)' in found[0]['message']


@pytest.mark.timeout(120)
def test_workers_fusing_parameters_differently_get_a_clear_error(job):
    """Same parameters, but rank 1 keeps one key per parameter (fuse=False): its store keys
    would differ from rank 0's, so every worker is told why before any key is sent."""
    result = job(script('''
        kv = kvps.create('dist_sync')
        params = [torch.nn.Parameter(torch.ones(n)) for n in (4, 3, 2)]
        try:
            Trainer(params, 'sgd', kvstore=kv, fuse=kv.rank != 1)
            report(error=None)
        except kvps.KVPSError as exc:
            report(error=type(exc).__name__, message=str(exc))
    '''), workers=2, servers=1, timeout=90)
    assert result.returncode == 0, result.output
    found = result.results()
    assert sorted(found) == [0, 1], result.output
    for values in found.values():
        assert values['error'] == 'ParameterMismatchError', found
        assert 'rank(s) 1 pack parameters into shared store keys' in values['message'], found
        assert 'the same fuse and bucket_bytes' in values['message'], found


GAN_FREEZING = '''
    kv = kvps.create(MODE)
    torch.manual_seed(0)
    def build():   # a GAN's two halves in one Trainer (README's recipe), small enough to fuse
        return [torch.nn.Parameter(torch.randn(n)) for n in (30, 7, 12, 5, 9, 4)]
    params, ref = build(), build()
    with torch.no_grad():
        for p, r in zip(params, ref):
            r.copy_(p)
    opt = {'learning_rate': 0.05, 'wd': 0.01}
    trainer = Trainer(params, 'adam', dict(opt), kvstore=kv)
    local = Trainer(ref, 'adam', dict(opt), kvstore=None)      # one process, no store
    fused_at_start = len(trainer._layout.fused)

    def step(ps, t, i, batch):
        for j, p in enumerate(ps):      # both halves at first, then one at a time
            p.requires_grad_(i < 2 or (j < 3) == (i % 2 == 0))
        t.zero_grad()
        g = torch.Generator().manual_seed(i)     # the same data on every worker
        sum((torch.randn(p.shape, generator=g) * p * p).sum() for p in ps
            if p.requires_grad).backward()
        t.step(batch, ignore_stale_grad=True)

    for i in range(8):
        step(params, trainer, i, kv.num_workers)   # summed over workers, scaled back
        step(ref, local, i, 1)
    diff = max(float((p - r).abs().max()) for p, r in zip(params, ref))
    kv.barrier()   # async: every worker's pushes are applied, so the counts are final
    trainer.save_states(f's{kv.rank}')
    from kvps.optimizer import states
    report(diff=diff, fused_at_start=fused_at_start, fused=len(trainer._layout.fused),
           counts=[[k, count] for k, count, _ in states.read_file(f's{kv.rank}')['keys']])
'''


@pytest.mark.timeout(120)
@pytest.mark.parametrize('mode, workers', [('dist_sync', 2), ('dist_async', 1),
                                           ('dist_async', 2)])
def test_fused_keys_split_by_freezing_train_as_one_process_does(job, mode, workers):
    """Parameters sharing a fused key, then frozen apart (a GAN's alternating halves): the key
    is split over 2 servers, its members get keys of their own with their Adam moments and
    counts, and no update is lost or doubled: each parameter trains in 5 of the 8 steps, so
    the servers count 5 updates of it in dist_sync (one per round) and 5 per worker in
    dist_async (one per push). Where the servers apply one sequence of updates, training
    matches one process bit for bit: in dist_sync (the same data on every worker, so the
    round's sum scaled back is the one process's gradient) and in dist_async with one
    worker. Two async workers' pushes are applied in the order they arrive, each with the
    weights its worker last pulled, so their weights have no one-process reference; their
    update counts are exact all the same."""
    result = job(script(GAN_FREEZING, MODE=mode), workers=workers, servers=2, timeout=90,
                 env={'KVPS_BIGARRAY_BOUND': '40'})
    assert result.returncode == 0, result.output
    found = result.results()
    assert sorted(found) == list(range(workers)), result.output
    updates = 5 * (workers if mode == 'dist_async' else 1)
    for values in found.values():
        assert values['fused_at_start'] == 1 and values['fused'] == 0, values
        assert values['counts'] == [[key, updates] for key in range(6)], values
        if mode == 'dist_sync' or workers == 1:
            assert values['diff'] == 0, values


@pytest.mark.timeout(120)
def test_a_grad_scaler_skips_a_step_on_every_worker_when_one_overflowed(job):
    """torch's GradScaler with the workers updating: an inf on one worker (a NaN on the
    other, later) reaches every worker in the sums, so all skip that step and back off alike;
    the other steps give bit for bit what torch.optim.SGD gives on both workers' gradients
    under one scaler (powers of two: the scaling is exact)."""
    result = job(script('''
        kv = kvps.create('dist_sync')
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
        ref = copy.deepcopy(net)
        trainer = Trainer(net, 'sgd', {'learning_rate': 0.25}, kvstore=kv,
                          update_on_kvstore=False)
        opt = torch.optim.SGD(ref.parameters(), lr=0.25)
        scaler, ref_scaler = [torch.amp.GradScaler('cpu', init_scale=2.0 ** 10,
                                                   growth_interval=2) for _ in range(2)]
        x = [torch.arange(8.0).reshape(2, 4) / 8 + r for r in range(2)]
        loss = lambda m, r, step: m(x[r]).sum() * float(FACTORS[r][step])
        scales, same = [], []
        for step in range(len(FACTORS[0])):
            trainer.zero_grad()
            scaler.scale(loss(net, kv.rank, step)).backward()
            trainer.allreduce_grads()
            scaler.step(trainer, 1)
            scaler.update()
            opt.zero_grad()
            for r in range(2):   # .grad: the sum of both, added as the server adds them
                ref_scaler.scale(loss(ref, r, step)).backward()
            ref_scaler.step(opt)
            ref_scaler.update()
            scales.append([scaler.get_scale(), ref_scaler.get_scale()])
            same.append(all(map(torch.equal, net.parameters(), ref.parameters())))
        report(scales=scales, same=same,
               weights=torch.cat([p.detach().flatten() for p in net.parameters()]).tolist())
    ''', FACTORS=[[1, 1, 2, 'nan', 0.5], [1, 'inf', 2, 1, 0.5]]),
        workers=2, servers=1, timeout=90)
    assert result.returncode == 0, result.output
    found = result.results()
    assert sorted(found) == [0, 1], result.output
    for values in found.values():
        assert values['scales'] == [[s, s] for s in (1024.0, 512.0, 512.0, 256.0, 256.0)]
        assert values['same'] == [True] * 5
    assert found[0]['weights'] == found[1]['weights']
