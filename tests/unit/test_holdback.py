"""The worker's holdback: socket pushes wait while zmq still queues more than KVPS_SOCKET_QUEUE
bytes of them (all servers' together), and pulls of keys already pushed go ahead of them;
nothing passes what it must follow."""

from kvps.config import Config
from kvps.wire import protocol as P
from kvps.worker.holdback import Holdback, pushed_bytes
from kvps.worker.pending import Request

MiB = 1 << 20


def push(node, *keys):
    return (node, {'op': P.PUSH, 'keys': [(key, 0, 'float32', 1, None, 0) for key in keys]},
            [], f'push {node} {keys}')


def pull(node, *keys):
    return (node, {'op': P.PULL, 'keys': [(key, 0, None) for key in keys]}, [],
            f'pull {node} {keys}')


def init(node):
    return node, {'op': P.INIT, 'keys': []}, [], f'init {node}'


def send(holdback, entry, payload=0):
    """Admit ``entry`` and, when it may go, send it: zmq's call once it has taken it (a no-op
    for a push not tracked), or None when it is held."""
    if not holdback.admit(entry, payload):
        return None
    return holdback.on_taken(entry[0], payload, lambda: None) or (lambda: None)


def ready(holdback):
    out = []
    while (entry := holdback.next_ready()) is not None:
        out.append(entry[3])
    return out


def test_pushes_beyond_the_limit_wait_and_a_pull_of_a_key_that_left_goes_ahead():
    holdback = Holdback(4 * MiB)
    first = send(holdback, push('s0', 'a'), 3 * MiB)
    assert first is not None
    assert send(holdback, push('s0', 'b'), 3 * MiB) is None       # 6 MiB would be queued
    assert send(holdback, pull('s0', 'a'), 0) is not None          # a's push has left
    assert send(holdback, pull('s0', 'b'), 0) is None              # b's has not
    assert send(holdback, pull('s0', 'a', 'b'), 0) is None         # nor has one of its keys
    assert holdback and len(holdback) == 3
    assert ready(holdback) == []
    first()                                                        # zmq took a's push
    assert ready(holdback) == ["push s0 ('b',)", "pull s0 ('b',)", "pull s0 ('a', 'b')"]
    assert not holdback


def test_other_servers_are_not_held_and_other_messages_follow_everything_held():
    holdback = Holdback(4 * MiB)
    first = send(holdback, push('s0', 'a'), 4 * MiB)
    assert send(holdback, push('s0', 'b'), 1) is None
    assert send(holdback, push('s1', 'b'), 4 * MiB) is not None   # another socket
    assert send(holdback, init('s0')) is None                     # passes nothing
    assert send(holdback, pull('s0', 'c'), 0) is None             # nor does a pull pass it
    first()
    assert ready(holdback) == ["push s0 ('b',)", 'init s0', "pull s0 ('c',)"]


def test_the_limit_is_the_workers_over_every_server_and_one_push_per_server_goes():
    holdback = Holdback(4 * MiB)
    to_s0 = send(holdback, push('s0', 'a'), 3 * MiB)
    assert send(holdback, push('s1', 'b'), 2 * MiB) is not None   # s1 queues nothing yet
    assert send(holdback, push('s1', 'c'), 1 * MiB) is None       # 6 MiB queued in all
    assert send(holdback, push('s2', 'd'), 8 * MiB) is not None   # s2 queues nothing yet
    to_s0()
    assert ready(holdback) == []                                  # still 10 MiB
    holdback = Holdback(4 * MiB)
    to_s0 = send(holdback, push('s0', 'a'), 3 * MiB)
    send(holdback, push('s1', 'b'), 1 * MiB)
    assert send(holdback, push('s1', 'c'), 1 * MiB) is None
    to_s0()                                                       # s0's 3 MiB left
    assert ready(holdback) == ["push s1 ('c',)"]


def test_pushes_keep_their_order_and_one_bigger_than_the_limit_goes_alone():
    holdback = Holdback(4 * MiB)
    first = send(holdback, push('s0', 'a'), 1 * MiB)
    assert send(holdback, push('s0', 'big'), 16 * MiB) is None
    assert send(holdback, push('s0', 'small'), 1 * MiB) is None   # would fit: stays behind
    assert ready(holdback) == []
    first()
    assert holdback.next_ready()[3] == "push s0 ('big',)"          # alone, bigger than the limit
    holdback.on_taken('s0', 16 * MiB, lambda: None)
    assert ready(holdback) == []


def test_small_pushes_share_a_tracked_one_and_untracked_ones_hold_nothing_back():
    holdback = Holdback(4 * MiB)
    assert holdback.on_taken('s0', MiB // 2, lambda: None) is None   # under 1 MiB: untracked
    assert send(holdback, push('s0', 'b'), 8 * MiB) is not None       # nothing counts as queued
    holdback = Holdback(MiB)
    send(holdback, push('s0', 'a'), MiB // 2)
    second = send(holdback, push('s0', 'b'), MiB // 2)                # tracked: stands for both
    assert send(holdback, push('s0', 'c'), MiB // 2) is None
    second()
    assert ready(holdback) == ["push s0 ('c',)"]


def test_a_tracked_push_wakes_the_io_thread_once_taken():
    woke = []
    holdback = Holdback(4 * MiB)
    holdback.on_taken('s0', 2 * MiB, lambda: woke.append(1))()
    assert woke == [1]


def test_no_limit_tracks_and_holds_nothing_and_shared_memory_pushes_are_never_held():
    unlimited = Holdback(0)
    assert unlimited.on_taken('s0', 64 * MiB, lambda: None) is None
    holdback = Holdback(4 * MiB)
    send(holdback, push('s0', 'a'), 4 * MiB)
    assert send(holdback, push('s0', 'b'), 0) is not None           # in shared memory


def test_release_gives_back_what_was_held_in_order_and_forgets_the_queue():
    holdback = Holdback(4 * MiB)
    send(holdback, push('s0', 'a'), 4 * MiB)
    send(holdback, push('s0', 'b'), 4 * MiB)
    send(holdback, pull('s0', 'b'), 0)
    assert [entry[3] for entry in holdback.release('s0')] == ["push s0 ('b',)",
                                                               "pull s0 ('b',)"]
    assert send(holdback, push('s0', 'c'), 4 * MiB) is not None   # a new socket: nothing queued
    assert send(holdback, push('s1', 'd'), 4 * MiB) is not None
    assert send(holdback, push('s1', 'e'), 4 * MiB) is None
    assert holdback.next_ready() is None
    assert holdback.next_ready(everything=True)[3] == "push s1 ('e',)"   # the thread ends
    assert holdback.release_all() == []


def test_pushed_bytes_counts_the_frames_of_pushes_only_not_of_a_pushpulls():
    plain, paced = Request(None, 's0', pusher=1), Request(None, 's0')   # (a pushpull's: none)
    assert pushed_bytes({'op': P.PUSH}, [b'x' * 10, memoryview(b'y' * 5)], plain) == 15
    assert pushed_bytes({'op': P.PUSH}, [], plain) == 0
    assert pushed_bytes({'op': P.INIT}, [b'x' * 10], plain) == 0
    assert pushed_bytes({'op': P.PUSH}, [b'x' * 10], paced) == 0


def test_the_setting():
    assert Config.from_env({}).socket_queue == 4 * MiB
    assert Config.from_env({'KVPS_SOCKET_QUEUE': '0'}).socket_queue == 0
