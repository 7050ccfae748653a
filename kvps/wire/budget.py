"""How many items one multi-key message may list: senders cut longer lists of keys into runs."""

from .protocol import MAX_HEADER_BYTES

# The items of one multi-key message pack to at most this many bytes (its sender cuts a longer
# list of keys into several messages): the header, and a DATA answer to a PULL, stay far
# below MAX_HEADER_BYTES, and the keys below MAX_KEYS_PER_MESSAGE.
ITEMS_BUDGET = MAX_HEADER_BYTES // 2
INT_ITEM_BYTES = 64   # an item with an int key: its list, 5 fields and key, 1 + 6 * 9 bytes


def item_bytes(key):
    """At most how many bytes an item of a multi-key message (PUSH, PULL, RESUME) about
    ``key`` packs to (an int packs to at most 9 bytes; a str to 5 + its UTF-8 bytes); an
    INIT or CHECK item also lists a shape (shape_bytes); a DATA answer's items are smaller."""
    if type(key) is not str:
        return INT_ITEM_BYTES
    return INT_ITEM_BYTES + 5 + (len(key) if key.isascii() else 4 * len(key))


def shape_bytes(shape):
    """At most how many bytes ``shape`` adds to an INIT or CHECK item."""
    return 5 + 9 * len(shape)


def within_budget(items):
    """``items`` (of kvps.wire.items, with a key) cut into runs that one message each may
    carry (ITEMS_BUDGET); no items: one empty run."""
    runs, run, used = [], [], 0
    for item in items:
        size = item_bytes(item.key)
        if run and used + size > ITEMS_BUDGET:
            runs.append(run)
            run, used = [], 0
        run.append(item)
        used += size
    runs.append(run)
    return runs
