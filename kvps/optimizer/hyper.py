"""Hyper-parameter checking shared by optimizers and lr schedulers: types, aliases, defaults."""

import math
import numbers

import numpy as np

from ..errors import ConfigError

# Parameters MXNet accepts that mean nothing here (fusion and aggregation are always on):
# accepted for script compatibility and dropped from the spec.
IGNORED = frozenset({'use_fused_step', 'aggregate_num'})


def coerce(kind, name, value, owner):
    """Check one parameter against its kind; returns the canonical value or raises ConfigError."""
    if value is None and kind.endswith('?'):
        return None
    base = kind.rstrip('?')
    ok = not isinstance(value, bool) or base == 'bool'
    if base == 'float' and ok and isinstance(value, numbers.Real):
        if not math.isfinite(value):   # it would turn every weight it touches into NaN
            raise ConfigError(f'{owner}: {name!r} must be a finite number, got {value!r}')
        return float(value)
    if base == 'int' and ok and isinstance(value, numbers.Integral):
        return int(value)
    if base == 'bool' and isinstance(value, (bool, np.bool_)):
        return bool(value)
    if base == 'str' and isinstance(value, str):
        return value
    if base == 'ints' and isinstance(value, (list, tuple)) and all(
            isinstance(v, numbers.Integral) and not isinstance(v, bool) for v in value):
        return [int(v) for v in value]
    want = {'float': 'a number', 'int': 'an integer', 'bool': 'a bool', 'str': 'a string',
            'ints': 'a list of integers'}[base]
    none = ' or None' if kind.endswith('?') else ''
    raise ConfigError(f'{owner}: {name!r} must be {want}{none}, got {value!r} '
                      f'({type(value).__name__})')


def check_params(owner, table, aliases, given, also=()):
    """Resolve aliases, reject unknown names (listing valid ones, ``also`` those the owner
    takes besides ``table``), coerce types, fill defaults."""
    out = {}
    for name, value in given.items():
        canon = aliases.get(name, name)
        if canon in IGNORED:
            continue
        if canon not in table:
            valid = ', '.join(sorted(set(table) | set(aliases) | set(also)))
            raise ConfigError(f'{owner}: unknown parameter {name!r}; valid names: {valid}')
        if canon in out:
            raise ConfigError(f'{owner}: {canon!r} given twice (through an alias)')
        out[canon] = coerce(table[canon][0], canon, value, owner)
    missing = [n for n, (kind, default) in table.items()
               if n not in out and default is None and not kind.endswith('?')]
    if missing:
        raise ConfigError(f'{owner}: missing required parameter(s) {", ".join(missing)}')
    return {name: out.get(name, default) for name, (_, default) in table.items()}
