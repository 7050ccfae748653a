"""Elastic jobs through the launcher (docs/elastic.md): rounds complete with the members when
they close, a lost worker's partial round is discarded, joiners count from the next round, and
falling below --min-workers ends the job naming the lost workers."""

import json
import textwrap

from conftest import ELASTIC_ROUNDS

# Every worker pushes rank + 1 to key 0 each round, with no optimizer: the value pulled after
# a round is that round's sum over the workers counted in it.
ROUNDS = ELASTIC_ROUNDS + '''
changes = []
kv.on_membership_change(lambda n, ranks: changes.append([n, ranks]))
'''


def test_a_worker_killed_mid_round_is_discarded_and_the_survivors_go_on(job):
    """Worker 3 pushes round KILL_AT and kills itself; the others push that round once they
    know it is lost. The round is either complete with worker 3 (10: the server closed it
    before it learned of the loss) or its push is taken out (6), never partial; the server
    says which. Every other round is the sum over its members, and the survivors agree."""
    script = ROUNDS + textwrap.dedent('''
    KILL_AT, TOTAL = 3, 8
    deltas = []
    for step in range(TOTAL):
        if step == KILL_AT:
            if kv.rank == 3:
                kv.push(0, np.full(1, 4, np.float32))
                time.sleep(0.5)            # (its push reaches the server first)
                os.kill(os.getpid(), signal.SIGKILL)
            while kv.num_workers == 4:
                time.sleep(0.05)
        deltas.append(one_round(kv, kv.rank + 1))
    report(deltas=deltas, workers=kv.num_workers, changes=changes)
    ''')
    result = job(script, workers=4, servers=1, launcher_args=['--min-workers', '2'],
                 ends_when='the survivors finish their rounds')
    assert result.returncode == 0, result.output
    assert 'worker 3' in result.stderr and 'goes on without it' in result.stderr
    taken_out = 'worker-3 left the job: its pushes to 1 open round(s) were taken out'
    at_loss = 6.0 if taken_out in result.output else 10.0
    want = {'deltas': [10.0] * 3 + [at_loss] + [6.0] * 4, 'workers': 3,
            'changes': [[3, [0, 1, 2]]]}
    assert result.results() == {0: want, 1: want, 2: want}, result.output


def test_a_worker_frozen_past_the_heartbeat_timeout_learns_it_was_taken_for_lost(job):
    """Worker 2 stops itself (SIGSTOP: a suspended process, a paused VM) for longer than the
    heartbeat timeout; the job goes on without it, and worker 0 wakes it once it has. The
    woken worker's next call says it was taken for lost, where it blamed the scheduler's
    silence, which was its own."""
    script = ROUNDS + textwrap.dedent('''
    if kv.rank == 2:
        one_round(kv, 3)
        os.kill(os.getpid(), signal.SIGSTOP)
        try:
            while True:
                one_round(kv, 3)
        except kvps.KVPSError as exc:
            report(error=f'{type(exc).__name__}: {exc}')
    else:
        one_round(kv, kv.rank + 1)
        while kv.num_workers == 3:
            time.sleep(0.05)
        pid = next(n['pid'] for n in kv._backend.io.welcome['nodes']
                   if n['role'] == 'worker' and n['rank'] == 2)
        if kv.rank == 0:
            os.kill(pid, signal.SIGCONT)
        report(delta=one_round(kv, kv.rank + 1), changes=changes)
    ''')
    result = job(script, workers=3, servers=1, launcher_args=['--min-workers', '2'],
                 env={'KVPS_HEARTBEAT_TIMEOUT': '2'}, ends_when='worker 2 wakes and fails')
    assert result.returncode == 0, result.output
    reports = result.results()
    want = {'delta': 3.0, 'changes': [[2, [0, 1]]]}
    assert reports[0] == reports[1] == want, result.output
    assert 'took it for lost' in reports[2]['error'], reports[2]
    assert 'worker 2' in result.output and 'did not run for' in result.output


def test_a_worker_that_joins_counts_in_the_next_rounds_and_only_in_them(job):
    """Rank 0 starts a fifth worker by hand (the job's contract, no rank) at round 3; it gets
    rank 4, pushes 5 for 5 rounds and leaves. Every round is 10 (the four) or 15 (with it),
    its 5 rounds are the only 15s, and everyone agrees on every round."""
    script = ROUNDS + textwrap.dedent('''
    import subprocess
    if os.environ.get('JOINER'):
        deltas = [one_round(kv, kv.rank + 1) for _ in range(5)]
        print('JOINED', json.dumps({'rank': kv.rank, 'deltas': deltas,
                                    'workers': kv.num_workers}), flush=True)
        kv.close()
        sys.exit(0)
    deltas, joiner = [], None
    for step in range(3000):
        if step == 3 and kv.rank == 0:
            env = {k: v for k, v in os.environ.items() if k != 'KVPS_RANK'}
            joiner = subprocess.Popen([sys.executable, sys.argv[0]], env={**env, 'JOINER': '1'})
        deltas.append(one_round(kv, kv.rank + 1))
        if deltas.count(15.0) == 5 and deltas[-1] == 10.0:
            break
        time.sleep(0.02)
    if joiner is not None:
        joiner.wait(60)
    report(deltas=deltas, changes=changes)
    ''')
    result = job(script, workers=4, servers=1,
                 launcher_args=['--min-workers', '2', '--max-workers', '5'],
                 ends_when='the joiner has pushed 5 rounds and left')
    assert result.returncode == 0, result.output
    joined = json.loads(result.stdout.split('JOINED ', 1)[1].split('\n', 1)[0])
    assert joined == {'rank': 4, 'deltas': [15.0] * 5, 'workers': 5}, result.output
    results = result.results()
    deltas = results[0]['deltas']
    first = deltas.index(15.0)
    assert deltas == [10.0] * first + [15.0] * 5 + [10.0], deltas
    assert first >= 3
    for rank in range(4):
        assert results[rank] == {'deltas': deltas, 'changes': [[5, [0, 1, 2, 3, 4]],
                                                               [4, [0, 1, 2, 3]]]}, result.output


def test_falling_below_the_minimum_ends_the_job_naming_the_lost_workers(job):
    script = ROUNDS + textwrap.dedent('''
    one_round(kv, 1)
    if kv.rank in (1, 2):
        os.kill(os.getpid(), signal.SIGKILL)
    for step in range(100):
        one_round(kv, 1)
    ''')
    result = job(script, workers=3, servers=1, launcher_args=['--min-workers', '2'],
                 ends_when='two of three workers are lost')
    assert result.returncode != 0
    assert 'fewer than its minimum of 2 (KVPS_MIN_WORKERS)' in result.output, result.output
    assert 'PeerLostError' in result.output
    lost = result.output.split('(KVPS_MIN_WORKERS); lost: ', 1)[1].split('\n', 1)[0]
    assert 'worker 1 (' in lost and 'worker 2 (' in lost, lost
