/* y[M, N] = norm(x)[M, K] @ W.T for W in a GGUF block format, its blocks' bytes as the file stores them.
 *
 * As llama.cpp does, each row of x is first quantised to 8 bits, and a weight block meets the activations
 * as integer dot products (one VNNI instruction, or maddubs + madd, per 32 pairs), scaled in float only
 * where a scale changes. That is 4x less arithmetic than dequantising to float32 and 4-7x fewer bytes read.
 * The optional RMSNorm (norm != NULL) is applied in the same pass over x, so the norm costs no extra op.
 *
 * Formats with blocks of 32 meet x in 8-bit blocks of 32 (int8 q, float scale d, and d * sum(q): ggml's
 * vec_dot_q4_1_q8_1 and friends), the 32 weights being d * q + m with small unsigned q (signed for Q8_0):
 *   Q4_0: d * (q - 8), so m = -8d     Q4_1: d * q + m     Q5_0: m = -16d     Q5_1: d * q + m     Q8_0: d * q
 * gguf_pack moves each row's scales apart from its quants (the same bytes), so 8 blocks' scales are one
 * vector and two blocks' nibbles one 32-byte load; a row pays one float multiply-add per 2 blocks.
 * The K-quants (super-blocks of 256) meet x in 8-bit blocks of 256 (int8 q, one float d, and the integer
 * sum of q over each 16: ggml's block_q8_K and its bsums, as in vec_dot_q4_K_q8_K). A super-block is 8
 * sub-blocks of 32 unsigned q with an integer scale and min per 16 weights, weight = d * scale * q - dmin * min:
 *   Q4_K, Q5_K: 6-bit scale and min per 32                 Q6_K: int8 scale per 16, q - 32 read as min 32 * scale
 * so sum(weight * x) = d * xd * sum(scale * dot(q, xq)) - dmin * xd * sum(min * sum(xq)): both sums are
 * integers over the whole super-block, and a row pays two float multiply-adds per 256 weights.
 * Layouts follow gguf-py's dequantize (tests check the two agree on real blocks).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };  /* GGML type numbers */

#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
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

/* -- 32 bytes at a time: AVX2 (with VNNI where the compiler targets it), else plain C ---------------- */
#ifdef __AVX2__
typedef __m256i bytes32;
typedef __m256i ints8;
typedef __m256i shorts16;
typedef __m256 floats8;
static inline bytes32 load32(const uint8_t *p) { return _mm256_loadu_si256((const __m256i *)p); }
/* (v >> shift) & mask per byte; mask must drop the bits a 16-bit shift brings in from the next byte */
static inline bytes32 bits(bytes32 v, int shift, uint8_t mask) {
    return _mm256_and_si256(_mm256_srli_epi16(v, shift), _mm256_set1_epi8((char)mask));
}
static inline bytes32 or_high(bytes32 low, bytes32 high) { return _mm256_or_si256(low, _mm256_slli_epi16(high, 4)); }
/* 16 bytes of nibbles: the low ones are weights 0..15, the high ones 16..31 (Q4_0, Q4_1, Q5_0, Q5_1) */
static inline bytes32 nibbles16(const uint8_t *q) {
    const __m128i v = _mm_loadu_si128((const __m128i *)q);
    return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(v, 4), v), _mm256_set1_epi8(15));
}
/* low (bytes < 16) with 16 added to byte j where bit j of the 32 little-endian bits at p is set (Q5's 5th bits) */
static inline bytes32 fifth_bits(bytes32 low, const uint8_t *p) {
    uint32_t word;
    memcpy(&word, p, 4);
#if defined(__AVX512BW__) && defined(__AVX512VL__)
    return _mm256_mask_add_epi8(low, (__mmask32)word, low, _mm256_set1_epi8(16));
#else
    const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32((int)word),  /* byte j <- byte j / 8 */
                                               _mm256_setr_epi64x(0, 0x0101010101010101, 0x0202020202020202,
                                                                  0x0303030303030303));
    const __m256i bit = _mm256_set1_epi64x((int64_t)0x8040201008040201);  /* byte j: bit j % 8 */
    const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
    return _mm256_or_si256(low, _mm256_and_si256(set, _mm256_set1_epi8(16)));
#endif
}
/* acc + dot products of unsigned w (< 128) with signed x, in 8 lanes of 4 pairs (lanes 0-3: weights 0..15). */
static inline ints8 dot_unsigned(ints8 acc, bytes32 w, bytes32 x) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(acc, w, x);
#elif defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(acc, w, x);
#else  /* pairs of products fit int16: |w| <= 64, |x| <= 127 */
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1)));
#endif
}
/* Signed w: |w| against x with w's sign moved onto x (w = -128 reads as 128 unsigned, still exact). */
static inline ints8 dot_signed(ints8 acc, bytes32 w, bytes32 x) {
    return dot_unsigned(acc, _mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));
}
/* acc + unsigned w (< 64) times signed x, each pair of products times its 16-bit scale: 8 lanes, lanes 0-3
 * weights 0..15 with scale lanes 0-7. A pair is at most 2 * 63 * 127, so maddubs never saturates. */
static inline ints8 add_scaled_dot(ints8 acc, bytes32 w, bytes32 x, shorts16 scale) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpwssd_epi32(acc, _mm256_maddubs_epi16(w, x), scale);
#elif defined(__AVXVNNI__)
    return _mm256_dpwssd_avx_epi32(acc, _mm256_maddubs_epi16(w, x), scale);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), scale));
#endif
}
static inline ints8 add_ints(ints8 a, ints8 b) { return _mm256_add_epi32(a, b); }
static inline ints8 zero_ints(void) { return _mm256_setzero_si256(); }
/* 16 int8 as 16 int16 lanes, in the order given */
static inline shorts16 widen(const int8_t *s) { return _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)s)); }
/* 16 int8 with the even ones in lanes 0-7 and the odd ones in lanes 8-15 */
static inline shorts16 widen_even_odd(const int8_t *s) {
    const __m128i v = _mm_loadu_si128((const __m128i *)s);
    return _mm256_cvtepi8_epi16(_mm_shuffle_epi8(v, _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15)));
}
static inline shorts16 times32(shorts16 v) { return _mm256_slli_epi16(v, 5); }
/* lane j of the even-odd scales in lanes 0-7 and lane 8 + j in lanes 8-15: sub-block j's two scales */
static inline shorts16 pick(shorts16 even_odd, int j) {
    return _mm256_shuffle_epi8(even_odd, _mm256_set1_epi16((short)((2 * j + 1) << 8 | 2 * j)));
}
static inline ints8 dot_shorts(shorts16 a, const int16_t *b) {
    return _mm256_madd_epi16(a, _mm256_loadu_si256((const __m256i *)b));
}
static inline floats8 fma_scaled(floats8 acc, ints8 sums, floats8 scale) {
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), scale, acc);
}
static inline floats8 zero8(void) { return _mm256_setzero_ps(); }
static inline floats8 set8(float v) { return _mm256_set1_ps(v); }
static inline floats8 load8(const float *p) { return _mm256_loadu_ps(p); }
static inline floats8 halves8(const uint8_t *p) {
#ifdef __F16C__
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
#else
    return _mm256_setr_ps(half(p), half(p + 2), half(p + 4), half(p + 6), half(p + 8), half(p + 10), half(p + 12), half(p + 14));
#endif
}
static inline floats8 mul8(floats8 a, floats8 b) { return _mm256_mul_ps(a, b); }
static inline floats8 fma8(floats8 a, floats8 b, floats8 acc) { return _mm256_fmadd_ps(a, b, acc); }
/* lane lo of v in lanes 0-3, lane hi in lanes 4-7 */
static inline floats8 lanes(floats8 v, int lo, int hi) {
    return _mm256_permutevar8x32_ps(v, _mm256_setr_epi32(lo, lo, lo, lo, hi, hi, hi, hi));
}
/* e^x: 2^n e^r with n = round(x / ln 2) and |r| <= ln 2 / 2, e^r by its Taylor series to r^6 (relative error
 * ~1e-7); x is clamped to [-87.3, 88.3], where 2^n stays a normal float */
static inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    /* r = x - n ln 2, with ln 2 in two parts so n * (high part) is exact */
    const __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.42860677e-6f), _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145752f), x));
    __m256 p = _mm256_set1_ps(1.f / 720);
    const float terms[6] = {1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f};
    for (int k = 0; k < 6; k++) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(terms[k]));
    const __m256i two_n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(two_n));
}
/* out = silu(gate) * up for 8 values: SwiGLU, gate / (1 + e^-gate) * up */
static inline void swiglu8(const float *gate, const float *up, float *out) {
    const __m256 g = _mm256_loadu_ps(gate), e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), g));
    _mm256_storeu_ps(out, _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.f), e)), _mm256_loadu_ps(up)));
}
static inline float sum8(floats8 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
#else
typedef struct { uint8_t b[32]; } bytes32;
typedef struct { int32_t i[8]; } ints8;
typedef struct { int16_t h[16]; } shorts16;
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
static inline bytes32 nibbles16(const uint8_t *q) {
    bytes32 v;
    for (int j = 0; j < 16; j++) v.b[j] = q[j] & 15, v.b[16 + j] = q[j] >> 4;
    return v;
}
static inline bytes32 fifth_bits(bytes32 low, const uint8_t *p) {
    for (int j = 0; j < 32; j++) low.b[j] |= (uint8_t)((p[j / 8] >> (j % 8) & 1) << 4);
    return low;
}
static inline ints8 dot_lanes(ints8 acc, bytes32 w, bytes32 x, int is_signed) {
    for (int j = 0; j < 32; j++)
        acc.i[j / 4] += (is_signed ? (int32_t)(int8_t)w.b[j] : (int32_t)w.b[j]) * (int32_t)(int8_t)x.b[j];
    return acc;
}
static inline ints8 dot_unsigned(ints8 acc, bytes32 w, bytes32 x) { return dot_lanes(acc, w, x, 0); }
static inline ints8 dot_signed(ints8 acc, bytes32 w, bytes32 x) { return dot_lanes(acc, w, x, 1); }
static inline ints8 add_scaled_dot(ints8 acc, bytes32 w, bytes32 x, shorts16 scale) {
    for (int j = 0; j < 32; j++) acc.i[j / 4] += (int32_t)w.b[j] * (int32_t)(int8_t)x.b[j] * scale.h[j / 2];
    return acc;
}
static inline ints8 add_ints(ints8 a, ints8 b) {
    for (int j = 0; j < 8; j++) a.i[j] += b.i[j];
    return a;
}
static inline ints8 zero_ints(void) { ints8 v = {{0}}; return v; }
static inline shorts16 widen(const int8_t *s) {
    shorts16 v;
    for (int j = 0; j < 16; j++) v.h[j] = s[j];
    return v;
}
static inline shorts16 widen_even_odd(const int8_t *s) {
    shorts16 v;
    for (int j = 0; j < 8; j++) v.h[j] = s[2 * j], v.h[8 + j] = s[2 * j + 1];
    return v;
}
static inline shorts16 times32(shorts16 v) {
    for (int j = 0; j < 16; j++) v.h[j] = (int16_t)(v.h[j] * 32);
    return v;
}
static inline shorts16 pick(shorts16 even_odd, int j) {
    shorts16 v;
    for (int k = 0; k < 8; k++) v.h[k] = even_odd.h[j], v.h[8 + k] = even_odd.h[8 + j];
    return v;
}
static inline ints8 dot_shorts(shorts16 a, const int16_t *b) {
    ints8 s = {{0}};
    for (int j = 0; j < 16; j++) s.i[j / 2] += (int32_t)a.h[j] * b[j];
    return s;
}
static inline floats8 fma_scaled(floats8 acc, ints8 sums, floats8 scale) {
    for (int j = 0; j < 8; j++) acc.f[j] += (float)sums.i[j] * scale.f[j];
    return acc;
}
static inline floats8 zero8(void) { floats8 v = {{0}}; return v; }
static inline floats8 set8(float v) {
    floats8 out;
    for (int j = 0; j < 8; j++) out.f[j] = v;
    return out;
}
static inline floats8 load8(const float *p) { floats8 v; memcpy(v.f, p, 32); return v; }
static inline floats8 halves8(const uint8_t *p) {
    floats8 v;
    for (int j = 0; j < 8; j++) v.f[j] = half(p + 2 * j);
    return v;
}
static inline floats8 mul8(floats8 a, floats8 b) {
    for (int j = 0; j < 8; j++) a.f[j] *= b.f[j];
    return a;
}
static inline floats8 fma8(floats8 a, floats8 b, floats8 acc) {
    for (int j = 0; j < 8; j++) acc.f[j] += a.f[j] * b.f[j];
    return acc;
}
static inline floats8 lanes(floats8 v, int lo, int hi) {
    floats8 out;
    for (int j = 0; j < 8; j++) out.f[j] = v.f[j < 4 ? lo : hi];
    return out;
}
static inline void swiglu8(const float *gate, const float *up, float *out) {
    for (int j = 0; j < 8; j++) out[j] = gate[j] / (1.f + expf(-gate[j])) * up[j];
}
static inline float sum8(floats8 v) {
    float s = 0.f;
    for (int j = 0; j < 8; j++) s += v.f[j];
    return s;
}
#endif

static inline int is_k_quant(int type) { return type == Q4_K || type == Q5_K || type == Q6_K; }
static inline int block_weights(int type) { return is_k_quant(type) ? 256 : 32; }
static inline int block_bytes(int type) {
    switch (type) {
    case Q4_0: return 18;
    case Q4_1: return 20;
    case Q5_0: return 22;
    case Q5_1: return 24;
    case Q8_0: return 34;
    case Q4_K: return 144;
    case Q5_K: return 176;
    default: return 210;  /* Q6_K */
    }
}

/* -- x's rows in 8 bits ------------------------------------------------------------------------------ */
/* Per row: q (K int8), and per block of 32 or 256 (the weight format's) a scale d, at d + row * per_row.
 * Blocks of 32 also keep s = d * sum(q) (what a block's min multiplies), d and s padded with zeros to a
 * multiple of 8 blocks (read 8 at a time), and q in pair order (pair_order). Blocks of 256 keep the integer
 * sum of q over each 16, the even 16s first, then the odd ones (the order a K-quant's scales take for pick()). */
typedef struct {
    int8_t *q;
    float *d, *s;
    int16_t *sums;
    int64_t per_row;  /* d's (and s's) a row */
} Acts;

static inline int64_t padded8(int64_t n) { return (n + 7) / 8 * 8; }

/* Blocks of 32 go in pairs: blocks 2p and 2p + 1 (A, B) as A[0..15] B[0..15] A[16..31] B[16..31], so that the
 * low nibbles of one 32-byte load of both blocks' nibbles (A's 16 bytes, then B's) meet the first 32 bytes and
 * the high nibbles the next 32, and a dot product's lanes 0-3 are A's, 4-7 B's. A last odd block stays as is. */
static inline int64_t pair_order(int64_t b, int j, int64_t blocks) {
    if (b == blocks - 1 && blocks % 2) return 32 * b + j;
    return 64 * (b / 2) + 32 * (j / 16) + 16 * (b % 2) + j % 16;
}

static void quantize_row(const float *x, int64_t K, int block, const float *norm, float eps, int gated, int8_t *q,
                         float *d, float *s, int16_t *sums, int64_t per_row) {
    float inv_rms = 1.f;
    if (norm) {
        float squares = 0.f;
        for (int64_t k = 0; k < K; k++) squares += x[k] * x[k];
        inv_rms = 1.f / sqrtf(squares / (float)K + eps);
    }
    const int64_t blocks = K / block;
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t at = block * b;
        float v[256], amax = 0.f;
        for (int j = 0; j < block; j += 8)
            if (gated) swiglu8(x + at + j, x + K + at + j, v + j);
            else for (int k = j; k < j + 8; k++) v[k] = norm ? x[at + k] * inv_rms * norm[at + k] : x[at + k];
        for (int j = 0; j < block; j++) amax = fmaxf(amax, fabsf(v[j]));
        const float scale = amax / 127.f, inv = scale ? 1.f / scale : 0.f;
        int8_t qb[256];
        int sum = 0;
        for (int j = 0; j < block; j++) {
            qb[j] = (int8_t)nearbyintf(v[j] * inv);
            sum += qb[j];
        }
        d[b] = scale;
        if (block == 32) {
            for (int j = 0; j < 32; j++) q[pair_order(b, j, blocks)] = qb[j];
            s[b] = scale * (float)sum;
            continue;
        }
        memcpy(q + at, qb, 256);
        for (int g = 0; g < 16; g++) {
            int group = 0;
            for (int j = 0; j < 16; j++) group += qb[16 * g + j];
            sums[16 * b + (g % 2) * 8 + g / 2] = (int16_t)group;
        }
    }
    for (int64_t b = blocks; b < per_row; b++) d[b] = s[b] = 0.f;
}

/* -- blocks of 32, repacked --------------------------------------------------------------------------- */
/* gguf_pack lays a row of 32-weight blocks out as: the fp16 scales d and, for Q4_1/Q5_1, the mins m, each padded
 * with zeros to a multiple of 8 blocks; Q5_0/Q5_1's fifth bits (32 a block, in pair order); the quants (16 bytes of
 * nibbles a block; Q8_0's 32 bytes in pair order). The same bytes as the file's, but 8 blocks' scales are one
 * vector load, and a row pays one float multiply-add per pair of blocks (ggml's blocks interleave them). The
 * scales come first so that a row is read front to back, as the hardware prefetcher expects. */
static inline int quant_bytes(int type) { return type == Q8_0 ? 32 : 16; }
static inline int has_fifth_bit(int type) { return type == Q5_0 || type == Q5_1; }
static inline int has_m(int type) { return type == Q4_1 || type == Q5_1; }
/* Offsets of a packed row's m, fifth bits and quants (d is at 0) */
static inline int64_t m_at(int64_t blocks) { return 2 * padded8(blocks); }
static inline int64_t qh_at(int type, int64_t blocks) { return m_at(blocks) * (has_m(type) ? 2 : 1); }
static inline int64_t qs_at(int type, int64_t blocks) { return qh_at(type, blocks) + (has_fifth_bit(type) ? 4 * blocks : 0); }

int64_t gguf_packed_row_bytes(int type, int64_t K) {
    if (is_k_quant(type)) return K / 256 * block_bytes(type);  /* super-blocks run as stored */
    const int64_t blocks = K / 32;
    return blocks * (quant_bytes(type) + (has_fifth_bit(type) ? 4 : 0)) + padded8(blocks) * (has_m(type) ? 4 : 2);
}

/* w: N rows of K weights as the file stores them -> out: N rows of gguf_packed_row_bytes. */
void gguf_pack(int type, const uint8_t *w, int64_t N, int64_t K, uint8_t *out) {
    const int64_t blocks = K / 32, in_row = K / block_weights(type) * block_bytes(type);
    const int64_t out_row = gguf_packed_row_bytes(type, K);
    for (int64_t n = 0; n < N; n++) {
        const uint8_t *src = w + n * in_row;
        uint8_t *d = out + n * out_row;
        if (is_k_quant(type)) {
            memcpy(d, src, (size_t)in_row);
            continue;
        }
        memset(d, 0, (size_t)out_row);
        uint8_t *m = d + m_at(blocks), *qh = d + qh_at(type, blocks), *qs = d + qs_at(type, blocks);
        for (int64_t b = 0; b < blocks; b++) {  /* a block: d, [m], [qh], quants (ggml's block_q4_0 etc.) */
            const uint8_t *block = src + b * block_bytes(type), *q = block + (has_m(type) ? 4 : 2);
            memcpy(d + 2 * b, block, 2);
            if (has_m(type)) memcpy(m + 2 * b, block + 2, 2);
            for (int j = 0; has_fifth_bit(type) && j < 32; j++) {
                const int64_t at = pair_order(b, j, blocks);
                qh[at / 8] |= (uint8_t)((q[j / 8] >> (j % 8) & 1) << (at % 8));
            }
            q += has_fifth_bit(type) ? 4 : 0;
            if (type == Q8_0)
                for (int j = 0; j < 32; j++) qs[pair_order(b, j, blocks)] = q[j];
            else
                memcpy(qs + 16 * b, q, 16);
        }
    }
}

/* Blocks b and b + 1's weights: lo meets x's first 32 bytes of the pair, hi the next 32 */
static inline void pair_weights(int type, const uint8_t *qs, const uint8_t *qh, int64_t b, bytes32 *lo, bytes32 *hi) {
    if (type == Q8_0) {
        *lo = load32(qs + 32 * b), *hi = load32(qs + 32 * b + 32);
        return;
    }
    const bytes32 both = load32(qs + 16 * b);
    *lo = bits(both, 0, 15), *hi = bits(both, 4, 15);
    if (has_fifth_bit(type)) *lo = fifth_bits(*lo, qh + 4 * b), *hi = fifth_bits(*hi, qh + 4 * b + 4);
}

/* A last odd block's weights, in their own order */
static inline bytes32 last_block_weights(int type, const uint8_t *qs, const uint8_t *qh, int64_t b) {
    if (type == Q8_0) return load32(qs + 32 * b);
    const bytes32 w = nibbles16(qs + 16 * b);
    return has_fifth_bit(type) ? fifth_bits(w, qh + 4 * b) : w;
}

static inline ints8 dot(int type, ints8 acc, bytes32 w, bytes32 x) {
    return type == Q8_0 ? dot_signed(acc, w, x) : dot_unsigned(acc, w, x);
}

/* Output n for R rows of x (from row r): every pair of weight blocks is unpacked once and used R times. type
 * and R are constants where this is inlined, so each (format, R) pair compiles to its own loop. */
static inline __attribute__((always_inline)) void dot_rows(int type, int R, const uint8_t *w_row, int64_t K,
                                                           const Acts *a, int64_t r, float *y, int64_t ldy) {
    const int64_t blocks = K / 32;
    const uint8_t *d = w_row, *m = d + m_at(blocks), *qh = d + qh_at(type, blocks), *qs = d + qs_at(type, blocks);
    /* two accumulators a row, for alternate pairs, so one pair's multiply-add need not wait for the last's */
    floats8 acc[2][4], mins[4];
    for (int i = 0; i < R; i++) acc[0][i] = acc[1][i] = mins[i] = zero8();
    for (int64_t c = 0; c < blocks; c += 8) {  /* 8 blocks, whose scales are one vector */
        const floats8 wd = halves8(d + 2 * c);
        /* what x's sums multiply: Q4_1's and Q5_1's m; Q4_0's d * (q - 8) is d * q - 8d, Q5_0's - 16d */
        const floats8 wm = has_m(type) ? halves8(m + 2 * c) : mul8(wd, set8(type == Q4_0 ? -8.f : -16.f));
        floats8 scale[4];
        for (int i = 0; i < R; i++) {
            const int64_t at = (r + i) * a->per_row + c;
            scale[i] = mul8(wd, load8(a->d + at));
            if (type != Q8_0) mins[i] = fma8(wm, load8(a->s + at), mins[i]);
        }
        for (int k = 0; k < 8 && c + k + 2 <= blocks; k += 2) {
            bytes32 lo, hi;
            pair_weights(type, qs, qh, c + k, &lo, &hi);
            for (int i = 0; i < R; i++) {
                const uint8_t *x = (const uint8_t *)(a->q + (r + i) * K + 32 * (c + k));
                const ints8 sums = dot(type, dot(type, zero_ints(), lo, load32(x)), hi, load32(x + 32));
                acc[k / 2 % 2][i] = fma_scaled(acc[k / 2 % 2][i], sums, lanes(scale[i], k, k + 1));
            }
        }
        if (blocks % 2 && c + 8 >= blocks) {  /* a last odd block */
            const int k = (int)(blocks - 1 - c);
            const bytes32 w = last_block_weights(type, qs, qh, blocks - 1);
            for (int i = 0; i < R; i++) {
                const bytes32 x = load32((const uint8_t *)(a->q + (r + i) * K + 32 * (blocks - 1)));
                acc[0][i] = fma_scaled(acc[0][i], dot(type, zero_ints(), w, x), lanes(scale[i], k, k));
            }
        }
    }
    for (int i = 0; i < R; i++) y[(r + i) * ldy] = sum8(acc[0][i]) + sum8(acc[1][i]) + sum8(mins[i]);
}

/* -- K-quant super-blocks of 256 ---------------------------------------------------------------------- */
typedef struct {
    shorts16 scales, mins;  /* per 16 weights, the even 16s in lanes 0-7 and the odd ones in 8-15 */
    float d, dmin;
} SuperScales;

/* Q4_K, Q5_K: 12 bytes of 6-bit scales and mins for 8 sub-blocks (ggml's get_scale_min_k4): bytes 0-3 hold
 * scales 0-3 in their low 6 bits, 4-7 mins 0-3; bytes 8-11 the low 4 bits of scales 4-7 (low nibble) and
 * mins 4-7 (high nibble), whose top 2 bits are the top 2 bits of bytes 0-3 (scales) and 4-7 (mins). */
static inline SuperScales k4_scales(const uint8_t *b) {
    uint32_t packed[3], scales[4], mins[4];
    memcpy(packed, b + 4, 12);
    const uint32_t low6 = 0x3f3f3f3fu, low4 = 0x0f0f0f0fu, low2 = 0x03030303u;
    scales[0] = scales[2] = packed[0] & low6;
    scales[1] = scales[3] = (packed[2] & low4) | (packed[0] >> 6 & low2) << 4;
    mins[0] = mins[2] = packed[1] & low6;
    mins[1] = mins[3] = (packed[2] >> 4 & low4) | (packed[1] >> 6 & low2) << 4;
    /* sub-block j's scale serves its 16s 2j (even) and 2j + 1 (odd): the 8 scales twice is the even-odd layout */
    SuperScales s = {widen((const int8_t *)scales), widen((const int8_t *)mins), half(b), half(b + 2)};
    return s;
}

static inline SuperScales k_scales(int type, const uint8_t *b) {
    if (type != Q6_K) return k4_scales(b);
    const shorts16 scales = widen_even_odd((const int8_t *)(b + 192));
    const float d = half(b + 208);
    SuperScales s = {scales, times32(scales), d, d};  /* d * scale * (q - 32) = d * scale * q - d * 32 * scale */
    return s;
}

/* Sub-block j's 32 unsigned q */
static inline bytes32 k_weights(int type, const uint8_t *b, int j) {
    if (type == Q6_K) {  /* ql[128], qh[64]: 128-weight halves, each 4 quarters of 32 */
        const int half_ = j / 4, quarter = j % 4;
        const bytes32 low = bits(load32(b + 64 * half_ + 32 * (quarter % 2)), 4 * (quarter / 2), 15);
        return or_high(low, bits(load32(b + 128 + 32 * half_), 2 * quarter, 3));
    }
    /* Q4_K: d, dmin, scales[12], qs[128]; Q5_K: the same with qh[32] (each weight's 5th bit) before qs */
    const bytes32 low = bits(load32(b + (type == Q5_K ? 48 : 16) + 32 * (j / 2)), 4 * (j % 2), 15);
    return type == Q5_K ? or_high(low, bits(load32(b + 16), j, 1)) : low;
}

static inline __attribute__((always_inline)) void dot_rows_k(int type, int R, const uint8_t *w_row, int64_t K,
                                                             const Acts *a, int64_t r, float *y, int64_t ldy) {
    floats8 acc[4], acc_min[4];
    for (int i = 0; i < R; i++) acc[i] = acc_min[i] = zero8();
    const int64_t supers = K / 256;
    for (int64_t sb = 0; sb < supers; sb++) {
        const uint8_t *b = w_row + sb * block_bytes(type);
        const SuperScales s = k_scales(type, b);
        ints8 even[4], odd[4];  /* two integer sums a row, so a VNNI multiply-add need not wait for the last */
        for (int i = 0; i < R; i++) even[i] = odd[i] = zero_ints();
        for (int j = 0; j < 8; j++) {
            const bytes32 w = k_weights(type, b, j);
            const shorts16 scale = pick(s.scales, j);
            for (int i = 0; i < R; i++) {
                const bytes32 x = load32((const uint8_t *)(a->q + (r + i) * K + 256 * sb + 32 * j));
                if (j % 2) odd[i] = add_scaled_dot(odd[i], w, x, scale);
                else even[i] = add_scaled_dot(even[i], w, x, scale);
            }
        }
        for (int i = 0; i < R; i++) {
            const int64_t at = (r + i) * supers + sb;
            acc[i] = fma_scaled(acc[i], add_ints(even[i], odd[i]), set8(s.d * a->d[at]));
            acc_min[i] = fma_scaled(acc_min[i], dot_shorts(s.mins, a->sums + 16 * at), set8(s.dmin * a->d[at]));
        }
    }
    for (int i = 0; i < R; i++) y[(r + i) * ldy] = sum8(acc[i]) - sum8(acc_min[i]);
}

#define FORMAT_ROWS(T, DOT)                                                                              \
    static void rows_##T(int R, const uint8_t *w_row, int64_t K, const Acts *a, int64_t r, float *y, int64_t ldy) { \
        if (R == 4) DOT(T, 4, w_row, K, a, r, y, ldy);                                                    \
        else if (R == 2) DOT(T, 2, w_row, K, a, r, y, ldy);                                               \
        else DOT(T, 1, w_row, K, a, r, y, ldy);                                                           \
    }
FORMAT_ROWS(Q4_0, dot_rows)
FORMAT_ROWS(Q4_1, dot_rows)
FORMAT_ROWS(Q5_0, dot_rows)
FORMAT_ROWS(Q5_1, dot_rows)
FORMAT_ROWS(Q8_0, dot_rows)
FORMAT_ROWS(Q4_K, dot_rows_k)
FORMAT_ROWS(Q5_K, dot_rows_k)
FORMAT_ROWS(Q6_K, dot_rows_k)

typedef void (*RowsFn)(int, const uint8_t *, int64_t, const Acts *, int64_t, float *, int64_t);

static RowsFn rows_of(int type) {
    switch (type) {
    case Q4_0: return rows_Q4_0;
    case Q4_1: return rows_Q4_1;
    case Q5_0: return rows_Q5_0;
    case Q5_1: return rows_Q5_1;
    case Q8_0: return rows_Q8_0;
    case Q4_K: return rows_Q4_K;
    case Q5_K: return rows_Q5_K;
    case Q6_K: return rows_Q6_K;
    default: return NULL;
    }
}

#define ROW_TILE 16  /* rows of x that stay in L1 while every output n runs over them */

/* w: N rows of K weights as gguf_pack lays them out. y: row i of the output at y + i * ldy (a column slice of a
 * wider output when a fused layer's parts differ in format). gated: x's rows hold 2K values, gate then up,
 * and the layer's input is silu(gate) * up (SwiGLU, applied here instead of in three PyTorch ops).
 * Returns 0, or -1 for an unknown type. */
int gguf_linear(int type, const float *x, int64_t M, int64_t K, const uint8_t *w, int64_t N, float *y, int64_t ldy,
                const float *norm, float eps, int gated, int threads) {
    const RowsFn rows = rows_of(type);
    if (!rows) return -1;
    const int block = block_weights(type);
    const int64_t per_row = block == 32 ? padded8(K / 32) : K / 256;
    Acts a = {malloc((size_t)(M * K)), malloc(sizeof(float) * (size_t)(M * per_row)),
              malloc(sizeof(float) * (size_t)(M * per_row)), malloc(sizeof(int16_t) * (size_t)(M * K / 16)), per_row};
    for (int64_t i = 0; i < M; i++)
        quantize_row(x + i * K * (gated ? 2 : 1), K, block, norm, eps, gated, a.q + i * K, a.d + i * per_row,
                     a.s + i * per_row, a.sums + i * (K / 16), per_row);
    const int64_t row_bytes = gguf_packed_row_bytes(type, K);
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
    free(a.q), free(a.d), free(a.s), free(a.sums);
    return 0;
}
