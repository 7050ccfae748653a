"""CUDA C source of the fused update kernels, generated from dtype names alone (no cupy needed).

cuda_kernels describes each update as a Plan (its arrays, scalars and the rule's C body in one
or more passes) and cuda_launch runs the source made here through cupy.RawKernel. Keeping
generation free of cupy lets the tests compile every variant with NVRTC on a machine without a
GPU. Two layouts share one body:
- `single`: one key, its arrays and scalars by value (one-pass rules only);
- `multi`: one launch over many keys of any sizes, as apex's multi-tensor apply and MXNet's
  multi-sgd do: key k runs on its own run of blocks (found from a prefix of the keys' block
  counts) in a grid-stride loop over its elements; a table on the device gives each key's
  element count, pointers and scalars (`table_words` says where each lies).
A rule of several passes (LAMB, LARS, LANS) sums, in each pass but the last, ``kv_norm[0]``
and ``kv_norm[1]`` over each key (its body adds to them); per-block partial sums are added up
by the key's last block to finish, in a fixed order, into the key's sums ``kv_s0`` and
``kv_s1``, from which the pass's ``finish`` (C, once per key) keeps what later passes need in
``kv_keep[0..KV_SLOTS)``, read there as ``kv_r0``, ``kv_r1``... (LAMB: its trust ratio). The
weights are written by the last pass only; nothing else is kept between passes.
Every rule loads several elements a thread before computing any (_ilp_loop): with one
element's loads in flight, rules of several passes ran at 0.25-0.61 of the copy rate on an H200
and rules of many state arrays (ftrl, adadelta, ftml) at 0.82-0.88; with four, 0.43-0.65 and
0.97-0.99, the others unchanged at 0.96-1.08.
A grad given as two arrays (a sync round's last pushes: ``p_g`` and ``p_g2``) is loaded as
their sum, in the compute type, wherever a pass reads ``g``: the numpy kernels' sum of the
same tuple, to the bit.
"""

import dataclasses
import functools
import re

from . import noise
from .common import storage_name

THREADS = 256           # threads per block, every kernel here
MAX_BLOCKS = 8192       # grid-stride loops cover the rest
KV_SLOTS = 4            # doubles per key that a pass's finish keeps for the passes after it
# Elements a thread loads at once (_ilp_loop); FORCED_ILP, where a benchmark sets it, applies
# to every kernel compiled after (1: the plain grid-stride loop).
ILP = 4
FORCED_ILP = None
GRADS = ('g', 'g2')     # the arrays of a grad, one or two (added as it is loaded)

# C the rules share: MXNet's gradient preprocessing (clip(rescale * g), + wd * w for the rules
# that decay through the gradient) and Adam's moments.
PREP = 'g = kv_clip<KC>(g * s_rescale, s_clip);'
PREP_WD = PREP + ' g = g + s_wd * w;'
MOMENTS = 'mean = s_beta1 * mean + s_omb1 * g; var = s_beta2 * var + s_omb2 * (g * g);'


def sgd_step(momentum, lr='s_lr'):
    """C of SGD's step on a preprocessed ``g``, with heavy-ball momentum or without; ``lr``:
    the C of its learning rate (LARS and LBSGD scale it)."""
    if momentum:
        return f' mom = s_momentum * mom - {lr} * g; w = w + mom;'
    return f' w = w - {lr} * g;'


# Storage dtype (numpy name) -> C type. Half types are 16-bit structs converted by hand (PTX
# cvt for float16, bit arithmetic for bfloat16), so no CUDA header is needed to compile.
CTYPES = {'float32': 'float', 'float64': 'double', 'float16': 'kv_f16', 'uint16': 'kv_bf16'}
_SHORT = {'float32': 'f32', 'float64': 'f64', 'float16': 'f16', 'uint16': 'bf16'}

# The float16 conversions, the only PTX here (the CPU emulation in the tests swaps them).
HALF_CONVERSIONS = r'''
__device__ __forceinline__ float kv_f16_to_f32(unsigned short h) {
    float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h)); return f;
}
__device__ __forceinline__ unsigned short kv_f32_to_f16(float f) {
    unsigned short h; asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f)); return h;
}
'''

PREAMBLE = f'#define KV_THREADS {THREADS}\n' + r'''
struct kv_f16 { unsigned short x; };
struct kv_bf16 { unsigned short x; };
''' + HALF_CONVERSIONS + r'''
__device__ __forceinline__ float kv_bf16_to_f32(unsigned short u) {
    return __uint_as_float(((unsigned int)u) << 16);
}
__device__ __forceinline__ unsigned short kv_f32_to_bf16(float f) {
    unsigned int x = __float_as_uint(f);
    if ((x & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((x >> 16) | 0x40u);
    x += 0x7fffu + ((x >> 16) & 1u);
    return (unsigned short)(x >> 16);
}
template <typename C> __device__ __forceinline__ C kv_ld(float x) { return (C)x; }
template <typename C> __device__ __forceinline__ C kv_ld(double x) { return (C)x; }
template <typename C> __device__ __forceinline__ C kv_ld(kv_f16 x) {
    return (C)kv_f16_to_f32(x.x);
}
template <typename C> __device__ __forceinline__ C kv_ld(kv_bf16 x) {
    return (C)kv_bf16_to_f32(x.x);
}
template <typename C> __device__ __forceinline__ void kv_st(float& d, C v) { d = (float)v; }
template <typename C> __device__ __forceinline__ void kv_st(double& d, C v) { d = (double)v; }
template <typename C> __device__ __forceinline__ void kv_st(kv_f16& d, C v) {
    d.x = kv_f32_to_f16((float)v);
}
template <typename C> __device__ __forceinline__ void kv_st(kv_bf16& d, C v) {
    d.x = kv_f32_to_bf16((float)v);
}
template <typename C> __device__ __forceinline__ C kv_clip(C x, C c) {
    return c < 0 ? x : (x > c ? c : (x < -c ? -c : x));   /* NaN passes, as np.clip */
}
template <typename C> __device__ __forceinline__ C kv_sign(C x) {
    return (C)((x > 0) - (x < 0));
}
/* multi layout: the key whose blocks hold this block, the last k with starts[k] <= block */
__device__ __forceinline__ int kv_key_of(const long long* starts, int nkeys) {
    const long long block = blockIdx.x;
    int lo = 0, hi = nkeys - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) / 2;
        if (starts[mid] <= block) lo = mid; else hi = mid - 1;
    }
    return lo;
}
/* two sums over a block's threads, added as a tree (a fixed order), left in acc[.][0] */
__device__ __forceinline__ void kv_block_sum2(const double* s, double (*acc)[KV_THREADS]) {
    acc[0][threadIdx.x] = s[0];
    acc[1][threadIdx.x] = s[1];
    __syncthreads();
    for (unsigned int h = blockDim.x / 2; h > 0; h >>= 1) {
        if (threadIdx.x < h) {
            acc[0][threadIdx.x] += acc[0][threadIdx.x + h];
            acc[1][threadIdx.x] += acc[1][threadIdx.x + h];
        }
        __syncthreads();
    }
}
/* common.lamb_ratio: ||w|| / ||d||, ||w|| bounded by the bounds > 0 (max and min as Python's:
   a NaN norm stays NaN); 1 when either norm is 0 or the ratio is not finite */
__device__ __forceinline__ double kv_trust_ratio(double sw, double sd, double lower,
                                                 double upper) {
    double r1 = sqrt(sw), r2 = sqrt(sd);
    if (lower > 0) r1 = lower > r1 ? lower : r1;
    if (upper > 0) r1 = upper < r1 ? upper : r1;
    return (r1 > 0 && r2 > 0 && isfinite(r1 / r2)) ? r1 / r2 : 1.0;
}
/* common.lars_factor: MXNet's multi_lars, eta ||w|| / (||g|| rescale + wd ||w|| + eps) */
__device__ __forceinline__ double kv_lars_factor(double sw, double sg, double eta, double eps,
                                                 double wd, double rescale) {
    const double wn = sqrt(sw);
    return (wn > 0 && sg > 0) ? eta * wn / (sqrt(sg) * rescale + wd * wn + eps) : 1.0;
}
/* common.lbsgd_lars: LBSGD's 'lars' warm-up, sqrt(|w|^2 / (|g|^2 + wd |w|^2)) in [0.01, 100] */
__device__ __forceinline__ double kv_lbsgd_lars(double sw, double sg, double wd) {
    const double r = sqrt(sw / (sg + wd * sw + 1e-18));
    return r < 0.01 ? 0.01 : (r > 100.0 ? 100.0 : r);
}
/* np.maximum: NaN if either is */
template <typename C> __device__ __forceinline__ C kv_max(C a, C b) {
    return (a > b || a != a) ? a : b;
}
''' + noise.C_SOURCE


@dataclasses.dataclass(frozen=True)
class Pass:
    """One sweep over a key: ``loads`` are (local, C of its value), ``rest`` is C (the rule,
    the stores), run per element with ``p_<name>`` a reference to the element of array
    ``name``; ``written``: the arrays it stores; ``finish``: in a pass before the last, C run
    once per key on its sums (see the module docstring)."""
    loads: tuple
    rest: str
    written: frozenset
    finish: str = ''

    @property
    def body(self):
        """The C run per element: the loads, then the rule and the stores."""
        return '\n'.join([*(f'KC {name} = {value};' for name, value in self.loads), self.rest])


@dataclasses.dataclass
class Plan:
    """One update on one key, ready to launch: ``arrays`` are (local name, array) in table
    order; ``passes`` run one after the other (several for LAMB: see the module docstring);
    ``scalars`` are (name, value, wide) read as ``s_<name>`` in the compute type (double when
    wide); ``variant`` is what the rule asked for before any array was looked at."""
    tag: str
    compute: str                 # 'float32' or 'float64'
    n: int
    arrays: list
    passes: tuple
    scalars: list
    variant: tuple = ()

    def signature(self):
        """What makes two plans share a kernel, and all its source depends on: rule, passes,
        dtypes, scalar names (cached dtype names: no source is built to ask)."""
        return (self.tag, self.compute, self.passes,
                tuple([(a[0], storage_name(a[1])) for a in self.arrays]),
                tuple([(s[0], s[2]) for s in self.scalars]))


def kernel_name(plan, multi=False, index=0):
    """``kvps_<rule>_<compute>_<array dtypes>[_multi][_pass<i>]``; a grad of two arrays
    shows as one dtype with ``x2`` (``f32x2``)."""
    two = any(a[0] == GRADS[1] for a in plan.arrays)
    dtypes = '_'.join(_SHORT[storage_name(a[1])] + ('x2' if two and a[0] == 'g' else '')
                      for a in plan.arrays if a[0] != GRADS[1])
    name = f'kvps_{plan.tag}_{_SHORT[plan.compute]}_{dtypes}' + ('_multi' if multi else '')
    return name + (f'_pass{index + 1}' if len(plan.passes) > 1 else '')


def kernels_of(plan):
    """{kernel name: source} of every kernel ``plan`` may launch."""
    layouts = [(True, i) for i in range(len(plan.passes))]
    if len(plan.passes) == 1:
        layouts.append((False, 0))
    return {kernel_name(plan, *layout): source(plan, *layout) for layout in layouts}


def source(plan, multi=False, index=0):
    """The complete CUDA C source of one kernel of ``plan``, named kernel_name(plan, ...)."""
    return PREAMBLE + definition(plan, multi, index)


def uses(text, name):
    """Whether C ``text`` names ``name``."""
    return re.search(rf'\b{name}\b', text) is not None


@functools.lru_cache(maxsize=256)
def passes(core, then, mp, grads, states):
    """The passes of a rule's C (cached: few rules, many keys): ``core`` and the bodies of
    ``then`` (see cuda_launch.Request), each between the loads of what it reads (the master
    weight ``w``, the grad ``g``, of ``grads`` arrays added, and ``states``) and the stores
    of the states it assigns; the last pass also stores the weights (and the low-precision
    weight when ``mp``)."""
    bodies = [core, *(body for _, body in then or ())]
    finishes = [*(finish for finish, _ in then or ()), '']
    weights = [('w', 'w')] + ([('weight', 'w')] if mp else [])
    out = []
    for index, (body, finish) in enumerate(zip(bodies, finishes)):
        last = index == len(bodies) - 1
        loads = [name for name in ('w', 'g', *states)
                 if (last and name == 'w') or uses(body, name)]
        stored = [(name, name) for name in states if _assigns(body, name)]
        out.append(_pass(loads, grads, body, (weights if last else []) + stored, finish))
    return tuple(out)


def _assigns(body, name):
    return re.search(rf'\b{name}\s*=(?!=)', body) is not None


def _pass(loads, grads, core, stores, finish=''):
    rest = '\n'.join([core] + [f'kv_st(p_{name}, {value});' for name, value in stores])
    return Pass(tuple([(name, _load(name, grads)) for name in loads]), rest,
                frozenset(name for name, _ in stores), finish)


def _load(name, grads):
    """C of the value of array ``name`` (the grad: the sum of its ``grads`` arrays, in
    order, as numpy_packing.add_parts adds them)."""
    names = GRADS[:grads] if name == 'g' else (name,)
    return ' + '.join(f'kv_ld<KC>(p_{each})' for each in names)


def _pointer_type(arr, written):
    return f'{"" if written else "const "}{CTYPES[storage_name(arr)]}*'


def definition(plan, multi=False, index=0):
    """The kernel alone: its compute type and its function, after PREAMBLE."""
    step = plan.passes[index]
    used = [(name, arr, name in step.written) for name, arr in plan.arrays
            if uses(step.body, f'p_{name}')]
    # each array's element i, as ``p_<name>``
    refs = {n: f'{_pointer_type(a, w)[:-1]}& p_{n} = p_{n}_[i];' for n, a, w in used}
    ilp = elements_per_thread()
    norms = multi and index < len(plan.passes) - 1
    tail = _finish_norms(step.finish) if norms else ''
    if multi:
        params, prologue = _multi_head(plan, used, step.body + tail, len(plan.passes) > 1)
        first, stride = '(blockIdx.x - first) * blockDim.x', 'blocks * blockDim.x'
    else:
        assert len(plan.passes) == 1, 'a rule of several passes runs in the multi layout only'
        params = ['const long long n']
        params += [f'{_pointer_type(a, n in step.written)} __restrict__ p_{n}_'
                   for n, a in plan.arrays]
        params += [f'const {"double" if wide else "KC"} s_{n}' for n, _, wide in plan.scalars]
        prologue = []
        first, stride = 'blockIdx.x * blockDim.x', 'gridDim.x * blockDim.x'
    if norms:
        prologue.append('double kv_norm[2] = {0, 0};')
    return '\n'.join([
        f'typedef {"double" if plan.compute == "float64" else "float"} KC;',
        f'extern "C" __global__ void {kernel_name(plan, multi, index)}(',
        '        ' + ',\n        '.join(params) + ') {',
        *('    ' + line for line in prologue),
        *(('    ' + line for line in _ilp_loop(step, refs, first, stride, ilp)) if ilp > 1 else (
            f'    for (long long i = (long long){first} + threadIdx.x; i < n;',
            f'         i += (long long){stride}) {{',
            *('        ' + line for line in [*refs.values(), *step.body.split('\n')]),
            '    }')),
        *([tail] if tail else []), '}', ''])


def elements_per_thread():
    """Elements each thread loads at once (see _ilp_loop): FORCED_ILP where set, else ILP."""
    return ILP if FORCED_ILP is None else FORCED_ILP


def _ilp_loop(step, refs, first, stride, ilp):
    """The grid-stride loop with ``ilp`` elements a thread a turn: the loads of all of them
    first, then each one's rule and stores, element after element in the plain loop's order
    (a pass's sums add up alike). The compiler does not move loads ahead of stores by itself
    here (pointers read from a table may alias, for all it knows), so the plain loop has
    one element's loads in flight per thread; this has ``ilp`` times as many. ``refs``: the
    C that names each array's element i (definition's)."""
    read = [n for n in refs if any(uses(value, f'p_{n}') for _, value in step.loads)]
    kept = [n for n in refs if uses(step.rest, f'p_{n}')]
    each = [f'    for (int kv_j = 0; kv_j < {ilp}; ++kv_j) {{',
            '        const long long i = kv_at + kv_j * kv_stride;',
            '        if (i < n) {']
    return [
        f'const long long kv_stride = (long long){stride};',
        '#pragma unroll 1',
        f'for (long long kv_at = (long long){first} + threadIdx.x; kv_at < n;',
        f'     kv_at += {ilp} * kv_stride) {{',
        *(f'    KC kv_l_{name}[{ilp}];' for name, _ in step.loads),
        '    #pragma unroll', *each,
        *(f'            {refs[n]}' for n in read),
        *(f'            kv_l_{name}[kv_j] = {value};' for name, value in step.loads),
        '        }', '    }',
        '    #pragma unroll', *each,
        *(f'            {refs[n]}' for n in kept),
        *(f'            KC {name} = kv_l_{name}[kv_j];' for name, _ in step.loads),
        *('            ' + line for line in step.rest.split('\n')),
        '        }', '    }',
        '}']


def _multi_head(plan, used, text, several):
    """Parameters and prologue of a multi-layout kernel: find the block's key, then its
    element count, pointers and scalars in the table (see table_words)."""
    width, count = 1 + len(plan.arrays), len(plan.scalars)
    params = ['const long long* __restrict__ tab', 'const int nkeys']
    if several:
        params += ['double* __restrict__ partial', 'unsigned int* __restrict__ count',
                   'double* __restrict__ ratio']
    prologue = ['const int k = kv_key_of(tab, nkeys);',
                'const long long first = tab[k], blocks = tab[k + 1] - first;',
                f'const long long* row = tab + (nkeys + 1) + (long long)k * {width};',
                'const long long n = row[0];']
    slots = {name: slot for slot, (name, _) in enumerate(plan.arrays, start=1)}
    for name, arr, written in used:
        ptype = _pointer_type(arr, written)
        prologue.append(f'{ptype} __restrict__ p_{name}_ = ({ptype})row[{slots[name]}];')
    read = [(slot, name, wide) for slot, (name, _, wide) in enumerate(plan.scalars)
            if uses(text, f's_{name}')]   # (unread ones would warn)
    if read:
        prologue.append(f'const double* sc = (const double*)(tab + (nkeys + 1) + (long long)'
                        f'nkeys * {width}) + (long long)k * {count};')
    for slot, name, wide in read:
        ctype = 'double' if wide else 'KC'
        prologue.append(f'const {ctype} s_{name} = ({ctype})sc[{slot}];')
    for slot in range(KV_SLOTS if several else 0):   # kept by the finishes before
        if uses(text, f'kv_r{slot}'):
            prologue.append(f'const double kv_r{slot} = ratio[{KV_SLOTS} * (long long)k'
                            f' + {slot}];')
    return params, prologue


def _finish_norms(finish):
    """The end of a pass before the last: the key's sums, then ``finish`` on them."""
    sums = [f'const double kv_s{i} = kv_acc[{i}][0];' for i in (0, 1)
            if uses(finish, f'kv_s{i}')]
    keep = f'double* kv_keep = ratio + {KV_SLOTS} * (long long)k;'
    return _FINISH_NORMS.replace('KV_FINISH;', ' '.join([*sums, keep, finish]))


# After a pass that sums: the block's sums of kv_norm become two partials; the key's last
# block to finish (counted atomically) adds the key's partials in block order, so the sums do
# not depend on which block finished last, and runs the pass's finish on them.
_FINISH_NORMS = r'''    __shared__ double kv_acc[2][KV_THREADS];
    __shared__ bool kv_last;
    kv_block_sum2(kv_norm, kv_acc);
    if (threadIdx.x == 0) {
        partial[2 * blockIdx.x] = kv_acc[0][0];
        partial[2 * blockIdx.x + 1] = kv_acc[1][0];
        __threadfence();   /* the partials are visible before the count that announces them */
        kv_last = atomicAdd(count + k, 1u) == (unsigned int)(blocks - 1);
    }
    __syncthreads();
    if (!kv_last) return;
    const volatile double* parts = partial;   /* written by other blocks: not from L1 */
    kv_norm[0] = kv_norm[1] = 0;
    for (long long j = first + threadIdx.x; j < first + blocks; j += blockDim.x) {
        kv_norm[0] += parts[2 * j];
        kv_norm[1] += parts[2 * j + 1];
    }
    kv_block_sum2(kv_norm, kv_acc);
    if (threadIdx.x == 0) {
        KV_FINISH;
        count[k] = 0;   /* zero again for the next launch */
    }'''


def table_words(nkeys, arrays, scalars):
    """Where the multi layout's table puts things, in 8-byte words: (offset of the rows of
    element count and pointers, their width, offset of the scalar rows, their width, total).
    Words 0..nkeys hold the keys' first blocks and, last, the launch's block count."""
    width, count = 1 + arrays, scalars
    rows = nkeys + 1
    return rows, width, rows + nkeys * width, count, rows + nkeys * (width + count)


def blocks_for(n):
    """Blocks of THREADS for n elements under a grid-stride loop (n > 0)."""
    return max(1, min(-(-n // THREADS), MAX_BLOCKS))
