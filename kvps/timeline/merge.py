"""Join the part files of a job's nodes into one Chrome trace, their clocks aligned to the scheduler's.

The output is Chrome's trace-event JSON object format (``{"traceEvents": [...]}``), which
Perfetto and chrome://tracing open: one process per node (named "scheduler", "server N",
"worker N"), one row per thread, spans as complete events, and flow arrows joining the spans
that share a flow key (a worker's push, the server's update of that round, the pull that
returns it), in time order. ``otherData`` says how well the clocks are aligned.
"""

import dataclasses
import glob
import json
import os

import msgpack

from ..atomic import write_atomically
from ..errors import ConfigError
from .recording import SUFFIX, parts_dir

_ROLE_ORDER = {'scheduler': 0, 'server': 1, 'worker': 2}


@dataclasses.dataclass
class Part:
    """What one node wrote: who it is, its threads, spans and clock samples."""
    path: str
    info: dict
    threads: dict = dataclasses.field(default_factory=dict)
    events: list = dataclasses.field(default_factory=list)
    clocks: list = dataclasses.field(default_factory=list)   # (error, offset, at)
    dropped: int = 0

    @property
    def name(self):
        return self.info.get('name') or self.info.get('role') or os.path.basename(self.path)

    def offset(self, scheduler_host=None):
        """``(offset_ns, error_ns)`` onto the scheduler's clock: none on the scheduler's
        host (Linux's monotonic clock is the whole machine's), else the reading with the
        least error (clocks do not drift apart within a job); a node that never read it
        gets 0 with no error bound (None)."""
        if self.info.get('role') == 'scheduler' or (
                scheduler_host is not None and self.info.get('host') == scheduler_host):
            return 0, 0
        if not self.clocks:
            return 0, None
        error, offset, _ = min(self.clocks)
        return offset, error

    def sort_key(self):
        rank = self.info.get('rank')
        return _ROLE_ORDER.get(self.info.get('role'), 3), -1 if rank is None else rank, self.path


def part_files(sources):
    """The part files named by ``sources``: part files, directories of them, or the PATH a
    job wrote (its parts lie in ``PATH.d``)."""
    files = []
    for source in sources:
        source = os.fspath(source)
        if os.path.isdir(source) or os.path.isdir(parts_dir(source)):
            folder = source if os.path.isdir(source) else parts_dir(source)
            files += sorted(glob.glob(os.path.join(folder, f'*{SUFFIX}')))
        elif os.path.isfile(source):
            files.append(source)
        else:
            raise ConfigError(f'{source}: no timeline part file or directory there')
    if not files:
        raise ConfigError(f'no timeline part files (*{SUFFIX}) in {", ".join(map(str, sources))}')
    return files


def read_part(path):
    """One node's part file; a file cut short (its node was killed mid-write) keeps what
    was whole."""
    part = Part(path, {})
    with open(path, 'rb') as f:
        unpacker = msgpack.Unpacker(f, raw=False, strict_map_key=False)
        try:
            for item in unpacker:
                _take(part, item)
        except (msgpack.OutOfData, ValueError, msgpack.ExtraData):
            pass   # a torn last item
    return part


def _take(part, item):
    kind = item[0]
    if kind in ('X', 'i'):
        part.events.append(item)
    elif kind == 'thread':
        part.threads[item[1]] = item[2]
    elif kind == 'clock':
        part.clocks.append((item[2], item[1], item[3]))
    elif kind == 'node':
        part.info.update({k: v for k, v in item[1].items() if v is not None})
    elif kind == 'dropped':
        part.dropped += item[1]


def chrome_trace(parts):
    """The Chrome trace (a dict) of ``parts``, clocks aligned, times from the first event."""
    parts = sorted(parts, key=Part.sort_key)
    scheduler = next((p.info.get('host') for p in parts if p.info.get('role') == 'scheduler'),
                     None)
    offsets = [part.offset(scheduler) for part in parts]
    starts = [event[4] + offset for part, (offset, _) in zip(parts, offsets)
              for event in part.events]
    origin = min(starts, default=0)
    trace, flows = [], {}
    for pid, (part, (offset, _)) in enumerate(zip(parts, offsets), 1):
        trace += _metadata(pid, part)
        for event in part.events:
            trace.append(_event(pid, event, (event[4] + offset - origin) / 1000))
            for key in event[7] or ():
                flows.setdefault(_hashable(key), []).append(trace[-1])
    trace += _flow_events(flows)
    errors = [error for _, error in offsets]
    return {'traceEvents': trace, 'displayTimeUnit': 'ms', 'otherData': {
        'clock_error_us': None if None in errors else max(errors, default=0) / 1000,
        'clock_unmeasured': [p.name for p, (_, e) in zip(parts, offsets) if e is None],
        'dropped_events': {p.name: p.dropped for p in parts if p.dropped},
        'nodes': [p.name for p in parts]}}


def _metadata(pid, part):
    meta = [{'ph': 'M', 'name': 'process_name', 'pid': pid, 'tid': 0,
             'args': {'name': part.name}},
            {'ph': 'M', 'name': 'process_sort_index', 'pid': pid, 'tid': 0,
             'args': {'sort_index': pid}}]
    meta += [{'ph': 'M', 'name': 'thread_name', 'pid': pid, 'tid': tid, 'args': {'name': name}}
             for tid, name in sorted(part.threads.items())]
    return meta


def _event(pid, event, ts_us):
    kind, name, cat, tid, _, dur, args, _ = event
    out = {'ph': kind, 'name': name, 'cat': cat, 'pid': pid, 'tid': tid, 'ts': ts_us}
    if kind == 'X':
        out['dur'] = dur / 1000
    else:
        out['s'] = 't'
    if args:
        out['args'] = args
    return out


def _hashable(key):
    return tuple(_hashable(k) for k in key) if isinstance(key, list) else key


def _flow_events(flows):
    """Arrows through the spans of each flow key, in time order: Chrome binds a flow event
    to the innermost span that encloses it on its thread, so each lies inside its span: at
    the start of the first (a push leaves while its span lasts: the server may update before
    the sending thread is done), in the middle of the others (an update), at the end of the
    last (a pull returned)."""
    out = []
    for number, spans in enumerate(flows.values(), 1):
        if len(spans) < 2:
            continue
        spans.sort(key=lambda e: e['ts'])
        for i, span in enumerate(spans):
            phase = 's' if i == 0 else 'f' if i == len(spans) - 1 else 't'
            at = span['ts'] + span.get('dur', 0) * {'s': 0.001, 't': 0.5, 'f': 0.999}[phase]
            flow = {'ph': phase, 'id': number, 'name': 'round', 'cat': 'flow',
                    'pid': span['pid'], 'tid': span['tid'], 'ts': at}
            if phase != 's':
                flow['bp'] = 'e'
            out.append(flow)
    return out


def merge(sources, out):
    """Merge the parts named by ``sources`` into the Chrome trace file ``out``; returns the
    trace's ``otherData``."""
    parts = [read_part(path) for path in part_files(sources)]
    trace = chrome_trace(parts)
    write_atomically(os.fspath(out), json.dumps(trace, separators=(',', ':')).encode())
    return trace['otherData']
