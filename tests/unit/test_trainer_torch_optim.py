"""A torch.optim optimizer given to the Trainer: the workers update with it on the summed
gradients, left in each .grad; the same weights as torch alone, its learning rate and state
reachable through the Trainer, and refusals where it cannot run."""

import pytest

torch = pytest.importorskip('torch')

import kvps  # noqa: E402
from kvps import Trainer  # noqa: E402
from kvps.kvstore import KVStore  # noqa: E402
from kvps.kvstore.local import LocalBackend  # noqa: E402

X = torch.linspace(-1, 1, 32).reshape(8, 4)


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2))


def adamw(net):
    return torch.optim.AdamW(net.parameters(), lr=0.01, weight_decay=0.1)


def torch_alone(steps, batch=4):
    """torch's loop: the summed loss's gradients over ``batch``, AdamW."""
    net = model()
    opt = adamw(net)
    for step in range(steps):
        opt.zero_grad()
        (net(X * (step + 1)).sum()).backward()
        torch._foreach_mul_([p.grad for p in net.parameters()], 1 / batch)
        opt.step()
    return net


def through_trainer(steps, store, fuse=True, batch=4):
    net = model()
    t = Trainer(net, adamw(net), kvstore=store, fuse=fuse)
    for step in range(steps):
        t.zero_grad()
        (net(X * (step + 1)).sum()).backward()
        t.step(batch)
    return net, t


@pytest.mark.parametrize('store', [None, 'local', 'dist_sync'])
@pytest.mark.parametrize('fuse', [True, False])
def test_a_torch_optimizer_trains_as_in_torch_alone(store, fuse):
    kv = KVStore(store, LocalBackend()) if store else None
    net, t = through_trainer(3, kv, fuse)
    assert t.update_on_kvstore is False
    assert all(map(torch.equal, net.parameters(), torch_alone(3).parameters()))


def test_its_learning_rate_is_the_trainers():
    net = model()
    opt = torch.optim.SGD([{'params': net[0].parameters()},
                           {'params': net[2].parameters(), 'lr': 0.5}], lr=0.25)
    t = Trainer(net, opt, kvstore=kvps.create('local'))
    assert t.learning_rate == 0.25
    t.set_learning_rate(0.125)
    assert [g['lr'] for g in opt.param_groups] == [0.125, 0.125]
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)   # torch's own
    opt.step()                 # (no gradients: nothing moves; torch wants it before the next)
    scheduler.step()
    assert t.learning_rate == 0.0625


def test_its_state_saves_and_loads_through_the_trainer(tmp_path):
    """Two steps, save, a fresh model and optimizer load, one more step: as three at once."""
    net, t = through_trainer(2, kvps.create('local'))
    t.save_states(tmp_path / 'opt')
    fresh = model()
    fresh.load_state_dict(net.state_dict())
    t2 = Trainer(fresh, adamw(fresh), kvstore=kvps.create('local'))
    t2.load_states(tmp_path / 'opt')
    t2.zero_grad()
    (fresh(X * 3).sum()).backward()
    t2.step(4)
    assert all(map(torch.equal, fresh.parameters(), torch_alone(3).parameters()))


def test_an_optimizer_over_other_tensors_is_refused():
    """Stepped on each worker's own gradient, they would drift apart between workers."""
    net, other = model(), torch.nn.Linear(2, 2)
    opt = torch.optim.SGD([*net.parameters(), *other.parameters()], lr=0.1)
    with pytest.raises(ValueError, match='2 tensor.*same parameters'):
        Trainer(net, opt, kvstore=KVStore('dist_sync', LocalBackend()))
    Trainer(net, torch.optim.SGD(net[0].parameters(), lr=0.1), kvstore=None)   # a subset


def test_the_servers_cannot_run_it():
    net = model()
    with pytest.raises(ValueError, match='no code travels'):
        Trainer(net, adamw(net), kvstore=kvps.create('local'), update_on_kvstore=True)
    with pytest.raises(ValueError, match='async'):
        Trainer(net, adamw(net), kvstore=KVStore('dist_async', LocalBackend()))
    with pytest.raises(ValueError, match='optimizer_params'):
        Trainer(net, adamw(net), {'learning_rate': 0.1})


def test_sparse_gradients_come_back_dense_as_the_sums_of_their_rows():
    def run(kv):
        torch.manual_seed(0)
        emb = torch.nn.Embedding(10, 3, sparse=True)
        t = Trainer(emb, torch.optim.SGD(emb.parameters(), lr=0.5), kvstore=kv)
        for ids in ([1, 4, 4], [2, 9]):
            t.zero_grad()
            emb(torch.tensor(ids)).sum().backward()
            t.step(1)
        return emb.weight.detach(), emb.weight.grad
    (alone, sparse), (summed, dense) = run(None), run(KVStore('dist_sync', LocalBackend()))
    assert sparse.layout == torch.sparse_coo and dense.layout == torch.strided
    assert torch.equal(dense, sparse.to_dense()) and torch.equal(summed, alone)


def test_alone_a_stale_parameter_is_skipped_with_ignore_stale_grad():
    """As with kvps's optimizers: a parameter backward did not reach since the last step is
    left alone (its old .grad is neither applied again nor scaled)."""
    net = model()
    t = Trainer(net, torch.optim.SGD(net.parameters(), lr=0.5), kvstore=None)
    net(X).sum().backward()
    t.step(1)
    first = [p.detach().clone() for p in net.parameters()]
    old = net[0].weight.grad
    for p in net[2].parameters():
        p.grad = None
    net[2](torch.ones(2, 3)).sum().backward()       # only the last layer
    with pytest.raises(kvps.StaleGradientError):
        t.step(1)
    t.step(1, ignore_stale_grad=True)
    assert torch.equal(net[0].weight, first[0]) and net[0].weight.grad is old
    assert not torch.equal(net[2].weight, first[2])
