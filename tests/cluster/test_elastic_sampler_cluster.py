"""kvps.elastic.Sampler through the launcher: a worker joins and another is killed mid-epoch,
or a joiner's Trainer abstains while it waits for a member's state, and every sample of the
epoch has its gradient applied exactly once (docs/elastic.md)."""

import json
import textwrap

SIZE, BATCH = 120, 3

# How every script starts: rank 0 starts one more process at step 2, which joins the running job
# with the same script (JOINER set), and every member waits at step 4 until it is in.
JOINING = '''
import subprocess

JOINER = bool(os.environ.get('JOINER'))


def join_midway(kv, step, members, joiner):
    if not JOINER and step == 2 and kv.rank == 0:
        env = {k: v for k, v in os.environ.items() if k != 'KVPS_RANK'}
        return subprocess.Popen([sys.executable, sys.argv[0]], env={**env, 'JOINER': '1'})
    if not JOINER and step == 4:
        while kv.num_workers < members:
            time.sleep(0.05)
    return joiner
'''

# How every script ends: the joiner prints its line (the launcher did not start it), the
# others report theirs once the joiner they started has ended.
REPORT = '''
if JOINER:
    print('JOINED', line, flush=True)
    kv.close()
else:
    if joiner is not None:
        joiner.wait(60)
    report(**json.loads(line))
'''


def one_epoch(job, script, workers):
    """Run ``script`` (SIZE and BATCH set) with ``workers`` workers and room for a joiner
    until the epoch is over; returns the job's result, the joiner's payload, and {rank:
    payload} of every worker, the joiner included."""
    result = job(f'SIZE, BATCH = {SIZE}, {BATCH}\n' + textwrap.dedent(script), workers=workers,
                 servers=1, launcher_args=['--min-workers', '2', '--max-workers',
                                           str(workers + 1)],
                 ends_when='the epoch is over for every member')
    assert result.returncode == 0, result.output
    joined = json.loads(result.stdout.split('JOINED ', 1)[1].split('\n', 1)[0])
    return result, joined, {**result.results(), joined['rank']: joined}


# Each worker pushes, per batch, a one at each of its samples into key 0; the servers'
# optimizer 'test' adds each round's sum to the weight, so the weight counts, per sample, how
# many times its gradient was applied.
SCRIPT = JOINING + '''
import signal
from kvps.elastic import Sampler
from kvps.optimizer import create as optimizer

kv = kvps.create('dist_sync')
kv.init(0, np.zeros(SIZE, np.float32))
kv.set_optimizer(optimizer('test'))
joiner, batches, out = None, [], np.zeros(SIZE, np.float32)
for step, batch in enumerate(Sampler(kv, SIZE, epoch=0, batch_size=BATCH, key=0)):
    joiner = join_midway(kv, step, 5, joiner)
    if not JOINER and step == 6 and kv.rank == 3:   # lost with a claim and no push
        os.kill(os.getpid(), signal.SIGKILL)
    grad = np.zeros(SIZE, np.float32)
    grad[batch] = 1
    kv.push(0, grad)
    kv.pull(0, out=out)
    batches.append(batch.tolist())
    time.sleep(0.05)
line = json.dumps({'rank': kv.rank, 'counts': out.tolist(), 'batches': batches,
                   'rounds': kv.notes.rounds()})
''' + REPORT


def test_every_sample_is_applied_once_whoever_is_lost_or_joins(job):
    result, joined, workers = one_epoch(job, SCRIPT, 4)
    assert 'worker 3' in result.stderr and 'goes on without it' in result.stderr
    assert sorted(workers) == [0, 1, 2, 4], result.output
    for rank, worker in workers.items():
        assert worker['counts'] == [1.0] * SIZE, f'worker {rank}: {worker["counts"]}'
        assert worker['rounds'] == workers[0]['rounds'], f'worker {rank} ended elsewhere'
    assert any(joined['batches']), joined        # the joiner had samples of its own
    # the survivors' and the joiner's batches, and the lost worker's first 6, are the epoch
    dealt = [s for w in workers.values() for batch in w['batches'] for s in batch]
    assert len(dealt) == len(set(dealt)) and len(dealt) <= SIZE


# A Trainer that updates on the workers: a joiner abstains from its first rounds (waiting for
# a member's state), and the batches it claimed for them are dealt again.
WITH_TRAINER = JOINING + '''
import torch
from kvps.elastic import Sampler

weights = torch.nn.Parameter(torch.zeros(SIZE))
kv = kvps.create('dist_sync')
trainer = kvps.Trainer([weights], 'sgd', {'learning_rate': 0.1}, kvstore=kv,
                       update_on_kvstore=False)
joiner, applied = None, []
for step, batch in enumerate(Sampler(kv, SIZE, 0, BATCH, trainer.round_key)):
    joiner = join_midway(kv, step, 4, joiner)
    weights[torch.from_numpy(batch)].sum().backward()
    if not trainer.joining:
        applied.append(batch.tolist())
    trainer.step(BATCH * kv.num_workers)
    trainer.zero_grad()
    time.sleep(0.05)
line = json.dumps({'rank': kv.rank, 'applied': applied, 'replayed': trainer._handover.replayed,
                   'weights': weights.detach().numpy().tobytes().hex()})
''' + REPORT


def test_a_joiners_batches_of_the_rounds_it_abstains_from_are_dealt_again(job):
    result, joined, workers = one_epoch(job, WITH_TRAINER, 3)
    assert sorted(workers) == [0, 1, 2, 3], result.output
    assert joined['replayed'] is not None and any(joined['applied']), joined
    applied = sorted(s for w in workers.values() for batch in w['applied'] for s in batch)
    assert applied == list(range(SIZE))
    assert len({w['weights'] for w in workers.values()}) == 1
