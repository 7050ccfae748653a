"""Pure wire format: message kinds, msgpack header encode/decode, frame layout and validation.

A message is a list of frames: ``[header, buf0, buf1, ...]``. The header is a small msgpack map
with at least ``op`` (str) and ``id`` (int); array payloads travel as raw frames after it,
never inside the header and never pickled. Decoding validates everything a peer could get
wrong (frame counts, lengths against declared dtype and element count, header size) and raises
ProtocolError, so a malformed message is rejected without touching state.
"""

import msgpack
import numpy as np

from ..errors import ProtocolError
from .codecs import GRADIENT_CODECS, ONE_BIT, PULL_CODECS, TOP_K, coded_nbytes
from .items import CheckItem, DataItem, InitItem, Layout, PullItem, PushItem, ResumeItem

# Node <-> scheduler.
VERSION = 24                 # bumped on any change of the wire format; checked at REGISTER
# node -> scheduler: {role, host, port, rank, pid, version, shared, rank_from (the setting
# that gave the rank, for messages: 'DMLC_WORKER_ID=3'), beat (its heartbeat interval, s)}
REGISTER = 'register'
# scheduler -> node: {rank, num_workers, num_servers, servers, nodes, recovery_timeout, job (a
# token naming this run, kept in server checkpoints), clock (the scheduler's monotonic ns: a
# node's timeline aligns with it)}; to a server that replaces a lost one also
# {restarted: True, finished: [worker ranks], checkpointed: a server of its rank wrote its file}
WELCOME = 'welcome'
# node -> scheduler, answered by HEARTBEAT_ACK {clock} (same id); a server's first after it
# joined and wrote its checkpoint file also says {checkpointed: True}
HEARTBEAT = 'heartbeat'
HEARTBEAT_ACK = 'heartbeat_ack'
# worker -> scheduler: {seq, call (the store call it is part of), digest (optional bytes), sum
# (optional float64 bytes: all_sum)}; answered by BARRIER_DONE when all arrive: {differs: [ranks
# whose digest is not rank 0's]} (agree), where they brought values {sum: their total} or
# {sum_error: why none}, and {mismatch: why} where they came from different calls
BARRIER = 'barrier'
BARRIER_DONE = 'barrier_done'
MAX_DIGEST_BYTES = 64
MAX_SUM_BYTES = 1 << 16      # all_sum: small arrays (metrics, counts), summed by the scheduler
FINISH = 'finish'            # worker -> scheduler: done; answered by ACK
ABORT = 'abort'              # node -> scheduler: {reason}; it is failing: the job ends at once
# scheduler -> node: exit now ({reason}); to a server no longer the job's, `fenced`: 'lost' (the
# job waits for a replacement) or 'replaced': it exits without writing its checkpoint
SHUTDOWN = 'shutdown'
PEER_LOST = 'peer_lost'      # scheduler -> node: {role, rank, host, reason}
FENCED = ('lost', 'replaced')
SERVER_LOST = 'server_lost'  # scheduler -> worker: {rank, reason}; the job waits for its return
SERVER_BACK = 'server_back'  # scheduler -> worker: {rank, host, port} of the replacement
# scheduler -> server, worker (elastic jobs): {epoch (= id), workers, gone, joined: lists of
# [rank, incarnation]}; a server answers ACK {id: epoch} (docs/elastic.md)
MEMBERS = 'members'

# Worker <-> server. A multi-key op lists one item per key part under `keys`, each of the
# NamedTuple that ITEMS names (kvps.wire.items declares every field). PUSH, PULL and PULL_ROWS
# may carry `priority` (an int in PRIORITIES; absent: 0), MXNet's: the worker sends, and the
# server serves, a higher one first (kvps.wire.ordering keeps what must stay in order)
# {sync, [device], keys: InitItem} + 1 buffer per item: key parts to create with these values
# (`device`: on the server's GPU, if it has one)
INIT = 'init'
# {keys: CheckItem}: verify a non-root worker's view of keys
CHECK = 'check'
# {sync, keys: PushItem} + 1 buffer per item whose `at` is None (see ATTACH). Optional `seen`
# (PUSH and PULL): see DATA's `lease`. `step` (sync stores): the most pushes this worker has
# made of any one key, this call's included; a round's update counts at least that many for
# the lr scheduler, as one server holding every key would (MXNet's num_update: the max of
# every key's update count)
PUSH = 'push'
# {key, part, [ids], [since]}: some rows of a key part, answered by ROWS once this worker's
# pushes of it are applied (as PULL): with `ids` true, the rows whose ids (int64, from the
# part's first row) the one data frame lists; with `since` ([epoch, count] of an earlier ROWS
# reply), every row changed after it; with `live` true, the rows of the value a push of rows
# made (no optimizer: the round's sum), all if it is dense; with none of them, every row
PULL_ROWS = 'pull_rows'
# The answer to PULL_ROWS: {epoch, count} + 1 buffer, the rows (kvps.rows); `since` =
# [epoch, count] in a later PULL_ROWS asks for the rows changed after this answer
ROWS = 'row_data'
# {keys: PullItem}. `seen` (an int, only from a worker that mapped this server's arena) also
# allows answers from the arena. `codec` (one of PULL_CODECS): float32 and float64 values are
# answered rounded to that 16-bit type (PULL_DTYPES), in a frame or the worker's segment, never
# lent; the DATA items are as for any pull
PULL = 'pull'
# + 1 buffer: the optimizer's spec (a map), msgpack. With `check` true the server only
# checks that it runs that optimizer with those parameters (an ERROR if not) and answers
# ACK {whole: whether it reads each weight whole}; nothing changes. `step` (it and
# COMMIT_STATES): the workers' sync push step now, which a new updater counts later ones from
SET_OPTIMIZER = 'set_optimizer'
GET_STATES = 'get_states'    # {dump, step (as SET_OPTIMIZER's)}: answered by STATES
# + 1 buffer: the updater state dict, msgpack; installed at once, or with `stage` true only
# checked and held until COMMIT_STATES (so that no server installs any if one refuses).
# A state bigger than STATE_CHUNK_BYTES comes in pieces: SET_STATES with `more` true (each
# acknowledged) holds one, and the one without `more` the last; `piece` numbers them from 0
SET_STATES = 'set_states'
COMMIT_STATES = 'commit_states'
# First message to a restarted server, unanswered: {keys: ResumeItem}, one per key part this
# worker pushed to the lost server; `more` true: the list goes on in the next RESUME (a worker
# holding many keys there sends it in several)
RESUME = 'resume'
# {name, nonce, size, [pid, fd]}: map this worker's shared-memory segment (kvps.wire.shm), through
# /proc/<pid>/fd/<fd> once its name is gone (a restarted server); ERROR, or ACK with
# {arena: {name, nonce, size, ...}} when the server keeps big weights in an arena of its own
ATTACH = 'attach'
# {kind, handle, size, event}: map this worker's device segment (kvps.wire.device_segments:
# `kind` of memory, 'cuda' or the stand-in's 'host'; the buffer's and the event's handles,
# HANDLE_BYTES each); ERROR, or ACK with {event}: the server's event handle, recorded behind
# its work on the segment before each answer (the worker waits for it). From then on PUSH,
# PULL and DATA items may name offsets in it (`at` >= DEVICE_BASE). Only a server on the
# worker's host with GPU shards maps it
ATTACH_DEVICE = 'attach_device'
# {kind}: would the server map a device segment of `kind` memory from this worker (it is on
# the worker's host and keeps GPU shards of that kind)? ACK or ERROR; asked before the worker
# allocates one, which it then does only when every server would
ASK_DEVICE = 'ask_device'
# {name} + 1 buffer (in pieces as SET_STATES's): a blob of the job that a later PUT_BLOB of the
# name replaces (kvps.server.blobs), answered by ACK; GET_BLOB {name}: STATES, b'' for none
PUT_BLOB, GET_BLOB = 'put_blob', 'get_blob'
# {key, part, epoch, size, count, round}: an elastic Sampler's claim (kvps.server.ledger),
# answered by ACK {positions: [int], end: bool} (maybe once earlier rounds have closed)
CLAIM = 'claim'

# Replies.
ACK = 'ack'
# {keys: DataItem}, one item per key part the PULL asked for, in its order, + 1 buffer per item
# whose `at` and `lent` are None (the worker knows each one's size: it asked). With lent
# values the header carries `lease` (the count of such replies to this worker): the server
# leaves those bytes unchanged until the worker's `seen` reaches it. `acks`: ids of the
# worker's requests answered by a plain ACK in the same flush (they ride along, acked first)
DATA = 'data'
ERROR = 'error'              # {type, message, traceback, node}
# + 1 buffer: the server's updater state dict, msgpack; in pieces as SET_STATES's, all
# answering one GET_STATES: those with `more` true, then the last
STATES = 'states'

# The item each multi-key op lists (kvps.wire.items), and what decoding checks in each.
ITEMS = {INIT: InitItem, CHECK: CheckItem, PUSH: PushItem, PULL: PullItem, DATA: DataItem,
         RESUME: ResumeItem}
_LAYOUTS = {op: Layout.of(item) for op, item in ITEMS.items()}
MAX_KEYS_PER_MESSAGE = 1 << 16
MAX_DIMS = 32
# How many raw buffers follow the header for each op; ops not listed carry none, and
# multi-key ops carry one per item that is not in shared memory (PUSH, INIT; DATA: see it).
_BUFFERS = {SET_OPTIMIZER: 1, SET_STATES: 1, STATES: 1, ROWS: 1, PUT_BLOB: 1}
# Header fields each op must carry (beyond op and id), with their accepted types.
_FIELDS = {
    REGISTER: {'role': str, 'host': str, 'port': int},
    BARRIER: {'seq': int},
    ABORT: {'reason': str},
    **{op: {'keys': list} for op in ITEMS},
    INIT: {'keys': list, 'sync': bool},
    PUSH: {'keys': list, 'sync': bool},
    GET_STATES: {'dump': bool},
    ERROR: {'type': str, 'message': str},
    PEER_LOST: {'role': str, 'reason': str},
    SERVER_LOST: {'rank': int, 'reason': str},
    SERVER_BACK: {'rank': int, 'host': str, 'port': int},
    MEMBERS: {'epoch': int, 'workers': list, 'gone': list, 'joined': list},
    PULL_ROWS: {'key': (int, str), 'part': int},
    ROWS: {'epoch': int, 'count': int},
    ATTACH: {'name': str, 'nonce': bytes, 'size': int},
    ATTACH_DEVICE: {'kind': str, 'handle': bytes, 'size': int, 'event': bytes},
    ASK_DEVICE: {'kind': str},
    PUT_BLOB: {'name': str},
    GET_BLOB: {'name': str},
    CLAIM: {'key': (int, str), 'part': int, 'epoch': int, 'size': int, 'count': int, 'round': int},
}
OPS = frozenset([REGISTER, WELCOME, HEARTBEAT, HEARTBEAT_ACK, BARRIER, BARRIER_DONE, FINISH, ABORT,
                 SHUTDOWN, PEER_LOST, SERVER_LOST, SERVER_BACK, MEMBERS, INIT, CHECK, PUSH, PULL,
                 SET_OPTIMIZER, GET_STATES, SET_STATES, COMMIT_STATES, RESUME, ATTACH,
                 ATTACH_DEVICE, ASK_DEVICE, ACK, DATA, ERROR, STATES, PULL_ROWS, ROWS, PUT_BLOB,
                 GET_BLOB, CLAIM])

# dtype names on the wire -> numpy storage dtype. bfloat16 travels as its raw 16-bit pattern.
# dtype objects, not scalar types: numpy converts a type to a dtype on every call it is given to.
DTYPES = {name: np.dtype(t) for name, t in {
    'float16': np.float16, 'float32': np.float32, 'float64': np.float64,
    'bfloat16': np.uint16,
    'int8': np.int8, 'uint8': np.uint8, 'int32': np.int32, 'int64': np.int64,
}.items()}
ITEMSIZE = {name: t.itemsize for name, t in DTYPES.items()}
# Compressed gradients (kvps.wire.codecs) and some rows of a key (kvps.rows) are PUSH item
# dtypes only; a 'rows' item's `n` counts bytes. A 'nothing' item (n 0, an empty frame) takes
# part in a sync round without a gradient (kvps.server.members.abstain).
ROW_SPARSE = 'rows'
NOTHING = 'nothing'
PUSH_CODECS = GRADIENT_CODECS + (ROW_SPARSE, NOTHING)
SIZED_IN_BYTES = (ONE_BIT, TOP_K, ROW_SPARSE, NOTHING)   # push kinds whose `n` counts bytes
MAX_HEADER_BYTES = 1 << 20   # headers are small maps; a bigger one is hostile or broken
MAX_KEY_CHARS = 1024
PRIORITIES = range(-2 ** 31, 2 ** 31)   # MXNet's priority is a C int


def encode(header, buffers=()):
    """Frames for one message: the packed header, then each buffer as is (no copy)."""
    return [msgpack.packb(header, use_bin_type=True), *buffers]


def decode(frames, max_message_bytes=None):
    """Validate and unpack frames into ``(header, [memoryview, ...])``, the items of a multi-key
    op as their NamedTuples (kvps.wire.items); raise ProtocolError."""
    if not frames:
        raise ProtocolError('empty message')
    head = frames[0]
    if len(head) > MAX_HEADER_BYTES:
        raise ProtocolError(f'header of {len(head)} bytes exceeds {MAX_HEADER_BYTES}')
    try:
        header = msgpack.unpackb(head, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise ProtocolError(f'undecodable header: {type(exc).__name__}: {exc}') from None
    try:
        items = validate_header(header)
        if items is not None:
            header['keys'] = items
        buffers = [memoryview(f) for f in frames[1:]]
        _check_buffers(header, buffers, max_message_bytes)
    except ProtocolError:
        raise
    except Exception as exc:  # backstop: no header, however odd, may crash a node
        raise ProtocolError(f'malformed {header.get("op")!r} message: {exc!r}') from None
    return header, buffers


def request_id(frames):
    """The id a malformed message asked under, if it can be read, so a job member can be told
    what was wrong with it instead of waiting for an answer that never comes."""
    return request_ids(frames)[0]


def request_ids(frames):
    """``(id, acks)`` of a malformed message, as far as its header can be read: request_id's,
    and the ids of the pushes whose plain acks ride on it (a DATA's ``acks``), answered even
    where the message's own values cannot be taken."""
    try:
        header = msgpack.unpackb(frames[0], raw=False, strict_map_key=False)
        ids = [header.get('id'), *header.get('acks', ())]
    except Exception:  # garbage has no id
        return None, []
    ids = [i if isinstance(i, int) and not isinstance(i, bool) else None for i in ids]
    return ids[0], [i for i in ids[1:] if i is not None]


def validate_header(header):
    """Check op, id and the fields the op needs; raise ProtocolError naming what is wrong.
    Returns the items of a multi-key op as their NamedTuples (None for other ops); the header
    is left as it is."""
    if not isinstance(header, dict):
        raise ProtocolError(f'header must be a map, got {type(header).__name__}')
    op = header.get('op')
    if not isinstance(op, str) or op not in OPS:   # type first: a list is unhashable
        raise ProtocolError(f'unknown op {op!r}')
    for name, kind in _FIELDS.get(op, {}).items():
        value = header.get(name)
        if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
            raise ProtocolError(f'{op}: field {name!r} missing or of wrong type')
    # Each field the header carries, by its name (a data message has a few of the many
    # names: asking each name whether it is there cost more than the rest of decoding)
    for name, value in header.items():
        check = _FIELD_CHECKS.get(name)
        if check is not None and not check(op, value):
            raise ProtocolError(f'{op}: {_FIELD_RULES.get(name) or name + " must be an int >= 0"}')
    layout = _LAYOUTS.get(op)
    return None if layout is None else _typed_items(op, layout, header['keys'])


def _flag(op, value):
    return type(value) is bool


def _optional(test):
    return lambda op, value: value is None or test(value)


def _raising(check):
    """A field check made of one that raises its own ProtocolError, saying more."""
    def checked(op, value):
        check(op, value)
        return True
    return checked


def _check_shared(op, shared):
    if not (isinstance(shared, dict) and len(shared) <= 16 and all(
            isinstance(k, str) and len(k) <= 64 and isinstance(v, (bool, int))
            for k, v in shared.items())):
        raise ProtocolError(f'{op}: shared must map at most 16 setting names to values')


def _natural(value):
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _check_dtype(op, dtype):
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise ProtocolError(f'{op}: unsupported dtype {dtype!r}')


# Header fields checked wherever they appear, by name -> (op, value) -> whether it is fine;
# what a failed check says is in _FIELD_RULES (else: an int >= 0). The fields an op must
# carry are _FIELDS's.
_FLAGS = ('device', 'stage', 'ids', 'live', 'more', 'check', 'whole', 'checkpointed')
_FIELD_CHECKS = {
    'id': lambda op, value: isinstance(value, int) and not isinstance(value, bool),
    'since': _optional(lambda v: type(v) is list and len(v) == 2 and all(map(_natural, v))),
    'priority': _optional(lambda v: type(v) is int and v in PRIORITIES),
    **dict.fromkeys(_FLAGS, _flag),
    'key': _raising(lambda op, key: check_key(key)),
    'dtype': _raising(_check_dtype),
    **dict.fromkeys(('n', 'part', 'port', 'size', 'seen', 'lease', 'pid', 'fd', 'step', 'epoch',
                     'count', 'piece', 'clock', 'round'), lambda op, value: _natural(value)),
    'rank': lambda op, value: value is None or _natural(value),
    'shared': _raising(_check_shared),   # REGISTER's only
    **dict.fromkeys(('rank_from', 'call'), _optional(lambda v: type(v) is str and len(v) <= 200)),
    'fenced': _optional(lambda v: v in FENCED),
    'codec': _optional(lambda v: type(v) is str and v in PULL_CODECS),
    'acks': lambda op, v: v is None or (op == DATA and type(v) is list and len(
        v) <= MAX_KEYS_PER_MESSAGE and all(type(a) is int and a > 0 for a in v)),
    'digest': _optional(lambda v: isinstance(v, bytes) and len(v) <= MAX_DIGEST_BYTES),
    'sum': _optional(lambda v: type(v) is bytes and 0 < len(v) <= MAX_SUM_BYTES
                     and len(v) % 8 == 0),
}
_FIELD_RULES = {
    'id': 'id must be an int', 'since': 'since must be [epoch, count], two ints >= 0',
    'priority': 'priority must be an int of 32 bits',
    **{flag: f'{flag} must be true or false' for flag in _FLAGS},
    **{name: f'{name} must be a string of at most 200 characters'
       for name in ('rank_from', 'call')},
    'fenced': f'fenced must be one of {", ".join(FENCED)}',
    'codec': f'codec must be one of {", ".join(PULL_CODECS)}',
    'acks': 'acks must be a list of request ids',
    'digest': f'digest must be at most {MAX_DIGEST_BYTES} bytes',
    'sum': f'sum must be float64 values, at most {MAX_SUM_BYTES} bytes',
}


def _typed_items(op, layout, items):
    """Each item of a multi-key message checked against its declaration (kvps.wire.items):
    as many fields, a key, a dtype and a shape where declared, counts ints >= 0 and offsets
    too unless they are None. Returns them as the declared NamedTuple."""
    width, counts, key_at, dtype_at = layout.width, layout.counts, layout.key, layout.dtype
    codecs, shape_at = layout.codecs, layout.shape
    least = 0 if op == RESUME else 1   # a worker may hold no key of a restarted server
    if not least <= len(items) <= MAX_KEYS_PER_MESSAGE:
        raise ProtocolError(f'{op}: {least} to {MAX_KEYS_PER_MESSAGE} keys per message')
    # Exact type tests (msgpack makes plain ints and strs; bool is not int here): this runs
    # for every key of every message.
    for item in items:
        if type(item) is not list or len(item) != width:
            raise ProtocolError(f'{op}: each item must be a list of {width} fields')
        if key_at is not None:
            key = item[key_at]
            if type(key) is not int and not (type(key) is str and len(key) <= MAX_KEY_CHARS):
                check_key(key)
        if dtype_at is not None:
            dtype = item[dtype_at]
            if (type(dtype) is not str or dtype not in DTYPES) and not (
                    codecs and dtype in PUSH_CODECS):
                _check_dtype(op, dtype)
        for index, name, nullable in counts:
            value = item[index]
            if not (type(value) is int and value >= 0) and not (nullable and value is None):
                raise ProtocolError(f'{op}: {name} must be an int >= 0')
        if shape_at is not None:
            _check_shape(op, item[shape_at])
    make, cls = tuple.__new__, layout.item   # (checked: NamedTuple's own checks would repeat)
    return [make(cls, item) for item in items]


def _check_shape(op, shape):
    if not (type(shape) is list and len(shape) <= MAX_DIMS and all(
            type(d) is int and d >= 0 for d in shape)):
        raise ProtocolError(f'{op}: shape must list at most {MAX_DIMS} ints >= 0')


def check_key(key):
    """Keys are ints or short strings; anything else is rejected."""
    if isinstance(key, bool) or not isinstance(key, (int, str)):
        raise ProtocolError(f'key must be int or str, got {type(key).__name__}')
    if isinstance(key, str) and len(key) > MAX_KEY_CHARS:
        raise ProtocolError(f'key longer than {MAX_KEY_CHARS} characters')


def _check_buffers(header, buffers, max_message_bytes):
    op = header['op']
    layout = _LAYOUTS.get(op)
    sized = [] if layout is None or not layout.sized else [   # (the rest lie in shared memory)
        item for item in header['keys'] if layout.at is None or item[layout.at] is None]
    if op == DATA:   # (sizes are the worker's to check: it knows what it asked)
        want = sum(1 for item in header['keys'] if item.at is None and item.lent is None)
    else:
        want = len(sized) if sized else _BUFFERS.get(op, int(header.get('ids', False)))
    if len(buffers) != want:
        raise ProtocolError(f'{op}: expected {want} data frame(s), got {len(buffers)}')
    total = sum(b.nbytes for b in buffers)
    if max_message_bytes is not None and total > max_message_bytes:
        raise ProtocolError(f'{op}: {total} bytes exceeds the limit of {max_message_bytes} '
                            '(KVPS_MAX_MESSAGE_BYTES)')
    for item, buffer in zip(sized, buffers):
        expected = nbytes(item.dtype, item.n)
        if buffer.nbytes != expected:
            raise ProtocolError(f'{op}: data frame of key {item.key!r} has {buffer.nbytes} '
                                f'bytes, but {item.n} {item.dtype} elements need {expected}')


def nbytes(dtype_name, n):
    """Bytes of ``n`` elements of a wire dtype, or of a payload whose PUSH item says ``n``."""
    size = ITEMSIZE.get(dtype_name)
    if size is not None:
        return n * size
    return n if dtype_name in (ROW_SPARSE, NOTHING) else coded_nbytes(dtype_name, n)


def as_array(buffer, dtype_name):
    """A read-only numpy view of a received buffer (no copy)."""
    # dtype passed by position: numpy parses a keyword here at twice the cost (0.5 vs 0.2 us),
    # paid for every key of every push and pull
    return np.frombuffer(buffer, DTYPES[dtype_name])


def error_header(req_id, exc, node, traceback_text=''):
    """The ERROR reply that carries an exception back to the node that caused it."""
    return {'op': ERROR, 'id': req_id, 'type': type(exc).__name__, 'message': str(exc),
            'traceback': traceback_text, 'node': node}
