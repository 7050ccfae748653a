"""Read a merged timeline: where an average step's time goes per role, the slowest step's critical path, bytes by route.

A step is the time from one Trainer step (a ``step`` span) to the next on a worker; a job
that uses the store without the Trainer has its steps cut at each ``push`` (or ``pushpull``)
call instead.
Time is counted exclusively: a span's own time leaves out the spans inside it (a pull's wait
is ``wait``, not also ``pull``). A worker's ``compute`` is the part of its steps in which
the thread making them was in no kvps span: the model's forward and backward, the data.
"""

import bisect
import collections
import json

STEP_NAMES = {'step': ('step',), 'push': ('push', 'pushpull')}   # spans that start a step
ROUTES = ('ipc', 'shm', 'socket')   # how a message's bytes travel (spans' fields of those names)
SHOWN = {'worker': ('compute', 'phase', 'step', 'push', 'compress', 'backpressure', 'wait',
                    'pull', 'land', 'barrier'),
         'server': ('recv', 'merge', 'update', 'reply', 'checkpoint'),
         'scheduler': ('register', 'barrier', 'membership', 'lost')}


def load(path):
    with open(path) as f:
        return json.load(f)


def summarize(trace):
    """The summary of a merged trace (a dict), as lines of text."""
    timeline = Timeline(trace)
    lines = [timeline.header()]
    lines += timeline.breakdown()
    lines += timeline.critical_path()
    lines += timeline.bytes_by_route()
    return lines


class Timeline:
    """The spans and flows of a merged trace, by node and thread."""

    def __init__(self, trace):
        events = trace['traceEvents']
        self.other = trace.get('otherData', {})
        self.names = {e['pid']: e['args']['name'] for e in events
                      if e.get('ph') == 'M' and e['name'] == 'process_name'}
        self.threads = {(e['pid'], e['tid']): e['args']['name'] for e in events
                        if e.get('ph') == 'M' and e['name'] == 'thread_name'}
        self.spans = [e for e in events if e.get('ph') == 'X']
        self.flows = [e for e in events if e.get('ph') in ('s', 't', 'f')]
        self.pauses = [e for e in events if e.get('ph') == 'i' and e['name'] == 'pause'
                       and e.get('cat') == 'timeline']
        self.by_thread = collections.defaultdict(list)
        for span in self.spans:
            self.by_thread[span['pid'], span['tid']].append(span)
        for spans in self.by_thread.values():
            spans.sort(key=lambda s: (s['ts'], -s['dur']))
        self.own = _exclusive(self.by_thread)
        self.steps = self._steps()

    def role(self, pid):
        return self.names.get(pid, '?').split(' ')[0]

    def _steps(self):
        """{(pid, tid): [(start, end)]} of each worker thread that made steps."""
        marks = collections.defaultdict(list)
        cat = 'step' if any(s['cat'] == 'step' for s in self.spans) else 'push'
        for span in self.spans:
            if (span['cat'] == cat and span['name'] in STEP_NAMES[cat]
                    and self.role(span['pid']) == 'worker'):
                marks[span['pid'], span['tid']].append(span['ts'])
        paused = collections.defaultdict(list)   # a paused recording's gap is no step
        for event in self.pauses:
            paused[event['pid']].append(event['ts'])
        return {where: [(a, b) for a, b in zip(starts, starts[1:])
                        if not any(a <= t < b for t in paused[where[0]])]
                for where, starts in marks.items() if len(starts) > 1}

    def header(self):
        count = max((len(p) for p in self.steps.values()), default=0)
        error = self.other.get('clock_error_us')
        clock = 'unmeasured' if error is None else f'aligned within {error / 1000:.3f} ms'
        mean = _mean([b - a for periods in self.steps.values() for a, b in periods])
        steps = (f'{count} steps, {mean / 1000:.2f} ms on average' if count else
                 'no steps (no Trainer step or push spans on a worker): totals of the job')
        nodes = ', '.join(self.names.values())
        return f'{len(self.names)} nodes ({nodes}); clocks {clock}; {steps}'

    def per_step(self):
        """{(role, thread): {kind of span: ms per step and node}} (spans that start within
        the workers' steps; time before the first, after the last and in a gap a pause left
        out is not counted); without steps, ms over the whole job. Threads are apart: a worker's I/O thread sends while
        its calling thread waits."""
        steps = max((len(p) for p in self.steps.values()), default=0) or 1
        within = _union(p for periods in self.steps.values() for p in periods)
        totals = collections.defaultdict(lambda: collections.defaultdict(float))
        for span, own in self.own:
            if within(span['ts']):
                totals[self._row(span['pid'], span['tid'])][span['cat']] += own
        for (pid, tid), periods in self.steps.items():
            totals[self._row(pid, tid)]['compute'] += sum(
                self._idle(pid, tid, a, b) for a, b in periods)
        nodes = collections.Counter(self.role(pid) for pid in self.names)
        return {row: {cat: us / nodes[row[0]] / steps / 1000 for cat, us in cats.items() if us}
                for row, cats in totals.items()}

    def _row(self, pid, tid):
        return self.role(pid), self.threads.get((pid, tid), f'thread {tid}')

    def step_ms(self):
        """The mean step, ms (0 without steps)."""
        return _mean([b - a for periods in self.steps.values() for a, b in periods]) / 1000

    def breakdown(self):
        """Lines: milliseconds per step each role's threads spend in each kind of span."""
        per_step, step = self.per_step(), self.step_ms()
        lines = ['', 'where an average step goes, ms per node (share of the step):' if step
                 else 'where the time went, ms per node:']
        order = {'worker': 0, 'server': 1, 'scheduler': 2}
        for role, thread in sorted(per_step, key=lambda r: (order.get(r[0], 3), r[1])):
            each = per_step[role, thread]
            shown = SHOWN.get(role, ())
            cats = [c for c in shown if c in each] + sorted(c for c in each if c not in shown)
            lines.append(f'  {role} ({thread}): ' + ', '.join(
                f'{c} {each[c]:.2f}' + (f' ({each[c] / step:.0%})' if step else '')
                for c in cats))
        return lines

    def _idle(self, pid, tid, start, end):
        """Time of [start, end) in which the thread was in no span (its compute)."""
        busy, reach = 0.0, start
        for span in self.by_thread[pid, tid]:
            a, b = max(span['ts'], reach), min(span['ts'] + span['dur'], end)
            if b > a:
                busy += b - a
                reach = b
        return end - start - busy

    def critical_path(self):
        """The chain of spans (joined by flows) that ended last in the slowest step."""
        slowest = max(((b - a, where, a, b) for where, periods in self.steps.items()
                       for a, b in periods), default=None)
        if slowest is None:
            return []
        length, (pid, _), start, end = slowest
        lines = ['', f'slowest step: {self.names[pid]}, {length / 1000:.2f} ms, from '
                     f'{start / 1000:.3f} ms; its last round:']
        chain = max((c for c in self.chains() if c[-1]['pid'] == pid
                     and start <= c[-1]['ts'] + c[-1]['dur'] <= end),
                    key=lambda c: c[-1]['ts'] + c[-1]['dur'], default=None)
        if chain is None:
            return lines + ['  (no flow recorded in it)']
        for span in chain:
            lines.append(f"  {span['ts'] / 1000:10.3f} ms  {self.names[span['pid']]:<10} "
                         f"{span['cat']}/{span['name']:<12} {span['dur'] / 1000:8.3f} ms"
                         f"{_describe(span.get('args'))}")
        return lines

    def chains(self):
        """The spans each flow passes through, in order."""
        chains = collections.defaultdict(list)
        for flow in sorted(self.flows, key=lambda f: f['ts']):
            span = self._enclosing(flow)
            if span is not None:
                chains[flow['id']].append(span)
        return [c for c in chains.values() if len(c) > 1]

    def _enclosing(self, flow):
        best = None
        for span in self.by_thread.get((flow['pid'], flow['tid']), ()):
            if span['ts'] <= flow['ts'] <= span['ts'] + span['dur']:
                if best is None or span['dur'] < best['dur']:
                    best = span
        return best

    def bytes_by_route(self):
        """Lines: the bytes workers' messages moved, by route (the spans' ``shm`` and
        ``socket`` fields) and kind (push or pull)."""
        moved = collections.defaultdict(float)
        for span in self.spans:
            args = span.get('args') or {}
            if self.role(span['pid']) == 'worker':
                for route in ROUTES:
                    if args.get(route):
                        moved[route, span['cat']] += args[route]
        if not moved:
            return []
        lines = ['', 'bytes by route (workers, whole job):']
        for route in ROUTES:
            cells = [f'{cat} {moved[route, cat] / 1e6:.1f} MB'
                     for cat in sorted(c for r, c in moved if r == route)]
            if cells:
                lines.append(f'  {route:<8} ' + ', '.join(cells))
        return lines


def _exclusive(by_thread):
    """[(span, its own time)]: a span's duration less that of the spans directly in it."""
    out = []
    for spans in by_thread.values():
        stack = []   # [span, own]
        for span in spans:
            end = span['ts'] + span['dur']
            while stack and stack[-1][0]['ts'] + stack[-1][0]['dur'] <= span['ts']:
                out.append(tuple(stack.pop()))
            if stack and end <= stack[-1][0]['ts'] + stack[-1][0]['dur']:
                stack[-1][1] -= span['dur']
            stack.append([span, span['dur']])
        out += [tuple(item) for item in stack]
    return out


def _describe(args):
    if not args:
        return ''
    shown = {k: v for k, v in args.items() if k != 'keys'}
    if 'keys' in args:
        shown['keys'] = len(args['keys']) if isinstance(args['keys'], list) else args['keys']
    return '  ' + ' '.join(f'{k}={v}' for k, v in shown.items())


def _mean(values):
    return sum(values) / len(values) if values else 0.0


def _union(periods):
    """Whether a time falls in any of ``periods`` ((start, end) pairs; none: every time)."""
    merged = []
    for a, b in sorted(periods):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    if not merged:
        return lambda t: True
    starts = [a for a, _ in merged]

    def within(t):
        i = bisect.bisect_right(starts, t) - 1
        return i >= 0 and t < merged[i][1]
    return within
