"""Emulated hosts for benchmarks: network namespaces on one bridge, each link rate-limited.

Each host is a network namespace with one veth link to a bridge. The link is limited to a
rate in both directions by tc's token bucket (on the host's side for what it sends, on the
bridge's side for what it receives), as a full-duplex NIC is. The bridge has no address and
no uplink: packets go from namespace to namespace and never leave the box. A host's TCP uses
the congestion control it is given (``congestion``; by default the box's own). Each host also
has a process (pid) namespace and a /dev/shm of its own (a directory of the real one, bound
over /dev/shm in the host's mount namespace): shared memory, and /proc/<pid>/fd through which
kvps maps a peer's segment, work within a host and not across hosts, as on real machines.
Needs root,
iproute2 (``ip``, ``tc``) and a kernel with namespaces, veth, bridge and tbf.
"""

import json
import os
import shutil
import signal
import subprocess
import time

SUBNET = '10.213.0'     # host i is SUBNET.(i+1); only inside the namespaces made here
PREFIX = 'kvb'          # names: kvb<pid>h<i> (namespace), kvb<pid> (bridge), kvb<pid>v<i> (veth)


def _ip(*args, check=True):
    return subprocess.run(['ip', *args], check=check, capture_output=True, text=True)


def _allow_congestion(name):
    """Let namespaces other than the box's own pick congestion control ``name``: they may
    choose only from net.ipv4.tcp_allowed_congestion_control, which may lack Linux's own
    default (a box running bbr allows "reno bbr")."""
    path = '/proc/sys/net/ipv4/tcp_allowed_congestion_control'
    with open(path) as f:
        allowed = f.read().split()
    if name not in allowed:
        with open(path, 'w') as f:
            f.write(' '.join([*allowed, name]))


def unavailable():
    """Why hosts cannot be emulated here ('' when they can)."""
    if os.geteuid() != 0:
        return 'needs root (network namespaces and tc)'
    missing = [t for t in ('ip', 'tc') if shutil.which(t) is None]
    if missing:
        return f'needs iproute2 ({", ".join(missing)} not found)'
    probe = f'{PREFIX}probe{os.getpid()}'
    made = _ip('netns', 'add', probe, check=False)
    if made.returncode != 0:
        return f'cannot make a network namespace: {made.stderr.strip()}'
    _ip('netns', 'del', probe, check=False)
    return ''


def congestion_controls():
    """The TCP congestion controls this kernel offers (``reno``, ``cubic``, ``bbr``, ...), and
    the one its sockets use by default."""
    with open('/proc/sys/net/ipv4/tcp_available_congestion_control') as f:
        offered = f.read().split()
    with open('/proc/sys/net/ipv4/tcp_congestion_control') as f:
        return offered, f.read().strip()


def remove_leftovers():
    """Namespaces and bridges an earlier run left behind (its process is gone)."""
    listed = _ip('netns', 'list', check=False).stdout.split()
    for name in listed:
        pid = _creator(name)
        if pid is not None and not os.path.exists(f'/proc/{pid}'):
            _ip('netns', 'del', name, check=False)
            shutil.rmtree(f'/dev/shm/{name}', ignore_errors=True)
    for line in _ip('-o', 'link', 'show', 'type', 'bridge', check=False).stdout.splitlines():
        name = line.split(':')[1].strip().split('@')[0]
        pid = _creator(name)
        if pid is not None and not os.path.exists(f'/proc/{pid}'):
            _ip('link', 'del', name, check=False)


def _creator(name):
    if not name.startswith(PREFIX):
        return None
    digits = name[len(PREFIX):].split('h')[0].split('v')[0]
    return int(digits) if digits.isdigit() else None


class EmulatedHosts:
    """``with EmulatedHosts(n, rate='1gbit') as hosts:`` ``hosts.address(i)``,
    ``hosts.command(i, argv)`` runs argv inside host i; everything is removed on exit.

    A host's namespaces live as long as its holder, a ``sleep`` that is the pid namespace's
    first process: commands enter its namespaces, and killing it ends all of them."""

    def __init__(self, count, rate='1gbit', queue_ms=20, congestion=None):
        self.count, self.rate, self.queue_ms = count, rate, queue_ms
        self.congestion = congestion
        self.tag = f'{PREFIX}{os.getpid()}'
        self.bridge = self.tag
        self.namespaces = [f'{self.tag}h{i}' for i in range(count)]
        self.holders, self.holder_pids = [], []

    def address(self, i):
        return f'{SUBNET}.{i + 1}'

    def command(self, i, argv):
        return ['nsenter', '-t', str(self.holder_pids[i]), '-n', '-m', '-p', '--', *argv]

    def _shm_dir(self, i):
        return f'/dev/shm/{self.namespaces[i]}'

    def __enter__(self):
        try:
            self._build()
        except BaseException:
            self.__exit__()
            raise
        return self

    def _build(self):
        if self.congestion:
            _allow_congestion(self.congestion)
        _ip('link', 'add', self.bridge, 'type', 'bridge')
        _ip('link', 'set', self.bridge, 'up')
        for i, ns in enumerate(self.namespaces):
            veth = f'{self.tag}v{i}'
            _ip('netns', 'add', ns)
            os.makedirs(self._shm_dir(i))
            _ip('link', 'add', veth, 'type', 'veth', 'peer', 'name', 'eth0', 'netns', ns)
            _ip('link', 'set', veth, 'master', self.bridge)
            _ip('link', 'set', veth, 'up')
            _ip('-n', ns, 'addr', 'add', f'{self.address(i)}/24', 'dev', 'eth0')
            _ip('-n', ns, 'link', 'set', 'eth0', 'up')
            _ip('-n', ns, 'link', 'set', 'lo', 'up')
            if self.congestion:   # (a namespace starts with the box's default)
                _ip('netns', 'exec', ns, 'sysctl', '-qw',
                    f'net.ipv4.tcp_congestion_control={self.congestion}')
            # each run's connections start afresh: Linux would otherwise start a connection
            # with the window the last one to that address ended with (the run before's)
            _ip('netns', 'exec', ns, 'sysctl', '-qw', 'net.ipv4.tcp_no_metrics_save=1')
            self._limit([], veth)                          # what host i receives
            self._limit(['ip', 'netns', 'exec', ns], 'eth0')  # what host i sends
            self._hold(i)

    def _hold(self, i):
        # unshare forks the holder as pid 1 of a new pid namespace with its own /proc, in
        # a mount namespace where the host's directory is bound over /dev/shm.
        ready = 'mount --bind "$0" /dev/shm && exec sleep infinity'
        holder = subprocess.Popen(
            ['ip', 'netns', 'exec', self.namespaces[i], 'unshare', '--pid', '--fork',
             '--mount-proc', 'sh', '-c', ready, self._shm_dir(i)],
            stdin=subprocess.DEVNULL, start_new_session=True)
        self.holders.append(holder)
        self.holder_pids.append(_wait_for_sleep(holder))

    def drops(self):
        """Packets the links have dropped so far (queues full: several senders at once into
        one host), summed over both directions of every link."""
        total = 0
        for i, ns in enumerate(self.namespaces):
            for prefix, device in (([], f'{self.tag}v{i}'), (['ip', 'netns', 'exec', ns], 'eth0')):
                shown = subprocess.run([*prefix, 'tc', '-s', '-j', 'qdisc', 'show', 'dev', device],
                                       capture_output=True, text=True, check=True)
                total += sum(q.get('drops', 0) for q in json.loads(shown.stdout))
        return total

    def _limit(self, prefix, device):
        # burst: a few of the 64 KiB segments veth passes with GSO; the queue absorbs
        # several senders at once (incast on a server) as a switch's buffer would.
        subprocess.run([*prefix, 'tc', 'qdisc', 'add', 'dev', device, 'root', 'tbf',
                        'rate', self.rate, 'burst', '256kb', 'latency', f'{self.queue_ms}ms'],
                       check=True, capture_output=True, text=True)

    def __exit__(self, *exc):
        for holder in self.holders:
            try:
                os.killpg(holder.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            holder.wait()
        for i, ns in enumerate(self.namespaces):  # deleting a namespace deletes its veth too
            _ip('netns', 'del', ns, check=False)
            shutil.rmtree(self._shm_dir(i), ignore_errors=True)
        _ip('link', 'del', self.bridge, check=False)
        return False


def _wait_for_sleep(holder, timeout=10.0):
    """The root-namespace pid of ``holder``'s child once it has become ``sleep`` (mounted)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and holder.poll() is None:
        try:
            with open(f'/proc/{holder.pid}/task/{holder.pid}/children') as f:
                children = f.read().split()
            if children:
                with open(f'/proc/{children[0]}/comm') as f:
                    if f.read().strip() == 'sleep':
                        return int(children[0])
        except OSError:
            pass
        time.sleep(0.02)
    raise RuntimeError(f'host namespace holder did not start (exit code {holder.poll()})')
