"""DESIGN.md's import rules and the public API, pinned by walking the AST."""

import ast
from pathlib import Path

import kvps

PKG = Path(kvps.__file__).parent
ROLES = {'scheduler', 'server', 'worker'}


def imports_of(path):
    """Absolute module names imported by a kvps source file (relative imports resolved)."""
    parts = path.relative_to(PKG.parent).with_suffix('').parts
    package = parts[:-1] if parts[-1] != '__init__' else parts[:-1]
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - node.level + 1]
                mod = '.'.join(base + ((node.module,) if node.module else ()))
                names.append(mod)
                names += [f'{mod}.{a.name}' for a in node.names]
            else:
                names.append(node.module)
    return names


def sources():
    return [p for p in PKG.rglob('*.py')]


def test_only_transport_imports_zmq():
    for path in sources():
        if any(n.split('.')[0] == 'zmq' for n in imports_of(path)):
            assert path.name == 'transport.py', f'{path} imports zmq'


def test_only_config_reads_the_environment():
    for path in sources():
        if path.name in ('config.py', 'launch.py') or path.name.startswith('_launch'):
            continue
        text = path.read_text()
        assert 'os.environ' not in text and 'getenv' not in text, f'{path} reads os.environ'


def test_role_packages_never_import_each_other_and_nothing_imports_launch():
    for path in sources():
        rel = path.relative_to(PKG).parts
        mods = imports_of(path)
        assert not any(m.startswith('kvps.launch') for m in mods), f'{path} imports launch'
        if rel[0] in ROLES:
            others = ROLES - {rel[0]}
            assert not any(m.split('.')[1:2] and m.split('.')[1] in others for m in mods
                           if m.startswith('kvps.')), f'{path} imports another role'


def test_torch_and_cupy_are_lazy():
    """Module-level imports of torch/cupy would make kvps unusable without them."""
    for path in sources():
        tree = ast.parse(path.read_text())
        for node in tree.body:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else [
                    node.module or '']
                assert not any(n.split('.')[0] in ('torch', 'cupy') for n in names), \
                    f'{path} imports torch/cupy at module level'


def test_public_api():
    assert {'create', 'KVStore', 'KVPSError', 'PeerLostError', 'RemoteError',
            'RequestTimeout', '__version__'} <= set(kvps.__all__)
    for name in kvps.__all__:
        assert hasattr(kvps, name), name
    assert kvps.kvstore.create is kvps.create


def test_devices_sits_between_arrays_and_the_stores():
    """devices (GPU values) builds on arrays and _kernels; only the stores and the Trainer use
    it, so no layer below them learns about GPUs."""
    below = ('kvps.errors', 'kvps.protocol', 'kvps.arrays', 'kvps._kernels')
    mods = [m for m in imports_of(PKG / 'devices.py') if m.startswith('kvps.')]
    assert all(m.startswith(below) for m in mods), mods
    lower = {'errors', 'config', 'protocol', 'arrays', 'optimizer', 'transport', 'shm'}
    for path in sources():
        rel = path.relative_to(PKG).parts
        if rel[0] in ROLES | {'_kernels'} or path.stem in lower:
            assert not any(m.startswith('kvps.devices') for m in imports_of(path)), path


def test_shm_sits_beside_protocol_below_the_roles():
    """shm (segments, the ring, offset checks) knows nothing of sockets, roles or config: the
    worker's staging and the server's regions build on it, and the launcher (or its sweeper,
    once it is killed) removes what a killed worker left."""
    mods = [m for m in imports_of(PKG / 'shm.py') if m.startswith('kvps.')]
    assert all(m.startswith('kvps.errors') for m in mods), mods
    for path in sources():
        rel = path.relative_to(PKG).parts
        if rel[0] not in ROLES and path.stem not in ('shm', '_launch_supervise', '_launch_sweeper'):
            assert not any(m.startswith('kvps.shm') for m in imports_of(path)), path
