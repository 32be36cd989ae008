/* The recorded head of a decode step in one pass over each row (engine/head.py holds the contract).
 *
 * Per row of log-probs x [v] (float32, C order): the k largest entries, sorted descending, ties to
 * the lower id; the sampled id's entry; whether an entry is -inf.
 *   1. Each block of BLOCK entries' maximum, and the row's minimum. Floats are compared as integer
 *      keys of the same order (the sign bit flips the rest), so the compiler vectorizes the loop
 *      without relaxing IEEE semantics.
 *   2. t = the k-th largest block maximum. The k blocks holding the k largest maxima hold k entries
 *      >= t, so the row's k-th largest entry is >= t: only blocks whose maximum is >= t can hold a
 *      head entry, and of those only entries >= t are inserted into the sorted head.
 * A head slot no finite entry fills keeps -inf and id -1 (the caller cuts the head at the kept
 * support). A NaN never enters the head (a row holding one is not recorded).
 *
 * Built at install as an optional extension (pyproject.toml) and called through ctypes; on x86-64
 * GCC compiles an AVX2 clone beside the baseline one and picks one when the library loads.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define BLOCK 32

/* An integer of the same order as the float f (NaNs aside); its own inverse. */
static inline int32_t order_key(int32_t bits) { return bits ^ ((bits >> 31) & 0x7FFFFFFF); }

static inline int32_t key_of(float f) {
    f += 0.0f; /* -0.0 to 0.0: equal floats, one key */
    int32_t bits;
    memcpy(&bits, &f, sizeof bits);
    return order_key(bits);
}

static inline float float_of(int32_t key) {
    int32_t bits = order_key(key);
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* y into the sorted head (hv descending) after the entries equal to it; the last one drops out. */
static inline void insert(float *hv, int64_t *hi, int64_t k, float y, int64_t id) {
    int64_t p = k - 1;
    while (p > 0 && hv[p - 1] < y) {
        hv[p] = hv[p - 1];
        hi[p] = hi[p - 1];
        p--;
    }
    hv[p] = y;
    hi[p] = id;
}

/* The k-th largest of keys [n] (INT32_MIN if n < k); top [k] and kept [n] are scratch. The keys
 * are split into k groups: the least of the groups' maxima, k of the keys, bounds the k-th largest
 * from below, and only keys at or above it (about a third of them) are sorted into a top k. */
static int32_t kth_largest(const int32_t *keys, int64_t n, int64_t k, int32_t *top, int32_t *kept) {
    if (n < k)
        return INT32_MIN;
    int32_t bound = INT32_MAX;
    for (int64_t g = 0; g < k; g++) {
        int32_t m = INT32_MIN;
        for (int64_t i = g * n / k; i < (g + 1) * n / k; i++)
            m = keys[i] > m ? keys[i] : m;
        bound = m < bound ? m : bound;
    }
    int64_t n_kept = 0;
    for (int64_t i = 0; i < n; i++) {
        kept[n_kept] = keys[i];
        n_kept += keys[i] >= bound;
    }
    for (int64_t p = 0; p < k; p++)
        top[p] = INT32_MIN;
    for (int64_t i = 0; i < n_kept; i++) {
        if (kept[i] <= top[k - 1])
            continue;
        int64_t p = k - 1;
        while (p > 0 && top[p - 1] < kept[i]) {
            top[p] = top[p - 1];
            p--;
        }
        top[p] = kept[i];
    }
    return top[k - 1];
}

/* The calling convention below; engine/head.py loads no build of another. */
int64_t prodrl_head_abi(void) { return 1; }

/* Returns the number of rows holding a -inf entry (or a NaN of negative sign), -1 if k < 1 or
 * memory ran out, -2 if a sampled id is outside [0, v). */
#if defined(__x86_64__)
__attribute__((target_clones("avx2", "default")))
#endif
int64_t
prodrl_recorded_head(const float *logp, int64_t n, int64_t v, int64_t k, const int64_t *sampled,
                     float *values, int64_t *ids, float *sampled_logp) {
    if (k < 1 || v < 1)
        return -1;
    int64_t blocks = (v + BLOCK - 1) / BLOCK, removed = 0;
    int32_t *block_max = malloc((2 * blocks + k + v) * sizeof(int32_t));
    if (block_max == NULL)
        return -1;
    int32_t *chosen = block_max + blocks, *scratch = chosen + blocks, *candidates = scratch + k;
    int32_t minus_inf = key_of(-INFINITY);
    for (int64_t r = 0; r < n; r++) {
        const float *x = logp + r * v;
        float *hv = values + r * k;
        int64_t *hi = ids + r * k;
        int32_t lowest = INT32_MAX;
        for (int64_t b = 0; b < blocks; b++) {
            int64_t end = (b + 1) * BLOCK < v ? (b + 1) * BLOCK : v;
            int32_t high = INT32_MIN, low = INT32_MAX;
            for (int64_t j = b * BLOCK; j < end; j++) {
                int32_t q = key_of(x[j]);
                high = q > high ? q : high;
                low = q < low ? q : low;
            }
            block_max[b] = high;
            lowest = low < lowest ? low : lowest;
        }
        removed += lowest <= minus_inf;
        int32_t t = kth_largest(block_max, blocks, k, scratch, chosen);
        float floor = t == INT32_MIN ? -INFINITY : float_of(t); /* fewer blocks than k: no bound */
        for (int64_t p = 0; p < k; p++) {
            hv[p] = -INFINITY;
            hi[p] = -1;
        }
        /* the blocks, then the entries, that can hold a head entry: gathered without branches */
        int64_t n_chosen = 0, n_candidates = 0;
        for (int64_t b = 0; b < blocks; b++) {
            chosen[n_chosen] = (int32_t)b;
            n_chosen += block_max[b] >= t;
        }
        for (int64_t c = 0; c < n_chosen; c++) {
            int64_t b = chosen[c], end = (b + 1) * BLOCK < v ? (b + 1) * BLOCK : v;
            for (int64_t j = b * BLOCK; j < end; j++) {
                candidates[n_candidates] = (int32_t)j;
                n_candidates += x[j] >= floor;
            }
        }
        for (int64_t c = 0; c < n_candidates; c++) /* in id order: ties keep the lower ids */
            if (x[candidates[c]] > hv[k - 1])
                insert(hv, hi, k, x[candidates[c]], candidates[c]);
        if (sampled[r] < 0 || sampled[r] >= v) {
            removed = -2;
            break;
        }
        sampled_logp[r] = x[sampled[r]];
    }
    free(block_max);
    return removed;
}
