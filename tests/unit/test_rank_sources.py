"""A process's rank from KVPS_RANK and the cluster managers' variables: which one each role
heeds, their precedence, disagreements and malformed values named."""

import json

import pytest

from kvps.config import Config
from kvps.errors import ConfigError
from kvps.rank_sources import SOURCES, rank_hint


def mx_config(kind, index):
    """MX_CONFIG as Kubeflow's MXJob operator writes it (cluster, labels, task)."""
    url = [{'url': f'job-{kind}-{i}', 'port': 9091} for i in range(2)]
    return json.dumps({'cluster': {'scheduler': url[:1], 'server': url, 'worker': url},
                       'labels': {'scheduler': '', 'server': '', 'worker': ''},
                       'task': {'type': kind, 'index': index}})


def tf_config(kind, index, chiefs=1):
    cluster = {'chief': ['c:2222'] * chiefs, 'worker': ['w0:2222', 'w1:2222'],
               'ps': ['p0:2222', 'p1:2222']}
    return json.dumps({'cluster': cluster, 'task': {'type': kind, 'index': index}})


@pytest.mark.parametrize('role, env, rank, source', [
    ('worker', {'KVPS_RANK': '3'}, 3, 'KVPS_RANK=3'),
    ('server', {'KVPS_RANK': ' 1 '}, 1, 'KVPS_RANK=1'),
    ('worker', {'DMLC_WORKER_ID': '2'}, 2, 'DMLC_WORKER_ID=2'),
    ('server', {'DMLC_SERVER_ID': '1'}, 1, 'DMLC_SERVER_ID=1'),
    ('worker', {'MX_CONFIG': mx_config('worker', 1)}, 1, 'MX_CONFIG task worker 1'),
    ('server', {'MX_CONFIG': mx_config('server', 0)}, 0, 'MX_CONFIG task server 0'),
    # TensorFlow's chief is worker 0, its "worker" tasks come after it; "ps" are servers
    ('worker', {'TF_CONFIG': tf_config('chief', 0)}, 0, 'TF_CONFIG task chief 0'),
    ('worker', {'TF_CONFIG': tf_config('worker', 1)}, 2, 'TF_CONFIG task worker 1 (after 1 '
                                                         'chief)'),
    ('worker', {'TF_CONFIG': tf_config('worker', 1, chiefs=0)}, 1, 'TF_CONFIG task worker 1'),
    ('server', {'TF_CONFIG': tf_config('ps', 1)}, 1, 'TF_CONFIG task ps 1'),
    ('worker', {'JOB_COMPLETION_INDEX': '4'}, 4, 'JOB_COMPLETION_INDEX=4'),
    ('server', {'JOB_COMPLETION_INDEX': '0'}, 0, 'JOB_COMPLETION_INDEX=0'),
    # dmlc-core's trackers number the workers first, then the servers
    ('worker', {'DMLC_TASK_ID': '1'}, 1, 'DMLC_TASK_ID=1'),
    ('server', {'DMLC_TASK_ID': '5', 'DMLC_NUM_WORKER': '4'}, 1,
     'DMLC_TASK_ID=5 (less DMLC_NUM_WORKER=4)'),
    # a process without a role that makes a distributed store is a worker
    (None, {'DMLC_WORKER_ID': '1'}, 1, 'DMLC_WORKER_ID=1'),
    ('worker', {}, None, None),
    ('worker', {'KVPS_RANK': '', 'JOB_COMPLETION_INDEX': '  '}, None, None),   # blank: unset
])
def test_each_source_gives_the_rank_within_the_role(role, env, rank, source):
    workers = int(env.get('DMLC_NUM_WORKER', 0)) or None
    assert rank_hint(env, role, workers) == (rank, source)
    config = Config.from_env({**env, **({'DMLC_ROLE': role} if role else {})})
    assert (config.rank, config.rank_from) == (rank, source)


def test_the_other_roles_ids_say_nothing_about_a_rank():
    """dmlc-core's kubernetes tracker sets DMLC_SERVER_ID=0 on every worker, and its ssh
    tracker leaves the last server's there: neither is a worker's rank."""
    assert rank_hint({'DMLC_SERVER_ID': '0', 'DMLC_WORKER_ID': '3'}, 'worker') == \
        (3, 'DMLC_WORKER_ID=3')
    assert rank_hint({'DMLC_SERVER_ID': '1', 'DMLC_WORKER_ID': '3'}, 'server') == \
        (1, 'DMLC_SERVER_ID=1')
    assert rank_hint({'DMLC_SERVER_ID': '1'}, 'worker') == (None, None)


def test_the_scheduler_has_no_rank_and_reads_none_of_them():
    env = {name: 'not a rank' for name in SOURCES}
    assert rank_hint(env, 'scheduler') == (None, None)
    assert Config.from_env({**env, 'DMLC_ROLE': 'scheduler'}).rank is None


def test_the_first_source_set_names_the_rank_and_the_others_may_agree():
    env = {'JOB_COMPLETION_INDEX': '1', 'DMLC_TASK_ID': '1', 'MX_CONFIG': mx_config('worker', 1),
           'DMLC_WORKER_ID': '1', 'DMLC_SERVER_ID': '0'}
    assert rank_hint(env, 'worker') == (1, 'DMLC_WORKER_ID=1')
    assert rank_hint({**env, 'KVPS_RANK': '1'}, 'worker') == (1, 'KVPS_RANK=1')
    assert rank_hint({'DMLC_TASK_ID': '3', 'JOB_COMPLETION_INDEX': '3'}, 'worker') == \
        (3, 'JOB_COMPLETION_INDEX=3')


@pytest.mark.parametrize('role, env, message', [
    ('worker', {'KVPS_RANK': '1', 'JOB_COMPLETION_INDEX': '0'},
     'KVPS_RANK=1 makes this worker rank 1, but JOB_COMPLETION_INDEX=0 makes it rank 0'),
    ('worker', {'DMLC_WORKER_ID': '2', 'MX_CONFIG': mx_config('worker', 3)},
     'DMLC_WORKER_ID=2 makes this worker rank 2, but MX_CONFIG task worker 3 makes it rank 3'),
    ('server', {'TF_CONFIG': tf_config('ps', 0), 'DMLC_TASK_ID': '3', 'DMLC_NUM_WORKER': '2'},
     'TF_CONFIG task ps 0 makes this server rank 0, but DMLC_TASK_ID=3 (less '
     'DMLC_NUM_WORKER=2) makes it rank 1'),
])
def test_disagreeing_sources_are_an_error_naming_both(role, env, message):
    with pytest.raises(ConfigError) as error:
        Config.from_env({**env, 'DMLC_ROLE': role})
    assert str(error.value) == (
        f'{message}: a process has one rank within its role; unset one of them (the first set '
        'of KVPS_RANK, DMLC_WORKER_ID, DMLC_SERVER_ID, MX_CONFIG, TF_CONFIG, '
        'JOB_COMPLETION_INDEX, DMLC_TASK_ID gives the rank, the others must agree)')


@pytest.mark.parametrize('role, env, message', [
    ('worker', {'KVPS_RANK': 'x'}, r"^KVPS_RANK='x': expected a rank, an integer >= 0$"),
    ('worker', {'KVPS_RANK': '-1'}, r"^KVPS_RANK='-1': expected a rank"),
    ('worker', {'KVPS_RANK': str(2 ** 64)}, r'^KVPS_RANK=\'18446744073709551616\': expected'),
    ('worker', {'DMLC_WORKER_ID': '1.0'}, r"^DMLC_WORKER_ID='1.0': expected a rank"),
    ('server', {'JOB_COMPLETION_INDEX': '٣'}, r"^JOB_COMPLETION_INDEX='٣': expected a rank"),
    ('worker', {'MX_CONFIG': '{"task": {"type": "worker", "index": 1}'},
     r'^MX_CONFIG is not JSON \(Expecting .*\): \'{"task"'),
    ('worker', {'MX_CONFIG': '[1, 2]'},
     r'^MX_CONFIG must be a JSON object with a "task"; it is \[1, 2\]$'),
    ('worker', {'TF_CONFIG': '{"cluster": {}}'}, r'^TF_CONFIG must hold {"task": {"type": '
                                                 r'\.\.\., "index": N}} .* its task is None$'),
    ('worker', {'MX_CONFIG': '{"task": {"type": "worker", "index": "1"}}'},
     r"^MX_CONFIG must hold .* its task is {'type': 'worker', 'index': '1'}$"),
    ('worker', {'MX_CONFIG': '{"task": {"type": "worker", "index": -1}}'}, 'index >= 0'),
    ('worker', {'MX_CONFIG': '{"task": {"type": "worker", "index": true}}'}, 'index >= 0'),
    ('worker', {'MX_CONFIG': mx_config('tuner', 0)},
     r"^MX_CONFIG's task type 'tuner' is not one of a kvps job \(worker, server, scheduler\)$"),
    ('worker', {'TF_CONFIG': tf_config('evaluator', 0)},
     r"^TF_CONFIG's task type 'evaluator' is not one of a kvps job \(chief, worker, ps\)$"),
    ('worker', {'MX_CONFIG': mx_config('server', 1)},
     r'^MX_CONFIG task server 1 is a server, but this process is a worker \(DMLC_ROLE\)$'),
    ('server', {'TF_CONFIG': tf_config('chief', 0)},
     r'^TF_CONFIG task chief 0 is a worker, but this process is a server'),
    ('worker', {'MX_CONFIG': mx_config('scheduler', 0)}, 'is a scheduler, but this process'),
    ('worker', {'TF_CONFIG': tf_config('chief', 1)}, r'^TF_CONFIG task chief 1: a job has one '
                                                     r'chief, index 0$'),
    ('worker', {'TF_CONFIG': '{"cluster": ["a"], "task": {"type": "worker", "index": 0}}'},
     r"^TF_CONFIG's cluster must map task types to their addresses; it is \['a'\]$"),
    ('server', {'DMLC_TASK_ID': '4'}, r'^DMLC_TASK_ID=4 on a server needs DMLC_NUM_WORKER'),
    ('server', {'DMLC_TASK_ID': '1', 'DMLC_NUM_WORKER': '2'},
     r"^DMLC_TASK_ID=1 is a worker's task index \(the dmlc tracker numbers the "
     r'DMLC_NUM_WORKER=2 workers first, then the servers\), but this process is a server$'),
    ('worker', {'DMLC_TASK_ID': '2', 'DMLC_NUM_WORKER': '2'},
     r"^DMLC_TASK_ID=2 is a server's task index .* but this process is a worker$"),
    # a malformed source is named even when another one gives the rank
    ('worker', {'KVPS_RANK': '0', 'MX_CONFIG': 'oops'}, '^MX_CONFIG is not JSON'),
])
def test_malformed_sources_are_named(role, env, message):
    with pytest.raises(ConfigError, match=message):
        Config.from_env({**env, 'DMLC_ROLE': role})


def test_a_long_cluster_spec_is_cut_in_the_message():
    spec = '{"cluster": {"worker": [' + ', '.join(['"w:1"'] * 500) + ']}'
    with pytest.raises(ConfigError) as error:
        Config.from_env({'MX_CONFIG': spec})
    assert len(str(error.value)) < 300 and str(error.value).endswith("...")


def test_the_rank_travels_to_a_child_as_kvps_rank_and_its_source_is_not_a_setting():
    config = Config.from_env({'DMLC_ROLE': 'server', 'DMLC_SERVER_ID': '1'})
    assert config.to_env() == {'KVPS_ROLE': 'server', 'KVPS_RANK': '1'}
    again = Config.from_env(config.to_env())
    assert again == config and again.rank_from == 'KVPS_RANK=1'


def test_asking_for_the_rank_alone_still_reads_it_within_the_role():
    env = {'DMLC_ROLE': 'server', 'DMLC_TASK_ID': '3', 'DMLC_NUM_WORKER': '2',
           'DMLC_WORKER_ID': '0'}
    assert Config.from_env(env, fields={'rank'}).rank == 1
    assert Config.from_env(env, fields={'timeout'}).rank is None
