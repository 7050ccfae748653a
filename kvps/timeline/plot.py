"""Draw one step of a merged timeline as a Gantt chart (matplotlib, the `plot` extra).

One row per node and thread, bars coloured by the kind of span, arrows for the flows of a
round (a worker's push, the server's update, the pull that returns it). The step shown is
the slowest, or the one asked for.
"""

from .summary import Timeline

COLOURS = {'step': '#d9d9d9', 'phase': '#bdbdbd', 'push': '#1f77b4', 'pull': '#2ca02c',
           'wait': '#ff7f0e', 'backpressure': '#d62728', 'barrier': '#9467bd',
           'compress': '#8c564b', 'land': '#17becf', 'recv': '#aec7e8', 'merge': '#98df8a',
           'update': '#ffbb78', 'reply': '#c5b0d5', 'checkpoint': '#c49c94',
           'register': '#f7b6d2', 'membership': '#dbdb8d', 'lost': '#ff9896'}
OTHER = '#7f7f7f'   # kinds of span not listed (a store's init, set_optimizer, ...)


def step_window(timeline, step=None):
    """``(start, end)`` in µs of step ``step`` (0-based) of the first worker, or the slowest."""
    periods = sorted(p for periods in timeline.steps.values() for p in periods)
    if not periods:
        raise ValueError('the timeline holds no steps (no step or push spans on a worker)')
    if step is None:
        return max(periods, key=lambda p: p[1] - p[0])
    first = sorted(timeline.steps)[0]
    own = timeline.steps[first]
    if not 0 <= step < len(own):
        raise ValueError(f'step {step} is not in the timeline (it has {len(own)})')
    return own[step]


def plot(trace, out, step=None):
    """Write the Gantt chart of one step of ``trace`` (a merged trace dict) to ``out``."""
    try:
        import matplotlib
        matplotlib.use('Agg')
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit('kvps.timeline plot needs matplotlib: pip install "kvps[plot]"') from None
    timeline = Timeline(trace)
    start, end = step_window(timeline, step)
    rows = sorted(timeline.by_thread)
    fig, ax = plt.subplots(figsize=(12, 0.45 * len(rows) + 1.5))
    shown = set()
    for y, where in enumerate(rows):
        for span in timeline.by_thread[where]:
            a, b = max(span['ts'], start), min(span['ts'] + span['dur'], end)
            if b < a:
                continue
            shown.add(span['cat'])
            ax.broken_barh([((a - start) / 1000, max(b - a, 1) / 1000)], (y - 0.35, 0.7),
                           color=COLOURS.get(span['cat'], OTHER), linewidth=0)
    _arrows(ax, timeline, rows, start, end)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([f'{timeline.names[p]}: {timeline.threads.get((p, t), t)}'
                        for p, t in rows], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, (end - start) / 1000)
    ax.set_xlabel('ms from the start of the step')
    ax.set_title(f'one step: {(end - start) / 1000:.2f} ms')
    kinds = [k for k in COLOURS if k in shown] + sorted(shown - set(COLOURS))
    ax.legend([plt.Rectangle((0, 0), 1, 1, color=COLOURS.get(k, OTHER)) for k in kinds],
              kinds, fontsize=8, loc='upper left', bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def _arrows(ax, timeline, rows, start, end):
    index = {where: y for y, where in enumerate(rows)}
    for chain in timeline.chains():
        for a, b in zip(chain, chain[1:]):
            x0, x1 = a['ts'] + a['dur'], b['ts']
            if start <= x0 <= end and start <= x1 <= end:
                ax.annotate('', xy=((x1 - start) / 1000, index[b['pid'], b['tid']]),
                            xytext=((x0 - start) / 1000, index[a['pid'], a['tid']]),
                            arrowprops={'arrowstyle': '->', 'lw': 0.6, 'color': '#444444'})
