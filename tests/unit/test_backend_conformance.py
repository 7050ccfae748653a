"""Both KVStore backends against kvps.kvstore.backend.Backend: every member, with the same
signature, and the behavioural contract on LocalBackend (DistClient's runs in a real job:
tests/cluster/test_backend_conformance_cluster.py)."""

import ast
from pathlib import Path

import pytest

import backend_contract as contract
import kvps
from kvps.kvstore.local import LocalBackend
from kvps.worker.client import DistClient

STORE_FILES = ('store.py', 'keys.py', 'row_calls.py')


@pytest.mark.parametrize('cls', [LocalBackend, DistClient])
def test_every_method_of_the_protocol_is_there_with_its_signature(cls):
    assert contract.signature_mismatches(cls) == {}


def test_the_protocol_declares_every_member_the_store_uses():
    """What kvps/kvstore asks of ``self._backend`` or a ``backend`` argument."""
    data, methods = contract.protocol_members()
    used = set()
    for name in STORE_FILES:
        tree = ast.parse((Path(kvps.kvstore.__file__).parent / name).read_text())
        used |= {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)
                 and _is_backend(node.value)}
    assert used and used <= data | methods.keys(), used - data - methods.keys()


def _is_backend(node):
    return (isinstance(node, ast.Name) and node.id == 'backend') or (
        isinstance(node, ast.Attribute) and node.attr == '_backend')


@pytest.mark.parametrize('check', contract.CHECKS, ids=lambda check: check.__name__)
def test_the_local_backend_keeps_the_contract(check):
    outcome = check(LocalBackend())
    if check is contract.check_a_python_updater_runs_here_or_is_refused:
        assert outcome == 'runs'


def test_the_local_backend_keeps_the_contract_through_one_run():
    """As the job runs them: in order, on one backend."""
    found = contract.run_all(LocalBackend())
    assert {name: word for name, word in found.items() if word not in (None, 'runs')} == {}
