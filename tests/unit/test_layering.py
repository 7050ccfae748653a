"""DESIGN.md's import rules (as ranks of folders) and the public API, pinned by walking the AST."""

import ast
import importlib
from pathlib import Path

import kvps

PKG = Path(kvps.__file__).parent
ROLES = {'scheduler', 'server', 'worker'}
# Each top-level module or package of kvps and its rank: a module imports only its own unit
# and units of a lower rank. Values and the wire at the bottom, the roles above them, the
# store and the Trainer on top; the launcher beside the top, imported by nothing.
RANKS = {
    'errors': 0, 'env_parsers': 0, 'rank_sources': 0,  # pure: text in, values out
    'config': 1, 'atomic': 1, 'allocator': 1, 'pinning': 1, 'elastic': 1,
    'timeline': 2, 'optimizer': 2,                   # recording spans; optimizers and kernels
    'wire': 3,                                       # the wire format, sockets, shared memory
    'arrays': 4,                                     # values, one on the other
    'rows': 5, 'compression': 5, 'devices': 5,
    'scheduler': 6, 'server': 6, 'worker': 6,        # the roles, which never import each other
    'node': 7,                                       # runs a scheduler or server role
    'kvstore': 8,
    'trainer': 9, 'launch': 9,
    '__init__': 10,
}


def unit_of(path):
    """The top-level unit a kvps source file belongs to ('server', 'arrays', '__init__')."""
    first = path.relative_to(PKG).parts[0]
    return first[:-3] if first.endswith('.py') else first


def imports_of(path):
    """Absolute module names imported by a kvps source file (relative imports resolved)."""
    parts = path.relative_to(PKG.parent).with_suffix('').parts
    package = parts[:-1]
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


def units_imported(path):
    """The kvps units a source file imports (its own excluded)."""
    own = unit_of(path)
    units = {m.split('.')[1] for m in imports_of(path)
             if m.startswith('kvps.') and m.split('.')[1] in RANKS}
    return units - {own}


def sources():
    return list(PKG.rglob('*.py'))


def test_every_unit_has_a_rank():
    assert {unit_of(p) for p in sources()} == set(RANKS)


def test_imports_only_go_down():
    for path in sources():
        own = unit_of(path)
        upward = {u for u in units_imported(path) if RANKS[u] >= RANKS[own]}
        assert not upward, f'{path.relative_to(PKG)} ({own}) imports {sorted(upward)}'


def test_role_packages_never_import_each_other_and_nothing_imports_launch():
    for path in sources():
        units = units_imported(path)
        assert 'launch' not in units, f'{path} imports launch'
        if unit_of(path) in ROLES:
            assert not units & ROLES, f'{path} imports another role'


def test_only_the_stores_and_the_trainer_see_gpu_values():
    """devices (GPU values: sums on the device, pinned transfers) is for the store and the
    Trainer; the roles below them handle host buffers (a server's GPU shards use the kernels'
    cupy arrays, not devices)."""
    for path in sources():
        if 'devices' in units_imported(path):
            assert unit_of(path) in ('kvstore', 'trainer'), path


def test_only_transport_imports_zmq():
    for path in sources():
        if any(n.split('.')[0] == 'zmq' for n in imports_of(path)):
            assert path.relative_to(PKG).as_posix() == 'wire/transport.py', \
                f'{path} imports zmq'


def test_only_config_and_the_launcher_read_the_environment():
    for path in sources():
        if path.name == 'config.py' or unit_of(path) == 'launch':
            continue
        text = path.read_text()
        assert 'os.environ' not in text and 'getenv' not in text, f'{path} reads os.environ'


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


def test_shm_is_used_by_the_roles_and_the_launcher_only():
    """wire.shm (segments, the ring, offset checks) knows nothing of sockets, roles or
    config (only of errors, and of pinning, whose regions its mappings are): the worker's
    staging and the server's regions build on it, as do its device twins in the wire (the
    host stand-in of CUDA IPC, the device segment's ring), and the launcher (or its sweeper,
    once it is killed) removes what a killed worker left."""
    mods = [m for m in imports_of(PKG / 'wire' / 'shm.py') if m.startswith('kvps.')]
    assert all(m.startswith(('kvps.errors', 'kvps.pinning')) for m in mods), mods
    twins = {'shm.py', 'device_sharing.py', 'device_segments.py'}
    for path in sources():
        if unit_of(path) not in ROLES | {'launch'} and path.name not in twins:
            assert not any(m.startswith('kvps.wire.shm') for m in imports_of(path)), path


def test_no_module_over_about_400_lines():
    long = {str(p.relative_to(PKG)): n for p in sources()
            if (n := len(p.read_text().splitlines())) > 420}
    assert not long, long


def test_every_module_opens_with_a_docstring():
    for path in sources():
        tree = ast.parse(path.read_text())
        assert ast.get_docstring(tree), f'{path} has no module docstring'


# -- the public API -----------------------------------------------------------------------
ERRORS = {'KVPSError', 'ConfigError', 'ProtocolError', 'TransportError', 'RequestTimeout',
          'PeerLostError', 'RemoteError', 'AuthError', 'KeyNotInitializedError',
          'DuplicateInitError', 'ShapeError', 'DTypeError', 'KeyTypeError',
          'ParameterMismatchError', 'StaleGradientError', 'StoreClosedError'}
PUBLIC = {
    'kvps': {'create', 'KVStore', 'Trainer', 'RowSparse', 'kvstore', 'optimizer', 'timeline',
             '__version__'} | ERRORS,
    'kvps.kvstore': {'create', 'KVStore', 'KVStoreBase', 'KNOWN_TYPES', 'parse_type',
                     'check_compression_type'},
    'kvps.optimizer': {'Optimizer', 'SGD', 'NAG', 'Adam', 'AdamW', 'AdaGrad', 'RMSProp', 'LAMB',
                       'Ftrl', 'Signum', 'Test', 'AdaDelta', 'Adamax', 'Nadam', 'FTML', 'LARS',
                       'LBSGD', 'SGLD', 'DCASGD', 'ccSGD', 'GroupAdaGrad', 'AdaBelief', 'LANS',
                       'create', 'register', 'registered',
                       'LRScheduler', 'FactorScheduler', 'MultiFactorScheduler',
                       'CosineScheduler', 'PolyScheduler', 'create_scheduler'},
    'kvps.trainer': {'Trainer'},
    'kvps.launch': {'main'},
    'kvps.timeline': {'phase', 'enabled', 'pause', 'resume'},
    # the codecs' package: set_gradient_compression's parameters, the codecs, the servers'
    # decoding and the 16-bit pulls
    'kvps.compression': {'parse', 'Settings', 'OFF', 'TYPES', 'CODECS', 'decode', 'nbytes',
                         'check_compressible', 'DECODABLE', 'ErrorFeedback', 'TwoBit',
                         'Float16', 'BFloat16', 'OneBit', 'TopK', 'sent_threshold',
                         'pulled_dtype', 'round_pulled', 'land_pulled'},
}


def test_public_api_is_pinned():
    for name, expected in PUBLIC.items():
        module = importlib.import_module(name)
        assert set(module.__all__) == expected, name
        for attr in module.__all__:
            assert hasattr(module, attr), f'{name}.{attr}'


def test_entry_points_do_not_move():
    import kvps.launch
    assert kvps.kvstore.create is kvps.create
    assert kvps.optimizer.create('sgd').name == 'sgd'
    assert kvps.Trainer is kvps.trainer.Trainer
    assert callable(kvps.launch.main)
    assert (PKG / 'launch' / '__main__.py').exists() and (PKG / 'node.py').exists()
    assert issubclass(kvps.PeerLostError, kvps.KVPSError)


def test_no_two_test_files_share_a_name():
    """pytest imports test files by their name (no __init__.py): a unit and a cluster test of
    one name stop the whole run at collection."""
    names = [p.name for p in Path(__file__).resolve().parents[1].glob('*/test_*.py')]
    assert not {n for n in names if names.count(n) > 1}
