"""kvps.Trainer's later-life paths across real processes: checkpoints moved between jobs of other sizes and setups, learning rates changed mid-job."""

import textwrap

import pytest

pytest.importorskip('torch')

pytestmark = pytest.mark.cluster

CHECKPOINT = '''
import torch
from kvps import Trainer
torch.set_num_threads(1)
kv = kvps.create('dist_sync')
rank, nw = kv.rank, kv.num_workers
g = torch.Generator().manual_seed(0)
params = [torch.nn.Parameter(torch.randn(n, generator=g)) for n in (6, 5, 4, 3)]
params[2].lr_mult = 0.5
if LOAD:
    with torch.no_grad():
        for p, w in zip(params, torch.load('weights.pt')):
            p.copy_(w)
opt = {'learning_rate': 0.1, 'wd': 0.01}
if SCHED:
    opt['lr_scheduler'] = {'name': 'factor', 'params': {'step': 2, 'factor': 0.5}}
trainer = Trainer(params, 'adam', opt, kvstore=kv, update_on_kvstore=UOK, fuse=FUSE)
BATCH = 6          # the combined batch, split over the workers

def train(start, stop):
    lrs = []
    for step in range(start, stop):
        if not SCHED and step == 2:
            trainer.set_learning_rate(0.03)
        trainer.zero_grad()
        loss = 0
        for sample in range(rank, BATCH, nw):
            g = torch.Generator().manual_seed(1000 * step + sample)
            loss = loss + sum((torch.randn(p.shape, generator=g) * p * p).sum() for p in params)
        loss.backward()
        trainer.step(BATCH)
        lrs.append(trainer.learning_rate)
    return lrs

if LOAD:
    trainer.load_states('states')
    lrs = train(3, 7)
else:
    train(0, 3)
    if rank == 0:
        trainer.save_states('states')
        torch.save([p.detach() for p in params], 'weights.pt')
    kv.barrier()
    lrs = train(3, 7)
report(weights=[p.detach().tolist() for p in params], lrs=lrs, lr=trainer.learning_rate,
       uok=trainer.update_on_kvstore)
'''


def checkpoint_job(job, workers, servers, **consts):
    lines = ''.join(f'{name} = {value!r}\n' for name, value in consts.items())
    result = job(lines + textwrap.dedent(CHECKPOINT), workers=workers, servers=servers,
                 timeout=90)
    assert result.returncode == 0, result.output
    found = result.results()
    assert sorted(found) == list(range(workers)), result.output
    return found


def close(a, b):
    """Equal but for the order in which each job's workers summed the batch."""
    return all(abs(x - y) <= 1e-6 * max(1.0, abs(x)) for u, v in zip(a, b) for x, y in zip(u, v))


@pytest.mark.timeout(240)
@pytest.mark.parametrize('sched, save, loads', [
    (True, (2, 2, True, True), [(1, 1, False, False), (3, 1, True, False)]),
    (False, (2, 2, False, True), [(3, 2, True, True)]),
], ids=['lr_scheduler', 'set_learning_rate'])
def test_states_saved_by_two_workers_resume_in_jobs_of_other_sizes_and_setups(
        job, sched, save, loads):
    """Adam with an lr_mult, saved after 3 steps by a 2-worker job (servers or workers
    updating, keys fused), loaded into jobs of 1 or 3 workers with update_on_kvstore and fuse
    flipped: the next 4 steps give the saver's weights and learning rates (the schedule
    resumes at update 4; a rate set before the save is the file's)."""
    workers, servers, uok, fuse = save
    saved = checkpoint_job(job, workers, servers, SCHED=sched, LOAD=False, UOK=uok, FUSE=fuse)
    for workers, servers, uok, fuse in loads:
        loaded = checkpoint_job(job, workers, servers, SCHED=sched, LOAD=True, UOK=uok,
                                FUSE=fuse)
        for rank, values in loaded.items():
            where = (workers, uok, fuse, rank)
            assert values['uok'] is uok
            assert values['lrs'] == saved[0]['lrs'], (where, values['lrs'], saved[0]['lrs'])
            assert close(values['weights'], saved[0]['weights']), (where, values, saved[0])


SET_LR = '''
import torch
from kvps import Trainer
kv = kvps.create(MODE)
params = [torch.nn.Parameter(torch.zeros(n)) for n in (3, 2, 700)]
trainer = Trainer(params, 'sgd', {'learning_rate': 1.0}, kvstore=kv, update_on_kvstore=True)
seen = []
if MODE == 'dist_async' and kv.rank == 0:
    # Make the race certain: rank 0 tells rank 1 when it is at a barrier of the collective
    # that sets the next rate, and rank 1 sends its gradients of this step only then.
    collectives = kv._backend._collectives
    real_barrier = collectives._barrier

    def barrier(digest=None, **call):
        open(f'at_barrier_of_step_{len(seen)}', 'w').close()
        return real_barrier(digest, **call)
    collectives._barrier = barrier


def wait_for(path):
    deadline = time.monotonic() + 30
    while not os.path.exists(path):
        assert time.monotonic() < deadline, path
        time.sleep(0.01)


# Every worker sets the rate at the same point (a collective when the servers update); the
# last, 0, makes the last step's pull see every worker's earlier updates, in async too.
for lr in RATES:
    trainer.set_learning_rate(lr)
    seen.append(trainer.learning_rate)
    if MODE == 'dist_async' and kv.rank == 1 and 1 <= len(seen) < len(RATES):
        wait_for(f'at_barrier_of_step_{len(seen)}')
    trainer.zero_grad()
    sum(p.sum() for p in params).backward()     # every gradient element is 1
    trainer.step(1)
report(seen=seen, weights=sorted({float(v) for p in params for v in p.detach().flatten()}))
'''


@pytest.mark.timeout(120)
@pytest.mark.parametrize('mode', ['dist_sync', 'dist_async'])
def test_a_learning_rate_set_on_every_worker_applies_from_its_next_step(job, mode):
    """sgd, 2 workers, gradients of 1 at a new rate each step: every element ends at
    -2 * (the sum of the rates) on every worker, whichever order async pushes arrive in: a
    worker's gradients of one step are applied at that step's rate, also when another
    worker has already moved on and set the next one."""
    rates = [1.0, 0.5, 0.25, 2.0, 0.125, 1.0, 0.5, 4.0, 0.25, 0.0]
    result = job(f'MODE = {mode!r}\nRATES = {rates!r}\n' + textwrap.dedent(SET_LR),
                 workers=2, servers=2, timeout=90, env={'KVPS_BIGARRAY_BOUND': '100'})
    assert result.returncode == 0, result.output
    found = result.results()
    assert sorted(found) == [0, 1], result.output
    for values in found.values():
        assert values == {'seen': rates, 'weights': [-2 * sum(rates)]}, found
