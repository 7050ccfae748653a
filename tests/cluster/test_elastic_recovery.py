"""Elastic jobs through the launcher, harder cases (docs/elastic.md): a worker lost and a server
restarted from its checkpoint in one job; repeated kills and joins with --restart-workers,
whose final weights equal a replay of the rounds' recorded members."""

import json
import textwrap
from pathlib import Path

from conftest import ELASTIC_ROUNDS

# Every worker pushes a value to key 0 each round; the servers' optimizer 'test' adds each
# round's sum to the weight (w += sum), so the pulled weights tell every round's sum.
ROUNDS = ELASTIC_ROUNDS + '''
from kvps.optimizer import create as optimizer
kv.set_optimizer(optimizer('test'))
'''


def test_a_lost_worker_and_a_restarted_server_in_one_job(job, tmp_path):
    """Worker 2 is killed in round 3 (its push is in that round, or taken out: 6 or 3, never
    partial); rank 0 kills the server after its push of round 7, and the launcher restarts
    it from its checkpoint (every update in it): no round is lost or applied twice."""
    script = ROUNDS + textwrap.dedent('''
    KILL_WORKER, KILL_SERVER, TOTAL = 3, 7, 12
    weights = []
    for step in range(TOTAL):
        if step == KILL_WORKER:
            if kv.rank == 2:
                kv.push(0, np.full(1, 3, np.float32))
                time.sleep(0.5)
                os.kill(os.getpid(), signal.SIGKILL)
            while kv.num_workers == 3:
                time.sleep(0.05)
        if step == KILL_SERVER and kv.rank == 0:
            kv.push(0, np.full(1, 1, np.float32))
            pid = next(n['pid'] for n in kv._backend.io.welcome['nodes'] if n['role'] == 'server')
            os.kill(pid, signal.SIGKILL)
            out = np.zeros(1, np.float32)
            kv.pull(0, out=out)
            weights.append(float(out[0]))
            continue
        weights.append(one_round(kv, kv.rank + 1))
    report(weights=weights, workers=kv.num_workers)
    ''')
    env = {'KVPS_CHECKPOINT_EVERY': '1', 'KVPS_CHECKPOINT_DIR': str(tmp_path / 'ckpt')}
    result = job(script, workers=3, servers=1, env=env,
                 launcher_args=['--min-workers', '2', '--restart-servers', '1'],
                 ends_when='the survivors finish their rounds after the server is back')
    assert result.returncode == 0, result.output
    assert 'rejoined' in result.output and 'goes on without it' in result.stderr
    at_loss = 3.0 if 'its pushes to 1 open round(s) were taken out' in result.output else 6.0
    deltas = [6.0] * 3 + [at_loss] + [3.0] * 8
    want = {'weights': [sum(deltas[:i + 1]) for i in range(12)], 'workers': 2}
    assert result.results() == {0: want, 1: want}, result.output


def test_repeated_kills_and_joins_end_in_the_weights_their_rounds_replay_to(job):
    """Ranks 1 and 2 kill themselves mid-round (rounds 3 and 6); the launcher restarts each
    (--restart-workers), and each new member pushes 5 rounds and leaves. Every member prints
    the weight after each of its rounds: sorted, they are the job's rounds, and the members of
    a round are those who saw its weight. Each round's sum must be its members' values (plus
    a killed member's, if its push made it into its last round before the loss was known),
    and the final weight the replay of those sums."""
    script = ROUNDS + textwrap.dedent('''
    incarnation = kv._backend.io.welcome.get('incarnation', 0)
    value = kv.rank + 1 + (10 if incarnation else 0)
    changes = []
    kv.on_membership_change(lambda n, ranks: changes.append(n))

    def note(weight):
        print('ROUND', json.dumps([kv.rank, incarnation, value, weight]), flush=True)

    KILL_AT = {1: 3, 2: 6}
    for step in range(3000):
        if not incarnation and step == KILL_AT.get(kv.rank):
            kv.push(0, np.full(1, value, np.float32))
            time.sleep(0.3)
            os.kill(os.getpid(), signal.SIGKILL)
        note(one_round(kv, value))
        if incarnation and step == 4:
            break
        if kv.rank == 0 and len(changes) >= 6 and kv.num_workers == 1:
            break
        time.sleep(0.02)
    kv.close()
    ''')
    result = job(script, workers=3, servers=1, env={'KVPS_HEARTBEAT_TIMEOUT': '3'},
                 launcher_args=['--min-workers', '2', '--restart-workers', '2'], timeout=180,
                 ends_when='both restarted workers have pushed 5 rounds and left')
    assert result.returncode == 0, result.output
    seen = {}     # weight after a round -> the (rank, incarnation, value) who saw it
    last = {}     # (rank, incarnation) -> the last weight it saw
    for line in result.stdout.splitlines():
        if '] ROUND ' in line:
            rank, incarnation, value, weight = json.loads(line.split('] ROUND ', 1)[1])
            seen.setdefault(weight, set()).add((rank, incarnation, value))
            last[rank, incarnation] = weight
    restarted = {who for who in last if who[1]}
    assert {rank for rank, _ in restarted} == {1, 2}, result.output
    killed = {1: 2.0, 2: 3.0}   # value of each killed founder
    replay = before = 0.0
    for weight in sorted(seen):
        members = sum(value for _, _, value in seen[weight])
        delta = weight - before
        late = [members + killed[r] for r in killed if last.get((r, 0)) == before]
        assert delta == members or delta in late, (weight, seen)   # never a partial sum
        replay += delta if delta in late else members   # the round's members, replayed
        before = weight
    assert replay == last[0, 0], result.output


DIGITS = Path(__file__).resolve().parents[2] / 'examples' / 'train_digits.py'


def test_the_digits_example_reaches_its_accuracy_with_a_worker_killed_halfway(job):
    """examples/train_digits.py, 4 workers in an elastic job: worker 3 is killed at step 42
    of 84; the Trainer goes on with 3 (its rounds scaled to the job's 4 by the servers) and
    every survivor ends with the same weights, at >= 90% test accuracy."""
    result = job(f'''
        import runpy, signal
        sys.argv = ['train_digits.py', '--epochs', '4']
        step, made = kvps.Trainer.step, [0]
        def killing_step(self, batch_size, *args, **kwargs):
            made[0] += 1
            if self.kvstore.rank == 3 and made[0] == 42:
                os.kill(os.getpid(), signal.SIGKILL)
            return step(self, batch_size, *args, **kwargs)
        kvps.Trainer.step = killing_step
        try:
            runpy.run_path({str(DIGITS)!r}, run_name='__main__')
        except SystemExit as exc:
            assert not exc.code, exc.code
    ''', workers=4, servers=1, env={'KVPS_HEARTBEAT_TIMEOUT': '3'},
                 launcher_args=['--min-workers', '2'], timeout=150,
                 ends_when='the three survivors finish 4 epochs')
    assert result.returncode == 0, result.output
    accuracies = {line.split('rank ')[1].split(':')[0]: line.split('test accuracy ')[1].split()[0]
                  for line in result.stdout.splitlines() if 'test accuracy' in line}
    assert sorted(accuracies) == ['0', '1', '2'], result.output
    assert len(set(accuracies.values())) == 1, accuracies      # the same weights everywhere
    assert float(accuracies['0']) >= 0.90, result.output
