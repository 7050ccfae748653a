"""Elastic jobs' pure parts: the scheduler's membership (leave, join, barriers counting
members) and a server's rounds as workers leave and join (kvps.server.members)."""

import collections

import numpy as np
import pytest

from kvps.config import Config
from kvps.errors import ConfigError
from kvps.optimizer import create
from kvps.optimizer.updater import Updater
from kvps.scheduler.elastic import bounds
from kvps.scheduler.membership import Membership
from kvps.server import members
from kvps.server.shard import Shard
from kvps.worker.joining import Members as WorkerMembers

W0, W1, W2, J = b'worker-0', b'worker-1', b'worker-2', b'worker-3.1'


def buf(*values):
    return memoryview(np.array(values, dtype=np.float32)).cast('B')


def shard_of(workers, updater=None):
    shard = Shard(workers, updater, elastic=True)
    shard.init('t0', 'k', 0, 'float32', [2], True, buf(0, 0))
    return shard


def value(shard):
    return shard.entries['k', 0].weight.tolist()


def acks(replies):
    return sorted(token for kind, token, _ in replies if kind == 'ack')


def test_a_gone_workers_push_is_taken_out_of_the_open_round_and_the_round_closes():
    shard = shard_of(3)
    assert shard.push('a', W0, 'k', 0, 'float32', True, buf(1, 1)) == []
    assert shard.push('b', W2, 'k', 0, 'float32', True, buf(100, 100)) == []
    replies, discarded = members.change(shard, [W2], [])
    assert replies == [] and discarded == {W2: 1}   # W1 has not pushed: still open
    assert acks(shard.push('c', W1, 'k', 0, 'float32', True, buf(2, 2))) == ['a', 'b', 'c']
    assert value(shard) == [3.0, 3.0]               # W0 + W1, never W2's 100
    assert shard.num_workers == 2
    shard.push('d', W0, 'k', 0, 'float32', True, buf(5, 5))
    assert acks(shard.push('e', W1, 'k', 0, 'float32', True, buf(1, 1))) == ['d', 'e']
    assert value(shard) == [6.0, 6.0]


def test_a_round_complete_before_the_loss_keeps_the_lost_workers_push():
    shard = shard_of(2)
    shard.push('a', W0, 'k', 0, 'float32', True, buf(1, 1))
    shard.push('b', W1, 'k', 0, 'float32', True, buf(2, 2))
    assert members.change(shard, [W1], []) == ([], {})
    assert value(shard) == [3.0, 3.0]


@pytest.mark.parametrize('gone_first', [True, False])
def test_a_lost_workers_complete_round_stays_and_its_queued_push_goes(gone_first):
    """A round every member pushed into keeps the lost worker's push; its push queued for
    the next round goes. (w -= lr * sum, lr 0.5)"""
    shard = shard_of(3, Updater(create('sgd', learning_rate=0.5).to_spec()))
    pushes = [(W2, buf(64, 64)), (W0, buf(1, 2)), (W1, buf(2, 4))]
    for token, (worker, data) in enumerate(pushes if gone_first else pushes[::-1]):
        shard.push(token, worker, 'k', 0, 'float32', True, data)
    assert value(shard) == [-33.5, -35.0]           # every member pushed: W2's counts
    shard.push('a', W0, 'k', 0, 'float32', True, buf(1, 2))
    shard.push('b', W2, 'k', 0, 'float32', True, buf(64, 64))
    shard.push('c', W2, 'k', 0, 'float32', True, buf(64, 64))   # queued: its next round
    assert acks(shard.push('d', W1, 'k', 0, 'float32', True, buf(2, 4))) == ['a', 'b', 'd']
    assert value(shard) == [-67.0, -70.0]           # (c is now in the open round)
    assert members.change(shard, [W2], []) == ([], {W2: 1})
    shard.push('e', W0, 'k', 0, 'float32', True, buf(1, 2))
    assert acks(shard.push('f', W1, 'k', 0, 'float32', True, buf(2, 4))) == ['c', 'e', 'f']
    assert value(shard) == [-68.5, -73.0]           # W0 + W1 only


def test_the_loss_of_the_only_worker_that_had_not_pushed_closes_the_round():
    shard = shard_of(3, Updater(create('sgd', learning_rate=0.5).to_spec()))
    shard.push('a', W1, 'k', 0, 'float32', True, buf(2, 4))
    shard.push('b', W0, 'k', 0, 'float32', True, buf(1, 2))
    replies, discarded = members.change(shard, [W2], [])
    assert acks(replies) == ['a', 'b'] and discarded == {}
    assert value(shard) == [-1.5, -3.0]


def test_a_joiner_counts_from_the_next_round_and_its_pulls_wait_for_the_open_one():
    shard = shard_of(2)
    shard.push('a', W0, 'k', 0, 'float32', True, buf(1, 1))     # round 0 has begun
    assert members.change(shard, [], [J]) == ([], {})
    assert shard.check('c', 'k', 0, 'float32', [2], J) == [('ack', 'c', 1)]
    assert shard.pull('p', J, 'k', 0) == []                      # waits for round 0
    replies = shard.push('b', W1, 'k', 0, 'float32', True, buf(2, 2))
    assert acks(replies) == ['a', 'b'] and [t for k, t, _ in replies if k == 'data'] == ['p']
    assert value(shard) == [3.0, 3.0]                            # round 0: without the joiner
    shard.push('d', W0, 'k', 0, 'float32', True, buf(1, 1))
    shard.push('e', W1, 'k', 0, 'float32', True, buf(2, 2))
    assert value(shard) == [3.0, 3.0]                            # round 1 waits for it
    assert acks(shard.push('f', J, 'k', 0, 'float32', True, buf(4, 4), seq=1)) == ['d', 'e',
                                                                                    'f']
    assert value(shard) == [7.0, 7.0]


def test_a_joiner_between_rounds_is_in_the_open_round():
    shard = shard_of(1)
    members.change(shard, [], [J])
    assert shard.check('c', 'k', 0, 'float32', [2], J) == [('ack', 'c', 0)]
    shard.push('a', W0, 'k', 0, 'float32', True, buf(1, 1))
    assert value(shard) == [0.0, 0.0]
    shard.push('b', J, 'k', 0, 'float32', True, buf(2, 2), seq=0)
    assert value(shard) == [3.0, 3.0]


def elastic(workers=3, least=2, most=4):
    m = Membership(workers, 1, (least, most))
    for i in range(workers):
        m.register(f'w{i}'.encode(), 'worker', 'h', 0, i, 10 + i, now=0)
    m.register(b's', 'server', 'h', 5000, None, 9, now=0)
    m.assign_ranks()
    return m


def test_joiners_take_the_lowest_free_rank_or_theirs_and_wait_when_none_is_free():
    m = elastic()
    m.leave(b'w1', lost=True)
    assert m.epoch == 1 and m.worker_members() == [[0, 0], [2, 0]]
    node = m.join(b'j1', 'h', 0, None, 20, now=1)
    assert (node.rank, node.incarnation) == (1, 2)
    assert m.join(b'j2', 'h', 0, 2, 21, now=1) is None         # rank 2 is held: wait
    assert m.join(b'j3', 'h', 0, None, 22, now=1).rank == 3
    assert m.join(b'j4', 'h', 0, None, 23, now=1) is None       # all 4 ranks are held
    with pytest.raises(ConfigError, match='ranks 0..3'):
        m.join(b'j5', 'h', 0, 4, 24, now=1)
    assert m.welcome(node)['workers'] == [[0, 0], [1, 2], [2, 0], [3, 3]]
    assert not m.too_few_workers
    m.leave(b'w0', lost=True)
    m.leave(b'w2', lost=True)
    m.leave(b'j3', lost=True)
    assert m.too_few_workers and [n.rank for n in m.lost_workers] == [1, 0, 2, 3]


def test_a_joiner_is_told_the_hosts_the_job_formed_on_not_its_own_count():
    # (the Trainer sizes its fused keys by it: every worker, joiners too, must see one value)
    m = elastic()
    joiner = m.join(b'j', 'elsewhere', 0, None, 20, now=1)
    assert m.welcome(joiner)['hosts'] == 1 == m.welcome(m.nodes[b'w0'])['hosts']


def test_a_fixed_job_takes_no_joiner():
    m = Membership(1, 1)
    with pytest.raises(ConfigError, match='not elastic.*--min-workers'):
        m.join(b'j', 'h', 0, None, 1, now=0)


def test_barriers_count_the_members_and_a_joiner_meets_the_first_one_not_begun():
    m = elastic()
    assert m.arrive(b'w0', 1) == []
    joiner = m.join(b'j', 'h', 0, None, 20, now=1)               # barrier 1 has begun
    assert joiner.first_barrier == 2 and m.welcome(joiner)['barriers'] == 1
    assert m.arrive(b'j', 2) == []                              # early, for barrier 2
    assert m.arrive(b'w1', 1) == []
    m.leave(b'w2', lost=True)                                  # it never comes
    assert m.releasable() == [(1, [b'w0', b'w1'], [], {})]
    for w in (b'w0', b'w1'):
        released = m.arrive(w, 2)
    assert released == [(2, [b'j', b'w0', b'w1'], [], {})]


@pytest.mark.parametrize('env, match', [
    ({'KVPS_MAX_WORKERS': '3'}, 'KVPS_MIN_WORKERS is not'),
    ({'KVPS_MIN_WORKERS': '5'}, 'need min <= workers <= max'),
    ({'KVPS_MIN_WORKERS': '1', 'KVPS_MAX_WORKERS': '3'}, 'need min <= workers <= max')])
def test_elastic_bounds_must_hold_the_jobs_size(env, match):
    with pytest.raises(ConfigError, match=match):
        bounds(Config.from_env({'DMLC_NUM_WORKER': '4', **env}))


def test_elastic_bounds():
    assert bounds(Config.from_env({'DMLC_NUM_WORKER': '4'})) is None
    assert bounds(Config.from_env({'DMLC_NUM_WORKER': '4', 'KVPS_MIN_WORKERS': '2'})) == (2, 4)


def test_an_epoch_is_dealt_once_among_the_members_whatever_the_changes():
    from kvps.elastic import epoch_order, shard
    order = epoch_order(103, epoch=2, seed=7)
    assert sorted(order.tolist()) == list(range(103))
    assert order.tolist() == epoch_order(103, 2, 7).tolist() != epoch_order(103, 3, 7).tolist()
    seen = []
    start = 0
    for ranks, steps in (([0, 1, 2, 3], 5), ([0, 2, 3], 4), ([0, 2, 3, 4], 100)):
        shares = {r: shard(103, 2, ranks, r, start, seed=7) for r in ranks}
        assert max(map(len, shares.values())) - min(map(len, shares.values())) <= 1
        for step in range(steps):   # a batch of 2 per member per step
            for r in ranks:
                seen += shares[r][2 * step:2 * step + 2].tolist()
        start = min(103, start + 2 * steps * len(ranks))
    assert sorted(seen) == list(range(103))
    with pytest.raises(ValueError, match='rank 1 is not one of the member ranks'):
        shard(10, 0, [0, 2], 1)
    with pytest.raises(ValueError, match='start 11 is outside'):
        shard(10, 0, [0], 0, start=11)


def test_a_restarted_server_learns_a_joiners_first_round_from_its_resume():
    """Round 0 had begun when J joined, so J counts from round 1; the server dies with round 0
    open and restarts from a checkpoint that predates the join. The founders resume at 0 (their
    round-0 pushes unanswered) and J at 1, its first: round 0 is redone without J (J's count
    says no round completed), and round 1 waits for J."""
    from kvps.server.checkpoint import restore, snapshot
    from kvps.server.recovery import rebase
    from kvps.wire.items import ResumeItem
    before = shard_of(2)
    restarted = Shard(3, elastic=True)
    restore(restarted, snapshot(before), rounds=True)
    rebase(restarted.entries, {W0: [ResumeItem('k', 0, 0)], W1: [ResumeItem('k', 0, 0)],
                               J: [ResumeItem('k', 0, 1, first=1)]}, {W0, W1, J})
    entry = restarted.entries['k', 0]
    assert (entry.version, entry.pushed, entry.late) == (0, {W0: 0, W1: 0, J: 1}, {J: 1})
    restarted.init('t', 'k', 0, 'float32', [2], True, buf(0, 0))   # (claims the restored key)
    restarted.push('a', W0, 'k', 0, 'float32', True, buf(1, 1), seq=0)
    restarted.push('b', W1, 'k', 0, 'float32', True, buf(2, 2), seq=0)
    assert value(restarted) == [3.0, 3.0]                      # round 0: the founders
    restarted.push('c', W0, 'k', 0, 'float32', True, buf(1, 1), seq=1)
    restarted.push('d', W1, 'k', 0, 'float32', True, buf(2, 2), seq=1)
    assert value(restarted) == [3.0, 3.0]                      # round 1 waits for J
    assert acks(restarted.push('e', J, 'k', 0, 'float32', True, buf(4, 4), seq=1)) == [
        'c', 'd', 'e']
    assert value(restarted) == [7.0, 7.0]


class IOStub:
    """What a worker's Members reads of its I/O thread."""

    def __init__(self, epoch=1, ranks=(0, 1)):
        self.membership = (epoch, list(ranks), [(r, 0) for r in ranks])
        self.membership_changes = collections.deque()
        self.welcome = {}

    def told(self, epoch, ranks):   # a MEMBERS, as the I/O thread takes it
        self.membership = (epoch, list(ranks), [(r, 0) for r in ranks])
        self.membership_changes.append(self.membership)


def test_each_membership_change_is_told_once_and_in_order():
    io = IOStub()
    seen = []
    worker = WorkerMembers(io, True, {})
    worker.callback = lambda n, ranks: seen.append((n, ranks))
    io.told(2, [0, 1, 2])   # a joiner came and went between two store calls:
    io.told(3, [0, 1])      # both are told, in order
    worker.moved()
    assert seen == [(3, [0, 1, 2]), (2, [0, 1])] and worker.epoch == 3
    worker.moved()          # nothing new: nothing told
    assert len(seen) == 2
    io.membership_changes.append((1, [0], [(0, 0)]))   # (not newer than what was told)
    worker.moved()
    assert len(seen) == 2 and worker.epoch == 3
