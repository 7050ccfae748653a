"""launch/kubernetes.yaml, parsed and run here: its objects are those a kvps job needs (by
their structure, and by Kubernetes' own schema where kubernetes-validate is installed), and its
containers, started with the environment the manifest gives each pod, form a job and train.

What stands in for the cluster, and nothing else: there is no cluster DNS, so host names and
pod IPs are 127.0.0.1 (DMLC_PS_ROOT_URI, checked to be the scheduler pod's name, is replaced;
status.podIP is 127.0.0.1); volumes are directories of the test (the Secret's file, the
checkpoint claim), their mount paths replaced in the environment; the scheduler binds a port
the OS picks (the others are given it) instead of the manifest's fixed one; `python` is this
interpreter, started in the repository as the image's working directory; and the failure
bounds are conftest.FAST's, so that a broken job fails the test quickly."""

import os
import re
import secrets
import sys
import time
from pathlib import Path

import pytest

from kvps.config import Config
from kvps.server.checkpoint import path_for

yaml = pytest.importorskip('yaml')

ROOT = Path(__file__).resolve().parents[2]
MANIFEST = ROOT / 'launch' / 'kubernetes.yaml'
INDEX_FIELD = "metadata.annotations['batch.kubernetes.io/job-completion-index']"
ROLES = ('scheduler', 'server', 'worker')


def load():
    """The manifest's objects by (kind, name), and its Jobs by the role their pods run."""
    objects = {(d['kind'], d['metadata']['name']): d
               for d in yaml.safe_load_all(MANIFEST.read_text()) if d}
    jobs = {job['spec']['template']['metadata']['labels']['kvps-role']: job
            for (kind, _), job in objects.items() if kind == 'Job'}
    return objects, jobs


def container(job):
    (only,) = job['spec']['template']['spec']['containers']
    return only


def pod(objects, job, index):
    """``(argv, env, mounts)`` of pod ``index`` of ``job`` as Kubernetes would start its
    container: the ConfigMaps it takes its environment from, then its own variables (values
    and fields of the pod), and JOB_COMPLETION_INDEX, which Kubernetes sets in every pod of
    an Indexed Job. ``mounts``: mount path -> the volume's source."""
    spec, main = job['spec']['template']['spec'], container(job)
    env = {}
    for source in main.get('envFrom', []):
        env.update(objects[('ConfigMap', source['configMapRef']['name'])]['data'])
    fields = {'status.podIP': '127.0.0.1', INDEX_FIELD: str(index),
              'metadata.name': f'{job["metadata"]["name"]}-{index}-x7k2p',
              'metadata.namespace': 'default'}
    for item in main.get('env', []):
        env[item['name']] = (item['value'] if 'value' in item else
                             fields[item['valueFrom']['fieldRef']['fieldPath']])
    env['JOB_COMPLETION_INDEX'] = str(index)
    volumes = {v['name']: v for v in spec.get('volumes', [])}
    mounts = {m['mountPath']: volumes[m['name']] for m in main.get('volumeMounts', [])}
    return main['command'] + main.get('args', []), env, mounts


def test_the_manifest_describes_a_kvps_job():
    objects, jobs = load()
    assert sorted(kind for kind, _ in objects) == ['ConfigMap', 'Job', 'Job', 'Job',
                                                   'PersistentVolumeClaim', 'Service']
    assert sorted(jobs) == sorted(ROLES)
    service = next(o for (kind, _), o in objects.items() if kind == 'Service')
    scheduler_pod = jobs['scheduler']['spec']['template']
    # the scheduler's stable name: <Job>-<index> as its host, the headless Service its domain
    assert service['spec']['clusterIP'] == 'None'
    labels = {role: job['spec']['template']['metadata']['labels'] for role, job in jobs.items()}
    selector = service['spec']['selector'].items()
    assert [role for role in ROLES if selector <= labels[role].items()] == ['scheduler']
    assert scheduler_pod['spec']['subdomain'] == service['metadata']['name']
    images = set()
    for role, job in jobs.items():
        spec, count = job['spec'], 1
        assert spec['completionMode'] == 'Indexed' and spec['completions'] == spec['parallelism']
        for index in range(spec['completions']):
            argv, env, mounts = pod(objects, job, index)
            config = Config.from_env(env).require_cluster()
            count = {'server': config.num_servers, 'worker': config.num_workers}.get(role, 1)
            assert env['DMLC_PS_ROOT_URI'] == (f'{jobs["scheduler"]["metadata"]["name"]}-0.'
                                               f'{service["metadata"]["name"]}')
            assert [p['port'] for p in service['spec']['ports']] == [config.scheduler_port]
            assert config.role == role and config.use_kubernetes
            # the rank is the completion index, from nothing else
            if role != 'scheduler':
                assert (config.rank, config.rank_from) == (index, f'JOB_COMPLETION_INDEX={index}')
            secret = mounts[os.path.dirname(config.secret_file)]['secret']
            assert f'kubectl create secret generic {secret["secretName"]}' in MANIFEST.read_text()
            assert f'--from-literal={os.path.basename(config.secret_file)}=' in \
                MANIFEST.read_text()
            assert secret['defaultMode'] == 0o400   # YAML 1.1's octal, as Kubernetes reads it
            if role == 'server':
                claim = mounts[config.checkpoint_dir]['persistentVolumeClaim']['claimName']
                assert ('PersistentVolumeClaim', claim) in objects
                assert config.recovery_timeout and config.unrecoverable() is None
        assert spec['completions'] == count, f'{role}s: completions must be {count}'
        restarts = 'OnFailure' if role == 'server' else 'Never'
        assert job['spec']['template']['spec']['restartPolicy'] == restarts
        assert (spec['backoffLimit'] > 0) == (role == 'server')
        images.add(container(job)['image'])
    assert len(images) == 1   # one placeholder, one kvps version everywhere


def test_kubernetes_accepts_the_manifest():
    """Every object against the API schema of the oldest and newest Kubernetes the package
    knows (offline: kubernetes-validate carries the schemas)."""
    validate = pytest.importorskip('kubernetes_validate')
    from kubernetes_validate.utils import all_versions
    for version in (all_versions()[0], all_versions()[-1]):
        for document in yaml.safe_load_all(MANIFEST.read_text()):
            validate.validate(document, version, strict=True)


@pytest.mark.timeout(240)
def test_the_manifests_pods_form_a_job_and_train(by_hand, tmp_path):
    """Every pod of the three Indexed Jobs, started with the manifest's own environment and
    command (workers in reverse order of their index: the index, not arrival, gives the
    rank), forms the job; the workers train kvps's example to the same weights and the
    servers leave their checkpoints on the claim."""
    objects, jobs = load()
    local = {'secret': tmp_path / 'secret', 'persistentVolumeClaim': tmp_path / 'claim'}
    for directory in local.values():
        directory.mkdir()
    key = local['secret'] / 'secret'            # the Secret's key, a file as Kubernetes mounts it
    key.write_text(secrets.token_hex(32))
    key.chmod(0o400)
    port_file = tmp_path / 'port'

    def start(role, index, port):
        argv, env, mounts = pod(objects, jobs[role], index)
        for path, volume in mounts.items():
            (source,) = set(volume) & set(local)
            env = {k: v.replace(path, str(local[source]), 1) if v.startswith(path) else v
                   for k, v in env.items()}
        env.update({'DMLC_PS_ROOT_URI': '127.0.0.1', 'DMLC_PS_ROOT_PORT': str(port)})
        if role == 'scheduler':
            env['KVPS_PORT_FILE'] = str(port_file)
        argv = [sys.executable if argv[0] == 'python' else argv[0], *argv[1:]]
        return by_hand(role, env, argv=argv, cwd=ROOT)

    scheduler = start('scheduler', 0, 0)
    deadline = time.monotonic() + 60
    while not port_file.exists():
        assert scheduler.poll() is None and time.monotonic() < deadline, scheduler.stdout.read()
        time.sleep(0.05)
    port = int(port_file.read_text())
    count = {role: jobs[role]['spec']['completions'] for role in ROLES}
    servers = [start('server', i, port) for i in range(count['server'])]
    workers = {i: start('worker', i, port) for i in reversed(range(count['worker']))}
    accuracies = set()
    for index, worker in workers.items():
        code, out = by_hand.finish(worker, timeout=180, exits_when='the example ends')
        assert code == 0, out
        (accuracy,) = re.findall(r'^rank (\d+): test accuracy (\S+)$', out, re.M)
        assert int(accuracy[0]) == index, out
        accuracies.add(accuracy[1])
    # one epoch: well above the 63% of always guessing the commoner class
    assert len(accuracies) == 1 and float(accuracies.pop()) > 0.85
    for node in (*servers, scheduler):
        code, out = by_hand.finish(node, exits_when='the workers finished')
        assert code == 0, out
    for rank in range(count['server']):
        assert os.path.exists(path_for(local['persistentVolumeClaim'], rank, count['server']))
