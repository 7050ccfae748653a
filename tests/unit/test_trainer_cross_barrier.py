"""The Trainer's priorities (the first layers first) and its cross-barrier steps, in one process
on the in-process backend: orders and values, never timings."""

import pytest

torch = pytest.importorskip('torch')

from kvps import Trainer  # noqa: E402
from kvps.kvstore import KVStore  # noqa: E402
from kvps.kvstore.local import LocalBackend  # noqa: E402


class CallLog(KVStore):
    """A dist_sync store on the in-process backend that records (call, keys, priority)."""

    def __init__(self):
        super().__init__('dist_sync', LocalBackend())
        self.calls = []

    def push(self, key, value, priority=0):
        self.calls.append(('push', sorted(key), priority))
        super().push(key, value, priority)

    def pull(self, key, out=None, priority=0, ignore_sparse=True):
        self.calls.append(('pull at step', sorted(key), priority))
        super().pull(key, out, priority)

    def pull_begin(self, key, out, priority=0):
        self.calls.append(('pull', sorted(key), priority))
        return super().pull_begin(key, out, priority)


def model():
    """Layer 0's weight is big enough to keep a key of its own (keys 0, 1, 2, 3); its bias and
    layer 2's parameters share fused key 4."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(256, 600), torch.nn.ReLU(),
                               torch.nn.Linear(600, 4))


class Embedded(torch.nn.Module):
    """A sparse embedding (its rows pulled into the weights, waited for at step) and a
    layer after it."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(1000, 256, sparse=True)
        self.out = torch.nn.Linear(256, 4)

    def forward(self, x):
        return self.out(self.embed((x.abs() * 100).long() % 1000).mean(1))


def train_step(net, trainer, seed):
    torch.manual_seed(seed)
    trainer.zero_grad()
    net(torch.randn(8, 256)).square().sum().backward()
    trainer.step(8)


def test_the_first_parameters_are_pushed_and_pulled_with_the_highest_priority():
    params = [torch.nn.Parameter(torch.zeros(256)) for _ in range(4)]   # 1 KiB each
    store = CallLog()
    t = Trainer(params, 'sgd', {'learning_rate': 1.0}, kvstore=store, fuse=False,
                bucket_bytes=2048)
    sum(p.sum() for p in params).backward()
    store.calls.clear()
    t.step(1)                    # the servers get the optimizer: everything leaves here
    assert store.calls == [('push', [0, 1], 0), ('pull', [0, 1], 0), ('push', [2, 3], -2),
                           ('pull', [2, 3], -2)]
    store.calls.clear()
    sum(p.sum() for p in params).backward()
    # backward reaches the last parameters first; each bucket's priority is its first's
    assert store.calls == [('push', [2, 3], -2), ('pull', [2, 3], -2), ('push', [0, 1], 0),
                           ('pull', [0, 1], 0)]
    t.step(1)


@pytest.mark.parametrize('fuse', [False, True])
def test_a_cross_barrier_step_leaves_each_modules_weights_to_its_forward(fuse):
    net = model()
    before = [p.detach().clone() for p in net.parameters()]
    t = Trainer(net, 'sgd', {'learning_rate': 0.1}, kvstore=CallLog(), fuse=fuse,
                cross_barrier=True)
    train_step(net, t, 1)
    assert all(torch.equal(p, b) for p, b in zip(net.parameters(), before))   # not landed
    seen = {}

    def first_layer_runs(module, args):   # (after the Trainer's hook on the same module)
        seen['own weight moved'] = not torch.equal(module.weight, before[0])
        seen['next layer moved'] = not torch.equal(net[2].weight, before[2])
    net[0].register_forward_pre_hook(first_layer_runs)
    net(torch.randn(1, 256))
    # fused, layer 0's bias shares key 4 with layer 2's parameters: they land with it
    assert seen == {'own weight moved': True, 'next layer moved': fuse}
    assert not any(torch.equal(p, b) for p, b in zip(net.parameters(), before))


def test_wait_and_save_states_land_what_no_forward_has_read(tmp_path):
    net = model()
    t = Trainer(net, 'sgd', {'learning_rate': 0.1}, kvstore=CallLog(), cross_barrier=True)
    train_step(net, t, 1)
    weight = net[0].weight.detach().clone()
    t.wait()
    assert not torch.equal(net[0].weight, weight)
    train_step(net, t, 2)
    weight = net[0].weight.detach().clone()
    t.save_states(tmp_path / 'states')
    assert not torch.equal(net[0].weight, weight)


def test_the_next_backward_lands_every_weight_before_its_gradients_leave():
    net = model()
    t = Trainer(net, 'sgd', {'learning_rate': 0.1}, kvstore=CallLog(), cross_barrier=True)
    train_step(net, t, 1)
    weight = net[0].weight.detach().clone()
    sum(p.sum() for p in net.parameters()).backward()   # no forward of the modules
    assert not torch.equal(net[0].weight, weight)


@pytest.mark.parametrize('make, overlap', [(model, True), (model, False), (Embedded, True)])
def test_cross_barrier_steps_give_the_waiting_steps_weights_bit_for_bit(make, overlap):
    nets = [make(), make()]
    trainers = [Trainer(net, 'sgd', {'learning_rate': 0.1, 'momentum': 0.9}, kvstore=CallLog(),
                        overlap=overlap, cross_barrier=crossing)
                for net, crossing in zip(nets, (False, True))]
    for seed in range(4):
        for net, t in zip(nets, trainers):
            train_step(net, t, seed)
    trainers[1].wait()
    for a, b in zip(*(net.parameters() for net in nets)):
        assert torch.equal(a, b)


def test_cross_barrier_is_refused_where_it_cannot_work():
    with pytest.raises(ValueError, match='pass the module itself'):
        Trainer(list(model().parameters()), 'sgd', kvstore=CallLog(), cross_barrier=True)
    for kvstore, update in ((CallLog(), False), (None, None)):
        with pytest.raises(ValueError, match='servers update'):
            Trainer(model(), 'sgd', kvstore=kvstore, update_on_kvstore=update,
                    cross_barrier=True)
