"""Messages sent in pieces (RESUME, STATES, SET_STATES, PUT_BLOB): a payload cut to fit, the
pieces' headers numbered, and the payload joined again."""

# Optimizer states travel in pieces of at most this many bytes (or KVPS_MAX_MESSAGE_BYTES):
# a server's state may outgrow what one message may carry.
STATE_CHUNK_BYTES = 64 << 20


def state_pieces(blob, max_message_bytes=None):
    """``blob`` (a packed state) cut into the pieces STATES and SET_STATES carry (views)."""
    size = min(STATE_CHUNK_BYTES, max_message_bytes or STATE_CHUNK_BYTES)
    view = memoryview(blob)
    return [view[at:at + size] for at in range(0, len(view), size)] or [view]


def continued(header, count):
    """The headers of a message sent in ``count`` pieces (RESUME, STATES, SET_STATES): each
    a copy of ``header`` numbered ``piece`` from 0, all but the last marked ``more``. (A
    request resent to a restarted server is answered from piece 0 again, and a restarted
    server meets the pieces of a SET_STATES from the one its predecessor did not answer.)"""
    return [{**header, 'piece': i, 'more': True} for i in range(count - 1)] + [
        {**header, 'piece': count - 1}]


def joined(pieces):
    """The payload a message sent in pieces carried (the only piece itself, uncopied)."""
    return pieces[0] if len(pieces) == 1 else b''.join(pieces)
