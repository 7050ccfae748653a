"""``set_gradient_compression``'s parameters: checked at the call, made into a push codec and
a pull type."""

import math
import numbers
from typing import NamedTuple, Optional

from ..wire.codecs import BF16, FP16, ONE_BIT, PULL_CODECS, TOP_K, TWO_BIT
from . import f16
from .half import BFloat16, Float16
from .onebit import OneBit, checked_chunk
from .topk import TopK
from .twobit import TwoBit

# Each type, the parameters it takes (besides 'type' and 'pull') and how its codec is made.
TYPES = {
    TWO_BIT: (('threshold',), lambda p, r: TwoBit(_threshold(p.get('threshold', 0.5)), r)),
    FP16: ((), lambda p, r: Float16(r)),
    BF16: ((), lambda p, r: BFloat16(r)),
    ONE_BIT: (('chunk',), lambda p, r: OneBit(checked_chunk(p.get('chunk', 64)), r)),
    TOP_K: (('ratio',), lambda p, r: TopK(_ratio(p.get('ratio', 0.01)), r)),
}
_WHY_NOT = {   # a parameter an MXNet or BytePS user may bring to a type that has none
    (ONE_BIT, 'threshold'): "kvps's 1bit sends each element as its chunk's mean of the "
                            'elements of its sign (docs/api.md): it has no threshold',
}


class Settings(NamedTuple):
    """What set_gradient_compression turned on."""
    push: Optional[object]    # the codec of pushes (an ErrorFeedback), or None
    pull: Optional[str]       # the type pulls travel in ('fp16', 'bf16'), or None


OFF = Settings(None, None)


def parse(params, residuals=None):
    """The Settings for ``set_gradient_compression`` params (None: off), the push codec
    keeping its residuals in ``residuals`` (a dict) when given. ValueError or TypeError
    naming what is wrong: an unknown type, parameter or pull type, a bad value."""
    if params is None:
        return OFF
    if not isinstance(params, dict):
        raise TypeError(f'compression params must be a dict such as {{"type": "2bit", '
                        f'"threshold": 0.5}}, got {type(params).__name__}')
    kind = str(params.get('type', '')).lower()
    if kind not in ('', 'none') and kind not in TYPES:
        raise ValueError(f'gradient compression type {params.get("type")!r} is not '
                         f'supported; kvps has {", ".join(TYPES)} (or none)')
    # with no type, a script's usual parameters of any type are taken and unused (MXNet's
    # examples pass {'type': args.gc_type, 'threshold': ...} with gc_type 'none')
    known = TYPES[kind][0] if kind in TYPES else sum((p for p, _ in TYPES.values()), ())
    _refuse_unknown(kind or 'none', params, known)
    pull = _pull(params.get('pull'))
    push = TYPES[kind][1](params, residuals) if kind in TYPES else None
    if FP16 in (kind, pull):
        f16.prepare()
    return Settings(push, pull)


def _refuse_unknown(kind, params, known):
    unknown = [name for name in params if name not in ('type', 'pull') + known]
    if not unknown:
        return
    why = next((_WHY_NOT[kind, n] for n in unknown if (kind, n) in _WHY_NOT), None)
    takes = ', '.join(('type', *known, 'pull'))
    raise ValueError(f'unknown parameter(s) {", ".join(map(repr, unknown))} for {kind} '
                     f'gradient compression; it takes {takes}' + (f' ({why})' if why else ''))


def _threshold(value):
    if not _number(value) or not math.isfinite(value) or value <= 0:
        raise ValueError(f'2bit compression needs a finite threshold > 0, got {value!r}')
    return float(value)


def _ratio(value):
    if not _number(value) or not 0 < value <= 1:
        raise ValueError(f'topk compression needs a ratio in (0, 1] (the share of each key '
                         f'part sent per push), got {value!r}')
    return float(value)


def _pull(value):
    name = None if value is None else str(value).lower()
    if name in (None, 'none'):
        return None
    if name not in PULL_CODECS:
        raise ValueError(f'pull compression {value!r} is not supported; pulls may travel as '
                         f'{" or ".join(map(repr, PULL_CODECS))} (or none)')
    return name


def _number(value):
    return not isinstance(value, bool) and isinstance(value, numbers.Real)
