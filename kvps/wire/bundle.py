"""Several messages to one peer sent as one: a server's answers to a worker in one flush.

A per-key loop (a pull per key) has a server answer many small requests of one worker at
once; each as a message of its own costs a send, a tag and a receive on both sides. A bundle
is ``[index, *frames of each message]``, its first frame a msgpack array of ``[header,
number of frames after it]`` per message (a message's first frame is a msgpack map, so the
two are told apart by that frame's first byte). The index is the frame a signing transport
tags, so the messages' headers are as authenticated as any header; each message is then
decoded and validated as if it had come alone.
"""

import msgpack

from ..errors import ProtocolError
from .protocol import MAX_HEADER_BYTES

MAX_MESSAGES = 1 << 12   # messages in one bundle
INDEX_BYTES = MAX_HEADER_BYTES // 2   # their headers together, at most: the index stays below
# msgpack's array markers: fixarray, array 16, array 32 (a map's are 0x80-0x8f, 0xde, 0xdf)
_ARRAY_FIRST_BYTES = frozenset([*range(0x90, 0xa0), 0xdc, 0xdd])


def bundle(messages):
    """The frames of one message carrying ``messages`` (each a list of frames, its header
    first), in their order."""
    index = msgpack.packb([[bytes(frames[0]), len(frames) - 1] for frames in messages],
                          use_bin_type=True)
    return [index, *(frame for frames in messages for frame in frames[1:])]


def unbundled(frames):
    """The messages ``frames`` carries: itself alone unless it is a bundle; ProtocolError
    where a bundle's index is malformed."""
    head = memoryview(frames[0])
    if not head.nbytes or head[0] not in _ARRAY_FIRST_BYTES:
        return [frames]
    if head.nbytes > MAX_HEADER_BYTES:
        raise ProtocolError(f'bundle index of {head.nbytes} bytes exceeds {MAX_HEADER_BYTES}')
    try:
        index = msgpack.unpackb(head, raw=False)
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise ProtocolError(f'undecodable bundle index: {type(exc).__name__}') from None
    if not (type(index) is list and 0 < len(index) <= MAX_MESSAGES and all(
            type(entry) is list and len(entry) == 2 and type(entry[0]) is bytes
            and type(entry[1]) is int and entry[1] >= 0 for entry in index)):
        raise ProtocolError('malformed bundle index')
    if sum(count for _, count in index) != len(frames) - 1:
        raise ProtocolError(f'bundle index names {sum(c for _, c in index)} frames; '
                            f'{len(frames) - 1} came')
    messages, at = [], 1
    for header, count in index:
        messages.append([header, *frames[at:at + count]])
        at += count
    return messages
