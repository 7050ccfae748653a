"""kvps.Trainer over a store of the user's own making, with MXNet's surface only (type, init,
push, pull, is_capable): it trains, without kvps's extensions and without AttributeErrors."""

import pytest

torch = pytest.importorskip('torch')

from kvps import Trainer  # noqa: E402
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
