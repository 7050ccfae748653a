"""The suite's own promise: a test not marked cluster starts no kvps process (tests/conftest.py
stops it first, naming what it would start), so `pytest -m "not cluster"` starts no job, node,
example or launch recipe."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PY = sys.executable
ROLELESS = {k: v for k, v in os.environ.items() if k not in ('DMLC_ROLE', 'KVPS_ROLE')}


@pytest.mark.parametrize('argv, env, named', [
    ([PY, '-m', 'kvps.launch', '-n', '1', '-s', '1', 'true'], {}, 'python -m kvps.launch'),
    ([PY, '-m', 'kvps.node'], {'DMLC_ROLE': 'server'}, 'python -m kvps.node'),
    (['bash', str(REPO / 'launch' / 'slurm.sbatch'), 'true'], {}, 'launch/slurm.sbatch'),
    ([PY, str(REPO / 'examples' / 'logreg_kvstore.py')], {}, 'examples/logreg_kvstore.py'),
    ([PY, '-c', 'import kvps'], {'DMLC_ROLE': 'scheduler'},
     'a kvps scheduler (code importing kvps, with a role in its environment)'),
    (f'{PY} -m kvps.node', {'KVPS_ROLE': 'server'}, 'python -m kvps.node'),
])
def test_an_unmarked_test_cannot_start_a_kvps_process(argv, env, named):
    refused = re.escape(f'starts {named} but is not marked cluster')
    with pytest.raises(pytest.fail.Exception, match=refused):
        subprocess.run(argv, env={**ROLELESS, **env}, shell=isinstance(argv, str),
                       capture_output=True, timeout=30)


@pytest.mark.parametrize('argv, env', [
    ([PY, '-c', 'import kvps'], {}),                     # no role: no node
    ([PY, '-c', 'print(1)'], {'DMLC_ROLE': 'server'}),   # a stand-in node (test_launch's)
])
def test_other_processes_start(argv, env):
    done = subprocess.run(argv, env={**ROLELESS, **env}, capture_output=True, timeout=60)
    assert done.returncode == 0, done.stderr
