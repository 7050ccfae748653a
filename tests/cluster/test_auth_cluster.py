"""A job with a secret refuses every process without it, logs why, and carries on."""


import msgpack
import pytest
import zmq


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
    # set_optimizer at the server. None is answered, each refusal is logged.
    assert not send_raw(scheduler_port, b'intruder-1', {'op': 'register', 'id': 1,
                                                        'role': 'worker', 'host': 'x', 'port': 0})
    assert not send_raw(scheduler_port, b'intruder-2', {'op': 'finish', 'id': 1})
    push = {'op': 'push', 'id': 1, 'key': 0, 'part': 0, 'dtype': 'float64', 'n': 3,
            'sync': True}
    assert not send_raw(port, b'intruder-3', push, b'\0' * 24)
    assert not send_raw(port, b'intruder-4', {'op': 'pull', 'id': 2, 'key': 0, 'part': 0})
    assert not send_raw(port, b'intruder-5', {'op': 'set_optimizer', 'id': 3},
                        msgpack.packb({'name': 'sgd'}))
    # Posing as the real worker: zmq drops a second peer with a taken identity, and the
    # real worker's connection is not disturbed (checked by its result below).
    assert not send_raw(port, b'worker-0', push, b'\0' * 24)
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
    for n in range(1, 6):
        assert f"refused a message from b'intruder-{n}'" in logs
    assert 'bad signature' in logs                       # the worker with the wrong secret
