"""`kvps.launch --mps`: the private MPS control daemon's start and stop (kvps.launch.mps), what the
launcher does with it, refuses, and leaves behind (nothing), through a stand-in
nvidia-cuda-mps-control (tests/mps_standin.py). Real jobs under it:
tests/cluster/test_mps_jobs.py."""

import io
import os
import signal
import subprocess
import sys
import textwrap

import pytest
from mps_standin import gone_within

from kvps.errors import ConfigError
from kvps.launch import cli as launch, mps
from kvps.launch.supervise import Supervisor

pytestmark = pytest.mark.timeout(60)


class Said(list):
    """A ``say``: keeps the launcher's lines."""

    def __call__(self, text):
        self.append(str(text))


def test_a_private_daemon_is_started_for_the_job_and_stopped_leaving_nothing(mps_control):
    control, said = mps_control(), Said()
    environ = dict(os.environ, PATH=control.path, KVPS_SECRET='s3cret')
    daemon = mps.start(environ, said)
    pipe, log = daemon.variables[mps.PIPE], daemon.variables[mps.LOG]
    assert os.path.dirname(pipe) == os.path.dirname(log) == daemon.root
    assert os.path.exists(os.path.join(pipe, 'control'))   # it waited for the daemon's pipe
    [started] = control.calls(['-d'])
    # the tool runs with the job's variables, in a directory only this user may enter, and
    # is not given the job's secret
    assert (started['pipe'], started['log'], started['mode']) == (pipe, log, '0o700')
    assert started['secret'] is False
    assert control.daemons_alive() and said == [f'MPS on: a private control daemon, '
                                                f'CUDA_MPS_PIPE_DIRECTORY={pipe}']
    mps.stop(daemon, said, environ)
    [quit_] = control.calls([])
    assert (quit_['stdin'], quit_['pipe']) == ('quit\n', pipe)
    assert control.daemons_alive() == [] and not os.path.exists(daemon.root)
    assert len(said) == 1   # it quit cleanly: nothing more to say


def test_a_daemon_already_named_is_used_and_neither_started_nor_stopped(mps_control):
    control, said = mps_control(), Said()
    environ = dict(os.environ, PATH=control.path, CUDA_MPS_PIPE_DIRECTORY='/run/mps')
    with mps.running(True, environ, said) as variables:
        assert variables == {}   # the processes inherit the one given
    assert control.calls() == []
    assert said == ['MPS on: the daemon of CUDA_MPS_PIPE_DIRECTORY=/run/mps (started and '
                    'stopped by others)']


def test_off_is_nothing(mps_control):
    control = mps_control()
    with mps.running(False, dict(os.environ, PATH=control.path), Said()) as variables:
        assert variables == {}
    assert control.calls() == []


@pytest.mark.parametrize('fail', ['missing', 'refused'])
def test_a_daemon_that_cannot_start_is_a_clear_error_leaving_nothing(fail, mps_control,
                                                                     tmp_path):
    control = mps_control(fail=True)
    path = str(tmp_path) if fail == 'missing' else control.path   # no such tool there
    with pytest.raises(ConfigError) as info:
        mps.start(dict(os.environ, PATH=path), Said())
    message = str(info.value)
    assert message.startswith('--mps: nvidia-cuda-mps-control ')
    assert "needs the NVIDIA driver's utilities (nvidia-cuda-mps-control on PATH) and a GPU" \
        in message
    if fail == 'missing':
        assert 'is not on PATH' in message and control.calls() == []
        return
    assert '-d failed (exit code 1: stand-in: no CUDA-capable device)' in message
    [started] = control.calls(['-d'])
    assert not os.path.exists(os.path.dirname(started['pipe']))


def test_a_quit_that_hangs_is_given_up_with_a_warning_and_the_directory_goes(mps_control):
    control, said = mps_control(), Said()
    environ = dict(os.environ, PATH=control.path)
    daemon = mps.start(environ, said)
    mps.stop(daemon, said, dict(environ, FAKE_MPS_QUIT_HANGS='1'), timeout=0.5)
    assert said[-1] == (f'warning: the MPS daemon of {daemon.variables[mps.PIPE]} did not quit '
                        'cleanly (no answer within 0.5 s); going on')
    assert not os.path.exists(daemon.root)   # (the fixture kills the stand-in daemon)


# -- the launcher ------------------------------------------------------------------------

@pytest.mark.parametrize('launcher', ['ssh', 'slurm', 'mpi'])
def test_mps_is_for_the_local_launcher_only(launcher, tmp_path, capsys):
    hosts = tmp_path / 'hosts'
    hosts.write_text('node1\n')
    extra = ['-H', str(hosts)] if launcher != 'slurm' else []
    with pytest.raises(SystemExit) as info:
        launch.parse_args(['-n', '1', '--mps', '--launcher', launcher, *extra, 'cmd'])
    assert info.value.code == 2
    assert (f'--mps starts an MPS daemon on this host only (--launcher local); with --launcher '
            f'{launcher} run MPS on each host, as cluster admins do (docs/launching.md#cuda-mps'
            in capsys.readouterr().err)


def _first_spec(monkeypatch, argv, environ):
    """(exit code, the first spec the launcher would start, its stderr): nothing starts."""
    started = []

    def start(self, spec):
        started.append(spec)
        self.stop(1)
    monkeypatch.setattr(Supervisor, 'start', start)
    err = io.StringIO()
    code = launch.run(launch.parse_args(['-n', '1', '-s', '1', *argv, '--', 'cmd']),
                      environ=environ, node_argv=('node',), out=io.StringIO(), err=err)
    return code, (started or [None])[0], err.getvalue()


def test_the_launcher_gives_its_processes_the_daemon_and_stops_it_after_them(monkeypatch,
                                                                             mps_control):
    control = mps_control()
    code, spec, err = _first_spec(monkeypatch, ['--mps'], dict(os.environ, PATH=control.path))
    [started], [quit_] = control.calls(['-d']), control.calls([])
    assert spec.env['CUDA_MPS_PIPE_DIRECTORY'] == started['pipe']
    assert spec.env['CUDA_MPS_LOG_DIRECTORY'] == started['log']
    assert quit_['stdin'] == 'quit\n' and control.daemons_alive() == []
    assert not os.path.exists(os.path.dirname(started['pipe']))
    assert f'kvps.launch: MPS on: a private control daemon, CUDA_MPS_PIPE_DIRECTORY=' \
           f'{started["pipe"]}\n' in err


def test_the_launcher_uses_a_daemon_already_named(monkeypatch, mps_control):
    control = mps_control()
    environ = dict(os.environ, PATH=control.path, CUDA_MPS_PIPE_DIRECTORY='/run/mps')
    code, spec, err = _first_spec(monkeypatch, ['--mps'], environ)
    assert spec.env['CUDA_MPS_PIPE_DIRECTORY'] == '/run/mps' and control.calls() == []
    assert 'MPS on: the daemon of CUDA_MPS_PIPE_DIRECTORY=/run/mps' in err


def test_without_its_tool_the_launcher_starts_no_process(monkeypatch, mps_control, tmp_path):
    control = mps_control(fail=True)
    for path in (str(tmp_path), control.path):   # not on PATH; there but -d fails
        code, spec, err = _first_spec(monkeypatch, ['--mps'], dict(os.environ, PATH=path))
        assert (code, spec) == (2, None)
        assert 'kvps.launch: --mps: nvidia-cuda-mps-control ' in err and 'and a GPU' in err


# The stand-in of `python -m kvps.node`: the scheduler reports a port as the real one does;
# every node then sleeps until it is killed.
SLEEPING_NODE = '''
import os, time
if os.environ['DMLC_ROLE'] == 'scheduler':
    path = os.environ['KVPS_PORT_FILE']
    with open(path + '.tmp', 'w') as f:
        f.write('4242')
    os.replace(path + '.tmp', path)
time.sleep(60)
'''


@pytest.mark.parametrize('signum', [signal.SIGINT, signal.SIGTERM, signal.SIGKILL])
def test_a_launcher_stopped_by_a_signal_leaves_no_daemon(signum, mps_control, tmp_path):
    """SIGINT, SIGTERM: the launcher stops the job, then its daemon. SIGKILL: it cannot;
    its sweeper, which outlives it, does."""
    control = mps_control()
    node = tmp_path / 'node.py'
    node.write_text(SLEEPING_NODE)
    worker = 'import time; print("up", flush=True); time.sleep(60)'
    code = textwrap.dedent(f'''
        import sys
        from kvps.launch import cli
        sys.exit(cli.main(['--mps', '-n', '1', '-s', '1', '--', sys.executable, '-c',
                           {worker!r}], node_argv=(sys.executable, {str(node)!r})))
    ''')
    proc = subprocess.Popen([sys.executable, '-c', code], env=dict(os.environ, PATH=control.path),
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert proc.stdout.readline() == '[worker 0] up\n'
        assert control.daemons_alive()
        proc.send_signal(signum)
        assert proc.wait(30) == (128 + signum if signum != signal.SIGKILL else -signum)
    finally:
        proc.kill()
        proc.wait(10)
        proc.stdout.close()
    [started] = control.calls(['-d'])
    root = os.path.dirname(started['pipe'])
    assert gone_within(lambda: control.daemons_alive() or os.path.exists(root), 30), \
        'the daemon or its directory outlived the launcher'
    assert control.calls([])[0]['stdin'] == 'quit\n'
