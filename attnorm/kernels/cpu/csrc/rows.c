/*
 * attnorm's native CPU row kernels: softmax of scaled rows (temperature and
 * Scalable-Softmax), alpha-entmax for any alpha >= 1 (sparsemax at alpha = 2), top-k
 * softmax and SA-Softmax, forward and backward, over contiguous rows.
 *
 * Built at first use by attnorm/kernels/cpu/build.py (plain C99 + OpenMP, no torch
 * headers, about a second of gcc) and called through ctypes with raw pointers by
 * attnorm/kernels/cpu/native.py, which implements the backend contract of
 * attnorm/kernels/README.md.  Python calls each kernel through its packed entry point
 * (the end of rows_impl.h): all arguments in one buffer of 8-byte slots, one ctypes
 * argument instead of 12 to 17 (ctypes converts each in Python, about 0.1 us apiece).  Rows are split across threads; each row is read from
 * memory once and written once, everything else happens in cache (a row of 32768
 * floats is 128 KiB).
 *
 * The kernels apply every row rule themselves (attnorm/kernels/rules.py); masked
 * positions arrive as -inf:
 *   - a row with no allowed (non -inf) score gives zeros;
 *   - a row holding +inf is uniform over its +inf positions (top-k: the first k);
 *   - a NaN score makes the whole row NaN;
 *   - finite scores never overflow: scaled scores are shifted first, m (x - max x)
 *     for m >= 0 and m (x - min x) for m < 0.
 * A soft cap (cap > 0; 0: off) replaces the scores by cap tanh(x / cap) as a kernel
 * reads them (-inf stays -inf); the backward passes take the raw scores and carry dx
 * through the cap's slope (rows_impl.h, "soft-capping").
 * Per-row parameters come as a double for all rows and an array in the row type with
 * one value per row that replaces it when not NULL; per-row outputs are written in the
 * row type (float rows: float).  Work below PARALLEL_MIN elements runs on the calling thread:
 * waking a thread team costs more than a few short rows.
 *
 * The element-wise exp/log below are plain C that gcc vectorises (glibc's are not
 * vectorised without -ffast-math, which would also break the inf/NaN rules).
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* exp for float: 2^n * e^r with |r| <= ln2/2, degree-7 Taylor polynomial (< 2 ulp).
 * Results below FLT_MIN (x < -87.3) are flushed to 0: negligible in a normalised
 * row, and it keeps the scaling to one exponent add.  -inf gives 0. */
static inline float exp_f32(float x) {
    const float hi = 88.7f, lo = -87.3f;
    float xc = x > hi ? hi : (x < lo ? lo : x);
    float n = __builtin_roundf(xc * 1.44269504088896341f);
    float r = xc - n * 0.693359375f;       /* ln2 split: exact high part ... */
    r = r - n * -2.12194440e-4f;           /* ... and the low part */
    float p = 1.0f / 5040;
    p = p * r + 1.0f / 720;
    p = p * r + 1.0f / 120;
    p = p * r + 1.0f / 24;
    p = p * r + 1.0f / 6;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    union { int32_t i; float f; } scale = {((int32_t)n + 127) << 23};
    return x < lo ? 0.0f : p * scale.f;
}

/* log for positive normal floats: e ln2 + log(m), m in [sqrt(1/2), sqrt(2)),
 * log(m) = 2 atanh(t), t = (m - 1) / (m + 1), |t| < 0.172 (< 2 ulp). */
static inline float log_f32(float x) {
    union { float f; int32_t i; } u = {x};
    int32_t e = ((u.i >> 23) & 0xff) - 127;
    u.i = (u.i & 0x007fffff) | 0x3f800000; /* mantissa in [1, 2) */
    float m = u.f;
    int big = m > 1.41421356f;
    m = big ? 0.5f * m : m;
    float ef = (float)(e + big);
    float t = (m - 1.0f) / (m + 1.0f);
    float t2 = t * t;
    float q = 2.0f / 9;
    q = q * t2 + 2.0f / 7;
    q = q * t2 + 2.0f / 5;
    q = q * t2 + 2.0f / 3;
    q = q * t2 + 2.0f;
    return ef * 0.693147180559945309f + t * q;
}

/* e^x - 1 for float without cancellation near 0: for |x| < 1/2 x (1 + x/2! + ... + x^8/9!)
 * (truncation below 1e-9 relative), else exp_f32(x) - 1 (at most a factor 1.6 lost to
 * the subtraction).  -inf gives -1, and so does anything below -87.3 (exp_f32's flush). */
static inline float expm1_f32(float x) {
    float p = 1.0f / 362880;
    p = p * x + 1.0f / 40320;
    p = p * x + 1.0f / 5040;
    p = p * x + 1.0f / 720;
    p = p * x + 1.0f / 120;
    p = p * x + 1.0f / 24;
    p = p * x + 1.0f / 6;
    p = p * x + 0.5f;
    p = p * x + 1.0f;
    return (x > -0.5f && x < 0.5f) ? x * p : exp_f32(x) - 1.0f;
}

/* base ** exponent for base > 0 (callers keep base = 0 out). */
static inline float pow_f32(float base, float exponent) {
    return exp_f32(exponent * log_f32(base > FLT_MIN ? base : FLT_MIN));
}

static inline double exp_f64(double x) { return exp(x); }
static inline double pow_f64(double base, double exponent) { return pow(base, exponent); }

/*
 * Appends the scores above `bound` to values and their positions to index;
 * returns how many.  AVX-512 compress-stores 16 (8) lanes at a time; elsewhere
 * a branch-free scalar loop.  Positions are int32 (the loader checks L < 2^31).
 */
#if defined(__AVX512F__) && defined(__AVX512VL__)
#include <immintrin.h>

static int64_t gather_above_f32(const float* x, int64_t length, float bound, float* values, int32_t* index) {
    int64_t count = 0, i = 0;
    const __m512 limit = _mm512_set1_ps(bound);
    __m512i position = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (; i + 16 <= length; i += 16) {
        __m512 v = _mm512_loadu_ps(x + i);
        __mmask16 above = _mm512_cmp_ps_mask(v, limit, _CMP_GT_OQ);
        _mm512_mask_compressstoreu_ps(values + count, above, v);
        _mm512_mask_compressstoreu_epi32(index + count, above, position);
        count += __builtin_popcount(above);
        position = _mm512_add_epi32(position, _mm512_set1_epi32(16));
    }
    for (; i < length; i++) {
        values[count] = x[i];
        index[count] = (int32_t)i;
        count += x[i] > bound;
    }
    return count;
}

static int64_t gather_above_f64(const double* x, int64_t length, double bound, double* values, int32_t* index) {
    int64_t count = 0, i = 0;
    const __m512d limit = _mm512_set1_pd(bound);
    __m256i position = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    for (; i + 8 <= length; i += 8) {
        __m512d v = _mm512_loadu_pd(x + i);
        __mmask8 above = _mm512_cmp_pd_mask(v, limit, _CMP_GT_OQ);
        _mm512_mask_compressstoreu_pd(values + count, above, v);
        _mm256_mask_compressstoreu_epi32(index + count, above, position);
        count += __builtin_popcount(above);
        position = _mm256_add_epi32(position, _mm256_set1_epi32(8));
    }
    for (; i < length; i++) {
        values[count] = x[i];
        index[count] = (int32_t)i;
        count += x[i] > bound;
    }
    return count;
}
#else
#define DEFINE_GATHER(REAL, SUFFIX)                                                                        \
    static int64_t gather_above_##SUFFIX(const REAL* x, int64_t length, REAL bound, REAL* values, int32_t* index) { \
        int64_t count = 0;                                                                                 \
        for (int64_t i = 0; i < length; i++) {                                                             \
            values[count] = x[i];                                                                          \
            index[count] = (int32_t)i;                                                                     \
            count += x[i] > bound;                                                                         \
        }                                                                                                  \
        return count;                                                                                      \
    }
DEFINE_GATHER(float, f32)
DEFINE_GATHER(double, f64)
#endif

/* Order-preserving keys: unsigned integers that compare as the floats do (NaN aside). */
static inline uint32_t key_f32(float v) {
    uint32_t bits;
    memcpy(&bits, &v, sizeof bits);
    return bits ^ ((uint32_t)((int32_t)bits >> 31) | 0x80000000u);
}

static inline float unkey_f32(uint32_t key) {
    uint32_t bits = key ^ ((key >> 31) ? 0x80000000u : 0xffffffffu);
    float v;
    memcpy(&v, &bits, sizeof v);
    return v;
}

static inline uint64_t key_f64(double v) {
    uint64_t bits;
    memcpy(&bits, &v, sizeof bits);
    return bits ^ ((uint64_t)((int64_t)bits >> 63) | 0x8000000000000000u);
}

static inline double unkey_f64(uint64_t key) {
    uint64_t bits = key ^ ((key >> 63) ? 0x8000000000000000u : 0xffffffffffffffffu);
    double v;
    memcpy(&v, &bits, sizeof v);
    return v;
}

/* What this build uses: 1 = OpenMP threads, 2 = AVX-512 gathers, 4 = AVX2. */
int attnorm_build_features(void) {
    int features = 0;
#ifdef _OPENMP
    features |= 1;
#endif
#if defined(__AVX512F__) && defined(__AVX512VL__)
    features |= 2;
#endif
#ifdef __AVX2__
    features |= 4;
#endif
    return features;
}

/* alpha-entmax's kernels: softmax at alpha = 1, closed forms for alpha = 2 and 1.5, pow otherwise. */
enum { SPARSEMAX = 0, ENTMAX15 = 1, GENERAL = 2, SOFTMAX = 3 };

static int entmax_kind(double alpha) {
    return alpha == 2.0 ? SPARSEMAX : (alpha == 1.5 ? ENTMAX15 : (alpha == 1.0 ? SOFTMAX : GENERAL));
}

/* What a row holds, as the shared rules see it (special_row). */
enum { ROW_FINITE = 0, ROW_NAN = 1, ROW_EMPTY = 2, ROW_POSINF = 3 };

#define PAD 16               /* candidate arrays are padded to whole 64-byte vectors */
#define SA_STATS 5           /* per-row numbers SA-Softmax's forward keeps for its backward */
#define MAX_GROUPS 256       /* position groups whose maxima bound entmax's threshold */
#define MAX_TOPK_GROUPS 4096 /* ... and top-k's k-th largest score (for k <= 2048) */
#define SMALL_SELECT 32      /* top-k's k-th largest of at most this many values: by insertion */
#define MAX_SUPPORT_STEPS 64 /* moves of entmax_anchored's support boundary (1 or 2 in practice) */

/* Position groups whose maxima bound top-k's k-th largest score: at least 2k (64 to MAX_TOPK_GROUPS). */
static int64_t topk_groups(int64_t k) {
    int64_t groups = 64;
    while (groups < 2 * k && groups < MAX_TOPK_GROUPS) groups *= 2;
    return groups;
}

/*
 * alpha-entmax (alpha > 2) weights of the candidate scores v[0..count) (doubles, any
 * order), overwriting v; they sum to 1.  At large alpha the weights of the smallest
 * support scores are y_j = (t_j - tau)^(1 / (alpha - 1)) of differences far below
 * the rounding of t_j and tau (alpha = 10, y = 0.02: t_j - tau = 5e-16), so they
 * are computed relative to the smallest support score r instead, where every
 * quantity is a sum of non-negative terms:
 *     y_j = (c_j + y_r^(alpha - 1))^(1 / (alpha - 1)),  c_j = (alpha - 1)(v_j - v_r) >= 0.
 * r is the smallest score whose mass test passes, sum_{v_j > v_r} c_j^(1/(alpha-1)) < 1
 * (decreasing in v_r), found by stepping from `start` (an estimate from the fast
 * threshold); then y_r solves g(y) = m y + sum_{c_j > 0} (c_j + y^(alpha-1))^(1/(alpha-1)) = 1
 * (m scores tied at v_r) by Newton's method safeguarded by bisection on [0, 1/m];
 * 1 <= g' <= count keeps it well conditioned.  Passes over the candidates: two per
 * boundary step and one per Newton step (typically 2 + 6), each with one pow per
 * candidate above r.
 */
static void entmax_anchored(double* v, int64_t count, double alpha, double start) {
    const double a = alpha - 1, p = 1 / a;
    double r = start, largest = -INFINITY;
    for (int64_t j = 0; j < count; j++) largest = v[j] > largest ? v[j] : largest;
    if (!(r <= largest)) r = largest;
    for (int step = 0; step < 2 * MAX_SUPPORT_STEPS; step++) {
        /* mass above r, and the neighbouring candidate scores below and above it */
        double mass = 0, below = -INFINITY, above = INFINITY;
        for (int64_t j = 0; j < count; j++) {
            double vj = v[j];
            if (vj > r) {
                mass += pow(a * (vj - r), p);
                above = vj < above ? vj : above;
            } else if (vj < r) {
                below = vj > below ? vj : below;
            }
        }
        if (mass >= 1) { /* r is outside the support: move up (r = largest has mass 0) */
            r = above;
            continue;
        }
        if (below == -INFINITY || step >= MAX_SUPPORT_STEPS) break;
        double below_mass = 0; /* does the next smaller score pass too? */
        for (int64_t j = 0; j < count; j++) below_mass += v[j] > below ? pow(a * (v[j] - below), p) : 0;
        if (below_mass >= 1) break;
        r = below;
    }
    double tied = 0;
    for (int64_t j = 0; j < count; j++) tied += v[j] == r;
    double low = 0, high = 1 / tied, y = high;
    for (int iteration = 0; iteration < 200; iteration++) {
        const double lifted = pow(y, a);
        double g = tied * y - 1, slope_sum = 0;
        for (int64_t j = 0; j < count; j++) {
            if (v[j] > r) {
                double base = a * (v[j] - r) + lifted;
                double w = pow(base, p);
                g += w;
                slope_sum += w / base;
            }
        }
        if (g >= 0) high = y;
        else low = y;
        if (fabs(g) <= 4 * DBL_EPSILON) break;
        double next = y - g / (tied + pow(y, a - 1) * slope_sum);
        if (!(next > low && next < high)) next = 0.5 * (low + high);
        if (next == y || high - low <= DBL_EPSILON * high) break;
        y = next;
    }
    const double lifted = pow(y, a);
    double total = 0;
    for (int64_t j = 0; j < count; j++) {
        double w = v[j] > r ? pow(a * (v[j] - r) + lifted, p) : (v[j] == r ? y : 0);
        v[j] = w;
        total += w;
    }
    for (int64_t j = 0; j < count; j++) v[j] /= total;
}

/* One argument of a packed call: a pointer, an integer (int64_t or int) or a double. */
typedef union {
    int64_t i;
    double d;
    void* p;
} attnorm_slot;

/* A packed call's buffer is its slot count, then the slots; copied out (the buffer need not
 * be aligned).  Returns 0 when the count is not `count`: Python and C disagree on a signature. */
static int unpack(const char* packed, attnorm_slot* slots, int64_t count) {
    int64_t given;
    memcpy(&given, packed, sizeof given);
    if (given != count) return 0;
    memcpy(slots, packed + sizeof given, count * sizeof *slots);
    return 1;
}
#define PACKED_MISMATCH (-1) /* what a packed entry point returns for a wrong slot count */

/* Parameter name for row r: name##_rows[r] when given, else the one value for all rows. */
#define ROW_PARAM(name, r) (name##_rows ? name##_rows[r] : name)
#define PARALLEL_MIN 4096
#define PARALLEL(rows, length) ((rows) > 1 && (rows) * (length) >= PARALLEL_MIN)
/* Run `call`, a function whose loop over the rows is an orphaned `omp for`, on a team of
 * `threads` (a variable of the caller) when PARALLEL, else straight on the calling thread
 * (the `omp for` then runs every row).  Not `omp parallel if (PARALLEL(...))`: entering a
 * region costs ~0.5 us even when its if() makes it serial, a third of a 4x16 sparsemax. */
#define ON_TEAM(rows, length, ...)                                         \
    do {                                                                   \
        if (PARALLEL(rows, length)) {                                      \
            _Pragma("omp parallel num_threads(threads)") { __VA_ARGS__; } \
        } else {                                                           \
            __VA_ARGS__;                                                   \
        }                                                                  \
    } while (0)

#define CAT_(a, b) a##_##b
#define CAT(a, b) CAT_(a, b)

/* double first: the float kernels call its entmax threshold for alpha close to 1. */
#define REAL double
#define KEY uint64_t
#define SUFFIX f64
#define EXP exp_f64
#define EXPM1 expm1
#define LOG log
#define POW pow_f64
#define SQRT sqrt
#define EPS DBL_EPSILON
#define SQRT_EPS 1.4901161193847656e-8 /* sqrt(DBL_EPSILON) */
#define REAL_MAX DBL_MAX
#define NEXT_BELOW(v) nextafter(v, -INFINITY)
#define WIDE_ENTMAX 0
#include "rows_impl.h"
#undef REAL
#undef KEY
#undef SUFFIX
#undef EXP
#undef EXPM1
#undef LOG
#undef POW
#undef SQRT
#undef EPS
#undef SQRT_EPS
#undef REAL_MAX
#undef NEXT_BELOW
#undef WIDE_ENTMAX

#define REAL float
#define KEY uint32_t
#define SUFFIX f32
#define EXP exp_f32
#define EXPM1 expm1_f32
#define LOG log_f32
#define POW pow_f32
#define SQRT sqrtf /* not sqrt: a double round trip per element */
#define EPS FLT_EPSILON
#define SQRT_EPS 3.4526698e-4 /* sqrt(FLT_EPSILON) */
#define REAL_MAX FLT_MAX
#define NEXT_BELOW(v) nextafterf(v, -INFINITY)
#define WIDE_ENTMAX 1 /* 1 < alpha < 1.1: the threshold and weights in double */
#include "rows_impl.h"
