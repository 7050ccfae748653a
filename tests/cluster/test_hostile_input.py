"""Hostile and malformed input against a live, hand-started cluster (kvps issue 5).

A scheduler, one server and one real worker (rank 0, dist_async) run as separate processes
under a job secret; the test itself is the job's worker 1 (it registers, heartbeats and meets
every barrier over raw ZeroMQ, signing with the secret). The real worker initializes its keys
and waits while the test sends thousands of hostile messages generated with hypothesis to the
server and to the scheduler: random frames, truncated and bad msgpack, msgpack of the wrong
types, valid-looking headers with wrong ops, fields, types and frame counts, oversized headers,
data frames that disagree with the declared dtype and element count, unknown dtypes, negative
n/part, huge keys, requests for keys that do not exist, replies sent to the server, and
REGISTER/BARRIER/FINISH from identities the scheduler never registered. They come

- from outsiders (no secret, a wrong secret, or a message signed for someone else): each must
  be refused by authentication with one logged line and no answer;
- from insiders (signed with the job secret, so they reach the decoder and the handlers; on the
  server under the identity of worker 1, the only identity a server talks to besides worker 0),
  and replays of their own earlier messages.

Every few dozen messages a probe checks that the node still answers. Then the real worker
proceeds and must read back exactly what it initialized and get exact push/pull results, and
every process must exit 0.

Each insider message is classified beforehand by ``kvps.wire.protocol.decode`` (the code the nodes
run): a ProtocolError must give one 'rejected' line in the node's log and no reply; a message
that decodes must get exactly one reply (server) or one logged refusal (scheduler). Not sent:
what a member may legitimately do and would change the job (PUSH/INIT to the real keys, a
valid SET_OPTIMIZER or a state dict for SET_STATES, an INIT of a sync key, whose rounds would
wait for worker 0). Type-confused headers that once crashed ``decode`` (TypeError instead of
ProtocolError) are sent too; test_hostile_requests.py pins them one by one.
"""

import collections
import os
import time

import msgpack
import pytest
import zmq
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st

from hostile_peers import CLUSTER_ENV, SECRET, FakeWorker, Output, Signed
from kvps.wire import protocol as P
from kvps.wire.auth import TO_ROUTER, Guard
from kvps.errors import ProtocolError
from kvps.optimizer import Optimizer

pytestmark = [pytest.mark.cluster]

SEED = int(os.environ.get('KVPS_FUZZ_SEED', '20250501'))
SERVER_MESSAGES = int(os.environ.get('KVPS_FUZZ_SERVER_MESSAGES', '1600'))
SCHEDULER_MESSAGES = int(os.environ.get('KVPS_FUZZ_SCHEDULER_MESSAGES', '800'))
OUTSIDER_MESSAGES = int(os.environ.get('KVPS_FUZZ_OUTSIDER_MESSAGES', '400'))
PROBE_EVERY = 50
REPLAY_EVERY = 97
BATCH = 20
REPLY_WAIT_S = 15.0

# The real worker's keys, sizes (elements) and dtypes. Key 3 is big (2.4 MB on the wire).
REAL_KEYS = {0: (5, 'float32'), 1: (1000, 'float64'), 2: (7, 'float16'), 3: (600_000, 'float32')}

WORKER_SCRIPT = '''
keys = {keys!r}
kv = kvps.create('dist_async')
assert kv.rank == 0
def initial(k, n, dt):
    return (np.arange(n) % 97 + k).astype(dt)
for k, (n, dt) in keys.items():
    kv.init(k, initial(k, n, dt))
print('READY', flush=True)
deadline = time.monotonic() + 120
while not os.path.exists('GO'):
    assert time.monotonic() < deadline, 'never told to go'
    time.sleep(0.05)
bad = []
for k, (n, dt) in keys.items():           # the fuzz must not have changed a single value
    out = np.zeros(n, dt); kv.pull(k, out=out)
    if not np.array_equal(out, initial(k, n, dt)):
        bad.append(('init', k))
for r in range(20):                        # no optimizer, no other pusher: pull gives the push
    for k, (n, dt) in keys.items():
        g = ((np.arange(n) * (r + 1) + k) % 251).astype(dt)
        kv.push(k, g)
        out = np.zeros(n, dt); kv.pull(k, out=out)
        if not np.array_equal(out, g):
            bad.append((r, k))
kv.barrier()
report(bad=bad, rounds=20)
'''.format(keys=REAL_KEYS)


# -- processes ---------------------------------------------------------------------------------
def start_cluster(by_hand, tmp_path, ctx, secret=SECRET):
    """Scheduler + 1 server (INFO log) + real worker 0, initialized and waiting; the test is
    worker 1."""
    env_extra = dict(CLUSTER_ENV, KVPS_SECRET=secret) if secret else {
        k: v for k, v in CLUSTER_ENV.items() if k != 'KVPS_SECRET'}
    sched, env = by_hand.scheduler(2, 1, extra=env_extra)
    cluster = {'scheduler': Output(sched),
               'scheduler_addr': f'tcp://127.0.0.1:{env["DMLC_PS_ROOT_PORT"]}',
               'go': tmp_path / 'GO'}
    cluster['server'] = Output(by_hand('server', {**env, 'KVPS_LOG_LEVEL': 'INFO'}, rank=0))
    cluster['worker'] = Output(by_hand('worker', env, script=WORKER_SCRIPT, rank=0))
    # (the real worker meets a barrier at each key's init, then one at its end)
    fake = cluster['fake'] = FakeWorker(
        ctx, cluster['scheduler_addr'], secret, rank=1,
        calls=lambda seq: 'init' if seq <= len(REAL_KEYS) else 'barrier')
    host, port = cluster['server'].wait_for(r'server 0 serving on (\S+):(\d+)', 60,
                                            fake.tick).groups()
    cluster['server_addr'] = f'tcp://{host}:{port}'
    cluster['worker'].wait_for(r'READY', 60, fake.tick)
    assert fake.welcome is not None and fake.welcome['rank'] == 1
    return cluster


# -- message strategies -----------------------------------------------------------------------
_ints64 = st.integers(-(1 << 63), (1 << 64) - 1)
_scalars = st.one_of(st.none(), st.booleans(), _ints64, st.floats(), st.text(max_size=12),
                     st.binary(max_size=12))
ANY = st.recursive(_scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4),
    st.dictionaries(st.one_of(st.text(max_size=8), st.integers(-4, 4)), inner, max_size=4)),
    max_leaves=8)

_fuzz_keys = st.one_of(
    _ints64.filter(lambda k: k not in REAL_KEYS), st.text(max_size=16),
    st.integers(P.MAX_KEY_CHARS - 2, P.MAX_KEY_CHARS + 50).map(lambda n: 'k' * n),
    st.sampled_from([(1 << 63) - 1, -(1 << 63), (1 << 64) - 1]))
_keys = st.one_of(_fuzz_keys, st.sampled_from(sorted(REAL_KEYS)))
WIRE_DTYPES = sorted(P.DTYPES) + list(P.GRADIENT_CODECS)   # compressed pushes too
_dtypes = st.one_of(st.sampled_from(WIRE_DTYPES), st.sampled_from(
    ['float128', 'complex64', 'object', 'bool', '', 'FLOAT32', 'float32 ', '<f4', '2BIT']),
    st.text(max_size=8))
# Shared-memory offsets: mostly none (a data frame), else anywhere, in range or not; this
# test's members never attached a segment, so every offset must be refused per key.
_AT = st.one_of(st.none(), st.none(), st.integers(-1, 1 << 33), ANY)
_shapes = st.lists(st.one_of(st.integers(-2, 300), ANY), max_size=4)
_item = st.tuples(st.one_of(_keys, ANY), st.one_of(st.integers(-1, 2), ANY),
                  st.one_of(_dtypes, ANY), st.one_of(st.integers(-1, 300), ANY), _AT,
                  st.one_of(st.integers(-1, 5), ANY), _shapes).map(list)
_GOOD = {
    # multi-key ops ('keys': [[key, part, at], [key, part, dtype, n, at(, seq)],
    # [key, part, dtype, n, shape], [key, part, dtype, shape], ...]); items maybe broken
    'keys': st.one_of(st.lists(_item.map(lambda i: i[:2] + i[4:5]), max_size=3),
                      st.lists(_item.map(lambda i: i[:3]), max_size=3),   # RESUME-shaped
                      st.lists(_item.map(lambda i: i[:6]), max_size=3),
                      st.lists(_item.map(lambda i: i[:5]), max_size=3),
                      st.lists(_item.map(lambda i: i[:4] + i[6:]), max_size=3),   # INIT
                      st.lists(_item.map(lambda i: i[:3] + i[6:]), max_size=3),   # CHECK
                      st.lists(_item.map(lambda i: i[4:6]), max_size=3),          # DATA
                      st.lists(ANY, max_size=3)),
    # ATTACH: names that are not kvps segments, or are but do not exist; any nonce and size
    'name': st.one_of(st.sampled_from(['kvps-1-0123456789abcdef', '../../etc/passwd',
                                       'kvps-..', '', 'kvps-1-0123456789abcdef/x']),
                      st.text(max_size=24)),
    'nonce': st.binary(max_size=20), 'size': st.integers(-1, 1 << 41),
    'digest': st.one_of(st.binary(max_size=80), ANY),
    'key': _keys, 'part': st.integers(-3, 3), 'n': st.integers(-3, 300), 'dtype': _dtypes,
    'shape': _shapes,
    'sync': st.booleans(), 'role': st.sampled_from(['worker', 'server', 'scheduler', '']),
    'host': st.text(max_size=20), 'port': st.integers(-1, 70000), 'seq': _ints64,
    'rank': st.one_of(st.none(), st.integers(-2, 3)),
    'spec': st.one_of(ANY.filter(lambda v: isinstance(v, dict)), st.fixed_dictionaries(
        {'name': st.one_of(st.sampled_from(['sgd', 'adam', 'pickle', '']), ANY)},
        optional={'params': ANY, 'lr_scheduler': ANY, 'lr_mult': ANY, 'bogus': ANY})),
    'states': st.dictionaries(st.text(max_size=8), ANY, max_size=3),
    'type': st.text(max_size=12), 'message': st.text(max_size=40), 'reason': st.text(max_size=20),
}
_ALL_OPS = sorted(P.OPS)
_EXTRA_NAMES = ['n', 'part', 'key', 'dtype', 'shape', 'sync', 'rank', 'seq', 'spec', 'pid', 'x',
                'digest']
_ODD_OPS = st.one_of(st.sampled_from(_ALL_OPS), st.text(max_size=12),
                     st.sampled_from(['PUSH', 'push ', 'exec', '__class__', '']),
                     _scalars.filter(lambda v: not isinstance(v, str)))
_IDS = st.integers(0, 1 << 40)
_SMALL = st.integers(0, 11)
_COIN = st.booleans()
_EXTRAS = st.lists(st.sampled_from(_EXTRA_NAMES), max_size=2, unique=True)
_DELTAS = st.sampled_from([0, 0, 0, 0, -1, 1, None, 7])
_SIZES = st.integers(0, 600)
_FILL = st.binary(max_size=16)


@st.composite
def headers(draw, ops):
    """Valid-looking header maps: usually a real op with its fields, each maybe wrong."""
    op = draw(ops) if draw(_SMALL) > 2 else draw(_ODD_OPS)
    header = {'op': op}
    choice = draw(_SMALL)
    if choice:
        header['id'] = draw(ANY) if choice == 1 else draw(_IDS)
    fields = P._FIELDS.get(op, {}) if isinstance(op, str) else {}
    for name in fields:
        choice = draw(_SMALL)
        if choice == 0:
            continue                                 # missing
        header[name] = draw(ANY) if choice == 1 else draw(_GOOD.get(name, ANY))
    if op == P.REGISTER and draw(_COIN):
        header['rank'] = draw(_GOOD['rank'])
    if draw(_SMALL) < 3:
        for name in draw(_EXTRAS):
            header[name] = draw(_GOOD.get(name, ANY)) if draw(_COIN) else draw(ANY)
    return header


@st.composite
def data_frames(draw, header):
    """Buffers: usually the count the op wants (one per item of a multi-key op that sends
    values), of the declared length or a bit off (a SET_OPTIMIZER's often a packed spec-like
    map)."""
    op = header.get('op')
    want = P._BUFFERS.get(op, 0) if isinstance(op, str) else 0
    if op == P.SET_OPTIMIZER and want and draw(_COIN):
        return [_packed_any(draw(_GOOD['spec']))]
    sizes = [_exact(header.get('n'), header.get('dtype'))]
    items = header.get('keys')
    if op in (P.INIT, P.PUSH) and isinstance(items, list):
        sizes = [_exact(i[3], i[2]) if isinstance(i, list) and len(i) > 3 else None
                 for i in items]
        want = len(items)
    count = want if draw(_SMALL) else draw(_SMALL) % 4
    frames = []
    for index in range(count):
        exact = sizes[index % len(sizes)] if sizes else None
        if exact is not None and draw(_SMALL) > 2:
            delta = draw(_DELTAS)
            size = max(0, exact + (-exact if delta is None else delta))
        else:
            size = draw(_SIZES)
        frames.append(draw(_FILL)[:size].ljust(size, b'\x01'))
    return frames


def _exact(n, dtype):
    """The bytes of ``n`` elements of ``dtype``, if both are sane; else None."""
    if type(n) is int and isinstance(dtype, str) and dtype in WIRE_DTYPES and 0 <= n <= 4096:
        return P.nbytes(dtype, n)
    return None


def _packed(header):
    try:
        return msgpack.packb(header, use_bin_type=True)
    except (OverflowError, ValueError, TypeError):
        return msgpack.packb({'op': str(header.get('op'))}, use_bin_type=True)


_POOL_KEYS = st.sampled_from(['f0', 'f1', 'f2', 100, 101, -5])
_ANY_POOL_KEYS = st.one_of(_POOL_KEYS, st.sampled_from(sorted(REAL_KEYS)))
_WF_OPS = st.sampled_from([P.INIT, P.PUSH, P.PULL, P.INIT, P.PUSH, P.CHECK, P.GET_STATES])
_WF_DTYPES = st.sampled_from(WIRE_DTYPES)
_WF_N = st.integers(0, 64)
_WF_AT = st.one_of(st.none(), st.none(), st.none(), st.integers(0, 1 << 30))


@st.composite
def well_formed(draw):
    """Requests a worker could send: init, push, pull, check of a small pool of keys."""
    op, dtype, n = draw(_WF_OPS), draw(_WF_DTYPES), draw(_WF_N)
    writes = op in (P.INIT, P.PUSH)
    key, part = draw(_POOL_KEYS if writes else _ANY_POOL_KEYS), draw(_SMALL) % 2
    header = {'op': op, 'id': draw(_IDS), 'key': key, 'part': part, 'dtype': dtype, 'n': n,
              'shape': [n], 'sync': op == P.PUSH and draw(_COIN), 'dump': draw(_COIN)}
    at = draw(_WF_AT)
    if op in (P.PUSH, P.PULL, P.INIT, P.CHECK):   # the multi-key wire format
        for name in ('key', 'part', 'dtype', 'n', 'shape'):
            del header[name]
        header['keys'] = [{P.PUSH: [key, part, dtype, n, at, draw(_SMALL)],
                           P.PULL: [key, part, at], P.INIT: [key, part, dtype, n, [n]],
                           P.CHECK: [key, part, dtype, [n]]}[op]]
    buffers = [draw(_FILL)[:1].ljust(P.nbytes(dtype, n), b'\x02')] \
        if writes and not (op == P.PUSH and at is not None) else []
    return [msgpack.packb(header, use_bin_type=True), *buffers]


_PERCENT = st.integers(0, 99)
_CUTS = st.integers(0, 1 << 16)
_OVERSIZE = st.integers(P.MAX_HEADER_BYTES - 64, P.MAX_HEADER_BYTES + 4096)
_BIG_N = st.integers(1 << 18, 1 << 20)
_RANDOM_FRAMES = st.lists(st.binary(max_size=48), min_size=1, max_size=4)
_JUNK = st.binary(min_size=1, max_size=8)
_FEW_JUNK = st.lists(st.binary(max_size=8), max_size=2)
_BIG_DELTA = st.sampled_from([0, 0, 4, -4])


@st.composite
def hostile_messages(draw, ops, dealers):
    """(dealer index, frames) for one hostile message."""
    kind = draw(_PERCENT)
    if kind < 8:                                     # random bytes, random frame count
        frames = draw(_RANDOM_FRAMES)
    elif kind < 16:                                  # truncated or corrupted msgpack header
        packed = _packed(draw(headers(ops)))
        cut = draw(_CUTS) % max(1, len(packed))
        frames = [packed[:cut] if draw(_COIN) else packed + draw(_JUNK)]
    elif kind < 24:                                  # msgpack of the wrong type
        frames = [_packed_any(draw(ANY))] + draw(_FEW_JUNK)
    elif kind < 26:                                  # oversized header (> 1 MiB)
        pad = draw(_OVERSIZE)
        frames = [msgpack.packb({'op': draw(ops), 'id': 1, 'key': 'x',
                                 'part': 0, 'pad': b'\0' * pad}, use_bin_type=True)]
    elif kind < 27:                                  # big data frame for a key that is absent
        n = draw(_BIG_N)
        header = {'op': P.PUSH, 'id': 2, 'key': draw(_fuzz_keys), 'part': 0,
                  'dtype': 'float32', 'n': n, 'sync': True}
        frames = [_packed(header), b'\0' * (4 * n + draw(_BIG_DELTA))]
    elif kind < 42:                                  # well-formed requests, mostly fuzz keys
        frames = draw(well_formed())
    else:                                            # valid-looking headers and data frames
        header = draw(headers(ops))
        frames = [_packed(header)] + draw(data_frames(header))
    return draw(_COIN) % dealers, frames


def _packed_any(value):
    try:
        return msgpack.packb(value, use_bin_type=True)
    except (OverflowError, ValueError, TypeError):
        return b'\xc1'  # never used in msgpack


# -- the oracle --------------------------------------------------------------------------------
def classify(frames, target):
    """What the node must do with an insider's ``frames``: 'reject' (decode fails: log, no
    reply), 'reject-reply' (server: decode fails, logged, ERROR reply to the id), 'reply' (server: exactly one reply), 'not-op' (scheduler: logged, no reply),
    'refuse' (scheduler: logged, ERROR reply), 'ignore'; or 'skip' with a reason (not sent)."""
    try:
        header, buffers = P.decode(frames)
    except ProtocolError:
        # A member whose request the server cannot read is told so, when it has an id.
        if target == 'server' and P.request_id(frames) is not None:
            return 'reject-reply', None
        return 'reject', None
    op = header['op']
    if target == 'server':
        if op == P.RESUME:
            return 'ignore', None   # only a restarted server waits for one; it never answers
        if op in (P.PUSH, P.INIT) and any(k in REAL_KEYS for k in _keys_of(header)):
            return 'skip', 'member write to a real key'
        if op == P.INIT and header.get('sync'):
            return 'skip', 'sync key (its rounds would wait for worker 0)'
        if op == P.SET_OPTIMIZER and _valid_spec(_unpacked(buffers[0])):
            return 'skip', 'valid SET_OPTIMIZER'
        if op == P.SET_STATES and isinstance(_unpacked(buffers[0]), dict):
            return 'skip', 'SET_STATES of a map'
        if op == P.RESUME:
            return 'ignore', None   # only a restarted server reads it, and it never answers
        return 'reply', None
    if op == P.HEARTBEAT:
        return 'ignore', None       # from an unregistered identity: not even an ack
    if op in (P.REGISTER, P.BARRIER, P.FINISH, P.ACK):   # (ACK: servers' of memberships)
        return 'refuse', None
    return 'not-op', None


def _keys_of(header):
    """The keys a decoded header names: 'key', or the key of each 'keys' item that has one."""
    keys = [header['key']] if 'key' in header else []
    keys += [getattr(item, 'key', None) for item in header.get('keys') or ()]
    return [k for k in keys if isinstance(k, (int, str))]


def _valid_spec(spec):
    try:
        Optimizer.from_spec(spec)
        return True
    except Exception:  # noqa: BLE001 - not an optimizer, whatever the reason
        return False


def _unpacked(buffer):
    try:
        return msgpack.unpackb(buffer, raw=False, strict_map_key=False)
    except Exception:  # noqa: BLE001
        return None


class Fuzzer:
    """Sends hostile messages to one node and tallies what the node owes in replies and logs.

    Insiders sign with the job secret; outsiders send raw frames, frames signed with a wrong
    secret, or frames signed for another identity; every one of theirs must be refused."""

    def __init__(self, ctx, address, target, identities, secret, insider, captured=None):
        """``captured``: the member identity an outsider's captured messages were signed for."""
        self.target, self.insider, self.captured = target, insider, captured
        self.socks = [Signed(ctx, address, i, secret if insider else None) for i in identities]
        self.wrong = Guard('not-the-secret')
        self.right = Guard(secret)
        self.expected = collections.Counter()
        self.skipped = collections.Counter()
        self.replies = collections.Counter()
        self.owed = [0] * len(self.socks)
        self.sent = self.probes = 0
        self.recent = collections.deque(maxlen=PROBE_EVERY + 5)
        self._probe_id = 1 << 50

    def send(self, index, frames):
        sock = self.socks[index]
        if not self.insider:
            self._send_outsider(sock, frames)
        else:
            verdict, why = classify(frames, self.target)
            if verdict == 'skip':
                self.skipped[why] += 1
                return
            self.expected[verdict] += 1
            if verdict in ('reply', 'refuse', 'reject-reply'):
                self.owed[index] += 1
            self.recent.append((index, frames[:1] + [f'<{len(f)} bytes>' for f in frames[1:]]))
            sock.send(frames)
            if self.sent % REPLAY_EVERY == REPLAY_EVERY - 1:    # the same signed frames again
                sock.sock.send_multipart(sock.last_sent)
                self.expected['auth'] += 1
        self.sent += 1
        if self.insider and self.sent % PROBE_EVERY == 0:
            self.probe()

    def _send_outsider(self, sock, frames):
        way = self.sent % 4
        if way == 1:
            frames = self.wrong.sign(frames, TO_ROUTER, sock.identity)
        elif way == 2:   # signed with the secret, but for another sender (a captured message)
            frames = self.right.sign(frames, TO_ROUTER, self.captured)
        elif way == 3:
            frames = [os.urandom(48) + bytes(frames[0]), *frames[1:]]
        sock.sock.send_multipart(frames)
        self.expected['auth'] += 1

    def probe(self):
        """Every socket gets every reply it is owed, then the answer to a fresh request."""
        for index, sock in enumerate(self.socks):
            self._probe_id += 1
            if self.target == 'server':
                probe = {'op': P.CHECK, 'id': self._probe_id,
                         'keys': [['no-such-key', 0, 'float32', [1]]]}
            else:
                probe = {'op': P.BARRIER, 'id': self._probe_id, 'seq': 1}
            sock.send(P.encode(probe))
            self.probes += 1
            self._drain(index, until_id=self._probe_id)

    def _drain(self, index, until_id):
        sock = self.socks[index].sock
        deadline = time.monotonic() + REPLY_WAIT_S
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not sock.poll(int(left * 1000)):
                raise AssertionError(
                    f'{self.target} stopped answering after {self.sent} hostile messages; '
                    'the last ones (socket, frames):\n' +
                    '\n'.join(repr(m)[:300] for m in self.recent))
            header = self.socks[index].recv()
            if header['op'] == P.ERROR and header.get('id') == until_id:
                self.recent.clear()
                return
            self.replies[header['op'] if header['op'] != P.ERROR else header['type']] += 1
            self.owed[index] -= 1 + len(header.get('acks', ()))   # (plain acks ride on DATA)

    def settle(self):
        if self.insider:
            self.probe()
            assert self.owed == [0] * len(self.socks), (self.target, self.owed, self.replies)

    def summary(self):
        kind = 'insider' if self.insider else 'outsider'
        return (f'{kind} -> {self.target}: sent {self.sent} {dict(self.expected)}, replies '
                f'{dict(self.replies)}, not sent {dict(self.skipped)}')


def fuzz(fuzzer, ops, count, between=lambda: None):
    """Send ``count`` hostile messages (hypothesis draws them BATCH at a time: much faster)."""
    @seed(SEED)
    @settings(max_examples=max(1, count // BATCH), deadline=None, database=None,
              phases=[Phase.generate], suppress_health_check=list(HealthCheck))
    @given(st.lists(hostile_messages(st.sampled_from(ops), len(fuzzer.socks)),
                    min_size=BATCH, max_size=BATCH))
    def send_batch(messages):
        for message in messages:
            fuzzer.send(*message)
        between()

    send_batch()
    fuzzer.settle()
    print(fuzzer.summary())


# -- tests --------------------------------------------------------------------------------------
SERVER_OPS = [P.INIT, P.CHECK, P.PUSH, P.PULL, P.SET_OPTIMIZER, P.GET_STATES, P.SET_STATES,
              P.RESUME, P.ACK, P.DATA, P.ERROR, P.STATES, P.SHUTDOWN, P.FINISH, P.REGISTER,
              P.ATTACH]
SCHEDULER_OPS = [P.REGISTER, P.BARRIER, P.FINISH, P.HEARTBEAT, P.SHUTDOWN, P.PEER_LOST,
                 P.SERVER_LOST, P.SERVER_BACK, P.WELCOME, P.ACK, P.ERROR, P.PUSH]


@pytest.mark.timeout(150)
def test_fuzzed_server_and_scheduler_keep_serving_exact_values(by_hand, tmp_path):
    ctx = zmq.Context()
    try:
        cluster = start_cluster(by_hand, tmp_path, ctx)
        fake = cluster['fake']
        sched, server = cluster['scheduler_addr'], cluster['server_addr']
        outsiders, worker_1 = [b'intruder', b'worker-7'], fake.member(1)
        runs = [
            (Fuzzer(ctx, sched, 'scheduler', outsiders, SECRET, False, worker_1),
             SCHEDULER_OPS, OUTSIDER_MESSAGES),
            (Fuzzer(ctx, server, 'server', outsiders, SECRET, False, worker_1), SERVER_OPS,
             OUTSIDER_MESSAGES),
            # Members that are not registered workers: the scheduler refuses what they ask.
            (Fuzzer(ctx, sched, 'scheduler', [b'member-a', b'member-b'], SECRET, True),
             SCHEDULER_OPS, SCHEDULER_MESSAGES),
            # Worker 1, the one identity besides worker 0 that a server talks to.
            (Fuzzer(ctx, server, 'server', [worker_1], SECRET, True), SERVER_OPS,
             SERVER_MESSAGES),
        ]
        for fuzzer, ops, count in runs:
            fuzz(fuzzer, ops, count, between=fake.tick)
        (sched_out, server_out, sched_in, server_in) = [run[0] for run in runs]
        assert sched_in.sent + server_in.sent >= 0.8 * (SERVER_MESSAGES + SCHEDULER_MESSAGES)

        cluster['go'].write_text('go')
        worker = cluster['worker']
        assert worker.exit_code(90, fake.tick) == 0, worker.text
        assert 'RESULT {"bad": [], "rounds": 20}' in worker.text, worker.text
        fake.tick()
        fake.finish()
        server, scheduler = cluster['server'], cluster['scheduler']
        assert scheduler.exit_code(30, fake.tick) == 0, scheduler.text[-5000:]
        assert server.exit_code(30) == 0, server.text[-5000:]
    finally:
        ctx.destroy(linger=0)

    # Every message was refused or rejected with one logged reason, or answered, on the node.
    assert server.text.count('kvps.wire.refusals WARNING refused a message from') == \
        server_out.expected['auth'] + server_in.expected['auth']
    # Today an outsider's message is logged a second time ('not a worker of this job') after
    # authentication refused it; either way is fine.
    assert server.text.count('not a worker of this job') in (0, server_out.expected['auth'])
    assert server.text.count('rejected a message from') == (
        server_in.expected['reject'] + server_in.expected['reject-reply'])
    # The fuzz reaches both sides: plenty refused at decoding, plenty past it to a handler.
    # (A coverage floor, not a behaviour: the draws shift when unrelated code loads first,
    # 261-276 answered messages of 1600 were seen, so 1/6 = 266 was a coin toss.)
    floor = SERVER_MESSAGES // 8
    assert server_in.expected['reject'] > floor and server_in.expected['reply'] > floor
    assert scheduler.text.count('refused a message from') == \
        sched_out.expected['auth'] + sched_in.expected['auth']
    assert scheduler.text.count('rejected a message from') == sched_in.expected['reject']
    assert scheduler.text.count('rejected ') == \
        sched_in.expected['reject'] + sched_in.expected['not-op']
    assert scheduler.text.count('refused ') == (sched_out.expected['auth'] +
                                                sched_in.expected['auth'] +
                                                sched_in.expected['refuse'] + sched_in.probes)
    assert 'Traceback' not in scheduler.text, scheduler.text[-5000:]
