"""Optimizers written in Python in the stores and Trainer that run them in this process, and on
a server: its plugins imported at start, an optimizer checked without being set."""

import numpy as np
import pytest
from test_python_optimizers import SPECS, by_hand, grads

import kvps
from kvps.errors import ConfigError
from kvps.optimizer import create

pytestmark = pytest.mark.usefixtures('plugin')   # the tests' plugin (tests/conftest.py)


def test_the_local_store_runs_it_with_shapes_and_saves_its_state(tmp_path):
    shape, gs = (3, 4), grads((3, 4), 4)
    kv = kvps.create('local')
    kv.init('w', np.ones(shape, np.float32))
    kv.set_optimizer(create('test_py_dcasgd', **SPECS['test_py_dcasgd']))
    for g in gs[:2]:
        kv.push('w', g)
    kv.save_optimizer_states(tmp_path / 's', dump_optimizer=True)
    for g in gs[2:]:
        kv.push('w', g)
    got = np.zeros(shape, np.float32)
    kv.pull('w', out=got)
    want = by_hand(create('test_py_dcasgd', **SPECS['test_py_dcasgd']), 'w',
                   np.ones(shape, np.float32), gs)
    np.testing.assert_array_equal(got, want)
    # a new store at the weights of step 2, with the file's optimizer, state and counts
    again = kvps.create('local')
    again.init('w', by_hand(create('test_py_dcasgd', **SPECS['test_py_dcasgd']), 'w',
                            np.ones(shape, np.float32), gs[:2]))
    again.load_optimizer_states(tmp_path / 's')
    for g in gs[2:]:
        again.push('w', g)
    again.pull('w', out=got)
    np.testing.assert_array_equal(got, want)


def test_rows_pushed_to_a_python_update_are_applied_densely():
    kv = kvps.create('local')
    kv.init(0, np.zeros((4, 2), np.float32))
    kv.set_optimizer(create('test_py_momentum', learning_rate=1.0))
    kv.push(0, kvps.RowSparse(np.array([2]), np.ones((1, 2), np.float32)))
    got = np.zeros((4, 2), np.float32)
    kv.pull(0, out=got)
    assert got.tolist() == [[0, 0], [0, 0], [-1, -1], [0, 0]]


def test_a_bfloat16_key_of_the_local_store_is_not_refused():
    kv = kvps.create('local')
    torch = pytest.importorskip('torch')
    kv.init(0, torch.ones(4, dtype=torch.bfloat16))
    kv.set_optimizer(create('test_py_momentum', learning_rate=0.5))
    kv.push(0, torch.ones(4, dtype=torch.bfloat16))
    got = torch.zeros(4, dtype=torch.bfloat16)
    kv.pull(0, out=got)
    assert got.tolist() == [0.5] * 4


def test_an_update_that_raises_fails_that_key_of_the_push_and_the_store_goes_on():
    kv = kvps.create('local')
    kv.init([0, 1], [np.zeros(2, np.float32)] * 2)
    kv.set_optimizer(create('test_py_picky', learning_rate=1.0))
    with pytest.raises(ValueError, match='key 1: a negative gradient'):
        kv.push([0, 1], [np.ones(2, np.float32), -np.ones(2, np.float32)])
    kv.push([0, 1], [np.ones(2, np.float32)] * 2)
    got = [np.zeros(2, np.float32) for _ in range(2)]
    kv.pull([0, 1], out=got)
    assert [g.tolist() for g in got] == [[-2.0, -2.0], [-1.0, -1.0]]


@pytest.mark.parametrize('uok', [True, False])
def test_the_trainer_runs_it_alone_and_through_a_store_alike(uok, tmp_path):
    """The Trainer hands each parameter in its shape (its own key: not fused when it reads
    weights whole), whoever updates; states saved by one load into the other."""
    torch = pytest.importorskip('torch')
    from kvps.kvstore import KVStore
    from kvps.kvstore.local import LocalBackend

    def run(kvstore, steps, load=None, save=None):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2))
        x, y = torch.randn(16, 6), torch.randn(16, 2)
        trainer = kvps.Trainer(model, 'test_py_dcasgd', dict(SPECS['test_py_dcasgd']),
                               kvstore=kvstore, update_on_kvstore=uok if kvstore else None)
        if load:
            for _ in range(2):   # the weights the file's state goes with, then its state
                trainer.zero_grad()
                torch.nn.functional.mse_loss(model(x), y, reduction='sum').backward()
                trainer.step(16)
            trainer.load_states(load)
        for _ in range(steps):
            trainer.zero_grad()
            torch.nn.functional.mse_loss(model(x), y, reduction='sum').backward()
            trainer.step(16)
        if save:
            trainer.save_states(save)
        return trainer, [p.detach().clone() for p in model.parameters()]

    _, alone = run(None, 4)
    trainer, _ = run(KVStore('dist_sync', LocalBackend()), 2, save=tmp_path / 's')
    assert not trainer._layout.fused or not uok
    assert all(not f.updated_whole for f in trainer._layout.fused)
    _, resumed = run(None, 2, load=tmp_path / 's')   # the store's state goes on alone
    for a, b in zip(alone, resumed):
        assert torch.equal(a, b)
    _, more = run(KVStore('dist_sync', LocalBackend()), 2, load=tmp_path / 's')
    for a, b in zip(alone, more):
        assert torch.equal(a, b)


def test_a_server_imports_its_plugins_and_one_that_fails_stops_it(monkeypatch, caplog):
    from kvps.optimizer import plugins
    monkeypatch.setattr(plugins, '_loaded', None)   # as a server before its start
    plugins.import_plugins(['kvps_test_optimizers'])
    assert plugins.loaded() == ['kvps_test_optimizers']
    with pytest.raises(ConfigError, match='this server imported kvps_test_optimizers from '
                                          'KVPS_SERVER_PLUGINS'):
        create('test_py_nowhere')
    with pytest.raises(ConfigError, match=r"plugin 'kvps_broken_plugin' failed to import "
                                          r'\(RuntimeError: kvps_broken_plugin is broken on '
                                          r'purpose\); this server stops'):
        plugins.import_plugins(['kvps_test_optimizers', 'kvps_broken_plugin'])
    assert 'Traceback' in caplog.text and 'broken on purpose' in caplog.text
    with pytest.raises(ConfigError, match="'no_such_plugin' failed to import "
                                          r'\(ModuleNotFoundError'):
        plugins.import_plugins(['no_such_plugin'])


def test_a_server_asked_to_check_an_optimizer_answers_and_sets_nothing():
    import msgpack

    from kvps.server.records import ReplyKind
    from kvps.server.requests import Requests, durable
    from kvps.server.shard import Shard
    shard = Shard(1)
    requests = Requests(shard, None, 'server 0')

    def check(spec):
        header = {'op': 'set_optimizer', 'id': 1, 'check': True}
        (reply,) = requests.handle(b'w', header, [msgpack.packb(spec)])
        return reply
    for name, whole in (('test_py_adam', True), ('sgd', False)):
        reply = check(create(name).to_spec())
        assert (reply.kind, reply.payload) == (ReplyKind.ACK, {'whole': whole})
    assert shard.updater is None and not durable({'op': 'set_optimizer', 'check': True})
    for spec, match in (({'name': 'test_py_nowhere'}, 'KVPS_SERVER_PLUGINS'),
                        ({'name': 'test_py_adam', 'params': {'beta1': 'x'}}, 'a number')):
        reply = check(spec)
        assert reply.kind is ReplyKind.ERROR and isinstance(reply.payload, ConfigError)
        assert match in str(reply.payload)
