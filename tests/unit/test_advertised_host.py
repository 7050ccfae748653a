"""The address a node tells its peers (and binds): DMLC_NODE_HOST, else DMLC_INTERFACE's
address, else loopback for a scheduler on this host, else the route to the scheduler."""

from kvps.config import Config
from kvps.wire.transport import advertised_host, bind_host

# TEST-NET-1: an address no test box has; reaching the route lookup for it would say so
AWAY = '192.0.2.7'


def config(**env):
    return Config.from_env({'DMLC_PS_ROOT_URI': AWAY, 'DMLC_PS_ROOT_PORT': '9091', **env})


def test_the_interface_gives_its_address_whatever_the_route_to_the_scheduler():
    node = config(DMLC_INTERFACE='lo')
    assert node.interface == 'lo'
    assert advertised_host(node, AWAY) == '127.0.0.1'
    assert bind_host(node, '127.0.0.1') == '127.0.0.1'


def test_the_node_host_wins_over_the_interface_and_is_bound_as_given():
    node = config(DMLC_INTERFACE='lo', DMLC_NODE_HOST='127.0.0.2')
    assert advertised_host(node, AWAY) == '127.0.0.2'
    assert bind_host(node, '127.0.0.2') == '127.0.0.2'
    assert advertised_host(config(KVPS_NODE_HOST='localhost'), AWAY) == 'localhost'


def test_under_kubernetes_a_node_binds_every_interface_and_advertises_its_pod_address():
    pod = config(DMLC_NODE_HOST='10.1.2.3', DMLC_USE_KUBERNETES='1')
    assert advertised_host(pod, AWAY) == '10.1.2.3'   # not this box's: not checked here
    assert bind_host(pod, '10.1.2.3') == '0.0.0.0'


def test_a_scheduler_on_this_host_is_reached_over_loopback():
    assert advertised_host(config(DMLC_PS_ROOT_URI='127.0.0.1'), '127.0.0.1') == '127.0.0.1'
    assert advertised_host(config(DMLC_PS_ROOT_URI='localhost'), '127.0.0.1') == '127.0.0.1'
