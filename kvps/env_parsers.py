"""Parsers of environment variables' values for kvps.config: each takes the text and returns
the value or raises ValueError saying what it expected."""

import dataclasses
import re

ROLES = ('worker', 'server', 'scheduler')


@dataclasses.dataclass(frozen=True)
class Var:
    """One environment variable: the native name, the ps-lite/MXNet/BytePS aliases, parser, default."""
    field: str
    names: tuple
    parse: object
    default: object
    doc: str


def number(cast, ok, message):
    """A parser of numbers of type ``cast`` for which ``ok(value)`` holds (NaN never does)."""
    def parse(text):
        value = cast(text)
        if not ok(value):
            raise ValueError(message)
        return value
    return parse


# Longest wait in seconds (about 31 years): Python's waits refuse more than
# threading.TIMEOUT_MAX (about 9.2e9 s) with an OverflowError, and a worker's start waits
# for the connect bound plus twice the heartbeat interval. 'inf' would also never end.
MAX_SECONDS = 1e9
# Largest count or size: every one travels in msgpack headers, which hold 64-bit ints.
MAX_INT = 2 ** 63 - 1

positive_float = number(float, lambda v: 0 < v <= MAX_SECONDS,
                          f'must be > 0 and at most {MAX_SECONDS:g} (seconds)')
nonneg_float = number(float, lambda v: 0 <= v <= MAX_SECONDS,
                        f'must be >= 0 and at most {MAX_SECONDS:g} (seconds)')
nonneg_int = number(int, lambda v: 0 <= v <= MAX_INT, 'must be >= 0 and below 2**63')
positive_int = number(int, lambda v: 1 <= v <= MAX_INT, 'must be >= 1 and below 2**63')


def flag(text):
    low = text.strip().lower()
    if low in ('1', 'true', 'yes', 'on'):
        return True
    if low in ('0', 'false', 'no', 'off', ''):
        return False
    raise ValueError('expected 0/1/true/false')


def role(text):
    low = text.strip().lower()
    if low not in ROLES:
        raise ValueError(f'expected one of {", ".join(ROLES)}')
    return low


def device(text):
    low = text.strip().lower()
    if low not in ('auto', 'cpu', 'cuda'):
        raise ValueError('expected auto, cpu or cuda')
    return low


def ipc(text):
    low = text.strip().lower()
    if low not in ('auto', 'off', 'cuda', 'host'):
        raise ValueError('expected auto, off, cuda or host')
    return low


def word_or(word, parse):
    """A parser of ``word`` (any case) or what ``parse`` takes."""
    def parse_either(text):
        low = text.strip().lower()
        return word if low == word else parse(low)
    return parse_either


count_or_auto = word_or('auto', positive_int)
bytes_or_auto = word_or('auto', nonneg_int)
count_or_all = word_or('all', nonneg_int)


def text(text):
    return text.strip()


_MODULE = re.compile(r'[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*')


def modules(text):
    names = tuple(n.strip() for n in text.split(',') if n.strip())
    bad = [n for n in names if not _MODULE.fullmatch(n)]
    if bad:
        raise ValueError(f'{bad[0]!r} is not a Python module name; expected module names '
                         'separated by commas (e.g. mypkg.optimizers,other)')
    return names


def port(text):
    value = int(text)
    if not 0 <= value <= 65535:
        raise ValueError('must be a TCP port, 0 to 65535')
    return value


def port_range(text):
    """``range`` of the ports LO..HI (KVPS_PORT_RANGE)."""
    match = re.fullmatch(r'\s*(\d{1,5})\s*-\s*(\d{1,5})\s*', text, re.ASCII)
    if not match or not 1 <= int(match[1]) <= int(match[2]) <= 65535:
        raise ValueError('expected LO-HI, ports with 1 <= LO <= HI <= 65535 (e.g. 20000-20100)')
    return range(int(match[1]), int(match[2]) + 1)   # both included


def port_range_text(ports):
    """How KVPS_PORT_RANGE writes ``ports``."""
    return f'{ports.start}-{ports.stop - 1}'


_LOG_LEVELS = ('DEBUG', 'INFO', 'WARNING', 'WARN', 'ERROR', 'CRITICAL', 'FATAL', 'NOTSET')


def log_level(text):
    name = text.strip().upper()
    if name not in _LOG_LEVELS:
        raise ValueError(f'expected one of {", ".join(_LOG_LEVELS)}')
    return name
