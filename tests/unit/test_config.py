"""The environment contract: KVPS_* names, ps-lite's DMLC_* aliases, and clear errors."""

import re

import pytest

from kvps.config import VARS, Config, markdown_table
from kvps.errors import ConfigError

DMLC = {'DMLC_ROLE': 'worker', 'DMLC_PS_ROOT_URI': '10.0.0.1', 'DMLC_PS_ROOT_PORT': '9091',
        'DMLC_NUM_WORKER': '4', 'DMLC_NUM_SERVER': '2', 'DMLC_INTERFACE': 'eth0',
        'DMLC_NODE_HOST': 'node-3', 'DMLC_USE_KUBERNETES': '1',
        'MXNET_KVSTORE_BIGARRAY_BOUND': '1000'}


def test_ps_lite_names_are_understood():
    c = Config.from_env(DMLC)
    assert (c.role, c.scheduler_host, c.scheduler_port) == ('worker', '10.0.0.1', 9091)
    assert (c.num_workers, c.num_servers) == (4, 2)
    assert (c.interface, c.node_host, c.use_kubernetes) == ('eth0', 'node-3', True)
    assert c.bigarray_bound == 1000
    assert c.require_cluster() is c


def test_native_name_wins_over_alias_and_defaults_apply():
    c = Config.from_env({'KVPS_BIGARRAY_BOUND': '7', 'MXNET_KVSTORE_BIGARRAY_BOUND': '9'})
    assert c.bigarray_bound == 7
    d = Config.from_env({})
    assert d.bigarray_bound == 1_000_000 and d.timeout == 600 and d.role is None


@pytest.mark.parametrize('name, value', [
    ('DMLC_ROLE', 'boss'), ('DMLC_NUM_WORKER', '0'), ('DMLC_NUM_WORKER', 'two'),
    ('KVPS_TIMEOUT', '-1'), ('DMLC_USE_KUBERNETES', 'maybe'), ('KVPS_SERVER_DEVICE', 'tpu'),
    ('DMLC_PS_ROOT_PORT', '-5'), ('DMLC_PS_ROOT_PORT', '70000'), ('KVPS_LOG_LEVEL', 'LOUD'),
    ('KVPS_LOG_LEVEL', '10'),
    # else every wait fails deep inside with OverflowError, or a registration never ends
    ('KVPS_TIMEOUT', 'inf'), ('KVPS_CONNECT_TIMEOUT', '1e12'), ('KVPS_HEARTBEAT_TIMEOUT', 'nan'),
    ('KVPS_RECOVERY_TIMEOUT', 'inf'), ('KVPS_CHECKPOINT_SECONDS', 'inf'),
    # else the registration fails in msgpack (OverflowError) instead of naming the variable
    ('KVPS_BIGARRAY_BOUND', '1' + '0' * 30), ('KVPS_RANK', str(2 ** 64)),
])
def test_bad_values_name_the_variable(name, value):
    with pytest.raises(ConfigError, match=name):
        Config.from_env({name: value})


def test_the_longest_accepted_waits_are_ones_python_can_wait_for():
    import threading
    c = Config.from_env({'KVPS_TIMEOUT': '1e9', 'KVPS_CONNECT_TIMEOUT': '1e9',
                         'KVPS_HEARTBEAT_INTERVAL': '9e8', 'KVPS_HEARTBEAT_TIMEOUT': '1e9',
                         'KVPS_RECOVERY_TIMEOUT': '1e9', 'KVPS_CHECKPOINT_SECONDS': '1e9'})
    # a worker's start waits the longest: the connect bound and then some
    assert c.connect_timeout + 10 + 2 * c.heartbeat_interval < threading.TIMEOUT_MAX
    assert c.timeout == c.recovery_timeout == 1e9


def test_a_heartbeat_interval_must_be_below_the_timeout():
    with pytest.raises(ConfigError, match='KVPS_HEARTBEAT_INTERVAL=3 must be below'):
        Config.from_env({'KVPS_HEARTBEAT_INTERVAL': '3', 'KVPS_HEARTBEAT_TIMEOUT': '1'})
    assert Config.from_env({'KVPS_HEARTBEAT_TIMEOUT': '2'}).heartbeat_timeout == 2


def test_missing_cluster_variables_are_listed():
    with pytest.raises(ConfigError, match='DMLC_PS_ROOT_URI.*DMLC_NUM_SERVER'):
        Config.from_env({'DMLC_NUM_WORKER': '1'}).require_cluster()


def test_to_env_round_trips():
    c = Config.from_env(DMLC)
    assert Config.from_env(c.to_env()) == c
    plugins = Config.from_env({**DMLC, 'KVPS_SERVER_PLUGINS': ' a.b , c,'})
    assert plugins.server_plugins == ('a.b', 'c')
    assert plugins.to_env()['KVPS_SERVER_PLUGINS'] == 'a.b,c'
    assert Config.from_env(plugins.to_env()) == plugins


def test_server_plugins_must_be_module_names():
    with pytest.raises(ConfigError, match="KVPS_SERVER_PLUGINS='a,2b'.*'2b' is not a Python "
                                          'module name'):
        Config.from_env({'KVPS_SERVER_PLUGINS': 'a,2b'})


def test_docs_list_every_variable_as_config_describes_it():
    from pathlib import Path
    env = (Path(__file__).resolve().parents[2] / 'docs' / 'env.md').read_text()
    assert markdown_table() in env, 'regenerate docs/env.md\'s table: kvps.config.markdown_table()'
    for var in VARS:
        for name in var.names:
            assert f'`{name}`' in env, f'{name} missing from docs/env.md'


def test_readme_configuration_table_names_only_real_variables():
    """README's short table (the settings people change most) names variables kvps reads."""
    import re
    from pathlib import Path
    readme = (Path(__file__).resolve().parents[2] / 'README.md').read_text()
    section = readme.split('\n## Configuration\n', 1)[1].split('\n## ', 1)[0]
    rows = [line for line in section.splitlines() if line.startswith('| `')]
    assert len(rows) >= 5, section
    defaults = {}   # every name and alias -> its default as the generated table writes it
    for row in markdown_table().splitlines()[2:]:
        names, aliases, default = row.split(' | ')[:3]
        for name in re.findall(r'`([A-Z0-9_]+)`', names + aliases):
            defaults[name] = default
    for row in rows:
        name, default = re.match(r'\| `([A-Z0-9_]+)` \| ([^|]*) \|', row).groups()
        assert name in defaults, f'README names {name}, which kvps does not read'
        assert default.strip() == defaults[name], f'README gives {name} another default'


def test_recovery_needs_a_checkpoint_that_is_written_during_the_job():
    base = {'KVPS_RECOVERY_TIMEOUT': '30'}
    assert Config.from_env({}).unrecoverable() is None
    assert 'KVPS_CHECKPOINT_DIR' in Config.from_env(base).unrecoverable()
    inits_only = Config.from_env({**base, 'KVPS_CHECKPOINT_DIR': '/ckpt'}).unrecoverable()
    assert 'KVPS_CHECKPOINT_EVERY=1' in inits_only and 'lose every update' in inits_only
    for every in ({'KVPS_CHECKPOINT_EVERY': '1'}, {'KVPS_CHECKPOINT_SECONDS': '5'}):
        assert Config.from_env({**base, 'KVPS_CHECKPOINT_DIR': '/c', **every}).unrecoverable() \
            is None


def test_a_misspelled_setting_is_named_with_the_one_it_looks_like(caplog):
    env = {**DMLC, 'KVPS_CHECKPOINT_EVRY': '1', 'KVPS_TEST_TAG': 'x', 'KVPS_PORT': '9'}
    Config.from_env(env)
    warnings = [r.getMessage() for r in caplog.records if r.name == 'kvps.config']
    # (tools' own KVPS_* names, unlike any setting, are not kvps's business)
    assert warnings == ['KVPS_CHECKPOINT_EVRY is not a kvps setting and is ignored; did you '
                        'mean KVPS_CHECKPOINT_EVERY?']
    Config.from_env(env)   # once per process
    assert len([r for r in caplog.records if r.name == 'kvps.config']) == 1


@pytest.mark.parametrize('text, lo, hi', [
    ('20000-20100', 20000, 20100), (' 9000 - 9000 ', 9000, 9000), ('1-65535', 1, 65535)])
def test_a_port_range_reads_both_ends_included(text, lo, hi):
    ports = Config.from_env({'KVPS_PORT_RANGE': text}).port_range
    assert (ports[0], ports[-1], len(ports)) == (lo, hi, hi - lo + 1)
    # and a child process is given the same range
    assert Config.from_env(Config(port_range=ports).to_env()).port_range == ports


@pytest.mark.parametrize('text', [
    '20000', '20000-', 'a-b', '20000:20100', '-5-10', '20100-20000', '0-10', '60000-70000',
    '\u0662\u0660-30',     # Arabic-Indic digits are not port numbers
])
def test_a_bad_port_range_is_a_config_error_naming_it(text):
    with pytest.raises(ConfigError, match=re.escape(
            f"KVPS_PORT_RANGE={text!r}: expected LO-HI, ports with 1 <= LO <= HI <= 65535")):
        Config.from_env({'KVPS_PORT_RANGE': text})
