"""Server checkpoints: exact round trip, the resume rule for init, and when one is due."""

import os

import numpy as np
import pytest

from kvps.errors import ConfigError, DuplicateInitError, ShapeError
from kvps.optimizer import create
from kvps.server.checkpoint import Checkpointer, restore, snapshot
from kvps.server.recovery import rebase
from kvps.server.shard import Shard
from kvps.wire.items import ResumeItem

W0 = b'worker-0'


def buf(values, dtype=np.float32):
    return memoryview(np.asarray(values, dtype=dtype)).cast('B')


def trained_shard():
    shard = Shard(1)
    shard.init(None, 'w', 0, 'float32', [2, 2], True, buf([1, 2, 3, 4]))
    shard.init(None, 7, 1, 'float16', [3], False, buf([1, 1, 1], np.float16))
    shard.set_optimizer(create('adam', learning_rate=0.1).to_spec())
    for _ in range(3):
        shard.push(None, W0, 'w', 0, 'float32', True, buf([1, -1, 2, -2]))
    return shard


def test_snapshot_restores_weights_and_optimizer_exactly():
    shard = trained_shard()
    resumed = Shard(1)
    restore(resumed, snapshot(shard))
    assert resumed.entries[('w', 0)].weight.tolist() == shard.entries[('w', 0)].weight.tolist()
    assert resumed.entries[(7, 1)].weight.dtype == np.float16
    for s in (shard, resumed):
        s.push(None, W0, 'w', 0, 'float32', True, buf([1, 1, 1, 1]))
    assert resumed.entries[('w', 0)].weight.tolist() == shard.entries[('w', 0)].weight.tolist()


def test_init_of_a_restored_key_keeps_the_checkpoint_once():
    resumed = Shard(1)
    restore(resumed, snapshot(trained_shard()))
    before = resumed.entries[('w', 0)].weight.tolist()
    resumed.init(None, 'w', 0, 'float32', [2, 2], True, buf([0, 0, 0, 0]))
    assert resumed.entries[('w', 0)].weight.tolist() == before
    with pytest.raises(DuplicateInitError):
        resumed.init(None, 'w', 0, 'float32', [2, 2], True, buf([0, 0, 0, 0]))
    with pytest.raises(ShapeError, match='checkpoint holds'):
        resumed.init(None, 7, 1, 'float16', [4], False, buf([0, 0, 0, 0], np.float16))


def test_garbage_is_not_a_checkpoint(tmp_path):
    with pytest.raises(ConfigError, match='unreadable server checkpoint'):
        restore(Shard(1), b'\x93\x01\x02\x03')
    torn = Checkpointer(str(tmp_path), 0, 1, job='this')
    with open(torn.path, 'wb') as f:   # (say, truncated by a full disk outside kvps)
        f.write(snapshot(trained_shard(), 'this')[:-9])
    with pytest.raises(ConfigError, match=f'unreadable server checkpoint {torn.path}: '):
        torn.load(Shard(1), rounds=True)


def test_due_by_updates_or_seconds_and_only_after_changes(tmp_path):
    by_count = Checkpointer(str(tmp_path), 0, 1, every=3, now=0)
    assert not by_count.due(2, now=100) and by_count.due(3, now=0)
    by_time = Checkpointer(str(tmp_path), 0, 1, seconds=10, now=0)
    assert not by_time.due(1, now=5) and by_time.due(1, now=10)
    shard = trained_shard()
    by_time.write(shard, now=10)
    assert not by_time.due(shard.updates, now=50)       # nothing changed since
    resumed = Shard(1)
    assert Checkpointer(str(tmp_path), 0, 1).load(resumed)
    assert not Checkpointer(str(tmp_path / 'new'), 0, 1).load(Shard(1))   # nothing: fresh start


def test_round_counts_come_back_only_for_a_server_rejoining_its_job():
    shard = Shard(1)
    shard.init(None, 'k', 0, 'float32', [2], False, memoryview(np.ones(2, np.float32)).cast('B'))
    shard.push(None, b'worker-0', 'k', 0, 'float32', False,
               memoryview(np.ones(2, np.float32)).cast('B'), seq=0)
    blob = snapshot(shard)
    rejoined, fresh = Shard(1), Shard(1)
    restore(rejoined, blob, rounds=True)
    restore(fresh, blob)
    assert rejoined.entries[('k', 0)].version == 1
    assert rejoined.entries[('k', 0)].pushed == {b'worker-0': 1}
    # A new job's workers count their pushes from 0 again: nothing may look like a resend.
    assert fresh.entries[('k', 0)].version == 0 and fresh.entries[('k', 0)].pushed == {}


def test_a_rejoining_server_takes_only_its_own_jobs_checkpoint(tmp_path):
    # Another run's file (an old job left it in the directory) would pass for this job's: the
    # workers' acknowledged pushes would be silently lost. A missing file is as bad.
    with pytest.raises(ConfigError, match='finds no checkpoint'):
        Checkpointer(str(tmp_path), 0, 1, job='this').load(Shard(1), rounds=True)
    # ... unless no server of its rank wrote one (lost as it joined: it served nothing)
    empty = Shard(1)
    assert not Checkpointer(str(tmp_path), 0, 1, job='this').load(empty, rounds=True,
                                                                  predecessor_wrote=False)
    assert empty.entries == {}
    Checkpointer(str(tmp_path), 0, 1, job='earlier').write(trained_shard(), now=0)
    with pytest.raises(ConfigError, match='written by another job'):
        Checkpointer(str(tmp_path), 0, 1, job='this').load(Shard(1), rounds=True)
    assert Checkpointer(str(tmp_path), 0, 1, job='this').load(Shard(1))   # a new job resumes
    assert Checkpointer(str(tmp_path), 0, 1, job='earlier').load(Shard(1), rounds=True)


def test_two_running_jobs_cannot_share_a_checkpoint_directory(tmp_path):
    """A server holds its rank's lock file while it lives: a server of another job is refused
    (it would resume from a live job's file and write over it), one of the same job (the
    replacement of a stopped server) is not; and a server whose file another job wrote since
    says so, rather than take itself for replaced."""
    live = Checkpointer(str(tmp_path), 0, 1, job='first')
    live.claim()
    with pytest.raises(ConfigError, match=r'another job that is still running \(run first\)'):
        Checkpointer(str(tmp_path), 0, 1, job='second').claim()
    Checkpointer(str(tmp_path), 0, 1, job='first').claim()   # its replacement
    Checkpointer(str(tmp_path), 1, 2, job='second').claim()   # (another file: no conflict)
    live.write(trained_shard(), now=0)
    Checkpointer(str(tmp_path), 0, 1, job='second').write(trained_shard(), now=0)
    with pytest.raises(ConfigError, match=r'written by another job \(run second\)'):
        live.write(trained_shard(), now=1)
    live.release()   # (its clean end: the directory keeps only the checkpoints)
    assert not os.path.exists(live.path + '.lock')


def test_rebase_counts_the_rounds_a_checkpoint_missed():
    shard = trained_shard()   # 'w' at round 3
    restored = Shard(1)
    restore(restored, snapshot(shard), rounds=True)
    lost = rebase(restored.entries, {W0: [ResumeItem('w', 0, 5), ResumeItem(7, 1, 0)]}, [W0])
    assert lost == {('w', 0): 2} and restored.entries[('w', 0)].version == 5


def test_a_failed_write_keeps_the_previous_checkpoint_and_says_why(tmp_path, monkeypatch):
    checkpointer = Checkpointer(str(tmp_path), 0, 1, every=1)
    shard = trained_shard()
    checkpointer.write(shard, now=0)
    kept = shard.entries[('w', 0)].weight.tolist()
    shard.push(None, W0, 'w', 0, 'float32', True, buf([1, 1, 1, 1]))

    def crash(src, dst):   # the write dies before its rename (disk full, a crash)
        raise OSError(28, 'No space left on device')
    monkeypatch.setattr('os.replace', crash)
    with pytest.raises(ConfigError, match='cannot write the checkpoint .*No space left'):
        checkpointer.write(shard, now=1)
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ['server-0-of-1.kvps']   # no temp left
    resumed = Shard(1)
    assert checkpointer.load(resumed)
    assert resumed.entries[('w', 0)].weight.tolist() == kept


def test_a_job_with_another_number_of_servers_is_refused_not_started_afresh(tmp_path):
    # Keys are split and placed by the number of servers: a job of 3 finds no file of its
    # own among a job of 2's, and would silently train from its init values.
    for rank in range(2):
        Checkpointer(str(tmp_path), rank, 2).write(trained_shard(), now=0)
    for rank in range(3):
        with pytest.raises(ConfigError, match=r'server-0-of-2.kvps, server-1-of-2.kvps.*'
                                              r'3 servers'):
            Checkpointer(str(tmp_path), rank, 3).load(Shard(1))
    assert Checkpointer(str(tmp_path), 1, 2).load(Shard(1))   # the same size resumes


def test_a_server_without_its_file_is_refused_only_among_an_earlier_jobs_files(tmp_path):
    def server(rank, job):
        return Checkpointer(str(tmp_path), rank, 2, job=job)

    def refuses_server_1():
        with pytest.raises(ConfigError, match=rf'{tmp_path} holds checkpoints of an earlier '
                                              r'job with 2 servers \(server-0-of-2.kvps\) but '
                                              r'none for server 1'):
            server(1, 'now').load(Shard(1))
    # Server 0 of this job wrote its file before server 1 looked: nothing to resume from.
    server(0, 'now').write(trained_shard(), now=0)
    assert not server(1, 'now').load(Shard(1))
    # An earlier job's file, and the same file once this job resumed and rewrote it.
    server(0, 'before').write(trained_shard(), now=0)
    refuses_server_1()
    resuming, shard = server(0, 'now'), Shard(1)
    assert resuming.load(shard)
    resuming.write(shard, now=0)
    refuses_server_1()


def test_a_checkpoint_dir_that_cannot_be_made_is_named(tmp_path):
    """A server failing with ConfigError tells the job why (ABORT) at once; an OSError was a
    traceback on the server, and the workers heard only of a lost heartbeat later."""
    taken = tmp_path / 'a_file'
    taken.write_text('')
    with pytest.raises(ConfigError, match=f"KVPS_CHECKPOINT_DIR='{taken}/sub': cannot create "
                                          'it: Not a directory'):
        Checkpointer(str(taken / 'sub'), 0, 1)


def test_a_server_whose_replacement_wrote_its_file_writes_no_more(tmp_path):
    """A server stopped while a replacement took its rank must not write its stale state
    over its successor's once it wakes; a file gone, or of no writer, fences nothing."""
    from kvps.server.checkpoint import Superseded
    old, new = (Checkpointer(str(tmp_path), 0, 1, job='j') for _ in range(2))
    old.write(trained_shard(), 0.0)
    old.write(trained_shard(), 1.0)                  # its own file: goes on writing
    new.write(Shard(1), 2.0)                         # the replacement joins
    successors = (tmp_path / 'server-0-of-1.kvps').read_bytes()
    with pytest.raises(Superseded, match='written by another server of this rank'):
        old.write(trained_shard(), 3.0)
    assert (tmp_path / 'server-0-of-1.kvps').read_bytes() == successors
    new.write(Shard(1), 4.0)                         # the successor is not fenced by itself
    os.unlink(tmp_path / 'server-0-of-1.kvps')
    new.write(Shard(1), 5.0)                         # (a file removed by hand fences nothing)
