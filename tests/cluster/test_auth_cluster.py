"""A job with a secret refuses every process without it, logs why (a bounded number of lines,
however many messages come), and carries on; the launcher's secrets; payload authentication;
private shared memory."""

import re

import msgpack
import numpy as np
import pytest
import zmq

from kvps.wire import protocol as P
from kvps.wire.identities import worker_identity
from kvps.wire.items import PushItem

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(120)]

SECRET = {'KVPS_SECRET': 'a-job-secret', 'KVPS_LOG_LEVEL': 'INFO'}

WORKER = '''
kv = kvps.create('dist_sync')
kv.init(0, np.zeros(3))
print('READY', flush=True)
while not os.path.exists(os.environ['GO']):
    time.sleep(0.05)
kv.push(0, np.full(3, 2.0))
out = np.zeros(3); kv.pull(0, out=out)
report(out=out.tolist())
'''


def send_raw(port, identity, header, *buffers):
    """What an intruder without the secret can do: well-formed kvps messages, unsigned."""
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, identity)
    sock.setsockopt(zmq.LINGER, 2000)   # deliver the message even though we close right away
    sock.connect(f'tcp://127.0.0.1:{port}')
    sock.send_multipart([msgpack.packb(header), *buffers])
    answered = sock.poll(500)
    sock.close()
    return answered


def flood(port, identity, count):
    """A stranger's flood: ``count`` unsigned heartbeats from one socket, all delivered."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, identity)
    sock.setsockopt(zmq.LINGER, 5000)
    sock.connect(f'tcp://127.0.0.1:{port}')
    for n in range(count):
        sock.send_multipart([msgpack.packb({'op': 'heartbeat', 'id': n})])
    sock.close()


def server_port(proc_output_lines):
    for line in proc_output_lines:
        if 'serving on' in line:
            return int(line.rsplit(':', 1)[1])


def test_intruders_are_refused_everywhere_and_the_job_carries_on(by_hand, tmp_path):
    sched, env = by_hand.scheduler(num_workers=1, num_servers=1, extra=SECRET)
    server = by_hand('server', env)
    go = tmp_path / 'go'
    worker = by_hand('worker', {**env, 'GO': str(go)}, script=WORKER)
    for line in worker.stdout:
        if 'READY' in line:
            break
    port = None
    for line in server.stdout:
        port = server_port([line])
        if port:
            break
    scheduler_port = int(env['DMLC_PS_ROOT_PORT'])

    # Without the secret: register, barrier and finish at the scheduler; push, pull and
    # set_optimizer at the server, each as a job member would send it (a push of today's
    # format that would change the key). None is answered, each refusal is logged.
    assert not send_raw(scheduler_port, b'intruder-1', {'op': 'register', 'id': 1,
                                                        'role': 'worker', 'host': 'x', 'port': 0,
                                                        'version': P.VERSION})
    assert not send_raw(scheduler_port, b'intruder-2', {'op': 'finish', 'id': 1})
    push = {'op': 'push', 'id': 1, 'sync': True,
            'keys': [list(PushItem(0, 0, 'float64', 3, None, 0))]}
    P.validate_header(push)   # well formed: only the missing secret stops it
    assert not send_raw(port, b'intruder-3', push, np.full(3, 100.0).tobytes())
    assert not send_raw(port, b'intruder-4', {'op': 'pull', 'id': 2, 'key': 0, 'part': 0})
    assert not send_raw(port, b'intruder-5', {'op': 'set_optimizer', 'id': 3},
                        msgpack.packb({'name': 'sgd'}))
    # Posing as the real worker under the name a job without a secret gives it: the real
    # worker's carries a tag only the job's members can make, so this is one more stranger
    # (refused by authentication), and its connection takes nothing from the real worker's.
    assert not send_raw(port, worker_identity(0), push, np.full(3, 100.0).tobytes())
    # A flood of a thousand at each: counted, summed up, and harmless.
    flood(scheduler_port, b'flooder', 1000)
    flood(port, b'flooder', 1000)
    # A kvps worker with the wrong secret cannot join either; it fails with a clear error.
    stranger = by_hand('worker', {**env, 'KVPS_SECRET': 'wrong', 'KVPS_CONNECT_TIMEOUT': '2'},
                       script='kvps.create("dist_sync")\n')
    code, out = by_hand.finish(stranger)
    assert code != 0 and 'RequestTimeout' in out
    assert "check that this node has the job's KVPS_SECRET" in out   # the likely cause

    go.write_text('')
    code, out = by_hand.finish(worker)
    assert code == 0 and '"out": [2.0, 2.0, 2.0]' in out, out   # the intruders changed nothing
    assert sched.wait(30) == 0 and server.wait(30) == 0
    logs = sched.stdout.read() + server.stdout.read()
    # Refused by authentication itself, in its words (a server that skipped it would still
    # refuse these strangers, in other words: as no worker of the job):
    for n in range(1, 6):
        assert re.search(f"refused a message from b'intruder-{n}': (message without an "
                         'authentication prefix|bad signature)', logs), logs
    assert re.search("refused a message from b'worker-0': (message without an "
                     'authentication prefix|bad signature)', logs), logs   # the impostor
    assert 'bad signature' in logs                       # the worker with the wrong secret
    # The floods: each node wrote the flooder's first three refusals, a note and a summary.
    assert logs.count("refused a message from b'flooder'") == 6, logs
    # (the scheduler's also counts the wrong-secret worker's beats while it waited to join)
    summaries = re.findall(r"refused (\d+) more messages in the last \d+ s: "
                           r"(\d+) from b'flooder'[^,\n]*(?:, (\d+) from b'worker-\w+' "
                           r"\(bad signature\))?\n", logs)
    assert len(summaries) == 2 and all(int(total) == int(flood) + int(beats or 0) and
                                       flood == '997' for total, flood, beats in summaries), logs
    assert len(logs.splitlines()) < 40, logs


SECRET_SEEN = '''
import hashlib
secret = os.environ.get('KVPS_SECRET')
kv = kvps.create('dist_sync')
kv.init(0, np.zeros(2))
kv.push(0, np.ones(2))
out = np.zeros(2); kv.pull(0, out=out)
argv = [open(f'/proc/{pid}/cmdline', 'rb').read() for pid in (os.getpid(), os.getppid())]
report(digest=secret and hashlib.sha256(secret.encode()).hexdigest(),
       secret_bytes=len(secret or ''), on_command_line=bool(secret) and any(secret.encode() in a for a in argv), out=out.tolist())
'''


def test_the_launcher_gives_each_job_a_fresh_secret_and_no_auth_none(job):
    digests = []
    for _ in range(2):
        result = job(SECRET_SEEN, 2, 1)
        assert result.returncode == 0, result.output
        seen = result.results()
        assert {r['digest'] for r in seen.values()} == {seen[0]['digest']}   # one per job
        assert seen[0]['secret_bytes'] == 64 and seen[0]['out'] == [2.0, 2.0]
        assert not any(r['on_command_line'] for r in seen.values())   # (worker, launcher)
        digests.append(seen[0]['digest'])
    assert digests[0] != digests[1]
    result = job(SECRET_SEEN, 2, 1, launcher_args=['--no-auth'])
    assert result.returncode == 0, result.output
    assert [r['digest'] for r in result.results().values()] == [None, None]
    assert result.results()[1]['out'] == [2.0, 2.0]


SHARED_MEMORY = '''
import stat
kv = kvps.create('dist_sync')
kv.init(0, np.zeros(50_000, np.float32))
for step in range(3):
    kv.push(0, np.full(50_000, kv.rank + 1.0, np.float32))
    out = np.empty(50_000, np.float32); kv.pull(0, out=out)
modes = []
for line in open('/proc/self/maps'):
    if '/dev/shm/' in line:   # this worker's segment, and the server's arena it reads
        mode = os.stat('/proc/self/map_files/' + line.split()[0]).st_mode
        modes.append(oct(stat.S_IMODE(mode)))
stats = kv.stats()
report(out=sorted(set(out.tolist())), modes=modes, pushed=stats['pushed_bytes'],
       pulled=stats['pulled_bytes'])
'''


def test_payload_authentication_and_private_shared_memory_in_a_real_job(job):
    """KVPS_AUTH_PAYLOAD=1 signs every payload frame, beside shared-memory payloads (which
    never cross a network: signed headers name their blocks, in segments of mode 0600 that
    only the job's user can open); values are exact and every segment is private."""
    result = job(SHARED_MEMORY, 2, 1, env={'KVPS_AUTH_PAYLOAD': '1'})
    assert result.returncode == 0, result.output
    for seen in result.results().values():
        assert seen['out'] == [3.0]   # 1 + 2: without an optimizer the sum replaces
        assert seen['pushed']['shm'] == 3 * 200_000 and seen['pulled']['shm'] > 0, seen
        assert seen['modes'] and set(seen['modes']) == {'0o600'}, seen
