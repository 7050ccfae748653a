"""The numpy-only KVStore example runs as README says, converges, and goes on from its save."""

from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[2] / 'examples' / 'logreg_kvstore.py'


def _run_example(job, args, workers, servers):
    return job(f'''
        import runpy
        sys.argv = ['logreg_kvstore.py', *{list(args)!r}]
        try:
            runpy.run_path({str(EXAMPLE)!r}, run_name='__main__')
        except SystemExit as exc:
            assert not exc.code, exc.code
    ''', workers=workers, servers=servers, timeout=100)


def _accuracies(result):
    return {int(line.split('rank ')[1].split(':')[0]): float(line.split('test accuracy ')[1])
            for line in result.stdout.splitlines() if 'test accuracy' in line}


@pytest.mark.timeout(200)
def test_logreg_example_trains_saves_and_resumes(job, tmp_path):
    """dist_sync with 2 servers: every worker ends with the same weights (same accuracy) above
    93%; a dist_async job resumed from its save (weights and Adam state) starts from exactly
    those weights."""
    prefix = str(tmp_path / 'logreg')
    result = _run_example(job, ['--epochs', '10', '--save', prefix], workers=2, servers=2)
    assert result.returncode == 0, result.output
    first = _accuracies(result)
    assert sorted(first) == [0, 1] and first[0] == first[1] >= 0.93, result.output
    assert 'epoch 10/10 loss' in result.stdout
    assert Path(prefix + '.npz').is_file() and Path(prefix + '.states').is_file()

    resumed = _run_example(job, ['--kvstore', 'dist_async', '--epochs', '0', '--resume',
                                 prefix], workers=2, servers=1)
    assert resumed.returncode == 0, resumed.output
    assert _accuracies(resumed) == first, resumed.output
