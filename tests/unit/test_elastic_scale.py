"""Elastic dist_sync rounds scaled to the job's size (KVStore.scale_rounds: the Trainer's keys):
a round of n members weighs as one of the job's N workers, exactly; full rounds are untouched;
and the Trainer's batch size is restated for N whatever members it counted (ElasticBatch)."""

import numpy as np
import pytest

from kvps.errors import ConfigError
from kvps.optimizer import create
from kvps.optimizer.kernels import numpy_kernels as K
from kvps.optimizer.updater import Updater
from kvps.server import members
from kvps.server.checkpoint import restore, snapshot
from kvps.server.row_store import RowGrad
from kvps.server.shard import Shard
from kvps.trainer.elastic_batch import ElasticBatch

W0, W1, W2, W3 = (f'worker-{r}'.encode() for r in range(4))


def buf(*values, dtype=np.float32):
    return memoryview(np.array(values, dtype=dtype)).cast('B')


def scaled_shard(live, scale_to=4, updater=None, dtype='float32', init=(0.0, 0.0)):
    """A shard of ``live`` members whose key 'k' is scaled to ``scale_to`` workers."""
    shard = Shard(live, updater, elastic=True)
    data = buf(*init) if dtype != 'bfloat16' else memoryview(
        K.f32_to_bf16(np.array(init, np.float32))).cast('B')
    shard.init('t', 'k', 0, dtype, [2], True, data, scale_to=scale_to)
    return shard


def value(shard):
    return shard.entries['k', 0].weight.tolist()


def test_a_round_of_fewer_members_is_scaled_to_the_jobs_size():
    shard = scaled_shard(3)                            # 3 of the job's 4 are members
    for worker, v in ((W0, 1), (W1, 2), (W2, 3)):
        shard.push(worker, worker, 'k', 0, 'float32', True, buf(v, 2 * v))
    assert value(shard) == [8.0, 16.0]                 # (1+2+3) * 4/3


def test_a_round_of_one_member_is_scaled_without_writing_its_push():
    shard = scaled_shard(1)
    pushed = np.array([3.0, -1.5], np.float32)
    shard.push('a', W0, 'k', 0, 'float32', True, memoryview(pushed).cast('B'))
    assert value(shard) == [12.0, -6.0]
    assert pushed.tolist() == [3.0, -1.5]              # a pushed buffer is never written


def test_a_round_of_the_jobs_size_is_a_fixed_jobs_round_bit_for_bit():
    scaled, fixed = scaled_shard(4, init=(0.1, 0.2)), Shard(4)
    fixed.init('t', 'k', 0, 'float32', [2], True, buf(0.1, 0.2))
    for shard in (scaled, fixed):
        for worker in (W0, W1, W2, W3):
            shard.push(worker, worker, 'k', 0, 'float32', True, buf(0.1, 1 / 3))
    assert value(scaled) == value(fixed)


def test_an_optimizer_gets_the_scaled_sum_of_the_round():
    """SGD, lr 0.5 (the last push reaches the update unsummed on host float32 keys: it is
    added first): w = 1 - 0.5 * (2 + 4) * 4/2."""
    shard = scaled_shard(2, updater=Updater(create('sgd', learning_rate=0.5).to_spec()),
                         init=(1.0, 1.0))
    shard.push('a', W0, 'k', 0, 'float32', True, buf(2, 0))
    shard.push('b', W1, 'k', 0, 'float32', True, buf(4, 1))
    assert value(shard) == [-5.0, 0.0]


def test_a_bfloat16_round_is_scaled_in_float32():
    shard = scaled_shard(1, dtype='bfloat16')
    shard.push('a', W0, 'k', 0, 'bfloat16', True,
               memoryview(K.f32_to_bf16(np.array([1.5, -3], np.float32))).cast('B'))
    assert K.bf16_to_f32(shard.entries['k', 0].weight).tolist() == [6.0, -12.0]


def test_a_gone_members_push_is_taken_out_and_the_round_scaled_to_the_rest():
    shard = scaled_shard(3)
    shard.push('a', W0, 'k', 0, 'float32', True, buf(1, 1))
    shard.push('b', W2, 'k', 0, 'float32', True, buf(100, 100))
    members.change(shard, [W2], [])
    shard.push('c', W1, 'k', 0, 'float32', True, buf(2, 2))
    assert value(shard) == [6.0, 6.0]                  # (1 + 2) * 4/2, never W2's 100


@pytest.mark.parametrize('dtype', ['float32', 'bfloat16'])
def test_rows_of_a_round_are_scaled(dtype):
    shard = scaled_shard(2, dtype=dtype)
    entry = shard.entries['k', 0]
    rows = np.array([[3.0]], np.float32)
    grad = RowGrad(np.array([1]), rows if dtype == 'float32' else K.f32_to_bf16(rows))
    out = members.scaled_rows(entry, grad, 2).rows
    assert (out if dtype == 'float32' else K.bf16_to_f32(out)).tolist() == [[6.0]]
    assert members.scaled_rows(entry, grad, 4) is grad


def test_only_floating_point_keys_are_scaled():
    shard = Shard(2, elastic=True)
    with pytest.raises(ConfigError, match="key 'n': rounds scaled to 4 workers need a "
                                          'floating point key, not int32'):
        shard.init('t', 'n', 0, 'int32', [2], True, buf(1, 2, dtype=np.int32), scale_to=4)


def test_a_checkpoint_keeps_the_scale():
    shard = scaled_shard(3)
    resumed = Shard(3, elastic=True)
    restore(resumed, snapshot(shard))
    assert resumed.entries['k', 0].scale_to == 4


class Members:
    def __init__(self, n):
        self.num_workers = n


def test_the_trainers_batch_is_restated_for_the_jobs_size():
    """step(16 * kv.num_workers) in a job of 4: the batch of 4 workers, 64, whatever the
    members; a caller that counted the members just before a change still gets it."""
    kv = Members(4)
    batches = ElasticBatch(kv, 4)
    assert batches.job_batch(64) == 64
    kv.num_workers = 3
    assert batches.job_batch(48) == 64
    kv.num_workers = 5
    assert batches.job_batch(48) == 64                 # counted 3 before the change to 5
    assert batches.job_batch(80) == 64
    assert batches.job_batch(40) == 32                 # its own batch halved: a new rescale

