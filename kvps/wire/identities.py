"""Who is who on the wire: workers' socket identities and their ranks, names for people, and
the nodes of a role on one host."""

import hashlib
import hmac


def members_on(welcome, host, role):
    """How many of the job's nodes of ``role`` registered from ``host`` (by the welcome's
    node table; the same advertised address is taken to mean the same machine)."""
    return sum(1 for n in welcome.get('nodes', ()) if n['role'] == role and n['host'] == host)


def worker_identity(rank, incarnation=0, salt=None):
    """The socket identity a worker uses towards every server (servers count rounds by it);
    an elastic job's joiner adds its ``incarnation`` (the epoch it joined at). With the job's
    ``salt`` (identity_salt) a tag follows that only the job's members can compute: ZeroMQ
    routes a server's answers by the name a peer connects under, before any message is
    verified, so a stranger who could guess a worker's name and connect under it first would
    take that worker's answers."""
    name = (f'worker-{rank}' if not incarnation else f'worker-{rank}.{incarnation}').encode()
    if not salt:
        return name
    return name + b'~' + hmac.new(salt, name, hashlib.sha256).hexdigest()[:24].encode()


def identity_salt(secret, job):
    """The salt of worker identities in the run ``job`` (the scheduler's token in WELCOME) of a
    job with ``secret`` (None without one: then nothing is authenticated anyway)."""
    if not secret:
        return None
    return hmac.new(secret.encode(), b'kvps worker identities ' + job.encode(),
                    hashlib.sha256).digest()


def own_identity(welcome, secret):
    """A worker's identity in the job that sent it ``welcome`` (with ``secret``)."""
    return worker_identity(welcome['rank'], welcome.get('incarnation', 0),
                           identity_salt(secret, welcome['job']))


def worker_rank(identity):
    """The rank in a worker's socket identity (worker_identity's inverse, less incarnation)."""
    return int(identity[7:].split(b'~')[0].split(b'.')[0])


def identity_label(identity):
    """A socket identity as people read it in errors ('worker-1', not b'worker-1'; without
    its tag)."""
    if isinstance(identity, bytes):
        return identity.split(b'~')[0].decode(errors='replace')
    return str(identity)
