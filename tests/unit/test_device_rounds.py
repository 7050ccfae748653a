"""A GPU shard's sync rounds with an optimizer, on the host: the round's last push is not added
into a merge buffer but handed to the update with the sum so far, whose kernels add the two as
they load them. On the host stand-in (HostStandIn: numpy kernels) and on the CUDA kernels run
on the CPU (g++, as test_cuda_emulated runs them), the weights are bit for bit those of host
shards: 2 and 3 workers, pushes read in place from workers' device blocks (never written) or
copied in, rows mixed in, a round whose message fails, an elastic worker lost mid-round, a
round closed by an abstention (its answers ordered behind the update that read a block)."""

import types

import numpy as np
import pytest
import test_cuda_emulated as E
from test_cuda_source import CASES, call, current_stream, plan_of
from test_device_arrays import HostTransfers

from kvps import rows as row_wire
from kvps.optimizer import create
from kvps.optimizer.kernels import cuda_kernels, cuda_launch as L, numpy_kernels
from kvps.optimizer.updater import Updater
from kvps.server import members
from kvps.server.device_arrays import DeviceArrays, HostStandIn
from kvps.server.shard import Shard
from kvps.server.storage import HostArrays, Storage
from kvps.server.transfers import HostCopies
from kvps.wire import protocol as P

N, ROWS = 1000, 250   # elements of a key (ROWS x 4 where a key takes rows)
WORKERS = [f'worker-{w}'.encode() for w in range(3)]
SPECS = {'sgd': dict(learning_rate=0.1, momentum=0.9, wd=0.01),
         'adam': dict(learning_rate=0.01, wd=0.001)}


def grads(rounds, workers, seed=3):
    rng = np.random.default_rng(seed)
    return [[rng.standard_normal(N) for _ in range(workers)] for _ in range(rounds)]


class Run:
    """One shard over ``arrays`` with an optimizer, and the kinds of grad its updates got
    (2: the round's last push came unsummed)."""

    def __init__(self, arrays, workers, optimizer='sgd', dtype='float32', block=None,
                 elastic=False, scale_to=0):
        """``block(values)``: a worker's device block holding ``values`` (None: pushes are
        copied in from wire bytes)."""
        self.arrays, self.dtype, self.block = arrays, dtype, block
        self.shard = Shard(workers, Updater(create(optimizer, **SPECS[optimizer]).to_spec()),
                           Storage(arrays, arrays), elastic=elastic)
        self.kinds, self.blocks = [], []
        real = self.shard.updater.update_many

        def update_many(items, step=0, failures=None):
            self.kinds += [len(g) if type(g) is tuple else 1 for *_, g in items]
            return real(items, step, failures)
        self.shard.updater.update_many = update_many
        self.init('k', np.linspace(-1, 1, N), scale_to=scale_to)

    def init(self, key, values, shape=(N,), dtype=None, scale_to=0):
        dtype = dtype or self.dtype
        self.shard.init('i', key, 0, dtype, list(shape), True, _wire(values, dtype),
                        device=True, scale_to=scale_to)

    def push(self, worker, values, key='k'):
        """One request pushing ``values`` of ``key``; its replies."""
        return self.shard.together(lambda: self.pushed(worker, values, key))

    def pushed(self, worker, values, key='k'):
        """Shard.push of ``values`` (in a request's handling)."""
        data = _wire(values, self.dtype)
        if self.block is not None:
            data = self.block(np.frombuffer(data, np.uint8))
            self.blocks.append((data, self.arrays.to_host(data).copy()))
        return self.shard.push('t', WORKERS[worker], key, 0, self.dtype, True, data)

    def weight(self, key='k'):
        return np.array(self.arrays.to_host(self.shard.entries[key, 0].weight))

    def blocks_unchanged(self):
        return all(np.array_equal(self.arrays.to_host(got), was) for got, was in self.blocks)


def _wire(values, dtype):
    return memoryview(np.ascontiguousarray(np.asarray(values, dtype))).cast('B')


def stand_in_block(values):
    """A worker's device block on the host stand-in: a numpy array, read in place."""
    return values.copy()


def train(arrays, workers, optimizer, dtype='float32', block=None):
    run = Run(arrays, workers, optimizer, dtype, block)
    for round_pushes in grads(3, workers):
        for worker, g in enumerate(round_pushes):
            run.push(worker, g)
    return run


@pytest.mark.parametrize('block', [None, stand_in_block], ids=['copied in', 'device blocks'])
@pytest.mark.parametrize('dtype', ['float32', 'float64'])
@pytest.mark.parametrize('optimizer', ['sgd', 'adam'])
@pytest.mark.parametrize('workers', [2, 3])
def test_a_stand_in_gpu_shard_sums_the_last_push_in_the_update_as_host_shards_do(
        workers, optimizer, dtype, block):
    host = train(HostArrays(), workers, optimizer, dtype)
    device = train(HostStandIn(), workers, optimizer, dtype, block)
    assert np.array_equal(device.weight(), host.weight())
    assert device.kinds == host.kinds == [2] * 3
    assert device.blocks_unchanged()


def test_half_keys_are_summed_first():
    # float16: a sum in the update's float32 would round otherwise than the merge's float16
    run = train(HostStandIn(), 2, 'sgd', 'float16', stand_in_block)
    assert run.kinds == [1] * 3
    assert np.array_equal(run.weight(), train(HostArrays(), 2, 'sgd', 'float16').weight())


def _mixed_rows(arrays):
    """Three workers, a key of rows: dense, rows, dense (the last: unsummed until the rows
    are added in)."""
    run = Run(arrays, 3, block=stand_in_block if arrays.on_device else None)
    run.init('r', np.linspace(-2, 2, N), shape=(ROWS, 4))
    rng = np.random.default_rng(4)
    for _ in range(3):
        ids = np.sort(rng.choice(ROWS, 40, replace=False)).astype(row_wire.ROW_ID)
        picked = rng.standard_normal((40, 4)).astype(np.float32)
        run.push(0, rng.standard_normal(N), 'r')
        run.shard.together(lambda: run.shard.push('t', WORKERS[1], 'r', 0, P.ROW_SPARSE, True,
                                                  row_wire.encode(ids, picked)))
        run.push(2, rng.standard_normal(N), 'r')
    return run


def test_rows_mixed_into_a_round_are_added_to_both_pushes():
    host, device = _mixed_rows(HostArrays()), _mixed_rows(HostStandIn())
    assert np.array_equal(device.weight('r'), host.weight('r'))
    assert device.kinds == host.kinds == [1] * 3 and device.blocks_unchanged()


def _failing_message(arrays):
    """Two workers; each round's message also pushes an int key, which no optimizer takes."""
    run = Run(arrays, 2, block=stand_in_block if arrays.on_device else None)
    run.init('i', np.ones(4), shape=(4,), dtype='int32')
    replies = []
    for round_pushes in grads(2, 2):
        for worker, g in enumerate(round_pushes):
            def message():
                return run.pushed(worker, g) + run.shard.push(
                    'bad', WORKERS[worker], 'i', 0, 'int32', True, _wire([1] * 4, 'int32'))
            replies += run.shard.together(message)
    return run, replies


def test_a_round_whose_message_fails_still_updates_its_other_key_from_both_pushes():
    # the update of both keys is refused at its check; each key is then updated alone, the
    # float key from the very pair of arrays it was given first
    (host, _), (device, replies) = _failing_message(HostArrays()), _failing_message(HostStandIn())
    assert np.array_equal(device.weight(), host.weight())
    assert [kind for kind, token, _ in replies if token == 'bad'] == ['error'] * 4
    assert device.kinds == host.kinds == [2, 1, 2, 1] * 2 and device.blocks_unchanged()


def _lost_mid_round(arrays, scale_to):
    """Three workers, elastic: workers 0 and 1 push, worker 1 is lost (its push taken out),
    worker 2's push closes the round of two; then a round of the two that are left
    (``scale_to``: each scaled to 3 workers, the pair added first)."""
    run = Run(arrays, 3, block=stand_in_block if arrays.on_device else None, elastic=True,
              scale_to=scale_to)
    (first, second, third), (again0, again2, _) = grads(2, 3, seed=6)
    run.push(0, first)
    run.push(1, second)
    members.change(run.shard, [WORKERS[1]], [])
    run.push(2, third)
    run.push(0, again0)
    run.push(2, again2)
    return run


@pytest.mark.parametrize('scale_to', [0, 3])
def test_a_worker_lost_mid_round_leaves_the_others_pushes_summed_in_the_update(scale_to):
    host, device = _lost_mid_round(HostArrays(), scale_to), _lost_mid_round(HostStandIn(),
                                                                            scale_to)
    assert np.array_equal(device.weight(), host.weight())
    assert device.kinds == host.kinds == [1 if scale_to else 2] * 2
    assert device.blocks_unchanged()


class Event:
    def __init__(self, log):
        self.log = log

    def record(self):
        self.log.append(('event recorded',))


def test_an_update_that_reads_a_block_pushed_earlier_is_ordered_before_its_answers():
    # Worker 0's block is read in place by the update that worker 1's abstention lets run,
    # in another request: that request's answers (worker 0's ack among them) are ordered
    # behind the update, or worker 0 could reuse the block before the update read it.
    log = []
    arrays = DeviceArrays(np, numpy_kernels, HostTransfers(log),
                          sharing=types.SimpleNamespace(event=lambda: Event(log),
                                                        worked_on=lambda array, event: None))
    arrays.order_event()   # (a worker mapped its device segment here)
    run = Run(arrays, 2, block=stand_in_block)
    run.push(0, np.ones(N))
    arrays.order()
    log.clear()
    replies = run.shard.together(lambda: run.shard.push('t', WORKERS[1], 'k', 0, P.NOTHING,
                                                        True, memoryview(b'')))
    assert [kind for kind, *_ in replies] == ['ack', 'ack']
    arrays.order()
    assert ('hold',) in log and log[-1] == ('event recorded',)


# -- the CUDA kernels, on the CPU ----------------------------------------------------------------
class CupyOnHost(E.HostDevice):
    """Emulated device memory that kvps takes for cupy's: the CUDA kernels update it."""
    __module__ = 'cupy._emulated'


def _on_device(array):
    return np.ascontiguousarray(array).view(CupyOnHost)


def emulated_block(values):
    """A worker's device block holding ``values``, read in place by the CUDA kernels."""
    return _on_device(values.copy())


class EmulatedGpu(DeviceArrays):
    """A GPU shard whose arrays are CupyOnHost (updated by cuda_kernels, on the CPU), each
    elementwise add it makes counted in ``adds``."""

    def __init__(self):
        self.adds = 0

        def add(a, b, out):
            self.adds += 1
            return np.add(a, b, out=out)
        xp = types.SimpleNamespace(
            ndarray=CupyOnHost, add=add, multiply=np.multiply, copyto=np.copyto,
            asnumpy=np.array, empty_like=lambda a, dtype=None: _on_device(
                np.empty_like(a, dtype=dtype)))
        super().__init__(xp, cuda_kernels, Copies())


class Copies(HostCopies):
    def empty(self, shape, dtype):
        return _on_device(np.empty(shape, dtype))


@pytest.fixture(scope='module')
def library(tmp_path_factory):
    """The kernels of these tests' rules (sgd and adam, float32 and float64, one grad and
    two), built for the CPU."""
    if not E._gxx_has_float16():
        pytest.skip('needs g++ with _Float16')
    plans = [plan_of(*call(*case[:3], dtype, dtype, False, grads=grads))
             for case in (CASES[1], CASES[4]) for dtype in ('float32', 'float64')
             for grads in (1, 2)]
    return E.build(tmp_path_factory.mktemp('device_rounds'), E.definitions(plans))


emulated = E.emulated   # (test_cuda_emulated's fixture, on this module's library)


@pytest.fixture
def gpu(emulated, monkeypatch):
    """cuda_kernels' arrays made as CupyOnHost; returns the kernels launched."""
    monkeypatch.setattr(L, 'cupy', lambda: types.SimpleNamespace(
        empty=lambda shape, dtype: _on_device(np.empty(shape, dtype)),
        zeros=lambda shape, dtype: _on_device(np.zeros(shape, dtype)),
        asarray=lambda a: _on_device(np.array(a)), float64=np.float64, uint32=np.uint32,
        cuda=types.SimpleNamespace(get_current_stream=current_stream)))
    return emulated


@pytest.mark.parametrize('dtype', ['float32', 'float64'])
@pytest.mark.parametrize('optimizer', ['sgd', 'adam'])
@pytest.mark.parametrize('workers', [2, 3])
def test_on_the_cuda_kernels_a_round_of_two_launches_no_add_for_its_last_push(
        gpu, workers, optimizer, dtype):
    device = train(EmulatedGpu(), workers, optimizer, dtype, emulated_block)
    host = train(HostArrays(), workers, optimizer, dtype)
    assert np.array_equal(device.weight(), host.weight())
    assert device.arrays.adds == 3 * (workers - 2)   # 3 workers: the second push, no more
    assert gpu and all('x2' in kernel for kernel in gpu)   # the update adds the last push
    assert device.blocks_unchanged()
