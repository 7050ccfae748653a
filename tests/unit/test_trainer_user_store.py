"""kvps.Trainer over a store of the user's own making, with MXNet 1.x's surface (type, init,
push, pull, is_capable) or MXNet 2.0's protocol (KVStoreBase: broadcast, pushpull): it trains
as without a store, without AttributeErrors; KVStoreBase.register and create."""

import pytest

torch = pytest.importorskip('torch')

import kvps  # noqa: E402
from kvps import Trainer  # noqa: E402
from kvps.errors import ConfigError  # noqa: E402
from kvps.kvstore import KVStore, KVStoreBase  # noqa: E402
from kvps.trainer.mode import Mode, Updates  # noqa: E402


class DictStore:
    """A dict of tensors: push replaces a key's value with the sum of what was pushed (one
    worker, so a sync round is one push), pull copies it out. Nothing else: no agree, no
    barrier, no pull_begin, no row pulls, no optimizer-state calls."""

    type = 'dist_sync'

    def __init__(self):
        self.values, self.pushes = {}, 0

    def is_capable(self, capability):
        return False

    def init(self, key, value):
        for k, v in zip(key, value):
            self.values[k] = v.detach().clone()

    def push(self, key, value, priority=0):
        self.pushes += 1
        for k, v in zip(key, value):
            self.values[k] = sum(v).clone() if isinstance(v, list) else v.detach().clone()

    def pull(self, key, out=None, priority=0):
        for k, o in zip(key, out):
            o.detach().copy_(self.values[k].reshape(o.shape))


class UpdatingDictStore(DictStore):
    """DictStore that runs plain SGD on pushes, as servers with an optimizer would."""

    def is_capable(self, capability):
        return capability == 'optimizer'

    def set_optimizer(self, spec):
        self.step = spec['params']['learning_rate'] * spec['params']['rescale_grad']

    def push(self, key, value, priority=0):
        self.pushes += 1
        for k, v in zip(key, value):
            self.values[k] -= self.step * v.detach()


def model_and_data():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    x, y = torch.randn(32, 4), torch.randn(32, 1)
    return model, x, y


def train(model, x, y, step, zero_grad, steps=5):
    for _ in range(steps):
        zero_grad()
        torch.nn.functional.mse_loss(model(x), y, reduction='sum').backward()
        step()


def reference_weights():
    model, x, y = model_and_data()
    sgd = torch.optim.SGD(model.parameters(), lr=0.01)
    train(model, x, y, lambda: (torch._foreach_mul_(  # rescale_grad 1/batch, as step(32)
        [p.grad for p in model.parameters()], 1 / 32), sgd.step()), sgd.zero_grad)
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize('store, on_servers', [(DictStore, False), (UpdatingDictStore, True)])
def test_a_small_model_trains_through_a_store_of_ones_own(store, on_servers, tmp_path):
    model, x, y = model_and_data()
    kv = store()
    trainer = Trainer(model.parameters(), 'sgd', {'learning_rate': 0.01}, kvstore=kv)
    assert trainer.kvstore is kv and trainer.update_on_kvstore is on_servers
    # MXNet's surface only: no fused keys, no early pulls, overlap as for any dist store
    assert trainer._mode == Mode(Updates.SERVERS if on_servers else Updates.WORKERS,
                                 distributed=True, fused=False, overlap=True)
    train(model, x, y, lambda: trainer.step(32), trainer.zero_grad)
    assert kv.pushes > 0
    for got, want in zip(model.parameters(), reference_weights()):
        assert torch.allclose(got, want, atol=1e-6)
    if on_servers:   # the state is the store's, which has no way to hand it over
        with pytest.raises(NotImplementedError, match='update_on_kvstore=False'):
            trainer.save_states(tmp_path / 's')
    else:
        trainer.save_states(tmp_path / 's')   # the workers' own state


# -- MXNet 2.0's custom-store protocol: kvps.kvstore.KVStoreBase --------------------------------

@pytest.fixture
def registry():
    """KVStoreBase's registry as it was, after the test."""
    saved = dict(KVStoreBase.kv_registry)
    yield KVStoreBase.kv_registry
    KVStoreBase.kv_registry.clear()
    KVStoreBase.kv_registry.update(saved)


class Loopback(KVStoreBase):
    """Horovod's shape with one worker: broadcast and pushpull (an allreduce over one worker
    copies), no optimizer, no init/push/pull."""

    type = 'loopback'
    rank, num_workers = 0, 1

    def __init__(self):
        self.calls = []

    def broadcast(self, key, value, out, priority=0):
        self.calls.append(('broadcast', key))
        out.detach().copy_(value)

    def pushpull(self, key, value, out=None, priority=0):
        self.calls.append(('pushpull', key, priority))
        (value if out is None else out).detach().copy_(value)

    def is_capable(self, capability):
        return False


class DistLoopback(Loopback):
    """The same with a 'dist' type: gradients leave while backward runs (overlap)."""
    type = 'dist_sync_loopback'


class UpdatingLoopback(Loopback):
    """Runs SGD from the spec it is given, as servers would; has no optimizer-state calls
    (KVStoreBase's raise NotImplementedError)."""

    type = 'dist_sync_updating'

    def __init__(self):
        super().__init__()
        self.weights = {}

    def is_capable(self, capability):
        return capability == KVStoreBase.OPTIMIZER

    def set_optimizer(self, spec):
        self.step = spec['params']['learning_rate'] * spec['params']['rescale_grad']

    def broadcast(self, key, value, out, priority=0):
        super().broadcast(key, value, out)
        self.weights[key] = value.detach().clone()

    def pushpull(self, key, value, out=None, priority=0):
        self.calls.append(('pushpull', key, priority))
        self.weights[key] -= self.step * value.detach()
        out.detach().copy_(self.weights[key])


def alone_weights(name='sgd', params=None):
    """The same training with no store: the Trainer's local update on its own gradients."""
    model, x, y = model_and_data()
    trainer = Trainer(model.parameters(), name, params or {'learning_rate': 0.01,
                                                          'momentum': 0.9}, kvstore=None)
    train(model, x, y, lambda: trainer.step(32), trainer.zero_grad)
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize('store, overlap', [(Loopback, False), (DistLoopback, True),
                                            (DictStore, True)])
def test_a_store_of_ones_own_trains_exactly_as_no_store(store, overlap):
    """Workers update on the sums the store returns (here their own gradients): bit for bit
    what the Trainer does alone, through MXNet 2.0's protocol or MXNet 1.x's surface."""
    model, x, y = model_and_data()
    kv = store()
    trainer = Trainer(model.parameters(), 'sgd', {'learning_rate': 0.01, 'momentum': 0.9},
                      kvstore=kv)
    assert trainer.kvstore is kv and not trainer.update_on_kvstore
    assert trainer._mode.overlap is overlap and not trainer._mode.fused
    train(model, x, y, lambda: trainer.step(32), trainer.zero_grad)
    for got, want in zip(model.parameters(), alone_weights()):
        assert torch.equal(got, want)
    if store is not DictStore:
        assert kv.calls[:4] == [('broadcast', k) for k in range(4)]
        # one pushpull per key and step, at its bucket's priority (one bucket: its first's)
        assert sorted(c for c in kv.calls if c[0] == 'pushpull') == sorted(
            ('pushpull', k, 0) for k in range(4) for _ in range(5))


def test_a_kvstorebase_store_that_runs_the_optimizer_gets_its_spec(tmp_path):
    model, x, y = model_and_data()
    kv = UpdatingLoopback()
    trainer = Trainer(model.parameters(), 'sgd', {'learning_rate': 0.01}, kvstore=kv)
    assert trainer.update_on_kvstore
    train(model, x, y, lambda: trainer.step(32), trainer.zero_grad)
    for got, want in zip(model.parameters(), reference_weights()):
        assert torch.allclose(got, want, atol=1e-6)
    with pytest.raises(NotImplementedError, match='update_on_kvstore=False'):
        trainer.save_states(tmp_path / 's')   # KVStoreBase's own save raises


def test_register_and_create_give_a_store_of_ones_own(registry):
    assert KVStoreBase.register(Loopback) is Loopback and registry['loopback'] is Loopback
    for name in ('loopback', 'LoopBack'):
        assert type(kvps.kvstore.create(name)) is Loopback and type(kvps.create(name)) is Loopback
    model, x, y = model_and_data()
    trainer = Trainer(model.parameters(), 'sgd', {'learning_rate': 0.01, 'momentum': 0.9},
                      kvstore='loopback')     # Gluon 2.0 creates a registered store by name
    assert type(trainer.kvstore) is Loopback
    train(model, x, y, lambda: trainer.step(32), trainer.zero_grad)
    for got, want in zip(model.parameters(), alone_weights()):
        assert torch.equal(got, want)
    # kvps's own stores are KVStoreBases too, as MXNet's KVStore is
    assert isinstance(kvps.create('local'), KVStoreBase) and KVStore.register is \
        KVStoreBase.register


def test_bad_registrations_are_refused(registry):
    with pytest.raises(TypeError, match='takes a class'):
        KVStoreBase.register(Loopback())
    with pytest.raises(TypeError, match='subclass of kvps.kvstore.KVStoreBase, got DictStore'):
        KVStoreBase.register(DictStore)
    for name in ('Local', 'Dist_Sync', 'DEVICE', 'dist_async_device'):
        with pytest.raises(ConfigError, match=f"'{name}' is a kvps store type"):
            KVStoreBase.register(type(name, (Loopback,), {}))
    assert 'local' not in registry and type(kvps.create('local')) is KVStore
    KVStoreBase.register(Loopback)
    with pytest.warns(UserWarning, match="kvstore 'loopback': .* replaces .*Loopback"):
        KVStoreBase.register(type('Loopback', (Loopback,), {}))


def test_a_store_with_neither_surface_is_refused_naming_what_it_has():
    class Half:
        type = 'dist_sync'

        def push(self, key, value, priority=0):
            pass
    model, _, _ = model_and_data()
    with pytest.raises(TypeError, match=r"got Half, which has push, type"):
        Trainer(model.parameters(), 'sgd', kvstore=Half())


def test_kvps_extensions_of_a_store_of_ones_own_are_used_when_present():
    class Agreeing(DictStore):
        rank = 0

        def __init__(self):
            super().__init__()
            self.asked = []

        def agree(self, digest):
            self.asked.append(('agree', len(digest)))
            return []

        def balance_keys(self, total):
            self.asked.append(('balance_keys', total))
    model, _, _ = model_and_data()
    kv = Agreeing()
    Trainer(model.parameters(), 'sgd', kvstore=kv)
    # the parameter table, then the fused layout (none), then the placement hint
    assert kv.asked == [('agree', 32), ('agree', 32), ('balance_keys', 4 * 8 + 8 + 8 + 1)]


def test_a_registered_name_with_compression_params_reaches_the_store(registry):
    class Compressing(Loopback):
        def set_gradient_compression(self, params):
            Compressing.given = params
    KVStoreBase.register(Compressing)
    model, _, _ = model_and_data()
    Trainer(model.parameters(), 'sgd', kvstore='compressing',
            compression_params={'type': '2bit', 'threshold': 0.5})
    assert Compressing.given == {'type': '2bit', 'threshold': 0.5}
