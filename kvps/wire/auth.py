"""Message authentication with a per-job secret: HMAC-SHA256 tags, sessions and replay checks.

Every message's first frame (the header) is prefixed with ``tag | session | seq``:

- ``tag`` = HMAC-SHA256(secret, direction | dealer identity | session | seq | header
  [| payload frames]) binds the message to who sent it, to whom, and in which direction, so a
  captured request cannot be replayed under another identity or reflected back as a reply;
- ``session`` is a random number per socket, ``seq`` counts its messages; a receiver accepts
  each (identity, session) only with increasing ``seq``, so replays are refused.

Array payloads are covered only with ``sign_payload`` (KVPS_AUTH_PAYLOAD=1): headers name
every operation, key and size, so an attacker without the secret can do nothing, while
hashing gigabytes of gradients would cost more than the transfer itself. Against an on-path
attacker who can rewrite TCP streams, turn payload signing on or isolate the network.
"""

import hashlib
import hmac
import secrets
import struct

from ..errors import AuthError

TAG_BYTES = 32
_PREFIX = struct.Struct('!32sQQ')      # tag, session, seq
PREFIX_BYTES = _PREFIX.size
TO_ROUTER, TO_DEALER = b'>', b'<'


def new_secret():
    """A fresh job secret (hex text, safe in an environment variable)."""
    return secrets.token_hex(32)


class Guard:
    """Signs outgoing and verifies incoming headers for one socket."""

    def __init__(self, secret, sign_payload=False):
        key = secret.encode() if isinstance(secret, str) else bytes(secret)
        # keyed once: each tag copies it (a third less than hmac.digest, which keys afresh)
        self._keyed = hmac.new(key, digestmod=hashlib.sha256)
        self._sign_payload = sign_payload
        self._session = secrets.randbits(63)
        self._seq = 0
        self._last_seen = {}           # (identity, session) -> last seq accepted

    def _tag(self, direction, identity, session, seq, header, payload):
        mac = self._keyed.copy()
        mac.update(b''.join((direction, struct.pack('!H', len(identity)), identity,
                             struct.pack('!QQ', session, seq), header)))
        if self._sign_payload:
            for frame in payload:
                mac.update(struct.pack('!Q', memoryview(frame).nbytes))
                mac.update(frame)
        return mac.digest()

    def sign(self, frames, direction, identity):
        """Frames with the header prefixed by its tag, session and sequence number."""
        self._seq += 1
        header = bytes(frames[0])
        tag = self._tag(direction, identity, self._session, self._seq, header, frames[1:])
        return [_PREFIX.pack(tag, self._session, self._seq) + header, *frames[1:]]

    def verify(self, frames, direction, identity):
        """The frames with the prefix removed; AuthError if forged, replayed or malformed."""
        if not frames or memoryview(frames[0]).nbytes < PREFIX_BYTES:
            raise AuthError('message without an authentication prefix')
        first = memoryview(frames[0])
        tag, session, seq = _PREFIX.unpack(first[:PREFIX_BYTES])
        header = first[PREFIX_BYTES:]
        expected = self._tag(direction, identity, session, seq, header, frames[1:])
        if not hmac.compare_digest(tag, expected):
            raise AuthError('bad signature (wrong or missing KVPS_SECRET)')
        last = self._last_seen.get((identity, session), 0)
        if seq <= last:
            raise AuthError(f'replayed or reordered message (seq {seq} after {last})')
        self._last_seen[(identity, session)] = seq
        return [header, *frames[1:]]
