"""A rule of the whole suite: a test that starts kvps processes (a job through kvps.launch, a
node, an example, a launch/ recipe) carries the `cluster` mark, so that
`pytest -m "not cluster"` starts none. A test without the mark is stopped, with the reason,
before such a process starts. (tests/cluster/conftest.py marks every test there.)"""

import importlib
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PLUGINS = str(REPO / 'tests' / 'plugins')   # optimizer plugins, as servers import them
NODE_MODULES = ('kvps.launch', 'kvps.node')
JOB_FOLDERS = (REPO / 'launch', REPO / 'examples')
IMPORTS_KVPS = re.compile(r'^\s*(import|from)\s+kvps\b', re.M)
pytest_plugins = ['mps_standin']   # the mps_control fixture, for unit and cluster tests


def kvps_process(args, env=None, cwd=None):
    """What kvps process ``args`` (a Popen argv, or a shell line) would start, run in ``cwd``
    with environment ``env`` (None: this process's): a string naming it, or None if none."""
    if isinstance(args, (str, bytes, os.PathLike)):
        args = shlex.split(os.fsdecode(args))
    argv = [os.fsdecode(a) for a in args]
    for flag, module in zip(argv, argv[1:]):
        if flag == '-m' and module in NODE_MODULES:
            return f'python -m {module}'
    paths = [_path(arg, cwd) for arg in argv]
    for path in filter(None, paths):
        if any(folder in path.parents for folder in JOB_FOLDERS):
            return str(path.relative_to(REPO))
    env = os.environ if env is None else env
    role = env.get('DMLC_ROLE') or env.get('KVPS_ROLE')
    if role and _imports_kvps(argv, paths):   # `import kvps` runs the role (MXNet's contract)
        return f'a kvps {role} (code importing kvps, with a role in its environment)'
    return None


def _path(arg, cwd):
    """``arg`` as an absolute path from ``cwd``, unless it is an option or code."""
    if not arg or arg.startswith('-') or '\n' in arg:
        return None
    return Path(os.path.normpath(Path(cwd or os.getcwd(), arg)))


def _imports_kvps(argv, paths):
    """Whether python argv ``argv`` runs code importing kvps (a -c string or a script)."""
    for flag, code in zip(argv, argv[1:]):
        if flag == '-c':
            return IMPORTS_KVPS.search(code) is not None
    for path in filter(None, paths[1:]):
        if path.suffix == '.py':
            try:
                return IMPORTS_KVPS.search(path.read_text(errors='replace')) is not None
            except OSError:   # not a file (a name that only looks like one)
                return False
    return False


@pytest.fixture(autouse=True)
def _kvps_processes_only_in_cluster_tests(request, monkeypatch):
    """Unless the test is marked cluster, refuse to start a kvps process (pytest.fail, a
    BaseException that no `except Exception` in the test or in kvps swallows)."""
    if request.node.get_closest_marker('cluster') is not None:
        return
    spawn = subprocess.Popen._execute_child

    def refusing(popen, args, executable, preexec_fn, close_fds, pass_fds, cwd, env, *rest):
        what = kvps_process(args, env, cwd)
        if what is not None:
            pytest.fail(f'{request.node.nodeid} starts {what} but is not marked cluster: mark '
                        'it (or move it to tests/cluster), so that `pytest -m "not cluster"` '
                        'starts no kvps process', pytrace=False)
        return spawn(popen, args, executable, preexec_fn, close_fds, pass_fds, cwd, env, *rest)

    monkeypatch.setattr(subprocess.Popen, '_execute_child', refusing)


@pytest.fixture(scope='module')
def plugin():
    """tests/plugins/kvps_test_optimizers (the tests' optimizer plugin) imported in this
    process; kvps's registry as it was afterwards, so that other tests see kvps's own."""
    from kvps.optimizer import optimizers
    saved = dict(optimizers._REGISTRY)
    sys.path.insert(0, PLUGINS)
    try:
        loaded = sys.modules.get('kvps_test_optimizers')
        yield importlib.reload(loaded) if loaded else importlib.import_module(
            'kvps_test_optimizers')
    finally:
        sys.path.remove(PLUGINS)
        optimizers._REGISTRY.clear()
        optimizers._REGISTRY.update(saved)
