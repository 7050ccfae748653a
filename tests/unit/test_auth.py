"""HMAC message authentication: forgeries, replays, reflections and wrong secrets are refused."""

import pytest

from kvps.wire.auth import PREFIX_BYTES, TO_DEALER, TO_ROUTER, Guard, new_secret
from kvps.errors import AuthError

SECRET = new_secret()


def signed(guard=None, frames=(b'header', b'payload'), direction=TO_ROUTER, identity=b'worker-0'):
    return (guard or Guard(SECRET)).sign(list(frames), direction, identity)


def test_round_trip_strips_the_prefix():
    frames = signed()
    assert len(frames[0]) == PREFIX_BYTES + len(b'header')
    out = Guard(SECRET).verify(frames, TO_ROUTER, b'worker-0')
    assert bytes(out[0]) == b'header' and out[1] == b'payload'


@pytest.mark.parametrize('tamper', [
    lambda f: [f[0][:-1] + b'X', *f[1:]],                  # header changed
    lambda f: [f[0][:PREFIX_BYTES - 1]],                   # truncated prefix
    lambda f: [b'header'],                                 # never signed
    lambda f: [],
])
def test_forged_or_broken_messages_are_refused(tamper):
    with pytest.raises(AuthError):
        Guard(SECRET).verify(tamper(signed()), TO_ROUTER, b'worker-0')


def test_wrong_secret_other_identity_and_reflection_are_refused():
    with pytest.raises(AuthError, match='bad signature'):
        Guard(new_secret()).verify(signed(), TO_ROUTER, b'worker-0')
    with pytest.raises(AuthError):
        Guard(SECRET).verify(signed(), TO_ROUTER, b'worker-1')
    with pytest.raises(AuthError):                         # a request replayed as a reply
        Guard(SECRET).verify(signed(), TO_DEALER, b'worker-0')


def test_replays_and_reordering_are_refused():
    sender, receiver = Guard(SECRET), Guard(SECRET)
    first, second = signed(sender), signed(sender)
    receiver.verify(second, TO_ROUTER, b'worker-0')
    with pytest.raises(AuthError, match='replayed'):
        receiver.verify(second, TO_ROUTER, b'worker-0')
    with pytest.raises(AuthError, match='replayed or reordered'):
        receiver.verify(first, TO_ROUTER, b'worker-0')
    # A new session of the same identity (a restarted process) starts its own sequence.
    receiver.verify(signed(Guard(SECRET)), TO_ROUTER, b'worker-0')


def test_payload_is_covered_only_when_asked():
    plain = signed(frames=(b'h', b'data'))
    plain[1] = b'DATA'
    Guard(SECRET).verify(plain, TO_ROUTER, b'worker-0')    # headers only: payload not covered
    strict = Guard(SECRET, sign_payload=True).sign([b'h', b'data'], TO_ROUTER, b'worker-0')
    strict[1] = b'DATA'
    with pytest.raises(AuthError):
        Guard(SECRET, sign_payload=True).verify(strict, TO_ROUTER, b'worker-0')
