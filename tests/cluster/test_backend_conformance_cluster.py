"""DistClient against kvps.kvstore.backend.Backend in a real job (1 worker, 1 server): the same
contract checks that LocalBackend passes in tests/unit/test_backend_conformance.py, over the
socket and over shared memory."""

import os
from pathlib import Path

import pytest

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(180)]

CONTRACT_DIR = Path(__file__).resolve().parents[1] / 'unit'   # backend_contract.py

SCRIPT = '''
import backend_contract as contract
from kvps.kvstore.job import dist_backend
backend = dist_backend(sync=True)   # the job membership a dist_sync store runs over
report(found=contract.run_all(backend))
'''


@pytest.mark.parametrize('shm', ['0', '1'])
def test_the_distributed_backend_keeps_the_contract(job, shm):
    path = os.pathsep.join([str(CONTRACT_DIR), *filter(None, [os.environ.get('PYTHONPATH')])])
    result = job(SCRIPT, 1, 1, env={'PYTHONPATH': path, 'KVPS_SHM': shm}, timeout=120)
    assert result.returncode == 0, result.output
    found = result.results()[0]['found']
    assert found.pop('check_a_python_updater_runs_here_or_is_refused') == 'refused'
    assert {name: word for name, word in found.items() if word is not None} == {}
