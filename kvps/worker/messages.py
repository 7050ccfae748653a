"""How a worker's requests are cut into messages and how their answers land: parts fused per
server, pulled bytes written into the caller's arrays."""

import numpy as np

from .. import rows
from ..arrays import flat_view
from ..compression import land_pulled, pulled_dtype
from ..errors import ProtocolError
from ..timeline import recording
from ..wire import budget, protocol as P
from ..wire.device_segments import DEVICE_BASE
from ..wire.pieces import joined

FUSE_BYTES = 1 << 20   # socket bytes up to which parts share a message for the same server
# Socket bytes a pushpull sends before the pull requests that follow them: small enough that
# results start coming back early in a big model's push, big enough that small keys still
# share messages.
WAVE_BYTES = 1 << 20


_SERVER_NAMES = {}


def server_name(rank):
    """The node name of server ``rank`` ('server N'), as the I/O thread knows it."""
    # One str per server, made once: asked per key part, and a str made anew hashes anew
    # each time it is looked up.
    name = _SERVER_NAMES.get(rank)
    if name is None:
        name = _SERVER_NAMES[rank] = f'server {rank}'
    return name


def server_rank(name):
    """The rank in a server's node name (server_name's inverse)."""
    return int(name[len('server '):])


def part_nbytes(item):
    """Bytes of one ``(key, part, array, dtype)`` part of a pull (``dtype``: the one its
    values travel in)."""
    return (item[1].stop - item[1].start) * P.ITEMSIZE[item[3]]


def fuse_bytes(config):
    """Socket bytes up to which parts share a message: FUSE_BYTES, less where the job's
    KVPS_MAX_MESSAGE_BYTES is lower (a message of small keys must stay one the server reads)."""
    return min(FUSE_BYTES, config.max_message_bytes)


def fuse(parts, wire_bytes=part_nbytes, shaped=False, most_bytes=FUSE_BYTES):
    """Group ``(key, part, array, dtype, ...)`` by server into messages: small parts together (one
    message per server instead of one per key), a big part alone, so the server starts on
    it while the next one is still on the wire. ``wire_bytes(item)``: what a part puts on the
    wire (0 through shared memory: such parts all share one message). A message also lists
    no more keys than its header may carry (budget.ITEMS_BUDGET; ``shaped``: INIT and CHECK
    items also list the key's shape, ``item[4]``). ``most_bytes``: fuse_bytes's."""
    open_batches, batches = {}, []
    int_item, most = budget.INT_ITEM_BYTES, budget.ITEMS_BUDGET   # (locals: runs per key part)
    for item in parts:
        server, nbytes = item[1].server, wire_bytes(item)
        if nbytes > most_bytes:
            batches.append((server, [item]))
            continue
        listed = int_item if type(item[0]) is int else budget.item_bytes(item[0])
        if shaped:
            listed += budget.shape_bytes(item[4])
        batch = open_batches.get(server)
        if batch is None or batch[0] + nbytes > most_bytes or batch[1] + listed > most:
            batch = open_batches[server] = [0, 0, []]
            batches.append((server, batch[2]))
        batch[0] += nbytes
        batch[1] += listed
        batch[2].append(item)
    return batches


def pushpull_waves(runs, pulls, sharding, staging):
    """``(pushes, pulls, socket bytes)`` per wave of a pushpull (Backend.pushpull's ``runs``
    and ``pulls``): a list of one run of copies cut into waves of about WAVE_BYTES on the
    socket; else each run as it is taken, with the bytes its payloads put on the socket
    (those in shared memory, ``staging``'s, count nothing)."""
    if isinstance(runs, list):
        (pushes,) = runs
        for start, stop, nbytes in _waves(pulls, sharding, staging):
            yield pushes[start:stop], pulls[start:stop], nbytes
        return
    done = 0
    for run in runs:
        sent = [(part, payload(part, array)) for key, array, _ in run
                for part in sharding.parts(key)]
        nbytes = sum(data.nbytes for part, data in sent if staging is None
                     or staging.offset_in(server_name(part.server), data) is None)
        yield run, pulls[done:done + len(run)], nbytes
        done += len(run)


def _waves(items, sharding, staging):
    """``(start, stop, socket bytes)`` runs of ``items`` ([(key, out, dtype)]) of about
    WAVE_BYTES each on the socket (parts that ``staging``, the worker's shared memory or
    None, would place count nothing: they cost no link time, and splitting them would only
    add messages)."""
    runs, start, held = [], 0, 0
    for i, (key, out, _) in enumerate(items):
        for part in sharding.parts(key):
            nbytes = (part.stop - part.start) * out.itemsize
            if staging is None or not staging.would_place(server_name(part.server), nbytes):
                held += nbytes
        if held >= WAVE_BYTES:
            runs.append((start, i + 1, held))
            start, held = i + 1, 0
    if start < len(items):
        runs.append((start, len(items), held))
    return runs


def payload(part, array):
    """What one part of an item carries: its slice of the flat array, or its own payload
    where ``array`` is a list of one per part (a compressed push, rows, or a value copied
    part by part into shared memory)."""
    return array[part.part] if type(array) is list else array[part.start:part.stop]


def landing_on_gpu(batch, codec, staging):
    """Whether each part of a pull's ``batch`` lands on a GPU (its target a devices.Landing,
    not a host array), where the worker has a device segment and the values are not
    rounded (a rounded value is written on the host); else None."""
    if staging is None or staging.device is None or codec is not None:
        return None
    return [type(item[2]) is not np.ndarray for item in batch]


def copier(batch, blocks, staging, node, counts, trace=None, landings=()):
    """The reply handler that writes every pulled part into the caller's arrays, from its data
    frame, from the shared-memory block (offset, array) the server wrote it into, or from the
    server's arena where it lent it (remembered: that key part then asks for no block).
    ``counts``: the worker's WorkerCounts (bytes by route); ``trace``: the I/O thread's
    MessageTrace while the timeline records. Targets may be a GPU pull's ``landings``
    (kvps.devices.Landing): their writes are made in their ``writing()``, which waits for
    them before the handler returns (the blocks and the arena's bytes they read are let go
    after it)."""
    def on_data(header, buffers):
        if not landings:
            return write_all(header, buffers)
        with landings[0].writing():
            write_all(header, buffers)

    def write_all(header, buffers):
        start = recording.now() if trace is not None else 0
        answers = header['keys']
        _check_answers(node, batch, answers, buffers)
        frames = iter(buffers)
        arena = None if staging is None else staging.arenas.get(node)
        socket = shm = ipc = 0
        for asked, block, answer in zip(batch, blocks, answers):
            key, part, target, dtype = asked
            at, lent = answer.at, answer.lent   # (read once: this runs for every key part)
            if arena is not None:
                arena.note((key, part.part), lent is not None)
            if lent is not None:
                if arena is None:
                    raise ProtocolError(f'{node} answered a pull from an arena this worker '
                                        'has not mapped')
                source = arena.view(lent, part_nbytes(asked))
                shm += source.nbytes
            elif at is None:
                source = next(frames)
                socket += source.nbytes
            elif block is not None and at == block[0]:
                source = block[1]
                if at >= DEVICE_BASE:   # a device array (the ipc route's): viewed, not read
                    ipc += source.nbytes
                    target[part.start:part.stop] = source.view(P.DTYPES[dtype])
                    continue
                shm += source.nbytes
            else:
                raise ProtocolError(f'a pull answered at shared-memory offset {at}, which this '
                                    'worker did not give')
            values = P.as_array(source, dtype)
            if values.itemsize == target.itemsize:
                target[part.start:part.stop] = values   # (np.copyto: slower)
            else:   # rounded by the server (a compressed pull): widened
                land_pulled(target[part.start:part.stop], values)
        counts.pulled_socket += socket
        counts.pulled_shm += shm
        counts.pulled_ipc += ipc
        if trace is not None:
            trace.landed(start, node, batch, socket, shm, ipc)
    return on_data


def _check_answers(node, batch, answers, frames):
    """A DATA answer lists no keys: it answers the pull's, in order. Check that it answers
    every one, and that each data frame has the size of the key part it answers, before
    any is written."""
    if len(answers) != len(batch):
        raise ProtocolError(f'{node} answered a pull of {len(batch)} key parts with '
                            f'{len(answers)}')
    frames = iter(frames)   # (as many as the items without `at` and `lent`: decode checked)
    for asked, answer in zip(batch, answers):
        if answer.at is None and answer.lent is None and len(next(frames)) != part_nbytes(asked):
            raise ProtocolError(f'{node} answered a pull of key {asked[0]!r} part '
                                f'{asked[1].part} with a frame of another size')


def state_collector(done):
    """The reply handler that gathers the pieces of a STATES answer and calls ``done`` with
    the whole. Piece 0 starts afresh: a request resent to a restarted server is answered
    from the start again, after pieces of its predecessor's answer."""
    pieces = []

    def keep(header, buffers):
        if not header.get('piece'):
            pieces.clear()
        pieces.append(buffers[0])
        if not header.get('more'):
            done(joined(pieces))
    return keep


def row_writer(table, marks, part):
    """The reply handler that writes pulled rows into ``table`` (a part's rows), and notes
    the part's change count in ``marks`` (a dict, or None)."""
    def on_rows(header, buffers):
        ids, values = rows.decode(buffers[0], table.shape[1], table.dtype, table.shape[0])
        table[ids] = values
        if marks is not None:
            marks[part] = [header['epoch'], header['count']]
    return on_rows


def live_collector(sink, slot, part, width, dtype):
    """The reply handler that puts a part's answered rows, as ids of the whole key, into
    ``sink[slot]``."""
    def on_rows(header, buffers):
        first = part.start // width
        ids, values = rows.decode(buffers[0], width, dtype, part.stop // width - first)
        sink[slot] = (ids + first, values)
    return on_rows


def describe(what, items):
    return f'{what} of key {items[0][0]!r}' if len(items) == 1 else f'{what} of {len(items)} keys'


def pull_targets(items, codec):
    """``(targets, finish, landings)`` of a pull of ``items`` ([(key, out, dtype)]): each
    key's flat target with the dtype its values travel in (``codec``'s, if it rounds them);
    ``(out, scratch)`` for outs that have no flat view (written into scratch, copied at the
    finish); the GPU pulls' Landings (device_route)."""
    targets, finish, landings = [], [], []
    for key, out, dtype in items:
        if type(out) is np.ndarray:
            flat = flat_view(out)
        else:
            flat = out
            landings.append(out)
        target = flat if flat is not None else np.empty(out.size, dtype=out.dtype)
        targets.append((key, target, dtype if codec is None else pulled_dtype(codec, dtype)))
        if flat is None:
            finish.append((out, target))
    return targets, finish, landings
