"""KVPS_PORT_RANGE: a job's scheduler and servers bind only ports of the range (what a
firewall that opens only these lets through), and a range with no port left fails at start,
naming the node and the range."""

import re
import socket

import pytest

pytestmark = pytest.mark.timeout(120)

SCRIPT = '''
kv = kvps.create('dist_sync')
kv.init(3, np.ones(4, np.float32))
out = np.zeros(4, np.float32)
kv.pull(3, out=out)
report(rank=kv.rank, w=out.tolist())
'''
BOUND = re.compile(r'^\[(scheduler|server \d)\] .* (?:listening|serving) on 127\.0\.0\.1:(\d+)$',
                   re.M)


def _ports_from(first_free, width):
    """``width`` ports from one the OS just gave (others in them are skipped by the nodes)."""
    return range(min(first_free, 65535 - width), min(first_free, 65535 - width) + width)


def _os_port():
    with socket.socket() as probe:
        probe.bind(('127.0.0.1', 0))
        return probe.getsockname()[1]


def test_every_node_binds_a_port_of_the_range(job):
    ports = _ports_from(_os_port(), 10)
    result = job(SCRIPT, workers=1, servers=2,
                 env={'KVPS_PORT_RANGE': f'{ports[0]}-{ports[-1]}', 'KVPS_LOG_LEVEL': 'INFO'})
    assert result.returncode == 0, result.output
    assert result.results() == {0: {'rank': 0, 'w': [1.0] * 4}}
    bound = dict(BOUND.findall(result.stdout))      # the nodes' own 'listening on' lines
    assert sorted(bound) == ['scheduler', 'server 0', 'server 1'], result.output
    assert all(int(port) in ports for port in bound.values()), bound


def test_a_range_with_every_port_taken_fails_naming_it(job):
    port = _os_port()
    result = job(SCRIPT, workers=1, servers=1, env={'KVPS_PORT_RANGE': f'{port}-{port}'})
    # the scheduler took the only port; the server finds none and the job stops on it
    assert result.returncode == 1, result.output
    assert 'kvps.launch: server 0 (pid ' in result.stderr
    assert (f'server failed: KVPS_PORT_RANGE={port}-{port}: every port of it is in use on '
            '127.0.0.1 (1 tried); widen the range') in result.output
