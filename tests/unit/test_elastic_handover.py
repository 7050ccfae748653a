"""A joiner's Trainer that updates on the workers takes a member's weights and optimizer state
(kvps.trainer.handover): who serves, what a joiner takes and replays, and the servers' side,
abstentions from rounds (kvps.server.members.abstain) and the job's blobs (kvps.server.blobs)."""

import msgpack
import numpy as np
import pytest
import torch

import kvps
from kvps.errors import ConfigError, KeyNotInitializedError, PeerLostError
from kvps.server.blobs import Blobs
from kvps.server.shard import Shard
from kvps.trainer.handover import BLOB, HAVE, WANT, Handover, record_name
from kvps.wire import protocol as P

W0, W1, J = b'worker-0', b'worker-1', b'worker-2.1'
NOTHING = memoryview(b'')


def buf(*values):
    return memoryview(np.array(values, dtype=np.float32)).cast('B')


def acks(replies):
    return sorted(token for kind, token, _ in replies if kind == 'ack')


# -- the servers: abstentions -------------------------------------------------------------
def shard_of(workers, scale_to=0, updater=None):
    shard = Shard(workers, updater, elastic=True)
    shard.init('t', 'k', 0, 'float32', [2], True, buf(0, 0), scale_to=scale_to)
    return shard


def value(shard):
    return shard.entries['k', 0].weight.tolist()


@pytest.mark.parametrize('abstains_first', [True, False])
def test_an_abstention_closes_the_round_with_neither_its_sum_nor_its_scale(abstains_first):
    """Three members of a job of 4 (rounds scaled to 4): one abstains, the round is the two
    others' sum times 4/2 (not 4/3: the abstainer is no pusher)."""
    shard = shard_of(3, scale_to=4)
    abstain = lambda: shard.push('j', J, 'k', 0, P.NOTHING, True, NOTHING)   # noqa: E731
    if abstains_first:
        assert abstain() == []
    shard.push('a', W0, 'k', 0, 'float32', True, buf(1, 2))
    replies = shard.push('b', W1, 'k', 0, 'float32', True, buf(3, 5))
    if not abstains_first:
        assert replies == []
        replies = abstain()
    assert acks(replies) == ['a', 'b', 'j']
    assert value(shard) == [8.0, 14.0]
    assert shard.entries['k', 0].abstained == 0   # the next round starts afresh


def test_an_abstainers_pull_waits_for_its_round_and_sees_its_result():
    shard = shard_of(2)
    shard.push('j', J, 'k', 0, P.NOTHING, True, NOTHING)
    assert shard.pull('p', J, 'k', 0) == []          # the round is open: it waits
    replies = shard.push('a', W0, 'k', 0, 'float32', True, buf(1, 2))
    assert [r.token for r in replies if r.kind == 'data'] == ['p']
    assert value(shard) == [1.0, 2.0]                # W0's push alone


def test_a_round_every_member_abstains_from_is_zeros():
    shard = shard_of(2, scale_to=4, updater=None)
    shard.entries['k', 0].weight[:] = 7
    shard.push('a', W0, 'k', 0, P.NOTHING, True, NOTHING)
    assert acks(shard.push('b', J, 'k', 0, P.NOTHING, True, NOTHING)) == ['a', 'b']
    assert value(shard) == [0.0, 0.0]


def test_an_abstention_queued_for_a_later_round_counts_there():
    shard = shard_of(2)
    shard.push('j0', J, 'k', 0, P.NOTHING, True, NOTHING)
    shard.push('j1', J, 'k', 0, P.NOTHING, True, NOTHING)      # round 1: queued
    shard.push('a0', W0, 'k', 0, 'float32', True, buf(1, 1))
    assert acks(shard.push('a1', W0, 'k', 0, 'float32', True, buf(2, 3))) == ['a1', 'j1']
    assert value(shard) == [2.0, 3.0]


def test_a_lost_worker_is_taken_out_of_a_round_an_abstainer_is_in():
    from kvps.server import members
    shard = shard_of(3, scale_to=3)
    shard.push('j', J, 'k', 0, P.NOTHING, True, NOTHING)
    shard.push('a', W0, 'k', 0, 'float32', True, buf(1, 2))
    replies, _ = members.change(shard, [W1], [])
    assert acks(replies) == ['a', 'j']
    assert value(shard) == [3.0, 6.0]                # W0's push times 3/1


def test_an_abstention_is_refused_outside_sync_rounds():
    shard = Shard(2)
    shard.init('t', 'a', 0, 'float32', [2], False, buf(0, 0))
    with pytest.raises(ConfigError, match="key 'a': a push of nothing takes part in a sync "
                                          'round; dist_async applies each push alone'):
        shard.push('x', W0, 'a', 0, P.NOTHING, False, NOTHING)


def test_a_push_of_nothing_is_a_valid_message_of_no_bytes():
    header = {'op': P.PUSH, 'id': 1, 'sync': True, 'keys': [[3, 0, P.NOTHING, 0, None, 0]]}
    decoded, buffers = P.decode(P.encode(header, [b'']))
    assert decoded['keys'][0].dtype == P.NOTHING and buffers[0].nbytes == 0
    with pytest.raises(kvps.errors.ProtocolError, match='data frame of key 3 has 1 bytes'):
        P.decode(P.encode(header, [b'x']))


def test_a_local_store_abstains_too_and_refuses_unknown_keys():
    kv = kvps.create('local')
    kv.init(0, np.ones(2, np.float32))
    kv.abstain(0)                          # its one member abstains: the round is zeros
    out = np.full(2, 9, np.float32)
    kv.pull(0, out=out)
    assert out.tolist() == [0.0, 0.0]
    with pytest.raises(KeyNotInitializedError, match='key 5 is not initialized'):
        kv.abstain([0, 5])


# -- the servers: blobs --------------------------------------------------------------------
def test_a_blob_is_replaced_whole_by_each_put_and_empty_until_one():
    blobs = Blobs()
    assert blobs.get({'name': 'b'}) == b''
    blobs.put(W0, {'name': 'b'}, b'first')
    blobs.put(W1, {'name': 'b', 'piece': 0, 'more': True}, b'sec')
    assert blobs.get({'name': 'b'}) == b'first'       # a piece alone changes nothing
    blobs.put(W1, {'name': 'b', 'piece': 1}, b'ond')
    assert blobs.get({'name': 'b'}) == b'second'


def test_blob_pieces_out_of_order_and_bad_names_are_refused():
    blobs = Blobs()
    with pytest.raises(ConfigError, match=r"blob 'b': piece 1 came after 0 piece\(s\)"):
        blobs.put(W0, {'name': 'b', 'piece': 1}, b'x')
    blobs.put(W0, {'name': 'b', 'piece': 0, 'more': True}, b'x')
    blobs.forget(W0)                                   # W0 left: its pieces go
    with pytest.raises(ConfigError, match=r'piece 1 came after 0 piece\(s\)'):
        blobs.put(W0, {'name': 'b', 'piece': 1}, b'y')
    with pytest.raises(ConfigError, match='a blob name has 1 to 200 characters, got 201'):
        blobs.put(W0, {'name': 'n' * 201}, b'x')


# -- the Trainers: who serves, what a joiner takes ------------------------------------------
class Job:
    """What FakeNotes share: the members, the epoch, the blobs, and every get made."""

    def __init__(self, members):
        self.members, self.epoch, self.blobs, self.gets = members, 1, {}, []


class FakeNotes:
    """Backend.notes of one worker of a Job; ``count``: the rounds it pushed into."""

    def __init__(self, job, me):
        self.job, self.me, self.count = job, me, 0

    epoch = property(lambda self: self.job.epoch)

    def rounds(self):
        return self.count

    def members(self):
        return list(self.job.members)

    def put(self, name, blob):
        self.job.blobs[name] = bytes(blob)

    def get(self, name):
        self.job.gets.append((self.me, name))
        return self.job.blobs.get(name, b'')


class NoExchange:
    """The exchange a 'grads' replay needs: where the sums were (``.grad``) and a flag."""
    abstaining, summed = False, {}


def local_trainer(seed, name='sgd', params=(('learning_rate', 0.125), ('momentum', 0.5))):
    torch.manual_seed(seed)
    model = torch.nn.Linear(3, 2)
    return model, kvps.Trainer(model.parameters(), name, dict(params), kvstore=None)


def gradient(round_index):
    rng = np.random.default_rng(round_index)
    return [torch.from_numpy(rng.standard_normal(s).astype(np.float32)) for s in [(2, 3), (2,)]]


def handover_of(trainer, notes, waiting):
    return Handover(notes, trainer._params, trainer._local, NoExchange(), None, waiting)


def apply(model, trainer, round_index):
    for p, g in zip(model.parameters(), gradient(round_index)):
        p.grad = g.clone()
    trainer.step(4)


@pytest.mark.parametrize('name, params', [
    ('sgd', (('learning_rate', 0.125), ('momentum', 0.5))),
    ('adam', (('learning_rate', 0.01),))])
def test_a_joiner_takes_an_older_state_and_replays_the_rounds_after_it(name, params):
    """The donor puts its state after round 1 (tag 2); the joiner, which kept the sums of
    rounds 0 to 3, takes it and replays rounds 2 and 3: its weights and state are the
    donor's after round 3, bit for bit (Adam's step count included)."""
    job = Job([(0, 0), (2, 1)])
    model, trainer = local_trainer(0, name, params)
    joiner_model, joiner = local_trainer(1, name, params)    # other weights to start with
    donor = handover_of(trainer, FakeNotes(job, (0, 0)), waiting=False)
    taker = handover_of(joiner, FakeNotes(job, (2, 1)), waiting=True)
    assert donor.pending == {(2, 1)} and taker.notes.me not in taker.pending
    for round_index in range(4):
        apply(model, trainer, round_index)
        donor.notes.count = taker.notes.count = round_index + 1
        for p, g in zip(joiner_model.parameters(), gradient(round_index)):
            p.grad = g.clone()
        taker.keep(joiner._params, 'grads', trainer.optimizer.rescale_grad, {})
        if round_index < 2:   # (then it keeps rounds 2 and 3 before it looks again)
            assert taker.step_ended() is False and taker.waiting
        if round_index == 1:
            assert job.blobs[record_name((2, 1))] == WANT
            donor.step_ended()          # (later rounds it does not serve: the joiner is late)
            assert msgpack.unpackb(job.blobs[BLOB])['tag'] == 2
    assert taker.step_ended() is True
    assert not taker.waiting and taker.replayed == 2
    assert job.blobs[record_name((2, 1))] == HAVE
    for mine, theirs in zip(joiner_model.parameters(), model.parameters()):
        assert torch.equal(mine, theirs)
    assert msgpack.packb(joiner._local.states()) == msgpack.packb(trainer._local.states())


def test_a_handover_of_a_round_before_the_joiners_first_is_not_taken():
    job = Job([(0, 0), (2, 1)])
    _, joiner = local_trainer(1)
    taker = handover_of(joiner, FakeNotes(job, (2, 1)), waiting=True)
    job.blobs[BLOB] = msgpack.packb({'tag': 4})           # an earlier joiner's
    taker.notes.count = 6                                  # its first round is 5
    taker.keep(joiner._params, 'grads', 0.25, {})
    assert taker.step_ended() is False and taker.waiting


def test_the_lowest_member_not_waiting_serves_and_a_member_takes_over_when_it_is_lost():
    job = Job([(0, 0), (1, 0), (2, 1)])
    _, first = local_trainer(0)
    _, second = local_trainer(0)
    rank0 = handover_of(first, FakeNotes(job, (0, 0)), waiting=False)
    rank1 = handover_of(second, FakeNotes(job, (1, 0)), waiting=False)
    job.blobs[record_name((2, 1))] = WANT
    rank1.step_ended()
    assert BLOB not in job.blobs and job.gets == []   # not its turn: it reads nothing
    rank0.step_ended()
    assert BLOB in job.blobs
    del job.blobs[BLOB]
    job.members, job.epoch = [(1, 0), (2, 1)], 2      # rank 0 is lost mid-handover
    rank1.step_ended()
    assert BLOB in job.blobs and rank1.pending == {(2, 1)}
    job.blobs[record_name((2, 1))] = HAVE              # the joiner took it
    job.gets.clear()
    rank1.step_ended()
    assert rank1.pending == set() and job.gets == [((1, 0), record_name((2, 1)))]
    assert job.blobs[BLOB] == b''                      # served: server 0 lets the model go
    job.gets.clear()
    rank1.step_ended()
    assert job.gets == []                              # nothing pending: no reads


def test_a_member_does_not_serve_a_joiner_that_has_not_asked():
    job = Job([(0, 0), (2, 1)])
    _, trainer = local_trainer(0)
    donor = handover_of(trainer, FakeNotes(job, (0, 0)), waiting=False)
    donor.step_ended()
    assert BLOB not in job.blobs and donor.pending == {(2, 1)}


def test_a_joiner_that_took_a_handover_serves_the_joiners_it_did_not_know_of():
    """The donor knew of (0, 0) and the joiner (2, 1); (1, 2) joined after its handover. The
    joiner takes it, then counts (1, 2) as waiting (and the donor's pending list too)."""
    job = Job([(0, 0), (1, 2), (2, 1)])
    _, joiner = local_trainer(1)
    _, trainer = local_trainer(0)
    taker = handover_of(joiner, FakeNotes(job, (2, 1)), waiting=True)
    taker.notes.count = 3
    taker.keep(joiner._params, 'grads', 0.25, {})
    job.blobs[BLOB] = msgpack.packb({
        'tag': 3, 'members': [[0, 0], [2, 1]], 'pending': [[2, 1]],
        'weights': [_weights(p) for p in trainer._params],
        'state': trainer._local.states()})
    assert taker.step_ended() is True and taker.replayed == 0
    assert taker.pending == {(1, 2)}


def _weights(p):
    return p.tensor.detach().numpy().tobytes()


def test_a_handover_of_another_model_is_refused():
    job = Job([(0, 0), (2, 1)])
    _, joiner = local_trainer(1)
    taker = handover_of(joiner, FakeNotes(job, (2, 1)), waiting=True)
    taker.notes.count = 1
    taker.keep(joiner._params, 'grads', 0.25, {})
    job.blobs[BLOB] = msgpack.packb({'tag': 1, 'members': [], 'pending': [],
                                     'weights': [b'', b''], 'state': {}})
    with pytest.raises(ConfigError, match=r'parameter .*: the handover holds 0 bytes, this '
                                          r"worker's \(2, 3\) torch.float32 has 24"):
        taker.step_ended()


def test_a_joiner_that_no_member_can_serve_is_told_so_instead_of_waiting():
    """Once the job's first workers are gone and no joiner has taken a handover, nobody holds
    the state: a waiting joiner raises PeerLostError (it would wait forever, keeping every
    round's sums); while a member that holds it is left, it waits."""
    job = Job([(0, 0), (2, 1), (3, 2)])
    _, joiner = local_trainer(1)
    taker = handover_of(joiner, FakeNotes(job, (2, 1)), waiting=True)
    taker.notes.count = 1
    taker.keep(joiner._params, 'grads', 0.25, {})
    assert taker.step_ended() is False                  # (0, 0) holds it
    job.members = [(2, 1), (3, 2)]                      # the first worker is lost
    job.blobs[record_name((3, 2))] = HAVE               # but (3, 2) took a handover
    assert taker.step_ended() is False
    job.blobs[record_name((3, 2))] = WANT               # (it had not, in this story)
    with pytest.raises(PeerLostError, match=r'no member holds the weights and optimizer state '
                                            r'.*members now: \[\(2, 1\), \(3, 2\)\]'):
        taker.step_ended()


def test_a_torch_optimizers_trainer_is_refused_in_an_elastic_job():
    """Its state cannot be handed to a joiner: refused when the Trainer starts, saying why."""
    model = torch.nn.Linear(3, 2)
    trainer = kvps.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), kvstore=None)
    with pytest.raises(ConfigError, match='kvps optimizer'):
        handover_of(trainer, FakeNotes(Job([(0, 0)]), (0, 0)), waiting=False)
