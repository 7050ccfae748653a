"""The MXNet KVStore API on the in-process 'local' store: names, keys, values, errors."""

import re

import numpy as np
import pytest
import torch

import kvps
from kvps.errors import (ConfigError, DTypeError, DuplicateInitError, KeyNotInitializedError,
                         KeyTypeError, ShapeError)
from kvps.kvstore import parse_type


@pytest.mark.parametrize('name, parsed', [
    ('local', (False, True, False)), ('device', (False, True, True)),
    ('dist', (True, True, False)), ('dist_sync', (True, True, False)),
    ('dist_async', (True, False, False)), ('dist_sync_device', (True, True, True)),
    ('dist_device_sync', (True, True, True)), ('dist_async_device', (True, False, True)),
    ('local_allreduce_cpu', (False, True, False)),
])
def test_type_names_parse_by_substring(name, parsed):
    assert parse_type(name) == parsed


def test_bad_type_names():
    with pytest.raises(TypeError):
        kvps.create(3)
    with pytest.raises(ConfigError, match='unknown kvstore type .*known types'):
        kvps.create('dist_sink')
    with pytest.raises(ConfigError):
        kvps.create('sync')


def test_dist_without_environment_says_how_to_start():
    with pytest.raises(ConfigError, match='kvps.launch'):
        kvps.kvstore.create('dist_sync')


@pytest.mark.parametrize('role', ['server', 'scheduler'])
def test_a_script_started_as_another_role_is_told_it_is_no_worker(monkeypatch, role):
    """A scheduler or server runs its role at `import kvps`; one whose role was set after
    that import (as here) must not register as a worker: it would take a real worker's
    place and leave the job a node short."""
    for name, value in {'DMLC_ROLE': role, 'DMLC_PS_ROOT_URI': '127.0.0.1',
                        'DMLC_PS_ROOT_PORT': '9', 'DMLC_NUM_WORKER': '1',
                        'DMLC_NUM_SERVER': '1', 'KVPS_CONNECT_TIMEOUT': '1'}.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError, match=f"DMLC_ROLE={role}.*only workers do.*python -m kvps.node"):
        kvps.kvstore.create('dist_sync')


def test_a_worker_given_port_0_is_told_only_the_scheduler_takes_it(monkeypatch):
    """Port 0 lets the scheduler's OS pick its port; a worker or server given it waited out
    KVPS_CONNECT_TIMEOUT and then suspected the job's secret."""
    for name, value in {'DMLC_ROLE': 'worker', 'DMLC_PS_ROOT_URI': '127.0.0.1',
                        'DMLC_PS_ROOT_PORT': '0', 'DMLC_NUM_WORKER': '1',
                        'DMLC_NUM_SERVER': '1', 'KVPS_CONNECT_TIMEOUT': '1'}.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError, match='DMLC_PS_ROOT_PORT=0.*only on the scheduler'):
        kvps.kvstore.create('dist_sync')


def test_local_and_device_echo_their_type_and_are_single_worker():
    for name in ('local', 'device'):
        kv = kvps.kvstore.create(name)
        assert (kv.type, kv.rank, kv.num_workers) == (name, 0, 1)
        assert kv.is_capable('optimizer') and kv.is_capable('OPTIMIZER')


def test_an_unknown_capability_is_a_value_error_as_in_mxnet():
    kv = kvps.create('local')
    for name in ('sparse', 'no_such_capability'):
        with pytest.raises(ValueError, match=f'Unknown capability: {name}'):
            kv.is_capable(name)


def test_push_replaces_with_the_sum_of_a_value_list():
    kv = kvps.create('local')
    kv.init(3, np.ones((2, 3), np.float32))
    kv.push(3, [np.full((2, 3), 2, np.float32), np.full((2, 3), 5, np.float32)])
    out = np.zeros((2, 3), np.float32)
    kv.pull(3, out=out)
    assert (out == 7).all()


def test_list_keys_and_multi_device_pull():
    kv = kvps.create('local')
    kv.init(['a', 'b'], [np.zeros(2), np.ones(3)])
    kv.push(['a', 'b'], [np.full(2, 4.0), np.full(3, 9.0)])
    outs = [np.zeros(2), np.zeros(2)]
    b = np.zeros(3)
    kv.pull(['a', 'b'], out=[outs, b])
    assert outs[0].tolist() == outs[1].tolist() == [4, 4] and b.tolist() == [9, 9, 9]


def test_torch_tensors_in_and_out_in_place():
    kv = kvps.create('local')
    w = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    kv.init(0, w)
    kv.push(0, torch.ones(2, 3, requires_grad=True) * 2)
    target = torch.zeros(2, 3)
    pointer = target.data_ptr()
    kv.pull(0, out=target)
    assert target.data_ptr() == pointer and (target == 2).all()


def test_pushed_array_is_not_modified_and_later_changes_do_not_leak():
    kv = kvps.create('local')
    kv.init(0, np.zeros(3))
    g = np.array([1.0, 2.0, 3.0])
    kv.push(0, g)
    g[:] = 100                          # after push returned: must not affect the store
    out = np.zeros(3)
    kv.pull(0, out=out)
    assert out.tolist() == [1, 2, 3]


def test_pushpull_and_broadcast():
    kv = kvps.create('local')
    kv.init(1, np.zeros(2))
    value = np.array([1.0, 2.0])
    kv.pushpull(1, value)
    assert value.tolist() == [1, 2]
    out = np.zeros(2)
    kv.broadcast(2, np.array([5.0, 6.0]), out=out)
    assert out.tolist() == [5, 6]


@pytest.mark.parametrize('bad', ['target', 'value'])
def test_pushpull_checks_values_and_targets_before_anything_is_pushed(bad):
    kv = kvps.create('local')
    kv.init([0, 1], [np.zeros(2), np.zeros(3)])
    values = [np.ones(2), np.ones(3)]
    outs = [np.zeros(2), np.zeros(3)]
    if bad == 'target':
        outs[1] = np.zeros(4)
    else:
        values[1] = np.ones(4)
    with pytest.raises(ValueError, match='key 1'):
        kv.pushpull([0, 1], values, out=outs)
    stored = [np.full(2, -1.0), np.full(3, -1.0)]
    kv.pull([0, 1], out=stored)
    assert [o.tolist() for o in stored] == [[0, 0], [0, 0, 0]]   # nothing was pushed
    assert outs[0].tolist() == [0, 0]                            # nothing was written


def test_non_contiguous_pull_target():
    kv = kvps.create('local')
    kv.init(0, np.zeros((3, 2)))
    kv.push(0, np.arange(6.0).reshape(3, 2))
    target = np.zeros((2, 3)).T           # Fortran-ordered view, shape (3, 2)
    kv.pull(0, out=target)
    assert target.tolist() == np.arange(6.0).reshape(3, 2).tolist()


def test_a_pull_target_whose_elements_share_memory_is_refused():
    """Every row of an expanded view is the same memory: it would silently hold the last
    row (torch's copy_ refuses it too)."""
    kv = kvps.create('local')
    kv.init(0, torch.zeros(4, 3))
    kv.push(0, torch.arange(12.0).reshape(4, 3))
    own = torch.zeros(4, 3)
    for targets in (torch.zeros(1, 3).expand(4, 3), [own, torch.zeros(3).expand(4, 3)]):
        with pytest.raises(ValueError, match='share memory'):
            kv.pull(0, out=targets)
    kv.push(0, torch.ones(3).expand(4, 3))             # a pushed view is only read: fine
    kv.pull(0, out=own)
    assert own.tolist() == [[1.0] * 3] * 4


def test_a_key_given_twice_in_one_call_is_one_key_as_in_mxnet():
    """MXNet groups a call's equal keys: their pushed values are summed into one push (one
    optimizer update), and each of their pull targets is written."""
    kv = kvps.create('local')
    kv.init([0, 1], [np.zeros(2), np.zeros(2)])
    kv.push([0, 1, 0], [np.ones(2), np.full(2, 7.0), [np.full(2, 2.0), np.full(2, 3.0)]])
    a, b, c = np.zeros(2), np.zeros(2), np.zeros(2)
    kv.pull([0, 1, 0], out=[a, b, c])
    assert (a.tolist(), b.tolist(), c.tolist()) == ([6, 6], [7, 7], [6, 6])
    kv.set_optimizer(kvps.optimizer.create('sgd', learning_rate=1.0, momentum=0.9))
    kv.push([1, 1], [np.ones(2), np.ones(2)])
    kv.pull(1, out=b)
    assert b.tolist() == [5, 5]                        # 7 - 1 * 2: one update, not two
    with pytest.raises(DuplicateInitError, match='one value per key'):
        kv.init([2, 2], [np.zeros(1), np.ones(1)])


def test_calls_of_many_keys_of_one_array_each_give_what_key_by_key_calls_give():
    """Such calls take a shorter way through the store (pulls._plain,
    StoreKeys.plain_copies); a list with any other kind of key, value or target in it takes
    the whole one, and every call gives what the same calls key by key give."""
    kv = kvps.create('local')
    shapes = [(3,), (2, 2), (4,)]
    kv.init([0, 1, 2], [np.zeros(s, np.float32) for s in shapes])
    kv.init(3, torch.zeros(2, dtype=torch.bfloat16))
    values = [np.arange(np.prod(s), dtype=np.float32).reshape(s) + 1 for s in shapes]
    kv.push([3], [torch.full((2,), 3.0, dtype=torch.bfloat16)])
    plain = [np.zeros(s, np.float32) for s in shapes]
    for scale in (2, 1):   # (a key's first push places it; the next ones are plain)
        kv.push([0, 1, 2], [v * scale for v in values])
        kv.pull([0, 1, 2], out=plain)
        assert [p.tolist() for p in plain] == [(v * scale).tolist() for v in values]
    mixed = [np.zeros(3, np.float64),                        # cast into
             np.zeros((2, 2), np.float32).T,                 # not C-contiguous
             np.zeros(4, np.float32), torch.zeros(2, dtype=torch.bfloat16)]
    kv.pull([0, 1, 2, 3], out=mixed)
    assert [m.tolist() for m in mixed] == [values[0].tolist(), values[1].tolist(),
                                          values[2].tolist(), [3, 3]]
    with pytest.raises(DTypeError, match='uint16'):       # (bfloat16's bits: not a target)
        kv.pull([0, 3], out=[plain[0], np.zeros(2, np.uint16)])
    kv.push([0, 2, 0], [values[0], values[2], values[0]])   # a key twice: one push, summed
    again = [np.zeros(3, np.float32), np.zeros(4, np.float32)]
    kv.pull([0, 2], out=again)
    assert again[0].tolist() == (2 * values[0]).tolist() and again[1].tolist() == \
        values[2].tolist()
    with pytest.raises(ShapeError, match='key 2'):           # checked before anything is sent
        kv.push([0, 2], [values[0] * 5, np.zeros(3, np.float32)])
    kv.pull([0], out=again[:1])
    assert again[0].tolist() == (2 * values[0]).tolist()
    with pytest.raises(ValueError, match='read-only'):      # and before anything is written
        kv.pull([0, 2], out=[plain[0], np.frombuffer(bytes(16), np.float32)])


def test_str_keys_longer_than_the_wire_allows_are_refused_at_the_call():
    kv = kvps.create('local')
    kv.init('w' * 1024, np.zeros(1))
    with pytest.raises(KeyTypeError, match='at most 1024 characters'):
        kv.init('w' * 1025, np.zeros(1))


def test_dtypes_fp16_fp64_and_bfloat16():
    kv = kvps.create('local')
    kv.init(0, np.zeros(2, np.float16))
    kv.push(0, np.array([1.5, 2.5], np.float16))
    out = np.zeros(2, np.float16)
    kv.pull(0, out=out)
    assert out.tolist() == [1.5, 2.5]
    kv.init(1, torch.zeros(3, dtype=torch.bfloat16))
    kv.push(1, torch.tensor([1.0, 2.0, 0.5], dtype=torch.bfloat16))
    b = torch.zeros(3, dtype=torch.bfloat16)
    kv.pull(1, out=b)
    assert b.tolist() == [1.0, 2.0, 0.5]


def test_numpy_integer_and_enum_keys_are_their_values():
    import enum

    class Name(str, enum.Enum):
        W = 'w'
    ints, strs = kvps.create('local'), kvps.create('local')
    ints.init(list(np.arange(3)), [np.zeros(2, np.float32)] * 3)   # np.int64 keys
    ints.push(1, np.ones(2, np.float32))
    out = np.zeros(2, np.float32)
    ints.pull(np.int32(1), out=out)
    assert out.tolist() == [1, 1]
    with pytest.raises(DuplicateInitError):
        ints.init(enum.IntEnum('K', 'A B').B, np.zeros(2, np.float32))   # the value 2
    strs.init(Name.W, np.zeros(1))
    strs.push('w', np.ones(1))
    with pytest.raises(KeyTypeError, match='bool'):
        ints.push(np.True_, np.zeros(2, np.float32))


def test_clear_errors_leave_the_store_usable():
    kv = kvps.create('local')
    kv.init(0, np.zeros(2, np.float32))
    with pytest.raises(DuplicateInitError):
        kv.init(0, np.zeros(2, np.float32))
    with pytest.raises(DuplicateInitError):
        kv.init([1, 1], [np.zeros(1), np.zeros(1)])
    with pytest.raises(KeyNotInitializedError, match='kv.init'):
        kv.push(9, np.zeros(2, np.float32))
    with pytest.raises(KeyNotInitializedError):
        kv.pull(9, out=np.zeros(2, np.float32))
    with pytest.raises(ShapeError, match=r'shape \(3,\)'):
        kv.push(0, np.zeros(3, np.float32))
    with pytest.raises(DTypeError, match='float64'):
        kv.push(0, np.zeros(2, np.float64))
    with pytest.raises(DTypeError, match='unsupported dtype'):
        kv.pull(0, out=np.zeros(2, np.complex64))   # (another kvps dtype is cast into)
    with pytest.raises(KeyTypeError, match='one kind per store'):
        kv.init('w', np.zeros(1))
    with pytest.raises(KeyTypeError):
        kv.push(1.5, np.zeros(2, np.float32))
    with pytest.raises(DTypeError, match='unsupported dtype'):
        kv.init(5, np.zeros(2, np.complex64))
    swapped = np.dtype(np.float32).newbyteorder()   # same name, bytes the wire would misread
    with pytest.raises(DTypeError, match='byte order'):
        kv.push(0, np.zeros(2, swapped))
    with pytest.raises(DTypeError, match='byte order'):
        kv.init(6, np.zeros(2, swapped))
    with pytest.raises(TypeError, match='numpy arrays, torch tensors or cupy arrays'):
        kv.push(0, [1.0, 2.0])
    with pytest.raises(TypeError, match='out='):
        kv.pull(0)
    with pytest.raises(ValueError, match='same length'):
        kv.push([0, 1], [np.zeros(2, np.float32)])
    kv.push(0, np.ones(2, np.float32))
    out = np.zeros(2, np.float32)
    kv.pull(0, out=out)
    assert out.tolist() == [1, 1]


def test_set_optimizer_rejects_non_optimizers():
    kv = kvps.create('local')
    with pytest.raises(TypeError, match='kvps optimizer'):
        kv.set_optimizer(torch.optim.SGD)


def test_optimizer_states_round_trip_through_a_file(tmp_path):
    def run(load=None, save=None, steps=range(3)):
        kv = kvps.create('local')
        kv.init('w', np.linspace(0, 1, 10, dtype=np.float32))
        kv.set_optimizer(kvps.optimizer.create('adam', learning_rate=0.1))
        if load:
            kv.load_optimizer_states(load)
        for step in steps:
            kv.push('w', np.full(10, step + 1.0, np.float32))
        if save:
            kv.save_optimizer_states(save)
        out = np.zeros(10, np.float32)
        kv.pull('w', out=out)
        return kv, out
    _, straight = run(steps=range(6))
    kv, half = run(save=tmp_path / 's')
    kv2 = kvps.create('local')
    kv2.init('w', half)
    kv2.set_optimizer(kvps.optimizer.create('adam', learning_rate=0.1))
    kv2.load_optimizer_states(tmp_path / 's')
    for step in range(3, 6):
        kv2.push('w', np.full(10, step + 1.0, np.float32))
    out = np.zeros(10, np.float32)
    kv2.pull('w', out=out)
    assert out.tolist() == straight.tolist()


def test_optimizer_state_errors(tmp_path):
    kv = kvps.create('local')
    kv.init(0, np.zeros(2, np.float32))
    with pytest.raises(ConfigError, match='no optimizer'):
        kv.save_optimizer_states(tmp_path / 'x')
    (tmp_path / 'junk').write_bytes(b'\xc1\xc1')
    with pytest.raises(ConfigError, match='not a kvps optimizer-state file'):
        kv.load_optimizer_states(tmp_path / 'junk')


def test_a_file_that_does_not_fit_the_key_changes_nothing_and_is_named(tmp_path):
    """A state of another size would be cut to fit; a refused file must not leave its
    optimizer installed either (the store had none: pushes still replace the value)."""
    saver = kvps.create('local')
    saver.init(0, np.zeros(3))
    saver.set_optimizer(kvps.optimizer.create('sgd', momentum=0.9))
    saver.push(0, np.ones(3))
    saver.save_optimizer_states(tmp_path / 's', dump_optimizer=True)
    kv = kvps.create('local')
    kv.init(0, np.zeros(2))
    with pytest.raises(ConfigError, match=r"^.*s: key 0: optimizer state 'mom' holds 3 "
                                          r'float64 elements in 24 bytes, but the key has 2'):
        kv.load_optimizer_states(tmp_path / 's')
    kv.push(0, np.full(2, 5.0))
    out = np.zeros(2)
    kv.pull(0, out=out)
    assert out.tolist() == [5.0, 5.0]


def _store_with_momentum(dtype, multi_precision=False):
    kv = kvps.create('local')
    kv.init(0, np.zeros(2, dtype))
    kv.set_optimizer(kvps.optimizer.create('sgd', momentum=0.5, learning_rate=1.0,
                                           multi_precision=multi_precision))
    kv.push(0, np.ones(2, dtype))
    return kv


@pytest.mark.parametrize('saved, loaded, refusal', [
    (('float64',), ('float32',), r"optimizer state 'mom' is float64, but the key is float32, "
                                 r'whose state is float32'),
    (('float32',), ('float64',), r"optimizer state 'mom' is float32, but the key is float64, "
                                 r'whose state is float64'),
    (('float16', True), ('float16',), r'the optimizer state holds an fp32 master weight, but this float16 key '
                                      r'keeps none \(only float16 and bfloat16 keys'),
    (('float16',), ('float16', True), r'the optimizer state holds no fp32 master weight, but this float16 key keeps '
                                      r'one under multi_precision')])
def test_a_state_of_another_dtype_is_refused_at_load_and_changes_nothing(tmp_path, saved,
                                                                         loaded, refusal):
    """Not at the first update after it (the load looked fine, the training then fails),
    nor converted: the state's dtype follows the key's and the optimizer's multi_precision,
    so a mismatch means a file of another job (MXNet's update fails on it alike)."""
    _store_with_momentum(*saved).save_optimizer_states(tmp_path / 's')
    kv = _store_with_momentum(*loaded)
    before = kv.get_optimizer_states()
    with pytest.raises(ConfigError, match=f'^{re.escape(str(tmp_path / "s"))}: key 0 part 0: '
                                          + refusal):
        kv.load_optimizer_states(tmp_path / 's')
    assert kv.get_optimizer_states() == before
    kv.push(0, np.ones(2, loaded[0]))          # the store trains on with its own state
    out = np.zeros(2, loaded[0])
    kv.pull(0, out=out)
    assert out.tolist() == [-2.5, -2.5]        # mom 0.5 * -1 - 1, then w -1 - 1.5


@pytest.mark.parametrize('saved, loaded', [
    ({'name': 'adam'}, {'name': 'sgd', 'momentum': 0.9}),
    ({'name': 'sgd'}, {'name': 'sgd', 'momentum': 0.9}),      # no state, then momentum
    ({'name': 'sgd', 'momentum': 0.9}, {'name': 'adam'})])
def test_states_saved_under_another_optimizer_are_refused_at_load(tmp_path, saved, loaded):
    kv = kvps.create('local')
    kv.init(0, np.zeros(2))
    kv.set_optimizer(kvps.optimizer.create(**saved))
    kv.push(0, np.ones(2))
    kv.save_optimizer_states(tmp_path / 's')
    other = kvps.create('local')
    other.init(0, np.zeros(2))
    other.set_optimizer(kvps.optimizer.create(**loaded))
    with pytest.raises(ConfigError, match='saved under another optimizer'):
        other.load_optimizer_states(tmp_path / 's')
    other.push(0, np.ones(2))          # the store keeps its own (empty) state and trains on
    out = np.zeros(2)
    other.pull(0, out=out)
    assert (out < 0).all()


def test_agree_on_one_worker_is_always_unanimous_and_takes_only_a_digest():
    kv = kvps.create('local')
    assert kv.agree(b'\x01' * 32) == []
    with pytest.raises(ValueError, match='at most 64 bytes'):
        kv.agree(b'x' * 65)


def test_a_python_updater_runs_in_place_as_in_mxnets_tutorial():
    kv = kvps.create('local')
    kv.init(3, np.ones((2, 3), np.float32) * 2)
    seen = []

    def update(key, merged, stored):
        seen.append((key, merged.shape, stored.shape, merged.tolist()))
        stored += merged * 2
    kv._set_updater(update)
    out = np.zeros((2, 3), np.float32)
    kv.push(3, [np.ones((2, 3), np.float32), np.ones((2, 3), np.float32)])   # summed first
    kv.pull(3, out=out)
    assert out.tolist() == [[6] * 3] * 2
    assert seen == [(3, (2, 3), (2, 3), [[2] * 3] * 2)]


def test_an_optimizer_and_a_python_updater_replace_each_other(tmp_path):
    kv = kvps.create('local')
    kv.init('w', np.zeros(2, np.float32))
    kv.set_updater(lambda key, merged, stored: stored.__isub__(merged))
    with pytest.raises(ConfigError, match='Python updater'):
        kv.save_optimizer_states(tmp_path / 's')
    kv.push('w', np.ones(2, np.float32))
    kv.set_optimizer(kvps.optimizer.create('test', rescale_grad=0.5))   # w += 0.5 * g
    kv.push('w', np.ones(2, np.float32))
    out = np.zeros(2, np.float32)
    kv.pull('w', out=out)
    assert out.tolist() == [-0.5, -0.5]


def test_a_failing_python_updater_raises_from_push_and_the_store_stays_usable():
    kv = kvps.create('local')
    kv.init('w', np.ones(2, np.float32))

    def broken(key, merged, stored):
        raise ValueError('bug in my updater')
    kv._set_updater(broken)
    with pytest.raises(ValueError, match='bug in my updater'):
        kv.push('w', np.ones(2, np.float32))
    kv._set_updater(lambda key, merged, stored: stored.__iadd__(merged))
    kv.push('w', np.ones(2, np.float32))
    out = np.zeros(2, np.float32)
    kv.pull('w', out=out)
    assert out.tolist() == [2, 2]
    with pytest.raises(TypeError, match='callable'):
        kv._set_updater('sgd')


def test_a_distributed_store_refuses_a_python_updater():
    from kvps.kvstore import KVStore
    from kvps.worker.client import DistClient

    class Servers:   # a distributed backend: optimizers travel as data, code never does
        keys, closed, forked = {}, False, False
        set_updater = DistClient.set_updater
    with pytest.raises(ConfigError, match='never sends code'):
        KVStore('dist_sync', Servers())._set_updater(lambda key, merged, stored: None)


def test_a_store_shared_by_threads_applies_every_push_once():
    # Training loops with a data-loading or logging thread share one store; the local shard's
    # rounds must not interleave (they once lost and doubled updates here).
    import threading
    kv = kvps.create('local')
    keys = list(range(4))
    kv.init(keys, [np.zeros(8, np.float32) for _ in keys])
    kv.set_optimizer(kvps.optimizer.create('sgd', learning_rate=1.0))
    pushes = 1500

    def train(key):
        grad = np.ones(8, np.float32)
        for _ in range(pushes):
            kv.push(key, grad)

    threads = [threading.Thread(target=train, args=(k,)) for k in keys]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    outs = [np.zeros(8, np.float32) for _ in keys]
    kv.pull(keys, out=outs)
    assert [o.tolist() for o in outs] == [[-float(pushes)] * 8] * len(keys)


def test_pulls_from_one_thread_see_whole_pushes_of_another():
    # An evaluation thread pulls the weights while the training thread pushes: each pull is
    # the value after some number of whole pushes, never one half-updated, never going back.
    import threading
    kv = kvps.create('local')
    kv.init([0, 1], [np.zeros(4096, np.float32), np.full(3, 7.0, np.float32)])
    kv.set_optimizer(kvps.optimizer.create('sgd', learning_rate=1.0))
    pushes, pushing, seen = 300, threading.Event(), []

    def train():
        grad = np.ones(4096, np.float32)
        for _ in range(pushes):
            kv.push(0, grad)
        pushing.clear()

    def evaluate():
        w, other = np.empty(4096, np.float32), np.empty(3, np.float32)
        while pushing.is_set() or not seen:
            kv.pull([0, 1], out=[w, other])
            seen.append((float(w[0]), bool((w == w[0]).all()), other.tolist()))

    pushing.set()
    threads = [threading.Thread(target=train), threading.Thread(target=evaluate)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    firsts = [first for first, _, _ in seen]
    assert all(whole and other == [7.0] * 3 for _, whole, other in seen)
    assert firsts == sorted(firsts, reverse=True) and all(f.is_integer() for f in firsts)
    w = np.empty(4096, np.float32)
    kv.pull(0, out=w)
    assert w.tolist() == [-float(pushes)] * 4096


@pytest.mark.parametrize('name', ['sgd', 'nag', 'adam', 'adamw', 'rmsprop', 'adagrad', 'ftrl',
                                  'signum', 'lamb'])
def test_an_empty_key_takes_every_optimizer(name):
    # A zero-width layer (nn.Linear(4, 0)) gives a size-0 key; it has nothing to update and
    # must not fail the keys pushed with it.
    kv = kvps.create('local')
    kv.init(['empty', 'w'], [np.zeros((0, 3), np.float32), np.ones(3, np.float32)])
    with_momentum = {'momentum': 0.9} if name in ('sgd', 'nag', 'signum') else {}
    kv.set_optimizer(kvps.optimizer.create(name, learning_rate=0.1, **with_momentum))
    kv.push(['empty', 'w'], [np.zeros((0, 3), np.float32), np.ones(3, np.float32)])
    empty, w = np.zeros((0, 3), np.float32), np.zeros(3, np.float32)
    kv.pull(['empty', 'w'], out=[empty, w])
    assert empty.shape == (0, 3) and (w < 1).all()


def test_a_closed_store_refuses_every_call():
    from kvps.errors import StoreClosedError
    kv = kvps.create('local')
    kv.init(0, np.zeros(2, np.float32))
    kv.close()
    out = np.zeros(2, np.float32)
    calls = [lambda: kv.init(1, out), lambda: kv.push(0, out), lambda: kv.pull(0, out=out),
             lambda: kv.pushpull(0, out), kv.barrier, lambda: kv.agree(b'x'),
             lambda: kv.set_optimizer(kvps.optimizer.create('sgd')),
             lambda: kv.save_optimizer_states('never-written')]
    for call in calls:
        with pytest.raises(StoreClosedError, match='closed'):
            call()
    kv.close()   # closing twice is fine


def test_keys_outside_64_bits_are_refused_at_the_call():
    kv = kvps.create('local')
    for key in (2 ** 64, -2 ** 63 - 1):
        with pytest.raises(KeyTypeError, match='64 bits'):
            kv.init(key, np.zeros(1))
    kv.init([2 ** 64 - 1, -2 ** 63], [np.zeros(1), np.ones(1)])   # the edges travel


def test_init_takes_one_value_per_key_and_mxnet_spellings_exist():
    kv = kvps.create('local')
    with pytest.raises(DuplicateInitError, match='one value per key'):
        kv.init(0, [np.zeros(1), np.ones(1)])
    kv.init(0, np.zeros(1))
    kv._barrier()
    assert kv.is_capable(kv.OPTIMIZER)
    out = np.full(1, 7.0)
    kv.row_sparse_pull(0, out=out, row_ids=np.array([0]))
    assert out.tolist() == [0.0]


def test_kvps_log_level_reaches_the_workers_own_log_lines():
    """Only nodes configured logging: a worker's DEBUG lines never showed, nor could ERROR
    quiet its warnings. (A subprocess: pytest holds handlers on the root logger.)"""
    import subprocess
    import sys
    code = ('import logging, kvps.kvstore.job as k; log = logging.getLogger("kvps.worker")\n'
            'k._worker_logging("DEBUG"); log.debug("shown")\n'
            'k._worker_logging("ERROR"); log.warning("quieted")\n')
    run = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == 0, run.stderr
    assert 'kvps.worker DEBUG shown' in run.stderr and 'quieted' not in run.stderr


def test_all_sum_of_one_worker_is_its_values_as_float64_in_their_shape():
    kv = kvps.create('local')
    got = kv.all_sum([[1, 2], [3, 4]])
    assert got.dtype == np.float64 and got.tolist() == [[1, 2], [3, 4]]
    assert kv.all_sum(7).tolist() == 7.0
    for bad in ([], np.zeros(8193)):
        with pytest.raises(ValueError, match='1 to 8192 numbers'):
            kv.all_sum(bad)
