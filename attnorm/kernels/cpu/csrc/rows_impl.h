/*
 * Row kernels for one floating type, included by rows.c once per type with
 * REAL (float or double), SUFFIX (f32, f64), EXP, POW, EPS and NEXT_BELOW defined.
 * Sums over a row are accumulated in double, except sums of exponentials (terms in (0, 1]).
 */
#define FN(name) CAT(name, SUFFIX)

/* Largest score, and whether the row must go to the reference (a NaN or +inf
 * score, or nothing but -inf). */
static int FN(scan_row)(const REAL* x, int64_t length, REAL* top) {
    REAL high = -INFINITY;
    int flag = 0;
#pragma omp simd reduction(max : high) reduction(| : flag)
    for (int64_t i = 0; i < length; i++) {
        REAL xi = x[i];
        high = xi > high ? xi : high;
        flag |= (xi != xi) | (xi == INFINITY);
    }
    *top = high;
    return flag | (high == -INFINITY);
}

/* Smallest finite score (-inf scores are masked). */
static REAL FN(smallest_finite)(const REAL* x, int64_t length) {
    REAL low = INFINITY;
#pragma omp simd reduction(min : low)
    for (int64_t i = 0; i < length; i++) {
        REAL finite = x[i] == -INFINITY ? INFINITY : x[i];
        low = finite < low ? finite : low;
    }
    return low;
}

/* Maxima of `groups` interleaved position classes (i mod groups), the row maximum,
 * and scan_row's flag.  A vertical max over blocks: vectorises across the groups. */
static int FN(scan_groups)(const REAL* x, int64_t length, int64_t groups, REAL* group_max, REAL* top) {
    for (int64_t j = 0; j < groups; j++) group_max[j] = -INFINITY;
    int flag = 0;
    for (int64_t start = 0; start < length; start += groups) {
        const REAL* block = x + start;
        int64_t width = length - start < groups ? length - start : groups;
#pragma omp simd reduction(| : flag)
        for (int64_t j = 0; j < width; j++) {
            REAL xi = block[j];
            group_max[j] = xi > group_max[j] ? xi : group_max[j];
            flag |= (xi != xi) | (xi == INFINITY);
        }
    }
    REAL high = -INFINITY;
#pragma omp simd reduction(max : high)
    for (int64_t j = 0; j < groups; j++) high = group_max[j] > high ? group_max[j] : high;
    *top = high;
    return flag | (high == -INFINITY);
}

/* ---- softmax(scale * x) ------------------------------------------------------- */

static void FN(softmax_row)(const REAL* x, REAL* y, int64_t length, REAL scale, uint8_t* bad) {
    REAL top;
    int flag = FN(scan_row)(x, length, &top);
    /* the largest scaled score comes from the largest score, or the smallest when the scale is negative */
    REAL anchor = scale > 0 ? top : (scale < 0 && !flag ? FN(smallest_finite)(x, length) : 0);
    if (flag || !(scale * anchor > -INFINITY && scale * anchor < INFINITY)) { /* scaled scores overflow: left to the reference */
        memset(y, 0, length * sizeof(REAL));
        *bad = 1;
        return;
    }
    *bad = 0;
    REAL total = 0; /* summed in SIMD lanes: pairwise-like rounding */
    if (scale > 0) { /* -inf scores give exp(-inf) = 0 */
#pragma omp simd reduction(+ : total)
        for (int64_t i = 0; i < length; i++) {
            REAL e = EXP(scale * (x[i] - anchor)); /* the difference first: exact for nearby scores */
            y[i] = e;
            total += e;
        }
    } else {
#pragma omp simd reduction(+ : total)
        for (int64_t i = 0; i < length; i++) {
            REAL e = x[i] == -INFINITY ? 0 : EXP(scale * (x[i] - anchor));
            y[i] = e;
            total += e;
        }
    }
    REAL inverse = 1 / total;
#pragma omp simd
    for (int64_t i = 0; i < length; i++) y[i] *= inverse;
}

/* grad_x = scale * y * (g - sum(y g)): softmax's Jacobian, times the chain-rule scale. */
static void FN(softmax_grad_row)(const REAL* y, const REAL* g, REAL* gx, int64_t length, REAL scale) {
    double dot = 0;
#pragma omp simd reduction(+ : dot)
    for (int64_t i = 0; i < length; i++) dot += (double)y[i] * g[i];
    REAL mean = (REAL)dot;
#pragma omp simd
    for (int64_t i = 0; i < length; i++) gx[i] = scale * y[i] * (g[i] - mean);
}

/* ---- Self-Adjusted Softmax (Zheng et al., 2025) -------------------------------- */

/*
 * y = phi(x) softmax(x), phi(x) = x (plain) or (x - low) / (high - low) with
 * low = min(min x, 0), high = max(max x, 0) over the finite scores (normalized;
 * phi = 0 when high = low).  stats receives SA_STATS numbers per row for the
 * backward: (max x, log sum exp(x - max x), low, high, gate); the gate is 0 in
 * flagged rows, whose gradient is 0 here.  The exponentials are computed twice
 * (sum, then weights) so that y may be x.
 */
static void FN(self_adjusted_row)(const REAL* x, REAL* y, int64_t length, int normalized, double* stats, uint8_t* bad) {
    REAL top;
    if (FN(scan_row)(x, length, &top)) {
        memset(y, 0, length * sizeof(REAL));
        memset(stats, 0, SA_STATS * sizeof(double));
        *bad = 1;
        return;
    }
    *bad = 0;
    REAL low = 0, high = 0, inverse_span = 0;
    if (normalized) {
        REAL smallest = FN(smallest_finite)(x, length);
        low = smallest < 0 ? smallest : 0;
        high = top > 0 ? top : 0;
        inverse_span = high > low ? 1 / (high - low) : 0;
    }
    REAL total = 0;
#pragma omp simd reduction(+ : total)
    for (int64_t i = 0; i < length; i++) total += EXP(x[i] - top);
    REAL inverse = 1 / total;
#pragma omp simd
    for (int64_t i = 0; i < length; i++) {
        REAL xi = x[i];
        REAL factor = normalized ? (xi - low) * inverse_span : xi;
        y[i] = xi == -INFINITY ? 0 : factor * EXP(xi - top) * inverse;
    }
    stats[0] = top;
    stats[1] = log((double)total);
    stats[2] = low;
    stats[3] = high;
    stats[4] = 1;
}

/*
 * With w = softmax(x), P = sum(g phi w), Q = sum(g w):
 * dx_j = w_j (g_j phi_j - P) + g_j w_j phi', phi' = 1 (plain) or 1 / span plus the
 * paths through low and high: (P - Q) / span shared by the positions attaining
 * low, -P / span by those attaining high (as torch's amin/amax and clamp share them).
 * w = exp((x - max x) - log sum): the difference first, exact for nearby scores.
 */
static void FN(self_adjusted_grad_row)(const REAL* x, const REAL* g, REAL* gx, int64_t length, int normalized,
                                       const double* stats) {
    if (stats[4] == 0) {
        memset(gx, 0, length * sizeof(REAL));
        return;
    }
    const REAL top = (REAL)stats[0], log_total = (REAL)stats[1], low = (REAL)stats[2], high = (REAL)stats[3];
    const REAL inverse_span = normalized && high > low ? 1 / (high - low) : 0;
    double phi_g_w = 0, g_w = 0;
    int64_t at_low = 0, at_high = 0;
#pragma omp simd reduction(+ : phi_g_w, g_w, at_low, at_high)
    for (int64_t i = 0; i < length; i++) {
        REAL xi = x[i];
        int allowed = xi > -INFINITY;
        REAL w = allowed ? EXP((xi - top) - log_total) : 0;
        REAL factor = normalized ? (xi - low) * inverse_span : xi;
        REAL weighted_g = allowed ? g[i] * w : 0;
        phi_g_w += allowed ? weighted_g * factor : 0;
        g_w += weighted_g;
        at_low += allowed && xi == low;
        at_high += allowed && xi == high;
    }
    const REAL P = (REAL)phi_g_w;
    const REAL through_low = inverse_span > 0 ? (REAL)(phi_g_w - g_w) * inverse_span / (at_low > 0 ? at_low : 1) : 0;
    const REAL through_high = inverse_span > 0 ? P * inverse_span / (at_high > 0 ? at_high : 1) : 0;
    const REAL slope = normalized ? inverse_span : 1;
#pragma omp simd
    for (int64_t i = 0; i < length; i++) {
        REAL xi = x[i];
        int allowed = xi > -INFINITY;
        REAL w = allowed ? EXP((xi - top) - log_total) : 0;
        REAL factor = normalized ? (xi - low) * inverse_span : xi;
        REAL dx = w * (g[i] * factor - P) + g[i] * w * slope;
        dx += (xi == low ? through_low : 0) - (xi == high ? through_high : 0);
        gx[i] = allowed ? dx : 0;
    }
}

/* ---- alpha-entmax ------------------------------------------------------------- */

/* Mass f(tau) = sum_j max(t_j - tau, 0)^p over the candidates, -f'(tau) and f''(tau). */
static void FN(entmax_mass)(REAL* t, int64_t count, REAL tau, REAL p, int kind, double* mass, double* slope,
                            double* curvature) {
    double f = 0, df = 0, f2 = 0;
    /* Padded with -inf (no mass) to whole vectors: a scalar remainder loop would
     * pay for pow one lane at a time. */
    const int64_t padded = (count + PAD - 1) / PAD * PAD;
    for (int64_t j = count; j < padded; j++) t[j] = -INFINITY;
    count = padded;
    if (kind == SPARSEMAX) {
#pragma omp simd reduction(+ : f, df)
        for (int64_t j = 0; j < count; j++) {
            REAL d = t[j] - tau;
            f += d > 0 ? d : 0;
            df += d > 0 ? 1 : 0;
        }
    } else if (kind == ENTMAX15) {
#pragma omp simd reduction(+ : f, df, f2)
        for (int64_t j = 0; j < count; j++) {
            REAL d = t[j] - tau;
            f += d > 0 ? d * d : 0;
            df += d > 0 ? 2 * d : 0;
            f2 += d > 0 ? 2 : 0;
        }
    } else {
#pragma omp simd reduction(+ : f, df, f2)
        for (int64_t j = 0; j < count; j++) {
            REAL d = t[j] - tau;
            REAL w = d > 0 ? POW(d > 0 ? d : 1, p) : 0;
            REAL w_over_d = d > 0 ? w / d : 0;
            f += w;
            df += w_over_d;
            f2 += d > 0 ? w_over_d / d : 0;
        }
        df *= p;
        f2 *= p * (p - 1);
    }
    *mass = f;
    *slope = df;
    *curvature = f2;
}

/* Weights max(t_j - tau, 0)^p written over the candidates; returns their sum. */
static double FN(entmax_weights)(REAL* t, int64_t count, REAL tau, REAL p, int kind) {
    double total = 0;
    const int64_t padded = (count + PAD - 1) / PAD * PAD; /* as in entmax_mass */
    for (int64_t j = count; j < padded; j++) t[j] = -INFINITY;
    count = padded;
    if (kind == GENERAL) {
#pragma omp simd reduction(+ : total)
        for (int64_t j = 0; j < count; j++) {
            REAL d = t[j] - tau;
            REAL w = d > 0 ? POW(d > 0 ? d : 1, p) : 0;
            t[j] = w;
            total += w;
        }
    } else {
#pragma omp simd reduction(+ : total)
        for (int64_t j = 0; j < count; j++) {
            REAL d = t[j] - tau;
            d = d > 0 ? d : 0;
            REAL w = kind == SPARSEMAX ? d : d * d;
            t[j] = w;
            total += w;
        }
    }
    return total;
}

/* The threshold tau of candidates t[0..count): sum_j max(t_j - tau, 0)^p = 1 with
 * p = 1 / (alpha - 1), starting from a lower bound `low` (mass >= 1 there); see
 * entmax_row.  With `index`, candidates at or below a proven lower bound are
 * dropped from t and index as it rises.  Stores the final lower bound in *low. */
static double FN(entmax_threshold)(REAL* t, int32_t* index, int64_t* count_io, double alpha, int kind, double* low,
                                   int iterations) {
    int64_t count = *count_io;
    const REAL p = (REAL)(1 / (alpha - 1));
    double high = -pow((double)count, 1.0 - alpha); /* each candidate has mass <= 1 / count there */
    double tau = alpha <= 2 ? *low : high, residual_before = INFINITY;
    for (int iteration = 0; iteration < iterations && high > *low; iteration++) {
        double f, df, f2;
        FN(entmax_mass)(t, count, (REAL)tau, p, kind, &f, &df, &f2);
        double previous_low = *low, residual = fabs(f - 1);
        if (f >= 1) *low = tau;
        else high = tau;
        if (residual <= 8 * EPS) break;
        /* Halley's step (Newton's where f'' = 0: sparsemax, Michelot's exact update) */
        double next = tau + 2 * (f - 1) * df / (2 * df * df - (f - 1) * f2);
        /* Bisect when the step leaves the bracket or the residual stalls: a score
         * just above tau makes the curvature (alpha > 2: the slope too) blow up
         * and the steps vanish far from the root. */
        int stalled = residual > 0.5 * residual_before || (REAL)next == (REAL)tau;
        if (!(next > *low && next < high) || (stalled && residual > SQRT_EPS)) next = 0.5 * (*low + high);
        if ((REAL)next == (REAL)tau) break; /* at the resolution of REAL: the residual is rounding noise */
        residual_before = residual;
        tau = next;
        if (index && *low > previous_low) {
            int64_t kept = 0;
            for (int64_t j = 0; j < count; j++) { /* branch-free compaction */
                t[kept] = t[j];
                index[kept] = index[j];
                kept += t[j] > *low;
            }
            count = kept;
        }
    }
    *count_io = count;
    return tau;
}

/*
 * entmax_alpha(x) = max((alpha - 1) x - tau, 0)^(1 / (alpha - 1)) with tau such that
 * the weights sum to 1.  With t = (alpha - 1)(x - max x) the threshold lies in
 * [-1, -n^(1 - alpha)] for n candidates.  A subset's threshold is a lower bound
 * (fewer terms, less mass), so for alpha <= 2 three steps on the maxima of
 * interleaved position groups raise -1 first; the candidates are the scores above
 * that bound, usually a few times the support.  On them, Halley's method (cubic
 * convergence; the mass is smooth between support changes) safeguarded by
 * bisection, starting from the lower end for alpha <= 2 (convex mass) and from the
 * upper end above.  For sparsemax the curvature is 0 and the step is Newton's,
 * which is Michelot's exact update and ends on the exact threshold; otherwise the
 * iteration stops once the mass is within a few ulps of 1, and the weights are
 * renormalised.
 */
static void FN(entmax_row)(const REAL* x, REAL* y, int64_t length, double alpha, REAL* t, int32_t* index, uint8_t* bad) {
    REAL group_max[MAX_GROUPS], subset[MAX_GROUPS], top;
    const int64_t groups = length > 8192 ? MAX_GROUPS : 64;
    if (FN(scan_groups)(x, length, groups, group_max, &top)) {
        memset(y, 0, length * sizeof(REAL));
        *bad = 1;
        return;
    }
    *bad = 0;
    const REAL scale = (REAL)(alpha - 1);
    const int kind = entmax_kind(alpha);
    double low = -1.0;
    if (alpha <= 2 && length >= 4 * groups) { /* on short rows the subset would cost more than it saves */
        int64_t count = groups;
#pragma omp simd
        for (int64_t j = 0; j < groups; j++) subset[j] = scale * (group_max[j] - top);
        FN(entmax_threshold)(subset, NULL, &count, alpha, kind, &low, 3);
        low = low - 4 * EPS > -1.0 ? low - 4 * EPS : -1.0; /* slack for the rounding of the subset's mass */
    }
    int64_t count = FN(gather_above)(x, length, top + (REAL)(low / scale), t, index);
#pragma omp simd
    for (int64_t j = 0; j < count; j++) t[j] = scale * (t[j] - top);
    memset(y, 0, length * sizeof(REAL)); /* after the gather: y may be x */
    double tau = FN(entmax_threshold)(t, index, &count, alpha, kind, &low, 100);
    REAL inverse = (REAL)(1.0 / FN(entmax_weights)(t, count, (REAL)tau, (REAL)(1 / (alpha - 1)), kind));
    for (int64_t j = 0; j < count; j++) y[index[j]] = t[j] * inverse;
}

/*
 * d/d alpha of sum_i g_i y_i, from the output: with beta = 1 / (alpha - 1),
 * S_i = y_i (beta - log y_i) and s_i = y_i^(2 - alpha) on the support,
 * beta (sum g S - sum g s * sum S / sum s)  (as attnorm.kernels.sparse derives it).
 */
static double FN(entmax_alpha_grad_row)(const REAL* y, const REAL* g, int64_t length, double alpha, double slope_total,
                                        double slope_dot) {
    const double beta = 1 / (alpha - 1);
    double entropy_total = 0, entropy_dot = 0;
    for (int64_t i = 0; i < length; i++) {
        if (y[i] > 0) {
            double term = y[i] * (beta - log((double)y[i]));
            entropy_total += term;
            entropy_dot += term * g[i];
        }
    }
    return slope_total > 0 ? beta * (entropy_dot - slope_dot * entropy_total / slope_total) : 0;
}

/* grad_x = s * (g - sum(s g) / sum(s)), s = y^(2 - alpha) on the support and 0
 * off it: entmax's Jacobian.  For general alpha the support is gathered first
 * (into `index`, s into `slope`) so that pow runs there only.  With
 * alpha_grad, also the row's alpha derivative (entmax_alpha_grad_row). */
static void FN(entmax_grad_row)(const REAL* y, const REAL* g, REAL* gx, int64_t length, double alpha, int32_t* index,
                                REAL* slope, double* alpha_grad) {
    const int kind = entmax_kind(alpha);
    double slope_total = 0, dot = 0;
    if (kind != GENERAL) { /* cheap slopes: two vectorised passes over the row */
        if (kind == SPARSEMAX) {
#pragma omp simd reduction(+ : slope_total, dot)
            for (int64_t i = 0; i < length; i++) {
                REAL s = y[i] > 0;
                gx[i] = s;
                slope_total += s;
                dot += (double)s * g[i];
            }
        } else {
#pragma omp simd reduction(+ : slope_total, dot)
            for (int64_t i = 0; i < length; i++) {
                REAL s = sqrt(y[i]);
                gx[i] = s;
                slope_total += s;
                dot += (double)s * g[i];
            }
        }
        REAL mean = slope_total > 0 ? (REAL)(dot / slope_total) : 0;
#pragma omp simd
        for (int64_t i = 0; i < length; i++) gx[i] = gx[i] * (g[i] - mean);
    } else { /* pow on the support only */
        int64_t count = FN(gather_above)(y, length, 0, slope, index);
        memset(gx, 0, length * sizeof(REAL));
        const REAL power = (REAL)(2 - alpha);
        const int64_t padded = (count + PAD - 1) / PAD * PAD; /* whole vectors for pow; the sums stop at count */
        for (int64_t j = count; j < padded; j++) slope[j] = 1;
#pragma omp simd
        for (int64_t j = 0; j < padded; j++) slope[j] = POW(slope[j], power);
#pragma omp simd reduction(+ : slope_total, dot)
        for (int64_t j = 0; j < count; j++) {
            slope_total += slope[j];
            dot += (double)slope[j] * g[index[j]];
        }
        REAL mean = slope_total > 0 ? (REAL)(dot / slope_total) : 0;
        for (int64_t j = 0; j < count; j++) gx[index[j]] = slope[j] * (g[index[j]] - mean);
    }
    if (alpha_grad) *alpha_grad = FN(entmax_alpha_grad_row)(y, g, length, alpha, slope_total, dot);
}

/* ---- top-k softmax ------------------------------------------------------------ */

/*
 * The k-th largest (1 <= k <= n) of v[0..n), with multiplicity: a radix select on
 * order-preserving integer keys, one bit at a time from the top.  Each step counts
 * the remaining keys with the bit set (a vectorised count), keeps the half that
 * holds the answer, and stops as soon as the answer is the largest or the smallest
 * of what remains.  No branches on the data beyond one per bit.
 */
static REAL FN(kth_largest)(const REAL* v, int64_t n, int64_t k, KEY* keys) {
    for (int64_t i = 0; i < n; i++) keys[i] = CAT(key, SUFFIX)(v[i]);
    int64_t size = n, rank = k; /* the answer is the rank-th largest of keys[0..size) */
    for (int bit = 8 * (int)sizeof(KEY) - 1; bit >= 0 && rank != 1 && rank != size; bit--) {
        KEY any = 0, all = ~(KEY)0;
#pragma omp simd reduction(| : any) reduction(& : all)
        for (int64_t i = 0; i < size; i++) {
            any |= keys[i];
            all &= keys[i];
        }
        const KEY differ = any ^ all; /* skip the bits every key agrees on */
        if (differ == 0) break;       /* all equal */
        while (!((differ >> bit) & 1)) bit--;
        const KEY mask = (KEY)1 << bit;
        int32_t set = 0; /* n < 2^31 (checked by the loader) */
#pragma omp simd reduction(+ : set)
        for (int64_t i = 0; i < size; i++) set += (keys[i] & mask) != 0;
        const int keep_set = set >= rank;
        int64_t kept = 0;
        for (int64_t i = 0; i < size; i++) { /* branch-free compaction */
            keys[kept] = keys[i];
            kept += ((keys[i] & mask) != 0) == keep_set;
        }
        if (!keep_set) rank -= set;
        size = kept;
    }
    KEY answer = keys[0];
    if (rank == 1) {
#pragma omp simd reduction(max : answer)
        for (int64_t i = 0; i < size; i++) answer = keys[i] > answer ? keys[i] : answer;
    } else {
#pragma omp simd reduction(min : answer)
        for (int64_t i = 0; i < size; i++) answer = keys[i] < answer ? keys[i] : answer;
    }
    return CAT(unkey, SUFFIX)(answer);
}

/*
 * softmax(scale * x) over the k largest finite scores (all of them when fewer),
 * zeros elsewhere.  The k-th largest of the maxima of at least 2k position groups
 * bounds the row's k-th largest from below; a radix select on the scores above
 * that bound finds it.  Scores tied with it are kept in index order until k are
 * kept (as the Triton kernel does).  `work` and `keys` hold length + MAX_TOPK_GROUPS
 * values, `index` length.
 */
static void FN(topk_row)(const REAL* x, REAL* y, int64_t length, int64_t k, REAL scale, REAL* work, int32_t* index,
                         KEY* keys, uint8_t* bad) {
    REAL* group_max = work + length;
    REAL top;
    int64_t groups = 64;
    while (groups < 2 * k && groups < MAX_TOPK_GROUPS) groups *= 2;
    if (FN(scan_groups)(x, length, groups, group_max, &top)) {
        memset(y, 0, length * sizeof(REAL));
        *bad = 1;
        return;
    }
    *bad = 0;
    REAL bound = -INFINITY;
    if (k <= groups && 4 * groups <= length) bound = FN(kth_largest)(group_max, groups, k, keys);
    /* x >= bound, finite: x > the float just below bound (or > -inf) */
    int64_t count = FN(gather_above)(x, length, bound > -INFINITY ? NEXT_BELOW(bound) : bound, work, index);
    if (bound == -INFINITY) k = k < count ? k : count; /* all finite scores are candidates */
    REAL threshold = -INFINITY; /* keep x > threshold, and `ties` scores equal to it */
    int64_t ties = 0, tied = 0;
    if (k < count || bound > -INFINITY) {
        threshold = FN(kth_largest)(work, count, k, keys);
        int64_t greater = 0;
#pragma omp simd reduction(+ : greater, tied)
        for (int64_t j = 0; j < count; j++) {
            greater += work[j] > threshold;
            tied += work[j] == threshold;
        }
        ties = k - greater;
    }
    double total = 0;
    if (ties == tied) {
#pragma omp simd reduction(+ : total)
        for (int64_t i = 0; i < length; i++) {
            REAL xi = x[i];
            REAL e = (xi > threshold || (ties > 0 && xi == threshold)) ? EXP(scale * (xi - top)) : 0;
            y[i] = e;
            total += e;
        }
    } else {
        for (int64_t i = 0; i < length; i++) {
            REAL xi = x[i];
            int keep = xi > threshold || (xi == threshold && ties-- > 0);
            REAL e = keep ? EXP(scale * (xi - top)) : 0;
            y[i] = e;
            total += e;
        }
    }
    REAL inverse = (REAL)(1.0 / total);
#pragma omp simd
    for (int64_t i = 0; i < length; i++) y[i] *= inverse;
}

/* ---- entry points: rows split across threads ---------------------------------- */

int FN(attnorm_softmax_forward)(const REAL* x, REAL* y, int64_t rows, int64_t length, const double* scale,
                                int64_t scale_stride, uint8_t* bad, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t r = 0; r < rows; r++) {
        FN(softmax_row)(x + r * length, y + r * length, length, (REAL)scale[r * scale_stride], bad + r);
    }
    return 0;
}

int FN(attnorm_softmax_backward)(const REAL* y, const REAL* g, REAL* gx, int64_t rows, int64_t length,
                                 const double* scale, int64_t scale_stride, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t r = 0; r < rows; r++) {
        FN(softmax_grad_row)(y + r * length, g + r * length, gx + r * length, length, (REAL)scale[r * scale_stride]);
    }
    return 0;
}

int FN(attnorm_self_adjusted_forward)(const REAL* x, REAL* y, int64_t rows, int64_t length, int normalized,
                                      double* stats, uint8_t* bad, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t r = 0; r < rows; r++) {
        FN(self_adjusted_row)(x + r * length, y + r * length, length, normalized, stats + SA_STATS * r, bad + r);
    }
    return 0;
}

int FN(attnorm_self_adjusted_backward)(const REAL* x, const REAL* g, REAL* gx, int64_t rows, int64_t length,
                                       int normalized, const double* stats, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t r = 0; r < rows; r++) {
        FN(self_adjusted_grad_row)(x + r * length, g + r * length, gx + r * length, length, normalized, stats + SA_STATS * r);
    }
    return 0;
}

int FN(attnorm_entmax_forward)(const REAL* x, REAL* y, int64_t rows, int64_t length, const double* alpha,
                               int64_t alpha_stride, uint8_t* bad, int threads) {
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        REAL* t = malloc((length + PAD) * sizeof(REAL));
        int32_t* index = malloc(length * sizeof(int32_t));
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) {
            if (t && index) {
                FN(entmax_row)(x + r * length, y + r * length, length, alpha[r * alpha_stride], t, index, bad + r);
            } else {
#pragma omp atomic write
                failed = 1;
            }
        }
        free(t);
        free(index);
    }
    return failed;
}

/* alpha_grad: NULL, or one double per row for d/d alpha of sum(g y). */
int FN(attnorm_entmax_backward)(const REAL* y, const REAL* g, REAL* gx, int64_t rows, int64_t length,
                                const double* alpha, int64_t alpha_stride, double* alpha_grad, int threads) {
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        int32_t* index = malloc(length * sizeof(int32_t));
        REAL* slope = malloc((length + PAD) * sizeof(REAL));
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) {
            if (index && slope) {
                FN(entmax_grad_row)(y + r * length, g + r * length, gx + r * length, length, alpha[r * alpha_stride],
                                    index, slope, alpha_grad ? alpha_grad + r : NULL);
            } else {
#pragma omp atomic write
                failed = 1;
            }
        }
        free(index);
        free(slope);
    }
    return failed;
}

int FN(attnorm_topk_forward)(const REAL* x, REAL* y, int64_t rows, int64_t length, const int64_t* k,
                             int64_t k_stride, const double* scale, int64_t scale_stride, uint8_t* bad, int threads) {
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        REAL* work = malloc((length + MAX_TOPK_GROUPS) * sizeof(REAL));
        int32_t* index = malloc(length * sizeof(int32_t));
        KEY* keys = malloc((length + MAX_TOPK_GROUPS) * sizeof(KEY));
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) {
            if (work && index && keys) {
                FN(topk_row)(x + r * length, y + r * length, length, k[r * k_stride], (REAL)scale[r * scale_stride],
                             work, index, keys, bad + r);
            } else {
#pragma omp atomic write
                failed = 1;
            }
        }
        free(work);
        free(index);
        free(keys);
    }
    return failed;
}

#undef FN
