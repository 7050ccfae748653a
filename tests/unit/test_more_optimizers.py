"""The optimizers MXNet has beyond kvps's first ten, run by the Updater over many steps: equal to
MXNet 1.9.1's own results, to float64 references of MXNet's documented rules, and to torch.optim
where torch has the rule (and different where MXNet's rule is)."""

import numpy as np
import pytest
import reference_rules as R
from optimizer_configs import BY_ID, CONFIGS, NOT_IN_MXNET_19, STEPS, draws, problem
from reference_rules import make

from kvps.optimizer import create
from kvps.optimizer.kernels import noise
from kvps.optimizer.updater import Updater

# MXNet 1.9.1's weights after the runs of optimizer_configs (STEPS updates of 16 float32
# elements), printed by mxnet_anchors.py; 'nadam-key<k>': nadam on two keys updated in turn.
MXNET = {
    'adadelta': [
        -0.918089867, -0.0434271768, 0.185971126, -0.662397861, -0.541759133, -0.401350588,
        -0.190130517, 0.089751631, -0.267207712, 0.138245195, -0.131362796, 0.0317470133,
        0.338465124, -0.470380217, -0.0142858922, -1.02944267],
    'adadelta-rho': [
        -0.219336793, -0.722105384, 0.361481488, 0.610955, -0.585355759, -0.342420757,
        2.15370488, 0.128119305, 1.7591598, 0.0040343767, -2.07673049, -0.0198570602,
        0.660860896, 2.0589304, 1.57915616, 1.28854656],
    'adamax': [
        2.78820992, 0.453074992, -0.114387944, 0.737334728, 0.12988539, 0.52804929, -0.523309886,
        0.458642185, 1.33203936, -0.0963356793, 1.1123594, -0.281344712, -1.06750071,
        -0.554164588, 1.57836878, -1.08309007],
    'adamax-betas': [
        -1.90971088, 1.70193875, -0.821626723, -0.106628992, 0.0362948254, -2.10438704,
        -1.00282633, 0.970233142, -0.290407926, -1.83576202, -1.23956454, -0.542126179,
        -0.0527841933, 1.11559057, -0.945042968, -1.2247498],
    'nadam': [
        0.0835335553, -0.271258533, -0.728746057, 0.454962909, -1.59795618, -0.667458475,
        -0.447586507, 1.51004004, 0.404927433, 0.393075824, 0.892757237, -1.55275345,
        -0.261220813, -0.728716314, -0.200821549, 0.254924268],
    'nadam-decay': [
        -0.549713492, -0.896540225, -1.46892595, 0.663470805, -0.215466455, -1.00615489,
        -0.739849389, 0.139539018, -0.825276732, -1.37541187, -0.494660854, -1.85540342,
        -1.81246662, -0.320716739, -0.534785748, 1.33197236],
    'ftml': [
        0.257520616, -2.05564642, -0.762761176, 0.133136302, -0.989634395, 0.127207518,
        0.232560992, 0.374281108, 0.386345148, 0.29234165, -1.74331677, 0.1718169, 0.997715592,
        -0.14446196, -1.88684499, 0.829625487],
    'ftml-betas': [
        -0.0138781257, -0.686153233, 0.245433867, -1.64683986, 1.51743126, 2.62436008,
        -0.123830326, 0.439645797, -0.234450147, -0.394533128, -0.908286572, 0.419685453,
        -2.51961565, 0.62423265, 0.0599627718, 1.11684275],
    'lars': [
        -0.89403075, 0.675392628, 0.21809493, 0.916561365, 0.909432411, -0.348231733,
        0.652703226, 0.3903355, -1.7240895, -0.991010308, -0.190498665, -0.474620432,
        0.868755579, -0.715428531, 0.00630849972, -2.1206286],
    'lars-uncorrected': [
        -0.734490871, -2.63420367, -1.71084952, -0.673641086, 0.297698677, -1.18529105,
        -1.16093886, -0.305264026, 0.639964044, -1.53564084, 0.150923088, 0.926205099,
        0.327578723, 0.892727435, -0.124711186, -0.511828899],
    'lars-bias': [
        -10.4225454, 3.01163435, -1.98050451, 5.48806763, -2.08006048, -1.43075001, 6.9824276,
        -8.21762657, 4.60263205, -9.2466259, 3.92013931, 3.23238254, -0.390581667, 5.77492571,
        -7.51945066, 6.38103819],
    'lbsgd': [
        -0.967821956, 0.923288584, -1.29501593, 0.00230419636, -1.75374091, 1.46419346,
        2.93564487, -1.71620512, 0.505332112, 1.76839578, -1.80402672, 0.891808033, -0.409070253,
        0.377254844, -0.0697369725, -0.806754291],
    'lbsgd-sqrt': [
        0.0578639656, -0.834797263, 0.60687089, -2.09881806, -0.915274858, -1.22718143,
        0.296526939, 0.883621991, -0.775180638, -0.346088856, -1.05652881, 0.109593667,
        -0.253052264, -2.13509011, -1.66882384, 2.83911967],
    'lbsgd-power2': [
        -0.883198977, 0.564454198, -2.86089778, -0.846557438, -1.34726655, -1.41731548,
        1.54304504, 1.14025533, -0.909080863, 1.25953758, -0.27104494, 1.48770607, 0.20895043,
        3.57606697, -0.448881418, 1.85246909],
    'lbsgd-lars': [
        -1.09146762, -0.798327923, -1.05086899, -1.32683933, -0.293498963, -0.246221766,
        0.466561019, 0.70561558, 1.72238648, 0.693811476, -0.35608691, 0.609441817, -0.25498718,
        -0.00996289309, 0.422052681, -0.284115344],
    'sgld': [
        0.225577548, 1.97463882, 0.923605084, -0.560565472, -0.343874753, 0.770415962,
        -0.662861168, 1.2416271, -0.446118087, -0.707064748, -0.0653726161, -0.688442886,
        -2.08892131, -0.302485794, 0.448018789, 0.558069706],
    'dcasgd': [
        -1.49031484, -0.297746807, -1.20885575, -0.374420255, 0.784359455, 0.70599705,
        -0.998711288, 0.000567946816, 1.22991002, -1.94412315, 0.500442743, -0.0446526408,
        1.45316088, -2.30166721, 0.477214724, -1.40504813],
    'ccsgd': [
        6.4697957, 3.17506719, -2.14739394, -0.864823341, 0.0648317039, -5.01028061, 3.96346426,
        -3.32861066, -1.77445793, -5.02716017, 2.32485199, -2.47042465, -2.23036623, 0.166470498,
        0.218447849, -0.216821536],
    'nadam-key0': [
        -1.27237797, -1.38012266, -0.424141049, 0.348803431, -0.748362005, 0.0377060287,
        -1.28190875, -0.683762193, -0.597790003, 0.0586553663, 1.48747766, -0.676182806,
        0.0604609735, -1.72607505, 0.704793096, 0.733666956],
    'nadam-key1': [
        -0.789471865, 0.0881112218, -0.467406243, -1.01288676, -0.675168514, -0.227123424,
        1.72024107, -1.08992088, 0.241582483, 0.260360509, 1.33428407, -0.286243439, -2.19391274,
        0.445965856, 0.625983536, -1.36918652],
}
# runs whose every operation kvps does as MXNet does, in MXNet's order: equal to the bit (the
# others differ in the order of a few operations, or take norms in another order)
EXACT = {'adadelta', 'adadelta-rho', 'adamax', 'adamax-betas', 'nadam', 'nadam-decay',
         'lars-bias', 'lbsgd-sqrt', 'lbsgd-power2', 'sgld', 'dcasgd'}


def train(config_id, n, dtype=np.float32, **more):
    """kvps's weight after the run of ``config_id`` through an Updater, in ``dtype``."""
    updater = Updater(make(config_id, **more))
    w0, grads = problem(config_id, n)
    weight = w0.astype(dtype)
    for grad in grads:
        updater.update(BY_ID[config_id][4], weight, grad.astype(dtype))
    return weight


def reference(config_id, n):
    _, name, params, _, key = BY_ID[config_id]
    w0, grads = problem(config_id, n)
    return R.reference_run(name, params, w0, grads, make(config_id).base_lr, key)


def relative(got, want):
    """The relative difference of two weights, ||got - want|| / ||want||."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return np.linalg.norm(got - want) / np.linalg.norm(want)


@pytest.fixture
def stand_in_noise(monkeypatch):
    """SGLD's draws replaced by optimizer_configs.draws, in order, as mxnet_anchors.py does
    in MXNet (whose generator kvps cannot reproduce); call again to start over."""
    def start(n):
        pending = list(draws(n))
        monkeypatch.setattr(noise, 'gaussian', lambda hi, lo, start, size: pending.pop(0))
    return start


@pytest.mark.parametrize('config_id', [c[0] for c in CONFIGS])
def test_many_updates_give_the_reference_of_mxnets_rule(config_id):
    """Float64 weights: MXNet's documented rule to 1e-12; float32 weights: to 1e-6."""
    want = reference(config_id, 300)
    np.testing.assert_allclose(train(config_id, 300, np.float64), want, rtol=1e-12, atol=1e-14)
    assert relative(train(config_id, 300), want) < 1e-6


@pytest.mark.parametrize('config_id', sorted(set(BY_ID) - NOT_IN_MXNET_19))
def test_many_updates_give_mxnets_own_weights(config_id, stand_in_noise):
    want = np.array(MXNET[config_id], np.float32)
    stand_in_noise(16)
    got = train(config_id, 16)
    if config_id in EXACT:
        np.testing.assert_array_equal(got, want)
    assert relative(got, want) < 1e-6
    stand_in_noise(16)   # the reference of the documented rule is MXNet's too
    assert relative(reference(config_id, 16), want) < 1e-6


def test_mxnet_19_fails_dcasgd_with_momentum_where_kvps_runs_the_rule():
    """MXNet 1.9's DCASGD tests ``if mom:`` on an array (ValueError for more than one element;
    a zero momentum of one element is False and trips an assert): kvps runs the rule its
    docstring and the paper give, against the reference (test above) and here by hand."""
    opt = create('dcasgd', momentum=0.5, lamda=0.5, learning_rate=0.1)
    updater, w = Updater(opt), np.array([1.0, -2.0], np.float32)
    updater.update('k', w, np.array([1.0, 1.0], np.float32))   # prev = w0: no compensation
    np.testing.assert_allclose(w, [0.9, -2.1], rtol=1e-6)
    updater.update('k', w, np.array([2.0, 0.0], np.float32))
    # mom = 0.5 * -0.1 - 0.1 * (2 + 0.5 * 4 * (0.9 - 1)) = -0.23; w = 0.9 - 0.23
    np.testing.assert_allclose(w, [0.67, -2.15], rtol=1e-6)


# ------------------------------------------------------------------ torch.optim where it has it
torch = pytest.importorskip('torch')


def torch_run(optimizer, kwargs, w0s, grads):
    params = [torch.nn.Parameter(torch.tensor(w0, dtype=torch.float64)) for w0 in w0s]
    opt = getattr(torch.optim, optimizer)(params, **kwargs)
    for step in grads:
        for p, g in zip(params, step):
            p.grad = torch.tensor(g, dtype=torch.float64)
        opt.step()
    return [p.detach().numpy() for p in params]


def kvps_run(name, params, w0s, grads):
    updater = Updater(create(name, **params))
    ws = [np.array(w0, np.float64) for w0 in w0s]
    for step in grads:
        updater.update_many([(k, 0, w, np.array(g, np.float64))
                             for k, (w, g) in enumerate(zip(ws, step))])
    return ws


def _problems(n_keys, n=200):
    runs = [problem(f'torch-{k}', n) for k in range(n_keys)]
    return [w0 for w0, _ in runs], [[g[s] for _, g in runs] for s in range(STEPS)]


def test_adamax_is_torchs_without_its_epsilon():
    """torch adds eps to |g| in the infinity norm; MXNet has none. With eps=0 they agree;
    where a gradient stays 0, MXNet's (and kvps's) u is 0 and the weight NaN, torch's not."""
    w0s, grads = _problems(1)
    ours = kvps_run('adamax', dict(learning_rate=0.01, wd=0.02, beta1=0.8, beta2=0.99), w0s,
                    grads)
    theirs = torch_run('Adamax', dict(lr=0.01, weight_decay=0.02, betas=(0.8, 0.99), eps=0.0),
                       w0s, grads)
    np.testing.assert_allclose(ours[0], theirs[0], rtol=1e-9, atol=1e-12)
    zero = [[np.array([0.0, 1.0])]] * 3
    with np.errstate(invalid='ignore'):   # (numpy says 0/0 was met)
        assert np.isnan(kvps_run('adamax', {}, [np.array([1.0, 1.0])], zero)[0][0])
    assert np.isfinite(torch_run('Adamax', {}, [np.array([1.0, 1.0])], zero)[0]).all()


def test_nadam_is_torchs_per_parameter_where_mxnet_shares_one_schedule():
    """torch keeps Nadam's momentum product per parameter, as kvps does per key; MXNet keeps
    one for all keys (its two-key run, baked in MXNET, differs from its one-key runs). (torch
    keeps the product in float32: 1e-6.)"""
    w0s, grads = _problems(2)
    ours = kvps_run('nadam', dict(learning_rate=0.01, wd=0.01, schedule_decay=0.1), w0s, grads)
    theirs = torch_run('NAdam', dict(lr=0.01, weight_decay=0.01, momentum_decay=0.1), w0s,
                       grads)
    for a, b in zip(ours, theirs):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-9)
    for k in (0, 1):   # MXNet's own two-key run
        w0, key_grads = problem(f'nadam-key{k}', 16)
        alone = kvps_run('nadam', dict(learning_rate=0.01), [w0], [[g] for g in key_grads])
        assert relative(alone[0], MXNET[f'nadam-key{k}']) > 1e-4


def test_adadelta_is_torchs_at_lr_1_without_wd_and_decays_outside_the_step():
    """MXNet 1.9's AdaDelta has no learning rate and decays the weight by wd outside the
    adaptive step (w -= delta + wd*w); torch scales delta by lr and adds wd*w to g."""
    w0s, grads = _problems(1)
    plain = dict(lr=1.0, rho=0.95, eps=1e-6)
    steps = [torch_run('Adadelta', plain, w0s, grads[:s])[0] for s in range(STEPS + 1)]
    for lr in (0.01, 5.0):
        ours = kvps_run('adadelta', dict(learning_rate=lr, rho=0.95, epsilon=1e-6), w0s, grads)
        np.testing.assert_allclose(ours[0], steps[-1], rtol=1e-9, atol=1e-12)
    # with wd: torch's steps without it (they depend on the gradients alone), then w -= wd*w
    w = np.array(w0s[0], np.float64)
    for before, after in zip(steps, steps[1:]):
        w = w - ((before - after) + 0.1 * w)
    ours = kvps_run('adadelta', dict(wd=0.1, rho=0.95, epsilon=1e-6), w0s, grads)[0]
    np.testing.assert_allclose(ours, w, rtol=1e-9, atol=1e-12)
    theirs = torch_run('Adadelta', dict(plain, weight_decay=0.1), w0s, grads)[0]
    assert relative(ours, theirs) > 1e-3
