"""CUDA C source of the fused update kernels, generated from dtype names alone (no cupy needed).

cuda_kernels describes each update as a Plan (its arrays, scalars and the rule's C body) and
launches the source made here through cupy.RawKernel. Keeping generation free of cupy lets
the tests compile every variant with NVRTC on a machine without a GPU. Two layouts share one
body: `single` (one array set, scalars by value) and `multi` (one launch over many keys: a
row per key in a table of element counts and pointers, and a row of scalars per key, as
MXNet's and apex's multi-tensor apply do).
"""

import dataclasses
import re

from .common import storage_name

THREADS = 256           # threads per block, every kernel here
MAX_BLOCKS = 8192       # grid-stride loops cover the rest

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

PREAMBLE = r'''
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
'''


@dataclasses.dataclass
class Plan:
    """One update on one key, ready to launch: ``arrays`` are (local name, array, written)
    read element by element as ``p_<name>``; ``raws`` are (name, array) indexed freely;
    ``scalars`` are (name, value, wide) passed as ``s_<name>`` in the compute type (double
    when wide); ``body`` is the rule in C, between the loads and stores it implies."""
    tag: str
    compute: str                 # 'float32' or 'float64'
    n: int
    arrays: list
    body: str
    scalars: list
    raws: list = dataclasses.field(default_factory=list)

    def signature(self):
        """What makes two plans share a kernel, and all its source depends on: rule, body,
        dtypes, scalar names. Asked at every launch (it keys the compiled kernels), so it
        reads cached dtype names instead of building the source."""
        return (self.tag, self.compute, self.body,
                tuple([(a[0], storage_name(a[1]), a[2]) for a in self.arrays]),
                tuple([(r[0], storage_name(r[1])) for r in self.raws]),
                tuple([(s[0], s[2]) for s in self.scalars]))

    def kernel_name(self, multi=False):
        dtypes = '_'.join(_SHORT[str(a[1].dtype)] for a in self.arrays)
        return f'kvps_{self.tag}_{_SHORT[self.compute]}_{dtypes}' + ('_multi' if multi else '')


def _ctype_of_compute(compute):
    return 'double' if compute == 'float64' else 'float'


def _element_refs(plan):
    """``p_x`` as a reference to element i of each array, const unless written."""
    refs = []
    for name, arr, written in plan.arrays:
        ctype = CTYPES[str(arr.dtype)]
        const = '' if written else 'const '
        refs.append(f'{const}{ctype}& p_{name} = p_{name}_[i];')
    return refs


def _loop(plan):
    return '\n'.join([
        '    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;',
        '         i += (long long)gridDim.x * blockDim.x) {',
        *('        ' + line for line in _element_refs(plan)),
        *('        ' + line for line in plan.body.split('\n')),
        '    }'])


def _pointer_decl(name, arr, written):
    ctype = CTYPES[str(arr.dtype)]
    return f'{"" if written else "const "}{ctype}* __restrict__ p_{name}_'


def source(plan, multi=False):
    """The complete CUDA C source of ``plan``'s kernel, named ``plan.kernel_name(multi)``."""
    return PREAMBLE + definition(plan, multi)


def definition(plan, multi=False):
    """The kernel alone: its compute type and its function, after PREAMBLE."""
    kc = _ctype_of_compute(plan.compute)
    head = [f'typedef {kc} KC;']
    if not multi:
        params = ['const long long n']
        params += [_pointer_decl(n, a, w) for n, a, w in plan.arrays]
        params += [f'const double* __restrict__ p_{n}' for n, _ in plan.raws]
        params += [f'const {"double" if wide else "KC"} s_{n}' for n, _, wide in plan.scalars]
        prologue = []
    else:  # row k of `table`: n, then one pointer per array; row k of `scal`: the scalars
        assert not plan.raws, 'a multi-tensor launch takes element-wise arrays only'
        params = ['const long long* __restrict__ table', 'const double* __restrict__ scal']
        width = 1 + len(plan.arrays)
        prologue = [f'const long long* row = table + (long long)blockIdx.y * {width};',
                    'const long long n = row[0];']
        for index, (name, arr, written) in enumerate(plan.arrays, start=1):
            decl = _pointer_decl(name, arr, written)
            ptype = decl.split('*')[0] + '*'
            prologue.append(f'{decl} = ({ptype})row[{index}];')
        prologue.append(f'const double* sc = scal + (long long)blockIdx.y * {len(plan.scalars)};')
        for index, (name, _, wide) in enumerate(plan.scalars):
            if re.search(rf'\bs_{name}\b', plan.body):   # (unread ones would warn)
                ctype = 'double' if wide else 'KC'
                prologue.append(f'const {ctype} s_{name} = ({ctype})sc[{index}];')
    return '\n'.join([*head,
                      f'extern "C" __global__ void {plan.kernel_name(multi)}(',
                      '        ' + ',\n        '.join(params) + ') {',
                      *('    ' + line for line in prologue),
                      _loop(plan), '}', ''])


def sumsq_source(dtype):
    """Two kernels for a deterministic sum of squares in double: ``kvps_sumsq_<t>`` leaves one
    partial per block (launch exactly THREADS blocks), ``kvps_sum_rows`` adds each row of
    THREADS partials in a fixed order (one block per row)."""
    ctype = CTYPES[dtype]
    reduce_shared = '''    acc[threadIdx.x] = s;
    __syncthreads();
    for (int k = THREADS / 2; k > 0; k >>= 1) {
        if (threadIdx.x < k) acc[threadIdx.x] += acc[threadIdx.x + k];
        __syncthreads();
    }'''
    return PREAMBLE + f'''
#define THREADS {THREADS}
extern "C" __global__ void kvps_sumsq_{_SHORT[dtype]}(const {ctype}* __restrict__ x,
        const long long n, double* __restrict__ partial) {{
    __shared__ double acc[THREADS];
    double s = 0;
    for (long long i = (long long)blockIdx.x * THREADS + threadIdx.x; i < n;
         i += (long long)gridDim.x * THREADS) {{
        double v = kv_ld<double>(x[i]);
        s += v * v;
    }}
{reduce_shared}
    if (threadIdx.x == 0) partial[blockIdx.x] = acc[0];
}}
extern "C" __global__ void kvps_sum_rows(const double* __restrict__ partial,
        double* __restrict__ out) {{
    __shared__ double acc[THREADS];
    double s = partial[(long long)blockIdx.x * THREADS + threadIdx.x];
{reduce_shared}
    if (threadIdx.x == 0) out[blockIdx.x] = acc[0];
}}
'''


def sumsq_name(dtype):
    return f'kvps_sumsq_{_SHORT[dtype]}'


def blocks_for(n):
    """Blocks of THREADS for n elements under a grid-stride loop (n > 0)."""
    return max(1, min(-(-n // THREADS), MAX_BLOCKS))
