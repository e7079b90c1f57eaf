/* y[M, N] = x[M, K] @ W.T for W stored in GGUF's own block formats, blocks of 32 weights along K.
 *
 * Decode reads every weight once per token, so a GGUF kept in its 4.5-8.5 bits per weight moves 4-7x
 * fewer bytes than the same weights dequantised to float32. Each block is dequantised in registers
 * exactly as gguf-py does it (one float32 multiply, then one add: built with -ffp-contract=off), so
 * the weights are bit-identical to the dequantised ones; only the summation order differs. With
 * AVX-512 a block is dequantised by table lookup (below); elsewhere the compiler vectorises plain C.
 *
 *   q4_0: w = d * (q - 8)     q4_1: w = d * q + m     q8_0: w = d * q
 * qs holds each row's blocks back to back (16 bytes a block for 4-bit: element j in the low nibble of
 * byte j, element j + 16 in the high nibble; 32 int8 for q8_0); d and m are float32 [N, K / 32].
 */
#include <stdint.h>

enum { Q4_0 = 2, Q4_1 = 3, Q8_0 = 8 };  /* GGML type numbers */

static inline void dequant(int type, const uint8_t *q, float d, float m, float *w) {
    if (type == Q8_0) {
        const int8_t *s = (const int8_t *)q;
        for (int j = 0; j < 32; j++) w[j] = d * (float)s[j];
    } else if (type == Q4_1) {
        for (int j = 0; j < 16; j++) {
            w[j] = d * (float)(q[j] & 15) + m;
            w[j + 16] = d * (float)(q[j] >> 4) + m;
        }
    } else {
        for (int j = 0; j < 16; j++) {
            w[j] = d * (float)((int)(q[j] & 15) - 8);
            w[j + 16] = d * (float)((int)(q[j] >> 4) - 8);
        }
    }
}


#ifdef __AVX512F__
#include <immintrin.h>
/* The two 16-weight halves of a block, dequantised as dequant() does: a 4-bit block's 16 possible
 * values d*i + m (i = 0..15) computed once, then looked up by nibble (vpermps reads an index's low 4 bits). */
static inline void dequant16x2(int type, const uint8_t *q, float d, float m, __m512 *lo, __m512 *hi) {
    if (type == Q8_0) {
        const __m512 scale = _mm512_set1_ps(d);
        *lo = _mm512_mul_ps(scale, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)q))));
        *hi = _mm512_mul_ps(scale, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + 16)))));
        return;
    }
    const __m512 levels = type == Q4_1 ? _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15)
                                       : _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
    __m512 table = _mm512_mul_ps(_mm512_set1_ps(d), levels);
    if (type == Q4_1) table = _mm512_add_ps(table, _mm512_set1_ps(m));
    const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)q));
    *lo = _mm512_permutexvar_ps(bytes, table);
    *hi = _mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), table);
}
/* R rows of x against output n, R x 2 accumulators in registers (R is a constant). */
#define ROWS_KERNEL(R)                                                                                   \
    static void rows_##R(int type, const float *x, int64_t K, const uint8_t *qs, const float *d,       \
                         const float *m, int64_t n, int64_t N, int64_t block_bytes, float *y) {        \
        const int64_t nb = K / 32;                                                                       \
        __m512 acc[R][2];                                                                                \
        for (int i = 0; i < R; i++) acc[i][0] = acc[i][1] = _mm512_setzero_ps();                         \
        for (int64_t b = 0; b < nb; b++) {                                                               \
            __m512 lo, hi;                                                                               \
            dequant16x2(type, qs + (n * nb + b) * block_bytes, d[n * nb + b], m ? m[n * nb + b] : 0.f, &lo, &hi); \
            for (int i = 0; i < R; i++) {                                                                \
                acc[i][0] = _mm512_fmadd_ps(lo, _mm512_loadu_ps(x + i * K + b * 32), acc[i][0]);          \
                acc[i][1] = _mm512_fmadd_ps(hi, _mm512_loadu_ps(x + i * K + b * 32 + 16), acc[i][1]);     \
            }                                                                                            \
        }                                                                                                \
        for (int i = 0; i < R; i++) y[i * N + n] = _mm512_reduce_add_ps(_mm512_add_ps(acc[i][0], acc[i][1])); \
    }
#else
/* R rows of x against output n: the R x 32 accumulators stay in registers (R is a constant). The
 * accumulate is an explicit fmaf, contracted on purpose; the dequantisation above is not. */
#define ROWS_KERNEL(R)                                                                                   \
    static void rows_##R(int type, const float *x, int64_t K, const uint8_t *qs, const float *d,       \
                         const float *m, int64_t n, int64_t N, int64_t block_bytes, float *y) {        \
        const int64_t nb = K / 32;                                                                       \
        float acc[R][32] = {{0}}, w[32];                                                                 \
        for (int64_t b = 0; b < nb; b++) {                                                               \
            dequant(type, qs + (n * nb + b) * block_bytes, d[n * nb + b], m ? m[n * nb + b] : 0.f, w);  \
            for (int i = 0; i < R; i++)                                                                  \
                for (int j = 0; j < 32; j++) acc[i][j] = __builtin_fmaf(w[j], x[i * K + b * 32 + j], acc[i][j]); \
        }                                                                                                \
        for (int i = 0; i < R; i++) {                                                                    \
            float s = 0.f;                                                                               \
            for (int j = 0; j < 32; j++) s += acc[i][j];                                                 \
            y[i * N + n] = s;                                                                            \
        }                                                                                                \
    }
#endif
ROWS_KERNEL(1)
ROWS_KERNEL(2)
ROWS_KERNEL(4)

#define ROW_TILE 16  /* rows of x that stay in L1 while every output n runs over them */

void gguf_linear(int type, const float *x, int64_t M, int64_t K, const uint8_t *qs, const float *d,
                 const float *m, int64_t N, float *y, int threads) {
    const int64_t block_bytes = type == Q8_0 ? 32 : 16;
    for (int64_t r0 = 0; r0 < M; r0 += ROW_TILE) {
        const int64_t tile = M - r0 < ROW_TILE ? M - r0 : ROW_TILE;
#pragma omp parallel for num_threads(threads) schedule(static)
        for (int64_t n = 0; n < N; n++) {
            int64_t r = r0;
            for (; r0 + tile - r >= 4; r += 4) rows_4(type, x + r * K, K, qs, d, m, n, N, block_bytes, y + r * N);
            for (; r0 + tile - r >= 2; r += 2) rows_2(type, x + r * K, K, qs, d, m, n, N, block_bytes, y + r * N);
            for (; r0 + tile - r >= 1; r += 1) rows_1(type, x + r * K, K, qs, d, m, n, N, block_bytes, y + r * N);
        }
    }
}
