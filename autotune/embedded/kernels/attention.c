/* One attention layer's work after its q/k/v matmul, for the CPU: RoPE on q and k, k and v written into the
 * KV cache, and causal grouped-query attention, in one call. On a decode step the arithmetic is tiny (one
 * query against a few hundred keys); the ~20 PyTorch ops that do the same (model.Attention.forward) cost
 * several times more in dispatch than in compute. Semantics are model.py's: HF's rotate-half RoPE, a query at
 * position p sees the cached keys at positions 0..p (and below kv_len), q head h reads kv head h / (H / Hkv).
 *
 * qkv: [B*T, (H + 2 Hkv) * D], each token's q, k, v; cos, sin: [B*T, D]; caches: [slots, Hkv, L, D];
 * slots: [B] cache slot of each batch row; pos: [B*T] positions; out: [B*T, H * D].
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

static void rope(const float *x, const float *cos, const float *sin, int64_t D, float *out) {
    const int64_t half = D / 2;
    for (int64_t i = 0; i < half; i++) {
        out[i] = x[i] * cos[i] - x[i + half] * sin[i];
        out[i + half] = x[i + half] * cos[i + half] + x[i] * sin[i + half];
    }
}

void attention(const float *qkv, int64_t B, int64_t T, int64_t H, int64_t Hkv, int64_t D, const float *cos,
               const float *sin, float *k_cache, float *v_cache, int64_t L, const int64_t *slots, const int64_t *pos,
               int64_t kv_len, float *out, int threads) {
    const int64_t width = (H + 2 * Hkv) * D, group = H / Hkv;
    float *q = malloc(sizeof(float) * (size_t)(B * T * H * D));
    /* every token's k and v go into the cache before any query reads it: a verify step's tokens see each other */
    for (int64_t bt = 0; bt < B * T; bt++) {
        const float *row = qkv + bt * width;
        for (int64_t h = 0; h < H; h++) rope(row + h * D, cos + bt * D, sin + bt * D, D, q + (bt * H + h) * D);
        for (int64_t h = 0; h < Hkv; h++) {
            const int64_t at = ((slots[bt / T] * Hkv + h) * L + pos[bt]) * D;
            rope(row + (H + h) * D, cos + bt * D, sin + bt * D, D, k_cache + at);
            for (int64_t i = 0; i < D; i++) v_cache[at + i] = row[(H + Hkv + h) * D + i];
        }
    }
    const float scale = 1.f / sqrtf((float)D);
#pragma omp parallel for collapse(2) num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t bt = 0; bt < B * T; bt++) {
        for (int64_t h = 0; h < H; h++) {
            const int64_t keys = (pos[bt] < kv_len - 1 ? pos[bt] : kv_len - 1) + 1;
            const float *qh = q + (bt * H + h) * D;
            const float *k = k_cache + (slots[bt / T] * Hkv + h / group) * L * D;
            const float *v = v_cache + (slots[bt / T] * Hkv + h / group) * L * D;
            float *scores = malloc(sizeof(float) * (size_t)keys), top = -INFINITY, total = 0.f;
            for (int64_t j = 0; j < keys; j++) {
                float dot = 0.f;
#pragma omp simd reduction(+ : dot) /* a vectorised sum: its order is not the loop's, which is fine here */
                for (int64_t i = 0; i < D; i++) dot += qh[i] * k[j * D + i];
                scores[j] = dot * scale;
                top = fmaxf(top, scores[j]);
            }
            float *o = out + (bt * H + h) * D;
            for (int64_t i = 0; i < D; i++) o[i] = 0.f;
            for (int64_t j = 0; j < keys; j++) {
                const float p = expf(scores[j] - top);
                total += p;
                for (int64_t i = 0; i < D; i++) o[i] += p * v[j * D + i];
            }
            for (int64_t i = 0; i < D; i++) o[i] /= total;
            free(scores);
        }
    }
    free(q);
}
