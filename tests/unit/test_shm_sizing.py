"""How much of /dev/shm a job takes: KVPS_SHM_BYTES as given, or with 'auto' a share that fits
a container's small /dev/shm, and nothing where no server shares a worker's host."""

import logging
import os
import types

import pytest

from kvps.config import Config
from kvps.errors import ConfigError
from kvps.server.regions import Regions
from kvps.wire import shm
from kvps.wire.identities import members_on
from kvps.wire.shm import Segment, segment_bytes, share_of
from kvps.worker.staging import Staging

MiB = 1 << 20


@pytest.fixture
def shm_of_size(monkeypatch):
    """Make the shared-memory filesystem appear ``total`` bytes big (None: unreadable)."""
    def fake(total):
        def statvfs(path):
            if total is None:
                raise FileNotFoundError(path)
            return types.SimpleNamespace(f_blocks=total // 4096, f_frsize=4096,
                                         f_bavail=total // 4096)
        monkeypatch.setattr(shm.os, 'statvfs', statvfs)
    return fake


def test_docker_default_of_64_mib_is_split_among_the_processes_on_the_host(shm_of_size):
    shm_of_size(64 * MiB)
    share = share_of(3)                      # W2 S1: each takes a sixth, half left to others
    assert share == 32 * MiB // 3 // shm.MIN_BYTES * shm.MIN_BYTES
    assert 3 * share <= 32 * MiB and share % shm.MIN_BYTES == 0
    assert share_of(6) >= 5 * MiB            # W4 S2 still gets 5 MiB each
    assert share_of(20) == 0                 # 1.6 MiB each: not worth a segment


def test_a_big_dev_shm_is_split_alike_since_pages_are_reserved_only_as_used(shm_of_size):
    shm_of_size(64 << 30)
    assert share_of(4) == 8 << 30   # a value of GBs takes shared memory, not the socket
    shm_of_size(None)
    assert share_of(4) == 0


def test_an_explicit_size_is_taken_as_given(shm_of_size):
    shm_of_size(64 * MiB)
    assert segment_bytes(100 * MiB, 3) == 100 * MiB
    assert segment_bytes('auto', 3) == share_of(3)


@pytest.mark.parametrize('text, value', [('auto', 'auto'), (' AUTO ', 'auto'),
                                         ('1048576', 1 << 20)])
def test_kvps_shm_bytes_takes_auto_or_a_size(text, value):
    assert Config.from_env({'KVPS_SHM_BYTES': text}).shm_bytes == value
    assert Config.from_env({}).shm_bytes == 'auto'


@pytest.mark.parametrize('text', ['0', '-5', 'lots'])
def test_a_bad_kvps_shm_bytes_names_the_variable(text):
    with pytest.raises(ConfigError, match='KVPS_SHM_BYTES'):
        Config.from_env({'KVPS_SHM_BYTES': text})


def test_a_worker_whose_share_is_too_small_uses_the_socket(shm_of_size, caplog):
    shm_of_size(64 * MiB)
    with caplog.at_level(logging.WARNING, logger='kvps.worker'):
        assert Staging.create(Config(), sharers=20) is None
    assert 'KVPS_SHM_BYTES' in caplog.text


def _welcome(*members):
    return {'nodes': [{'role': role, 'host': host} for role, host in members]}


def test_members_on_a_host_are_counted_by_role():
    welcome = _welcome(('worker', 'a'), ('worker', 'a'), ('server', 'a'), ('worker', 'b'),
                       ('scheduler', 'a'))
    assert members_on(welcome, 'a', 'worker') == 2
    assert members_on(welcome, 'a', 'server') == 1
    assert members_on(welcome, 'b', 'server') == 0


def _staging_of(host, welcome, config=None):
    """What the worker I/O thread sets up for ``host`` with this welcome."""
    return Staging.for_job(config or Config(shm_bytes=4 * MiB), welcome, host)


def test_a_worker_with_no_server_on_its_host_reserves_no_segment():
    welcome = _welcome(('server', '10.0.0.1'), ('worker', '10.0.0.2'))
    assert _staging_of('10.0.0.2', welcome) is None


def test_a_worker_beside_a_server_splits_dev_shm_with_everyone_on_its_host(shm_of_size):
    shm_of_size(64 * MiB)
    welcome = _welcome(('server', 'h'), ('worker', 'h'), ('worker', 'h'), ('server', 'x'))
    staging = _staging_of('h', welcome, Config())
    try:
        assert staging.segment.size == share_of(3)   # itself, the other worker, the server
    finally:
        staging.segment.close()


def test_a_server_without_a_share_lends_no_arena_but_maps_workers(tmp_path, caplog):
    worker_segment = Segment.create(MiB, directory=tmp_path)
    regions = Regions(directory=tmp_path, arena_bytes=0, neighbours=1)
    with caplog.at_level(logging.WARNING):
        assert regions.attach(b'worker-0', worker_segment.describe()) is None
    assert 'under 2 MiB' in caplog.text and regions.arena is None
    assert len(regions.view(b'worker-0', shm.HEADER_BYTES, 64)) == 64   # still mapped
    worker_segment.unlink()
    assert os.listdir(tmp_path) == []
