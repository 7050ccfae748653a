"""Who is who on the wire: workers' socket identities and their ranks, names for people, and
the nodes of a role on one host."""


def members_on(welcome, host, role):
    """How many of the job's nodes of ``role`` registered from ``host`` (by the welcome's
    node table; the same advertised address is taken to mean the same machine)."""
    return sum(1 for n in welcome.get('nodes', ()) if n['role'] == role and n['host'] == host)


def worker_identity(rank, incarnation=0):
    """The socket identity a worker uses towards every server (servers count rounds by it);
    an elastic job's joiner adds its ``incarnation`` (the epoch it joined at)."""
    return (f'worker-{rank}' if not incarnation else f'worker-{rank}.{incarnation}').encode()


def worker_rank(identity):
    """The rank in a worker's socket identity (worker_identity's inverse, less incarnation)."""
    return int(identity[7:].split(b'.')[0])


def identity_label(identity):
    """A socket identity as people read it in errors ('worker-1', not b'worker-1')."""
    return identity.decode(errors='replace') if isinstance(identity, bytes) else str(identity)
