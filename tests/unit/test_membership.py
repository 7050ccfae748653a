"""Scheduler state: registration, deterministic ranks, barriers, liveness, finishing."""

import numpy as np
import pytest

from kvps.errors import ConfigError
from kvps.scheduler.membership import Membership


def full(hints=(None, None)):
    m = Membership(num_workers=2, num_servers=1)
    m.register(b'w-a', 'worker', 'h', 0, hints[0], 11, now=0)
    m.register(b's', 'server', 'h', 5000, None, 12, now=0)
    m.register(b'w-b', 'worker', 'h', 0, hints[1], 13, now=0)
    return m


def test_ranks_follow_arrival_order_without_hints():
    m = full()
    assert m.complete
    m.assign_ranks()
    assert [m.nodes[i].rank for i in (b'w-a', b'w-b', b's')] == [0, 1, 0]


def test_requested_ranks_are_kept():
    m = full(hints=(1, 0))
    m.assign_ranks()
    assert m.nodes[b'w-a'].rank == 1 and m.nodes[b'w-b'].rank == 0
    welcome = m.welcome(m.nodes[b'w-a'])
    assert welcome['servers'] == [['h', 5000]] and welcome['num_workers'] == 2


def test_the_welcome_counts_the_hosts_of_the_workers_and_servers():
    m = full()
    m.assign_ranks()
    assert m.welcome(m.nodes[b'w-a'])['hosts'] == 1
    m = Membership(num_workers=2, num_servers=2)
    for identity, role, host in [(b'w0', 'worker', 'a'), (b'w1', 'worker', 'b'),
                                 (b's0', 'server', 'a'), (b's1', 'server', 'c')]:
        m.register(identity, role, host, 5000 if role == 'server' else 0, None, 1, now=0)
    m.assign_ranks()
    assert [m.welcome(node)['hosts'] for node in m.nodes.values()] == [3, 3, 3, 3]


@pytest.mark.parametrize('role, hint, match', [
    ('boss', None, 'expected worker or server'),
    # a rank set by hand (KVPS_RANK) is named with what it clashes with
    ('worker', 5, r'KVPS_RANK=5 is out of range: the job has 2 workers \(DMLC_NUM_WORKER\), '
                  r'ranks 0\.\.1'),
    ('worker', 0, r'worker rank 0 is claimed twice: worker 0 \(host h, pid 1, rank from '
                  r'KVPS_RANK=0\) has it, so worker 0 \(host h, pid 2, rank from KVPS_RANK=0\) '
                  r'is refused; give every worker its own rank'),
])
def test_bad_registrations_are_refused(role, hint, match):
    m = Membership(2, 1)
    m.register(b'w0', 'worker', 'h', 0, 0, 1, now=0)
    with pytest.raises(ConfigError, match=match):
        m.register(b'x', role, 'h', 0, hint, 2, now=0)


def test_a_rank_claimed_twice_names_both_claims_and_the_settings_that_gave_them():
    """Whoever reads the refusal (the refused process, the scheduler's log, the reason the
    job ends with) can tell both processes apart and which cluster setting to fix."""
    m = Membership(2, 2)
    m.register(b'w-a', 'worker', 'node-a', 0, 1, 11, 0, rank_from='KVPS_RANK=1')
    m.register(b's-a', 'server', 'node-a', 5000, 1, 21, 0,
               rank_from='DMLC_TASK_ID=3 (less DMLC_NUM_WORKER=2)')
    with pytest.raises(ConfigError) as refused:
        m.register(b'w-b', 'worker', 'node-b', 0, 1, 12, 0, rank_from='DMLC_WORKER_ID=1')
    assert str(refused.value) == (
        'worker rank 1 is claimed twice: worker 1 (host node-a, pid 11, rank from KVPS_RANK=1) '
        'has it, so worker 1 (host node-b, pid 12, rank from DMLC_WORKER_ID=1) is refused; '
        'give every worker its own rank')
    with pytest.raises(ConfigError, match=r'^server rank 1 is claimed twice: server 1 \(host '
                                          r'node-a, pid 21, rank from DMLC_TASK_ID=3 \(less '
                                          r'DMLC_NUM_WORKER=2\)\) has it, so server 1 \(host '
                                          r'node-c, pid 22, rank from JOB_COMPLETION_INDEX=1\)'):
        m.register(b's-b', 'server', 'node-c', 5001, 1, 22, 0, rank_from='JOB_COMPLETION_INDEX=1')
    assert b'w-b' not in m.nodes and b's-b' not in m.nodes
    # the job that then never forms ends naming what is missing and why
    assert m.missing() == (
        '1 of 2 workers and 1 of 2 servers never registered (missing: worker 0, server 0; '
        'registered: worker 1 (host node-a, pid 11), server 1 (host node-a, pid 21); '
        f'refused: {refused.value}; refused: server rank 1 is claimed twice: server 1 (host '
        'node-a, pid 21, rank from DMLC_TASK_ID=3 (less DMLC_NUM_WORKER=2)) has it, so server '
        '1 (host node-c, pid 22, rank from JOB_COMPLETION_INDEX=1) is refused; give every '
        'server its own rank)')
    assert m.label(b'w-a') == 'worker 1 (host node-a, pid 11, rank from KVPS_RANK=1)'


def test_a_rank_whose_holder_fell_silent_before_the_job_formed_goes_to_its_new_claimant():
    """A cluster manager restarts a pod that died while the job formed, with its index: the
    new process takes the rank once the old one has missed its beats (3 s here), not before;
    the job then forms with it, and the old one is told why if it ever speaks again."""
    m = Membership(2, 1, stale_after=3)
    m.register(b'w-old', 'worker', 'pod-1', 0, 1, 11, 0, rank_from='JOB_COMPLETION_INDEX=1',
               beat=1.0)
    m.register(b'w-0', 'worker', 'pod-0', 0, 0, 10, 0)
    m.seen(b'w-0', 3.5)
    with pytest.raises(ConfigError, match='worker rank 1 is claimed twice'):
        m.register(b'w-early', 'worker', 'pod-1', 0, 1, 12, 2.5)   # heard from 2.5 s ago
    stale = m.register(b'w-new', 'worker', 'pod-1', 0, 1, 13, 3.5,
                       rank_from='JOB_COMPLETION_INDEX=1')
    assert stale.pid == 11 and b'w-old' not in m.nodes
    assert m.dropped == {b'w-old': 'worker 1 (host pod-1, pid 13, rank from '
                                   'JOB_COMPLETION_INDEX=1) took its rank after 3.5 s of its '
                                   'silence'}
    m.register(b's', 'server', 'h', 5000, None, 14, 3.6)
    assert m.complete
    m.assign_ranks()
    assert m.nodes[b'w-new'].rank == 1


def test_a_holder_that_beats_slowly_keeps_its_rank_for_three_of_its_own_beats():
    """Three missed beats of the holder's own interval, whatever the scheduler's."""
    m = Membership(2, 1, stale_after=3)
    m.register(b'w-slow', 'worker', 'h', 0, 1, 11, 0, beat=5.0)
    with pytest.raises(ConfigError, match='claimed twice'):
        m.register(b'w-new', 'worker', 'h', 0, 1, 12, 14.0)
    assert m.register(b'w-new', 'worker', 'h', 0, 1, 12, 15.5).pid == 11


def test_a_node_silent_past_the_heartbeat_timeout_leaves_the_forming_job():
    m = Membership(2, 1, stale_after=3)
    m.register(b'w-a', 'worker', 'h', 0, None, 11, 0)
    m.register(b's', 'server', 'h', 5000, None, 12, 0)
    m.seen(b's', 9.0)
    assert m.drop_silent(10.0, 10.5) == [] and len(m.nodes) == 2
    gone = m.drop_silent(10.0, 6.0)
    assert [n.pid for n in gone] == [11] and list(m.nodes) == [b's']
    assert 'nothing heard from it for 10.0 s' in m.dropped[b'w-a']
    m.register(b'w-b', 'worker', 'h', 0, None, 13, 10.0)   # its place is free again
    assert m.count('worker') == 1


def test_a_rank_out_of_range_names_the_setting_that_gave_it():
    with pytest.raises(ConfigError, match=r'^JOB_COMPLETION_INDEX=4 is out of range: the job has '
                                          r'2 servers \(DMLC_NUM_SERVER\), ranks 0\.\.1$'):
        Membership(2, 2).register(b's', 'server', 'h', 1, 4, 1, 0,
                                  rank_from='JOB_COMPLETION_INDEX=4')


def test_the_formed_jobs_table_lists_every_node_by_role_and_rank_with_its_address():
    m = full(hints=(1, None))
    m.assign_ranks()
    assert m.table() == ('server 0 at h:5000 (pid 12), worker 0 at h (pid 13), '
                         'worker 1 at h (pid 11)')
    assert m.label(b'w-b') == 'worker (host h, pid 13)'


def test_a_full_job_refuses_more_nodes():
    m = full()
    with pytest.raises(ConfigError, match='already has its 2 worker'):
        m.register(b'w-c', 'worker', 'h', 0, None, 14, now=0)


def test_settings_every_node_must_share_are_compared_at_registration():
    """A worker alone with another KVPS_BIGARRAY_BOUND places keys where no server has
    them; one alone signing payloads has every message refused as forged."""
    from kvps.config import Config
    m = Membership(num_workers=3, num_servers=1)
    worker = Config.from_env({}).shared_settings('worker')
    m.register(b's', 'server', 'h', 1, None, 10, 0, Config.from_env({}).shared_settings('server'))
    m.register(b'w-a', 'worker', 'h', 0, None, 11, 0, worker)
    with pytest.raises(ConfigError, match=r"KVPS_BIGARRAY_BOUND=1000 here, but "
                                          r"KVPS_BIGARRAY_BOUND=1000000 on the worker pid 11"):
        m.register(b'w-b', 'worker', 'h', 0, None, 12, 0, {**worker, 'KVPS_BIGARRAY_BOUND': 1000})
    with pytest.raises(ConfigError, match='KVPS_AUTH_PAYLOAD=True here.*server pid 10'):
        m.register(b'w-c', 'worker', 'h', 0, None, 13, 0, {**worker, 'KVPS_AUTH_PAYLOAD': True})
    m.register(b'w-d', 'worker', 'h', 0, None, 14, 0, worker)
    assert m.count('worker') == 2


def test_a_node_whose_job_size_differs_from_the_schedulers_is_refused():
    """A node started by hand with another DMLC_NUM_WORKER / DMLC_NUM_SERVER is told so at
    once, not a connect timeout later as a node that 'never registered'."""
    from kvps.config import Config
    m = Membership(num_workers=2, num_servers=1)
    sized = {'DMLC_NUM_WORKER': '2', 'DMLC_NUM_SERVER': '1'}
    for role, wrong, match in [('worker', {'DMLC_NUM_WORKER': '1'},
                                'DMLC_NUM_WORKER=1 here, but DMLC_NUM_WORKER=2 on the scheduler'),
                               ('server', {'KVPS_NUM_SERVERS': '3'},
                                'DMLC_NUM_SERVER=3 here, but DMLC_NUM_SERVER=1 on the scheduler')]:
        shared = Config.from_env({**sized, **wrong}).shared_settings(role)
        with pytest.raises(ConfigError, match=match):
            m.register(b'x', role, 'h', 0, None, 1, 0, shared)
    m.register(b's', 'server', 'h', 1, None, 2, 0, Config.from_env(sized).shared_settings('server'))
    assert m.count('server') == 1 and m.count('worker') == 0


def test_missing_names_what_never_came():
    m = Membership(3, 2)
    m.register(b'w0', 'worker', 'h', 0, None, 1, now=0)
    # the missing workers would take their ranks in arrival order: only the count is known
    assert m.missing() == ('2 of 3 workers and 2 of 2 servers never registered (missing: '
                           'server 0, server 1; registered: worker (host h, pid 1))')
    assert Membership(1, 1).missing() == ('1 of 1 workers and 1 of 1 servers never registered '
                                          '(missing: worker 0, server 0; registered: none)')


def test_missing_names_the_ranks_that_never_came_when_nodes_ask_for_ranks():
    # a launcher gives every node its rank: the scheduler can tell which one is missing
    m = Membership(3, 1)
    m.register(b'w2', 'worker', 'h', 0, 2, 7, now=0)
    m.register(b's0', 'server', 'g', 5000, 0, 8, now=0)
    m.register(b'w0', 'worker', 'h', 0, 0, 9, now=0)
    assert m.missing_ranks() == [('worker', 1)]
    assert m.missing() == ('1 of 3 workers never registered (missing: worker 1; registered: '
                           'worker 2 (host h, pid 7), server 0 (host g, pid 8), '
                           'worker 0 (host h, pid 9))')
    assert m.complete is False and Membership(2, 1).complete is False


def test_a_big_jobs_missing_list_is_bounded():
    text = Membership(50, 1).missing()
    assert text.endswith('(missing: ' + ', '.join(f'worker {r}' for r in range(20))
                         + ', and 31 more; registered: none)')


def test_barrier_releases_everyone_once_all_arrive():
    m = full()
    m.assign_ranks()
    assert m.arrive(b'w-a', 1) == []
    assert m.arrive(b'w-b', 1) == [(1, [b'w-a', b'w-b'], [], {})]
    assert m.arrive(b'w-a', 2) == []


def test_a_barrier_with_digests_names_the_ranks_that_differ_from_rank_0():
    m = full()
    m.assign_ranks()
    assert m.arrive(b'w-b', 1, b'other') == []
    rank_of_b = m.nodes[b'w-b'].rank
    assert m.arrive(b'w-a', 1, b'same') == [(1, [b'w-a', b'w-b'], [rank_of_b], {})]
    assert m.disagreeing() == [rank_of_b]
    m.arrive(b'w-a', 2, b'x')
    m.arrive(b'w-b', 2, b'x')
    assert m.disagreeing() == []


def test_a_barrier_with_values_answers_their_sum_or_why_there_is_none():
    """all_sum: the scheduler adds what every worker brought (float64), the same bytes to
    all; workers that met there with different calls get why instead."""
    m = full()
    m.assign_ranks()
    f8 = lambda *v: np.array(v, '<f8').tobytes()   # noqa: E731
    assert m.arrive(b'w-a', 1, values=f8(1, 0.5)) == []
    (_, _, _, fields), = m.arrive(b'w-b', 1, values=f8(2, 0.25))
    assert np.frombuffer(fields['sum'], '<f8').tolist() == [3, 0.75]
    m.arrive(b'w-a', 2, values=f8(1))
    (_, _, _, fields), = m.arrive(b'w-b', 2)                  # a plain barrier there
    assert 'different calls' in fields['sum_error'] and 'sum' not in fields
    m.arrive(b'w-a', 3, values=f8(1))
    (_, _, _, fields), = m.arrive(b'w-b', 3, values=f8(1, 2))
    assert 'different lengths' in fields['sum_error']


def test_workers_meeting_from_different_calls_are_all_told_so():
    """One worker's init met another's barrier: each would go on out of step with the
    other, so every one of them is answered why instead."""
    m = running()
    assert m.arrive(b'w-a', 1, call='init') == []
    (_, workers, _, fields), = m.arrive(b'w-b', 1, call='barrier')
    assert workers == [b'w-a', b'w-b'] and fields == {'mismatch': (
        'the workers met at barrier 1 from different calls (rank 0 in init, rank 1 in '
        'barrier): collective calls (init, set_optimizer, barrier, agree, all_sum, optimizer '
        'states) must come in the same order on every worker')}
    m.arrive(b'w-a', 2, call='init')
    assert m.arrive(b'w-b', 2, call='init') == [(2, [b'w-a', b'w-b'], [], {})]


def test_finished_worker_blocks_barriers_and_liveness_skips_it():
    m = full()
    m.assign_ranks()
    m.arrive(b'w-a', 1)
    m.finish(b'w-b')
    waiting, finished = m.blocked_barriers()
    assert waiting == [(b'w-a', 1)] and finished.identity == b'w-b'
    m.seen(b'w-a', 10)
    m.seen(b's', 10)
    assert m.silent(now=12, timeout=5) == []
    assert [n.identity for n in m.silent(now=16, timeout=5)] == [b'w-a', b's']
    assert not m.all_workers_finished
    m.finish(b'w-a')
    assert m.all_workers_finished


def test_rank_of_the_wrong_type_is_refused():
    with pytest.raises(ConfigError, match='out of range'):
        Membership(1, 1).register(b'w', 'worker', 'h', 0, 'x', 1, now=0)


def test_only_the_next_barrier_can_be_waited_at():
    m = full()
    m.assign_ranks()
    with pytest.raises(ConfigError, match='out of step'):
        m.arrive(b'w-a', 2)
    m.arrive(b'w-a', 1)
    m.arrive(b'w-b', 1)
    with pytest.raises(ConfigError, match='out of step'):
        m.arrive(b'w-a', 1)            # a replayed or stale barrier
    assert m.arrive(b'w-a', 2) == []


def running():
    m = full()
    m.assign_ranks()
    return m


def test_a_server_rejoins_with_its_rank_and_replaces_the_old_one():
    m = running()
    node, old = m.replace(b's2', 'server', 'h2', 6000, 0, 99, now=5)
    assert old.identity == b's' and b's' not in m.nodes and b's' in m.replaced
    assert node.rank == 0 and m.welcome(node)['servers'] == [['h2', 6000]]


def test_a_rank_counts_as_checkpointed_once_any_of_its_servers_wrote_its_file():
    m = running()
    assert not m.nodes[b's'].checkpointed
    m.nodes[b's'].checkpointed = True   # (its heartbeat said so)
    first, _ = m.replace(b's2', 'server', 'h2', 6000, 0, 99, now=5)
    second, _ = m.replace(b's3', 'server', 'h3', 6000, 0, 99, now=6)   # lost as it joined
    assert first.checkpointed and second.checkpointed


def test_a_lost_server_is_awaited_not_lost_again_and_its_rank_is_taken_by_default():
    m = running()
    m.nodes[b's'].lost_since = 40
    assert b's' not in [n.identity for n in m.silent(now=41, timeout=30)]
    assert m.overdue(now=45, timeout=10) == []
    assert [n.rank for n in m.overdue(now=51, timeout=10)] == [0]
    node, _ = m.replace(b's2', 'server', 'h', 6000, None, 99, now=42)
    assert node.rank == 0 and node.lost_since is None


@pytest.mark.parametrize('role, hint, match', [
    ('worker', None, 'only a server can rejoin'),
    ('server', 3, 'out of range'),
    ('server', None, '0 servers are lost'),
])
def test_bad_rejoins_are_refused(role, hint, match):
    with pytest.raises(ConfigError, match=match):
        running().replace(b'x', role, 'h', 1, hint, 1, now=1)


@pytest.mark.parametrize('said, kept', [(5.0, 5.0), (2, 2.0), (None, 0.5), ('1', 0.5),
                                        (True, 0.5), (0, 0.5), (-1.0, 0.5), (1e9, 0.5)])
def test_the_scheduler_takes_a_nodes_heartbeat_interval_only_when_it_is_a_sane_number(said, kept):
    from types import SimpleNamespace

    from kvps.scheduler.loop import _beat
    assert _beat({'beat': said}, SimpleNamespace(heartbeat_interval=0.5)) == kept
