/* The recorded head of a decode step in one pass over each row (engine/head.py holds the contract).
 *
 * Per row of log-probs x [v] (float32, C order): the k largest entries, sorted descending, ties to
 * the lower id; the sampled id's entry; whether an entry is -inf.
 *   1. Each block of BLOCK entries' maximum, and the row's minimum. Floats are compared as integer
 *      keys of the same order (the sign bit flips the rest), so the compiler vectorizes the loop
 *      without relaxing IEEE semantics.
 *   2. A bound t on the k-th largest block maximum from a histogram of the maxima (kth_bound): at
 *      least k blocks have a maximum >= t, so the row's k-th largest entry is >= t, and every entry
 *      of the head (ties at the k-th value included) lies in a block whose maximum is >= t.
 *   3. The entries >= t of those blocks are the candidates (about k + 1 on a decode step's row);
 *      each one's place in the head is counted: the candidates above it, and those equal to it
 *      with lower ids. More than RANKED candidates (a flat row) are inserted one by one instead.
 * A head slot no finite entry fills keeps -inf and id -1 (the caller cuts the head at the kept
 * support). A NaN never enters the head (a row holding one is not recorded).
 *
 * Built at install as an optional extension (pyproject.toml) and called through ctypes; on x86-64
 * GCC compiles an AVX2 clone beside the baseline one and picks one when the library loads.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define BLOCK 32
#define BUCKET_BITS 6
#define BUCKETS (1 << BUCKET_BITS)
#define RANKED 64 /* up to this many candidates are placed by counting, more are inserted */

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

/* A bound t on the k-th largest of keys [n] (n >= k): at least k keys are >= t, and few more. A
 * radix select: the keys' range is cut into BUCKETS buckets of a power-of-two width, and the bucket
 * holding the k-th largest key is cut again while more than 2k keys lie at or above its start (a
 * -inf block maximum, from a mask, stretches the first range over every finite one). t is the
 * least key at or above the last bucket's start. */
static inline int32_t kth_bound(const int32_t *keys, int64_t n, int64_t k) {
    int32_t lo = INT32_MAX, hi = INT32_MIN;
    for (int64_t i = 0; i < n; i++) {
        lo = keys[i] < lo ? keys[i] : lo;
        hi = keys[i] > hi ? keys[i] : hi;
    }
    /* keys as offsets from lo; the range looked at is [start, start + span], `above` keys above it */
    uint32_t start = 0, span = (uint32_t)hi - (uint32_t)lo, edge;
    int64_t above = 0;
    for (;;) {
        /* the buckets' width, 2^shift: span >> shift < BUCKETS */
        int shift = span < BUCKETS ? 0 : 32 - __builtin_clz(span) - BUCKET_BITS;
        int32_t count[BUCKETS] = {0};
        for (int64_t i = 0; i < n; i++) {
            uint32_t d = (uint32_t)keys[i] - (uint32_t)lo - start; /* wraps above span if below start */
            int inside = d <= span;
            count[inside ? d >> shift : 0] += inside;
        }
        int64_t b = BUCKETS - 1, seen = above + count[b];
        while (seen < k)
            seen += count[--b];
        edge = start + ((uint32_t)b << shift);
        if (shift == 0 || seen <= 2 * k)
            break;
        above = seen - count[b];
        start = edge;
        span = ((uint32_t)1 << shift) - 1;
    }
    int32_t t = INT32_MAX;
    for (int64_t i = 0; i < n; i++) {
        int32_t y = (uint32_t)keys[i] - (uint32_t)lo >= edge ? keys[i] : INT32_MAX;
        t = y < t ? y : t;
    }
    return t;
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
    /* block maxima, chosen blocks, candidates' ids, and their values (padded to a multiple of 8) */
    int32_t *block_max = malloc((2 * blocks + v) * sizeof(int32_t) + (v + 8) * sizeof(float));
    if (block_max == NULL)
        return -1;
    int32_t *chosen = block_max + blocks, *candidates = chosen + blocks;
    float *cv = (float *)(candidates + v);
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
        int32_t t = blocks < k ? INT32_MIN : kth_bound(block_max, blocks, k);
        float floor = t == INT32_MIN ? -INFINITY : float_of(t); /* fewer blocks than k: no bound */
        float least = floor > -FLT_MAX ? floor : -FLT_MAX; /* a -inf entry is never a candidate */
        for (int64_t p = 0; p < k; p++) {
            hv[p] = -INFINITY;
            hi[p] = -1;
        }
        /* the blocks that can hold a head entry (gathered without branches), then their entries
         * >= floor, in id order: a mask of the block's comparisons, read bit by bit */
        int64_t n_chosen = 0, m = 0;
        for (int64_t b = 0; b < blocks; b++) {
            chosen[n_chosen] = (int32_t)b;
            n_chosen += block_max[b] >= t;
        }
        for (int64_t c = 0; c < n_chosen; c++) {
            int64_t start = (int64_t)chosen[c] * BLOCK;
            if (start + BLOCK <= v) {
                uint32_t mask = 0;
                for (int j = 0; j < BLOCK; j++)
                    mask |= (uint32_t)(x[start + j] >= least) << j;
                for (; mask; mask &= mask - 1) {
                    int64_t j = start + __builtin_ctz(mask);
                    candidates[m] = (int32_t)j;
                    cv[m++] = x[j];
                }
            } else { /* the row's last, short block */
                for (int64_t j = start; j < v; j++) {
                    candidates[m] = (int32_t)j;
                    cv[m] = x[j];
                    m += x[j] >= least;
                }
            }
        }
        if (m <= RANKED) { /* a candidate's place: those above it, and those equal with lower ids */
            int64_t padded = (m + 7) & ~(int64_t)7;
            for (int64_t j = m; j < padded; j++)
                cv[j] = -INFINITY; /* below every candidate */
            for (int64_t i = 0; i < m; i++) {
                float y = cv[i];
                int32_t place = 0;
                for (int32_t j = 0; j < padded; j++)
                    place += (cv[j] > y) | ((cv[j] == y) & (j < i));
                if (place < k) {
                    hv[place] = y;
                    hi[place] = candidates[i];
                }
            }
        } else { /* many ties at the bound (a flat row) */
            for (int64_t c = 0; c < m; c++)
                if (cv[c] > hv[k - 1])
                    insert(hv, hi, k, cv[c], candidates[c]);
        }
        if (sampled[r] < 0 || sampled[r] >= v) {
            removed = -2;
            break;
        }
        sampled_logp[r] = x[sampled[r]];
    }
    free(block_max);
    return removed;
}
