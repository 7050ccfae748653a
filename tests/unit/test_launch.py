"""The launcher: argument parsing and planning, prefixed output, supervision, the port handshake.

Children here are plain python commands (and a fake node script), never a real kvps cluster.
"""

import io
import os
import re
import runpy
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from kvps.config import Config
from kvps.launch import cli as launch, supervise as launch_supervise
from kvps.launch.processes import ProcSpec
from kvps.launch.forwarding import run_specs
from kvps.launch.supervise import Supervisor

pytestmark = pytest.mark.timeout(30)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# A stand-in for `python -m kvps.node`: the scheduler binds port 0 and reports it through the
# port file like the real one; every role prints what it was given, then sleeps FAKE_<ROLE>_SLEEP.
FAKE_NODE = textwrap.dedent('''
    import os, socket, sys, time
    role = os.environ['DMLC_ROLE']
    if role == 'scheduler':
        if os.environ.get('FAKE_SCHEDULER_FAIL'):
            print('scheduler: cannot bind'); sys.exit(int(os.environ['FAKE_SCHEDULER_FAIL']))
        if os.environ.get('FAKE_SCHEDULER_SILENT'):
            print('scheduler: still resolving', flush=True)
            if os.environ.get('FAKE_PRINTED'):   # a file, once that line is out
                open(os.environ['FAKE_PRINTED'], 'w').close()
        else:
            s = socket.socket(); s.bind(('127.0.0.1', 0)); port = s.getsockname()[1]
            path = os.environ['KVPS_PORT_FILE']
            with open(path + '.tmp', 'w') as f:
                f.write(str(port))
            os.replace(path + '.tmp', path)
            print('bound', port)
            if not os.environ.get('FAKE_WORKERS_NEVER_JOIN'):
                open(path + '.formed', 'w').close()   # as if every node registered at once
    else:
        print(role, os.environ['KVPS_RANK'], 'dials', os.environ['DMLC_PS_ROOT_PORT'])
    time.sleep(float(os.environ.get('FAKE_%s_SLEEP' % role.upper(), '0.2')))
''')


def alive(pid):
    """Whether `pid` runs; zombies count as dead (this container's PID 1 may never reap them)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f'/proc/{pid}/stat', 'rb') as f:
            return f.read().rsplit(b')', 1)[1].split()[0] != b'Z'
    except (OSError, IndexError):
        return False


def assert_gone(pids, within=3.0):
    deadline = time.monotonic() + within
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not [p for p in pids if alive(p)], 'processes left behind'


def py(role, rank, code, **env):
    return ProcSpec(role, rank, (sys.executable, '-c', textwrap.dedent(code)),
                    dict(os.environ, PYTHONUNBUFFERED='1', **env))


def _once(path, then):
    """Code that runs the statements ``then`` once file ``path`` exists."""
    return (f'import os, time\nwhile not os.path.exists({str(path)!r}):\n    time.sleep(0.01)\n'
            + textwrap.dedent(then))


def _writes_pid(path):
    """Code that writes its pid to file ``path`` (whole: through a rename), then exits 0."""
    return (f'import os, pathlib\ntmp = pathlib.Path({str(path)!r} + ".tmp")\n'
            f'tmp.write_text(str(os.getpid())); tmp.replace({str(path)!r})')


def _after_reaped(path, then):
    """Code that runs the statement ``then`` once the process whose pid file ``path`` holds is
    gone, reaped by the supervisor: its exit reached the supervisor first. (A fixed sleep
    before ``then`` lost that race to a slow-starting process on a loaded machine.)"""
    return _once(path, f'''
        pid = open({str(path)!r}).read()
        while os.path.exists('/proc/' + pid):   # a zombie keeps its entry until it is reaped
            time.sleep(0.01)
        {then}
    ''')


def run_supervisor(specs, grace=1.0, shutdown_timeout=10.0, restarts=None, **options):
    """Run specs in-process; returns (exit code, stdout text, stderr text, the Supervisor)."""
    out, err = io.StringIO(), io.StringIO()
    sup = Supervisor(out=out, err=err, grace=grace, restarts=restarts, **options)
    try:
        for spec in specs:
            assert sup.start(spec) is not None
        rc = sup.supervise(shutdown_timeout)
    finally:
        sup.stop(1)
    return rc, out.getvalue(), err.getvalue(), sup


def supervise(specs, **options):
    """run_supervisor, with the children's pids in place of the Supervisor."""
    rc, out, err, sup = run_supervisor(specs, **options)
    return rc, out, err, [c.pid for c in sup.children]


@pytest.fixture
def fake_node(tmp_path):
    path = tmp_path / 'fake_node.py'
    path.write_text(FAKE_NODE)
    return (sys.executable, str(path))


# -- parsing and planning --------------------------------------------------------------------

def test_parse_command_forms():
    opts = launch.parse_args(['-n', '2', '-s', '1', 'python', 'train.py', '-n', '5'])
    assert (opts.num_workers, opts.num_servers) == (2, 1)
    assert opts.command == ['python', 'train.py', '-n', '5']
    assert opts.host == '127.0.0.1' and opts.grace == 5.0 and opts.env == []
    opts = launch.parse_args(['--num-workers', '3', '--num-servers', '2', '--grace', '0.5',
                              '--env', 'A=1', '--env', 'B=x=y', '--', 'python', '--', 'z'])
    assert (opts.num_workers, opts.num_servers, opts.grace) == (3, 2, 0.5)
    assert opts.command == ['python', '--', 'z'] and opts.env == [('A', '1'), ('B', 'x=y')]


@pytest.mark.parametrize('argv, message', [
    (['-n', '1', '-s', '0', 'cmd'], 'need at least one server'),
    (['-n', '0', '-s', '1', 'cmd'], 'must be >= 1'),
    (['-n', '1', '-s', '1'], 'missing the command'),
    (['-n', '1', '-s', '1', '--'], 'missing the command'),
    (['-s', '1', 'cmd'], '-n/--num-workers'),
    (['-n', '1', '-s', '1', '--timeout', '-1', 'cmd'], 'must be > 0'),
    (['-n', '1', '-s', '1', '--connect-timeout', 'soon', 'cmd'], "'soon'"),
    (['-n', '1', '-s', '1', '--host', 'no-such-host.invalid', 'cmd'],
     "'no-such-host.invalid': cannot resolve it to an IPv4 address on this host"),
    (['-n', '1', '-s', '1', '--host', '::1', 'cmd'], 'cannot resolve it to an IPv4 address'),
    (['-n', '1', '-s', '1', '--grace', '-2', 'cmd'], 'must be a finite number >= 0'),
    (['-n', '1', '-s', '1', '--grace', 'inf', 'cmd'], 'must be a finite number >= 0'),
    (['-n', '1', '-s', '1', '--grace', 'nan', 'cmd'], 'must be a finite number >= 0'),
    (['-n', '1', '-s', '1', '--grace', 'soon', 'cmd'], 'must be a finite number >= 0'),
    (['-n', '1', '-s', '1', '--env', 'NO SPACE=1', 'cmd'], 'expected NAME=VALUE'),
    (['-n', '1', '-s', '1', '--env', '=1', 'cmd'], 'valid variable name'),
    (['-n', '1', '-s', '1', '--env', '1FOO=2', 'cmd'], 'valid variable name'),
    (['-n', '1', '-s', '1', '--env', 'A-B=2', 'cmd'], 'valid variable name'),
    (['-n', '1', '-s', '1', '--env', '\u00e9T\u00c9=2', 'cmd'], 'valid variable name'),
    (['-n', '1', '-s', '1', '--env', 'DMLC_ROLE=server', 'cmd'], 'set by the launcher'),
    (['-n', '1', '-s', '1', '--env', 'KVPS_RANK=3', 'cmd'], 'set by the launcher'),
    (['-n', '1', '-s', '1', '--server-plugin', 'my-opts', 'cmd'], 'not a Python module name'),
    (['-n', '1', '-s', '1', '--server-plugin', 'a,b', 'cmd'], 'one module name per'),
])
def test_parse_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        launch.parse_args(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert 'usage:' in err and message in err


def test_plan_environment_of_each_role():
    opts = launch.parse_args(['-n', '2', '-s', '3', '--timeout', '7', '--heartbeat-timeout',
                              '4', '--env', 'EXTRA=1', 'python', 'train.py'])
    # stale contract variables in the launcher's own environment must not leak into children
    environ = {'PATH': '/bin', 'KVPS_ROLE': 'worker', 'DMLC_PS_ROOT_PORT': '1',
               'KVPS_RANK': '9', 'KVPS_TIMEOUT': '99', 'KVPS_LOG_LEVEL': 'INFO'}
    sched = launch.plan_scheduler(opts, environ, '/tmp/x/port', node_argv=('node',))
    assert (sched.role, sched.rank, sched.name, sched.argv) == ('scheduler', None, 'scheduler',
                                                               ('node',))
    assert sched.env['DMLC_PS_ROOT_PORT'] == '0' and sched.env['KVPS_PORT_FILE'] == '/tmp/x/port'
    assert 'KVPS_RANK' not in sched.env
    nodes = launch.plan_nodes(opts, environ, 4242, node_argv=('node',))
    assert [(s.role, s.rank) for s in nodes] == [
        ('server', 0), ('server', 1), ('server', 2), ('worker', 0), ('worker', 1)]
    assert [s.argv for s in nodes] == [('node',)] * 3 + [('python', 'train.py')] * 2
    for spec in [sched] + nodes:
        env = spec.env
        assert env['DMLC_ROLE'] == spec.role and 'KVPS_ROLE' not in env
        assert env['DMLC_PS_ROOT_URI'] == '127.0.0.1'
        assert (env['DMLC_NUM_WORKER'], env['DMLC_NUM_SERVER']) == ('2', '3')
        assert env['PYTHONUNBUFFERED'] == '1' and env['PATH'] == '/bin' and env['EXTRA'] == '1'
        assert env['KVPS_TIMEOUT'] == '7' and env['KVPS_HEARTBEAT_TIMEOUT'] == '4'
        assert env['KVPS_LOG_LEVEL'] == 'INFO' and 'KVPS_CONNECT_TIMEOUT' not in env
        config = Config.from_env(env)  # what the node will see
        assert (config.role, config.rank) == (spec.role, spec.rank)
        assert config.scheduler_port == (0 if spec.role == 'scheduler' else 4242)
        assert (config.num_workers, config.num_servers, config.timeout) == (2, 3, 7.0)
    assert environ['KVPS_ROLE'] == 'worker'  # the caller's mapping is not modified


def test_plan_host_and_passed_down_options():
    opts = launch.parse_args(['-n', '1', '-s', '1', '--host', '10.0.0.5', '--connect-timeout',
                              '3', '--heartbeat-interval', '0.5', '--log-level', 'DEBUG', 'c'])
    env = launch.plan_nodes(opts, {}, 1, node_argv=('node',))[1].env
    assert env['DMLC_PS_ROOT_URI'] == '10.0.0.5' and env['KVPS_CONNECT_TIMEOUT'] == '3'
    assert env['KVPS_HEARTBEAT_INTERVAL'] == '0.5' and env['KVPS_LOG_LEVEL'] == 'DEBUG'


def test_server_plugins_reach_the_servers_only_after_those_inherited():
    opts = launch.parse_args(['-n', '1', '-s', '2', '--server-plugin', 'mine.optimizers',
                              '--server-plugin', 'other', 'c'])
    nodes = launch.plan_nodes(opts, {'KVPS_SERVER_PLUGINS': 'site_opts'}, 1, node_argv=('n',))
    assert [s.env['KVPS_SERVER_PLUGINS'] for s in nodes] == [
        'site_opts,mine.optimizers,other'] * 2 + ['site_opts']   # a worker: only inherited
    assert Config.from_env(nodes[0].env).server_plugins == ('site_opts', 'mine.optimizers',
                                                            'other')
    alone = launch.plan_nodes(launch.parse_args(['-n', '1', '-s', '1', '--server-plugin', 'x',
                                                 'c']), {}, 1, node_argv=('n',))
    assert alone[0].env['KVPS_SERVER_PLUGINS'] == 'x' and 'KVPS_SERVER_PLUGINS' not in \
        alone[1].env


def module_entry(argv, monkeypatch, capsys):
    """`python -m kvps.launch ARGV`, run in this process: (exit code, stderr). (Run as a
    process with a job, it would start kvps nodes: tests/cluster/test_launch_shell.py.)"""
    monkeypatch.setattr(sys, 'argv', ['kvps.launch', *argv])
    with pytest.raises(SystemExit) as info:
        runpy.run_module('kvps.launch', run_name='__main__', alter_sys=True)
    return info.value.code, capsys.readouterr().err


def test_module_entry_point_reports_usage_errors(monkeypatch, capsys):
    code, err = module_entry(['-n', '1', '-s', '0', 'cmd'], monkeypatch, capsys)
    assert code == 2 and 'need at least one server' in err


def test_bad_inherited_setting_is_reported_before_starting(capsys):
    opts = launch.parse_args(['-n', '1', '-s', '1', 'true'])
    assert launch.run(opts, environ={'KVPS_TIMEOUT': 'never'}, node_argv=('false',)) == 2
    assert "KVPS_TIMEOUT='never'" in capsys.readouterr().err


# -- output ----------------------------------------------------------------------------------

def test_output_is_prefixed_per_line_including_a_partial_last_line():
    rc, out, err, _ = supervise([
        py('worker', 0, r'''
            import sys
            print('hello'); sys.stdout.flush()
            sys.stderr.write('to stderr\n'); sys.stderr.flush()
            sys.stdout.buffer.write(b'bad \xff byte\nno newline at the end')
        '''),
        py('scheduler', None, 'print("up")'),
    ])
    assert rc == 0 and err == ''
    lines = out.splitlines(keepends=True)
    assert sorted(lines) == sorted([
        '[worker 0] hello\n', '[worker 0] to stderr\n', '[worker 0] bad \ufffd byte\n',
        '[worker 0] no newline at the end\n', '[scheduler] up\n'])


def test_interleaved_output_keeps_lines_whole_and_in_order():
    code = '''
        import os, time
        for i in range(40):
            print(f'line {i} ' + 'x' * 200)
            time.sleep(0.002)
    '''
    rc, out, _, _ = supervise([py('worker', r, code) for r in range(3)])
    assert rc == 0
    for rank in range(3):
        mine = [l for l in out.splitlines() if l.startswith(f'[worker {rank}] ')]
        assert [l.split()[3] for l in mine] == [str(i) for i in range(40)]
        assert all(l.endswith('x' * 200) for l in mine)
    assert len(out.splitlines()) == 120


# -- supervision -----------------------------------------------------------------------------

def test_first_failure_stops_everything_including_grandchildren(tmp_path):
    flag = tmp_path / 'grandchild.pid'
    rc, out, err, pids = supervise([
        py('server', 0, 'import time; time.sleep(60)'),
        py('worker', 0, f'''
            import subprocess, time
            p = subprocess.Popen(['sleep', '60'])
            open({str(flag)!r} + '.tmp', 'w').write(str(p.pid))
            __import__('os').replace({str(flag)!r} + '.tmp', {str(flag)!r})
            time.sleep(60)
        '''),
        py('worker', 1, f'''
            import os, sys, time
            while not os.path.exists({str(flag)!r}):
                time.sleep(0.01)
            for i in range(30):
                print('noise', i)
            raise SystemExit('ValueError: the real cause')
        '''),
    ])
    assert rc == 1  # SystemExit with a message exits 1
    grandchild = int(flag.read_text())
    assert_gone(pids + [grandchild])
    assert re.search(r'kvps.launch: worker 1 \(pid \d+\) failed first: exit code 1', err)
    tail = err.split('last 20 lines:\n')[1].splitlines()
    assert tail[0] == '[worker 1] noise 11' and tail[-1] == '[worker 1] ValueError: the real cause'
    assert err.count('failed first') == 2  # at once, and again after the teardown


def test_exit_code_is_the_failing_childs_and_only_it_is_blamed():
    rc, _, err, pids = supervise([
        py('server', 0, 'import time; time.sleep(60)'),
        py('worker', 0, 'import time; time.sleep(0.3); raise SystemExit(3)'),
        py('worker', 1, 'import time; time.sleep(60)'),
    ])
    assert rc == 3 and 'worker 0' in err and 'worker 1' not in err and 'server' not in err
    assert 'exit code 3' in err and 'printed nothing' in err
    assert_gone(pids)


def test_child_killed_by_signal():
    rc, _, err, pids = supervise([
        py('server', 0, 'import time; time.sleep(60)'),
        py('worker', 0, 'import os, signal; print("bye"); os.kill(os.getpid(), signal.SIGKILL)'),
    ])
    assert rc == 128 + 9
    assert re.search(r'worker 0 \(pid \d+\) failed first: killed by signal SIGKILL', err)
    assert '[worker 0] bye' in err
    assert_gone(pids)


def test_all_succeed():
    rc, out, err, pids = supervise([
        py('scheduler', None, 'import time; time.sleep(0.3)'),
        py('server', 0, 'import time; time.sleep(0.3)'),
        py('worker', 0, 'print("done")'),
        py('worker', 1, 'print("done")'),
    ])
    assert (rc, err) == (0, '') and out.count('done') == 2
    assert_gone(pids)


def test_a_failed_server_is_restarted_until_its_budget_is_spent(tmp_path):
    starts = tmp_path / 'starts'
    rc, out, err, pids = supervise([
        py('server', 0, f'open({str(starts)!r}, "a").write("x"); raise SystemExit(3)'),
        py('worker', 0, 'import time; time.sleep(60)'),
    ], restarts={'server': 2})
    assert starts.read_text() == 'xxx'                  # the first start and two restarts
    assert err.count('restarting it') == 2 and '(0 restart(s) left)' in err
    assert rc == 3 and 'server 0' in err and 'failed first' in err
    assert_gone(pids)


def test_a_server_failing_after_the_workers_finished_is_not_restarted(tmp_path):
    worker = tmp_path / 'worker.pid'
    rc, _, err, pids = supervise([
        py('server', 0, _after_reaped(worker, 'raise SystemExit(4)')),
        py('worker', 0, _writes_pid(worker)),
    ], restarts={'server': 2})
    assert rc == 4 and 'restarting' not in err
    assert_gone(pids)


def test_child_ignoring_sigterm_is_killed_after_the_grace(tmp_path, monkeypatch):
    # The server takes its time on SIGTERM (writing a checkpoint, say), then stays. The
    # launcher's clock stands still until it has finished: a SIGKILL that did not wait for
    # the grace would come first, and the server would never say it had. (The worker fails
    # once the server handles SIGTERM, else a slow-starting server would die of it.)
    ready, done = tmp_path / 'ready', tmp_path / 'done'
    monkeypatch.setattr(launch_supervise, 'time', _ClockFrom(done))
    rc, out, err, sup = run_supervisor([
        py('server', 0, f'''
            import pathlib, signal, time
            def clean_up(*_):
                time.sleep(0.5)
                print('cleaned up after SIGTERM', flush=True)
                pathlib.Path({str(done)!r}).touch()
            signal.signal(signal.SIGTERM, clean_up)
            pathlib.Path({str(ready)!r}).touch()
            time.sleep(60)
        '''),
        py('worker', 0, _once(ready, 'raise SystemExit(4)')),
    ], grace=0.6)
    assert rc == 4 and 'survived SIGKILL' not in err
    assert '[server 0] cleaned up after SIGTERM' in out, out
    server = sup.children[0]
    assert server.proc.returncode == -signal.SIGKILL   # not left to its 60 s sleep
    assert_gone([server.pid])


def test_server_that_outlives_the_workers_is_reported_and_killed(tmp_path):
    server_1 = tmp_path / 'server1.pid'   # exits on its own, before the worker finishes
    rc, _, err, pids = supervise([
        py('server', 0, 'import time; time.sleep(60)'),
        py('server', 1, _writes_pid(server_1)),
        py('worker', 0, _after_reaped(server_1, 'pass')),
    ], shutdown_timeout=0.5)
    assert rc == 1
    assert 'kvps.launch: server 0 did not exit within 0.5 s after all workers finished' in err
    assert 'server 1' not in err
    assert_gone(pids)


SCHEDULER_AND_SERVER_WAITING = [py('scheduler', None, 'import time; time.sleep(60)'),
                                 py('server', 0, 'import time; time.sleep(60)')]


def test_workers_that_never_join_end_the_job_at_once(tmp_path):
    """A script that makes no distributed store (or none at all) ran to completion: the
    scheduler and servers waiting for it to register are stopped, nothing failed."""
    rc, out, err, sup = run_supervisor([*SCHEDULER_AND_SERVER_WAITING,
                                        py('worker', 0, 'print("done")'),
                                        py('worker', 1, 'import time; time.sleep(0.5)')],
                                       formed_file=str(tmp_path / 'formed'))
    assert rc == 0 and out.count('done') == 1
    assert err == 'kvps.launch: no worker joined the job (none created a distributed kvstore); ' \
                  'stopping the rest\n'
    # Stopped, not waited for: left to their 60 s, they would have met the shutdown bound
    # (10 s), which ends them too but with exit code 1, saying so.
    assert [c.proc.returncode for c in sup.children[:2]] == [-signal.SIGTERM] * 2
    assert_gone([c.pid for c in sup.children])


def test_a_worker_leaving_before_the_job_formed_is_blamed(tmp_path):
    """The others would wait for it until KVPS_CONNECT_TIMEOUT, and a server would be named."""
    rc, _, err, pids = supervise([*SCHEDULER_AND_SERVER_WAITING,
                                  py('worker', 0, 'import time; time.sleep(60)'),
                                  py('worker', 1, 'pass')],
                                 formed_file=str(tmp_path / 'formed'), unjoined_grace=0.5)
    assert rc == 1
    assert re.search(r'worker 1 \(pid \d+\) failed first: exited with exit code 0 without '
                     r'joining the job \(it never created a distributed kvstore\)', err)
    assert_gone(pids)


def test_workers_that_joined_may_finish_at_any_pace(tmp_path):
    formed = tmp_path / 'formed'
    formed.touch()
    rc, _, err, pids = supervise([py('server', 0, 'import time; time.sleep(1.5)'),
                                  py('worker', 0, 'import time; time.sleep(1)'),
                                  py('worker', 1, 'pass')],
                                 formed_file=str(formed), unjoined_grace=0.2)
    assert (rc, err) == (0, '')
    assert_gone(pids)


def _blaming(path, blame, reason, after=None):
    """Code that names ``blame`` ([role, rank] pairs) in the blame file, then exits 1, as the
    scheduler does when it ends the job because of a node; once file ``after`` exists, if
    given (a sleep alone lost the race to a slow-starting node on a loaded machine)."""
    code = f'''
        import json, os, time
        time.sleep(0.3)
        with open({str(path)!r} + '.tmp', 'w') as f:
            json.dump({{'blame': {blame!r}, 'reason': {reason!r}}}, f)
        os.replace({str(path)!r} + '.tmp', {str(path)!r})
        raise SystemExit(1)
    '''
    return code if after is None else _once(after, code)


def _exits_after(path):
    return _once(path, 'raise SystemExit(1)   # told by the scheduler that the job is over')


def test_the_node_the_scheduler_blames_is_named_not_the_first_to_exit(tmp_path):
    """A stopped server never exits: its peers, told the job is over, do; the scheduler's
    reason is the root cause."""
    blame, printed = tmp_path / 'blame', tmp_path / 'printed'
    rc, _, err, pids = supervise([
        py('scheduler', None, _blaming(blame, [['server', 1]], 'server 1 is lost: no heartbeat',
                                       after=printed)),
        py('server', 0, _exits_after(blame)),
        py('server', 1, f'import pathlib, time; print("stuck", flush=True); '
                        f'pathlib.Path({str(printed)!r}).touch(); time.sleep(60)'),
        py('worker', 0, _exits_after(blame)),
    ], blame_file=str(blame), restarts={'server': 2})
    assert rc == 1 and 'restarting' not in err   # the job is over: nothing to restart
    assert re.search(r'^kvps.launch: server 1 \(pid \d+\) failed first: the scheduler ended '
                     r'the job: server 1 is lost: no heartbeat; stopping', err, re.M), err
    assert '[server 1] stuck' in err and 'worker 0' not in err and 'server 0' not in err
    assert_gone(pids)


def test_a_worker_that_never_registered_is_named(tmp_path):
    blame = tmp_path / 'blame'
    rc, _, err, pids = supervise([
        py('scheduler', None, _blaming(blame, [['worker', 1]], '1 of 2 workers never registered')),
        py('worker', 0, _exits_after(blame)),
        py('worker', 1, 'import time; time.sleep(60)'),
    ], blame_file=str(blame))
    assert rc == 1
    assert re.search(r'worker 1 \(pid \d+\) failed first: the scheduler ended the job: 1 of 2 '
                     r'workers never registered', err), err
    assert 'worker 0' not in err
    assert_gone(pids)


def test_a_blame_naming_no_child_leaves_the_first_failure_blamed(tmp_path):
    blame = tmp_path / 'blame'
    rc, _, err, pids = supervise([
        py('scheduler', None, 'import time; time.sleep(60)'),
        py('worker', 0, _blaming(blame, [], 'a worker never registered')),
    ], blame_file=str(blame))
    assert rc == 1 and re.search(r'worker 0 \(pid \d+\) failed first: exit code 1', err), err
    assert_gone(pids)


def test_command_that_cannot_start():
    out, err = io.StringIO(), io.StringIO()
    rc = run_specs([py('server', 0, 'import time; time.sleep(60)'),
                    ProcSpec('worker', 0, ('/nonexistent/kvps-cmd',), {})],
                   grace=1.0, out=out, err=err)
    assert rc == 127 and 'cannot start worker 0 (/nonexistent/kvps-cmd)' in err.getvalue()


def _launcher_subprocess(code, count):
    """Run a launcher in its own process; returns it and {label: pid} once `count` are printed."""
    proc = subprocess.Popen([sys.executable, '-c', textwrap.dedent(code)], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    pids = {}
    while len(pids) < count:
        line = proc.stdout.readline()
        assert line, proc.stderr.read()
        prefix, label, pid = line.rsplit(None, 2)
        pids[f'{prefix} {label}'] = int(pid)
    return proc, pids


SLEEPERS = '''
    import sys
    from kvps.launch.processes import ProcSpec
    from kvps.launch.forwarding import run_specs
    code = 'import os, time; print("pid", os.getpid(), flush=True); time.sleep(60)'
    specs = [ProcSpec('server', r, (sys.executable, '-c', code), {}) for r in (0, 1)]
    code = ('import os, subprocess, time; p = subprocess.Popen(["sleep", "60"]); '
            'print("pid", os.getpid(), flush=True); print("grandchild", p.pid, flush=True); '
            'time.sleep(60)')
    specs.append(ProcSpec('worker', 0, (sys.executable, '-c', code), {}))
    sys.exit(run_specs(specs, grace=2.0))
'''


@pytest.mark.parametrize('signum', [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_signal_to_the_launcher_is_forwarded(signum):
    proc, pids = _launcher_subprocess(SLEEPERS, 4)
    proc.send_signal(signum)
    assert proc.wait(timeout=10) == 128 + signum
    assert f'got {signum.name}; stopping all processes' in proc.stderr.read()
    assert_gone(pids.values())
    proc.stdout.close(), proc.stderr.close()


def test_signals_ignored_at_start_stay_ignored():
    """`nohup kvps.launch ...` ignores SIGHUP (a closed terminal must not end the job), and a
    shell's background job SIGINT: the launcher forwards only the signals it is not told to
    ignore."""
    code = SLEEPERS.replace('import sys\n',
                            'import signal, sys\n    signal.signal(signal.SIGHUP, signal.SIG_IGN)\n')
    proc, pids = _launcher_subprocess(code, 4)
    proc.send_signal(signal.SIGHUP)
    proc.send_signal(signal.SIGTERM)   # (not ignored: forwarded, as ever)
    assert proc.wait(timeout=10) == 128 + signal.SIGTERM
    err = proc.stderr.read()
    assert 'got SIGTERM' in err and 'SIGHUP' not in err, err
    assert_gone(pids.values())
    proc.stdout.close(), proc.stderr.close()


def test_a_launcher_that_cannot_write_its_output_still_runs_the_job_to_its_end(monkeypatch):
    """A full disk (or a closed stdout) fails every write of the children's lines: the
    launcher keeps draining their pipes, so they never block writing, and returns their
    exit code."""
    class Full(io.StringIO):
        def write(self, text):
            raise OSError(28, 'No space left on device')
    noisy = 'import sys; [print("x" * 1000) for _ in range(2000)]; sys.exit(3)'
    rc = run_specs([py('worker', 0, noisy)], grace=1.0, out=Full(), err=Full())
    assert rc == 3
    monkeypatch.setattr(sys, 'stdout', None)   # (started with them closed: `>&- 2>&-`)
    monkeypatch.setattr(sys, 'stderr', None)
    assert run_specs([py('worker', 0, noisy)], grace=1.0) == 3


def test_children_die_with_a_killed_launcher():
    proc, pids = _launcher_subprocess(SLEEPERS, 4)
    proc.kill()
    proc.wait(timeout=10)
    proc.stdout.close(), proc.stderr.close()
    grandchild = pids.pop('[worker 0] grandchild')
    try:  # PR_SET_PDEATHSIG reaches direct children only: the worker's `sleep` outlives it
        assert_gone(pids.values())
    finally:
        os.kill(grandchild, signal.SIGKILL)


# -- the port-file handshake -----------------------------------------------------------------

def _opts(*extra):
    return launch.parse_args(['-n', '2', '-s', '1', '--grace', '1', *extra, '--',
                              sys.executable, '-c',
                              'import os; print("port", os.environ["DMLC_PS_ROOT_PORT"])'])


def test_port_file_handshake_with_a_fake_scheduler(fake_node):
    out, err = io.StringIO(), io.StringIO()
    assert launch.run(_opts(), node_argv=fake_node, out=out, err=err) == 0, err.getvalue()
    text = out.getvalue()
    port = re.search(r'^\[scheduler\] bound (\d+)$', text, re.M).group(1)
    assert f'[server 0] server 0 dials {port}' in text
    assert text.count(f'] port {port}') == 2
    assert err.getvalue() == ''


def test_the_launcher_learns_from_the_scheduler_whether_the_job_formed(fake_node):
    err = io.StringIO()
    rc = launch.run(_opts('--env', 'FAKE_WORKERS_NEVER_JOIN=1', '--env', 'FAKE_SCHEDULER_SLEEP=60',
                          '--env', 'FAKE_SERVER_SLEEP=60'),
                    node_argv=fake_node, out=io.StringIO(), err=err)
    assert rc == 0 and 'no worker joined the job' in err.getvalue()


def test_scheduler_that_exits_before_writing_its_port(fake_node):
    out, err = io.StringIO(), io.StringIO()
    rc = launch.run(_opts('--env', 'FAKE_SCHEDULER_FAIL=5'), node_argv=fake_node, out=out,
                    err=err)
    assert rc == 5
    assert re.search(r'scheduler \(pid \d+\) failed first: exit code 5', err.getvalue())
    assert '[scheduler] scheduler: cannot bind' in err.getvalue()
    assert 'server' not in out.getvalue() and 'worker' not in out.getvalue()


def test_scheduler_that_exits_cleanly_without_a_port(fake_node):
    err = io.StringIO()
    rc = launch.run(_opts('--env', 'FAKE_SCHEDULER_SILENT=1', '--env', 'FAKE_SCHEDULER_SLEEP=0'),
                    node_argv=fake_node, out=io.StringIO(), err=err)
    assert rc == 1 and 'exited with exit code 0 before writing its port file' in err.getvalue()


class _ClockFrom:
    """The launcher's ``time``, whose monotonic clock stands still until file ``path`` exists,
    or ``within`` seconds passed on the real clock (then the test fails on what it finds): the
    bounds it counts start there."""

    def __init__(self, path, within=15.0):
        self.path, self.within, self._started, self._held = path, within, None, None

    def __getattr__(self, name):   # sleep and the rest: the real ones
        return getattr(time, name)

    def monotonic(self):
        now = time.monotonic()
        if self._started is None:
            self._held = self._held or now
            if not os.path.exists(self.path) and now < self._held + self.within:
                return self._held
            self._started = now
        return now - (self._started - self._held)


def test_scheduler_that_never_writes_its_port(fake_node, tmp_path, monkeypatch):
    # The 0.5 s bound counts from the scheduler's first line: a slow-starting scheduler on a
    # loaded machine had not printed it 0.5 s after it was spawned ('printed nothing').
    # It is stopped on that bound while it still runs: had the launcher waited for it, it
    # would exit after its 20 s, and the launcher would say that it exited.
    printed = tmp_path / 'printed'
    monkeypatch.setattr(launch_supervise, 'time', _ClockFrom(printed))
    err = io.StringIO()
    rc = launch.run(_opts('--connect-timeout', '0.5', '--env', 'FAKE_SCHEDULER_SILENT=1',
                          '--env', 'FAKE_SCHEDULER_SLEEP=20', '--env', f'FAKE_PRINTED={printed}'),
                    node_argv=fake_node, out=io.StringIO(), err=err)
    assert rc == 1
    assert re.search(r'scheduler \(pid \d+\) failed first: did not write its port file within '
                     r'0.5 s', err.getvalue())
    # what it was stuck on is shown
    assert '[scheduler] scheduler: still resolving' in err.getvalue(), err.getvalue()


def test_an_unresolvable_host_is_refused_before_anything_starts(monkeypatch, capsys):
    # else the scheduler retries DNS for the whole --connect-timeout (120 s by default) while
    # the launcher waits for its port and finally says only that it never came
    started = []
    monkeypatch.setattr(Supervisor, 'start', lambda self, spec: started.append(spec.name))
    code, err = module_entry(['-n', '1', '-s', '1', '--host', 'no-such-host.invalid', '--',
                              sys.executable, '-c', 'pass'], monkeypatch, capsys)
    assert code == 2 and started == [], err
    assert "argument --host: 'no-such-host.invalid': cannot resolve" in err


def test_children_inherit_no_rank_from_a_cluster_manager():
    """kvps.launch gives the ranks: one run inside a Kubernetes Indexed Job's pod, a TFJob or
    under a dmlc tracker must not hand that process's own index to every child, where it
    would disagree with the KVPS_RANK the launcher sets."""
    opts = launch.parse_args(['-n', '2', '-s', '2', 'python', 'train.py'])
    environ = {'JOB_COMPLETION_INDEX': '3', 'DMLC_WORKER_ID': '5', 'DMLC_SERVER_ID': '0',
               'DMLC_TASK_ID': '7', 'MX_CONFIG': '{}', 'TF_CONFIG': '{}', 'KVPS_RANK': '1'}
    for spec in launch.plan_nodes(opts, environ, 4242, node_argv=('node',)):
        assert not (set(environ) - {'KVPS_RANK'}) & set(spec.env), spec.env
        assert spec.env['KVPS_RANK'] == str(spec.rank)
        assert Config.from_env(spec.env).rank_from == f'KVPS_RANK={spec.rank}'
