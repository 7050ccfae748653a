"""A real OpenSSH server on 127.0.0.1 for the launcher's ssh tests: its own host key, config
and authorized key in a temporary directory, and an ssh client config that names the test's
hosts (alpha, beta, gamma) as aliases of it. Needs /usr/sbin/sshd (Debian's openssh-server,
which .ci/run installs where it can); without it the tests that ask for it skip.

The port: sshd cannot take port 0 and say which it got, so the OS picks a free one on a
socket that is closed just before sshd binds it; a port taken in between is tried again.
"""

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

SSHD = '/usr/sbin/sshd'
# what sshd lets through of the client's environment: the tests' tag (to find what a job
# leaves behind) and PYTHONPATH (where kvps is, as a login on a real cluster would have it)
PASSED = 'KVPS_TEST_TAG PYTHONPATH'


def available():
    """Why the real-sshd tests cannot run here, or None when they can."""
    if not os.path.exists(SSHD):
        return f'{SSHD} is not installed (Debian: apt-get install openssh-server)'
    if shutil.which('ssh-keygen') is None or not os.path.exists('/usr/bin/ssh'):
        return 'the OpenSSH client (ssh, ssh-keygen) is not installed'
    if os.geteuid() != 0 and not os.path.isdir('/run/sshd'):
        return 'sshd needs /run/sshd, which only root can make here'
    return None


class Daemon:
    """One sshd serving the current user with a key of its own; ``command`` is the ssh
    command line that reaches it as alpha, beta or gamma."""

    def __init__(self, directory, hosts):
        self.dir = Path(directory)
        self.hosts = hosts
        self.proc = None
        for name in ('host_key', 'user_key'):
            subprocess.run(['ssh-keygen', '-q', '-t', 'ed25519', '-N', '', '-f',
                            str(self.dir / name)], check=True)
        shutil.copy(self.dir / 'user_key.pub', self.dir / 'authorized_keys')
        os.chmod(self.dir / 'authorized_keys', 0o600)

    @property
    def command(self):
        return f'/usr/bin/ssh -F {self.dir / "ssh_config"} -o BatchMode=yes'

    def start(self, tries=5):
        for _ in range(tries):
            port = _free_port()
            self._write_configs(port)
            # sshd refuses to start without its privilege separation directory
            os.makedirs('/run/sshd', mode=0o755, exist_ok=True)   # (root: available())
            log = open(self.dir / 'sshd.log', 'ab')
            self.proc = subprocess.Popen([SSHD, '-D', '-e', '-f', str(self.dir / 'sshd_config')],
                                         stdout=log, stderr=log)
            log.close()
            if self._listening(port):
                return self
            self.stop()
        raise RuntimeError(f'sshd did not start: {self.log()}')

    def _write_configs(self, port):
        d = self.dir
        (d / 'sshd_config').write_text(
            f'Port {port}\nListenAddress 127.0.0.1\nHostKey {d}/host_key\n'
            f'AuthorizedKeysFile {d}/authorized_keys\nPasswordAuthentication no\n'
            'KbdInteractiveAuthentication no\nPermitRootLogin prohibit-password\nUsePAM no\n'
            f'StrictModes no\nPidFile {d}/sshd.pid\nAcceptEnv {PASSED}\n')
        (d / 'ssh_config').write_text(
            f'Host {" ".join(self.hosts)}\n  HostName 127.0.0.1\n  Port {port}\n'
            f'  IdentityFile {d}/user_key\n  IdentitiesOnly yes\n'
            '  StrictHostKeyChecking no\n  UserKnownHostsFile /dev/null\n  LogLevel ERROR\n'
            f'  SendEnv {PASSED}\n')

    def _listening(self, port, timeout=10.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.proc.poll() is None:
            with socket.socket() as probe:
                if probe.connect_ex(('127.0.0.1', port)) == 0:
                    return True
            time.sleep(0.05)
        return False

    def log(self):
        return (self.dir / 'sshd.log').read_text(errors='replace')

    def stop(self):
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)
        self.proc = None


def _free_port():
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]
