"""A pushpull's credit (kvps.worker.credit): a wave leaves once the waves before it hold at
most the credit unanswered; a wait on others' pushes lasts at most PATIENCE, then the call
goes on without a credit; KVPS_PUSHPULL_CREDIT=auto is on for encoded runs only."""

import threading

import numpy as np
import pytest

from kvps.config import Config
from kvps.errors import ConfigError
from kvps.worker import credit as credit_module
from kvps.worker.credit import AUTO_COMPRESSED, Credit
from kvps.worker.messages import pushpull_waves
from kvps.worker.sharding import Sharding


def answered(after=None):
    """An Event set now (None), or by a timer after ``after`` seconds."""
    done = threading.Event()
    if after is None:
        done.set()
    else:
        threading.Timer(after, done.set).start()
    return done


def test_a_wave_waits_for_the_oldest_results_to_fit():
    credit = Credit(10)
    first, second = threading.Event(), threading.Event()
    credit.add(first, 6)
    credit.add(second, 4)
    threading.Timer(0.05, first.set).start()
    credit.admit(5)              # 6 + 4 + 5 > 10: waits for the first wave's results
    assert first.is_set() and not second.is_set()
    assert credit.limit == 10    # still on


def test_waves_that_fit_leave_at_once_and_a_big_one_leaves_alone():
    credit = Credit(10)
    never = threading.Event()
    credit.admit(4)
    credit.add(never, 4)
    credit.admit(6)              # 4 + 6 fits: no wait on a wave never answered
    empty = Credit(10)
    empty.admit(1 << 30)         # nothing in flight: a wave over the credit still leaves


def test_no_answer_within_patience_drops_the_credit_for_the_call(monkeypatch):
    monkeypatch.setattr(credit_module, 'PATIENCE', 0.05)
    credit = Credit(10)
    credit.add(threading.Event(), 8)   # its round waits on a worker that pushes it late
    credit.admit(8)                    # returns after PATIENCE
    assert credit.limit == 0
    credit.add(threading.Event(), 8)
    credit.admit(8)                    # and every later wave leaves at once


def test_no_limit_and_waves_through_shared_memory_take_no_credit():
    off = Credit(0)
    off.add(threading.Event(), 1 << 30)
    off.admit(1 << 30)
    on = Credit(10)
    on.add(threading.Event(), 0)     # all in shared memory: nothing on the socket
    on.admit(10)


def test_auto_is_on_for_encoded_runs_only():
    assert Credit.of('auto', [[]]).limit == 0
    assert Credit.of('auto', iter([])).limit == AUTO_COMPRESSED
    assert Credit.of(0, iter([])).limit == 0
    assert Credit.of(123, [[]]).limit == 123


@pytest.mark.parametrize('text, value', [('auto', 'auto'), ('0', 0), ('4194304', 4 << 20),
                                         (' AUTO ', 'auto')])
def test_the_setting(text, value):
    assert Config.from_env({'KVPS_PUSHPULL_CREDIT': text}).pushpull_credit == value


@pytest.mark.parametrize('text', ['-1', 'lots', '1.5'])
def test_a_bad_setting_is_refused_by_name(text):
    with pytest.raises(ConfigError, match='KVPS_PUSHPULL_CREDIT'):
        Config.from_env({'KVPS_PUSHPULL_CREDIT': text})


def test_waves_count_the_bytes_each_puts_on_the_socket():
    sharding = Sharding(2, bigarray_bound=1000)
    for key, size in (('a', 4000), ('b', 10), ('c', 300_000)):
        sharding.place(key, size, 4)
    pulls = [(k, np.zeros(n, np.float32), 'float32') for k, n in
             (('a', 4000), ('b', 10), ('c', 300_000))]
    copies = [(k, np.zeros(n, np.float32), 'float32') for k, n in
              (('a', 4000), ('b', 10), ('c', 300_000))]
    waves = list(pushpull_waves([copies], pulls, sharding, None))
    assert [(len(p), len(w), n) for p, w, n in waves] == [(3, 3, 4 * 304_010)]
    encoded = [[('a', [np.zeros(4000, np.uint8), np.zeros(4000, np.uint8)], 'fp16')],
               [('b', [np.zeros(20, np.uint8)], 'fp16')]]
    waves = list(pushpull_waves(iter(encoded), pulls[:2], sharding, None))
    assert [([k for k, _, _ in p], [k for k, _, _ in w], n) for p, w, n in waves] == [
        (['a'], ['a'], 8000), (['b'], ['b'], 20)]
