"""Pure wire format: message kinds, msgpack header encode/decode, frame layout and validation.

A message is a list of frames: ``[header, buf0, buf1, ...]``. The header is a small msgpack map
with at least ``op`` (str) and ``id`` (int); array payloads travel as raw frames after it,
never inside the header and never pickled. Decoding validates everything a peer could get
wrong (frame counts, lengths against declared dtype and element count, header size) and raises
ProtocolError, so a malformed message is rejected without touching state.
"""

import msgpack
import numpy as np

from .errors import ProtocolError

# Node <-> scheduler.
REGISTER = 'register'        # node -> scheduler: {role, host, port, rank, pid}
WELCOME = 'welcome'          # scheduler -> node: {rank, num_workers, num_servers, servers, nodes}
HEARTBEAT = 'heartbeat'      # node -> scheduler, answered by HEARTBEAT_ACK
HEARTBEAT_ACK = 'heartbeat_ack'
BARRIER = 'barrier'          # worker -> scheduler: {seq}; answered by BARRIER_DONE when all arrive
BARRIER_DONE = 'barrier_done'
FINISH = 'finish'            # worker -> scheduler: done; answered by ACK
SHUTDOWN = 'shutdown'        # scheduler -> node: exit now ({reason})
PEER_LOST = 'peer_lost'      # scheduler -> node: {role, rank, host, reason}

# Worker <-> server.
INIT = 'init'                # {key, part, dtype, n, shape, sync} + 1 buffer
CHECK = 'check'              # {key, dtype, shape}: verify a non-root worker's view of a key
PUSH = 'push'                # {key, part, dtype, n, sync} + 1 buffer
PULL = 'pull'                # {key, part}
SET_OPTIMIZER = 'set_optimizer'  # {spec}
GET_STATES = 'get_states'    # {dump}: answered by STATES
SET_STATES = 'set_states'    # + 1 buffer: the updater state dict, msgpack

# Replies.
ACK = 'ack'
DATA = 'data'                # {key, part, dtype, n} + 1 buffer
ERROR = 'error'              # {type, message, traceback, node}
STATES = 'states'            # + 1 buffer: the server's updater state dict, msgpack

# How many raw buffers follow the header for each op; ops not listed carry none.
_BUFFERS = {INIT: 1, PUSH: 1, DATA: 1, SET_STATES: 1, STATES: 1}
# Header fields each op must carry (beyond op and id), with their accepted types.
_KEY = (int, str)
_FIELDS = {
    REGISTER: {'role': str, 'host': str, 'port': int},
    BARRIER: {'seq': int},
    INIT: {'key': _KEY, 'part': int, 'dtype': str, 'n': int, 'shape': list, 'sync': bool},
    CHECK: {'key': _KEY, 'dtype': str, 'shape': list},
    PUSH: {'key': _KEY, 'part': int, 'dtype': str, 'n': int, 'sync': bool},
    PULL: {'key': _KEY, 'part': int},
    SET_OPTIMIZER: {'spec': dict},
    GET_STATES: {'dump': bool},
    DATA: {'key': _KEY, 'part': int, 'dtype': str, 'n': int},
    ERROR: {'type': str, 'message': str},
    PEER_LOST: {'role': str, 'reason': str},
}
OPS = frozenset([REGISTER, WELCOME, HEARTBEAT, HEARTBEAT_ACK, BARRIER, BARRIER_DONE, FINISH,
                 SHUTDOWN, PEER_LOST, INIT, CHECK, PUSH, PULL, SET_OPTIMIZER, GET_STATES,
                 SET_STATES, ACK, DATA, ERROR, STATES])

# dtype names on the wire -> numpy storage dtype. bfloat16 travels as its raw 16-bit pattern.
DTYPES = {
    'float16': np.float16, 'float32': np.float32, 'float64': np.float64,
    'bfloat16': np.uint16,
    'int8': np.int8, 'uint8': np.uint8, 'int32': np.int32, 'int64': np.int64,
}
MAX_HEADER_BYTES = 1 << 20   # headers are small maps; a bigger one is hostile or broken
MAX_KEY_CHARS = 1024


def encode(header, buffers=()):
    """Frames for one message: the packed header, then each buffer as is (no copy)."""
    return [msgpack.packb(header, use_bin_type=True), *buffers]


def decode(frames, max_message_bytes=None):
    """Validate and unpack frames into ``(header, [memoryview, ...])``; raise ProtocolError."""
    if not frames:
        raise ProtocolError('empty message')
    head = frames[0]
    if len(head) > MAX_HEADER_BYTES:
        raise ProtocolError(f'header of {len(head)} bytes exceeds {MAX_HEADER_BYTES}')
    try:
        header = msgpack.unpackb(head, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise ProtocolError(f'undecodable header: {type(exc).__name__}: {exc}') from None
    validate_header(header)
    buffers = [memoryview(f) for f in frames[1:]]
    _check_buffers(header, buffers, max_message_bytes)
    return header, buffers


def validate_header(header):
    """Check op, id and the fields the op needs; raise ProtocolError naming what is wrong."""
    if not isinstance(header, dict):
        raise ProtocolError(f'header must be a map, got {type(header).__name__}')
    op = header.get('op')
    if op not in OPS:
        raise ProtocolError(f'unknown op {op!r}')
    if not isinstance(header.get('id', 0), int) or isinstance(header.get('id'), bool):
        raise ProtocolError(f'{op}: id must be an int')
    for name, kind in _FIELDS.get(op, {}).items():
        value = header.get(name)
        if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
            raise ProtocolError(f'{op}: field {name!r} missing or of wrong type')
    if 'key' in header:
        check_key(header['key'])
    if 'dtype' in header and header['dtype'] not in DTYPES:
        raise ProtocolError(f'{op}: unsupported dtype {header["dtype"]!r}')
    for name in ('n', 'part'):
        if name in header and header[name] < 0:
            raise ProtocolError(f'{op}: {name} must be >= 0')


def check_key(key):
    """Keys are ints or short strings; anything else is rejected."""
    if isinstance(key, bool) or not isinstance(key, (int, str)):
        raise ProtocolError(f'key must be int or str, got {type(key).__name__}')
    if isinstance(key, str) and len(key) > MAX_KEY_CHARS:
        raise ProtocolError(f'key longer than {MAX_KEY_CHARS} characters')


def _check_buffers(header, buffers, max_message_bytes):
    op = header['op']
    want = _BUFFERS.get(op, 0)
    if len(buffers) != want:
        raise ProtocolError(f'{op}: expected {want} data frame(s), got {len(buffers)}')
    total = sum(b.nbytes for b in buffers)
    if max_message_bytes is not None and total > max_message_bytes:
        raise ProtocolError(f'{op}: {total} bytes exceeds the limit of {max_message_bytes}')
    if want and 'dtype' in header:
        expected = header['n'] * np.dtype(DTYPES[header['dtype']]).itemsize
        if buffers[0].nbytes != expected:
            raise ProtocolError(
                f'{op}: data frame has {buffers[0].nbytes} bytes, but {header["n"]} '
                f'{header["dtype"]} elements need {expected}')


def as_array(buffer, dtype_name):
    """A read-only numpy view of a received buffer (no copy)."""
    return np.frombuffer(buffer, dtype=DTYPES[dtype_name])


def error_header(req_id, exc, node, traceback_text=''):
    """The ERROR reply that carries an exception back to the node that caused it."""
    return {'op': ERROR, 'id': req_id, 'type': type(exc).__name__, 'message': str(exc),
            'traceback': traceback_text, 'node': node}


def worker_identity(rank):
    """The socket identity a worker uses towards every server (servers count rounds by it)."""
    return f'worker-{rank}'.encode()
