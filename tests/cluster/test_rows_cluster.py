"""Rows across a real job: pushes of some rows summed by split servers, pulls of some rows and of the rows changed, and the Trainer's sparse embeddings."""

import pytest

pytestmark = pytest.mark.cluster

# 'emb' (9 rows of 2) is split between the two servers at a row (bound 10 elements); 'wide'
# (1 row of 40) has fewer rows than servers, so it is split inside its row and its rows
# travel dense. Worker r pushes rows r, 8 - r and 4, valued r + 1, twice; lazy sgd, lr 1.
SYNC_ROWS = '''
kv = kvps.create('dist_sync')
r = kv.rank
kv.init('emb', np.zeros((9, 2), np.float32))
kv.init('wide', np.zeros((1, 40), np.float32))
kv.set_optimizer(kvps.optimizer.create('sgd', learning_rate=1.0, wd=0.5))
marks, seen = {}, np.full((9, 2), 5, np.float32)
kv.pull_changed_rows_begin('emb', seen, marks)()
for _ in range(2):
    kv.push('emb', kvps.RowSparse([r, 8 - r, 4], np.full((3, 2), r + 1, np.float32)))
kv.push('wide', kvps.RowSparse([0], np.ones((1, 40), np.float32)))
full = np.zeros((9, 2), np.float32)
kv.pull('emb', out=full)
some = np.full((9, 2), 9, np.float32)
kv.row_sparse_pull('emb', out=some, row_ids=[8, 0, 3])
wide = np.zeros((1, 40), np.float32)
kv.row_sparse_pull('wide', out=wide, row_ids=[0])
seen[:] = 5
kv.pull_changed_rows_begin('emb', seen, marks)()
report(parts=[list(p) for p in kv._keys.parts('emb')], full=full[:, 0].tolist(),
       some=some[:, 0].tolist(), wide=sorted(set(wide[0].tolist())), seen=seen[:, 0].tolist())
'''


@pytest.mark.parametrize('partition, parts', [(None, [[0, 8], [8, 18]]),
                                             ('24', [[0, 4], [4, 8], [8, 12], [12, 18]])],
                         ids=['halves', 'partitioned'])
def test_rows_pushed_to_split_servers_are_summed_updated_lazily_and_pulled_by_row(
        job, partition, parts):
    """partitioned: 'emb' (72 bytes) in 4 parts of whole rows, 'wide' in 8 inside its row."""
    result = job(SYNC_ROWS, workers=2, servers=2,
                 env={'KVPS_BIGARRAY_BOUND': '10',
                      **({'KVPS_PARTITION_BYTES': partition} if partition else {})})
    assert result.returncode == 0, result.output
    # Rows 0..3 on one server, 4..8 on the other; each row's value after two rounds of
    # w -= 1 * (g + 0.5 w): g = 1 (rows 0, 8), 2 (rows 1, 7), 3 (row 4): w1 = -g, w2 = -1.5 g.
    full = [-1.5, -3.0, 0.0, 0.0, -4.5, 0.0, 0.0, -3.0, -1.5]
    for rank in (0, 1):
        got = result.results()[rank]
        assert [p[2:] for p in got['parts']] == parts
        assert got['full'] == full
        assert got['some'] == [-1.5, 9, 9, 0.0, 9, 9, 9, 9, -1.5]
        assert got['wide'] == [-2.0]                       # dense: pushed whole, both workers
        assert got['seen'] == [v if v else 5 for v in full]   # rows never changed: not sent


ASYNC_ROWS = '''
kv = kvps.create('dist_async')
r = kv.rank
kv.init(0, np.zeros((6, 3), np.float32))
kv.set_optimizer(kvps.optimizer.create('sgd', learning_rate=1.0))
for step in range(5):
    kv.push(0, kvps.RowSparse([r, 5, r], np.ones((3, 3), np.float32)))
kv.barrier()
out = np.zeros((6, 3), np.float32)
kv.row_sparse_pull(0, out=out, row_ids=[0, 1, 5])
report(rows=out[:, 0].tolist())
'''


def test_async_row_pushes_are_each_applied_and_none_lost(job):
    result = job(ASYNC_ROWS, workers=2, servers=2)
    assert result.returncode == 0, result.output
    # each push: rows r (twice: 2) and 5 (1); five pushes per worker
    assert result.results() == {r: {'rows': [-10.0, -10.0, 0, 0, 0, -10.0]} for r in (0, 1)}


# Two models in one Trainer, the same but for sparse=True: the sparse one's rows travel
# alone and come back by the rows changed; with plain sgd (lazy or not, the same rule) both
# train alike. 40000 x 4 floats: above the size the Trainer fuses.
TRAINER_ROWS = '''
import torch
kv = kvps.create('dist_sync')

class Bag(torch.nn.Module):
    def __init__(self, sparse):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(40000, 4, sparse=sparse)
        self.out = torch.nn.Linear(4, 1)

    def forward(self, ids):
        return self.out(self.emb(ids).mean(1)).pow(2).mean()

models = torch.nn.ModuleList([Bag(True), Bag(False)])
start = models[0].emb.weight.detach().clone()
trainer = kvps.Trainer(models.named_parameters(), 'sgd', {'learning_rate': 0.5}, kvstore=kv,
                       update_on_kvstore=os.environ['UOK'] == '1')
for step in range(4):
    ids = torch.randint(0, 40000, (8, 3), generator=torch.Generator().manual_seed(
        10 * step + kv.rank))
    (models[0](ids) + models[1](ids)).backward()
    trainer.step(8)
    trainer.zero_grad()
sparse, dense = (m.emb.weight.detach() for m in models)
report(rows=sorted(trainer._exchange.row_keys),
       close=bool(torch.allclose(sparse, dense, atol=1e-6)),
       out=bool(torch.allclose(models[0].out.weight, models[1].out.weight, atol=1e-6)),
       moved=int((sparse != start).any(1).sum()), checksum=float(sparse.double().sum()))
'''


@pytest.mark.parametrize('uok', ['1', '0'])
def test_a_trainers_sparse_embedding_trains_as_the_dense_one_through_its_rows(job, uok):
    # servers update (rows changed pulled back) or workers (the summed rows pulled)
    result = job(TRAINER_ROWS, workers=2, servers=2, timeout=180, env={'UOK': uok})
    assert result.returncode == 0, result.output
    got = result.results()
    for rank in (0, 1):
        assert got[rank]['rows'] == [0] and got[rank]['close'] and got[rank]['out'], got
        assert 0 < got[rank]['moved'] <= 4 * 2 * 8 * 3   # the rows the batches read
    assert got[0]['checksum'] == got[1]['checksum']     # every worker holds the same weights


# Rows of 64 floats: a push of ten is 2.6 KB, staged in the worker's shared memory (servers
# read it in place) unless KVPS_SHM=0 sends it on the socket.
WIDE_ROWS = '''
kv = kvps.create('dist_sync')
r = kv.rank
kv.init(0, np.zeros((100, 64), np.float32))
for step in range(3):
    ids = np.arange(10) * 7 + r + step
    kv.push(0, kvps.RowSparse(ids, np.full((10, 64), r + 1, np.float32)))
out = np.zeros((100, 64), np.float32)
kv.pull(0, out=out)
report(nonzero=np.flatnonzero(out[:, 0]).tolist(), values=sorted(set(out[:, 0].tolist())))
'''


@pytest.mark.parametrize('shm', ['1', '0'])
def test_wide_rows_travel_through_shared_memory_or_the_socket_alike(job, shm):
    result = job(WIDE_ROWS, workers=2, servers=1, env={'KVPS_SHM': shm})
    assert result.returncode == 0, result.output
    # no optimizer: the value is the last round's sum, zeros elsewhere (rows 7i+2, 7i+3)
    want = sorted([7 * i + 2 for i in range(10)] + [7 * i + 3 for i in range(10)])
    assert result.results() == {r: {'nonzero': want, 'values': [0.0, 1.0, 2.0]} for r in (0, 1)}


# Rows through a server restart (checkpoint every update): rank 0 kills server 1 after its
# push of step 5; pushes left unanswered are resent to the replacement, which counts row
# changes afresh (a new epoch): the table each worker keeps by pulling the rows changed must
# still end equal to the servers' value, and that to a local store fed the same rows.
ROWS_RESTART = '''
import signal
from kvps.optimizer import create as optimizer
STEPS, KILL_AT, SHAPE = 10, 5, (200, 16)

def rows_of(rank, step):
    ids = (np.arange(12) * 17 + 5 * rank + 3 * step) % SHAPE[0]
    return ids, np.full((12, SHAPE[1]), (rank + 1) * (step + 1) / 8, np.float32)

kv = kvps.create('dist_sync')
kv.init('emb', np.ones(SHAPE, np.float32))
spec = optimizer('sgd', learning_rate=0.1, momentum=0.9, wd=0.01)
kv.set_optimizer(spec)
marks, kept = {}, np.zeros(SHAPE, np.float32)
for step in range(STEPS):
    kv.push('emb', kvps.RowSparse(*rows_of(kv.rank, step)))
    if step == KILL_AT and kv.rank == 0:
        pid = next(n['pid'] for n in kv._backend.io.welcome['nodes']
                   if n['role'] == 'server' and n['rank'] == 1)
        os.kill(pid, signal.SIGKILL)
    kv.pull_changed_rows_begin('emb', kept, marks)()
out = np.zeros(SHAPE, np.float32)
kv.pull('emb', out=out)

local = kvps.create('local')
local.init('emb', np.ones(SHAPE, np.float32))
local.set_optimizer(spec)
for step in range(STEPS):
    local.push('emb', [kvps.RowSparse(*rows_of(r, step)) for r in range(kv.num_workers)])
want = np.zeros(SHAPE, np.float32)
local.pull('emb', out=want)
report(parts=[p[2:] for p in kv._keys.parts('emb')], exact=bool(np.array_equal(out, want)),
       kept=bool(np.array_equal(kept, out)), moved=int((out != 1).any(1).sum()))
'''


def test_rows_survive_a_server_restart_with_nothing_lost_and_changed_rows_still_right(job,
                                                                                   tmp_path):
    env = {'KVPS_CHECKPOINT_EVERY': '1', 'KVPS_BIGARRAY_BOUND': '100',
           'KVPS_CHECKPOINT_DIR': str(tmp_path / 'ckpt')}
    result = job(ROWS_RESTART, workers=2, servers=2, env=env,
                 launcher_args=['--restart-servers', '1'])
    assert result.returncode == 0, result.output
    assert 'rejoined' in result.output
    for rank in (0, 1):
        got = result.results()[rank]
        assert got['parts'] == [[0, 1600], [1600, 3200]]
        assert got['exact'] and got['kept'] and got['moved'] > 100, got
