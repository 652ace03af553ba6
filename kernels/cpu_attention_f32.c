// Attention for fp32 KV on x86 CPUs with AVX2 and FMA (no AVX512-BF16 needed), built by
// kernels/cpu_native.py beside cpu_attention.c and called through ctypes.
//
// Why it exists: on CPUs without AVX512-BF16 (AMD Zen 2/3, older Intel) bf16 matmuls are slow, so
// the engine runs fp32 there, and PyTorch's attention then (1) cannot skip the keys a query never
// sees in a fused prefill (the recomputed tokens are scattered; the call takes an explicit mask
// over every key) and (2) runs a batched decode step as one small call chain per sequence. Here
// the causal-by-position mask is computed from the positions, so a query block reads only the
// keys up to its last position, and one call serves every sequence of a decode step. The softmax
// runs online in fp32 as flash attention does.
//
// Layouts (element strides; a head's D values are contiguous):
//   q   [Tq, H, D]  row stride q_rs      k, v [Tk, Hkv, D]  row strides k_rs, v_rs
//   out [Tq, H, D]  contiguous           key positions ascending (the caller checks)
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define BK 32  // keys per block: 4 vectors of 8 scores
#define BQ 32  // query tokens per work item (times the heads sharing one KV head)
#define RB 3   // query rows per score micro-tile: 3 x 4 accumulators + 3 broadcasts fit 16 registers

static inline __m256 exp_ps(__m256 x) {
    // exp(x) = 2^n * e^r, |r| <= ln2/2, degree-6 polynomial (relative error ~2e-7)
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.3888889e-3f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3333333e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1666667e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666667e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    // 2^n from the exponent bits (n in [-126, 127] after the clamp above)
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

static inline float hmax8(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
    return _mm_cvtss_f32(m);
}

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}

// Eight vectors to the vector of their eight horizontal sums.
static inline __m256 hsum8x8(__m256 a0, __m256 a1, __m256 a2, __m256 a3, __m256 a4, __m256 a5, __m256 a6,
                             __m256 a7) {
    __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a4, a5), _mm256_hadd_ps(a6, a7));
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// K block b of KV head hk, transposed to [D][BK] (8 keys per vector); keys past tk are zero.
static void pack_keys(const float* k, int64_t k_rs, int64_t tk, int64_t hk, int64_t d, int64_t b, float* kt) {
    for (int64_t j = 0; j < BK; j++) {
        const int64_t key = b * BK + j;
        const float* row = k + key * k_rs + hk * d;
        for (int64_t x = 0; x < d; x++) kt[x * BK + j] = key < tk ? row[x] : 0.0f;
    }
}

// Inlined per head size (see prefill_dispatch): constant trip counts, accumulators in registers.
static inline __attribute__((always_inline)) void prefill_item(
        const float* q, int64_t q_rs, const float* v, int64_t v_rs, float* out, const int64_t* qpos,
        const int64_t* kpos, int64_t tq, int64_t tk, int64_t h, int64_t hkv, const int64_t d, float scale,
        const float* kpack, int64_t hk, int64_t qb, float* o, float* s, float* m, float* l) {
    const int64_t g = h / hkv, t0 = qb * BQ, nt = (tq - t0) < BQ ? (tq - t0) : BQ, rows = nt * g;
    const int64_t nblocks = (tk + BK - 1) / BK, nc = d / 8;
    int64_t qmax = INT64_MIN, qmin = INT64_MAX;
    for (int64_t t = 0; t < nt; t++) {
        qmax = qpos[t0 + t] > qmax ? qpos[t0 + t] : qmax;
        qmin = qpos[t0 + t] < qmin ? qpos[t0 + t] : qmin;
    }
    // keys are ascending: the first key past the block's last position ends its reads
    int64_t lo = 0, hi = tk;
    while (lo < hi) {
        int64_t mid = (lo + hi) / 2;
        if (kpos[mid] <= qmax) lo = mid + 1; else hi = mid;
    }
    const int64_t kend = lo, bend = (kend + BK - 1) / BK < nblocks ? (kend + BK - 1) / BK : nblocks;
    for (int64_t r = 0; r < rows; r++) { m[r] = -INFINITY; l[r] = 0.0f; }
    memset(o, 0, sizeof(float) * rows * d);
    const __m256 vscale = _mm256_set1_ps(scale);
    for (int64_t b = 0; b < bend; b++) {
        const float* kb = kpack + (hk * nblocks + b) * BK * d;
        const int64_t last = (b + 1) * BK - 1;
        const int full = last < kend && kpos[last] <= qmin;  // every row sees every key of the block
        // scores: RB rows at a time, 4 vectors of 8 keys each
        for (int64_t r0 = 0; r0 < rows; r0 += RB) {
            const int64_t rn = rows - r0 < RB ? rows - r0 : RB;
            const float* qr[RB];
            for (int64_t i = 0; i < RB; i++) {
                int64_t r = r0 + (i < rn ? i : 0), t = r / g, head = hk * g + r % g;
                qr[i] = q + (t0 + t) * q_rs + head * d;
            }
            __m256 acc[RB][4];
            for (int i = 0; i < RB; i++)
                for (int c = 0; c < 4; c++) acc[i][c] = _mm256_setzero_ps();
            for (int64_t x = 0; x < d; x++) {
                const float* kx = kb + x * BK;
                for (int i = 0; i < RB; i++) {
                    const __m256 qx = _mm256_broadcast_ss(qr[i] + x);
                    for (int c = 0; c < 4; c++) acc[i][c] = _mm256_fmadd_ps(qx, _mm256_loadu_ps(kx + c * 8), acc[i][c]);
                }
            }
            for (int64_t i = 0; i < rn; i++)
                for (int c = 0; c < 4; c++) _mm256_storeu_ps(s + (r0 + i) * BK + c * 8, _mm256_mul_ps(acc[i][c], vscale));
        }
        // online softmax per row; s becomes the row's probabilities for the block
        for (int64_t r = 0; r < rows; r++) {
            float* sr = s + r * BK;
            const int64_t qp = qpos[t0 + r / g];
            if (!full)
                for (int64_t j = 0; j < BK; j++) {
                    int64_t key = b * BK + j;
                    if (key >= tk || kpos[key] > qp) sr[j] = -INFINITY;
                }
            __m256 mx = _mm256_loadu_ps(sr);
            for (int c = 1; c < 4; c++) mx = _mm256_max_ps(mx, _mm256_loadu_ps(sr + c * 8));
            const float bmax = hmax8(mx);
            if (bmax == -INFINITY) {  // this row sees no key of the block
                memset(sr, 0, sizeof(float) * BK);
                continue;
            }
            const float mnew = m[r] > bmax ? m[r] : bmax;
            const float corr = m[r] == -INFINITY ? 0.0f : expf(m[r] - mnew);
            const __m256 vm = _mm256_set1_ps(mnew);
            __m256 sum = _mm256_setzero_ps();
            for (int c = 0; c < 4; c++) {
                // exp(-inf - m) is 0 after the clamp only approximately: mask it exactly
                const __m256 x = _mm256_loadu_ps(sr + c * 8);
                const __m256 live = _mm256_cmp_ps(x, _mm256_set1_ps(-INFINITY), _CMP_NEQ_OQ);
                const __m256 p = _mm256_and_ps(live, exp_ps(_mm256_sub_ps(x, vm)));
                _mm256_storeu_ps(sr + c * 8, p);
                sum = _mm256_add_ps(sum, p);
            }
            l[r] = l[r] * corr + hsum8(sum);
            m[r] = mnew;
            if (corr != 1.0f) {
                const __m256 vc = _mm256_set1_ps(corr);
                for (int64_t c = 0; c < nc; c++)
                    _mm256_storeu_ps(o + r * d + c * 8, _mm256_mul_ps(_mm256_loadu_ps(o + r * d + c * 8), vc));
            }
        }
        // o += p @ v, one row at a time over up to 8 vectors of its D values
        const int64_t kn = tk - b * BK < BK ? tk - b * BK : BK;
        const float* vb = v + (b * BK) * v_rs + hk * d;
        for (int64_t r = 0; r < rows; r++) {
            const float* pr = s + r * BK;
            for (int64_t c0 = 0; c0 < nc; c0 += 8) {
                const int64_t cn = nc - c0 < 8 ? nc - c0 : 8;
                __m256 acc[8];
                for (int64_t c = 0; c < cn; c++) acc[c] = _mm256_loadu_ps(o + r * d + (c0 + c) * 8);
                for (int64_t j = 0; j < kn; j++) {
                    const __m256 pj = _mm256_broadcast_ss(pr + j);
                    const float* vrow = vb + j * v_rs + c0 * 8;
                    for (int64_t c = 0; c < cn; c++) acc[c] = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vrow + c * 8), acc[c]);
                }
                for (int64_t c = 0; c < cn; c++) _mm256_storeu_ps(o + r * d + (c0 + c) * 8, acc[c]);
            }
        }
    }
    for (int64_t r = 0; r < rows; r++) {
        int64_t t = r / g, head = hk * g + r % g;
        float* dst = out + ((t0 + t) * h + head) * d;
        const __m256 inv = _mm256_set1_ps(l[r] > 0.0f ? 1.0f / l[r] : 0.0f);
        for (int64_t c = 0; c < nc; c++) _mm256_storeu_ps(dst + c * 8, _mm256_mul_ps(_mm256_loadu_ps(o + r * d + c * 8), inv));
    }
}

static void prefill_dispatch(const float* q, int64_t q_rs, const float* v, int64_t v_rs, float* out,
                             const int64_t* qpos, const int64_t* kpos, int64_t tq, int64_t tk, int64_t h, int64_t hkv,
                             int64_t d, float scale, const float* kpack, int64_t hk, int64_t qb, float* o, float* s,
                             float* m, float* l) {
#define ITEM(D) prefill_item(q, q_rs, v, v_rs, out, qpos, kpos, tq, tk, h, hkv, D, scale, kpack, hk, qb, o, s, m, l)
    switch (d) {
        case 32: ITEM(32); break;
        case 64: ITEM(64); break;
        case 96: ITEM(96); break;
        default: ITEM(128); break;
    }
#undef ITEM
}

// Returns 0, or a negative code for an unsupported shape (the caller then uses torch).
int rc_prefill_f32(const float* q, int64_t q_rs, const float* k, int64_t k_rs, const float* v, int64_t v_rs,
                   float* out, const int64_t* qpos, const int64_t* kpos, int64_t tq, int64_t tk, int64_t h,
                   int64_t hkv, int64_t d, float scale, int nthreads) {
    if (d % 32 != 0 || d > 128 || hkv <= 0 || h % hkv != 0 || tq <= 0 || tk <= 0) return -1;
    const int64_t nblocks = (tk + BK - 1) / BK, g = h / hkv, nqb = (tq + BQ - 1) / BQ;
    // only the blocks some query reads are packed: up to the last query's position
    int64_t qmax = INT64_MIN;
    for (int64_t t = 0; t < tq; t++) qmax = qpos[t] > qmax ? qpos[t] : qmax;
    int64_t lo = 0, hi = tk;
    while (lo < hi) {
        int64_t mid = (lo + hi) / 2;
        if (kpos[mid] <= qmax) lo = mid + 1; else hi = mid;
    }
    const int64_t used = (lo + BK - 1) / BK;
    float* kpack = aligned_alloc(32, sizeof(float) * hkv * nblocks * BK * d);
    if (!kpack) return -2;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t i = 0; i < hkv * nblocks; i++)
        if (i % nblocks < used) pack_keys(k, k_rs, tk, i / nblocks, d, i % nblocks, kpack + i * BK * d);
    // later query blocks read more keys: hand them out first, then the short ones fill in
#pragma omp parallel num_threads(nthreads)
    {
        const int64_t rows = BQ * g;
        float* o = aligned_alloc(32, sizeof(float) * rows * d);
        float* s = aligned_alloc(32, sizeof(float) * rows * BK);
        float* m = malloc(sizeof(float) * rows);
        float* l = malloc(sizeof(float) * rows);
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < hkv * nqb; i++) {
            int64_t qb = nqb - 1 - i / hkv, hk = i % hkv;
            prefill_dispatch(q, q_rs, v, v_rs, out, qpos, kpos, tq, tk, h, hkv, d, scale, kpack, hk, qb, o, s, m, l);
        }
        free(o); free(s); free(m); free(l);
    }
    free(kpack);
    return 0;
}

// One (sequence, KV head) pair of a decode step: the g query heads of KV head hk over all n keys
// (every key is visible to the newest token). Scores first (eight keys per hsum8x8), then the
// softmax, then the weighted sum of V rows. Every head of the group is served from the same pass
// over the keys and the values: a key block is read from memory once and stays in L1 for the
// other heads, and each value row is read once for up to three heads' accumulators.
static inline __attribute__((always_inline)) void decode_item(
        const float* q, const float* k, const float* v, int64_t n, int64_t h, int64_t hkv, const int64_t d,
        int64_t row_stride, float scale, int64_t hk, float* out, float* s) {
    const int64_t g = h / hkv, nc = d / 8;
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
        for (int64_t r = 0; r < g; r++) {
            const float* qr = q + (hk * g + r) * d;
            __m256 a[8];
            for (int jj = 0; jj < 8; jj++) {
                const float* kr = k + (j + jj) * row_stride + hk * d;
                __m256 acc = _mm256_mul_ps(_mm256_loadu_ps(qr), _mm256_loadu_ps(kr));
                for (int64_t c = 1; c < nc; c++) acc = _mm256_fmadd_ps(_mm256_loadu_ps(qr + c * 8), _mm256_loadu_ps(kr + c * 8), acc);
                a[jj] = acc;
            }
            _mm256_storeu_ps(s + r * n + j, _mm256_mul_ps(hsum8x8(a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7]),
                                                          _mm256_set1_ps(scale)));
        }
    }
    for (; j < n; j++) {
        const float* kr = k + j * row_stride + hk * d;
        for (int64_t r = 0; r < g; r++) {
            const float* qr = q + (hk * g + r) * d;
            __m256 acc = _mm256_mul_ps(_mm256_loadu_ps(qr), _mm256_loadu_ps(kr));
            for (int64_t c = 1; c < nc; c++) acc = _mm256_fmadd_ps(_mm256_loadu_ps(qr + c * 8), _mm256_loadu_ps(kr + c * 8), acc);
            s[r * n + j] = hsum8(acc) * scale;
        }
    }
    float inv[16];
    for (int64_t r = 0; r < g; r++) {
        float* sr = s + r * n;
        float mx = -INFINITY;
        for (int64_t x = 0; x < n; x++) mx = sr[x] > mx ? sr[x] : mx;
        const __m256 vm = _mm256_set1_ps(mx);
        __m256 sum = _mm256_setzero_ps();
        float tail = 0.0f;
        int64_t x = 0;
        for (; x + 8 <= n; x += 8) {
            const __m256 p = exp_ps(_mm256_sub_ps(_mm256_loadu_ps(sr + x), vm));
            _mm256_storeu_ps(sr + x, p);
            sum = _mm256_add_ps(sum, p);
        }
        for (; x < n; x++) {
            sr[x] = expf(sr[x] - mx);
            tail += sr[x];
        }
        inv[r] = 1.0f / (hsum8(sum) + tail);
    }
    // up to 3 heads x 4 vectors of dims in registers, the value row's 4 vectors beside them
    for (int64_t r0 = 0; r0 < g; r0 += 3) {
        const int64_t rn = g - r0 < 3 ? g - r0 : 3;
        for (int64_t c0 = 0; c0 < nc; c0 += 4) {
            const int64_t cn = nc - c0 < 4 ? nc - c0 : 4;
            __m256 acc[3][4];
            for (int64_t r = 0; r < rn; r++)
                for (int64_t c = 0; c < cn; c++) acc[r][c] = _mm256_setzero_ps();
            for (int64_t jj = 0; jj < n; jj++) {
                const float* vr = v + jj * row_stride + hk * d + c0 * 8;
                __m256 vv[4];
                for (int64_t c = 0; c < cn; c++) vv[c] = _mm256_loadu_ps(vr + c * 8);
                for (int64_t r = 0; r < rn; r++) {
                    const __m256 pj = _mm256_broadcast_ss(s + (r0 + r) * n + jj);
                    for (int64_t c = 0; c < cn; c++) acc[r][c] = _mm256_fmadd_ps(pj, vv[c], acc[r][c]);
                }
            }
            for (int64_t r = 0; r < rn; r++) {
                float* dst = out + (hk * g + r0 + r) * d;
                for (int64_t c = 0; c < cn; c++)
                    _mm256_storeu_ps(dst + (c0 + c) * 8, _mm256_mul_ps(acc[r][c], _mm256_set1_ps(inv[r0 + r])));
            }
        }
    }
}

static void decode_dispatch(const float* q, const float* k, const float* v, int64_t n, int64_t h, int64_t hkv,
                            int64_t d, int64_t row_stride, float scale, int64_t hk, float* out, float* s) {
#define ITEM(D) decode_item(q, k, v, n, h, hkv, D, row_stride, scale, hk, out, s)
    switch (d) {
        case 32: ITEM(32); break;
        case 64: ITEM(64); break;
        case 96: ITEM(96); break;
        default: ITEM(128); break;
    }
#undef ITEM
}

// q [B, H, D] contiguous; sequence b's keys/values start at kptr[b]/vptr[b] (addresses), lens[b]
// rows of row_stride elements; out [B, H * D]. Work items are (sequence, KV head) pairs.
int rc_decode_f32(const float* q, const int64_t* kptr, const int64_t* vptr, const int64_t* lens, int64_t nseq,
                  int64_t h, int64_t hkv, int64_t d, int64_t row_stride, float scale, float* out, int nthreads) {
    if (d % 32 != 0 || d > 128 || hkv <= 0 || h % hkv != 0 || h / hkv > 16 || nseq <= 0) return -1;
    int64_t longest = 0;
    for (int64_t b = 0; b < nseq; b++) {
        if (lens[b] <= 0) return -1;
        longest = lens[b] > longest ? lens[b] : longest;
    }
    const int64_t g = h / hkv;
#pragma omp parallel num_threads(nthreads)
    {
        float* s = malloc(sizeof(float) * g * longest);
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < nseq * hkv; i++) {
            const int64_t b = i / hkv, hk = i % hkv;
            decode_dispatch(q + b * h * d, (const float*)(intptr_t)kptr[b], (const float*)(intptr_t)vptr[b], lens[b], h,
                            hkv, d, row_stride, scale, hk, out + b * h * d, s);
        }
        free(s);
    }
    return 0;
}

// RoPE, NeoX halves, of rows [layers][n][heads][dim] by per-token tables [n][dim] (the first half
// read): out1 = fma(-x2, s, r(x1 c)), out2 = fma(x1, s, r(x2 c)), torch's roundings (its mul, then
// its addcmul, which fuses the multiply-add: contraction is off so that nothing else fuses). One
// pass over x where torch's four strided passes ran several times slower.
__attribute__((optimize("fp-contract=off")))
int rc_rope_f32(const float* x, int64_t x_ls, int64_t x_rs, float* out, int64_t o_ls, int64_t o_rs,
                const float* cos, const float* sin, int64_t layers, int64_t n, int64_t heads, int64_t dim,
                int nthreads) {
    if (dim % 2 != 0 || layers <= 0 || n <= 0 || heads <= 0) return -1;
    const int64_t half = dim / 2;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t r = 0; r < layers * n; r++) {
        const int64_t layer = r / n, t = r % n;
        const float* c = cos + t * dim;
        const float* s = sin + t * dim;
        for (int64_t h = 0; h < heads; h++) {
            const float* xh = x + layer * x_ls + t * x_rs + h * dim;
            float* oh = out + layer * o_ls + t * o_rs + h * dim;
            for (int64_t i = 0; i < half; i++) {
                const float a = xh[i], b = xh[i + half];
                const float ac = a * c[i], bc = b * c[i];
                oh[i] = fmaf(-b, s[i], ac);
                oh[i + half] = fmaf(a, s[i], bc);
            }
        }
    }
    return 0;
}

// --- small-batch linear layers ------------------------------------------------------------------
// y = x W^T (+ res) for a few activation rows (a decode step's batch): the weights are read once
// and every row's dot products are formed from the same loads. Small-M GEMMs of the BLAS torch
// calls reached 7-17 GB/s here, where reading the weights once allows twice that or more.

// R weight rows x MP activation rows (R * MP == 8): their eight dot products over K, one vector
// (lane r * MP + m).
static inline __attribute__((always_inline)) __m256 linear_block_f32(const float* const* xr, const float* w,
                                                                      int64_t w_rs, int64_t kdim, const int R,
                                                                      const int MP) {
    __m256 acc[8];
    for (int i = 0; i < 8; i++) acc[i] = _mm256_setzero_ps();
    for (int64_t k = 0; k < kdim; k += 8) {
        __m256 xv[8];
#pragma GCC unroll 8
        for (int m = 0; m < MP; m++) xv[m] = _mm256_loadu_ps(xr[m] + k);
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) {
            const __m256 wv = _mm256_loadu_ps(w + r * w_rs + k);
#pragma GCC unroll 8
            for (int m = 0; m < MP; m++) acc[r * MP + m] = _mm256_fmadd_ps(wv, xv[m], acc[r * MP + m]);
        }
    }
    return hsum8x8(acc[0], acc[1], acc[2], acc[3], acc[4], acc[5], acc[6], acc[7]);
}

// One block of R output columns from n0 for activation rows xr[0..MP), stored (with `res` added)
// for the first `mrows` of them, the residual added as a vector.
static inline __attribute__((always_inline)) void linear_store_f32(
        const float* const* xr, const float* w, int64_t w_rs, const float* res, int64_t res_rs, float* y,
        int64_t y_rs, int64_t mrows, int64_t n0, int64_t kdim, const int R, const int MP) {
    __m256 sums = linear_block_f32(xr, w + n0 * w_rs, w_rs, kdim, R, MP);
    if (res) {
        float added[8];
        for (int r = 0; r < R; r++)
            for (int m = 0; m < MP; m++) added[r * MP + m] = m < mrows ? res[m * res_rs + n0 + r] : 0.0f;
        sums = _mm256_add_ps(sums, _mm256_loadu_ps(added));
    }
    float out[8];
    _mm256_storeu_ps(out, sums);
    for (int r = 0; r < R; r++)
        for (int64_t m = 0; m < mrows && m < MP; m++) y[m * y_rs + n0 + r] = out[r * MP + m];
}

// Returns 0, or -1 for a shape it does not take (more than 8 rows; K or N not a multiple of 8):
// the caller then uses torch. res may be NULL; res_rs 0 broadcasts one row (a bias). Five to
// eight rows run as two passes of four over each block of weight rows, the block still in L1 for
// the second. The block shape is chosen inside the parallel loop so each case is compiled with
// its constants.
int rc_linear_f32(const float* x, int64_t x_rs, const float* w, int64_t w_rs, const float* res, int64_t res_rs,
                  float* y, int64_t y_rs, int64_t mrows, int64_t n, int64_t kdim, int nthreads) {
    if (mrows < 1 || mrows > 8 || kdim <= 0 || kdim % 8 != 0 || n <= 0 || n % 8 != 0) return -1;
    const int mp = mrows == 1 ? 1 : mrows == 2 ? 2 : 4, rb = 8 / mp;
    const float* xr[8];
    for (int m = 0; m < 8; m++) xr[m] = x + (m < mrows ? m : mrows - 1) * x_rs;  // padded rows repeat the last
    const float* res_hi = res && res_rs ? res + 4 * res_rs : res;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t n0 = 0; n0 < n; n0 += rb) {
        switch (mp) {
            case 1: linear_store_f32(xr, w, w_rs, res, res_rs, y, y_rs, mrows, n0, kdim, 8, 1); break;
            case 2: linear_store_f32(xr, w, w_rs, res, res_rs, y, y_rs, mrows, n0, kdim, 4, 2); break;
            default:
                linear_store_f32(xr, w, w_rs, res, res_rs, y, y_rs, mrows < 4 ? mrows : 4, n0, kdim, 2, 4);
                if (mrows > 4)
                    linear_store_f32(xr + 4, w, w_rs, res_hi, res_rs, y + 4 * y_rs, y_rs, mrows - 4, n0, kdim, 2, 4);
                break;
        }
    }
    return 0;
}
