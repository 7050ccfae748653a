"""Optimizers of a user's own on the servers, from plugins they import at start: a job equals
the local store exactly; refusals reach every worker; a broken plugin stops the job at start."""

import json
import os
from pathlib import Path

import numpy as np
import pytest

import kvps

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(240)]

PLUGINS = str(Path(__file__).resolve().parents[1] / 'plugins')
SHAPES = {'mat': (12, 10), 'small': (7,)}    # 'mat' would be split (bound 100) were it not whole
SPEC = {'name': 'test_py_dcasgd',
        'params': {'learning_rate': 0.05, 'momentum': 0.5, 'rescale_grad': 0.5, 'wd': 0.01}}
STEPS = 3   # per phase


def grad(rank, step, key):
    rng = np.random.default_rng([rank, step, list(SHAPES).index(key)])
    return rng.standard_normal(SHAPES[key]).astype(np.float32)


def initial(key):
    return np.linspace(-1, 1, int(np.prod(SHAPES[key])), dtype=np.float32).reshape(SHAPES[key])


def plugin_env():
    path = os.pathsep.join(p for p in (PLUGINS, os.environ.get('PYTHONPATH')) if p)
    return {'PYTHONPATH': path, 'KVPS_BIGARRAY_BOUND': '100', 'TEST_DIR': str(Path(__file__)
                                                                                .parent)}


SCRIPT = '''
from kvps.errors import ConfigError
sys.path.insert(0, os.environ['TEST_DIR'])
from test_plugins_cluster import SHAPES, SPEC, STEPS, grad, initial
kv = kvps.create('dist_sync')
r = kv.rank

def refusal(spec):
    try:
        kv.set_optimizer(spec)
    except ConfigError as exc:
        return str(exc)
    return None

refused = {
    'nowhere': refusal({'name': 'test_py_nowhere', 'params': {}}),
    'half': refusal({'name': 'test_py_half', 'params': {}}),
    'range': refusal({'name': 'test_py_dcasgd', 'params': {'momentum': 'high'}}),
    'typo': refusal({'name': 'test_py_dcasgd', 'params': {'momentom': 0.5}}),
}
# this worker never imported the plugin: it names the optimizer and sends its parameters
assert 'kvps_test_optimizers' not in sys.modules
kv.set_optimizer(SPEC)      # before init: its keys stay whole on one server each
for key in SHAPES:
    kv.init(key, initial(key))

def steps(first):
    for step in range(first, first + STEPS):
        kv.push(list(SHAPES), [grad(r, step, key) for key in SHAPES])   # keys of one round

def pulled():
    out = {key: np.zeros(SHAPES[key], np.float32) for key in SHAPES}
    kv.pull(list(out), out=list(out.values()))
    return {key: value.tolist() for key, value in out.items()}

steps(0)
at_save = pulled()
if r == 0:
    kv.save_optimizer_states(os.environ['STATES'])
kv.barrier()
steps(STEPS)
at_end = pulled()
kv.load_optimizer_states(os.environ['STATES'])    # collective: the servers take the file's
steps(2 * STEPS)
report(refused=refused, at_save=at_save, at_end=at_end, reloaded=pulled())
'''


def local_run(start, steps, states=None, save=None):
    """The same optimizer in a local store: one push per step of both workers' sum."""
    kv = kvps.create('local')
    for key in SHAPES:
        kv.init(key, np.array(start[key], np.float32))
    kv.set_optimizer(kvps.optimizer.Optimizer.from_spec(SPEC))
    if states:
        kv.load_optimizer_states(states)
    for step in steps:
        kv.push(list(SHAPES), [grad(0, step, key) + grad(1, step, key) for key in SHAPES])
    if save:
        kv.save_optimizer_states(save)
    out = {key: np.zeros(SHAPES[key], np.float32) for key in SHAPES}
    kv.pull(list(out), out=list(out.values()))
    return out


def test_a_plugin_optimizer_runs_on_the_servers_as_in_the_local_store(job, tmp_path, plugin):
    states = tmp_path / 'states'
    result = job(SCRIPT, workers=2, servers=2,
                 env={**plugin_env(), 'STATES': str(states)},
                 launcher_args=('--server-plugin', 'kvps_test_optimizers',
                                '--server-plugin', 'kvps_half_plugin'))
    assert result.returncode == 0, result.output
    got = result.results()
    assert sorted(got) == [0, 1]
    for rank in (0, 1):
        refused = got[rank]['refused']
        assert "unknown optimizer 'test_py_nowhere'" in refused['nowhere']
        assert 'KVPS_SERVER_PLUGINS' in refused['nowhere']
        assert 'kvps_test_optimizers, kvps_half_plugin' in refused['nowhere']
        # server 1 registers test_py_half, server 0 does not: refused, set on neither
        assert "unknown optimizer 'test_py_half'" in refused['half']
        assert 'server 0' in refused['half']
        assert "'momentum' must be a number" in refused['range']
        assert "unknown parameter 'momentom'" in refused['typo']
    initial_weights = {key: initial(key) for key in SHAPES}
    at_save = local_run(initial_weights, range(STEPS), save=tmp_path / 'local_states')
    at_end = local_run(initial_weights, range(2 * STEPS))
    for key in SHAPES:
        for rank in (0, 1):
            assert np.array_equal(np.array(got[rank]['at_save'][key], np.float32),
                                  at_save[key]), key
            assert np.array_equal(np.array(got[rank]['at_end'][key], np.float32),
                                  at_end[key]), key
    # the servers' file (two servers, whole keys) loads into a local store and goes on alike
    assert local_run(got[0]['at_save'], range(STEPS, 2 * STEPS), states=states)['mat'].tolist() \
        == got[0]['at_end']['mat']
    reloaded = local_run(got[0]['at_end'], range(2 * STEPS, 3 * STEPS), states=states)
    for key in SHAPES:
        assert np.array_equal(np.array(got[0]['reloaded'][key], np.float32), reloaded[key]), key
    assert json.dumps(got[0]['reloaded']) == json.dumps(got[1]['reloaded'])


def test_a_plugin_that_fails_to_import_stops_the_job_at_start(job):
    result = job('kv = kvps.create("dist_sync")\nreport(joined=True)\n', workers=2, servers=2,
                 env=plugin_env(), launcher_args=('--server-plugin', 'kvps_broken_plugin'),
                 ends_when='server 0 and 1 exit at start, and the launcher stops the rest')
    assert result.returncode != 0
    assert not result.results()      # no worker got past joining
    out = result.output
    assert 'Traceback' in out and 'RuntimeError: kvps_broken_plugin is broken on purpose' in out
    assert "the optimizer plugin 'kvps_broken_plugin' failed to import" in out
    assert 'failed first' in out and 'server' in out.split('failed first')[0].splitlines()[-1]
