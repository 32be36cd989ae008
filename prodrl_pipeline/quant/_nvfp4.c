/* NVFP4 activations in one pass over each block of 16 (quant/w4a4.py holds the contract and the
 * torch expression this computes bit for bit; tests/quant/test_w4a4.py checks both).
 *
 * For x [n * 16] (float32, C order) and the per-tensor scale s, per block:
 *   raw = max|x| / (6 s)   (fp32: 6 s first, then the division, as torch)
 *   sb  = e4m3(raw == 0 ? 1 : clamp(raw, 2^-9, 448))   (round to nearest, ties to even)
 *   each element: y = x / (sb s); q = the nearest E2M1 magnitude of |y| (ties to the even code,
 *   saturating at 6), negative when y < 0; x_hat = q * (sb s).
 * A block holding a NaN gives NaN (torch: its amax, so its scale, is NaN). Every product and quotient
 * is one IEEE operation, none fused, none reordered (pyproject.toml compiles it with -fno-fast-math
 * -ffp-contract=off).
 *
 * Built at install as an optional extension (pyproject.toml) and called through ctypes.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define BLOCK 16

int64_t prodrl_nvfp4_abi(void) { return 1; }

/* v in [2^-9, 448] to the nearest E4M3 (fn) value, ties to even: steps of 2^-9 below 2^-6 (the
 * subnormals: adding 2^23 to v 2^9 < 8 rounds it to an integer), 3 mantissa bits from 2^-6 on (the
 * float's 23 cut to 3 by adding half their last step, less one unless the kept bit is odd). */
static inline float e4m3(float v) {
    if (v < 0x1p-6f) return (v * 512.0f + 0x1p23f - 0x1p23f) / 512.0f;
    uint32_t bits;
    memcpy(&bits, &v, sizeof bits);
    bits = (bits + 0x7FFFFu + ((bits >> 20) & 1u)) & ~0xFFFFFu;
    memcpy(&v, &bits, sizeof v);
    return v;
}

/* The E2M1 magnitude nearest a >= 0 (codes 0-7: 0 0.5 1 1.5 2 3 4 6), a tie to the even code (the
 * value 0, 1, 2 or 4), saturating at 6: the steps passed, each boundary on the side its tie falls.
 * Branch-free, so that it vectorizes. */
static inline float e2m1(float a) {
    return 0.5f * ((a > 0.25f) + (a >= 0.75f) + (a > 1.25f) + (a >= 1.75f)) + (float)(a > 2.5f) +
           (float)(a >= 3.5f) + 2.0f * (a > 5.0f);
}

#if defined(__x86_64__)
__attribute__((target_clones("avx2", "default")))
#endif
void prodrl_nvfp4_dequantized(const float *x, int64_t blocks, float s, float *out) {
    const float divisor = 6.0f * s;
    for (int64_t b = 0; b < blocks; b++) {
        const float *xb = x + b * BLOCK;
        float *ob = out + b * BLOCK;
        float amax = 0.0f;
        int nan = 0;
        for (int i = 0; i < BLOCK; i++) {
            float a = fabsf(xb[i]);
            nan |= a != a;
            amax = a > amax ? a : amax;
        }
        if (nan) {
            for (int i = 0; i < BLOCK; i++) ob[i] = NAN;
            continue;
        }
        float raw = amax / divisor;
        float sb = raw == 0.0f ? 1.0f : e4m3(raw < 0x1p-9f ? 0x1p-9f : raw > 448.0f ? 448.0f : raw);
        float scale = sb * s;
        for (int i = 0; i < BLOCK; i++) {
            float y = xb[i] / scale;
            ob[i] = ((y < 0.0f ? -1.0f : 1.0f) * e2m1(fabsf(y))) * scale; /* (+-q) * scale */
        }
    }
}
