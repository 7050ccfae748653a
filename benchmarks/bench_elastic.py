"""The cost of elasticity: dist_sync push+pull step time of a fixed job against the same job
with --min-workers (the membership check per round), and the time an elastic job takes to go
on after a worker is killed (bounded by KVPS_HEARTBEAT_TIMEOUT)."""

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from _common import JsonLines, default_out_dir, median, note

HERE = Path(__file__).resolve().parent
REPO = HERE.parent


def run_job(workers, launcher_args, mode, rounds, keys, size, env):
    cmd = [sys.executable, '-m', 'kvps.launch', '-n', str(workers), '-s', '1', *launcher_args,
           '--', sys.executable, str(HERE / 'elastic_worker.py'), mode, str(rounds), str(keys),
           str(size)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO,
                          env={**os.environ, 'OMP_NUM_THREADS': '1', **env})
    if proc.returncode != 0:
        raise RuntimeError(f'job failed ({proc.returncode}):\n{proc.stderr[-3000:]}')
    return [json.loads(line.split('RESULT ', 1)[1]) for line in proc.stdout.splitlines()
            if 'RESULT ' in line]


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument('--workers', type=int, default=2)
    p.add_argument('--rounds', type=int, default=300)
    p.add_argument('--keys', type=int, default=8)
    p.add_argument('--size', type=int, default=1 << 16, help='float32 elements per key')
    p.add_argument('--launches', type=int, default=3)
    p.add_argument('--out', default=None)
    args = p.parse_args()
    out = JsonLines(args.out or default_out_dir('elastic'), 'bench_elastic')
    shape = {'workers': args.workers, 'keys': args.keys, 'size': args.size}
    steps = {'fixed': [], 'elastic': []}
    for launch in range(args.launches):   # interleaved, so drift hits both alike
        for name, extra in (('fixed', []), ('elastic', ['--min-workers', '1'])):
            note(f'launch {launch}: {name}')
            results = run_job(args.workers, extra, 'steady', args.rounds, args.keys,
                              args.size, {})
            steps[name].append(median([r['step_s'] for r in results]))
    fixed, elastic = median(steps['fixed']), median(steps['elastic'])
    out.emit({'what': 'step', **shape, 'fixed_ms': fixed * 1e3, 'elastic_ms': elastic * 1e3,
              'elastic_over_fixed': elastic / fixed, 'launches': args.launches,
              # every launch's median, in the order run: the spread is the noise to judge by
              'fixed_each_ms': [round(s * 1e3, 3) for s in steps['fixed']],
              'elastic_each_ms': [round(s * 1e3, 3) for s in steps['elastic']]})
    for timeout in ('2', '6'):
        note(f'recovery, KVPS_HEARTBEAT_TIMEOUT={timeout}')
        env = {'KVPS_HEARTBEAT_INTERVAL': '0.5', 'KVPS_HEARTBEAT_TIMEOUT': timeout}
        results = run_job(args.workers + 1, ['--min-workers', '1'], 'recover', 60, args.keys,
                          args.size, env)
        out.emit({'what': 'recovery', **shape, 'workers': args.workers + 1,
                  'heartbeat_timeout_s': float(timeout),
                  'recovery_s': median([r['kill_round_s'] for r in results]),
                  'step_after_ms': median([r['step_s'] for r in results]) * 1e3,
                  'survivors': len(results)})


if __name__ == '__main__':
    main()
