"""`python -m kvps.timeline merge|summary|plot`: join a job's part files, read the result, draw a step."""

import argparse
import sys

from ..errors import ConfigError
from . import merge, summary


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog='python -m kvps.timeline', description=__doc__)
    sub = p.add_subparsers(dest='command', required=True)
    m = sub.add_parser('merge', help="join nodes' part files into one Chrome trace")
    m.add_argument('sources', nargs='+', help='part files, their directories, or the PATH a '
                   'job wrote (its parts are in PATH.d)')
    m.add_argument('-o', '--output', required=True, help='the Chrome trace to write')
    s = sub.add_parser('summary', help='where the time of a step goes')
    s.add_argument('path', help='a merged trace')
    g = sub.add_parser('plot', help='one step as a Gantt chart (needs matplotlib)')
    g.add_argument('path', help='a merged trace')
    g.add_argument('-o', '--output', required=True, help='the picture to write (.png, .svg)')
    g.add_argument('--step', type=int, default=None, help='which step (default: the slowest)')
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    try:
        if args.command == 'merge':
            other = merge.merge(args.sources, args.output)
            print(f'{args.output}: {len(other["nodes"])} nodes ({", ".join(other["nodes"])})')
        elif args.command == 'summary':
            print('\n'.join(summary.summarize(summary.load(args.path))))
        else:
            from .plot import plot
            plot(summary.load(args.path), args.output, args.step)
    except (ConfigError, ValueError, OSError) as exc:
        print(f'kvps.timeline: {exc}', file=sys.stderr)
        return 1
    return 0


if __name__ == '__main__':
    sys.exit(main())
