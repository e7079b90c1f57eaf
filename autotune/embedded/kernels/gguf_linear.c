/* y[M, N] = norm(x)[M, K] @ W.T for W in a GGUF block format, read as the file stores it.
 *
 * As llama.cpp does (ggml's vec_dot_q4_1_q8_1 and friends), each row of x is first quantised to 8-bit
 * blocks of 32 (int8 q, float scale d, and d * sum(q)); a weight block then meets an activation block as
 * an integer dot product (one VNNI instruction, or maddubs + madd, per 32 pairs) scaled once in float.
 * That is 4x less arithmetic than dequantising to float32 and 4-7x fewer bytes read. The optional
 * RMSNorm (norm != NULL) is applied in the same pass over x, so the norm costs no extra op.
 *
 * Every format is decoded into groups of 32 small integers w with a scale (one per 16 weights: Q6_K has
 * two scales a group) and a min, so that the 32 weights are scale * w - min:
 *   Q4_0: d * (q - 8)       Q4_1: d * q + m       Q8_0: d * q                      (blocks of 32)
 *   Q4_K, Q5_K: (d * sc_j) * q - (dmin * m_j), 6-bit sc_j, m_j per 32          (super-blocks of 256)
 *   Q6_K: (d * sc_j) * (q - 32), int8 sc_j per 16                             (super-block of 256)
 * Layouts follow gguf-py's dequantize (tests check the two agree on real blocks).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { Q4_0 = 2, Q4_1 = 3, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };  /* GGML type numbers */

/* -- 32 bytes at a time: AVX2 (with VNNI where the compiler targets it), else plain C ---------------- */
#ifdef __AVX2__
#include <immintrin.h>
typedef __m256i bytes32;
typedef __m256 floats8;
static inline bytes32 load32(const uint8_t *p) { return _mm256_loadu_si256((const __m256i *)p); }
/* (v >> shift) & mask per byte; mask must drop the bits a 16-bit shift brings in from the next byte */
static inline bytes32 bits(bytes32 v, int shift, uint8_t mask) {
    return _mm256_and_si256(_mm256_srli_epi16(v, shift), _mm256_set1_epi8((char)mask));
}
static inline bytes32 or_high(bytes32 low, bytes32 high) { return _mm256_or_si256(low, _mm256_slli_epi16(high, 4)); }
static inline bytes32 minus(bytes32 v, int8_t c) { return _mm256_sub_epi8(v, _mm256_set1_epi8(c)); }
/* 16 bytes of nibbles: the low ones are weights 0..15, the high ones 16..31 (Q4_0, Q4_1) */
static inline bytes32 nibbles16(const uint8_t *q) {
    const __m128i v = _mm_loadu_si128((const __m128i *)q);
    return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(v, 4), v), _mm256_set1_epi8(15));
}
/* Dot products of unsigned w (< 128) with signed x, in 8 lanes of 4 pairs (lanes 0-3: weights 0..15). */
static inline __m256i dot_unsigned(bytes32 w, bytes32 x) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), w, x);
#elif defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), w, x);
#else  /* pairs of products fit int16: |w| <= 64, |x| <= 127 */
    return _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1));
#endif
}
/* Signed w: |w| against x with w's sign moved onto x (w = -128 reads as 128 unsigned, still exact). */
static inline __m256i dot_signed(bytes32 w, bytes32 x) {
    return dot_unsigned(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));
}
/* acc + sums * (lo for lanes 0-3, hi for 4-7); lo == hi is a plain broadcast */
static inline floats8 fma_scaled(floats8 acc, __m256i sums, float lo, float hi, int one_scale) {
    const __m256 scale = one_scale ? _mm256_set1_ps(lo) : _mm256_setr_ps(lo, lo, lo, lo, hi, hi, hi, hi);
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), scale, acc);
}
static inline floats8 zero8(void) { return _mm256_setzero_ps(); }
static inline float sum8(floats8 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
#else
typedef struct { uint8_t b[32]; } bytes32;
typedef struct { int32_t i[8]; } ints8;
typedef struct { float f[8]; } floats8;
static inline bytes32 load32(const uint8_t *p) { bytes32 v; memcpy(v.b, p, 32); return v; }
static inline bytes32 bits(bytes32 v, int shift, uint8_t mask) {
    for (int j = 0; j < 32; j++) v.b[j] = (uint8_t)(v.b[j] >> shift) & mask;
    return v;
}
static inline bytes32 or_high(bytes32 low, bytes32 high) {
    for (int j = 0; j < 32; j++) low.b[j] |= (uint8_t)(high.b[j] << 4);
    return low;
}
static inline bytes32 minus(bytes32 v, int8_t c) {
    for (int j = 0; j < 32; j++) v.b[j] = (uint8_t)(v.b[j] - c);
    return v;
}
static inline ints8 dot_lanes(bytes32 w, bytes32 x, int is_signed) {
    ints8 s = {{0}};
    for (int j = 0; j < 32; j++)
        s.i[j / 4] += (is_signed ? (int32_t)(int8_t)w.b[j] : (int32_t)w.b[j]) * (int32_t)(int8_t)x.b[j];
    return s;
}
static inline ints8 dot_unsigned(bytes32 w, bytes32 x) { return dot_lanes(w, x, 0); }
static inline ints8 dot_signed(bytes32 w, bytes32 x) { return dot_lanes(w, x, 1); }
static inline floats8 fma_scaled(floats8 acc, ints8 sums, float lo, float hi, int one_scale) {
    (void)one_scale;
    for (int j = 0; j < 8; j++) acc.f[j] += (float)sums.i[j] * (j < 4 ? lo : hi);
    return acc;
}
static inline floats8 zero8(void) { floats8 v = {{0}}; return v; }
static inline float sum8(floats8 v) {
    float s = 0.f;
    for (int j = 0; j < 8; j++) s += v.f[j];
    return s;
}
static inline bytes32 nibbles16(const uint8_t *q) {
    bytes32 v;
    for (int j = 0; j < 16; j++) v.b[j] = q[j] & 15, v.b[16 + j] = q[j] >> 4;
    return v;
}
#endif

static inline float half(const uint8_t *p) {  /* IEEE binary16 -> float, little-endian */
    const uint32_t h = (uint32_t)p[0] | (uint32_t)p[1] << 8;
#ifdef __F16C__
    return _cvtsh_ss((unsigned short)h);
#endif
    const uint32_t sign = (h & 0x8000u) << 16, exponent = h >> 10 & 31, mantissa = h & 1023;
    if (exponent == 0) return (sign ? -1.f : 1.f) * ldexpf((float)mantissa, -24);  /* zero, subnormal */
    const uint32_t bits32 = sign | (exponent == 31 ? 0x7f800000u | mantissa << 13 : (exponent + 112) << 23 | mantissa << 13);
    float f;
    memcpy(&f, &bits32, 4);
    return f;
}

typedef struct {
    bytes32 w;
    float lo, hi, min;  /* weights 0..15 are lo * w - min, 16..31 hi * w - min */
} Group;

static inline int block_weights(int type) { return type == Q4_K || type == Q5_K || type == Q6_K ? 256 : 32; }
static inline int block_bytes(int type) {
    switch (type) {
    case Q4_0: return 18;
    case Q4_1: return 20;
    case Q8_0: return 34;
    case Q4_K: return 144;
    case Q5_K: return 176;
    default: return 210;  /* Q6_K */
    }
}
static inline int is_signed(int type) { return type == Q4_0 || type == Q8_0 || type == Q6_K; }
static inline int has_min(int type) { return type == Q4_1 || type == Q4_K || type == Q5_K; }

/* The K-quants' 6-bit scale and min of group j (ggml's get_scale_min_k4). */
static inline void scale_min_k4(int j, const uint8_t *s, int *sc, int *m) {
    if (j < 4) {
        *sc = s[j] & 63;
        *m = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 15) | (s[j - 4] >> 6) << 4;
        *m = (s[j + 4] >> 4) | (s[j] >> 6) << 4;
    }
}

/* One block (32 weights) or super-block (256) as 1 or 8 groups. */
static inline void decode(int type, const uint8_t *b, Group *g) {
    if (type == Q4_0 || type == Q4_1 || type == Q8_0) {
        const float d = half(b);
        g->lo = g->hi = d;
        g->min = type == Q4_1 ? -half(b + 2) : 0.f;
        g->w = type == Q8_0 ? load32(b + 2) : type == Q4_1 ? nibbles16(b + 4) : minus(nibbles16(b + 2), 8);
        return;
    }
    if (type == Q6_K) {  /* ql[128], qh[64], int8 scales[16], d */
        const uint8_t *ql = b, *qh = b + 128;
        const int8_t *scales = (const int8_t *)(b + 192);
        const float d = half(b + 208);
        for (int j = 0; j < 8; j++) {
            const int half_ = j / 4, t = j % 4;  /* 128-weight half, and which quarter of it */
            const bytes32 low = bits(load32(ql + 64 * half_ + 32 * (t % 2)), 4 * (t / 2), 15);
            g[j].w = minus(or_high(low, bits(load32(qh + 32 * half_), 2 * t, 3)), 32);
            g[j].lo = d * (float)scales[2 * j];
            g[j].hi = d * (float)scales[2 * j + 1];
            g[j].min = 0.f;
        }
        return;
    }
    /* Q4_K: d, dmin, scales[12], qs[128]; Q5_K: the same with qh[32] (each weight's 5th bit) before qs */
    const float d = half(b), dmin = half(b + 2);
    const uint8_t *scales = b + 4, *qh = b + 16, *qs = type == Q5_K ? b + 48 : b + 16;
    for (int j = 0; j < 8; j++) {
        int sc, m;
        scale_min_k4(j, scales, &sc, &m);
        bytes32 w = bits(load32(qs + 32 * (j / 2)), 4 * (j % 2), 15);
        if (type == Q5_K) w = or_high(w, bits(load32(qh), j, 1));
        g[j].w = w;
        g[j].lo = g[j].hi = d * (float)sc;
        g[j].min = dmin * (float)m;
    }
}

/* x's rows as 8-bit blocks of 32: q, scale d, and d * sum(q) (what a weight block's min multiplies). */
typedef struct {
    int8_t *q;
    float *d, *s;
} Acts;

static void quantize_row(const float *x, int64_t K, const float *norm, float eps, int gated, int8_t *q, float *d,
                         float *s) {
    float inv_rms = 1.f;
    if (norm) {
        float squares = 0.f;
        for (int64_t k = 0; k < K; k++) squares += x[k] * x[k];
        inv_rms = 1.f / sqrtf(squares / (float)K + eps);
    }
    for (int64_t b = 0; b < K / 32; b++) {
        float v[32], amax = 0.f;
        for (int j = 0; j < 32; j++) {
            const float xj = x[32 * b + j];
            v[j] = gated ? xj / (1.f + expf(-xj)) * x[K + 32 * b + j] : norm ? xj * inv_rms * norm[32 * b + j] : xj;
            amax = fmaxf(amax, fabsf(v[j]));
        }
        const float scale = amax / 127.f, inv = scale ? 1.f / scale : 0.f;
        int sum = 0;
        for (int j = 0; j < 32; j++) {
            q[32 * b + j] = (int8_t)nearbyintf(v[j] * inv);
            sum += q[32 * b + j];
        }
        d[b] = scale;
        s[b] = scale * (float)sum;
    }
}

/* Output n for R rows of x (from row r): every weight group is decoded once and used R times. type and R
 * are constants where this is inlined, so each (format, R) pair compiles to its own loop. */
static inline __attribute__((always_inline)) void dot_rows(int type, int R, const uint8_t *w_row, int64_t K,
                                                           const Acts *a, int64_t r, float *y, int64_t ldy) {
    /* two accumulators a row, taken in turn, so one group's multiply-add need not wait for the last's */
    floats8 acc[4], other[4];
    float mins[4], other_mins[4];
    for (int i = 0; i < R; i++) acc[i] = other[i] = zero8(), mins[i] = other_mins[i] = 0.f;
    const int8_t *xq[4];
    const float *xd[4], *xs[4];
    for (int i = 0; i < R; i++) xq[i] = a->q + (r + i) * K, xd[i] = a->d + (r + i) * (K / 32), xs[i] = a->s + (r + i) * (K / 32);
    const int groups = block_weights(type) / 32, bytes = block_bytes(type);
    for (int64_t blk = 0; blk < K / 32 / groups; blk++) {
        Group g[8];
        decode(type, w_row + blk * bytes, g);
        for (int j = 0; j < groups; j++) {
            const int64_t block = blk * groups + j;  /* the activation block these 32 weights meet */
            for (int i = 0; i < R; i++) {
                const bytes32 x = load32((const uint8_t *)(xq[i] + 32 * block));
                const floats8 previous = acc[i];
                acc[i] = other[i];
                other[i] = fma_scaled(previous, is_signed(type) ? dot_signed(g[j].w, x) : dot_unsigned(g[j].w, x),
                                      g[j].lo * xd[i][block], g[j].hi * xd[i][block], type != Q6_K);
                if (has_min(type)) {
                    const float previous_min = mins[i];
                    mins[i] = other_mins[i];
                    other_mins[i] = previous_min + g[j].min * xs[i][block];
                }
            }
        }
    }
    for (int i = 0; i < R; i++) y[(r + i) * ldy] = sum8(acc[i]) + sum8(other[i]) - mins[i] - other_mins[i];
}

#define FORMAT_ROWS(T)                                                                                  \
    static void rows_##T(int R, const uint8_t *w_row, int64_t K, const Acts *a, int64_t r, float *y, int64_t ldy) { \
        if (R == 4) dot_rows(T, 4, w_row, K, a, r, y, ldy);                                              \
        else if (R == 2) dot_rows(T, 2, w_row, K, a, r, y, ldy);                                         \
        else dot_rows(T, 1, w_row, K, a, r, y, ldy);                                                     \
    }
FORMAT_ROWS(Q4_0)
FORMAT_ROWS(Q4_1)
FORMAT_ROWS(Q8_0)
FORMAT_ROWS(Q4_K)
FORMAT_ROWS(Q5_K)
FORMAT_ROWS(Q6_K)

typedef void (*RowsFn)(int, const uint8_t *, int64_t, const Acts *, int64_t, float *, int64_t);

#define ROW_TILE 16  /* rows of x that stay in L1 while every output n runs over them */

/* w: N rows of K / block_weights(type) blocks. y: row i of the output at y + i * ldy (a column slice of a
 * wider output when a fused layer's parts differ in format). gated: x's rows hold 2K values, gate then up,
 * and the layer's input is silu(gate) * up (SwiGLU, applied here instead of in three PyTorch ops).
 * Returns 0, or -1 for an unknown type. */
int gguf_linear(int type, const float *x, int64_t M, int64_t K, const uint8_t *w, int64_t N, float *y, int64_t ldy,
                const float *norm, float eps, int gated, int threads) {
    RowsFn rows = type == Q4_0 ? rows_Q4_0 : type == Q4_1 ? rows_Q4_1 : type == Q8_0 ? rows_Q8_0
                : type == Q4_K ? rows_Q4_K : type == Q5_K ? rows_Q5_K : type == Q6_K ? rows_Q6_K : NULL;
    if (!rows) return -1;
    Acts a = {malloc((size_t)(M * K)), malloc(sizeof(float) * (size_t)(M * K / 32)),
              malloc(sizeof(float) * (size_t)(M * K / 32))};
    for (int64_t i = 0; i < M; i++)
        quantize_row(x + i * K * (gated ? 2 : 1), K, norm, eps, gated, a.q + i * K, a.d + i * (K / 32), a.s + i * (K / 32));
    const int64_t row_bytes = K / block_weights(type) * block_bytes(type);
    for (int64_t r0 = 0; r0 < M; r0 += ROW_TILE) {
        const int64_t end = M - r0 < ROW_TILE ? M : r0 + ROW_TILE;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
        for (int64_t n = 0; n < N; n++) {
            int64_t r = r0;
            for (; end - r >= 4; r += 4) rows(4, w + n * row_bytes, K, &a, r, y + n, ldy);
            for (; end - r >= 2; r += 2) rows(2, w + n * row_bytes, K, &a, r, y + n, ldy);
            for (; end - r >= 1; r += 1) rows(1, w + n * row_bytes, K, &a, r, y + n, ldy);
        }
    }
    free(a.q), free(a.d), free(a.s);
    return 0;
}
