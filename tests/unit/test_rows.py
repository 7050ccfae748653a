"""Row-sparse values: pushes of some rows, lazy row updates, pulls of some rows and of the rows changed."""

import numpy as np
import pytest
import torch

import kvps
from kvps import rows
from kvps.errors import DTypeError, ProtocolError, ShapeError
from kvps.server.shard import Shard
from kvps.optimizer.updater import Updater
from kvps.worker.sharding import Sharding

W0, W1 = b'worker-0', b'worker-1'


def rs(ids, values, dtype=np.float32):
    return kvps.RowSparse(np.array(ids), np.array(values, dtype=dtype))


# -- values and their payload ----------------------------------------------------------------
def test_rows_are_sorted_and_repeated_ids_summed_without_touching_the_callers_values():
    values = np.array([[1, 1], [2, 2], [4, 4]], np.float32)
    ids, summed = rows.host_rows(kvps.RowSparse([5, 2, 5], values), (6, 2), 'float32', 'k')
    assert ids.tolist() == [2, 5] and summed.tolist() == [[2, 2], [5, 5]]
    assert values.tolist() == [[1, 1], [2, 2], [4, 4]]
    back = rows.decode(rows.encode(ids, summed), 2, np.dtype(np.float32), 6)
    assert back[0].tolist() == [2, 5] and back[1].tolist() == [[2, 2], [5, 5]]


def test_a_torch_sparse_gradient_is_taken_as_rows():
    emb = torch.nn.Embedding(5, 3, sparse=True)
    emb(torch.tensor([4, 1, 4])).sum().backward()
    ids, summed = rows.host_rows(emb.weight.grad, (5, 3), 'float32', 'k')
    assert ids.tolist() == [1, 4] and summed.tolist() == [[1] * 3, [2] * 3]


@pytest.mark.parametrize('value, error, match', [
    (kvps.RowSparse([6], np.ones((1, 2), np.float32)), ShapeError, 'row id 6 is out of range'),
    (kvps.RowSparse([-1], np.ones((1, 2), np.float32)), ShapeError, 'row id -1'),
    (kvps.RowSparse([1, 2], np.ones((1, 2), np.float32)), ShapeError, r'rows of shape \(2,\)'),
    (kvps.RowSparse([1], np.ones((1, 3), np.float32)), ShapeError, r'rows of shape \(2,\)'),
    (kvps.RowSparse([1], np.ones((1, 2), np.float64)), DTypeError, 'dtype float64'),
    (kvps.RowSparse([[1]], np.ones((1, 2), np.float32)), ShapeError, '1-D array of integers'),
    (kvps.RowSparse([0.5], np.ones((1, 2), np.float32)), ShapeError, '1-D array of integers'),
])
def test_bad_rows_are_refused_naming_the_key(value, error, match):
    kv = kvps.create('local')
    kv.init('emb', np.zeros((6, 2), np.float32))
    with pytest.raises(error, match=match):
        kv.push('emb', value)
    out = np.ones((6, 2), np.float32)
    kv.pull('emb', out=out)
    assert not out.any()   # nothing was applied


def test_init_with_rows_is_refused_clearly():
    kv = kvps.create('local')
    with pytest.raises(TypeError, match='init takes a dense value'):
        kv.init(0, kvps.RowSparse([1], np.ones((1, 2), np.float32)))


@pytest.mark.parametrize('payload, match', [
    (rows.encode(np.array([3, 1]), np.ones((2, 2), np.float32)), 'sorted, unique'),
    (rows.encode(np.array([1, 1]), np.ones((2, 2), np.float32)), 'sorted, unique'),
    (rows.encode(np.array([6]), np.ones((1, 2), np.float32)), 'below 6'),
    (rows.encode(np.array([1]), np.ones((1, 2), np.float32))[:-1], 'whole rows'),
])
def test_a_server_refuses_a_malformed_rows_payload(payload, match):
    shard = Shard(1)
    shard.init('t', 'k', 0, 'float32', [6, 2], True, memoryview(np.zeros(12, np.float32)))
    with pytest.raises(ProtocolError, match=match):
        shard.push('p', W0, 'k', 0, 'rows', True, memoryview(payload))


# -- what a push of rows does ---------------------------------------------------------------
def test_without_an_optimizer_pushed_rows_replace_the_value_zeros_elsewhere_as_in_mxnet():
    kv = kvps.create('local')
    kv.init(0, np.full((4, 2), 9, np.float32))
    kv.push(0, [rs([3, 1], [[1, 1], [2, 2]]), rs([1], [[5, 5]]), np.ones((4, 2), np.float32)])
    out = np.empty((4, 2), np.float32)
    kv.pull(0, out=out)
    assert out.tolist() == [[1, 1], [8, 8], [1, 1], [2, 2]]


def test_without_an_optimizer_each_round_of_rows_clears_the_last_ones_and_changes_only_those():
    kv = kvps.create('local')
    kv.init(0, np.full((6, 2), 9, np.float32))
    marks, seen = {}, np.empty((6, 2), np.float32)
    kv.pull_changed_rows_begin(0, seen, marks)()
    kv.push(0, rs([1, 4], [[1, 1], [2, 2]]))          # first: every row changes (9 -> 0)
    kv.pull_changed_rows_begin(0, seen, marks)()
    assert seen[:, 0].tolist() == [0, 1, 0, 0, 2, 0]
    seen[:] = 7
    kv.push(0, rs([4, 5], [[3, 3], [5, 5]]))          # then: the rows of both rounds only
    kv.pull_changed_rows_begin(0, seen, marks)()
    assert seen[:, 0].tolist() == [7, 0, 7, 7, 3, 5]
    kv.push(0, np.ones((6, 2), np.float32))            # a dense value in between
    kv.push(0, rs([0], [[8, 8]]))
    out = np.empty((6, 2), np.float32)
    kv.pull(0, out=out)
    assert out[:, 0].tolist() == [8, 0, 0, 0, 0, 0]


def lazy_sgd(w, mom, ids, g, lr, wd, momentum):
    """MXNet's lazy SGD: the rows of ``ids`` only."""
    g = g + wd * w[ids]
    mom[ids] = momentum * mom[ids] - lr * g
    w[ids] += mom[ids]


def test_lazy_sgd_moves_only_the_rows_pushed_and_their_momentum():
    kv = kvps.create('local')
    start = np.arange(12, dtype=np.float32).reshape(6, 2)
    kv.init(0, start)
    kv.set_optimizer(kvps.optimizer.create('sgd', learning_rate=0.5, wd=0.1, momentum=0.9))
    w, mom = start.copy(), np.zeros_like(start)
    for ids in ([1, 4], [4], [0, 1, 5]):
        g = np.full((len(ids), 2), 1.5, np.float32)
        kv.push(0, rs(ids, g))
        lazy_sgd(w, mom, ids, g, np.float32(0.5), np.float32(0.1), np.float32(0.9))
    out = np.empty_like(start)
    kv.pull(0, out=out)
    np.testing.assert_allclose(out, w, rtol=1e-6)
    assert out[[2, 3]].tolist() == start[[2, 3]].tolist()   # never pushed: untouched


@pytest.mark.parametrize('optimizer', [
    {'name': 'sgd', 'momentum': 0.9, 'wd': 0.1, 'lazy_update': False},
    {'name': 'adam', 'wd': 0.1, 'lazy_update': False},
    {'name': 'lamb', 'wd': 0.1},      # reads the whole weight: never row by row
    {'name': 'rmsprop', 'wd': 0.1},   # no lazy_update in MXNet: dense
])
def test_optimizers_that_do_not_update_lazily_apply_rows_as_the_dense_gradient(optimizer):
    outs = []
    for as_rows in (True, False):
        kv = kvps.create('local')
        kv.init(0, np.arange(12, dtype=np.float32).reshape(6, 2))
        kv.set_optimizer(kvps.optimizer.create(**optimizer, learning_rate=0.1))
        for step in range(3):
            g = rs([step, 4], np.full((2, 2), step + 1.0))
            dense = np.zeros((6, 2), np.float32)
            dense[[step, 4]] = step + 1.0
            kv.push(0, g if as_rows else dense)
        outs.append(np.empty((6, 2), np.float32))
        kv.pull(0, out=outs[-1])
    assert outs[0].tolist() == outs[1].tolist()


def test_a_sync_round_sums_every_workers_rows_and_updates_their_union_once():
    shard = Shard(2, Updater(kvps.optimizer.create('sgd', learning_rate=1.0)))
    shard.init('t', 'k', 0, 'float32', [5, 1], True, memoryview(np.zeros(5, np.float32)))

    def push(token, worker, ids, values):
        return shard.push(token, worker, 'k', 0, 'rows', True, memoryview(
            rows.encode(np.array(ids), np.array(values, np.float32).reshape(-1, 1))))
    assert push('a', W0, [0, 3], [1, 2]) == []
    assert push('b', W0, [4], [7]) == []                # a fast worker's next round waits
    assert sorted(t for _, t, _ in push('c', W1, [2, 3], [20, 10])) == ['a', 'c']
    (_, _, (_, weight, _)), = shard.pull('q', W1, 'k', 0)
    assert weight.tolist() == [-1, 0, -20, -12, 0]
    assert sorted(t for _, t, _ in push('d', W1, [], [])) == ['b', 'd']
    (_, _, (_, weight, _)), = shard.pull('q', W0, 'k', 0)
    assert weight.tolist() == [-1, 0, -20, -12, -7]


@pytest.mark.parametrize('order', ['rows first', 'rows between', 'rows last'])
def test_a_round_of_rows_and_dense_pushes_adds_them_all(order):
    shard = Shard(3, Updater(kvps.optimizer.create('sgd', learning_rate=1.0)))
    shard.init('t', 'k', 0, 'float32', [3], True, memoryview(np.zeros(3, np.float32)))
    dense = [('float32', memoryview(np.full(3, v, np.float32)).cast('B')) for v in (1, 2)]
    sparse = ('rows', memoryview(rows.encode(np.array([1]), np.array([[5]], np.float32))))
    pushes = {'rows first': [sparse, *dense], 'rows between': [dense[0], sparse, dense[1]],
              'rows last': [*dense, sparse]}[order]
    for worker, (dtype, data) in zip((W0, W1, b'worker-2'), pushes):
        shard.push('p', worker, 'k', 0, dtype, True, data)
    (_, _, (_, weight, _)), = shard.pull('q', W1, 'k', 0)
    assert weight.tolist() == [-3, -8, -3]


def test_bfloat16_rows_sum_in_float32_and_round_once():
    kv = kvps.create('local')
    kv.init(0, torch.zeros(3, 2, dtype=torch.bfloat16))
    one = torch.ones(1, 2, dtype=torch.bfloat16)
    third = torch.full((1, 2), 1 / 256, dtype=torch.bfloat16)
    kv.push(0, kvps.RowSparse(torch.tensor([2, 2, 2]), torch.cat([one, third, third])))
    out = torch.empty(3, 2, dtype=torch.bfloat16)
    kv.pull(0, out=out)
    # In bfloat16 steps 1 + 1/256 rounds back to 1; summed in float32 then rounded: 1 + 1/128.
    assert out[2].tolist() == [1 + 1 / 128] * 2 and not out[:2].any()


# -- pulls of rows ---------------------------------------------------------------------------
def test_row_sparse_pull_writes_only_the_rows_asked_in_any_order_and_repeated():
    kv = kvps.create('local')
    kv.init(0, np.arange(10, dtype=np.float32).reshape(5, 2))
    kv.init(1, np.arange(4, dtype=np.float32))
    out, vec = np.full((5, 2), -1, np.float32), np.full(4, -1, np.float32)
    kv.row_sparse_pull([0, 1], out=[out, vec], row_ids=[np.array([4, 1, 4]), [2]])
    assert out.tolist() == [[-1, -1], [2, 3], [-1, -1], [-1, -1], [8, 9]]
    assert vec.tolist() == [-1, -1, 2, -1]
    strided = torch.full((2, 5), -1.0).t()      # not contiguous: rows land one by one
    kv.row_sparse_pull(0, out=strided, row_ids=torch.tensor([3]))
    assert strided[3].tolist() == [6, 7] and (strided[[0, 1, 2, 4]] == -1).all()


def test_row_sparse_pull_fills_several_targets_each_with_its_rows():
    kv = kvps.create('local')
    kv.init(0, np.arange(6, dtype=np.float32).reshape(3, 2))
    a, b = np.zeros((3, 2), np.float32), np.zeros((3, 2), np.float32)
    kv.row_sparse_pull(0, out=[a, b], row_ids=[np.array([0]), np.array([2])])
    assert a.tolist() == [[0, 1], [0, 0], [0, 0]] and b.tolist() == [[0, 0], [0, 0], [4, 5]]


@pytest.mark.parametrize('kwargs, error, match', [
    ({'out': np.zeros((3, 2), np.float32)}, TypeError, 'needs row_ids'),
    ({'out': np.zeros((3, 2), np.float32), 'row_ids': [3]}, ShapeError, 'row id 3'),
    ({'out': np.zeros((2, 3), np.float32), 'row_ids': [0]}, ShapeError, 'shape'),
    ({'out': np.zeros((3, 2), np.float64), 'row_ids': [0]}, DTypeError, 'dtype'),
    ({'row_ids': [0]}, TypeError, 'needs out'),
    ({'out': kvps.RowSparse([0], np.zeros((1, 2), np.float32)), 'row_ids': [0]}, TypeError,
     'dense'),
])
def test_row_sparse_pull_refuses_bad_arguments(kwargs, error, match):
    kv = kvps.create('local')
    kv.init(0, np.zeros((3, 2), np.float32))
    with pytest.raises(error, match=match):
        kv.row_sparse_pull(0, **kwargs)


def test_pulling_the_rows_changed_brings_every_row_once_then_only_those_changed():
    kv = kvps.create('local')
    kv.init(0, np.zeros((4, 2), np.float32))
    kv.set_optimizer(kvps.optimizer.create('sgd', learning_rate=1.0))
    marks, table = {}, np.full((4, 2), 7, np.float32)
    kv.pull_changed_rows_begin(0, table, marks)()
    assert not table.any()                                   # first look: every row
    kv.push(0, rs([2], [[1, 1]]))
    table[:] = 7
    kv.pull_changed_rows_begin(0, table, marks)()
    assert table.tolist() == [[7, 7], [7, 7], [-1, -1], [7, 7]]
    table[:] = 7
    kv.pull_changed_rows_begin(0, table, marks)()
    assert (table == 7).all()                                # nothing changed since
    kv.push(0, np.ones((4, 2), np.float32))                  # a dense update: every row
    kv.pull_changed_rows_begin(0, table, marks)()
    assert table.tolist() == [[-1, -1], [-1, -1], [-2, -2], [-1, -1]]


def test_another_servers_counts_ask_for_every_row():
    """A replacement server counts changes afresh: a worker's count from before must not
    hide rows it changed since (shards are told apart by their epoch)."""
    shard = Shard(1)
    shard.init('t', 'k', 0, 'float32', [3, 1], True, memoryview(np.arange(3, dtype=np.float32)))
    (_, _, (epoch, count, _)), = shard.pull('q', W0, 'k', 0, (None, None))
    (_, _, (_, _, payload)), = shard.pull('q', W0, 'k', 0, (None, [epoch, count]))
    assert rows.decode(payload, 1, np.dtype(np.float32), 3)[0].tolist() == []
    (_, _, (_, _, payload)), = shard.pull('q', W0, 'k', 0, (None, [epoch + 1, count]))
    assert rows.decode(payload, 1, np.dtype(np.float32), 3)[0].tolist() == [0, 1, 2]


# -- placement -----------------------------------------------------------------------------
def test_split_keys_are_cut_between_rows_unless_they_have_fewer_rows_than_servers():
    placement = Sharding(3, 10)
    parts = placement.place('emb', 7 * 4, 4, width=4)
    assert [(p.start, p.stop) for p in parts] == [(0, 8), (8, 16), (16, 28)]
    parts = placement.place('wide', 2 * 30, 4, width=30)   # 2 rows, 3 servers: by elements
    assert [(p.start, p.stop) for p in parts] == [(0, 20), (20, 40), (40, 60)]
