"""Optimizer-state files: per-server states merged into whole keys and split back."""

import logging

from kvps.optimizer import states


def blob(*values):
    return {'dtype': 'float32', 'shape': [len(values)], 'data': bytes(4 * len(values))}


def server(num_update, items):
    return {'format': 'kvps.updater.states/1', 'num_update': num_update,
            'counts': [[k, p, c] for k, p, c, _ in items],
            'states': [[k, p, {'mom': b}] for k, p, _, b in items]}


def parts_of(key):   # 'split' has a part on each of two servers; 'whole' lives on server 1
    return [(0, 0, 0, 2), (1, 1, 2, 3)] if key == 'split' else [(1, 0, 0, 2)]


def test_whole_keys_from_parts_and_back():
    merged = states.merge([server(3, [('split', 0, 3, blob(0, 0))]),
                           server(3, [('split', 1, 3, blob(0)), ('whole', 0, 2, blob(0, 0))])],
                          parts_of)
    assert [k for k, _, _ in merged['keys']] == ['split', 'whole']
    assert merged['keys'][0][2]['mom']['shape'] == [3]
    back = states.split(merged, 2, parts_of)
    assert back[0]['states'] == [['split', 0, {'mom': blob(0, 0)}]]


def test_a_key_whose_first_update_reached_some_parts_only_is_left_out(caplog):
    # dist_async: servers are read one after the other while another worker pushes; a save
    # must not fail on a key that is being updated for the first time.
    with caplog.at_level(logging.WARNING, logger='kvps'):
        merged = states.merge([server(1, [('split', 0, 1, blob(0, 0))]),
                               server(2, [('whole', 0, 2, blob(0, 0))])], parts_of)
    assert [k for k, _, _ in merged['keys']] == ['whole'] and merged['num_update'] == 2
    assert "key 'split' left out" in caplog.text
