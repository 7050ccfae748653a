"""Workers' socket identities: readable, and in a job with a secret, not guessable by strangers."""

from kvps.wire.identities import (identity_label, identity_salt, own_identity, worker_identity,
                                  worker_rank)


def test_without_a_secret_identities_are_the_plain_names():
    assert identity_salt(None, 'job') is None
    assert worker_identity(3) == b'worker-3' and worker_identity(3, 2) == b'worker-3.2'


def test_with_a_secret_each_name_carries_a_tag_only_the_jobs_members_can_make():
    """A stranger who could guess a worker's name and connect under it to a server first
    would have that worker's answers routed to it (ZeroMQ routes by name before any message
    is verified): the tag depends on the secret and on the run."""
    salt = identity_salt('s3cret', 'run-a')
    tagged = worker_identity(1, salt=salt)
    assert tagged.startswith(b'worker-1~') and len(tagged) == len(b'worker-1~') + 24
    assert tagged == worker_identity(1, salt=identity_salt('s3cret', 'run-a'))   # every member
    assert tagged not in (worker_identity(1), worker_identity(2, salt=salt),
                          worker_identity(1, salt=identity_salt('other', 'run-a')),
                          worker_identity(1, salt=identity_salt('s3cret', 'run-b')))
    assert own_identity({'rank': 1, 'job': 'run-a'}, 's3cret') == tagged
    assert own_identity({'rank': 1, 'incarnation': 4, 'job': 'run-a'}, 's3cret') == \
        worker_identity(1, 4, salt)


def test_rank_and_label_read_through_the_tag():
    salt = identity_salt('s3cret', 'run-a')
    for rank, incarnation in ((0, 0), (12, 0), (5, 3)):
        for identity in (worker_identity(rank, incarnation),
                         worker_identity(rank, incarnation, salt)):
            assert worker_rank(identity) == rank
    assert identity_label(worker_identity(5, 3, salt)) == 'worker-5.3'
    assert identity_label(b'intruder') == 'intruder'
