/* y[M, N] = x[M, K] @ W.T for W stored in GGUF's own block formats, blocks of 32 weights along K.
 *
 * Decode reads every weight once per token, so a GGUF kept in its 4.5-8.5 bits per weight moves 4-7x
 * fewer bytes than the same weights dequantised to float32. Each block is dequantised in registers
 * exactly as gguf-py does it (one float32 multiply, then one add: built with -ffp-contract=off), so
 * the weights are bit-identical to the dequantised ones; only the summation order differs.
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
ROWS_KERNEL(1)
ROWS_KERNEL(2)
ROWS_KERNEL(4)

void gguf_linear(int type, const float *x, int64_t M, int64_t K, const uint8_t *qs, const float *d,
                 const float *m, int64_t N, float *y, int threads) {
    const int64_t block_bytes = type == Q8_0 ? 32 : 16;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t n = 0; n < N; n++) {
        int64_t r = 0;
        for (; M - r >= 4; r += 4) rows_4(type, x + r * K, K, qs, d, m, n, N, block_bytes, y + r * N);
        for (; M - r >= 2; r += 2) rows_2(type, x + r * K, K, qs, d, m, n, N, block_bytes, y + r * N);
        for (; M - r >= 1; r += 1) rows_1(type, x + r * K, K, qs, d, m, n, N, block_bytes, y + r * N);
    }
}

/* out[N, K] = W in float32: for many rows of x (prefill chunks) one dequantisation and a GEMM beat
 * dequantising every block once per row. */
void gguf_dequantize(int type, int64_t K, const uint8_t *qs, const float *d, const float *m, int64_t N, float *out,
                     int threads) {
    const int64_t nb = K / 32, block_bytes = type == Q8_0 ? 32 : 16;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t n = 0; n < N; n++)
        for (int64_t b = 0; b < nb; b++)
            dequant(type, qs + (n * nb + b) * block_bytes, d[n * nb + b], m ? m[n * nb + b] : 0.f, out + n * K + b * 32);
}
