"""torch's GradScaler drives a Trainer whose workers update: it unscales the sums that
allreduce_grads() leaves in .grad and steps, or skips a step whose sums hold inf or NaN,
as with a torch optimizer; where the store updates it is refused, saying what to do."""

import pytest

torch = pytest.importorskip('torch')

import kvps  # noqa: E402
from kvps import Trainer  # noqa: E402
from kvps.kvstore import KVStore  # noqa: E402
from kvps.kvstore.local import LocalBackend  # noqa: E402

STEPS = [1.0, float('inf'), 2.0, float('nan'), 0.5]   # a gradient factor each step


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))


def batch(factor):
    """A loss whose gradients are `factor` times a fixed one (inf/NaN: an overflow)."""
    return lambda net: net(torch.arange(8.0).reshape(2, 4) / 8).sum() * factor


def train(optimizer_of, reduce=lambda opt: None, clip=None, steps=STEPS):
    """Weights after ``steps`` under a GradScaler (powers of two: the scaling is exact), and
    the scales it went through; ``clip``: unscaled first, then clipped to that norm."""
    net = model()
    opt = optimizer_of(net)
    scaler = torch.amp.GradScaler('cpu', init_scale=2.0 ** 10, growth_interval=2)
    scales = []
    for factor in steps:
        opt.zero_grad()
        scaler.scale(batch(factor)(net)).backward()
        reduce(opt)
        if clip is not None:
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(net.parameters(), clip)
        scaler.step(opt, *([] if isinstance(opt, torch.optim.Optimizer) else [1]))
        scaler.update()
        scales.append(scaler.get_scale())
    return [p.detach().clone() for p in net.parameters()], scales


@pytest.mark.parametrize('clip', [None, 0.5])
@pytest.mark.parametrize('fuse', [True, False])
@pytest.mark.parametrize('store', [None, 'local'])
@pytest.mark.parametrize('optimizer', ['kvps', 'torch'])
def test_a_trainer_under_a_grad_scaler_trains_as_torch_sgd_does(store, fuse, clip, optimizer):
    """Steps with inf or NaN are skipped and the scale backs off, finite ones are applied
    unscaled (and clipped, where unscale_ came first): bit for bit torch.optim.SGD's weights
    and scales under the same scaler, with kvps's SGD or torch's in the Trainer."""
    want = train(lambda net: torch.optim.SGD(net.parameters(), lr=0.25), clip=clip)

    def trainer(net):
        kv = None if store is None else kvps.create(store)
        if optimizer == 'torch':
            return Trainer(net, torch.optim.SGD(net.parameters(), lr=0.25), kvstore=kv,
                           fuse=fuse)
        return Trainer(net, 'sgd', {'learning_rate': 0.25}, kvstore=kv,
                       update_on_kvstore=False, fuse=fuse)
    got = train(trainer, reduce=lambda t: t.allreduce_grads(), clip=clip)   # (alone: nothing)
    assert got[1] == want[1] == [1024.0, 512.0, 512.0, 256.0, 256.0]
    for g, w in zip(got[0], want[0]):
        assert torch.equal(g, w)


def test_a_skipped_step_leaves_the_weights_and_the_next_one_applies():
    net = model()
    start = [p.detach().clone() for p in net.parameters()]
    t = Trainer(net, 'sgd', {'learning_rate': 0.25}, kvstore=kvps.create('local'),
                update_on_kvstore=False)
    scaler = torch.amp.GradScaler('cpu', init_scale=4.0)
    scaler.scale(batch(float('inf'))(net)).backward()
    t.allreduce_grads()
    scaler.step(t, 1)                     # inf: skipped, the step ends unapplied
    scaler.update()
    assert all(torch.equal(p, s) for p, s in zip(net.parameters(), start))
    t.zero_grad()
    scaler.scale(batch(1.0)(net)).backward()
    t.allreduce_grads()
    scaler.step(t, 1)
    assert not torch.equal(next(net.parameters()), start[0])


def test_a_scaler_is_refused_where_the_store_updates():
    net = model()
    t = Trainer(net, 'sgd', kvstore=kvps.create('local'), update_on_kvstore=True)
    scaler = torch.amp.GradScaler('cpu')
    scaler.scale(batch(1.0)(net)).backward()
    with pytest.raises(RuntimeError, match='update_on_kvstore=False'):
        scaler.step(t, 1)


def test_in_a_job_the_scaler_waits_for_allreduce_grads():
    """Unscaled and checked before the sums, each worker's own gradient could send some
    workers to step and others to skip: refused, before anything is pushed or applied."""
    net = model()
    start = [p.detach().clone() for p in net.parameters()]
    t = Trainer(net, 'sgd', kvstore=KVStore('dist_sync', LocalBackend()),
                update_on_kvstore=False)
    scaler = torch.amp.GradScaler('cpu')
    scaler.scale(batch(1.0)(net)).backward()
    with pytest.raises(RuntimeError, match='allreduce_grads'):
        scaler.step(t, 1)
    assert all(torch.equal(p, s) for p, s in zip(net.parameters(), start))
    t.allreduce_grads()
    scaler.step(t, 1)
    scaler.update()
    assert not torch.equal(next(net.parameters()), start[0])


def test_a_fixed_scale_where_the_store_updates_is_folded_into_the_batch_size():
    """docs/trainer.md: the loss times S and step(batch_size * S) give the unscaled steps."""
    def run(scale):
        net = model()
        t = Trainer(net, 'sgd', {'learning_rate': 0.25, 'momentum': 0.5},
                    kvstore=kvps.create('local'), update_on_kvstore=True)
        for factor in (1.0, 2.0, 0.5):
            t.zero_grad()
            (batch(factor)(net) * scale).backward()
            t.step(2 * scale)
        return list(net.parameters())
    assert all(map(torch.equal, run(2.0 ** 12), run(1.0)))


def test_param_groups_lr_is_the_trainers_to_read_and_set():
    """torch code sets group['lr'] (warm-ups): it sets the Trainer's learning rate."""
    t = Trainer(model(), 'sgd', {'learning_rate': 0.25}, kvstore=kvps.create('local'),
                update_on_kvstore=True)
    group, = t.param_groups
    assert group['lr'] == 0.25
    group['lr'] = 0.125
    assert t.learning_rate == t.param_groups[0]['lr'] == 0.125
    with pytest.raises(KeyError, match="only 'lr'"):
        group['momentum'] = 0.9
