"""A job's timeline: spans every node records (KVPS_TIMELINE), joined into one Chrome trace, summarised and plotted.

Turn it on with ``python -m kvps.launch --timeline trace.json ...`` (or KVPS_TIMELINE on
every node of a job started by hand, then ``python -m kvps.timeline merge``). Mark the
phases of your own step so they show beside kvps's spans::

    with kvps.timeline.phase('forward'):
        loss = loss_fn(model(x), y)

``pause()`` and ``resume()`` (or SIGUSR2 to a node) keep a long job's trace to the window
that matters.
"""

import contextlib

from . import recording

__all__ = ['phase', 'enabled', 'pause', 'resume']

_OFF = contextlib.nullcontext()


def pause():
    """Stop recording in this process until ``resume()``: the timeline's sites cost what they
    cost when it is off. Other processes go on recording (``kill -USR2 PID`` toggles one)."""
    recording.pause()


def resume():
    """Record again in this process after ``pause()``."""
    recording.resume()


def enabled():
    """Whether this process records a timeline."""
    return recording.RECORDER is not None


def phase(name):
    """A ``with`` block recorded as a span named ``name`` (kind 'phase'); nothing when the
    timeline is off."""
    recorder = recording.RECORDER
    return _OFF if recorder is None else recorder.timed(str(name), 'phase')
