"""load_optimizer_states and a resume from KVPS_CHECKPOINT_DIR on two servers: a file that
does not fit the job is refused, naming it, before any server changes."""

import pytest

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(180)]

# Keys 0 and 1 are small: key 0 lives on server 0, key 1 on server 1. Each bad file differs
# from the good one in key 1 only, so a server 0 that loads it alone changes its key 0.
LOAD_SCRIPT = '''
import copy
from kvps.optimizer import states
kv = kvps.create('dist_sync')
kv.init([0, 1], [np.zeros(4, np.float32), np.zeros(4, np.float32)])
kv.set_optimizer(kvps.optimizer.create('sgd', momentum=0.5))
kv.push([0, 1], [np.ones(4, np.float32), np.ones(4, np.float32)])
kv.save_optimizer_states('saved')
good = states.read_file('saved')
entry = {key: whole for key, _, whole in good['keys']}[1]
bad = {'other optimizer': {'mean': entry['mom'], 'var': entry['mom']},
       'other size': {'mom': {**entry['mom'], 'shape': [5], 'data': bytes(20)}},
       'bad data': {'mom': {**entry['mom'], 'data': bytes(3)}},
       'other dtype': {'mom': {**entry['mom'], 'dtype': 'float64', 'data': bytes(32)}}}
seen, refusals = {}, {}
for name, state in bad.items():
    kv.push([0, 1], [np.ones(4, np.float32), np.ones(4, np.float32)])   # state moves on
    merged = copy.deepcopy(good)
    merged['keys'] = [[k, c, state if k == 1 else w] for k, c, w in merged['keys']]
    states.write_file(name, merged)
    before = kv.get_optimizer_states()
    try:
        kv.load_optimizer_states(name)
        seen[name] = 'loaded'
    except kvps.errors.KVPSError as exc:
        seen[name] = [type(exc).__name__, str(exc).startswith(name) and 'key 1' in str(exc),
                      kv.get_optimizer_states() == before]
        refusals[name] = str(exc)
report(seen=seen, dtype_refusal=refusals.get('other dtype'))
'''


def test_a_bad_optimizer_state_file_changes_no_server(job, tmp_path):
    result = job(LOAD_SCRIPT, 1, 2)
    assert result.returncode == 0, result.output
    seen, refusal = result.results()[0]['seen'], result.results()[0]['dtype_refusal']
    assert seen == {name: [seen[name][0], True, True] for name in
                    ('other optimizer', 'other size', 'bad data', 'other dtype')}, seen
    # refused when staged, not at the first update after both servers committed it
    assert refusal == ("other dtype: key 1 part 0: optimizer state 'mom' is float64, but the "
                       'key is float32, whose state is float32 (on server 1)'), refusal
