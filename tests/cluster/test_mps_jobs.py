"""Real jobs through `python -m kvps.launch --mps`, with a stand-in nvidia-cuda-mps-control
(tests/mps_standin.py): every process of the job is a client of one private daemon, started
before the first of them and stopped after the last, and nothing is left, whether the job
succeeds or a worker fails. The launcher's refusals and a killed launcher:
tests/unit/test_launch_mps.py."""

import os

import pytest

pytestmark = pytest.mark.timeout(180)

# Worker 0 reads, while every process of the job runs (between two barriers), the MPS
# variables each was started with.
SCRIPT = '''
def job_processes():
    """{'role rank': [pipe, log directory]} of every live process of this job."""
    tag, seen = os.environ['KVPS_TEST_TAG'].encode(), {}
    for entry in filter(str.isdigit, os.listdir('/proc')):
        try:
            with open(f'/proc/{entry}/environ', 'rb') as f:
                env = dict(v.split(b'=', 1) for v in f.read().split(b'\\0') if b'=' in v)
        except OSError:
            continue
        if env.get(b'KVPS_TEST_TAG') == tag and b'DMLC_ROLE' in env:
            name = f"{env[b'DMLC_ROLE'].decode()} {env.get(b'KVPS_RANK', b'').decode()}"
            seen[name.strip()] = [env.get(b'CUDA_MPS_PIPE_DIRECTORY', b'').decode(),
                                  env.get(b'CUDA_MPS_LOG_DIRECTORY', b'').decode()]
    return seen

kv = kvps.create('dist_sync')
kv.init(0, np.zeros(1, np.float32))
kv.barrier()
if kv.rank == 0:   # (and whether the daemon is there to serve them: its control pipe)
    pipe = os.environ['CUDA_MPS_PIPE_DIRECTORY']
    report(seen=job_processes(), served=os.path.exists(os.path.join(pipe, 'control')))
kv.barrier()
if os.environ.get('FAIL') and kv.rank == 1:
    raise RuntimeError('worker 1 fails on purpose')
'''


@pytest.mark.parametrize('fails', [False, True], ids=['succeeds', 'a-worker-fails'])
def test_every_process_is_a_client_of_one_daemon_that_outlives_none(fails, job, mps_control):
    control = mps_control()
    env = {'PATH': control.path, **({'FAIL': '1'} if fails else {})}
    done = job(SCRIPT, workers=2, servers=1, env=env, launcher_args=('--mps',))
    if fails:
        assert done.returncode == 1 and 'RuntimeError: worker 1 fails on purpose' in done.output
    else:
        assert done.returncode == 0, done.output
    [started], [quit_] = control.calls(['-d']), control.calls([])
    pipe, log = started['pipe'], started['log']
    assert f'kvps.launch: MPS on: a private control daemon, CUDA_MPS_PIPE_DIRECTORY={pipe}' \
        in done.stderr
    # every process of the job was given the daemon's pipe and log directories
    assert done.results()[0] == {'served': True, 'seen': {name: [pipe, log] for name in (
        'scheduler', 'server 0', 'worker 0', 'worker 1')}}
    # the daemon ran before the first of them and quit after the last (as it quit, it was
    # told so on its front-end's stdin, which found it through the same pipe directory)
    assert started['job'] == [] and quit_['job'] == []
    assert (quit_['stdin'], quit_['pipe']) == ('quit\n', pipe)
    assert [r.get('ended', False) for r in control.calls(['--daemon'])] == [False, True]
    assert control.daemons_alive() == [] and not os.path.exists(os.path.dirname(pipe))
