"""Sync rounds, async pushes, ordered pulls and finished workers in the pure server Shard."""

import numpy as np
import pytest

from kvps.errors import (ConfigError, DTypeError, DuplicateInitError, KeyNotInitializedError,
                         KVPSError, ShapeError)
from kvps.optimizer import FactorScheduler, create
from kvps.optimizer.kernels import numpy_kernels as K
from kvps.optimizer.updater import Updater
from kvps.server import members
from kvps.server.recovery import rebase
from kvps.server.shard import Shard
from kvps.wire.items import PullItem, ResumeItem

W0, W1, W2 = b'worker-0', b'worker-1', b'worker-2'


def buf(*values, dtype=np.float32):
    return memoryview(np.array(values, dtype=dtype)).cast('B')


def make(num_workers=2, sync=True, values=(0.0, 0.0), updater=None):
    shard = Shard(num_workers, updater)
    assert shard.init('t0', 'k', 0, 'float32', [len(values)], sync, buf(*values)) == [
        ('ack', 't0', None)]
    return shard


def data_of(replies):
    return {token: payload[1].tolist() for kind, token, payload in replies if kind == 'data'}


def acks(replies):
    return sorted(token for kind, token, _ in replies if kind == 'ack')


def test_round_completes_only_after_every_worker_and_replaces_with_the_sum():
    shard = make()
    assert shard.push('p0', W0, 'k', 0, 'float32', True, buf(1, 2)) == []
    replies = shard.push('p1', W1, 'k', 0, 'float32', True, buf(10, 20))
    assert acks(replies) == ['p0', 'p1']
    assert data_of(shard.pull('q', W0, 'k', 0)) == {'q': [11.0, 22.0]}


def test_a_pull_is_ready_whole_only_when_no_key_waits_for_a_round():
    """ready_for: the server answers such a pull at once, as one reply; else key by key."""
    shard = make()
    shard.init('t1', 'j', 0, 'float32', [1], True, buf(5))
    both = [PullItem('k', 0, None), PullItem('j', 0, None)]
    assert [e.key for e in shard.ready_for(W0, both)] == ['k', 'j']
    shard.push('p0', W0, 'k', 0, 'float32', True, buf(1, 2))
    assert shard.ready_for(W0, both) is None           # k's round lacks worker 1's push
    assert shard.ready_for(W1, both) is not None       # worker 1 pushed nothing yet
    assert shard.ready_for(W0, [PullItem('j', 0, None)]) is not None
    assert shard.ready_for(W0, [PullItem('j', 0, None), PullItem('absent', 0, None)]) is None
    shard.push('p1', W1, 'k', 0, 'float32', True, buf(1, 2))
    entries = shard.ready_for(W0, both)
    assert [e.pulled().array.tolist() for e in entries] == [[2.0, 4.0], [5.0]]


def test_same_worker_twice_is_not_two_workers():
    shard = make()
    shard.push('a', W0, 'k', 0, 'float32', True, buf(1, 1))
    assert shard.push('b', W0, 'k', 0, 'float32', True, buf(5, 5)) == []   # queued, round 2
    replies = shard.push('c', W1, 'k', 0, 'float32', True, buf(2, 2))
    assert acks(replies) == ['a', 'c']
    assert data_of(shard.pull('q', W1, 'k', 0)) == {'q': [3.0, 3.0]}
    # The fast worker's second push opens round 2 untouched by round 1.
    replies = shard.push('d', W1, 'k', 0, 'float32', True, buf(7, 7))
    assert acks(replies) == ['b', 'd']
    assert data_of(shard.pull('q2', W0, 'k', 0)) == {'q2': [12.0, 12.0]}


def test_fast_worker_many_rounds_ahead_keeps_every_round_separate():
    shard = make()
    for r in range(3):
        shard.push(f'f{r}', W0, 'k', 0, 'float32', True, buf(r, r))
    results = []
    for r in range(3):
        shard.push(f's{r}', W1, 'k', 0, 'float32', True, buf(100, 100))
        results.append(data_of(shard.pull(f'q{r}', W1, 'k', 0))[f'q{r}'][0])
    assert results == [100.0, 101.0, 102.0]


def test_pull_waits_for_the_pullers_own_round():
    shard = make()
    shard.push('p0', W0, 'k', 0, 'float32', True, buf(1, 1))
    assert shard.pull('q0', W0, 'k', 0) == []            # deferred: W0's round is open
    assert data_of(shard.pull('q1', W1, 'k', 0)) == {'q1': [0.0, 0.0]}  # W1 pushed nothing
    replies = shard.push('p1', W1, 'k', 0, 'float32', True, buf(2, 2))
    assert acks(replies) == ['p0', 'p1']
    assert data_of(replies) == {'q0': [3.0, 3.0]}


def test_pulled_bytes_do_not_change_with_later_updates():
    shard = make(num_workers=1)
    shard.push('p', W0, 'k', 0, 'float32', True, buf(1, 1))
    (_, _, (_, first, _)), = shard.pull('q', W0, 'k', 0)
    shard.push('p2', W0, 'k', 0, 'float32', True, buf(9, 9))
    assert first.tolist() == [1.0, 1.0]


def test_async_applies_every_push_at_once():
    shard = make(sync=False)
    assert acks(shard.push('a', W0, 'k', 0, 'float32', False, buf(1, 1))) == ['a']
    assert data_of(shard.pull('q', W1, 'k', 0)) == {'q': [1.0, 1.0]}


class AddUpdater:
    """weight += grad, recording calls: one per round in sync, one per push in async, and
    whether the round's last push came unsummed (a tuple of parts, as Updater accepts)."""

    def __init__(self):
        self.calls, self.parts = 0, []

    def update_many(self, items, step=0, failures=None):
        for _, _, weight, grad in items:
            self.calls += 1
            self.parts.append(len(grad) if isinstance(grad, tuple) else 1)
            for g in grad if isinstance(grad, tuple) else (grad,):
                weight += g


def test_optimizer_runs_once_per_sync_round_on_the_sum():
    updater = AddUpdater()
    shard = make(values=(1.0, 1.0), updater=updater)
    shard.push('a', W0, 'k', 0, 'float32', True, buf(1, 2))
    shard.push('b', W1, 'k', 0, 'float32', True, buf(3, 4))
    assert updater.calls == 1
    assert data_of(shard.pull('q', W0, 'k', 0)) == {'q': [5.0, 7.0]}


def test_optimizer_runs_once_per_async_push():
    updater = AddUpdater()
    shard = make(sync=False, updater=updater)
    shard.push('a', W0, 'k', 0, 'float32', False, buf(1, 1))
    shard.push('b', W1, 'k', 0, 'float32', False, buf(1, 1))
    assert updater.calls == 2
    assert data_of(shard.pull('q', W0, 'k', 0)) == {'q': [2.0, 2.0]}


def test_pushed_buffer_is_never_written():
    shard = make(updater=AddUpdater())
    g0, g1 = np.array([1, 2], np.float32), np.array([3, 4], np.float32)
    shard.push('a', W0, 'k', 0, 'float32', True, memoryview(g0).cast('B'))
    shard.push('b', W1, 'k', 0, 'float32', True, memoryview(g1).cast('B'))
    assert g0.tolist() == [1, 2] and g1.tolist() == [3, 4]


@pytest.mark.parametrize('workers', [1, 2, 3])
@pytest.mark.parametrize('optimizer', [False, True])
def test_read_only_pushes_sum_and_update_exactly_round_after_round(workers, optimizer):
    # Pushes arrive read-only (a worker's shared memory): the first of a round is kept as
    # received, later ones summed into the merge buffer, whatever the number of workers.
    updater = Updater(create('sgd', learning_rate=1.0).to_spec()) if optimizer else None
    shard = make(num_workers=workers, values=(0.0, 0.0), updater=updater)
    expect = np.zeros(2, np.float32)
    for round_index in range(3):
        grads = [np.array([w + 1, round_index], np.float32) for w in range(workers)]
        for w, g in enumerate(grads):
            g.flags.writeable = False
            shard.push((round_index, w), f'worker-{w}'.encode(), 'k', 0, 'float32', True,
                       memoryview(g).cast('B'))
        total = sum(grads)
        expect = expect - total if optimizer else total
        assert data_of(shard.pull('q', W0, 'k', 0)) == {'q': expect.tolist()}
        assert [g.tolist() for g in grads] == [[w + 1, round_index] for w in range(workers)]


@pytest.mark.parametrize('dtype', [np.float16, np.float64])
def test_other_dtypes_sum_exactly(dtype):
    shard = Shard(2)
    name = np.dtype(dtype).name
    shard.init('t', 1, 0, name, [3], True, buf(0, 0, 0, dtype=dtype))
    shard.push('a', W0, 1, 0, name, True, buf(0.5, 1, 2, dtype=dtype))
    shard.push('b', W1, 1, 0, name, True, buf(0.25, 1, 2, dtype=dtype))
    (_, _, (_, value, _)), = shard.pull('q', W0, 1, 0)
    assert value.dtype == dtype and value.tolist() == [0.75, 2, 4]


def bf16_wire(*values):
    return memoryview(K.f32_to_bf16(np.array(values, np.float32))).cast('B')


@pytest.mark.parametrize('optimizer', [False, True])
def test_bfloat16_rounds_sum_numbers_in_float32_not_bit_patterns(optimizer):
    # numpy has no bfloat16: its uint16 storage added as integers gave nonsense (0.5 + 0.5
    # came back as 4e37). The sum runs in float32 and is rounded once: 1 + 2**-8 + 2**-8 is
    # 1.0078125, where adding in bfloat16 step by step would tie back to 1.0 twice.
    updater = Updater(create('sgd', learning_rate=1.0).to_spec()) if optimizer else None
    shard = Shard(3, updater)
    shard.init('t', 1, 0, 'bfloat16', [3], True, bf16_wire(0, 0, 0))
    weight = np.zeros(3, np.float32)
    for round_index in range(3):
        pushes = [(0.5, 1, 3), (0.5, 2.0 ** -8, 0.5), (round_index, 2.0 ** -8, -2)]
        for worker, values in zip((W0, W1, W2), pushes):
            shard.push(('p', worker), worker, 1, 0, 'bfloat16', True, bf16_wire(*values))
        total = np.sum(np.array(pushes, np.float32), axis=0)
        weight = K.bf16_to_f32(K.f32_to_bf16(weight - total if optimizer else total))
        (_, _, (_, value, _)), = shard.pull('q', W0, 1, 0)
        assert value.dtype == np.uint16
        assert K.bf16_to_f32(value).tolist() == weight.tolist()
    assert optimizer or weight.tolist() == [3, 1.0078125, 1.5]


def test_errors_are_clear():
    shard = make()
    with pytest.raises(DuplicateInitError):
        shard.init('t', 'k', 0, 'float32', [2], True, buf(1, 1))
    with pytest.raises(KeyNotInitializedError, match="'nope' is not initialized"):
        shard.push('p', W0, 'nope', 0, 'float32', True, buf(1, 1))
    with pytest.raises(KeyNotInitializedError):
        shard.pull('p', W0, 'nope', 0)
    with pytest.raises(ShapeError, match='3 elements, expected 2'):
        shard.push('p', W0, 'k', 0, 'float32', True, buf(1, 1, 1))
    with pytest.raises(DTypeError):
        shard.push('p', W0, 'k', 0, 'float64', True, buf(1, 1, dtype=np.float64))
    with pytest.raises(ConfigError, match='dist_sync'):
        shard.push('p', W0, 'k', 0, 'float32', False, buf(1, 1))
    # Nothing above changed the store: a full round still works.
    shard.push('a', W0, 'k', 0, 'float32', True, buf(1, 1))
    assert acks(shard.push('b', W1, 'k', 0, 'float32', True, buf(1, 1))) == ['a', 'b']


def test_check_compares_another_workers_view():
    shard = make()
    assert shard.check('c', 'k', 0, 'float32', [2]) == [('ack', 'c', 0)]   # (pushes of it)
    with pytest.raises(ShapeError, match=r'rank 0 initialized \(2,\)'):
        shard.check('c', 'k', 0, 'float32', [1, 2])
    with pytest.raises(DTypeError, match=r'float64, but rank 0 initialized \(2,\) float32'):
        shard.check('c', 'k', 0, 'float64', [2])


def test_finished_worker_fails_rounds_that_can_never_complete():
    shard = make(num_workers=3)
    shard.push('a', W0, 'k', 0, 'float32', True, buf(1, 1))
    assert shard.pull('q', W0, 'k', 0) == []
    replies = members.worker_finished(shard, W2)           # W2 never pushed: round 1 is doomed
    assert sorted(t for kind, t, _ in replies if kind == 'error') == ['a', 'q']
    with pytest.raises(KVPSError, match='can never complete'):
        shard.push('b', W1, 'k', 0, 'float32', True, buf(1, 1))


def test_finished_worker_that_already_pushed_lets_the_round_finish():
    shard = make()
    shard.push('a', W0, 'k', 0, 'float32', True, buf(1, 1))
    assert members.worker_finished(shard, W0) == []
    assert acks(shard.push('b', W1, 'k', 0, 'float32', True, buf(2, 2))) == ['a', 'b']


def test_same_optimizer_kind_again_keeps_state_other_kind_starts_fresh():
    shard = make(num_workers=1, values=(1.0, 1.0))
    shard.set_optimizer(create('sgd', learning_rate=1.0, momentum=0.5).to_spec())
    shard.push('a', W0, 'k', 0, 'float32', True, buf(1, 1))          # mom -1, w 0
    shard.set_optimizer(create('sgd', learning_rate=2.0, momentum=0.5).to_spec())
    shard.push('b', W0, 'k', 0, 'float32', True, buf(1, 1))          # mom -0.5-2, w -2.5
    assert data_of(shard.pull('q', W0, 'k', 0)) == {'q': [-2.5, -2.5]}
    shard.set_optimizer(create('adam', learning_rate=0.1).to_spec())
    assert shard.updater.optimizer.name == 'adam' and shard.updater.num_update == 0


# -- a restarted server: resent pushes count once, rounds line up with the workers ---------

def test_a_resent_async_push_is_acknowledged_not_applied_again():
    shard = make(sync=False)
    assert acks(shard.push('a', W0, 'k', 0, 'float32', False, buf(1, 1), seq=0)) == ['a']
    assert acks(shard.push('again', W0, 'k', 0, 'float32', False, buf(1, 1), seq=0)) == ['again']
    assert data_of(shard.pull('q', W0, 'k', 0)) == {'q': [1.0, 1.0]}


def test_a_resent_push_of_a_completed_round_is_acknowledged_not_merged():
    shard = make()
    shard.push('a', W0, 'k', 0, 'float32', True, buf(1, 1), seq=0)
    shard.push('b', W1, 'k', 0, 'float32', True, buf(2, 2), seq=0)
    assert acks(shard.push('a2', W0, 'k', 0, 'float32', True, buf(1, 1), seq=0)) == ['a2']
    replies = shard.push('c', W0, 'k', 0, 'float32', True, buf(5, 5), seq=1)
    replies += shard.push('d', W1, 'k', 0, 'float32', True, buf(6, 6), seq=1)
    assert acks(replies) == ['c', 'd']
    assert data_of(shard.pull('q', W0, 'k', 0)) == {'q': [11.0, 11.0]}


def restarted(checkpointed_rounds, sync=True):
    """A shard as a server that rejoins finds it: the checkpoint's round count, no open round."""
    shard = make(sync=sync, values=(100.0, 100.0))
    entry = shard.entries[('k', 0)]
    entry.version = checkpointed_rounds
    if not sync:
        entry.pushed = {W0: checkpointed_rounds}
    return shard


def test_rebase_takes_the_rounds_a_worker_saw_completed_and_redoes_the_open_one():
    shard = restarted(checkpointed_rounds=3)
    # worker 0 saw round 4 acknowledged (the checkpoint predates it); worker 1's ack of it
    # was lost, so it resends round 4 (seq 3) and then pushes round 5 (seq 4).
    rebase(shard.entries, {W0: [ResumeItem('k', 0, 4)], W1: [ResumeItem('k', 0, 3)]}, {W0, W1})
    assert acks(shard.push('dup', W1, 'k', 0, 'float32', True, buf(9, 9), seq=3)) == ['dup']
    replies = shard.push('a', W0, 'k', 0, 'float32', True, buf(1, 1), seq=4)
    replies += shard.push('b', W1, 'k', 0, 'float32', True, buf(2, 2), seq=4)
    assert acks(replies) == ['a', 'b']
    assert data_of(shard.pull('q', W1, 'k', 0)) == {'q': [3.0, 3.0]}   # round 5 only, once
    assert shard.entries[('k', 0)].version == 5


def test_rebase_keeps_a_checkpoint_newer_than_what_workers_saw():
    shard = restarted(checkpointed_rounds=5)   # round 5 completed, its acks never left
    rebase(shard.entries, {W0: [ResumeItem('k', 0, 4)], W1: [ResumeItem('k', 0, 4)]}, {W0, W1})
    assert acks(shard.push('a', W0, 'k', 0, 'float32', True, buf(1, 1), seq=4)) == ['a']
    assert acks(shard.push('b', W1, 'k', 0, 'float32', True, buf(1, 1), seq=4)) == ['b']
    assert data_of(shard.pull('q', W0, 'k', 0)) == {'q': [100.0, 100.0]}   # not merged again


def test_rebase_of_async_keys_counts_each_worker_on_its_own():
    shard = restarted(checkpointed_rounds=2, sync=False)
    rebase(shard.entries, {W0: [ResumeItem('k', 0, 1)], W1: [ResumeItem('k', 0, 4)]}, {W0, W1})
    assert acks(shard.push('old', W0, 'k', 0, 'float32', False, buf(1, 1), seq=1)) == ['old']
    assert acks(shard.push('old1', W1, 'k', 0, 'float32', False, buf(1, 1), seq=3)) == ['old1']
    assert acks(shard.push('new', W1, 'k', 0, 'float32', False, buf(7, 7), seq=4)) == ['new']
    assert data_of(shard.pull('q', W0, 'k', 0)) == {'q': [7.0, 7.0]}


@pytest.mark.parametrize('workers', [2, 3])
def test_a_rounds_last_push_is_summed_in_the_update_exactly_as_a_merge_would(workers):
    # float32 with an optimizer: the update gets (sum of the others, last push) and adds them
    # in its own pass; the weights are bit for bit those of summing first. float16 keys are
    # merged first (a sum in the update's float32 would round differently).
    rng = np.random.default_rng(3)
    pushes = [[rng.standard_normal(1000).astype(np.float32) for _ in range(workers)]
              for _ in range(3)]
    for dtype, fused in (('float32', True), ('float16', False)):
        spec = create('sgd', learning_rate=0.1, momentum=0.9, wd=0.01).to_spec()
        recorder, shard = AddUpdater(), Shard(workers, Updater(spec))
        shard.updater.update_many = lambda items, step=0, failures=None, \
            real=shard.updater.update_many: (
                recorder.parts.extend(len(g) if isinstance(g, tuple) else 1 for *_, g in items),
                real(items, step, failures))
        reference = Updater(spec)
        w_ref = np.ones(1000, dtype)
        shard.init('i', 'k', 0, dtype, [1000], True, w_ref.tobytes())
        for r, round_pushes in enumerate(pushes):
            for w, g in enumerate(round_pushes):
                shard.together(lambda: shard.push(f'p{r}{w}', f'w{w}'.encode(), 'k', 0, dtype,
                                                  True, g.astype(dtype).tobytes()))
            total = round_pushes[0].astype(dtype)
            for g in round_pushes[1:]:
                total = total + g.astype(dtype)
            reference.update('k', w_ref, total)
        got = data_of(shard.pull('q', b'w0', 'k', 0))['q']
        assert np.array_equal(np.array(got, dtype), w_ref), dtype
        assert recorder.parts == ([2] * 3 if fused else [1] * 3), dtype


# -- updates gathered over one message (multi-tensor apply) -------------------------------------
class CountingUpdater:
    """An SGD Updater that records how many keys each update_many call got."""

    def __init__(self):
        self.real = Updater(create('sgd', learning_rate=0.5).to_spec())
        self.calls = []

    def update_many(self, items, step=0, failures=None):
        self.calls.append(sorted(key for key, *_ in items))
        self.real.update_many(items)


def many_keys(sync, num_workers=2, keys=('a', 'b', 'c')):
    updater = CountingUpdater()
    shard = Shard(num_workers, updater)
    for key in keys:
        shard.init('i', key, 0, 'float32', [2], sync, buf(1, 1))
    return shard, updater


def push_all(shard, worker, sync, values, keys=('a', 'b', 'c'), tag='p'):
    def handle():
        replies = []
        for key, value in zip(keys, values):
            replies += shard.push(f'{tag}-{key}', worker, key, 0, 'float32', sync,
                                  buf(value, value))
        return replies
    return shard.together(handle)


def test_rounds_one_message_completes_are_updated_in_one_pass_then_answered():
    shard, updater = many_keys(sync=True)
    assert push_all(shard, W0, True, [1, 2, 3], tag='w0') == []
    pulls = [shard.pull(f'q-{key}', W0, key, 0) for key in 'abc']
    assert pulls == [[], [], []]                       # waiting for the round
    replies = push_all(shard, W1, True, [1, 2, 3], tag='w1')
    assert updater.calls == [['a', 'b', 'c']]           # one multi-key update
    assert acks(replies) == sorted(f'{w}-{k}' for w in ('w0', 'w1') for k in 'abc')
    # w -= 0.5 * (sum of the two pushes)
    assert {k: data_of(shard.pull('q', W0, k, 0))['q'] for k in 'abc'} == {
        'a': [0.0, 0.0], 'b': [-1.0, -1.0], 'c': [-2.0, -2.0]}


def test_pulls_waiting_on_a_gathered_round_get_the_updated_weight():
    shard, _ = many_keys(sync=True, keys=('a',))
    push_all(shard, W0, True, [1], keys=('a',))
    assert shard.pull('q', W0, 'a', 0) == []
    replies = push_all(shard, W1, True, [1], keys=('a',))
    assert data_of(replies) == {'q': [0.0, 0.0]}


def test_a_queued_next_round_completed_by_a_gathered_update_is_applied_too():
    shard, updater = many_keys(sync=True, keys=('a',))
    push_all(shard, W0, True, [1], keys=('a',), tag='r1')
    push_all(shard, W0, True, [3], keys=('a',), tag='r2')    # round 2, queued
    replies = push_all(shard, W1, True, [1, 1], keys=('a', 'a'), tag='x')   # rounds 1 and 2
    assert acks(replies) == ['r1-a', 'r2-a', 'x-a', 'x-a'] and len(updater.calls) == 2
    assert data_of(shard.pull('q', W0, 'a', 0)) == {'q': [-2.0, -2.0]}   # 1 - 0.5*2 - 0.5*4


def test_the_same_async_key_twice_in_one_message_is_updated_twice_in_order():
    shard, updater = many_keys(sync=False, num_workers=1)
    replies = push_all(shard, W0, False, [1, 2, 4], keys=('a', 'b', 'a'))
    assert acks(replies) == ['p-a', 'p-a', 'p-b']
    assert updater.calls == [['a', 'b'], ['a']]
    assert data_of(shard.pull('q', W0, 'a', 0)) == {'q': [-1.5, -1.5]}   # 1 - 0.5 - 2


def test_a_failing_push_does_not_lose_the_updates_gathered_before_it():
    shard, updater = many_keys(sync=False, num_workers=1)

    def handle():
        shard.push('ok', W0, 'a', 0, 'float32', False, buf(2, 2))
        shard.push('bad', W0, 'a', 0, 'float64', False, buf(2, 2, dtype=np.float64))
    with pytest.raises(DTypeError):
        shard.together(handle)
    assert updater.calls == [['a']]
    assert data_of(shard.pull('q', W0, 'a', 0)) == {'q': [0.0, 0.0]}


def test_without_an_optimizer_nothing_is_gathered():
    shard = Shard(1)
    shard.init('i', 'a', 0, 'float32', [2], True, buf(1, 1))
    replies = shard.together(lambda: shard.push('p', W0, 'a', 0, 'float32', True, buf(5, 6)))
    assert acks(replies) == ['p'] and data_of(shard.pull('q', W0, 'a', 0)) == {'q': [5.0, 6.0]}


# -- an update that fails ----------------------------------------------------------------------
def sgd():
    return Updater(create('sgd', learning_rate=1.0).to_spec())


def errors(replies):
    return {token: str(exc) for kind, token, exc in replies if kind == 'error'}


def test_a_failed_sync_update_fails_its_round_and_the_key_goes_on():
    # An int key cannot be updated by an optimizer: every pusher of the round gets the error
    # at once and a pull waiting for the round gets the unchanged weight (before, both waited
    # for KVPS_TIMEOUT); the next round is not stuck behind it.
    shard = Shard(2, sgd())
    shard.init('t', 'i', 0, 'int32', [2], True, buf(5, 5, dtype=np.int32))
    shard.push('a', W0, 'i', 0, 'int32', True, buf(1, 1, dtype=np.int32))
    assert shard.pull('q', W0, 'i', 0) == []               # waits for the round
    shard.push('a2', W0, 'i', 0, 'int32', True, buf(1, 1, dtype=np.int32))   # next round
    replies = shard.push('b', W1, 'i', 0, 'int32', True, buf(1, 1, dtype=np.int32))
    failed = errors(replies)
    assert sorted(failed) == ['a', 'b'] and 'int32' in failed['a']
    assert data_of(replies) == {'q': [5, 5]}
    assert [kind for kind, *_ in replies] == ['error', 'error', 'data']   # errors first
    replies = shard.push('b2', W1, 'i', 0, 'int32', True, buf(1, 1, dtype=np.int32))
    assert sorted(errors(replies)) == ['a2', 'b2']
    shard.updater = None                                    # the key is still usable
    shard.push('a3', W0, 'i', 0, 'int32', True, buf(2, 2, dtype=np.int32))
    assert acks(shard.push('b3', W1, 'i', 0, 'int32', True, buf(3, 3, dtype=np.int32))) == [
        'a3', 'b3']
    assert data_of(shard.pull('q3', W1, 'i', 0)) == {'q3': [5, 5]}


def test_a_failed_async_update_answers_its_push_with_the_error():
    shard = Shard(2, sgd())
    shard.init('t', 'i', 0, 'int32', [2], False, buf(5, 5, dtype=np.int32))
    assert list(errors(shard.push('a', W0, 'i', 0, 'int32', False,
                                  buf(1, 1, dtype=np.int32)))) == ['a']
    assert data_of(shard.pull('q', W0, 'i', 0)) == {'q': [5, 5]}


@pytest.mark.parametrize('sync', [True, False])
def test_one_key_that_cannot_be_updated_does_not_fail_the_keys_sent_with_it(sync):
    shard = Shard(1, sgd())
    shard.init('t', 'f', 0, 'float32', [2], sync, buf(1, 1))
    shard.init('t', 'i', 0, 'int32', [2], sync, buf(1, 1, dtype=np.int32))
    shard.init('t', 'g', 0, 'float32', [2], sync, buf(1, 1))

    def one_message():
        return [reply for key, dtype in (('f', np.float32), ('i', np.int32), ('g', np.float32))
                for reply in shard.push(key, W0, key, 0, np.dtype(dtype).name, sync,
                                        buf(0.5, 0.5, dtype=dtype))]
    replies = shard.together(one_message)
    assert acks(replies) == ['f', 'g'] and list(errors(replies)) == ['i']
    assert data_of(shard.pull('q', W0, 'f', 0)) == {'q': [0.5, 0.5]}
    assert data_of(shard.pull('q', W0, 'g', 0)) == {'q': [0.5, 0.5]}
    assert shard.updates == 2


def test_a_rounds_lr_step_is_its_own_pushes_not_a_fast_workers_later_ones():
    # The step (most pushes of any key, sent by each worker) lifts num_update for the lr
    # scheduler; a push queued for a later round must not lift the round still open.
    sched = FactorScheduler(step=1, factor=0.5, base_lr=1.0)
    shard = make(values=(0.0,), updater=Updater(create('sgd', learning_rate=1.0,
                                                       lr_scheduler=sched)))
    shard.push('a0', W0, 'k', 0, 'float32', True, buf(1.0), step=3)
    shard.push('a1', W0, 'k', 0, 'float32', True, buf(1.0), step=9)    # queued: round 2
    shard.push('b0', W1, 'k', 0, 'float32', True, buf(1.0), step=3)
    assert shard.updater.num_update == 3
    assert data_of(shard.pull('q', W1, 'k', 0))['q'] == [-0.5]          # lr 1.0 * 0.5 ** 1
    shard.push('b1', W1, 'k', 0, 'float32', True, buf(1.0), step=4)
    assert shard.updater.num_update == 9                                 # the queued step


def test_refused_states_leave_the_shard_as_it_was_and_staged_ones_wait_for_commit():
    shard = Shard(1)
    mom = {'dtype': 'float32', 'shape': [2], 'data': bytes(8)}
    states = {'format': 'kvps.updater.states/1', 'num_update': 3, 'counts': [[0, 0, 3]],
              'optimizer': create('sgd', momentum=0.9).to_spec(),
              'states': [[0, 0, {'mean': mom}]]}
    with pytest.raises(ConfigError, match="key 0 part 0 holds optimizer state.*'mean'"):
        shard.set_states(states)
    assert shard.updater is None            # the file's optimizer was not installed either
    states['states'] = [[0, 0, {'mom': {**mom, 'data': bytes(5)}}]]
    with pytest.raises(ConfigError, match=r'key 0 part 0: malformed optimizer state'):
        shard.set_states(states)
    states['states'] = [[0, 0, {'mom': mom}]]
    shard.set_states(states, stage=True)
    assert shard.updater is None
    shard.commit_states()
    assert shard.updater.num_update == 3 and shard.updater.get_states()['counts'] == [[0, 0, 3]]
    with pytest.raises(ConfigError, match='no optimizer states are staged'):
        shard.commit_states()


@pytest.mark.parametrize('mom, refusal', [
    ({'dtype': 'float32', 'shape': [2, 1], 'data': bytes(8)},
     r"key 'k' part 0: optimizer state 'mom' has shape \(2, 1\), the key part \(2,\)"),
    ({'dtype': 'float32', 'shape': [3], 'data': bytes(12)},
     r"key 'k' part 0: optimizer state 'mom' has shape \(3,\), the key part \(2,\)"),
    ({'dtype': 'float16', 'shape': [2], 'data': bytes(4)},
     r"key 'k' part 0: optimizer state 'mom' is float16, but the key is float32")])
def test_states_that_do_not_fit_their_key_are_refused_when_staged(mom, refusal):
    """Not at the key's first update, after every server has committed them."""
    shard = Shard(1, Updater(create('sgd', momentum=0.9, learning_rate=0.5)))
    shard.init('i', 'k', 0, 'float32', (2,), True, buf(0.0, 0.0))
    states = {'format': 'kvps.updater.states/1', 'num_update': 1, 'counts': [['k', 0, 1]],
              'states': [['k', 0, {'mom': mom}]]}
    with pytest.raises(ConfigError, match=refusal):
        shard.set_states(states, stage=True)
    with pytest.raises(ConfigError, match='no optimizer states are staged'):
        shard.commit_states()
    shard.push('p', W0, 'k', 0, 'float32', True, buf(1.0, 1.0))
    assert data_of(shard.pull('q', W0, 'k', 0))['q'] == [-0.5, -0.5]
