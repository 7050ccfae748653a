"""What a shard answers with: Reply records, their kinds, and the payloads that have parts."""

import enum
from typing import NamedTuple


class ReplyKind(str, enum.Enum):   # (enum.StrEnum needs Python 3.11)
    """What a reply says, and so what its payload is (its value: how logs and tests name it)."""
    ACK = 'ack'          # done; payload: None, or fields for the ACK header
    DATA = 'data'        # a value; payload: Pulled (a key part), PullAnswer (a whole PULL)
    ERROR = 'error'      # failed; payload: the exception, which travels back to the worker
    STATES = 'states'    # the optimizer's state; payload: it packed (bytes)
    ROWS = 'rows'        # some rows of a key part; payload: Rows


class Reply(NamedTuple):
    """One answer to one request (or to one key part of a multi-key request)."""
    kind: ReplyKind
    token: object        # the request's: opaque to the shard, it tells the loop where to send
    payload: object      # as ``kind`` says


class Pulled(NamedTuple):
    """A pulled key part's value, lent to the reply (not copied)."""
    entry: object        # the Entry pulled
    array: object        # its weight, in host memory
    lease: object        # the Lease that keeps ``array`` unchanged until the reply is sent


class PullAnswer(NamedTuple):
    """The DATA reply to a whole PULL: each key part asked, in its order."""
    reader: object       # the worker's Reader of the server's arena, or None: nothing is lent
    pulled: list         # a Pulled per key part
    places: list         # per key part: None, or (offset, view) in the worker's segment
    codec: object = None   # the PULL's: float32 and float64 values are rounded to it


class Rows(NamedTuple):
    """The ROWS reply to a PULL_ROWS; [epoch, count] in a later one asks for the rows changed
    since this answer."""
    epoch: int           # names the shard that counts the changes
    count: int           # the key part's change count as answered
    data: object         # the rows, encoded (kvps.rows)
