"""`python -m kvps.launch` run from a shell that has a node's role, or a bad setting, left in
its environment."""

import pytest

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize('inherited', [{'DMLC_ROLE': 'server'}, {'KVPS_ROLE': 'scheduler'}])
def test_the_launcher_process_never_takes_a_role_from_its_shell(job, inherited):
    # `import kvps` runs a server or scheduler role (MXNet's contract), but the launcher sets
    # the roles itself: a stale one in its shell must not turn it into a node.
    result = job('kvps.create("dist_sync")\nprint(7 * 6)\n', 1, 1, env=inherited)
    assert result.returncode == 0 and '[worker 0] 42' in result.stdout, result.output


def test_a_bad_setting_in_the_launchers_shell_is_its_usage_error(job):
    # exit 2 naming it, not a traceback at `import kvps`, and nothing started
    result = job('print(7 * 6)\n', 1, 1, env={'KVPS_TIMEOUT': 'never'})
    assert result.returncode == 2 and "KVPS_TIMEOUT='never'" in result.stderr, result.output
    assert '[worker 0]' not in result.stdout and '[scheduler]' not in result.output
