// Attention for bf16 KV on x86 CPUs with AVX512-BF16, built by kernels/cpu_native.py and called
// through ctypes (no Python or torch headers needed, so a plain gcc builds it).
//
// Why it exists: on these CPUs PyTorch's flash SDPA reaches about half the GEMMs' FLOP rate, and
// a masked call cannot skip the keys a query never sees. Here the scores and the weighted sum use
// VDPBF16PS (bf16 pairs, fp32 accumulation) on key/value blocks packed once per call, the softmax
// runs online in fp32 (as flash attention does; the probabilities are rounded to bf16 before the
// product with V, as PyTorch's CPU flash kernel does), and the causal-by-position mask is computed
// from the positions, so a query block reads only the keys up to its last position.
//
// Layouts (element strides; a head's D values are contiguous):
//   q   [Tq, H, D]  row stride q_rs      k, v [Tk, Hkv, D]  row strides k_rs, v_rs
//   out [Tq, H, D]  contiguous           key positions ascending (the caller checks)
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef uint16_t bf16;

#define BK 64  // keys per block: 4 vectors of 16 scores
#define BQ 32  // query tokens per work item (times the heads sharing one KV head)

static inline __m512 exp_ps(__m512 x) {
    // exp(x) = 2^n * e^r, |r| <= ln2/2, degree-6 polynomial (relative error ~2e-7)
    const __m512 hi = _mm512_set1_ps(88.3762626647949f), lo = _mm512_set1_ps(-88.3762626647949f);
    x = _mm512_min_ps(_mm512_max_ps(x, lo), hi);
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.3888889e-3f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3333333e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1666667e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666667e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

static inline __m512bh as_bh(__m512i v) { return (__m512bh)v; }

static inline int32_t pair_at(const bf16* p) {
    int32_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline bf16 to_bf16(float f) {  // round to nearest even, as torch does
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16)((u >> 16) | 0x40);  // NaN stays NaN
    u += 0x7fffu + ((u >> 16) & 1u);
    return (bf16)(u >> 16);
}

// K block b of one KV head as [D/2][BK][2]: 16 keys x one dim pair per vector (VNNI order), by
// gathering each pair from 16 key rows. V block b as [BK/2][D][2]: 16 dims x one key pair per
// vector, by interleaving two key rows. Keys past tk are zero.
static void pack_block(const bf16* k, int64_t k_rs, const bf16* v, int64_t v_rs, int64_t tk, int64_t hk,
                       int64_t d, int64_t b, bf16* kp, bf16* vp) {
    const int32_t* kbase = (const int32_t*)(const void*)(k + hk * d);
    for (int64_t j0 = 0; j0 < BK; j0 += 16) {
        const int64_t first = b * BK + j0;
        const __mmask16 live = first >= tk ? 0 : (tk - first >= 16 ? 0xffff : (__mmask16)((1u << (tk - first)) - 1u));
        const __m512i rows = _mm512_mullo_epi32(_mm512_add_epi32(_mm512_set1_epi32((int32_t)first),
                                                                 _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10,
                                                                                   11, 12, 13, 14, 15)),
                                                _mm512_set1_epi32((int32_t)(k_rs / 2)));
        for (int64_t p = 0; p < d / 2; p++) {
            __m512i pairs = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), live,
                                                        _mm512_add_epi32(rows, _mm512_set1_epi32((int32_t)p)),
                                                        kbase, 4);
            _mm512_storeu_si512(kp + (p * BK + j0) * 2, pairs);
        }
    }
    const __m512i lo = _mm512_setr_epi32(0x00200000, 0x00210001, 0x00220002, 0x00230003, 0x00240004, 0x00250005,
                                         0x00260006, 0x00270007, 0x00280008, 0x00290009, 0x002a000a, 0x002b000b,
                                         0x002c000c, 0x002d000d, 0x002e000e, 0x002f000f);
    const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
    for (int64_t j = 0; j < BK; j += 2) {
        const int64_t key = b * BK + j;
        for (int64_t x = 0; x < d; x += 32) {
            __m512i a = key < tk ? _mm512_loadu_si512(v + key * v_rs + hk * d + x) : _mm512_setzero_si512();
            __m512i c = key + 1 < tk ? _mm512_loadu_si512(v + (key + 1) * v_rs + hk * d + x) : _mm512_setzero_si512();
            _mm512_storeu_si512(vp + ((j / 2) * d + x) * 2, _mm512_permutex2var_epi16(a, lo, c));
            _mm512_storeu_si512(vp + ((j / 2) * d + x + 16) * 2, _mm512_permutex2var_epi16(a, hi, c));
        }
    }
}

// Inlined per head size (see prefill_dispatch) so the inner loops have constant trip counts and
// the accumulators stay in registers.
static inline __attribute__((always_inline)) void prefill_item(
        const bf16* q, int64_t q_rs, bf16* out, const int64_t* qpos, const int64_t* kpos, int64_t tq, int64_t tk,
        int64_t h, int64_t hkv, const int64_t d, float scale, const bf16* kpack, const bf16* vpack, int64_t hk,
        int64_t qb, float* o, float* s, bf16* pr, float* m, float* l) {
    const int64_t g = h / hkv, t0 = qb * BQ, nt = (tq - t0) < BQ ? (tq - t0) : BQ, rows = nt * g;
    const int64_t nblocks = (tk + BK - 1) / BK, nc = d / 16;
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
    const __m512 vscale = _mm512_set1_ps(scale);
    for (int64_t b = 0; b < bend; b++) {
        const bf16* kb = kpack + (hk * nblocks + b) * BK * d;
        const bf16* vb = vpack + (hk * nblocks + b) * BK * d;
        const int64_t last = (b + 1) * BK - 1;
        const int full = last < kend && kpos[last] <= qmin;  // every row sees every key of the block
        // scores: 4 rows at a time, 4 vectors of 16 keys each
        for (int64_t r0 = 0; r0 < rows; r0 += 4) {
            const int64_t rn = rows - r0 < 4 ? rows - r0 : 4;
            const bf16* qr[4];
            for (int64_t i = 0; i < 4; i++) {
                int64_t r = r0 + (i < rn ? i : 0), t = r / g, head = hk * g + r % g;
                qr[i] = q + (t0 + t) * q_rs + head * d;
            }
            __m512 acc[4][4];
            for (int i = 0; i < 4; i++)
                for (int c = 0; c < 4; c++) acc[i][c] = _mm512_setzero_ps();
            for (int64_t p = 0; p < d / 2; p++) {
                __m512i kv0 = _mm512_loadu_si512(kb + (p * BK) * 2);
                __m512i kv1 = _mm512_loadu_si512(kb + (p * BK + 16) * 2);
                __m512i kv2 = _mm512_loadu_si512(kb + (p * BK + 32) * 2);
                __m512i kv3 = _mm512_loadu_si512(kb + (p * BK + 48) * 2);
                for (int i = 0; i < 4; i++) {
                    __m512i qb2 = _mm512_set1_epi32(pair_at(qr[i] + 2 * p));
                    acc[i][0] = _mm512_dpbf16_ps(acc[i][0], as_bh(kv0), as_bh(qb2));
                    acc[i][1] = _mm512_dpbf16_ps(acc[i][1], as_bh(kv1), as_bh(qb2));
                    acc[i][2] = _mm512_dpbf16_ps(acc[i][2], as_bh(kv2), as_bh(qb2));
                    acc[i][3] = _mm512_dpbf16_ps(acc[i][3], as_bh(kv3), as_bh(qb2));
                }
            }
            for (int64_t i = 0; i < rn; i++)
                for (int c = 0; c < 4; c++) _mm512_storeu_ps(s + (r0 + i) * BK + c * 16, _mm512_mul_ps(acc[i][c], vscale));
        }
        // online softmax per row; probabilities to bf16
        for (int64_t r = 0; r < rows; r++) {
            float* sr = s + r * BK;
            __mmask16 valid[4];
            const int64_t qp = qpos[t0 + r / g];
            for (int c = 0; c < 4; c++) {
                if (full) { valid[c] = 0xffff; continue; }
                __mmask16 vm = 0;
                for (int j = 0; j < 16; j++) {
                    int64_t key = b * BK + c * 16 + j;
                    if (key < tk && kpos[key] <= qp) vm |= (__mmask16)(1u << j);
                }
                valid[c] = vm;
            }
            __m512 mx = _mm512_set1_ps(-INFINITY);
            for (int c = 0; c < 4; c++) mx = _mm512_mask_max_ps(mx, valid[c], mx, _mm512_loadu_ps(sr + c * 16));
            float bmax = _mm512_reduce_max_ps(mx);
            bf16* pb = pr + r * BK;
            if (bmax == -INFINITY) {  // this row sees no key of the block
                memset(pb, 0, sizeof(bf16) * BK);
                continue;
            }
            float mnew = m[r] > bmax ? m[r] : bmax;
            float corr = m[r] == -INFINITY ? 0.0f : expf(m[r] - mnew);
            __m512 vm = _mm512_set1_ps(mnew), sum = _mm512_setzero_ps();
            for (int c = 0; c < 4; c += 2) {
                __m512 p0 = _mm512_maskz_mov_ps(valid[c], exp_ps(_mm512_sub_ps(_mm512_loadu_ps(sr + c * 16), vm)));
                __m512 p1 = _mm512_maskz_mov_ps(valid[c + 1],
                                                exp_ps(_mm512_sub_ps(_mm512_loadu_ps(sr + (c + 1) * 16), vm)));
                __m512bh packed = _mm512_cvtne2ps_pbh(p1, p0);  // p0 in the low half
                _mm512_storeu_si512(pb + c * 16, (__m512i)packed);
                sum = _mm512_add_ps(sum, _mm512_add_ps(p0, p1));  // unrounded, as PyTorch's flash kernel sums
            }
            l[r] = l[r] * corr + _mm512_reduce_add_ps(sum);
            m[r] = mnew;
            if (corr != 1.0f) {
                __m512 vc = _mm512_set1_ps(corr);
                for (int64_t c = 0; c < nc; c++)
                    _mm512_storeu_ps(o + r * d + c * 16, _mm512_mul_ps(_mm512_loadu_ps(o + r * d + c * 16), vc));
            }
        }
        // o += p @ v: RB rows at a time, nc vectors of 16 dims each (nc <= 8)
        const int64_t rb = nc <= 4 ? 4 : 2;
        for (int64_t r0 = 0; r0 < rows; r0 += rb) {
            const int64_t rn = rows - r0 < rb ? rows - r0 : rb;
            __m512 acc[4][8];
            for (int64_t i = 0; i < rn; i++)
                for (int64_t c = 0; c < nc; c++) acc[i][c] = _mm512_loadu_ps(o + (r0 + i) * d + c * 16);
            for (int64_t kp = 0; kp < BK / 2; kp++) {
                const bf16* vrow = vb + kp * d * 2;
                __m512i vv[8];
                for (int64_t c = 0; c < nc; c++) vv[c] = _mm512_loadu_si512(vrow + c * 32);
                for (int64_t i = 0; i < rn; i++) {
                    __m512i pp = _mm512_set1_epi32(pair_at(pr + (r0 + i) * BK + 2 * kp));
                    for (int64_t c = 0; c < nc; c++) acc[i][c] = _mm512_dpbf16_ps(acc[i][c], as_bh(vv[c]), as_bh(pp));
                }
            }
            for (int64_t i = 0; i < rn; i++)
                for (int64_t c = 0; c < nc; c++) _mm512_storeu_ps(o + (r0 + i) * d + c * 16, acc[i][c]);
        }
    }
    for (int64_t r = 0; r < rows; r++) {
        int64_t t = r / g, head = hk * g + r % g;
        bf16* dst = out + ((t0 + t) * h + head) * d;
        float inv = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
        for (int64_t x = 0; x < d; x++) dst[x] = to_bf16(o[r * d + x] * inv);
    }
}

static void prefill_dispatch(const bf16* q, int64_t q_rs, bf16* out, const int64_t* qpos, const int64_t* kpos,
                             int64_t tq, int64_t tk, int64_t h, int64_t hkv, int64_t d, float scale,
                             const bf16* kpack, const bf16* vpack, int64_t hk, int64_t qb, float* o, float* s,
                             bf16* pr, float* m, float* l) {
#define ITEM(D) prefill_item(q, q_rs, out, qpos, kpos, tq, tk, h, hkv, D, scale, kpack, vpack, hk, qb, o, s, pr, m, l)
    switch (d) {
        case 32: ITEM(32); break;
        case 64: ITEM(64); break;
        case 96: ITEM(96); break;
        default: ITEM(128); break;
    }
#undef ITEM
}

// Returns 0, or a negative code for an unsupported shape (the caller then uses torch).
int rc_prefill_bf16(const bf16* q, int64_t q_rs, const bf16* k, int64_t k_rs, const bf16* v, int64_t v_rs,
                    bf16* out, const int64_t* qpos, const int64_t* kpos, int64_t tq, int64_t tk, int64_t h,
                    int64_t hkv, int64_t d, float scale, int nthreads) {
    if (d % 32 != 0 || d > 128 || hkv <= 0 || h % hkv != 0 || tq <= 0 || tk <= 0) return -1;
    const int64_t nblocks = (tk + BK - 1) / BK, g = h / hkv, nqb = (tq + BQ - 1) / BQ;
    bf16* kpack = aligned_alloc(64, sizeof(bf16) * hkv * nblocks * BK * d);
    bf16* vpack = aligned_alloc(64, sizeof(bf16) * hkv * nblocks * BK * d);
    if (!kpack || !vpack) { free(kpack); free(vpack); return -2; }
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t i = 0; i < hkv * nblocks; i++)
        pack_block(k, k_rs, v, v_rs, tk, i / nblocks, d, i % nblocks, kpack + i * BK * d, vpack + i * BK * d);
    // later query blocks read more keys: hand them out first, then the short ones fill in
#pragma omp parallel num_threads(nthreads)
    {
        const int64_t rows = BQ * g;
        float* o = aligned_alloc(64, sizeof(float) * rows * d);
        float* s = aligned_alloc(64, sizeof(float) * rows * BK);
        bf16* pr = aligned_alloc(64, sizeof(bf16) * rows * BK);
        float* m = malloc(sizeof(float) * rows);
        float* l = malloc(sizeof(float) * rows);
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < hkv * nqb; i++) {
            int64_t qb = nqb - 1 - i / hkv, hk = i % hkv;
            prefill_dispatch(q, q_rs, out, qpos, kpos, tq, tk, h, hkv, d, scale, kpack, vpack, hk, qb, o, s, pr, m, l);
        }
        free(o); free(s); free(pr); free(m); free(l);
    }
    free(kpack);
    free(vpack);
    return 0;
}

// Four vectors to one whose 128-bit block L holds, in order, the sums of block L of each.
static inline __m512 sum4_blocks(__m512 a, __m512 b, __m512 c, __m512 d) {
    __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
    __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
    return _mm512_add_ps(_mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(3, 2, 3, 2)));
}

// Sixteen vectors to the vector of their sixteen horizontal sums (lane i: the sum of a[i]).
static inline __m512 hsum16x16(const __m512* a) {
    __m512 r0 = sum4_blocks(a[0], a[1], a[2], a[3]), r1 = sum4_blocks(a[4], a[5], a[6], a[7]);
    __m512 r2 = sum4_blocks(a[8], a[9], a[10], a[11]), r3 = sum4_blocks(a[12], a[13], a[14], a[15]);
    __m512 y01 = _mm512_add_ps(_mm512_shuffle_f32x4(r0, r1, _MM_SHUFFLE(1, 0, 1, 0)),
                               _mm512_shuffle_f32x4(r0, r1, _MM_SHUFFLE(3, 2, 3, 2)));
    __m512 y23 = _mm512_add_ps(_mm512_shuffle_f32x4(r2, r3, _MM_SHUFFLE(1, 0, 1, 0)),
                               _mm512_shuffle_f32x4(r2, r3, _MM_SHUFFLE(3, 2, 3, 2)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(y01, y23, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(y01, y23, _MM_SHUFFLE(3, 1, 3, 1)));
}

// One (sequence, KV head) pair of a decode step; inlined per head size like prefill_item. Every
// query head of the KV head is served from one pass over the keys (a block of 16 keys stays in
// L1 for the other heads; its 16 scores are summed together) and one over the values (each value
// row feeds up to four heads' accumulators).
static inline __attribute__((always_inline)) void decode_pv(const bf16* vb, int64_t n, int64_t kv_rs,
                                                            const float* sc, int64_t np, bf16* dst, int64_t d,
                                                            int64_t c0, const int XN) {
    __m512 acc[4][2];
    for (int x = 0; x < XN; x++) acc[x][0] = acc[x][1] = _mm512_setzero_ps();
    for (int64_t j = 0; j < n; j++) {
        const bf16* vr = vb + j * kv_rs + c0 * 16;
        const __m512 v0 = _mm512_cvtpbh_ps((__m256bh)_mm256_loadu_si256((const __m256i*)vr));
        const __m512 v1 = _mm512_cvtpbh_ps((__m256bh)_mm256_loadu_si256((const __m256i*)(vr + 16)));
        for (int x = 0; x < XN; x++) {
            const __m512 p = _mm512_set1_ps(sc[x * np + j]);
            acc[x][0] = _mm512_fmadd_ps(p, v0, acc[x][0]);
            acc[x][1] = _mm512_fmadd_ps(p, v1, acc[x][1]);
        }
    }
    for (int x = 0; x < XN; x++) {
        float tmp[32];
        _mm512_storeu_ps(tmp, acc[x][0]);
        _mm512_storeu_ps(tmp + 16, acc[x][1]);
        for (int y = 0; y < 32; y++) dst[x * d + c0 * 16 + y] = to_bf16(tmp[y]);
    }
}

static inline __attribute__((always_inline)) void decode_item(
        const bf16* q, const int64_t* kptr, const int64_t* vptr, const int64_t* lens, int64_t h, int64_t hkv,
        const int64_t d, int64_t kv_rs, float scale, bf16* out, float* sc, int64_t i) {
    const int64_t g = h / hkv, nc = d / 16;
    const int64_t b = i / hkv, hk = i % hkv, n = lens[b], np = (n + 15) / 16 * 16;
    const bf16* kb = (const bf16*)(intptr_t)kptr[b] + hk * d;
    const bf16* vb = (const bf16*)(intptr_t)vptr[b] + hk * d;
    const bf16* qb = q + (b * h + hk * g) * d;
    const __m512 vscale = _mm512_set1_ps(scale);
    int64_t j = 0;
    for (; j + 16 <= n; j += 16) {
        for (int64_t x = 0; x < g; x++) {
            __m512 acc[16];
#pragma GCC unroll 16
            for (int jj = 0; jj < 16; jj++) {
                const bf16* kr = kb + (j + jj) * kv_rs;
                __m512 a = _mm512_setzero_ps();
                for (int64_t c = 0; c < d; c += 32)
                    a = _mm512_dpbf16_ps(a, as_bh(_mm512_loadu_si512(kr + c)), as_bh(_mm512_loadu_si512(qb + x * d + c)));
                acc[jj] = a;
            }
            _mm512_storeu_ps(sc + x * np + j, _mm512_mul_ps(hsum16x16(acc), vscale));
        }
    }
    for (; j < n; j++) {
        const bf16* kr = kb + j * kv_rs;
        for (int64_t x = 0; x < g; x++) {
            __m512 acc = _mm512_setzero_ps();
            for (int64_t c = 0; c < d; c += 32)
                acc = _mm512_dpbf16_ps(acc, as_bh(_mm512_loadu_si512(kr + c)), as_bh(_mm512_loadu_si512(qb + x * d + c)));
            sc[x * np + j] = _mm512_reduce_add_ps(acc) * scale;
        }
    }
    for (int64_t x = 0; x < g; x++) {
        float* sr = sc + x * np;
        for (int64_t t = n; t < np; t++) sr[t] = -INFINITY;
        __m512 mx = _mm512_set1_ps(-INFINITY);
        for (int64_t t = 0; t < np; t += 16) mx = _mm512_max_ps(mx, _mm512_loadu_ps(sr + t));
        __m512 vm = _mm512_set1_ps(_mm512_reduce_max_ps(mx)), sum = _mm512_setzero_ps();
        for (int64_t t = 0; t < np; t += 16) {
            __m512 e = exp_ps(_mm512_sub_ps(_mm512_loadu_ps(sr + t), vm));
            e = _mm512_maskz_mov_ps(t + 16 <= n ? 0xffff : (__mmask16)((1u << (n - t)) - 1u), e);
            _mm512_storeu_ps(sr + t, e);
            sum = _mm512_add_ps(sum, e);
        }
        const float inv = 1.0f / _mm512_reduce_add_ps(sum);
        for (int64_t t = 0; t < n; t++) sr[t] *= inv;
    }
    bf16* dst = out + (b * h + hk * g) * d;
    for (int64_t x0 = 0; x0 < g; x0 += 4) {
        const int64_t xn = g - x0 < 4 ? g - x0 : 4;
        const float* sx = sc + x0 * np;
        for (int64_t c0 = 0; c0 < nc; c0 += 2) {
            switch (xn) {
                case 1: decode_pv(vb, n, kv_rs, sx, np, dst + x0 * d, d, c0, 1); break;
                case 2: decode_pv(vb, n, kv_rs, sx, np, dst + x0 * d, d, c0, 2); break;
                case 3: decode_pv(vb, n, kv_rs, sx, np, dst + x0 * d, d, c0, 3); break;
                default: decode_pv(vb, n, kv_rs, sx, np, dst + x0 * d, d, c0, 4); break;
            }
        }
    }
}

static void decode_dispatch(const bf16* q, const int64_t* kptr, const int64_t* vptr, const int64_t* lens, int64_t h,
                            int64_t hkv, int64_t d, int64_t kv_rs, float scale, bf16* out, float* sc, int64_t i) {
#define ITEM(D) decode_item(q, kptr, vptr, lens, h, hkv, D, kv_rs, scale, out, sc, i)
    switch (d) {
        case 32: ITEM(32); break;
        case 64: ITEM(64); break;
        case 96: ITEM(96); break;
        default: ITEM(128); break;
    }
#undef ITEM
}

// One decode step for B sequences: query b [H, D] (q row b, contiguous) over its own keys and
// values (kptr[b], vptr[b]: [len[b], Hkv, D] with row stride kv_rs), every key visible.
// Scores and probabilities stay fp32; keys and values are read once per KV head.
int rc_decode_bf16(const bf16* q, const int64_t* kptr, const int64_t* vptr, const int64_t* lens, int64_t nseq,
                   int64_t h, int64_t hkv, int64_t d, int64_t kv_rs, float scale, bf16* out, int nthreads) {
    if (d % 32 != 0 || d > 128 || hkv <= 0 || h % hkv != 0 || h / hkv > 16) return -1;
    const int64_t g = h / hkv;
    int64_t maxlen = 0;
    for (int64_t b = 0; b < nseq; b++) maxlen = lens[b] > maxlen ? lens[b] : maxlen;
#pragma omp parallel num_threads(nthreads)
    {
        float* sc = aligned_alloc(64, sizeof(float) * g * ((maxlen + 15) / 16 * 16));
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < nseq * hkv; i++) {
            decode_dispatch(q, kptr, vptr, lens, h, hkv, d, kv_rs, scale, out, sc, i);
        }
        free(sc);
    }
    return 0;
}

static inline float from_bf16(bf16 v) {
    uint32_t u = (uint32_t)v << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline bf16 to_bf16_lanes(float f) {  // to_bf16 without a branch, so the loop vectorises
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    return (bf16)((u & 0x7fffffffu) > 0x7f800000u ? ((u >> 16) | 0x40) : rounded);
}

// RoPE, NeoX halves, of rows [layers][n][heads][dim] by per-token tables [n][dim] (bf16, the
// first half read): out1 = r(r(x1 c) - x2 s), out2 = r(r(x2 c) + x1 s), torch's roundings (a
// product of two bf16 is exact in fp32, so each sum rounds once, then to bf16). One pass over x
// where torch's four strided passes ran several times slower.
int rc_rope_bf16(const bf16* x, int64_t x_ls, int64_t x_rs, bf16* out, int64_t o_ls, int64_t o_rs,
                 const bf16* cos, const bf16* sin, int64_t layers, int64_t n, int64_t heads, int64_t dim,
                 int nthreads) {
    if (dim % 2 != 0 || layers <= 0 || n <= 0 || heads <= 0) return -1;
    const int64_t half = dim / 2;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t r = 0; r < layers * n; r++) {
        const int64_t layer = r / n, t = r % n;
        const bf16* c = cos + t * dim;
        const bf16* s = sin + t * dim;
        for (int64_t h = 0; h < heads; h++) {
            const bf16* xh = x + layer * x_ls + t * x_rs + h * dim;
            bf16* oh = out + layer * o_ls + t * o_rs + h * dim;
            for (int64_t i = 0; i < half; i++) {
                const float a = from_bf16(xh[i]), b = from_bf16(xh[i + half]);
                const float cf = from_bf16(c[i]), sf = from_bf16(s[i]);
                const float ac = from_bf16(to_bf16_lanes(a * cf)), bc = from_bf16(to_bf16_lanes(b * cf));
                oh[i] = to_bf16_lanes(ac - b * sf);
                oh[i + half] = to_bf16_lanes(bc + a * sf);
            }
        }
    }
    return 0;
}

// --- small-batch linear layers ------------------------------------------------------------------
// y = x W^T (+ res) for a few activation rows (a decode step's batch), sums in fp32 and rounded
// to bf16 once: the weights are read once and every row's dot products are formed from the same
// loads. Small-M GEMMs of the BLAS torch calls reached 7-23 GB/s here, where reading the weights
// once allows more.

// R weight rows x MP activation rows (R * MP == 16): their sixteen dot products over K (lane
// r * MP + m), 32 bf16 pairs per instruction.
static inline __attribute__((always_inline)) __m512 linear_block_bf16(const bf16* const* xr, const bf16* w,
                                                                       int64_t w_rs, int64_t kdim, const int R,
                                                                       const int MP) {
    __m512 acc[16];
    for (int i = 0; i < 16; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t k = 0; k < kdim; k += 32) {
        __m512i xv[16];
#pragma GCC unroll 16
        for (int m = 0; m < MP; m++) xv[m] = _mm512_loadu_si512(xr[m] + k);
#pragma GCC unroll 16
        for (int r = 0; r < R; r++) {
            const __m512i wv = _mm512_loadu_si512(w + r * w_rs + k);
#pragma GCC unroll 16
            for (int m = 0; m < MP; m++) acc[r * MP + m] = _mm512_dpbf16_ps(acc[r * MP + m], as_bh(wv), as_bh(xv[m]));
        }
    }
    return hsum16x16(acc);
}

// One block of R output columns from n0 for activation rows xr[0..MP), stored (with `res` added)
// for the first `mrows` of them: the sums, residual added and rounding done as vectors.
static inline __attribute__((always_inline)) void linear_store_bf16(
        const bf16* const* xr, const bf16* w, int64_t w_rs, const bf16* res, int64_t res_rs, bf16* y, int64_t y_rs,
        int64_t mrows, int64_t n0, int64_t kdim, const int R, const int MP) {
    __m512 sums = linear_block_bf16(xr, w + n0 * w_rs, w_rs, kdim, R, MP);
    if (res) {
        uint32_t added[16];
        for (int r = 0; r < R; r++)
            for (int m = 0; m < MP; m++)
                added[r * MP + m] = m < mrows ? (uint32_t)res[m * res_rs + n0 + r] << 16 : 0u;
        sums = _mm512_add_ps(sums, _mm512_castsi512_ps(_mm512_loadu_si512(added)));
    }
    bf16 rounded[16];
    _mm256_storeu_si256((__m256i*)rounded, (__m256i)_mm512_cvtneps_pbh(sums));
    for (int r = 0; r < R; r++)
        for (int64_t m = 0; m < mrows && m < MP; m++) y[m * y_rs + n0 + r] = rounded[r * MP + m];
}

// Returns 0, or -1 for a shape it does not take (more than 8 rows, K not a multiple of 32, N not
// a multiple of 16): the caller then uses torch. res may be NULL; res_rs 0 broadcasts one row (a
// bias). Five to eight rows run as two passes of four over each block of weight rows, the block
// still in L1 for the second. The block shape is chosen inside the parallel loop so each case is
// compiled with its constants (an outlined OpenMP body would otherwise see them as variables).
int rc_linear_bf16(const bf16* x, int64_t x_rs, const bf16* w, int64_t w_rs, const bf16* res, int64_t res_rs,
                   bf16* y, int64_t y_rs, int64_t mrows, int64_t n, int64_t kdim, int nthreads) {
    if (mrows < 1 || mrows > 8 || kdim <= 0 || kdim % 32 != 0 || n <= 0 || n % 16 != 0) return -1;
    const int mp = mrows == 1 ? 1 : mrows == 2 ? 2 : 4, rb = 16 / mp;
    const bf16* xr[8];
    for (int m = 0; m < 8; m++) xr[m] = x + (m < mrows ? m : mrows - 1) * x_rs;  // padded rows repeat the last
    const bf16* res_hi = res && res_rs ? res + 4 * res_rs : res;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t n0 = 0; n0 < n; n0 += rb) {
        switch (mp) {
            case 1: linear_store_bf16(xr, w, w_rs, res, res_rs, y, y_rs, mrows, n0, kdim, 16, 1); break;
            case 2: linear_store_bf16(xr, w, w_rs, res, res_rs, y, y_rs, mrows, n0, kdim, 8, 2); break;
            default:
                linear_store_bf16(xr, w, w_rs, res, res_rs, y, y_rs, mrows < 4 ? mrows : 4, n0, kdim, 4, 4);
                if (mrows > 4)
                    linear_store_bf16(xr + 4, w, w_rs, res_hi, res_rs, y + 4 * y_rs, y_rs, mrows - 4, n0, kdim, 4, 4);
                break;
        }
    }
    return 0;
}
