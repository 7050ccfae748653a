"""A process's rank within its role from KVPS_RANK or a cluster manager's variables, in one
order of precedence (config.py asks; this module reads only the mapping it is given)."""

import json
import re

# Where a rank can come from, in order of precedence: the first one set gives the rank, and
# every other one set must give the same (two disagreeing sources are a mistake to name, not
# a choice to make silently).
#   KVPS_RANK             kvps's own (kvps.launch, the launch/ recipes, by hand)
#   DMLC_WORKER_ID        a worker's rank: BytePS, dmlc-core's ssh/mesos/kubernetes trackers
#   DMLC_SERVER_ID        a server's rank: the same trackers; BytePS with preferred ranks
#   MX_CONFIG             Kubeflow's MXJob: JSON, {"task": {"type": "worker", "index": 3}}
#   TF_CONFIG             TensorFlow's cluster JSON (a TFJob, say): "ps" tasks are servers
#   JOB_COMPLETION_INDEX  a Kubernetes Indexed Job's completion index
#   DMLC_TASK_ID          dmlc-core's local/mpi/sge trackers: one index over the job's tasks,
#                         workers first (a server's rank is it less DMLC_NUM_WORKER)
SOURCES = ('KVPS_RANK', 'DMLC_WORKER_ID', 'DMLC_SERVER_ID', 'MX_CONFIG', 'TF_CONFIG',
           'JOB_COMPLETION_INDEX', 'DMLC_TASK_ID')

# Ranks travel in msgpack headers, which hold 64-bit ints.
_MOST = 2 ** 63 - 1
_DIGITS = re.compile(r'[0-9]+')
# The roles the task types of MX_CONFIG and TF_CONFIG name (a TF "chief" is worker 0).
_TASK_ROLES = {'MX_CONFIG': {'worker': 'worker', 'server': 'server', 'scheduler': 'scheduler'},
               'TF_CONFIG': {'chief': 'worker', 'worker': 'worker', 'ps': 'server'}}


def rank_hint(env, role, num_workers=None):
    """``(rank, source)``: this process's rank within ``role`` ('worker', 'server'; None is
    a worker) and the setting that gave it, as messages name it ('DMLC_WORKER_ID=3'), or
    ``(None, None)`` when none is set (ranks then follow the order of registration). The
    scheduler has no rank. ``num_workers`` (DMLC_NUM_WORKER) places a server's DMLC_TASK_ID.
    Raises ValueError naming the variable that is malformed, or the two that disagree."""
    role = role or 'worker'
    if role == 'scheduler':
        return None, None
    found = []
    for name in SOURCES:
        raw = env.get(name)
        if raw is None or not raw.strip():
            continue
        read = _READERS[name](name, raw.strip(), role, num_workers)
        if read is not None:
            found.append(read)
    if not found:
        return None, None
    (rank, source), others = found[0], found[1:]
    for other, said in others:
        if other != rank:
            raise ValueError(
                f'{source} makes this {role} rank {rank}, but {said} makes it rank {other}: '
                'a process has one rank within its role; unset one of them (the first set of '
                f'{", ".join(SOURCES)} gives the rank, the others must agree)')
    return rank, source


def _number(name, raw):
    if not _DIGITS.fullmatch(raw) or int(raw) > _MOST:
        raise ValueError(f'{name}={raw!r}: expected a rank, an integer >= 0')
    return int(raw)


def _plain(name, raw, role, num_workers):
    return _number(name, raw), f'{name}={raw}'


def _of_role(own):
    """A reader of a variable only ``own``'s processes heed: trackers leave DMLC_SERVER_ID=0
    on workers (dmlc-core's kubernetes tracker sets it so; its ssh tracker leaks the last
    server's), so it says nothing about a worker's rank."""
    def read(name, raw, role, num_workers):
        return _plain(name, raw, role, num_workers) if role == own else None
    return read


def _task_index(name, raw, role, num_workers):
    """dmlc-core's trackers count workers 0..W-1, then servers W..W+S-1."""
    task = _number(name, raw)
    if num_workers is None:
        if role == 'server':
            raise ValueError(f'{name}={raw} on a server needs DMLC_NUM_WORKER: the dmlc '
                             'tracker numbers the workers first, then the servers')
        return task, f'{name}={raw}'
    if (task < num_workers) != (role == 'worker'):
        kind = 'worker' if task < num_workers else 'server'
        raise ValueError(f'{name}={raw} is a {kind}\'s task index (the dmlc tracker numbers '
                         f'the DMLC_NUM_WORKER={num_workers} workers first, then the servers), '
                         f'but this process is a {role}')
    if role == 'worker':
        return task, f'{name}={raw}'
    return task - num_workers, f'{name}={raw} (less DMLC_NUM_WORKER={num_workers})'


def _cluster_json(name, raw, role, num_workers):
    """MX_CONFIG / TF_CONFIG: ``task.index`` within ``task.type``, a type of this role."""
    spec = _parsed(name, raw)
    task = spec.get('task')
    kind = task.get('type') if isinstance(task, dict) else None
    index = task.get('index') if isinstance(task, dict) else None
    if not isinstance(kind, str) or type(index) is not int or index < 0:
        raise ValueError(f'{name} must hold {{"task": {{"type": ..., "index": N}}}} with a '
                         f'type name and an index >= 0; its task is {_short(task)}')
    roles = _TASK_ROLES[name]
    if kind not in roles:
        raise ValueError(f'{name}\'s task type {kind!r} is not one of a kvps job '
                         f'({", ".join(roles)})')
    said = f'{name} task {kind} {index}'
    if roles[kind] != role:
        raise ValueError(f'{said} is a {roles[kind]}, but this process is a {role} '
                         '(DMLC_ROLE)')
    if kind == 'chief':
        if index:
            raise ValueError(f'{said}: a job has one chief, index 0')
        return 0, said
    chiefs = _chiefs(spec) if (name, kind) == ('TF_CONFIG', 'worker') else 0
    # TensorFlow numbers its chief worker 0 and the "worker" tasks after it
    return index + chiefs, said + (f' (after {chiefs} chief)' if chiefs else '')


def _parsed(name, raw):
    try:
        spec = json.loads(raw)
    except ValueError as exc:   # json.JSONDecodeError
        raise ValueError(f'{name} is not JSON ({exc}): {_short(raw)}') from None
    if not isinstance(spec, dict):
        raise ValueError(f'{name} must be a JSON object with a "task"; it is {_short(spec)}')
    return spec


def _chiefs(spec):
    cluster = spec.get('cluster', {})
    chiefs = cluster.get('chief', []) if isinstance(cluster, dict) else None
    if not isinstance(chiefs, (list, dict)):
        raise ValueError('TF_CONFIG\'s cluster must map task types to their addresses; it is '
                         f'{_short(cluster)}')
    return len(chiefs)


def _short(value, most=120):
    """A value as an error shows it: its repr, cut (a cluster spec can be long)."""
    text = repr(value)
    return text if len(text) <= most else text[:most] + '...'


_READERS = {'KVPS_RANK': _plain, 'DMLC_WORKER_ID': _of_role('worker'),
            'DMLC_SERVER_ID': _of_role('server'), 'MX_CONFIG': _cluster_json,
            'TF_CONFIG': _cluster_json, 'JOB_COMPLETION_INDEX': _plain,
            'DMLC_TASK_ID': _task_index}
