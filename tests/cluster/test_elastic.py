"""Elastic jobs through the launcher (docs/elastic.md): rounds complete with the members when
they close, a lost worker's partial round is discarded, joiners count from the next round, and
falling below --min-workers ends the job naming the lost workers."""

import textwrap

# Every worker pushes rank + 1 to key 0 each round, with no optimizer: the value pulled after
# a round is that round's sum over the workers counted in it.
ROUNDS = '''
import signal

def one_round(kv, value):
    kv.push(0, np.full(1, value, np.float32))
    out = np.zeros(1, np.float32)
    kv.pull(0, out=out)
    return float(out[0])

kv = kvps.create('dist_sync')
kv.init(0, np.zeros(1, np.float32))
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
