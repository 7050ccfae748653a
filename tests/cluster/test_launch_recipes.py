"""launch/slurm.sbatch, a thin wrapper of `python -m kvps.launch --launcher slurm`, runs a
job inside a (stand-in) allocation: srun starts its tasks here as Slurm would."""

import os
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import standins
from conftest import FAST, PRELUDE, Job, assert_no_leftovers
from test_launch_clusters import TRAIN

LAUNCH = Path(__file__).resolve().parents[2] / 'launch'


def test_slurm_batch_script_sizes_the_job_from_the_allocation(tmp_path):
    tag = uuid.uuid4().hex
    bin_dir = tmp_path / 'bin'
    bin_dir.mkdir()
    standins.srun(bin_dir)
    script = tmp_path / 'train.py'
    script.write_text(PRELUDE + textwrap.dedent(TRAIN))
    env = {**os.environ, **FAST, 'KVPS_TEST_TAG': tag, 'PYTHON': sys.executable,
           'PATH': f'{bin_dir}:{os.environ["PATH"]}', 'SLURM_NTASKS': '5',
           'SLURM_JOB_ID': '4242', 'NUM_SERVERS': '2'}
    proc = subprocess.run(['bash', LAUNCH / 'slurm.sbatch', '--host', '127.0.0.1', '--grace',
                           '2', '--', sys.executable, script], env=env, capture_output=True,
                          text=True, timeout=120, cwd=tmp_path)
    assert_no_leftovers(tag)
    result = Job(proc.returncode, proc.stdout, proc.stderr)
    assert result.returncode == 0, result.output
    # 5 tasks: the scheduler, 2 servers, 2 workers, each output line prefixed by role and rank
    assert result.results() == {r: {'rank': r, 'workers': 2, 'w': [3.0] * 3,
                                    'authenticated': True} for r in (0, 1)}
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith('.kvps-launch')]


def test_slurm_batch_script_refuses_an_allocation_too_small(tmp_path):
    env = {**os.environ, 'SLURM_NTASKS': '2', 'NUM_SERVERS': '1', 'PYTHON': sys.executable}
    proc = subprocess.run(['bash', LAUNCH / 'slurm.sbatch', 'python', 'train.py'], env=env,
                          capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert proc.returncode == 2
    assert 'need --ntasks >= NUM_SERVERS + 2' in proc.stderr
