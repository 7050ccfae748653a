"""An elastic Sampler's claim ledger (kvps.server.ledger): positions dealt in order, kept once
the claimer's round closes with its push, given back when it is lost or abstains before that,
and the epoch's end, the same round for every member; kvps.elastic.Sampler on a store."""

import numpy as np
import pytest

import kvps
from kvps.elastic import Sampler, epoch_order
from kvps.errors import ConfigError, KeyNotInitializedError
from kvps.server import ledger, members
from kvps.server.shard import Shard
from kvps.wire import protocol as P

W0, W1, W2 = b'worker-0', b'worker-1', b'worker-2'


def buf(*values):
    return memoryview(np.array(values, dtype=np.float32)).cast('B')


def shard_of(workers):
    shard = Shard(workers, elastic=True)
    shard.init('t', 'k', 0, 'float32', [1], True, buf(0))
    return shard


def claim(shard, worker, count=2, size=7, epoch=0, token=None):
    """The answer ({positions, end}) of ``worker``'s claim for its next push, or None."""
    header = {'key': 'k', 'part': 0, 'epoch': epoch, 'size': size, 'count': count,
              'round': shard.entries['k', 0].pushed.get(worker, 0)}
    replies = ledger.claim(shard, token or worker, worker, header)
    return replies[0].payload if replies else None


def push(shard, worker):
    return shard.push(worker, worker, 'k', 0, 'float32', True, buf(1))


def answered(replies):
    return {r.token: r.payload for r in replies if isinstance(r.payload, dict)}


def test_claims_deal_the_order_and_the_epoch_ends_for_everyone_at_one_round():
    """7 samples, 2 per claim, 2 workers: rounds 0 and 1 deal 4 each; in round 1 the last
    claimer gets 1 sample... round 2 gets nothing and ends the epoch for both."""
    shard = shard_of(2)
    assert claim(shard, W0) == {'positions': [0, 1], 'end': False}
    assert claim(shard, W1) == {'positions': [2, 3], 'end': False}
    push(shard, W0), push(shard, W1)
    assert claim(shard, W1) == {'positions': [4, 5], 'end': False}
    assert claim(shard, W0) == {'positions': [6], 'end': False}
    push(shard, W0), push(shard, W1)
    assert claim(shard, W0) == {'positions': [], 'end': True}
    assert claim(shard, W1) == {'positions': [], 'end': True}


def test_a_claimer_that_finds_nothing_left_in_a_round_others_got_positions_for_steps_empty():
    shard = shard_of(2)
    assert claim(shard, W0, count=7) == {'positions': list(range(7)), 'end': False}
    assert claim(shard, W1) == {'positions': [], 'end': False}    # (round 0: it steps)


def test_a_lost_claimers_positions_go_back_and_are_dealt_first():
    shard = shard_of(3)
    claim(shard, W0), claim(shard, W1), claim(shard, W2)     # 0-1, 2-3, 4-5
    push(shard, W0), push(shard, W1)
    replies, _ = members.change(shard, [W2], [])              # lost before its push
    assert sorted(r.token for r in replies) == [W0, W1]       # the round closed without it
    assert claim(shard, W1) == {'positions': [4, 5], 'end': False}
    assert claim(shard, W0) == {'positions': [6], 'end': False}


def test_a_claim_whose_round_closed_with_the_claimers_push_stays_when_it_is_lost_after():
    shard = shard_of(2)
    claim(shard, W0, size=4), claim(shard, W1, size=4)
    push(shard, W0), push(shard, W1)                          # round 0 closed: both kept
    members.change(shard, [W1], [])
    assert claim(shard, W0, size=4) == {'positions': [], 'end': True}


def test_a_lost_claimer_whose_push_was_taken_out_of_the_open_round_gives_its_claim_back():
    shard = shard_of(3)
    claim(shard, W0, size=6), claim(shard, W1, size=6), claim(shard, W2, size=6)
    push(shard, W0), push(shard, W2)                          # W1's is still to come
    members.change(shard, [W2], [])                           # W2's push is taken out
    push(shard, W1)
    assert claim(shard, W0, size=6) == {'positions': [4, 5], 'end': False}


def test_an_abstainers_claim_of_that_round_goes_back():
    shard = shard_of(2)
    claim(shard, W0, size=4), claim(shard, W1, size=4)        # 0-1, 2-3
    shard.push('j', W1, 'k', 0, P.NOTHING, True, memoryview(b''))
    push(shard, W0)
    assert claim(shard, W0, size=4) == {'positions': [2, 3], 'end': False}


def test_at_the_epochs_end_a_claim_waits_for_earlier_rounds_that_may_give_positions_back():
    """W0 is a round ahead with nothing left; W1's round-0 claim may still come back (it has
    not pushed): W0's claim waits, and when W1 is lost it gets W1's positions."""
    shard = shard_of(3)
    claim(shard, W0, count=2, size=4), claim(shard, W1, count=2, size=4)
    assert claim(shard, W2, count=2, size=4) == {'positions': [], 'end': False}
    push(shard, W0)
    assert claim(shard, W0, count=2, size=4) is None           # it waits
    push(shard, W2)
    replies, _ = members.change(shard, [W1], [])
    assert answered(replies) == {W0: {'positions': [2, 3], 'end': False}}


def test_a_waiting_claim_is_answered_once_the_earlier_round_closes_with_every_push():
    shard = shard_of(2)
    claim(shard, W0, count=2, size=4), claim(shard, W1, count=2, size=4)
    push(shard, W0)
    assert claim(shard, W0, count=2, size=4) is None
    replies = push(shard, W1)
    assert answered(replies) == {W0: {'positions': [], 'end': True}}


def test_claims_of_a_new_epoch_start_a_new_deal_and_old_epochs_are_let_go():
    shard = shard_of(1)
    for epoch in range(4):
        assert claim(shard, W0, count=3, size=3, epoch=epoch)['positions'] == [0, 1, 2]
    assert sorted(shard.entries['k', 0].claims.ledgers) == [2, 3]


def test_bad_claims_are_refused_with_their_reason():
    shard = shard_of(1)
    with pytest.raises(ConfigError, match='a claim asks for 1 to 65536 positions'):
        claim(shard, W0, count=0)
    claim(shard, W0, size=7)
    with pytest.raises(ConfigError, match='epoch 0 is of 7 samples; a claim says 8'):
        claim(shard, W0, size=8)
    with pytest.raises(KeyNotInitializedError, match="key 'x' is not initialized here"):
        ledger.claim(shard, 't', W0, {'key': 'x', 'part': 0, 'epoch': 0, 'size': 1,
                                      'count': 1, 'round': 0})
    shard.init('t', 'a', 0, 'float32', [1], False, buf(0))
    with pytest.raises(ConfigError, match="key 'a' is async"):
        ledger.claim(shard, 't', W0, {'key': 'a', 'part': 0, 'epoch': 0, 'size': 1,
                                      'count': 1, 'round': 0})


def test_a_claim_is_a_valid_message():
    header = {'op': P.CLAIM, 'id': 1, 'key': 3, 'part': 0, 'epoch': 2, 'size': 10,
              'count': 4, 'round': 7}
    assert P.decode(P.encode(header))[0] == header
    with pytest.raises(kvps.errors.ProtocolError, match="claim: field 'round' missing"):
        P.decode(P.encode({**header, 'round': None}))


def test_a_sampler_on_a_local_store_deals_the_epoch_once_in_its_order():
    kv = kvps.create('local')
    kv.init(0, np.zeros(1, np.float32))
    seen = []
    for batch in Sampler(kv, 10, epoch=3, batch_size=4, key=0):
        seen.append(batch.tolist())
        kv.push(0, np.ones(1, np.float32))
    order = epoch_order(10, 3).tolist()
    assert seen == [order[0:4], order[4:8], order[8:10]]


@pytest.mark.parametrize('args, message', [
    ((-1, 0, 4), 'dataset_len must be an int >= 0, got -1'),
    ((10, 0, 0), 'batch_size must be an int >= 1, got 0'),
    ((10, 1.5, 4), 'epoch must be an int >= 0, got 1.5'),
    ((10, 0, True), 'batch_size must be an int >= 1, got True')])
def test_a_sampler_refuses_bad_arguments(args, message):
    with pytest.raises(ValueError, match=message):
        Sampler(None, *args, key=0)


def test_a_trainers_round_key_is_pushed_at_every_step_and_ties_a_sampler():
    import torch
    model = torch.nn.Linear(3, 2)
    kv = kvps.create('local')
    trainer = kvps.Trainer(model.parameters(), 'sgd', {'learning_rate': 0.1}, kvstore=kv)
    assert trainer.round_key == 0              # the weight's (a local store fuses nothing)
    data = torch.ones(6, 3)
    steps = 0
    for batch in Sampler(kv, 6, epoch=0, batch_size=4, key=trainer.round_key):
        model(data[torch.from_numpy(batch)]).sum().backward()
        trainer.step(len(batch))
        steps += 1
    assert steps == 2
    model.weight.requires_grad_(False)
    model.bias.requires_grad_(False)
    with pytest.raises(ValueError, match='round_key: this Trainer pushes nothing'):
        trainer.round_key
