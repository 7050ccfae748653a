"""kvps.trainer.Trainer in one process: Gluon's decision rules, scaling, lr, states, parameters."""

import contextlib

import numpy as np
import pytest

torch = pytest.importorskip('torch')

import kvps
from kvps.trainer import params as _trainer_params  # noqa: E402
from kvps.kvstore import KVStore  # noqa: E402
from kvps.kvstore.local import LocalBackend  # noqa: E402
from kvps.trainer.stores import UserStore  # noqa: E402
from kvps.optimizer import create as create_optimizer  # noqa: E402
from kvps import StaleGradientError, Trainer  # noqa: E402
from kvps.errors import ConfigError  # noqa: E402


def param(value, shape=(10,)):
    return torch.nn.Parameter(torch.full(shape, float(value)))


def backward(*params, coeff=1.0):
    """loss = sum(coeff * (p + 1)): every gradient element is coeff."""
    sum((coeff * (p + 1)).sum() for p in params).backward()


def fake_store(name):
    """A store of the given type name on the in-process backend (one worker, no sockets)."""
    return KVStore(name, LocalBackend())


class NoOptimizerStore(KVStore):
    def is_capable(self, capability):
        return False


# -- update_on_kvstore decision table -----------------------------------------------------------

@pytest.mark.parametrize('kvstore', [None, 'local', 'device'])
@pytest.mark.parametrize('requested', [None, True, False])
def test_single_process_names_mean_no_store(kvstore, requested):
    t = Trainer([param(0)], 'sgd', kvstore=kvstore, update_on_kvstore=requested)
    assert t.kvstore is None and t.update_on_kvstore is False


@pytest.mark.parametrize('name, requested, expected', [
    ('local', None, True), ('local', True, True), ('local', False, False),
    ('dist_sync', None, True), ('dist_sync', True, True), ('dist_sync', False, False),
    ('dist_device_sync', None, True), ('dist_sync_device', False, False),
    ('dist_async', None, True), ('dist_async', True, True), ('dist_async', False, ValueError),
    ('dist_async_device', False, ValueError),
])
def test_update_on_kvstore_rules(name, requested, expected):
    kv = kvps.create('local') if name == 'local' else fake_store(name)
    if expected is ValueError:
        with pytest.raises(ValueError, match='async'):
            Trainer([param(0)], 'sgd', kvstore=kv, update_on_kvstore=requested)
        return
    t = Trainer([param(0)], 'sgd', kvstore=kv, update_on_kvstore=requested)
    assert t.kvstore is kv and t.update_on_kvstore is expected


@pytest.mark.parametrize('requested, expected', [(None, False), (False, False),
                                                 (True, ValueError)])
def test_store_without_optimizer_falls_back_to_local_updates(requested, expected):
    kv = NoOptimizerStore('local', LocalBackend())
    if expected is ValueError:
        with pytest.raises(ValueError, match='cannot run optimizers'):
            Trainer([param(0)], 'sgd', kvstore=kv, update_on_kvstore=requested)
        return
    t = Trainer([param(0)], 'sgd', {'learning_rate': 1.0}, kvstore=kv,
                update_on_kvstore=requested)
    assert t.update_on_kvstore is False
    x = t._params[0].tensor
    backward(x)
    t.step(1)
    assert torch.all(x == -1)


def test_bad_kvstore_arguments():
    with pytest.raises(kvps.ConfigError):
        Trainer([param(0)], 'sgd', kvstore='bogus')
    with pytest.raises(TypeError):
        Trainer([param(0)], 'sgd', kvstore=3)
    with pytest.raises(TypeError):
        Trainer([param(0)], 'sgd', kvstore=None, update_on_kvstore='yes')


# -- stepping ------------------------------------------------------------------------------

@pytest.mark.parametrize('kvstore, uok', [(None, None), ('local', True), ('local', False),
                                         ('dist_sync', False)])
def test_sgd_momentum_steps(kvstore, uok):
    """MXNet's test_trainer on one device: lr 1, momentum 0.5, gradient 1 each step."""
    kv = kvps.create('local') if kvstore == 'local' else (
        fake_store(kvstore) if kvstore else None)
    x = param(0)
    t = Trainer([x], 'sgd', {'learning_rate': 1.0, 'momentum': 0.5}, kvstore=kv,
                update_on_kvstore=uok)
    backward(x)
    t.step(1)
    assert torch.all(x == -1)
    t.zero_grad()
    backward(x)
    t.step(1)
    assert torch.all(x == -2.5)       # mom = 0.5 * -1 - 1


STORES = [(None, None), ('local', True), ('local', False), ('dist_sync', True),
          ('dist_sync', False)]


def _store(kvstore):
    return None if kvstore is None else (
        kvps.create('local') if kvstore == 'local' else fake_store(kvstore))


@pytest.mark.parametrize('kvstore, uok', STORES)
@pytest.mark.parametrize('optimizer', [
    ('sgd', {'learning_rate': 0.1, 'momentum': 0.9, 'wd': 0.1, 'clip_gradient': 0.5}),
    ('adam', {'learning_rate': 0.1, 'wd': 0.01})])
def test_a_step_leaves_the_gradients_as_backward_made_them(kvstore, uok, optimizer):
    # As with torch.optim: logging a gradient norm after step() must see the gradient, not
    # the kernels' scratch (rescaled, clipped, decayed), which local updates used to leave.
    x = torch.nn.Parameter(torch.linspace(-1, 1, 10))
    t = Trainer([x], *optimizer, kvstore=_store(kvstore), update_on_kvstore=uok)
    for step in range(2):
        t.zero_grad()
        (x * torch.arange(10.0) * (step + 1)).sum().backward()
        t.step(4)
        assert x.grad.tolist() == (torch.arange(10.0) * (step + 1)).tolist()


class Bag(torch.nn.Module):
    def __init__(self, sparse):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(12, 3, sparse=sparse)
        self.out = torch.nn.Linear(3, 1)

    def forward(self, ids):
        return self.out(self.emb(ids)).sum()


@pytest.mark.parametrize('kvstore, uok', STORES)
def test_sparse_gradients_train_as_the_dense_ones_they_stand_for(kvstore, uok):
    # nn.Embedding(sparse=True) gives sparse COO gradients (ids repeat: duplicates add up);
    # without lazy updates (MXNet's lazy_update=False) training equals sparse=False exactly,
    # whether the rows travel alone (a kvps store) or densified.
    ids = torch.tensor([[1, 4, 4], [7, 1, 0]])
    models = []
    for sparse in (True, False):
        model = Bag(sparse)
        t = Trainer(model, 'adam', {'learning_rate': 0.1, 'wd': 0.01, 'lazy_update': False},
                    kvstore=_store(kvstore), update_on_kvstore=uok)
        for step in range(3):
            t.zero_grad()
            model(ids * (step + 1) % 12).backward()
            assert model.emb.weight.grad.is_sparse == sparse
            t.step(2)
        models.append(model)
    for (name, a), (_, b) in zip(*(m.named_parameters() for m in models)):
        assert torch.equal(a, b), name


def test_lazy_updates_of_sparse_gradients_are_the_same_whoever_updates():
    """Servers updating (rows changed pulled back) and workers updating (summed rows pulled,
    updated lazily on the worker) give the same weights; rows no batch read stay as they
    were, momentum and wd included, unlike the dense update."""
    def run(uok, sparse):
        torch.manual_seed(0)
        emb = torch.nn.Embedding(50, 3, sparse=sparse)
        start = emb.weight.detach().clone()
        t = Trainer([emb.weight], 'sgd', {'learning_rate': 0.1, 'momentum': 0.9, 'wd': 0.01},
                    kvstore=kvps.create('local'), update_on_kvstore=uok)
        for step in range(3):
            emb(torch.tensor([1, 4, 4, step + 7])).sum().backward()
            t.step(1)
            t.zero_grad()
        assert t._exchange.row_keys == ({0} if sparse else set())
        return emb.weight.detach(), start
    (servers, start), (workers, _), (dense, _) = run(True, True), run(False, True), run(True, False)
    assert torch.equal(servers, workers)
    untouched = [r for r in range(50) if r not in (1, 4, 7, 8, 9)]
    assert torch.equal(servers[untouched], start[untouched])
    assert not torch.equal(dense[untouched], start[untouched])   # wd reached every row


def test_allreduce_grads_then_update_of_sparse_gradients_is_lazy_and_sees_clipping():
    def run(lr, split, clip=1.0):
        torch.manual_seed(0)
        emb = torch.nn.Embedding(50, 3, sparse=True)
        start = emb.weight.detach().clone()
        t = Trainer([emb.weight], 'sgd', {'learning_rate': lr, 'momentum': 0.9, 'wd': 0.01},
                    kvstore=kvps.create('local'), update_on_kvstore=False)
        for step in range(3):
            emb(torch.tensor([1, 4, 4, step + 7])).sum().backward()
            if split:
                t.allreduce_grads()
                assert emb.weight.grad.layout == torch.strided   # the sum, dense
                emb.weight.grad.mul_(clip)
                t.update(1)
            else:
                t.step(1)
            t.zero_grad()
        return emb.weight.detach(), start
    (stepped, start), (split, _) = run(0.1, False), run(0.1, True)
    assert torch.equal(stepped, split)
    untouched = [r for r in range(50) if r not in (1, 4, 7, 8, 9)]
    assert torch.equal(split[untouched], start[untouched])   # lazy: wd reached no other row
    clipped, _ = run(0.1, True, clip=0.5)
    assert not torch.equal(clipped, split)                    # the clipped rows were applied


@pytest.mark.parametrize('kvstore', [None, 'local'])
def test_rescale_grad_is_scale_over_batch_size(kvstore):
    kv = kvps.create(kvstore) if kvstore else None
    x = param(0)
    t = Trainer([x], 'sgd', {'learning_rate': 1.0, 'rescale_grad': 2.0}, kvstore=kv)
    backward(x)
    t.step(4)
    assert t.optimizer.rescale_grad == 0.5
    assert torch.allclose(x, torch.full((10,), -0.5))
    t.zero_grad()
    backward(x)
    t.step(8)          # a new batch size is honoured on a local store too
    assert t.optimizer.rescale_grad == 0.25
    assert torch.allclose(x, torch.full((10,), -0.75))


def test_batch_size_change_refused_when_dist_servers_update():
    x = param(0)
    t = Trainer([x], 'sgd', kvstore=fake_store('dist_sync'), update_on_kvstore=True)
    backward(x)
    t.step(4)
    t.zero_grad()
    backward(x)
    with pytest.raises(kvps.ConfigError, match='batch_size changed'):
        t.step(8)


def test_a_job_with_another_batch_size_resumes_from_saved_states(tmp_path):
    # A single-process run (batch 4) saved; a distributed job whose servers update resumes it
    # with its own combined batch size: the loaded rescale_grad is the saver's, not a change.
    x = param(0)
    t = Trainer([x], 'sgd', {'learning_rate': 1.0, 'momentum': 0.5}, kvstore=None)
    backward(x)
    t.step(4)                          # mom = -0.25, x = -0.25
    t.save_states(tmp_path / 's')
    y = param(-0.25)
    t2 = Trainer([y], 'sgd', {'learning_rate': 1.0, 'momentum': 0.5},
                 kvstore=fake_store('dist_sync'), update_on_kvstore=True)
    t2.load_states(tmp_path / 's')
    backward(y)
    t2.step(8)                         # mom = 0.5 * -0.25 - 1/8 = -0.25: the momentum survived
    assert torch.allclose(y, torch.full((10,), -0.5))
    t2.zero_grad()
    backward(y)
    with pytest.raises(kvps.ConfigError, match='batch_size changed'):
        t2.step(16)                    # this job's own change is still refused


def test_allreduce_then_update_equals_step():
    a, b = param(1), param(1)
    ta = Trainer([a], 'sgd', {'learning_rate': 0.1}, kvstore=kvps.create('local'),
                 update_on_kvstore=False)
    tb = Trainer([b], 'sgd', {'learning_rate': 0.1}, kvstore=None)
    backward(a, coeff=3.0)
    backward(b, coeff=3.0)
    ta.allreduce_grads()
    ta.update(2)
    tb.step(2)
    assert torch.equal(a, b)



@pytest.mark.parametrize('kvstore', ['local', 'dist_sync'])
def test_step_after_allreduce_grads_applies_the_sums_as_they_are_now(kvstore):
    """Gluon's clipping pattern is allreduce_grads(), clip .grad, update(). A step() in place
    of update() (torch's GradScaler calls step) applies the clipped sum, never reducing
    again."""
    x = param(0, (3,))
    t = Trainer([x], 'sgd', {'learning_rate': 1.0}, kvstore=fake_store(kvstore),
                update_on_kvstore=False)
    backward(x, coeff=4.0)
    t.allreduce_grads()
    x.grad.mul_(0.25)                              # clipped
    t.step(1)
    assert torch.all(x == -1)


@pytest.mark.parametrize('uok', [True, False])
@pytest.mark.parametrize('change', ['clip', 'replace'])
def test_a_grad_changed_after_backward_sent_it_is_refused_not_lost(uok, change):
    """torch's recipe clips between backward() and step(). With overlap the gradients left
    while backward ran, and the step would apply them unclipped: it says so instead."""
    x = param(0, (3,))
    t = Trainer([x], 'sgd', {'learning_rate': 1.0}, kvstore=fake_store('dist_sync'),
                update_on_kvstore=uok)
    backward(x)
    t.step(1)             # (the servers' first step: their optimizer goes before any push)
    t.zero_grad()
    backward(x, coeff=4.0)
    if change == 'clip':
        torch.nn.utils.clip_grad_norm_([x], 1.0)
    else:
        x.grad = x.grad * 0.5
    with pytest.raises(RuntimeError, match='changed after backward sent it'):
        t.step(1) if uok else t.allreduce_grads()
    assert torch.all(x == -1)


def test_without_overlap_a_changed_grad_is_what_the_step_sends():
    x = param(0, (3,))
    t = Trainer([x], 'sgd', {'learning_rate': 1.0}, kvstore=fake_store('dist_sync'),
                overlap=False)
    for _ in range(2):
        t.zero_grad()
        backward(x, coeff=4.0)
        x.grad.mul_(0.25)
        t.step(1)
    assert torch.all(x == -2)


def test_allreduce_and_update_refused_when_servers_update():
    x = param(0)
    t = Trainer([x], 'sgd', kvstore=kvps.create('local'), update_on_kvstore=True)
    backward(x)
    with pytest.raises(RuntimeError, match='update_on_kvstore=False'):
        t.allreduce_grads()
    with pytest.raises(RuntimeError, match='step'):
        t.update(1)


def test_update_without_allreduce_refused_in_dist_mode():
    x = param(0)
    t = Trainer([x], 'sgd', kvstore=fake_store('dist_sync'), update_on_kvstore=False)
    backward(x)
    with pytest.raises(RuntimeError, match='allreduce_grads'):
        t.update(1)


def test_stale_gradients():
    used, unused = param(0), param(5)
    t = Trainer([used, unused], 'sgd', {'learning_rate': 1.0})
    backward(used)
    with pytest.raises(StaleGradientError, match='param1') as info:
        t.step(1)
    assert isinstance(info.value, UserWarning)      # what MXNet raises
    t.step(1, ignore_stale_grad=True)
    assert torch.all(used == -1) and torch.all(unused == 5)
    with pytest.raises(StaleGradientError, match='param0'):
        t.step(1)                                   # no backward since the last step
    used.grad = torch.ones(10)                      # a gradient set by hand is fresh too
    t.step(1, ignore_stale_grad=True)
    assert torch.all(used == -2)


@pytest.mark.parametrize('kvstore, uok', STORES)
def test_freezing_and_unfreezing_mid_training_work_as_in_torch_optim(kvstore, uok):
    """requires_grad is read at every step, as Gluon reads grad_req: a parameter unfrozen
    later is trained from then on (its gradient sent during backward from its second step),
    and one frozen later is left alone, not called stale."""
    a, b = param(0), param(0)
    b.requires_grad_(False)
    t = Trainer([a, b], 'sgd', {'learning_rate': 1.0}, kvstore=_store(kvstore),
                update_on_kvstore=uok)
    backward(a)
    t.step(1)
    b.requires_grad_(True)
    for _ in range(2):
        t.zero_grad()
        backward(a, b)
        t.step(1)
    assert torch.all(a == -3) and torch.all(b == -2)
    a.requires_grad_(False)
    t.zero_grad()
    backward(b)
    t.step(1)
    assert torch.all(a == -3) and torch.all(b == -3)


def test_overlap_pushes_during_backward_and_refuses_a_second_backward():
    x = param(0)
    t = Trainer([x], 'sgd', {'learning_rate': 1.0}, kvstore=fake_store('dist_sync'),
                update_on_kvstore=False)
    backward(x)
    assert t._exchange.pushed == {0}                          # sent by the hook, before step()
    with pytest.raises(RuntimeError, match='overlap=False'):
        backward(x)
    y = param(0)
    t2 = Trainer([y], 'sgd', {'learning_rate': 1.0}, kvstore=fake_store('dist_sync'),
                 update_on_kvstore=False, overlap=False)
    backward(y)
    backward(y)                                      # accumulates: gradient 2
    t2.step(1)
    assert torch.all(y == -2)


def test_a_learning_rate_set_after_backward_sent_the_gradients_warns():
    x = param(0)
    t = Trainer([x], 'sgd', {'learning_rate': 1.0}, kvstore=fake_store('dist_sync'))
    backward(x)
    t.step(1)                                        # the servers have the optimizer now
    t.set_learning_rate(0.5)                         # before backward: no warning
    t.zero_grad()
    backward(x)
    with pytest.warns(UserWarning, match='applies from the next step'):
        t.set_learning_rate(0.25)
    t.step(1)
    assert torch.all(x == -1.5)                      # this step ran at 0.5


def test_a_second_trainer_on_a_store_is_told_what_to_do_instead():
    store = fake_store('dist_sync')
    Trainer([param(0)], 'sgd', {'learning_rate': 1.0}, kvstore=store)
    with pytest.raises(kvps.errors.DuplicateInitError, match='One store serves one Trainer'):
        Trainer([param(0)], 'adam', {'learning_rate': 1.0}, kvstore=store)


class PushLog(KVStore):
    """A dist_sync store on the in-process backend that records each push call's keys."""

    def __init__(self):
        super().__init__('dist_sync', LocalBackend())
        self.pushes = []

    def push(self, key, value, priority=0):
        self.pushes.append(list(key) if isinstance(key, list) else [key])
        super().push(key, value, priority)


def test_gradients_leave_in_buckets_and_the_last_one_before_backward_returns():
    params = [param(0, (256,)) for _ in range(5)]             # 1 KiB each
    store = PushLog()
    t = Trainer(params, 'sgd', {'learning_rate': 1.0}, kvstore=store,
                update_on_kvstore=False, bucket_bytes=2048, fuse=False)
    backward(*params)
    # autograd reaches the parameters in reverse: full buckets of two as they fill, and the
    # last, half-full one when backward ends
    assert [sorted(keys) for keys in store.pushes] == [[3, 4], [1, 2], [0]]
    assert t._exchange.pushed == set(range(5))
    t.step(1)
    assert len(store.pushes) == 3 and all(torch.all(p == -1) for p in params)


class PullLog(PushLog):
    """PushLog that also records the pulls a Trainer sends right behind its pushes."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def push(self, key, value, priority=0):
        self.calls.append(('push', sorted(key)))
        super().push(key, value, priority)

    def pull(self, key, out=None, priority=0, ignore_sparse=True):
        self.calls.append(('pull at step', sorted(key)))
        super().pull(key, out, priority)

    def pull_begin(self, key, out, priority=0):
        self.calls.append(('pull', sorted(key)))
        return super().pull_begin(key, out, priority)


@pytest.mark.parametrize('servers_update', [True, False])
def test_each_bucket_is_pulled_right_behind_its_push_and_lands_only_at_step(servers_update):
    params = [param(0, (256,)) for _ in range(3)]             # 1 KiB each
    store = PullLog()
    t = Trainer(params, 'sgd', {'learning_rate': 1.0}, kvstore=store, fuse=False,
                update_on_kvstore=servers_update, bucket_bytes=2048)
    backward(*params)
    t.step(1)                # servers update: they get the optimizer here; overlap from now on
    t.zero_grad()
    store.calls.clear()
    backward(*params, coeff=2.0)
    assert store.calls == [('push', [1, 2]), ('pull', [1, 2]), ('push', [0]), ('pull', [0])]
    # nothing landed in the parameters or their gradients before step()
    assert all(torch.all(p == -1) and torch.all(p.grad == 2) for p in params)
    t.step(1)
    assert store.calls[4:] == []                               # step only waited
    assert all(torch.all(p == -3) for p in params)


def test_a_bucket_size_of_zero_sends_each_gradient_alone_and_bad_sizes_are_refused():
    params = [param(0) for _ in range(3)]
    store = PushLog()
    t = Trainer(params, 'sgd', kvstore=store, update_on_kvstore=False, bucket_bytes=0)
    backward(*params)
    assert sorted(store.pushes) == [[0], [1], [2]]
    t.step(1)
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match='bucket_bytes'):
            Trainer([param(0)], 'sgd', kvstore=fake_store('dist_sync'), bucket_bytes=bad)


def test_what_backward_did_not_send_leaves_in_one_push_at_step():
    params = [param(0) for _ in range(3)]
    store = PushLog()
    t = Trainer(params, 'sgd', {'learning_rate': 1.0}, kvstore=store, overlap=False,
                fuse=False)
    backward(*params)
    assert store.pushes == []
    t.step(1)
    assert store.pushes == [[0, 1, 2]] and all(torch.all(p == -1) for p in params)



def _train_one_unused_after_the_first_step(kvstore, uok, fuse, split=False):
    used, unused = param(0, (3,)), param(1, (3,))
    t = Trainer([used, unused], 'sgd', {'learning_rate': 1.0, 'momentum': 0.5, 'wd': 0.1},
                kvstore=kvstore, update_on_kvstore=uok, fuse=fuse)
    for step in range(3):
        t.zero_grad()
        (used.sum() + (unused.sum() if step == 0 else 0)).backward()
        if split:
            t.allreduce_grads()
            assert (unused.grad is None) == (step > 0)   # not made up from the store
            t.update(1, ignore_stale_grad=True)
        else:
            t.step(1, ignore_stale_grad=True)
    return used.detach(), unused.detach()


@pytest.mark.parametrize('name', ['local', 'device'])
@pytest.mark.parametrize('uok', [True, False])
@pytest.mark.parametrize('fuse', [True, False])
def test_a_store_in_this_process_skips_stale_parameters_as_no_store_does(name, uok, fuse):
    """Alone, ignore_stale_grad=True skips a parameter backward left alone: its momentum and
    weight decay must not move it, with a 'local' store whoever updates, fused or not."""
    expected = _train_one_unused_after_the_first_step(None, None, True)
    assert torch.allclose(expected[1], torch.full((3,), -0.1))   # moved at the first step only
    found = _train_one_unused_after_the_first_step(kvps.create(name), uok, fuse)
    assert all(torch.equal(a, b) for a, b in zip(found, expected)), (found, expected)
    if not uok:
        found = _train_one_unused_after_the_first_step(kvps.create(name), uok, fuse,
                                                      split=True)
        assert all(torch.equal(a, b) for a, b in zip(found, expected)), (found, expected)


# -- learning rate -------------------------------------------------------------------------

@pytest.mark.parametrize('kvstore, uok', [(None, None), ('local', True), ('local', False)])
def test_learning_rate_get_set(kvstore, uok):
    x = param(0)
    t = Trainer([x], 'sgd', {'learning_rate': 0.1, 'momentum': 0.5},
                kvstore=kvps.create('local') if kvstore else None, update_on_kvstore=uok)
    assert t.learning_rate == 0.1
    backward(x)
    t.step(1)
    assert torch.allclose(x, torch.full((10,), -0.1))
    t.set_learning_rate(1.0)
    assert t.learning_rate == 1.0
    t.zero_grad()
    backward(x)
    t.step(1)           # the servers' copy follows, momentum kept: mom = 0.5 * -0.1 - 1
    assert torch.allclose(x, torch.full((10,), -1.15))


@pytest.mark.parametrize('kvstore, uok', [(None, None), ('local', True)])
def test_learning_rate_follows_scheduler(kvstore, uok):
    """MXNet's test_trainer_lr_sched: FactorScheduler(step=2, factor=0.1), base lr 1."""
    x = param(0)
    sched = {'name': 'factor', 'params': {'step': 2, 'factor': 0.1, 'base_lr': 1.0}}
    t = Trainer([x], 'sgd', {'learning_rate': 1.0, 'lr_scheduler': sched},
                kvstore=kvps.create('local') if kvstore else None, update_on_kvstore=uok)
    lr = 1.0
    for i in range(10):
        t.zero_grad()
        backward(x)
        t.step(1)
        if i % 2 == 0:
            assert t.learning_rate == pytest.approx(lr), i
            lr *= 0.1
    with pytest.raises(kvps.ConfigError):
        t.set_learning_rate(0.5)


# -- states --------------------------------------------------------------------------------

def _train(trainer, x, steps):
    for _ in range(steps):
        trainer.zero_grad()
        backward(x, coeff=float(x.detach().sum().abs()) + 1.0)
        trainer.step(2)


@pytest.mark.parametrize('save_uok, load_uok', [(None, None), (True, True), (True, None),
                                                (None, True), (False, False)])
def test_save_load_states_round_trip(tmp_path, save_uok, load_uok):
    """Saved after 2 steps, loaded into a fresh trainer on the same weights: the next steps
    match the original's, whichever side ran the optimizer."""
    def make(value, uok):
        x = torch.nn.Parameter(value.clone())
        kv = kvps.create('local') if uok is not None else None
        return x, Trainer([x], 'adam', {'learning_rate': 0.1}, kvstore=kv, update_on_kvstore=uok)

    x, t = make(torch.linspace(-1, 1, 10), save_uok)
    _train(t, x, 2)
    t.save_states(tmp_path / 'a.states')
    snapshot = x.detach().clone()
    _train(t, x, 3)
    y, t2 = make(snapshot, load_uok)
    t2.load_states(tmp_path / 'a.states')
    assert t2.optimizer.num_update == 2
    _train(t2, y, 3)
    assert torch.allclose(x, y, atol=1e-6)
    t2.save_states(tmp_path / 'b.states')
    t2.load_states(tmp_path / 'b.states')



@pytest.mark.parametrize('uok', [True, False])
def test_a_store_file_without_its_optimizer_resumes_the_schedule_at_its_count(tmp_path, uok):
    """kv.save_optimizer_states(fname) leaves the optimizer out but keeps the update count:
    loaded by a Trainer, learning_rate follows the schedule from that count, whoever
    updates (the servers do)."""
    sched = {'name': 'factor', 'params': {'step': 2, 'factor': 0.5}}
    opt = {'learning_rate': 1.0, 'momentum': 0.5, 'lr_scheduler': sched}
    x = param(0, (3,))
    t = Trainer([x], 'sgd', opt, kvstore=fake_store('dist_sync'), update_on_kvstore=True)
    for _ in range(5):
        t.zero_grad()
        backward(x)
        t.step(1)
    assert t.learning_rate == 0.25
    t.kvstore.save_optimizer_states(tmp_path / 's')
    y = param(0, (3,))
    t2 = Trainer([y], 'sgd', opt, kvstore=fake_store('dist_sync'), update_on_kvstore=uok)
    t2.load_states(tmp_path / 's')
    assert (t2.optimizer.num_update, t2.learning_rate) == (5, 0.25)


def test_load_states_refuses_other_parameters_and_garbage(tmp_path):
    x = param(0)
    t = Trainer([x], 'sgd', {'momentum': 0.5})
    backward(x)
    t.step(1)
    t.save_states(tmp_path / 'ok')
    other = Trainer([param(0, shape=(3,))], 'sgd', {'momentum': 0.5})
    with pytest.raises(ValueError, match='other parameters'):
        other.load_states(tmp_path / 'ok')
    more = Trainer([param(0), param(0)], 'sgd', {'momentum': 0.5})
    more.load_states(tmp_path / 'ok')              # a subset of the keys is fine
    (tmp_path / 'bad').write_bytes(b'\x00garbage')
    with pytest.raises(ValueError, match='not a kvps optimizer-state file'):
        t.load_states(tmp_path / 'bad')


@pytest.mark.parametrize('uok', [None, False])
def test_load_states_of_another_dtype_is_refused_at_load_and_changes_nothing(tmp_path, uok):
    """Workers update: a float64 run's state loaded for float32 parameters was accepted, and
    the next step failed."""
    def make(dtype):
        x = torch.nn.Parameter(torch.ones(4, dtype=dtype))
        kv = kvps.create('local') if uok is not None else None
        return x, Trainer([x], 'sgd', {'momentum': 0.5}, kvstore=kv, update_on_kvstore=uok)
    x64, t64 = make(torch.float64)
    _train(t64, x64, 1)
    t64.save_states(tmp_path / 'f64')
    x, t = make(torch.float32)
    _train(t, x, 1)
    before = x.detach().clone()
    with pytest.raises(ConfigError, match=r"f64: .*'mom' is float64, but the key is float32"):
        t.load_states(tmp_path / 'f64')
    _train(t, x, 1)                      # the state it had goes on
    y, t2 = make(torch.float32)
    y.data.copy_(before)
    _train(t2, y, 1)
    assert not torch.equal(x, y)         # momentum from the first step counted (not reset)


# -- parameters ----------------------------------------------------------------------------

class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(4, 3)
        self.fc2 = torch.nn.Linear(3, 2)


def _stored(kv, tensor, key):
    out = torch.empty_like(tensor)
    kv.pull(key, out=out)
    return out


@pytest.mark.parametrize('form', ['module', 'named', 'dict', 'list', 'iterator'])
def test_keys_are_positions_in_the_given_order(form):
    net = Net()
    named = list(net.named_parameters())
    given = {'module': net, 'named': net.named_parameters(), 'dict': dict(named),
             'list': [p for _, p in named], 'iterator': net.parameters()}[form]
    kv = kvps.create('local')
    t = Trainer(given, 'sgd', kvstore=kv, fuse=False)   # fused keys: test_trainer_fusion.py
    assert [p.key for p in t._params] == [0, 1, 2, 3]
    for key, (name, tensor) in enumerate(named):
        assert torch.equal(_stored(kv, tensor, key), tensor.detach()), name
    if form != 'list' and form != 'iterator':
        assert [p.name for p in t._params] == [n for n, _ in named]


def test_tied_parameters_are_kept_once():
    shared = param(1)
    t = Trainer([shared, param(2), shared], 'sgd')
    assert [p.key for p in t._params] == [0, 1]


@pytest.mark.parametrize('params, match', [
    ([], 'empty'),
    ('weights', 'must be a module'),
    (torch.ones(3), 'must be a module'),
    ([np.ones(3)], 'torch tensor'),
    ([('a', torch.nn.Parameter(torch.ones(3))), torch.nn.Parameter(torch.ones(3))], 'mixes'),
    ([(3, torch.nn.Parameter(torch.ones(3)))], 'name'),
])
def test_bad_params(params, match):
    with pytest.raises(ValueError, match=match):
        Trainer(params, 'sgd')


def test_non_leaf_parameter_refused():
    leaf = torch.nn.Parameter(torch.ones(3))
    with pytest.raises(ValueError, match='leaf'):
        Trainer([leaf * 2], 'sgd')


def test_bad_optimizer_arguments():
    with pytest.raises(ValueError, match='optimizer_params'):
        Trainer([param(0)], create_optimizer('sgd'), {'learning_rate': 0.1})
    with pytest.raises(TypeError):
        Trainer([param(0)], 3)
    with pytest.raises(kvps.ConfigError):
        Trainer([param(0)], 'no-such-optimizer')


def test_lr_mult_attributes_are_read():
    x, y = param(0), param(0)
    y.lr_mult = 0.5
    t = Trainer([x, y], 'sgd', {'learning_rate': 1.0})
    backward(x, y)
    t.step(1)
    assert torch.all(x == -1) and torch.all(y == -0.5)


def test_digest_sees_names_shapes_dtypes_order_and_frozen():
    def table(*specs):
        return [_trainer_params.Param(i, n, t) for i, (n, t) in enumerate(specs)]
    a = torch.nn.Parameter(torch.ones(2, 3))
    b = torch.nn.Parameter(torch.ones(3))
    base = _trainer_params.digest(table(('a', a), ('b', b)))
    frozen = torch.nn.Parameter(torch.ones(3), requires_grad=False)
    variants = [table(('b', b), ('a', a)), table(('a', a), ('c', b)),
                table(('a', torch.nn.Parameter(torch.ones(3, 2))), ('b', b)),
                table(('a', a), ('b', torch.nn.Parameter(torch.ones(3, dtype=torch.float64)))),
                table(('a', a), ('b', frozen))]
    for v in variants:
        assert base != _trainer_params.digest(v)
    assert base == _trainer_params.digest(table(('a', a), ('b', b)))


def test_compression_params_reach_the_store():
    x = param(0, (4,))
    t = Trainer([x], 'sgd', {'learning_rate': 1.0}, kvstore=fake_store('dist_sync'),
                compression_params={'type': '2bit', 'threshold': 0.5})
    x.grad = torch.tensor([0.7, 0.2, -0.6, 1.5])
    t.step(1)                       # the servers get +-0.5 or 0 per element, then SGD
    assert x.tolist() == [-0.5, 0.0, 0.5, -0.5]
    with pytest.raises(ValueError, match='not supported'):
        Trainer([param(0)], 'sgd', kvstore=fake_store('dist_sync'),
                compression_params={'type': '3bit'})


@pytest.mark.parametrize('kvstore', ['local', 'local_update_cpu', 'store'])
def test_compression_params_on_a_store_type_without_compression_are_refused(kvstore):
    """A 'local' name makes no store, so the params were dropped without a word; a 'local'
    store object took them and did nothing. Both refuse them at construction."""
    kv = kvps.create('local') if kvstore == 'store' else kvstore
    with pytest.raises(ConfigError, match="not supported for a 'local.*' store"):
        Trainer([param(0)], 'sgd', kvstore=kv, compression_params={'type': '2bit'})


def test_compression_params_warn_when_a_custom_store_cannot_compress():
    class Bare:
        type = 'dist_sync'

        def init(self, *a):
            pass
        push = pull = init
    with pytest.warns(UserWarning, match='set_gradient_compression'):
        UserStore(Bare()).set_compression({'type': '2bit'})


# -- multi-precision -------------------------------------------------------------------------

@pytest.mark.parametrize('dtype', [torch.float16, torch.bfloat16])
@pytest.mark.parametrize('kvstore, uok', [(None, None), ('dist_sync', True),
                                          ('dist_sync', False)])
def test_multi_precision_weights_are_the_rounded_float32_master(dtype, kvstore, uok, tmp_path):
    """float16/bfloat16 parameters with multi_precision: each step is torch's SGD on a float32
    master copy, rounded once into the parameter, whoever updates, with fused keys split by
    freezing mid-training and a state file round trip (the master travels with it)."""
    g = torch.Generator().manual_seed(0)
    start = [torch.randn(5, generator=g) for _ in range(4)]
    opt = {'learning_rate': 0.1, 'momentum': 0.9, 'wd': 0.01, 'multi_precision': True}

    def make():
        params = [torch.nn.Parameter(w.to(dtype)) for w in start]
        kv = fake_store(kvstore) if kvstore else None
        return params, Trainer(params, 'sgd', opt, kvstore=kv, update_on_kvstore=uok)

    params, trainer = make()
    master = [torch.nn.Parameter(w.to(dtype).float()) for w in start]
    reference = torch.optim.SGD(master, lr=0.1, momentum=0.9, weight_decay=0.01)
    for step in range(6):
        if step == 3:                       # resume from the file in a new Trainer
            trainer.save_states(tmp_path / 's')
            weights = [p.detach().clone() for p in params]
            params, trainer = make()
            with torch.no_grad():
                for p, w in zip(params, weights):
                    p.copy_(w)
            trainer.load_states(tmp_path / 's')
        for p in params:                    # the second parameter is frozen at steps 2-3
            p.requires_grad_(not (2 <= step < 4 and p is params[1]))
        g = torch.Generator().manual_seed(100 + step)
        trainer.zero_grad()
        sum((torch.randn(5, generator=g).to(dtype) * p * p).sum()
            for p in params if p.requires_grad).backward()
        trainer.step(1)
        reference.zero_grad()
        for p, m in zip(params, master):
            m.grad = p.grad.float() if p.requires_grad else None
        reference.step()
    for p, m in zip(params, master):
        assert p.dtype == dtype and torch.equal(p.detach(), m.detach().to(dtype))


@pytest.mark.parametrize('uok', [True, False, 'torch'])
def test_no_sync_accumulates_as_overlap_off_does(uok):
    """DDP's gradient accumulation: backward passes in no_sync() send nothing, the last one
    sends the sums (here one that reaches only one of the two layers: the other's sum from
    the earlier passes still goes), and the weights are those of overlap=False."""
    def run(overlap):
        torch.manual_seed(0)
        a, b = torch.nn.Linear(4, 3), torch.nn.Linear(4, 3)
        modules = torch.nn.ModuleList([a, b])
        if uok == 'torch':   # (torch's SGD on the workers)
            t = Trainer(modules, torch.optim.SGD(modules.parameters(), lr=0.5),
                        kvstore=fake_store('dist_sync'), overlap=overlap)
        else:
            t = Trainer(modules, 'sgd', {'learning_rate': 0.5}, kvstore=fake_store('dist_sync'),
                        update_on_kvstore=uok, overlap=overlap)
        x = torch.linspace(-1, 1, 8).reshape(2, 4)
        for step in range(3):
            t.zero_grad()
            with t.no_sync() if overlap else contextlib.nullcontext():
                for micro in range(2):
                    (a(x * (micro + step)).sum() + b(x - micro).sum()).backward()
                assert not t._exchange.pushed       # nothing left yet
            a(x + step).sum().backward()
            t.step(6)
        return [p.detach() for p in (*a.parameters(), *b.parameters())]
    assert all(map(torch.equal, run(True), run(False)))
