"""Stand-ins for ssh, srun and mpirun that start their commands on this machine as the real
ones would on a cluster, so the launcher's ssh, slurm and mpi paths run whole in a test.

- ssh: logs its argv, runs the remote command with ``bash -c`` in a session of its own and a
  login's environment (as sshd would), copies stdin, stdout and stderr through pipes; when it
  dies the remote side sees its stdin close and its output pipes break, as over a dropped
  connection; the exit code is the remote command's (255 when a signal killed it, as OpenSSH
  reports). The login environment keeps PYTHONPATH (kvps installed there) and the test's
  KVPS_TEST_TAG (to find what a job leaves behind).
- srun / mpirun: start N copies of their command with the rank variables of Slurm
  (SLURM_PROCID, SLURM_NTASKS, SLURM_NODELIST, ...), Open MPI (OMPI_COMM_WORLD_RANK/SIZE)
  or MPICH (PMI_RANK/PMI_SIZE); relay their output; forward SIGTERM and SIGINT; when one
  fails, stop the others (srun's --kill-on-bad-exit, mpirun's default); exit with the
  highest code.
"""

import sys

SSH = '''#!{python}
import json, os, subprocess, sys, threading
if os.environ.get('FAKE_SSH_LOG'):
    with open(os.environ['FAKE_SSH_LOG'], 'a') as log:
        log.write(json.dumps(sys.argv[1:]) + '\\n')
argv = sys.argv[1:]
while argv and argv[0].startswith('-'):
    if argv.pop(0) in ('-o', '-i', '-p', '-l', '-F'):
        argv.pop(0)
command = ' '.join(argv[1:])
# a login's environment, not this one's (PYTHONPATH: kvps installed there; the test's tag: to
# find what a job leaves behind)
env = {k: v for k, v in os.environ.items()
       if k in ('PATH', 'HOME', 'LANG', 'PYTHONPATH', 'KVPS_TEST_TAG')}
remote = subprocess.Popen(['bash', '-c', command], env=env, stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          start_new_session=True)

def copy(src, dst, close):
    while True:
        data = os.read(src, 65536)
        if not data:
            break
        try:
            os.write(dst, data)
        except OSError:
            break
    if close:
        os.close(dst)

threading.Thread(target=copy, args=(0, remote.stdin.fileno(), True), daemon=True).start()
outs = [threading.Thread(target=copy, args=(s.fileno(), fd, False))
        for s, fd in ((remote.stdout, 1), (remote.stderr, 2))]
for t in outs:
    t.start()
code = remote.wait()
for t in outs:
    t.join()
sys.exit(code if code >= 0 else 255)
'''

BATCH = '''#!{python}
import os, signal, subprocess, sys, threading
FLAVOUR = '{flavour}'
argv = sys.argv[1:]
count = None
while argv and argv[0].startswith('-'):
    opt = argv.pop(0)
    if opt.startswith('--ntasks='):
        count = int(opt.split('=', 1)[1])
    elif opt in ('-n', '--hostfile'):
        value = argv.pop(0)
        count = int(value) if opt == '-n' else count
tasks = []
for rank in range(count):
    env = dict(os.environ)
    if FLAVOUR == 'slurm':
        env.update(SLURM_PROCID=str(rank), SLURM_NTASKS=str(count), SLURM_LOCALID=str(rank),
                   SLURM_NODELIST='node[1-2]', SLURM_STEP_ID='0')
    elif FLAVOUR == 'openmpi':
        env.update(OMPI_COMM_WORLD_RANK=str(rank), OMPI_COMM_WORLD_SIZE=str(count))
    else:
        env.update(PMI_RANK=str(rank), PMI_SIZE=str(count))
    tasks.append(subprocess.Popen(argv, env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, start_new_session=True))
lock = threading.Lock()

def relay(proc):
    for line in proc.stdout:
        with lock:
            sys.stdout.buffer.write(line)
            sys.stdout.buffer.flush()

readers = [threading.Thread(target=relay, args=(t,)) for t in tasks]
for reader in readers:
    reader.start()

def forward(signum, frame):
    for task in tasks:
        if task.poll() is None:
            task.send_signal(signum)

signal.signal(signal.SIGTERM, forward)
signal.signal(signal.SIGINT, forward)
worst, left = 0, set(tasks)
while left:
    pid, status = os.wait()
    done = next((t for t in left if t.pid == pid), None)
    if done is None:
        continue
    left.discard(done)
    done.returncode = os.waitstatus_to_exitcode(status)
    code = done.returncode if done.returncode >= 0 else 128 - done.returncode
    if code and not worst:
        for other in left:
            other.terminate()
    worst = max(worst, code)
for reader in readers:
    reader.join()
sys.exit(worst)
'''


def install(bin_dir, name, text, flavour=''):
    path = bin_dir / name
    path.write_text(text.replace('{python}', sys.executable).replace('{flavour}', flavour))
    path.chmod(0o755)
    return path


def ssh(bin_dir):
    return install(bin_dir, 'ssh', SSH)


def srun(bin_dir):
    return install(bin_dir, 'srun', BATCH, 'slurm')


def mpirun(bin_dir, flavour):
    """An mpirun that gives its ranks Open MPI's variables ('openmpi') or MPICH's ('mpich')."""
    return install(bin_dir, 'mpirun', BATCH, flavour)
