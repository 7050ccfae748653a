"""Key placement: big arrays split over every server, small keys balanced by bytes."""

import pytest

from kvps.worker.sharding import Sharding


def test_big_array_is_split_across_all_servers_and_covers_every_element():
    placement = Sharding(num_servers=3, bigarray_bound=10)
    parts = placement.place('big', 100, 4)
    assert sorted(p.server for p in parts) == [0, 1, 2]
    assert [p.part for p in parts] == [0, 1, 2]
    assert parts[0].start == 0 and parts[-1].stop == 100
    assert all(a.stop == b.start for a, b in zip(parts, parts[1:]))
    assert max(p.stop - p.start for p in parts) - min(p.stop - p.start for p in parts) <= 1


def test_a_key_of_bound_elements_is_split_as_in_mxnet_and_one_server_never_splits():
    assert len(Sharding(2, 10).place('k', 9, 4)) == 1
    assert len(Sharding(2, 10).place('k', 10, 4)) == 2   # MXNet: size < bound stays whole
    assert len(Sharding(1, 10).place('k', 1000, 4)) == 1


def test_small_keys_balance_bytes_not_counts():
    placement = Sharding(num_servers=2, bigarray_bound=10**6)
    placement.place('a', 1000, 4)             # server 0: 4000 bytes
    servers = [placement.place(k, 10, 4)[0].server for k in 'bcdefgh']
    assert set(servers) == {1}                # all the small ones go to the lighter server
    assert placement.load == [4000, 280]


def test_a_balanced_model_of_few_big_tensors_loads_no_server_above_one_and_a_half_shares():
    # the 'wide' MLP: 784x1024, two 1024x1024, 1024x10 and its biases, on four servers
    sizes = [802816, 1048576, 1048576, 10240, 3082]
    total = sum(sizes)
    mxnet = Sharding(4, 10**6)   # the 784x1024 tensor stays whole: one server gets 1.8x a share
    for key, n in enumerate(sizes):
        mxnet.place(key, n, 4)
    assert max(mxnet.load) > 1.8 * sum(mxnet.load) / 4
    balanced = Sharding(4, 10**6)
    balanced.balance(total)
    assert balanced.bound == total // 8
    for key, n in enumerate(sizes):
        balanced.place(key, n, 4)
    assert [len(balanced.parts(k)) for k in range(5)] == [4, 4, 4, 1, 1]
    assert max(balanced.load) <= 1.5 * sum(balanced.load) / 4


def test_balancing_never_raises_the_bound_nor_splits_small_models_or_one_server():
    placement = Sharding(2, 1000)
    placement.balance(10**9)
    assert placement.bound == 1000                     # the configured bound stays the cap
    placement = Sharding(2, 10**6)
    placement.balance(100_000)
    assert placement.bound == 1 << 16                  # tiny keys are never split
    placement = Sharding(1, 10**6)
    placement.balance(10**8)
    assert placement.bound == 10**6                    # one server: nothing to balance


def test_placement_is_deterministic_and_remembered():
    def run():
        p = Sharding(3, 50)
        return [p.place(k, n, 4) for k, n in [(0, 10), (1, 100), (2, 7), (3, 60)]]
    assert run() == run()
    p = Sharding(2, 50)
    first = p.place('x', 10, 4)
    assert p.place('x', 10, 4) == first == p.parts('x')


def test_small_parts_share_a_message_per_server_and_shared_memory_parts_all_share_one():
    import numpy as np
    from kvps.worker.messages import FUSE_BYTES, fuse
    from kvps.worker.sharding import Part
    big = np.zeros(FUSE_BYTES // 2, np.uint8)          # two of these fill a socket message
    parts = [(k, Part(k % 2, 0, 0, big.size), big, 'uint8') for k in range(8)]
    on_socket = fuse(parts)
    assert [(server, len(batch)) for server, batch in on_socket] == [(0, 2), (1, 2)] * 2
    in_shm = fuse(parts, lambda item: 0 if item[1].server == 0 else item[2].nbytes)
    assert [(server, [i[0] for i in batch]) for server, batch in in_shm] == [
        (0, [0, 2, 4, 6]), (1, [1, 3]), (1, [5, 7])]


def test_small_parts_share_messages_only_up_to_a_lowered_message_limit():
    """KVPS_MAX_MESSAGE_BYTES below FUSE_BYTES bounds the fused messages: they must stay
    readable by a server taking no more."""
    import numpy as np
    from kvps.config import Config
    from kvps.worker.messages import FUSE_BYTES, fuse, fuse_bytes
    from kvps.worker.sharding import Part
    assert fuse_bytes(Config()) == FUSE_BYTES
    most = fuse_bytes(Config(max_message_bytes=10000))
    assert most == 10000
    small = np.zeros(4000, np.uint8)
    parts = [(k, Part(0, 0, 0, small.size), small, 'uint8') for k in range(5)]
    assert [len(batch) for _, batch in fuse(parts, most_bytes=most)] == [2, 2, 1]



@pytest.mark.parametrize('key_of', [lambda k: 2 ** 64 - 1 - k,          # 9 bytes packed
                                    lambda k: f'{k:04}' + 'x' * 1020,   # 1024 chars
                                    lambda k: f'{k:04}' + '😀' * 1020])  # 4 UTF-8 bytes each
def test_a_message_lists_no_more_keys_than_a_header_may_carry(key_of):
    """Many keys of one server (a model of thousands of tensors, long names) are cut into
    several messages: a header over P.MAX_HEADER_BYTES is refused by its receiver, and so
    would the DATA answer of a pull be; so are an init's and a check's, which list shapes.
    Every field here packs to its widest."""
    import numpy as np
    from kvps.wire import budget, protocol as P
    from kvps.wire.items import ResumeItem
    from kvps.worker.messages import fuse
    from kvps.worker.sharding import Part
    widest = 2 ** 64 - 1
    count = 3000 if isinstance(key_of(0), str) else 30000
    value = np.zeros(1, np.uint8)
    parts = [(key_of(k), Part(0, 0, 0, 1), value, 'bfloat16') for k in range(count)]
    batches = fuse(parts, lambda item: 0)   # all in shared memory: no payload bytes fuse them
    assert len(batches) > 1
    assert [item[0] for _, batch in batches for item in batch] == [p[0] for p in parts]
    for _, batch in batches:
        items = [[key, widest, 'bfloat16', widest, widest, widest] for key, *_ in batch]
        header, _ = P.decode(P.encode({'op': P.PUSH, 'id': widest, 'keys': items, 'sync': True,
                                       'step': widest}))
        assert len(header['keys']) == len(batch) <= P.MAX_KEYS_PER_MESSAGE
        answer = {'op': P.DATA, 'id': widest, 'keys': [[widest, widest]] * len(batch),
                  'lease': widest}
        assert len(P.encode(answer)[0]) <= P.MAX_HEADER_BYTES
    # INIT and CHECK items also list the key's shape: here of P.MAX_DIMS dims at their widest
    shape = [widest] * P.MAX_DIMS
    shaped = fuse([(*p, shape) for p in parts], lambda item: 0, shaped=True)
    assert len(shaped) > len(batches)
    for _, batch in shaped:
        for op, item in ((P.INIT, ['bfloat16', widest, shape]), (P.CHECK, ['bfloat16', shape])):
            items = [[key, widest, *item] for key, *_ in batch]
            header = {'op': op, 'id': widest, 'keys': items, 'sync': True, 'device': True}
            frames = P.encode(header, [b''] * len(batch) if op == P.INIT else [])
            assert len(frames[0]) <= P.MAX_HEADER_BYTES
    runs = budget.within_budget([ResumeItem(key, widest, widest) for key, *_ in parts])
    assert [len(run) for run in runs] == [len(batch) for _, batch in batches]
    for run in runs:
        P.decode(P.encode({'op': P.RESUME, 'id': 0, 'keys': run, 'more': True}))
    assert budget.within_budget([]) == [[]]   # a worker with no key there still resumes

def test_keys_over_the_partition_size_are_cut_in_whole_rounds_of_the_servers():
    """As BytePS: parts of at most partition_bytes, as many on every server."""
    one = Sharding(1, 10**6, partition_bytes=1000)
    parts = one.place('k', 1001, 4)            # 4004 bytes: 5 parts on the one server
    assert [p.server for p in parts] == [0] * 5 and [p.part for p in parts] == list(range(5))
    assert parts[0].start == 0 and parts[-1].stop == 1001
    assert all(a.stop == b.start for a, b in zip(parts, parts[1:]))
    assert max((p.stop - p.start) * 4 for p in parts) <= 1000
    three = Sharding(3, 10**6, partition_bytes=1000)
    parts = three.place('k', 1001, 4)          # 5 parts rounded up to 6: two per server
    assert sorted(p.server for p in parts) == [0, 0, 1, 1, 2, 2]
    assert three.load == [1332, 1336, 1336]
    assert len(three.place('small', 250, 4)) == 1                  # 1000 bytes: whole
    assert Sharding(2, 10**6).place('k', 10**5, 4)[0].stop == 10**5   # None: never cut


def test_partitions_are_cut_between_rows_and_never_when_keys_stay_whole():
    placement = Sharding(2, 10**6, partition_bytes=4000)
    parts = placement.place('table', 100 * 30, 4, width=30)        # 12000 bytes: 4 parts
    assert len(parts) == 4 and all(p.start % 30 == 0 for p in parts)
    placement.keep_whole = True                # LAMB reads each weight whole
    assert len(placement.place('next', 100 * 30, 4, width=30)) == 1


def test_a_pull_answer_that_does_not_match_the_request_fails_it():
    """A DATA answer lists no keys (it answers the pull's items in order): the worker checks
    that it answers each of them, with a frame of each one's size, before writing any."""
    import numpy as np
    from kvps.wire import protocol as P
    from kvps.wire.items import DataItem
    from kvps.errors import ProtocolError
    from kvps.timeline.counters import WorkerCounts
    from kvps.worker.messages import copier
    from kvps.worker.sharding import Part
    targets = [np.zeros(2, np.float32), np.zeros(3, np.float32)]
    batch = [('a', Part(0, 0, 0, 2), targets[0], 'float32'),
             ('b', Part(0, 0, 0, 3), targets[1], 'float32')]
    on_data = copier(batch, [None, None], None, 'server 0', WorkerCounts())
    frames = [memoryview(np.ones(2, np.float32)).cast('B'),
              memoryview(np.full(3, 2, np.float32)).cast('B')]
    in_frame = DataItem(at=None, lent=None)
    with pytest.raises(ProtocolError, match='a pull of 2 key parts with 1'):
        on_data({'op': P.DATA, 'keys': [in_frame]}, frames[:1])
    with pytest.raises(ProtocolError, match="key .b. part 0 with a frame of another size"):
        on_data({'op': P.DATA, 'keys': [in_frame] * 2}, [frames[0], frames[0]])
    assert [t.tolist() for t in targets] == [[0.0, 0.0], [0.0, 0.0, 0.0]]   # none written
    on_data({'op': P.DATA, 'keys': [in_frame] * 2}, frames)
    assert [t.tolist() for t in targets] == [[1.0, 1.0], [2.0, 2.0, 2.0]]
