"""Jobs started by hand with ranks from a cluster manager's variables, a rank claimed twice,
and nodes advertising the address DMLC_INTERFACE or DMLC_NODE_HOST gives them."""

import json
import re
import signal
from pathlib import Path

import pytest
from hostile_peers import Output

# Each worker says which rank it got, then one sync round shows the job works.
WORKER = '''
kv = kvps.kvstore.create('dist_sync')
report(rank=kv.rank, num_workers=kv.num_workers)
kv.init(0, np.zeros(3, np.float32))
kv.push(0, np.full(3, kv.rank + 1, np.float32))
out = np.empty(3, np.float32)
kv.pull(0, out=out)
report(pulled=out.tolist())
'''


def results(output):
    return [json.loads(line.split('RESULT ', 1)[1]) for line in output.splitlines()
            if line.startswith('RESULT ')]


def test_workers_take_their_ranks_from_dmlc_worker_id_whatever_order_they_start_in(by_hand):
    """The worker started first has DMLC_WORKER_ID=1: without the ids, ranks would follow
    the order of registration and it would be rank 0. The scheduler's table of the formed
    job shows each rank at the process that asked for it."""
    sched, env = by_hand.scheduler(2, 1, extra={'KVPS_LOG_LEVEL': 'INFO'})
    log = Output(sched)
    server = by_hand('server', {**env, 'DMLC_SERVER_ID': '0'})
    first = by_hand('worker', {**env, 'DMLC_WORKER_ID': '1'}, script=WORKER)
    log.wait_for(rf'registered worker 1 \(host 127\.0\.0\.1, pid {first.pid}, rank from '
                 r'DMLC_WORKER_ID=1\)', 60)
    second = by_hand('worker', {**env, 'DMLC_WORKER_ID': '0'}, script=WORKER)
    for worker, rank in ((first, 1), (second, 0)):
        code, out = by_hand.finish(worker, exits_when='the job ends')
        assert code == 0, out
        assert results(out) == [{'rank': rank, 'num_workers': 2}, {'pulled': [3.0] * 3}], out
    assert by_hand.finish(server)[0] == 0
    assert log.exit_code(30) == 0, log.text
    table = re.search(r'all 3 nodes registered: (.*)', log.text).group(1)
    port = re.search(r'server 0 at 127\.0\.0\.1:(\d+) ', table).group(1)
    assert table == (f'server 0 at 127.0.0.1:{port} (pid {server.pid}), worker 0 at 127.0.0.1 '
                     f'(pid {second.pid}), worker 1 at 127.0.0.1 (pid {first.pid})')


def test_a_rank_claimed_twice_is_refused_naming_both_processes(by_hand):
    """The refused process, the scheduler's log and the reason the job ends with (which a
    launcher reads to blame a node) all name both claims: host, pid and the setting."""
    sched, env = by_hand.scheduler(2, 1, extra={'KVPS_LOG_LEVEL': 'INFO',
                                                'KVPS_CONNECT_TIMEOUT': '30'})
    log = Output(sched)
    server = by_hand('server', env)
    log.wait_for(rf'registered server \(host 127\.0\.0\.1, pid {server.pid}\)', 60)
    holder = by_hand('worker', {**env, 'KVPS_RANK': '1'}, script=WORKER)
    log.wait_for(rf'registered worker 1 \(host 127\.0\.0\.1, pid {holder.pid}, rank from '
                 r'KVPS_RANK=1\)', 60)
    claimant = by_hand('worker', {**env, 'DMLC_WORKER_ID': '1'}, script=WORKER)
    code, out = by_hand.finish(claimant, exits_when='the scheduler refuses its rank')
    both = (f'worker rank 1 is claimed twice: worker 1 (host 127.0.0.1, pid {holder.pid}, rank '
            f'from KVPS_RANK=1) has it, so worker 1 (host 127.0.0.1, pid {claimant.pid}, rank '
            'from DMLC_WORKER_ID=1) is refused; give every worker its own rank')
    assert code != 0 and f'ConfigError: {both} (on scheduler)' in out, out
    log.wait_for(re.escape(both), 10)
    # the job never forms: it ends at KVPS_CONNECT_TIMEOUT, saying who is missing and why
    assert log.exit_code(60) == 1, log.text
    blame = json.loads(Path(env['KVPS_PORT_FILE'] + '.blame').read_text())
    assert blame['blame'] == [['worker', 0]]
    assert blame['reason'].endswith(f'(missing: worker 0; registered: server (host 127.0.0.1, '
                                    f'pid {server.pid}), worker 1 (host 127.0.0.1, pid '
                                    f'{holder.pid}); refused: {both}) (KVPS_CONNECT_TIMEOUT)'), \
        blame
    for node in (holder, server):
        assert by_hand.finish(node, exits_when='the scheduler ends the job')[0] != 0


def test_a_node_that_dies_before_the_job_forms_gives_its_rank_to_a_restarted_one(by_hand):
    """As a cluster manager restarts a pod with its index: the holder of worker rank 1 stops
    answering (SIGSTOP: it cannot beat) while the job forms; its restarted copy claims rank 1,
    takes it once the holder has missed its beats, and the job forms and trains with it. The
    holder, woken, is told it left the job, and ends."""
    sched, env = by_hand.scheduler(2, 1, extra={'KVPS_LOG_LEVEL': 'INFO'})
    log = Output(sched)
    server = by_hand('server', {**env, 'DMLC_SERVER_ID': '0'})
    holder = by_hand('worker', {**env, 'DMLC_WORKER_ID': '1'}, script=WORKER)
    log.wait_for(rf'registered worker 1 \(host 127\.0\.0\.1, pid {holder.pid}', 60)
    holder.send_signal(signal.SIGSTOP)
    restarted = []
    try:
        # a claim that comes too early is refused (the holder might be alive); the restarted
        # process of a cluster manager tries again, as this loop does
        left = log.wait_for(r'left the forming job: (.*?); \d+ of 3 nodes registered', 60,
                            lambda: _claim_again(by_hand, env, restarted))
    finally:
        holder.send_signal(signal.SIGCONT)
    new = restarted[-1]
    assert f'worker 1 (host 127.0.0.1, pid {holder.pid}, rank from DMLC_WORKER_ID=1) left' \
        in log.text, log.text
    assert left.group(1).startswith(f'worker 1 (host 127.0.0.1, pid {new.pid}, rank from '
                                    'DMLC_WORKER_ID=1) took its rank after ') or \
        left.group(1).startswith('nothing heard from it for'), left.group(1)
    first = by_hand('worker', {**env, 'DMLC_WORKER_ID': '0'}, script=WORKER)
    for worker, rank in ((new, 1), (first, 0)):
        code, out = by_hand.finish(worker, exits_when='the job ends')
        assert code == 0, out
        assert results(out) == [{'rank': rank, 'num_workers': 2}, {'pulled': [3.0] * 3}], out
    code, out = by_hand.finish(holder, exits_when='the scheduler tells it it left the job')
    assert code != 0 and 'ConfigError: this node left the forming job: ' in out, out
    assert by_hand.finish(server)[0] == 0
    assert log.exit_code(30) == 0, log.text



def _claim_again(by_hand, env, claims):
    """Start a claimant of worker rank 1 unless one is still waiting for its answer."""
    if claims and claims[-1].poll() is None:
        return
    claims.append(by_hand('worker', {**env, 'DMLC_WORKER_ID': '1'}, script=WORKER))


@pytest.mark.parametrize('env, host', [
    ({'DMLC_INTERFACE': 'lo'}, '127.0.0.1'),
    # servers bind 127.0.0.2 alone: the job works only if peers dial what they advertise
    ({'DMLC_NODE_HOST': '127.0.0.2'}, '127.0.0.2'),
])
def test_nodes_advertise_the_address_the_interface_or_node_host_gives(job, env, host):
    result = job(WORKER, workers=2, servers=2, env={**env, 'KVPS_LOG_LEVEL': 'INFO'})
    assert result.returncode == 0, result.output
    assert [r['pulled'] for r in result.results().values()] == [[3.0] * 3] * 2, result.output
    table = re.search(r'all 4 nodes registered: (.*)', result.output).group(1)
    entries = re.findall(r'(\w+ \d) at ([\d.]+)(?::\d+)? \(pid \d+\)', table)
    assert entries == [('server 0', host), ('server 1', host), ('worker 0', host),
                       ('worker 1', host)], table
