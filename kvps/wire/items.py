"""Every item a multi-key message lists, declared once: its fields, their kinds and meaning.

A multi-key message (INIT, CHECK, PUSH, PULL, RESUME and the DATA answer; kvps.wire.protocol
names which carries which) lists one item per key part under its header's ``keys``. An item
travels as a msgpack list of its fields in the order declared here (a NamedTuple packs as
one); kvps.wire.protocol.decode checks each field against its kind and hands the receiver
the item as its NamedTuple, so that senders and receivers name fields, never positions.
Every kind below is checked as its comment says: a peer's mistake is a ProtocolError.
"""

from typing import NamedTuple, NewType, Optional, Union

# Makes a NamedTuple from a tuple of its fields at half the cost of its constructor (which
# wraps this in a call of its own): for the items and records made once per key part.
new = tuple.__new__

# The kinds of fields.
Key = Union[int, str]          # an int, or a str of at most MAX_KEY_CHARS characters
Count = NewType('Count', int)  # an int >= 0
Offset = Optional[Count]       # a byte offset (an int >= 0) into shared memory, or None
DType = NewType('DType', str)  # a name in protocol.DTYPES: how the value is stored
PushDType = NewType('PushDType', str)   # a DType, or one of protocol.PUSH_CODECS
Shape = NewType('Shape', list)          # at most MAX_DIMS ints >= 0


class InitItem(NamedTuple):
    """INIT: a key part to create, with its value in the item's data frame."""
    key: Key        # the key, as the store names it
    part: Count     # which part of the key (kvps.worker.sharding cuts keys)
    dtype: DType    # the value's dtype
    n: Count        # elements in the part: its data frame holds n of dtype
    shape: Shape    # the whole key's shape


class CheckItem(NamedTuple):
    """CHECK: a non-root worker's view of a key (its part 0), compared with rank 0's init."""
    key: Key        # the key
    part: Count     # the part asked (0: where rank 0's init put it)
    dtype: DType    # the dtype this worker holds
    shape: Shape    # the whole key's shape as this worker holds it


class PushItem(NamedTuple):
    """PUSH: one key part's gradient (or, without an optimizer, its new value). A codec's
    payload (kvps.compression, kvps.rows) is decoded by the server into the key's dtype. The
    worker numbers its pushes of each key part to each server (``seq``) as it queues them, so
    that a push resent to a restarted server is acknowledged there, not applied twice."""
    key: Key          # the key
    part: Count       # which part of the key
    dtype: PushDType  # the payload's dtype, or its codec
    n: Count          # elements in the payload (bytes for ROW_SPARSE)
    at: Offset        # where the payload lies in the worker's segment; None: a data frame
    seq: Count        # this worker's earlier pushes of this key part to this server


class PullItem(NamedTuple):
    """PULL: one key part's value, once this worker's pushes of it are applied."""
    key: Key        # the key
    part: Count     # which part of the key
    at: Offset      # where in the worker's segment to write the value; None: a data frame


class DataItem(NamedTuple):
    """DATA: where one pulled value is, answering the PULL's items in order (so no key). With
    both fields None the value is in a data frame (the frames follow the items' order); one
    lent stays unchanged until the worker's ``seen`` reaches the answer's ``lease``."""
    at: Offset      # in the worker's segment, where the PULL asked for it
    lent: Offset    # in the server's arena


class ResumeItem(NamedTuple):
    """RESUME: what a worker saw acknowledged of a key part before its server was lost."""
    key: Key        # the key
    part: Count     # which part of the key
    acked: Count    # how many of the worker's pushes of it the lost server acknowledged
    # the worker's first round of it: 0, or later for a worker that joined a running elastic
    # job (its count started there, so ``acked == first`` tells of no completed round)
    first: Count = 0


class Layout(NamedTuple):
    """What decoding checks in each item of one kind, read off the item's declaration."""
    item: type                  # the item's NamedTuple
    width: int                  # its fields
    key: Optional[int]          # the index of its key (DATA's items have none)
    dtype: Optional[int]        # the index of its dtype
    codecs: bool                # the dtype may also be one of protocol.PUSH_CODECS
    counts: tuple               # (index, name, may be None) of each Count and Offset
    shape: Optional[int]        # the index of its shape
    at: Optional[int]           # the index of `at`: a sized item whose `at` is set has no frame
    sized: bool                 # a data frame per item (unless `at`): n elements of dtype

    @classmethod
    def of(cls, item):
        """The Layout of ``item``, one of the NamedTuples above."""
        names, kinds = item._fields, list(item.__annotations__.values())

        def index(*wanted):
            return next((i for i, kind in enumerate(kinds) if kind in wanted), None)
        counts = tuple((i, name, kind == Offset) for i, (name, kind)
                       in enumerate(zip(names, kinds)) if kind in (Count, Offset))
        return cls(item, len(names), index(Key), index(DType, PushDType), PushDType in kinds,
                   counts, index(Shape), names.index('at') if 'at' in names else None,
                   'n' in names)
