"""A worker joins a running elastic job whose Trainer updates on the workers
(update_on_kvstore=False): it takes a member's weights and optimizer state, abstains from its
rounds meanwhile, and from then on every worker holds the same weights and state, bit for
bit, as a replay of the rounds' recorded members does (docs/elastic.md)."""

import json
import textwrap

import numpy as np
import pytest
import torch

import kvps
from kvps.optimizer import states

N, TOTAL = 3, 12   # the job's -n; the rounds every worker makes
OPTIMIZERS = {'sgd': {'learning_rate': 0.125, 'momentum': 0.5},
              'adam': {'learning_rate': 0.01}}


def grads(rank, round_index):
    """Worker ``rank``'s data of a round, and so its gradients: the loss sum(c * model(x))
    has gradients c^T x and sum(c) whatever the weights, in small integers, so a round's
    sum is exact in any order and a replay can make it again."""
    rng = np.random.default_rng([rank, round_index])
    x = rng.integers(-2, 3, (2, 4)).astype(np.float32)
    c = rng.integers(-1, 2, (2, 3)).astype(np.float32)
    return x, c


SCRIPT = '''
import signal, subprocess
import torch
from kvps.optimizer import states

def grads(rank, round_index):
    rng = np.random.default_rng([rank, round_index])
    x = rng.integers(-2, 3, (2, 4)).astype(np.float32)
    c = rng.integers(-1, 2, (2, 3)).astype(np.float32)
    return x, c

torch.manual_seed(0)
model = torch.nn.Linear(4, 3).to(DEVICE)
kv = kvps.create(STORE)
trainer = kvps.Trainer(model.parameters(), NAME, PARAMS, kvstore=kv, update_on_kvstore=False)
joiner, pushed = None, []
while kv.notes.rounds() < TOTAL:
    round_index = kv.notes.rounds()
    if round_index == 3 and kv.rank == SPAWNER and not os.environ.get('JOINER'):
        env = {k: v for k, v in os.environ.items() if k != 'KVPS_RANK'}
        joiner = subprocess.Popen([sys.executable, sys.argv[0]], env={**env, 'JOINER': '1'})
    if round_index == 4:   # the members wait for the joiner (rank 3) before round 4
        while 3 not in [rank for rank, _ in kv.notes.members()]:
            time.sleep(0.05)
        if KILL_DONOR and kv.rank == 0 and not os.environ.get('JOINER'):
            os.kill(os.getpid(), signal.SIGKILL)   # the donor, lost before it served
    x, c = grads(kv.rank, round_index)
    (torch.from_numpy(c).to(DEVICE) * model(torch.from_numpy(x).to(DEVICE))).sum().backward()
    if not trainer.joining:
        pushed.append(round_index)
    trainer.step(2 * kv.num_workers)
    trainer.zero_grad()
trainer.save_states(f'states-{kv.rank}.bin')
weights = [p.detach().cpu().numpy().tobytes().hex() for p in model.parameters()]
line = json.dumps({'rank': kv.rank, 'pushed': pushed, 'weights': weights,
                   'replayed': trainer._handover.replayed})
if os.environ.get('JOINER'):
    print('JOINED', line, flush=True)
else:
    if joiner is not None:
        joiner.wait(60)
    report(**json.loads(line))
'''


CUDA = pytest.param('cuda', 'dist_sync_device', marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason='no CUDA device')])


@pytest.mark.parametrize('device, store', [('cpu', 'dist_sync'), ('cpu', 'dist_sync_device'),
                                           CUDA])
@pytest.mark.parametrize('name', sorted(OPTIMIZERS))
def test_a_joiner_takes_the_weights_and_optimizer_state_of_the_members(job, tmp_path, name,
                                                                        device, store):
    """Parameters on a GPU (a device store, the CUDA kernels) are held to the same: every
    worker's weights and state bit for bit the same, and as the replay's to rounding."""
    result, joined, workers = run(job, name, device, store)
    for rank in range(N):
        assert workers[rank]['pushed'] == list(range(TOTAL))
        assert workers[rank]['replayed'] is None         # (members take no handover)
    check(tmp_path, name, device, joined, workers)


def test_when_the_donor_is_lost_before_it_served_the_next_member_serves(job, tmp_path):
    """Rank 0, the donor, is killed when it sees the joiner (before its push of round 4):
    rank 1 is then the lowest member, and serves."""
    result, joined, workers = run(job, 'sgd', 'cpu', 'dist_sync', kill_donor=True)
    assert 'worker 0' in result.stderr and 'goes on without it' in result.stderr
    assert 'its pushes to 1 open round(s) were taken out' not in result.output
    workers[0] = {'pushed': [0, 1, 2, 3]}   # (it made rounds 0 to 3, and died)
    for rank in (1, 2):
        assert workers[rank]['pushed'] == list(range(TOTAL))
    check(tmp_path, 'sgd', 'cpu', joined, workers)


def run(job, name, device, store, kill_donor=False):
    """The job of N workers and a joiner: (result, the joiner's report, every report)."""
    script = (f'NAME, PARAMS, TOTAL, DEVICE, STORE = {name!r}, {OPTIMIZERS[name]!r}, '
              f'{TOTAL}, {device!r}, {store!r}\n'
              f'SPAWNER, KILL_DONOR = {2 if kill_donor else 0}, {kill_donor}\n'
              + textwrap.dedent(SCRIPT))
    result = job(script, workers=N, servers=1,
                 launcher_args=['--min-workers', '2', '--max-workers', '4'],
                 ends_when=f'every worker has made {TOTAL} rounds')
    assert result.returncode == 0, result.output
    joined = json.loads(result.stdout.split('JOINED ', 1)[1].split('\n', 1)[0])
    workers = {**result.results(), joined['rank']: joined}
    assert joined['rank'] == 3, result.output
    assert sorted(workers) == ([1, 2] if kill_donor else [0, 1, 2]) + [3], result.output
    return result, joined, workers


def check(tmp_path, name, device, joined, workers):
    """The joiner abstained, then pushed; every live worker's weights and state are the
    replay's of who pushed into each round."""
    assert joined['replayed'] in (0, 1), joined          # the donor's last round, or one before
    # the joiner abstained from its first round(s), and pushed from the next one on
    assert 4 <= joined['pushed'][0] and joined['pushed'] == list(
        range(joined['pushed'][0], TOTAL)), joined
    weights, file_states = replay(name, workers, tmp_path / 'replayed.bin')
    workers = {rank: w for rank, w in workers.items() if 'weights' in w}
    if device != 'cpu':   # the CUDA kernels round as they do: the workers agree among them
        for ours, replayed in zip(workers[0]['weights'], weights):
            np.testing.assert_allclose(_floats(ours), _floats(replayed), rtol=1e-5)
        weights = workers[0]['weights']
        file_states = states.read_file(tmp_path / 'states-0.bin')
    for rank, worker in workers.items():
        assert worker['weights'] == weights, f'worker {rank}'
        assert same_states(states.read_file(tmp_path / f'states-{rank}.bin'),
                           file_states), f'worker {rank}'


def _floats(hex_bytes):
    return np.frombuffer(bytes.fromhex(hex_bytes), np.float32)


def replay(name, workers, path):
    """The weights and optimizer state after every round, made again in this process from
    who pushed into each round: its sum, scaled by N / (its pushers), applied by a Trainer
    without a store on the batch of N workers (the rescale every worker uses)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    trainer = kvps.Trainer(model.parameters(), name, OPTIMIZERS[name], kvstore=None)
    for round_index in range(TOTAL):
        pushers = [rank for rank, w in workers.items() if round_index in w['pushed']]
        total = [np.zeros((3, 4), np.float32), np.zeros(3, np.float32)]
        for rank in pushers:
            x, c = grads(rank, round_index)
            total[0] += c.T @ x
            total[1] += c.sum(0)
        for p, summed in zip(model.parameters(), total):
            if len(pushers) != N:
                np.multiply(summed, N / len(pushers), out=summed)
            p.grad = torch.from_numpy(summed)
        trainer.step(2 * N)
    trainer.save_states(path)
    return ([p.detach().numpy().tobytes().hex() for p in model.parameters()],
            states.read_file(path))


def same_states(a, b):
    """Whether two state files hold the same update count and per-parameter state, bit for
    bit (their optimizers' specs may list keys differently: fused or not)."""
    return a['num_update'] == b['num_update'] and sorted(a['keys']) == sorted(b['keys'])
