"""Refused messages: every one counted, a bounded number of log lines however many come."""

import logging

import pytest

from kvps.wire import refusals
from kvps.wire.refusals import Refusals


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


@pytest.fixture
def lines(caplog):
    caplog.set_level(logging.WARNING, logger='kvps.wire.refusals')
    return lambda: [r.getMessage() for r in caplog.records if r.name == 'kvps.wire.refusals']


def flood(limiter, sender, count, reason='bad signature'):
    for _ in range(count):
        limiter.refuse(sender, reason, 'refused a message from %r: %s', sender, reason)


def test_a_thousand_refusals_from_one_sender_give_four_lines_then_one_summary(lines):
    clock = Clock()
    limiter = Refusals(clock)
    flood(limiter, b'flooder', 1000)
    assert lines() == ["refused a message from b'flooder': bad signature"] * 3 + [
        "further refusals of messages from b'flooder' are summed up every 10 s"]
    clock.now = 10.0
    limiter.tick(clock.now)   # the flood has stopped: its summary still comes
    assert lines()[4:] == ["refused 997 more messages in the last 10 s: 997 from b'flooder' "
                           "(bad signature)"]
    assert limiter.total == 1000
    clock.now = 20.0
    limiter.tick(clock.now)   # nothing held: no line
    assert len(lines()) == 5


def test_a_flood_that_goes_on_writes_one_line_an_interval(lines):
    clock = Clock()
    limiter = Refusals(clock)
    for second in range(60):
        clock.now = float(second)
        flood(limiter, b'flooder', 100)
    clock.now = 60.0
    limiter.tick(clock.now)
    summaries = [line for line in lines() if line.startswith('refused ') and 'more' in line]
    assert len(summaries) == 6 and len(lines()) == 4 + 6
    held = [int(line.split()[1]) for line in summaries]
    assert sum(held) == 6000 - 3 and limiter.total == 6000   # nothing uncounted


def test_many_senders_are_bounded_too_and_the_busiest_are_named(lines):
    clock = Clock()
    limiter = Refusals(clock)
    for n in range(100):
        flood(limiter, f'stranger-{n}'.encode(), 5 + (n == 42) * 50, reason='malformed')
    # the first ten senders of the interval get their full lines (3 and a note each)
    assert len(lines()) == refusals.NEW_SENDERS * 4
    clock.now = 10.0
    limiter.tick(clock.now)
    summary = lines()[-1]
    assert summary.startswith(f'refused {100 * 5 + 50 - 30} more messages in the last 10 s: '
                              "55 from b'stranger-42' (malformed), 5 from ")
    assert summary.endswith('455 from 97 other sender(s)')   # (the first ten's last two too)
    assert limiter.total == 550


def test_new_senders_get_full_lines_again_in_the_next_interval(lines):
    clock = Clock()
    limiter = Refusals(clock)
    for n in range(refusals.NEW_SENDERS + 1):
        flood(limiter, bytes([n]), 1)
    assert len(lines()) == refusals.NEW_SENDERS
    clock.now = 10.0
    flood(limiter, b'late', 1)
    assert lines()[-1] == "refused a message from b'late': bad signature"
    assert lines()[-2].startswith('refused 1 more messages in the last 10 s')


def test_all_logs_every_refusal_and_zero_only_sums_them_up(lines):
    clock = Clock()
    every = Refusals(clock)
    every.configure('all')
    flood(every, b'x', 50)
    assert len(lines()) == 50
    quiet = Refusals(clock)
    quiet.configure(0)
    flood(quiet, b'x', 50)
    clock.now = 10.0
    quiet.tick(clock.now)
    assert len(lines()) == 51 and quiet.total == 50
