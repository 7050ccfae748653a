"""Atomic file writes: a crash mid-write never leaves a torn or half-written file behind."""

import os
import tempfile


def write_atomically(path, data):
    """Write ``data`` (bytes or str) to a temporary file beside ``path``, fsync, rename over it."""
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=directory, prefix='.kvps-tmp-')
    try:
        with os.fdopen(fd, 'wb') as f:
            f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
