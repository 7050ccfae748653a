"""Server checkpoints in real jobs: a checkpoint that cannot be written ends the job with
its reason, and the previous checkpoint stays loadable."""

import re

import pytest

from kvps.server.checkpoint import Checkpointer
from kvps.server.shard import Shard

pytestmark = pytest.mark.cluster

# The worker puts a directory where server 0's checkpoint file was (as a disk that fails
# would), so the write after the next update cannot replace it.
UNWRITABLE = '''
kv = kvps.create('dist_sync')
kv.init(0, np.zeros(4, dtype=np.float32))
path = os.path.join(os.environ['KVPS_CHECKPOINT_DIR'], 'server-0-of-1.kvps')
os.rename(path, path + '.kept')
os.makedirs(path)
try:
    kv.push(0, np.ones(4, dtype=np.float32))
    kv.pull(0, out=np.zeros(4, dtype=np.float32))
    report(error=None)
except kvps.errors.KVPSError as exc:
    report(error=str(exc))
'''


def test_a_checkpoint_that_cannot_be_written_ends_the_job_with_its_reason(by_hand, tmp_path):
    # Started by hand (as a cluster operator would), nobody reads the server's traceback: the
    # workers must learn why, at once, not as a lost heartbeat KVPS_HEARTBEAT_TIMEOUT later.
    ckpt = tmp_path / 'ckpt'
    _, env = by_hand.scheduler(1, 1, extra={'KVPS_CHECKPOINT_DIR': str(ckpt),
                                            'KVPS_CHECKPOINT_EVERY': '1'})
    server = by_hand('server', env)
    code, out = by_hand.finish(by_hand('worker', env, script=UNWRITABLE))
    assert 'server 0' in out and 'checkpoint' in out and 'Is a directory' in out, out
    assert 'no heartbeat' not in out, out
    assert by_hand.finish(server)[0] != 0
    # The update was never acknowledged, and the checkpoint before it is whole.
    (ckpt / 'server-0-of-1.kvps').rmdir()
    (ckpt / 'server-0-of-1.kvps.kept').rename(ckpt / 'server-0-of-1.kvps')
    resumed = Shard(1)
    assert Checkpointer(str(ckpt), 0, 1).load(resumed)
    assert resumed.entries[(0, 0)].weight.tolist() == [0.0] * 4


# dist_async, keys 3 (split over both servers) and 5: each worker pushes gradients that are
# exact in float32 and whose sum does not depend on the order the servers apply them in.
ASYNC_RESUMED = '''
kv = kvps.create('dist_async')
shapes = {3: (40,), 5: (2, 3)}
kv.init(list(shapes), [np.full(s, 100.0, np.float32) for s in shapes.values()])
kv.set_optimizer(kvps.optimizer.create('test', rescale_grad=0.5))
first = int(os.environ['FIRST'])
for step in range(first, first + 3):
    kv.push(list(shapes), [np.full(s, (kv.rank + 1) * (step + 1), np.float32)
                           for s in shapes.values()])
kv.barrier()
outs = [np.zeros(s, np.float32) for s in shapes.values()]
kv.pull(list(shapes), out=outs)
report(values=[sorted(set(o.ravel().tolist())) for o in outs])
'''


def test_a_dist_async_job_resumed_from_its_directory_goes_on_as_if_it_never_stopped(
        job, tmp_path):
    env = {'KVPS_CHECKPOINT_DIR': str(tmp_path / 'ckpt'), 'KVPS_BIGARRAY_BOUND': '10'}
    for first, steps in ((0, 3), (3, 6)):
        result = job(ASYNC_RESUMED, workers=2, servers=2, env={**env, 'FIRST': str(first)})
        assert result.returncode == 0, result.output
        # 100 + 0.5 * sum over steps and both workers of (rank + 1) * (step + 1)
        want = 100 + 0.5 * 3 * sum(range(1, steps + 1))
        assert result.results() == {r: {'values': [[want], [want]]} for r in (0, 1)}
        # the second job says, at the default log level, where its values came from
        resumed = re.findall(r'server (\d) resumed \d+ key parts from .*server-\d-of-2.kvps, an '
                             r"earlier job's checkpoint", result.output)
        assert sorted(resumed) == ([] if first == 0 else ['0', '1']), result.output


# Keys 0 and 1, equal in size: each lands on the server with the least load so far, so the
# init order decides which server holds which (KEYS=0,1: key 0 on server 0, key 1 on server 1).
INIT_IN_ORDER = '''
kv = kvps.create('dist_sync')
keys = [int(k) for k in os.environ['KEYS'].split(',')]
kv.init(keys, [np.full(4, float(os.environ['VALUE']), np.float32) for _ in keys])
outs = [np.zeros(4, np.float32) for _ in keys]
kv.pull(keys, out=outs)
report(values=[[k, o.tolist()] for k, o in zip(keys, outs)])
'''


def _checkpointed_job(job, ckpt):
    """A finished 2-server job that checkpointed keys 0 and 1 at 5.0 in ``ckpt``."""
    env = {'KVPS_CHECKPOINT_DIR': str(ckpt), 'KEYS': '0,1', 'VALUE': '5'}
    result = job(INIT_IN_ORDER, workers=1, servers=2, env=env)
    assert result.returncode == 0, result.output
    assert sorted(p.name for p in ckpt.iterdir()) == ['server-0-of-2.kvps', 'server-1-of-2.kvps']
    return env


def test_a_job_missing_one_servers_checkpoint_refuses_to_resume_half_of_it(job, tmp_path):
    # Server 0 would resume key 0 at 5.0 while server 1 started key 1 afresh at 0.0.
    ckpt = tmp_path / 'ckpt'
    env = _checkpointed_job(job, ckpt)
    (ckpt / 'server-1-of-2.kvps').unlink()
    result = job(INIT_IN_ORDER, workers=1, servers=2, env={**env, 'VALUE': '0'})
    assert result.returncode != 0, result.output
    assert 'server 1' in result.output and str(ckpt) in result.output, result.output
    assert 'server-0-of-2.kvps' in result.output, result.output
    assert 'values' not in (result.results().get(0) or {}), result.output


def test_a_job_that_inits_its_keys_in_another_order_refuses_to_resume(job, tmp_path):
    # Key 1 now lands on server 0, which holds key 0 from the checkpoint: nothing would resume.
    ckpt = tmp_path / 'ckpt'
    env = _checkpointed_job(job, ckpt)
    result = job(INIT_IN_ORDER, workers=1, servers=2, env={**env, 'KEYS': '1,0', 'VALUE': '0'})
    assert result.returncode != 0, result.output
    assert 'server 0' in result.output and str(ckpt) in result.output, result.output
    assert 'key 1' in result.output and 'another order' in result.output, result.output
    assert 'values' not in (result.results().get(0) or {}), result.output
    # The refused job kept the checkpoint: the original order still resumes it.
    result = job(INIT_IN_ORDER, workers=1, servers=2, env={**env, 'VALUE': '0'})
    assert result.returncode == 0, result.output
    assert result.results() == {0: {'values': [[0, [5.0] * 4], [1, [5.0] * 4]]}}
