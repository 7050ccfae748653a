"""Fixtures shared by the unit tests."""

import pytest

from kvps.kvstore.local import LocalBackend
from kvps.wire.refusals import REFUSALS


class RecordingBackend(LocalBackend):
    """The in-process backend, holding every pushed buffer as the worker client does until the
    servers acknowledge the push (it sends them without copying)."""

    def __init__(self):
        super().__init__()
        self.held = []

    def push(self, items, priority=0):
        self.held += [flat for _, flat, _ in items]
        super().push(items, priority)


@pytest.fixture
def recording_backend():
    return RecordingBackend()


@pytest.fixture(autouse=True)
def fresh_refusals():
    """Each test starts with no refusals counted: the log budget is per process, and a test
    that checks a refusal is logged must not find it spent by an earlier test."""
    REFUSALS.reset()
    yield
    REFUSALS.reset()


@pytest.fixture
def locker(monkeypatch):
    """A fresh kvps.pinning registry for this test, locking with a HostLocker (returned)."""
    from page_locking import HostLocker

    from kvps import pinning
    standin = HostLocker()
    monkeypatch.setattr(pinning, 'REGISTRY', pinning.Registry(standin))
    return standin
