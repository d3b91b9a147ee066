/*
 * Row kernels for one floating type, included by rows.c once per type with REAL
 * (float or double), SUFFIX (f32, f64), EXP, EXPM1, LOG, POW, EPS, REAL_MAX, NEXT_BELOW and
 * WIDE_ENTMAX defined.  Sums over a row are accumulated in double, except sums of
 * exponentials (terms in (0, 1]).  "Pass" below means one sweep over a row of
 * `length` values: the first reads it from memory (length * sizeof(REAL) bytes), the
 * others find it in cache; each output row is written once.
 */
#define FN(name) CAT(name, SUFFIX)

/* ---- the shared row rules ------------------------------------------------------ */

/* One pass: the largest score (-inf when every score is masked) and whether a score is NaN. */
static int FN(scan_row)(const REAL* x, int64_t length, REAL* top) {
    REAL high = -INFINITY;
    int nan = 0;
#pragma omp simd reduction(max : high) reduction(| : nan)
    for (int64_t i = 0; i < length; i++) {
        REAL xi = x[i];
        high = xi > high ? xi : high;
        nan |= xi != xi;
    }
    *top = high;
    return nan;
}

/* Maxima of `groups` interleaved position classes (i mod groups), the row maximum,
 * and whether a score is NaN: one pass, a vertical max over blocks that vectorises
 * across the groups. */
static int FN(scan_groups)(const REAL* x, int64_t length, int64_t groups, REAL* group_max, REAL* top) {
    for (int64_t j = 0; j < groups; j++) group_max[j] = -INFINITY;
    int nan = 0;
    for (int64_t start = 0; start < length; start += groups) {
        const REAL* block = x + start;
        int64_t width = length - start < groups ? length - start : groups;
#pragma omp simd reduction(| : nan)
        for (int64_t j = 0; j < width; j++) {
            REAL xi = block[j];
            group_max[j] = xi > group_max[j] ? xi : group_max[j];
            nan |= xi != xi;
        }
    }
    REAL high = -INFINITY;
#pragma omp simd reduction(max : high)
    for (int64_t j = 0; j < groups; j++) high = group_max[j] > high ? group_max[j] : high;
    *top = high;
    return nan;
}

/* Allowed positions: those not -inf (+inf and NaN count).  One pass. */
static int64_t FN(count_allowed)(const REAL* x, int64_t length) {
    int64_t count = 0;
#pragma omp simd reduction(+ : count)
    for (int64_t i = 0; i < length; i++) count += x[i] != -INFINITY;
    return count;
}

/* Smallest finite score (+inf when none).  One pass. */
static REAL FN(smallest_finite)(const REAL* x, int64_t length) {
    REAL low = INFINITY;
#pragma omp simd reduction(min : low)
    for (int64_t i = 0; i < length; i++) {
        REAL finite = x[i] == -INFINITY ? INFINITY : x[i];
        low = finite < low ? finite : low;
    }
    return low;
}

/*
 * Writes the rows the rules decide alone and says which kind the row is: a NaN
 * score gives NaN everywhere (ROW_NAN); no allowed score gives zeros (ROW_EMPTY); a
 * +inf score gives 1 / c on the first c +inf positions, c = min(their count, keep)
 * (keep < 0: all of them; ROW_POSINF).  Rows of finite allowed scores (ROW_FINITE)
 * are left to the caller.  `sink` is the score of a virtual position after the last
 * (-inf: none), its weight goes to *sink_weight; `nan` and `top` include it.  At most
 * two passes, in special rows only.
 */
static int FN(special_row)(const REAL* x, REAL* y, int64_t length, int nan, REAL top, int64_t keep, REAL sink,
                           REAL* sink_weight) {
    if (nan) {
        for (int64_t i = 0; i < length; i++) y[i] = NAN;
        *sink_weight = NAN;
        return ROW_NAN;
    }
    *sink_weight = 0;
    if (top == -INFINITY) {
        memset(y, 0, length * sizeof(REAL));
        return ROW_EMPTY;
    }
    if (top != INFINITY) return ROW_FINITE;
    int64_t count = 0;
#pragma omp simd reduction(+ : count)
    for (int64_t i = 0; i < length; i++) count += x[i] == INFINITY;
    count += sink == INFINITY;
    if (keep >= 0 && keep < count) count = keep;
    const REAL share = (REAL)(1.0 / (double)count);
    int64_t left = count;
    for (int64_t i = 0; i < length; i++) {
        int use = x[i] == INFINITY && left > 0;
        y[i] = use ? share : 0;
        left -= use;
    }
    if (sink == INFINITY && left > 0) *sink_weight = share; /* the last position: it loses every tie */
    return ROW_POSINF;
}

/* m (x - anchor) <= 0 for a finite x, without overflow: when the difference itself
 * overflows (|x|, |anchor| near the largest float), on halved scores. */
static inline REAL FN(scaled_difference)(REAL xi, REAL anchor, REAL m) {
    REAL d = xi - anchor;
    return (d > -REAL_MAX && d < REAL_MAX) ? m * d : (2 * m) * ((REAL)0.5 * xi - (REAL)0.5 * anchor);
}

/*
 * y = softmax(m x) over the allowed positions of a row of finite allowed scores
 * (top: the largest), as exp(m (x - anchor)) / sum with the anchor the score whose
 * scaled value is largest (top for m >= 0, the smallest finite score for m < 0), so
 * every exponent is <= 0 and the sum >= 1.  The sink (-inf: none; else finite, and
 * counted in top) is one more term of the sum, its weight written to *sink_weight.
 * Two passes: exponentials and their sum, then the scaling (three for m < 0 or a
 * tiny m, which look for the smallest score or guard against differences that
 * overflow).
 */
static void FN(softmax_finite)(const REAL* x, REAL* y, int64_t length, REAL m, REAL top, REAL sink,
                               REAL* sink_weight) {
    /* m REAL_MAX > 1000: a difference beyond the range would give exp(< -1000) = 0 anyway */
    const int plain = m > 0 && m * REAL_MAX > 1000;
    REAL anchor = top;
    if (m < 0) {
        anchor = FN(smallest_finite)(x, length);
        anchor = sink > -INFINITY && sink < anchor ? sink : anchor;
    }
    REAL total = 0; /* summed in SIMD lanes: pairwise-like rounding */
    if (plain) { /* -inf scores give exp(-inf) = 0 */
#pragma omp simd reduction(+ : total)
        for (int64_t i = 0; i < length; i++) {
            REAL e = EXP(m * (x[i] - anchor)); /* the difference first: exact for nearby scores */
            y[i] = e;
            total += e;
        }
    } else { /* m <= 0 (0 * -inf is NaN), or differences that overflow */
#pragma omp simd reduction(+ : total)
        for (int64_t i = 0; i < length; i++) {
            REAL xi = x[i];
            REAL e = xi == -INFINITY ? 0 : EXP(FN(scaled_difference)(xi, anchor, m));
            y[i] = e;
            total += e;
        }
    }
    const REAL sink_term = sink == -INFINITY ? 0 : EXP(FN(scaled_difference)(sink, anchor, m));
    total += sink_term;
    REAL inverse = 1 / total;
#pragma omp simd
    for (int64_t i = 0; i < length; i++) y[i] *= inverse;
    *sink_weight = sink_term * inverse;
}

/* ---- softmax(m x): temperature (variant 0) and Scalable-Softmax (variant 1) ---- */

/* m = 1 / first, or first * log(max(n, 1)) + second with n the allowed positions
 * (the sink, -inf when none, is not one of them: it only joins the softmax).
 * Passes: one scan (+ one count for variant 1), then softmax_finite's. */
static void FN(softmax_row)(const REAL* x, REAL* y, int64_t length, int variant, double first, double second,
                            REAL sink, REAL* multiplier, REAL* log_count, REAL* sink_weight) {
    REAL top;
    int nan = FN(scan_row)(x, length, &top) | (sink != sink);
    top = sink > top ? sink : top;
    double m;
    if (variant == 1) {
        int64_t n = FN(count_allowed)(x, length);
        double log_n = log((double)(n > 1 ? n : 1));
        m = first * log_n + second;
        *log_count = (REAL)log_n;
    } else {
        m = 1 / first;
    }
    int kind = FN(special_row)(x, y, length, nan, top, -1, sink, sink_weight);
    *multiplier = kind == ROW_POSINF ? 0 : (REAL)m;
    if (kind == ROW_FINITE) FN(softmax_finite)(x, y, length, (REAL)m, top, sink, sink_weight);
}

/*
 * dx = m dz, dz = y (g - sum(y g)); per row, param_grad 1: -m sum(dz log y) and
 * 2: sum(dz (x - c)), over y > 0 (and finite x), c the largest such x (sum(dz) = 0
 * makes the shift exact; it avoids cancellation on large scores).  A sink is one more
 * position of weight w and gradient 0 (w = 0: none; its score s is read for
 * param_grad 2 only): it leaves sum(y g) alone, receives *dsink = m w (0 - sum(y g))
 * and adds its terms to the per-row sums.  A row holding NaN (y NaN, so sum(y g) is)
 * gets NaN everywhere, its per-row sum included.  Two passes (three with param_grad 2), sums
 * in double.  x may be gx itself (each x[i] is read before gx[i] is written).
 */
static void FN(softmax_grad_row)(const REAL* y, const REAL* g, const REAL* x, REAL* gx, int64_t length, REAL m,
                                 int param_grad, REAL* per_row, REAL w, REAL s, REAL* dsink) {
    double dot = 0;
#pragma omp simd reduction(+ : dot)
    for (int64_t i = 0; i < length; i++) dot += (double)y[i] * g[i];
    const REAL mean = (REAL)dot;
    const REAL dz_sink = w * (0 - mean);
    *dsink = m * dz_sink;
    const int sink_used = w > 0 && s > -INFINITY && s < INFINITY;
    REAL shift = 0;
    if (param_grad == 2) {
        REAL high = sink_used ? s : -INFINITY;
#pragma omp simd reduction(max : high)
        for (int64_t i = 0; i < length; i++) {
            int used = y[i] > 0 && x[i] > -INFINITY && x[i] < INFINITY;
            high = used && x[i] > high ? x[i] : high;
        }
        shift = high > -INFINITY ? high : 0;
    }
    double sum = 0;
    if (param_grad == 1) {
#pragma omp simd reduction(+ : sum)
        for (int64_t i = 0; i < length; i++) {
            REAL dz = y[i] * (g[i] - mean);
            gx[i] = m * dz;
            sum += y[i] > 0 ? (double)dz * LOG(y[i] > 0 ? y[i] : 1) : 0;
        }
        sum += w > 0 ? (double)dz_sink * LOG(w) : 0;
        *per_row = mean == mean ? (REAL)(-(double)m * sum) : NAN; /* a row holding NaN: NaN, as dx */
    } else if (param_grad == 2) {
#pragma omp simd reduction(+ : sum)
        for (int64_t i = 0; i < length; i++) {
            const REAL xi = x[i]; /* read before gx[i] is written: x may be gx (capped scores) */
            REAL dz = y[i] * (g[i] - mean);
            gx[i] = m * dz;
            int used = y[i] > 0 && xi > -INFINITY && xi < INFINITY;
            sum += used ? (double)dz * (xi - shift) : 0;
        }
        sum += sink_used ? (double)dz_sink * (s - shift) : 0;
        *per_row = mean == mean ? (REAL)sum : NAN;
    } else {
#pragma omp simd
        for (int64_t i = 0; i < length; i++) gx[i] = m * y[i] * (g[i] - mean);
    }
}

/* ---- Self-Adjusted Softmax (Zheng et al., 2025) -------------------------------- */

/*
 * low = min(min x, 0), high = max(max x, 0) over the finite scores, and the span as
 * the factor phi = (x * scale - low * scale) / span takes it: scale = 1/2 when
 * high - low overflows.  Dividing (no 1 / span) keeps denormal spans finite.
 */
static void FN(sa_span)(REAL top, REAL bottom, REAL* low, REAL* high, REAL* scale, REAL* span) {
    *low = bottom < 0 ? bottom : 0;
    *high = top > 0 ? top : 0;
    *scale = *high - *low < INFINITY ? 1 : (REAL)0.5;
    *span = *high * *scale - *low * *scale;
}

/*
 * y = phi(x) softmax(x), phi(x) = x (plain) or (x - low) / (high - low) (normalized;
 * phi = 0 when high = low).  stats receives (c0, c1, low, high, gate) with the
 * softmax weights w = exp((x - c0) - c1): c0 the row max, c1 the log of the sum;
 * gate is 0 in rows holding +inf or fully masked.  A row holding +inf is the limit
 * of the finite case: weights uniform over the +inf positions (normalized) or +inf
 * there (plain).  The sink (-inf: none) is one more score in every statistic (max,
 * min, the sum), its weight written to *sink_weight.  Three passes: the scan,
 * exponentials and their sum, the factors (four when normalized: the smallest score).
 */
static void FN(self_adjusted_row)(const REAL* x, REAL* y, int64_t length, int normalized, REAL* stats, REAL sink,
                                  REAL* sink_weight) {
    REAL top;
    int nan = FN(scan_row)(x, length, &top) | (sink != sink);
    top = sink > top ? sink : top;
    int kind = FN(special_row)(x, y, length, nan, top, -1, sink, sink_weight);
    if (kind != ROW_FINITE) {
        if (kind == ROW_POSINF && !normalized) {
            for (int64_t i = 0; i < length; i++) y[i] = y[i] > 0 ? INFINITY : 0;
            *sink_weight = *sink_weight > 0 ? INFINITY : 0;
        }
        for (int j = 0; j < 4; j++) stats[j] = kind == ROW_NAN ? NAN : 0;
        stats[4] = kind == ROW_NAN;
        return;
    }
    const int sink_allowed = sink > -INFINITY; /* and finite: the row is */
    REAL low = 0, high = 0, scale = 1, span = 0;
    if (normalized) {
        REAL bottom = FN(smallest_finite)(x, length);
        bottom = sink_allowed && sink < bottom ? sink : bottom;
        FN(sa_span)(top, bottom, &low, &high, &scale, &span);
    }
    REAL total = 0;
#pragma omp simd reduction(+ : total)
    for (int64_t i = 0; i < length; i++) {
        REAL e = EXP(x[i] - top);
        y[i] = e;
        total += e;
    }
    const REAL sink_term = sink_allowed ? EXP(sink - top) : 0;
    total += sink_term;
    const REAL inverse = 1 / total;
    if (normalized) {
        const REAL low_scaled = low * scale, divisor = span > 0 ? span : 1, on = span > 0;
#pragma omp simd
        for (int64_t i = 0; i < length; i++) {
            REAL factor = on * ((x[i] * scale - low_scaled) / divisor);
            y[i] = x[i] == -INFINITY ? 0 : factor * (y[i] * inverse);
        }
        *sink_weight = sink_allowed ? on * ((sink * scale - low_scaled) / divisor) * (sink_term * inverse) : 0;
    } else {
#pragma omp simd
        for (int64_t i = 0; i < length; i++) y[i] = x[i] == -INFINITY ? 0 : x[i] * (y[i] * inverse);
        *sink_weight = sink_allowed ? sink * (sink_term * inverse) : 0;
    }
    stats[0] = top;
    stats[1] = (REAL)log((double)total);
    stats[2] = low;
    stats[3] = high;
    stats[4] = 1;
}

/*
 * With w = softmax(x), P = sum(g phi w), Q = sum(g w):
 * dx_j = w_j (g_j phi_j - P) + g_j w_j phi', phi' = 1 (plain) or 1 / span plus the
 * paths through low and high: (P - Q) / span shared by the positions attaining
 * low when low <= 0, -P / span by those attaining high when high >= 0 (at a row min or
 * max of exactly 0 the path counts, as autograd's clamp has it).
 * w = exp((x - c0) - c1): the difference first, exact for nearby scores.  Rows with
 * gate 0 get 0, rows holding NaN get NaN.  The sink (-inf: none) is one more
 * position with gradient 0: nothing in P and Q, but it may share the paths through
 * low and high; *dsink is its dx.  Two passes; x may be gx itself (each x[i] is read
 * before gx[i] is written).
 */
static void FN(self_adjusted_grad_row)(const REAL* x, const REAL* g, REAL* gx, int64_t length, int normalized,
                                       const REAL* stats, REAL sink, REAL* dsink) {
    *dsink = 0;
    if (stats[4] == 0) {
        memset(gx, 0, length * sizeof(REAL));
        return;
    }
    const REAL top = stats[0], log_total = stats[1], low = stats[2], high = stats[3];
    REAL scale = 1, span = 0;
    if (normalized) {
        scale = high - low < INFINITY ? 1 : (REAL)0.5;
        span = high * scale - low * scale;
    }
    const REAL divisor = span > 0 ? span : 1, on = span > 0, low_scaled = low * scale;
    double phi_g_w = 0, g_w = 0;
    int64_t at_low = 0, at_high = 0;
    int nan = 0;
#pragma omp simd reduction(+ : phi_g_w, g_w, at_low, at_high) reduction(| : nan)
    for (int64_t i = 0; i < length; i++) {
        REAL xi = x[i];
        int allowed = xi > -INFINITY;
        REAL w = allowed ? EXP((xi - top) - log_total) : 0;
        REAL factor = normalized ? on * ((xi * scale - low_scaled) / divisor) : xi;
        REAL weighted_g = allowed ? g[i] * w : 0;
        phi_g_w += allowed ? weighted_g * factor : 0;
        g_w += weighted_g;
        at_low += allowed && xi == low;
        at_high += allowed && xi == high;
        nan |= xi != xi;
    }
    const int sink_allowed = sink > -INFINITY;
    at_low += sink_allowed && sink == low;
    at_high += sink_allowed && sink == high;
    if (nan || sink != sink) {
        for (int64_t i = 0; i < length; i++) gx[i] = NAN;
        *dsink = NAN;
        return;
    }
    const REAL P = (REAL)phi_g_w, Q = (REAL)g_w;
    /* scale / span is 1 / (high - low) */
    const REAL through_low = normalized && span > 0 && low <= 0 ? (P - Q) * scale / span / (REAL)at_low : 0;
    const REAL through_high = normalized && span > 0 && high >= 0 ? P * scale / span / (REAL)at_high : 0;
#pragma omp simd
    for (int64_t i = 0; i < length; i++) {
        REAL xi = x[i];
        int allowed = xi > -INFINITY;
        REAL w = allowed ? EXP((xi - top) - log_total) : 0;
        REAL factor, direct;
        if (normalized) {
            factor = on * ((xi * scale - low_scaled) / divisor);
            direct = on * (g[i] * w * scale / divisor);
        } else {
            factor = xi;
            direct = g[i] * w;
        }
        REAL dx = w > 0 ? w * (g[i] * factor - P) + direct : 0; /* w = 0: no 0 * inf from a huge g phi - P */
        dx += (xi == low ? through_low : 0) - (xi == high ? through_high : 0);
        gx[i] = allowed ? dx : 0;
    }
    if (sink_allowed) { /* g = 0 at the sink: only -w P and the paths through low and high */
        const REAL w = EXP((sink - top) - log_total);
        *dsink = (w > 0 ? -w * P : 0) + (sink == low ? through_low : 0) - (sink == high ? through_high : 0);
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
 * dropped from t and index as it rises.  Stores the final lower bound in *low.
 * One pass over the candidates per iteration. */
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
 * the weights sum to 1, for a row of finite allowed scores.  With
 * t = (alpha - 1)(x - max x) the threshold lies in [-1, -n^(1 - alpha)] for n
 * candidates.  A subset's threshold is a lower bound (fewer terms, less mass), so
 * for alpha <= 2 three steps on the maxima of interleaved position groups raise -1
 * first; the candidates are the scores above that bound, usually a few times the
 * support.  On them, Halley's method (cubic convergence; the mass is smooth between
 * support changes) safeguarded by bisection, starting from the lower end for
 * alpha <= 2 (convex mass) and from the upper end above.  For sparsemax the
 * curvature is 0 and the step is Newton's, which is Michelot's exact update and
 * ends on the exact threshold; otherwise the iteration stops once the mass is
 * within a few ulps of 1, and the weights are renormalised.
 *
 * Where that is ill conditioned the weights are recomputed in double: for alpha > 2
 * by entmax_anchored (relative to the smallest support score), and for float rows
 * with alpha < 1.1 (errors in t grow by 1 / (alpha - 1) in the weights) the
 * threshold and weights run on double candidates.  `wide` holds length + PAD
 * doubles.  Passes over the row: one scan, one gather, one zeroing write; then
 * passes over the candidates only.
 */
static void FN(entmax_finite)(const REAL* x, REAL* y, int64_t length, double alpha, REAL top, const REAL* group_max,
                              int64_t groups, REAL* t, int32_t* index, double* wide) {
    REAL subset[MAX_GROUPS];
    const REAL scale = (REAL)(alpha - 1);
    const int kind = entmax_kind(alpha);
    const int anchored = alpha > 2;
    const int in_double = WIDE_ENTMAX && kind == GENERAL && alpha < 1.1;
    double low = -1.0;
    if (alpha <= 2 && !in_double && length >= 4 * groups) { /* on short rows the subset costs more than it saves */
        int64_t count = groups;
#pragma omp simd
        for (int64_t j = 0; j < groups; j++) subset[j] = scale * (group_max[j] - top);
        FN(entmax_threshold)(subset, NULL, &count, alpha, kind, &low, 3);
        low = low - 4 * EPS > -1.0 ? low - 4 * EPS : -1.0; /* slack for the rounding of the subset's mass */
    }
    /* x > top + low / scale, one float lower (the bound may round up to top itself) */
    int64_t count = FN(gather_above)(x, length, NEXT_BELOW(top + (REAL)(low / scale)), t, index);
    memset(y, 0, length * sizeof(REAL));
    if (in_double) {
#if WIDE_ENTMAX
        for (int64_t j = 0; j < count; j++) wide[j] = (alpha - 1) * ((double)t[j] - (double)top);
        double tau = entmax_threshold_f64(wide, index, &count, alpha, kind, &low, 200);
        double inverse = 1.0 / entmax_weights_f64(wide, count, tau, 1 / (alpha - 1), kind);
        for (int64_t j = 0; j < count; j++) y[index[j]] = (REAL)(wide[j] * inverse);
#endif
        return;
    }
#pragma omp simd
    for (int64_t j = 0; j < count; j++) t[j] = scale * (t[j] - top);
    double tau = FN(entmax_threshold)(t, anchored ? NULL : index, &count, alpha, kind, &low, 100);
    if (anchored) {
        double start = INFINITY; /* the smallest score the fast threshold keeps */
        for (int64_t j = 0; j < count; j++) {
            double xj = x[index[j]];
            wide[j] = xj;
            start = t[j] > tau && xj < start ? xj : start;
        }
        entmax_anchored(wide, count, alpha, start);
        for (int64_t j = 0; j < count; j++) y[index[j]] = (REAL)wide[j];
        return;
    }
    REAL inverse = (REAL)(1.0 / FN(entmax_weights)(t, count, (REAL)tau, (REAL)(1 / (alpha - 1)), kind));
    for (int64_t j = 0; j < count; j++) y[index[j]] = t[j] * inverse;
}

/* The shared rules, then softmax (alpha = 1) or entmax_finite; gate 0 in rows holding
 * +inf, else 1.  alpha below 1 or NaN gives a NaN row.  A sink is the row's last
 * position here (the entry point extends the row). */
static void FN(entmax_row)(const REAL* x, REAL* y, int64_t length, double alpha, REAL* gate, REAL* t, int32_t* index,
                           double* wide) {
    REAL group_max[MAX_GROUPS], top, no_sink;
    const int64_t groups = length > 8192 ? MAX_GROUPS : 64;
    int nan = FN(scan_groups)(x, length, groups, group_max, &top);
    int kind = FN(special_row)(x, y, length, nan || !(alpha >= 1), top, -1, -INFINITY, &no_sink);
    *gate = kind != ROW_POSINF;
    if (kind != ROW_FINITE) return;
    if (alpha == 1) FN(softmax_finite)(x, y, length, 1, top, -INFINITY, &no_sink);
    else FN(entmax_finite)(x, y, length, alpha, top, group_max, groups, t, index, wide);
}

/*
 * d/d alpha of sum_i g_i y_i, from the output: with beta = 1 / (alpha - 1),
 * S_i = y_i (beta - log y_i) and s_i = y_i^(2 - alpha) on the support,
 * beta (sum g S - sum g s * sum S / sum s); 0 for alpha = 1.  A sink of weight w
 * (gradient 0) adds its S to sum S (slope_total holds its s).  One pass.
 */
static double FN(entmax_alpha_grad_row)(const REAL* y, const REAL* g, int64_t length, double alpha, double slope_total,
                                        double slope_dot, REAL w) {
    if (alpha == 1) return 0;
    const double beta = 1 / (alpha - 1);
    double entropy_total = w > 0 ? w * (beta - log((double)w)) : 0, entropy_dot = 0;
    for (int64_t i = 0; i < length; i++) {
        if (y[i] > 0) {
            double term = y[i] * (beta - log((double)y[i]));
            entropy_total += term;
            entropy_dot += term * g[i];
        }
    }
    return slope_total > 0 ? beta * (entropy_dot - slope_dot * entropy_total / slope_total) : 0;
}

/* grad_x = gate * s * (g - sum(s g) / sum(s)), s = y^(2 - alpha) on the support and 0
 * off it (y itself for alpha = 1): entmax's Jacobian.  For general alpha the support
 * is gathered first (into `index`, s into `slope`) so that pow runs there only.  With
 * alpha_grad, also the row's alpha derivative (entmax_alpha_grad_row), times gate.
 * A sink of weight w (0: none) is one more position with gradient 0: its s joins
 * sum(s) only, and *dsink = gate * s (0 - sum(s g) / sum(s)).  A row holding NaN (its
 * weights NaN) gets NaN gradients, dsink and alpha's included, as softmax's does.
 * Two passes (three with alpha_grad). */
static void FN(entmax_grad_row)(const REAL* y, const REAL* g, REAL* gx, int64_t length, REAL gate, double alpha,
                                int32_t* index, REAL* slope, REAL* alpha_grad, REAL w, REAL* dsink) {
    const int kind = entmax_kind(alpha);
    const REAL positive = w > 0 ? w : 0;
    const REAL sink_slope = kind == SPARSEMAX ? (REAL)(w > 0)
                            : kind == ENTMAX15 ? SQRT(positive)
                            : kind == SOFTMAX  ? positive
                                               : (w > 0 ? POW(positive, (REAL)(2 - alpha)) : 0);
    double slope_total = 0, dot = 0;
    int64_t nans = 0; /* NaN weights: the row held NaN, and its gradients are NaN (as softmax's) */
    REAL mean;
    if (kind != GENERAL) { /* cheap slopes: two vectorised passes over the row, one loop per kind */
        if (kind == ENTMAX15) {
#pragma omp simd reduction(+ : slope_total, dot, nans)
            for (int64_t i = 0; i < length; i++) {
                REAL s = SQRT(y[i] > 0 ? y[i] : 0);
                gx[i] = s;
                slope_total += s;
                dot += (double)s * g[i];
                nans += y[i] != y[i];
            }
        } else {
#pragma omp simd reduction(+ : slope_total, dot, nans)
            for (int64_t i = 0; i < length; i++) {
                REAL positive = y[i] > 0 ? y[i] : 0;
                REAL s = kind == SPARSEMAX ? (REAL)(y[i] > 0) : positive;
                gx[i] = s;
                slope_total += s;
                dot += (double)s * g[i];
                nans += y[i] != y[i];
            }
        }
        slope_total += sink_slope;
        mean = slope_total > 0 ? (REAL)(dot / slope_total) : 0;
#pragma omp simd
        for (int64_t i = 0; i < length; i++) gx[i] = gate * (gx[i] * (g[i] - mean));
    } else { /* pow on the support only */
#pragma omp simd reduction(+ : nans)
        for (int64_t i = 0; i < length; i++) nans += y[i] != y[i]; /* the support gather skips NaN */
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
        slope_total += sink_slope;
        mean = slope_total > 0 ? (REAL)(dot / slope_total) : 0;
        for (int64_t j = 0; j < count; j++) gx[index[j]] = gate * (slope[j] * (g[index[j]] - mean));
    }
    *dsink = gate * (sink_slope * (0 - mean));
    if (alpha_grad) *alpha_grad = gate * (REAL)FN(entmax_alpha_grad_row)(y, g, length, alpha, slope_total, dot, w);
    if (nans) {
        for (int64_t i = 0; i < length; i++) gx[i] = NAN;
        *dsink = NAN;
        if (alpha_grad) *alpha_grad = NAN;
    }
}

/* ---- top-k softmax ------------------------------------------------------------ */

/*
 * The k-th largest (1 <= k <= n) of v[0..n), with multiplicity: a radix select on
 * order-preserving integer keys, one bit at a time from the top.  Each step counts
 * the remaining keys with the bit set (a vectorised count), keeps the half that
 * holds the answer, and stops as soon as the answer is the largest or the smallest
 * of what remains.  No branches on the data beyond one per bit.  Up to SMALL_SELECT
 * values (short rows: the bit loop's ~20 steps cost more than the row), an insertion
 * of each value into the k largest so far, descending: the same value up to the sign
 * of a zero (-0 and +0 compare equal, so every use of the threshold is the same).
 */
static REAL FN(kth_largest)(const REAL* v, int64_t n, int64_t k, KEY* keys) {
    if (n <= SMALL_SELECT) {
        REAL largest[SMALL_SELECT];
        int64_t held = 0;
        for (int64_t i = 0; i < n; i++) {
            const REAL vi = v[i];
            if (held == k && !(vi > largest[k - 1])) continue;
            int64_t j = held < k ? held++ : k - 1;
            for (; j > 0 && largest[j - 1] < vi; j--) largest[j] = largest[j - 1];
            largest[j] = vi;
        }
        return largest[k - 1];
    }
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
        int32_t set = 0; /* n < 2^31 (checked by the caller) */
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

/* Positions kept: min(k, n), or max(1, ceil(k n - 1e-9)) (at most n) for a fraction.
 * A fraction is of the allowed positions less `uncounted` (a sink: 1 when it is
 * allowed), and keeps at most all allowed positions. */
static int64_t FN(topk_count)(const REAL* x, int64_t length, double k, int is_fraction, int64_t uncounted) {
    if (is_fraction) {
        const int64_t n = FN(count_allowed)(x, length);
        double kept = ceil(k * (double)(n - uncounted) - 1e-9);
        kept = kept > 1 ? kept : 1;
        return kept < (double)n ? (int64_t)kept : n;
    }
    return k >= (double)length ? length : (k >= 1 ? (int64_t)k : 0);
}

/*
 * softmax(m x), m = 1 / temperature, over the k largest allowed scores (all of them
 * when fewer), zeros elsewhere.  The k-th largest of the maxima of at least 2k
 * position groups bounds the row's k-th largest from below; a radix select on the
 * scores above that bound finds it.  Scores tied with it are kept in index order
 * until k are kept (the lowest index wins).  `work` and `keys` hold
 * length + topk_groups(k) values, `index` length.  A sink is the row's last
 * position here (the entry point extends the row; `uncounted` as in topk_count).
 * Passes over the row: one scan (+ one count for a fraction), one gather, one write
 * of the exponentials, one scaling; the select runs on the candidates.
 */
static void FN(topk_row)(const REAL* x, REAL* y, int64_t length, double k_value, int is_fraction, double temperature,
                         REAL* multiplier, REAL* work, int32_t* index, KEY* keys, int64_t uncounted) {
    REAL* group_max = work + length;
    REAL top, no_sink;
    int64_t k = FN(topk_count)(x, length, k_value, is_fraction, uncounted);
    const int64_t groups = topk_groups(k);
    int nan = FN(scan_groups)(x, length, groups, group_max, &top);
    const REAL m = (REAL)(1 / temperature);
    int kind = FN(special_row)(x, y, length, nan, top, k, -INFINITY, &no_sink);
    *multiplier = kind == ROW_POSINF ? 0 : m;
    if (kind != ROW_FINITE) return;
    if (k < 1) {
        memset(y, 0, length * sizeof(REAL));
        return;
    }
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
    REAL anchor = top; /* m < 0: the smallest kept score (rare: a second look at the candidates) */
    if (m < 0) {
        anchor = ties > 0 ? threshold : INFINITY;
        for (int64_t j = 0; j < count; j++) anchor = work[j] > threshold && work[j] < anchor ? work[j] : anchor;
    }
    double total = 0;
    if (ties == tied) {
#pragma omp simd reduction(+ : total)
        for (int64_t i = 0; i < length; i++) {
            REAL xi = x[i];
            int keep = xi > threshold || (ties > 0 && xi == threshold);
            REAL e = keep ? EXP(FN(scaled_difference)(keep ? xi : anchor, anchor, m)) : 0;
            y[i] = e;
            total += e;
        }
    } else {
        for (int64_t i = 0; i < length; i++) {
            REAL xi = x[i];
            int keep = xi > threshold || (xi == threshold && ties-- > 0);
            REAL e = keep ? EXP(FN(scaled_difference)(xi, anchor, m)) : 0;
            y[i] = e;
            total += e;
        }
    }
    REAL inverse = (REAL)(1.0 / total);
#pragma omp simd
    for (int64_t i = 0; i < length; i++) y[i] *= inverse;
}

/* ---- soft-capping (kernels/README.md, "Soft-capping") -------------------------- */

/*
 * c(x) = cap tanh(x / cap), overflow-free: with v = 2 x / cap and em = e^-|v| - 1 in
 * (-1, 0], tanh(|x| / cap) = -em / (2 + em); expm1 keeps small scores exact and
 * 2 + em >= 1 keeps large ones (|v| = +inf gives 1).  c(-inf) = -inf (still not
 * allowed), c(+inf) = cap, c(NaN) = NaN.  `twice_inverse` is 2 / cap.
 */
static inline REAL FN(soft_cap)(REAL xi, REAL cap, REAL twice_inverse) {
    const REAL v = xi * twice_inverse;
    const REAL em = EXPM1(v < 0 ? v : -v);
    const REAL t = -em / (2 + em);
    return xi == -INFINITY ? xi : cap * (v < 0 ? -t : t);
}

/* dc/dx = 1 - tanh(x / cap)^2 = 4 e / (1 + e)^2 with e = e^(-2 |x| / cap): no
 * cancellation anywhere (1 - t^2 loses every digit once t rounds to 1).  0 at
 * infinite and NaN scores, as in the reference. */
static inline REAL FN(cap_slope)(REAL xi, REAL twice_inverse) {
    const REAL v = xi * twice_inverse;
    const REAL e = EXP(v < 0 ? v : -v);
    const REAL one_plus_e = 1 + e;
    return xi - xi == 0 ? 4 * e / (one_plus_e * one_plus_e) : 0;
}

/* c(x) of a row written to `capped` (which may be the output row); returns it.  One pass. */
static const REAL* FN(cap_row)(const REAL* x, int64_t length, double cap, REAL* capped) {
    const REAL bound = (REAL)cap, twice_inverse = (REAL)(2 / cap);
#pragma omp simd
    for (int64_t i = 0; i < length; i++) capped[i] = FN(soft_cap)(x[i], bound, twice_inverse);
    return capped;
}

/* gx, the gradient with respect to c(x), carried to the raw scores x: gx *= dc/dx.  One pass. */
static void FN(through_cap)(const REAL* x, int64_t length, double cap, REAL* gx) {
    const REAL twice_inverse = (REAL)(2 / cap);
#pragma omp simd
    for (int64_t i = 0; i < length; i++) gx[i] *= FN(cap_slope)(x[i], twice_inverse);
}

/* Which positions a row may use, read in C with no masked copy of the scores (that copy was one
 * more pass over them in torch, as slow as the kernel for sparsemax):
 *  - stops[r] (NULL: all): a causal mask and key lengths allow the row a prefix of its `length`
 *    positions, which the kernels bound themselves;
 *  - allow (NULL: all): a bool mask, row r's at allow + allow_rows[r] (1 = may use), applied as
 *    the row is copied into a buffer the kernel works on in cache (copy_row).
 * Returns the length a row kernel works on, points `row` at the row and `allowed` at its mask row
 * (NULL: none).  A row with no position reads as one masked score, so it takes the fully masked
 * path (zeros) any kernel takes.  `kept` gets the real prefix (0 then), which gradient and cap
 * passes use. */
static int64_t FN(row_bounds)(const REAL* x, int64_t r, int64_t length, const int64_t* stops, const uint8_t* allow,
                              const int64_t* allow_rows, const REAL** row, const uint8_t** allowed, int64_t* kept) {
    static const REAL masked = -INFINITY;
    *row = x + r * length;
    *kept = stops ? (stops[r] < 0 ? 0 : stops[r] > length ? length : stops[r]) : length;
    *allowed = allow ? allow + allow_rows[r] : NULL;
    if (*kept > 0 || length == 0) return *kept;
    *row = &masked;
    *allowed = NULL;
    return 1;
}

/* -inf where `allowed` forbids, in `out` (which may be `x`).  On the bits: a select vectorises as
 * masked loads, twice as slow here. */
static void FN(mask_row)(const REAL* x, const uint8_t* allowed, int64_t length, REAL* out) {
    const REAL masked = -INFINITY;
    KEY masked_bits;
    memcpy(&masked_bits, &masked, sizeof masked_bits);
#pragma omp simd
    for (int64_t i = 0; i < length; i++) {
        const KEY keep = (KEY)0 - (KEY)(allowed[i] != 0);
        KEY bits;
        memcpy(&bits, x + i, sizeof bits);
        bits = (bits & keep) | (masked_bits & ~keep);
        memcpy(out + i, &bits, sizeof bits);
    }
}

/* The row a kernel works on, written to `out`: capped when cap > 0, -inf where `allowed` forbids
 * (NULL: nowhere).  One pass over the row from memory (two in cache with a cap and a mask).
 * `out` may be the output row (the kernels that run in place read each position before writing
 * it); not `x` itself. */
static REAL* FN(copy_row)(const REAL* x, const uint8_t* allowed, int64_t length, double cap, REAL* out) {
    if (cap > 0) FN(cap_row)(x, length, cap, out);
    else if (!allowed) memcpy(out, x, length * sizeof(REAL));
    if (allowed) FN(mask_row)(cap > 0 ? out : x, allowed, length, out);
    return out;
}

/* The positions past a row's prefix: weight (or gradient) 0, or NaN in a row a NaN made NaN (whose
 * every position is NaN, masked ones included, as without `stops`).  No pass without `stops`. */
static void FN(zero_tail)(REAL* out, int64_t used, int64_t length) {
    if (used >= length) return;
    if (used > 0 && out[0] != out[0]) {
        for (int64_t i = used; i < length; i++) out[i] = out[0];
    } else {
        memset(out + used, 0, (size_t)(length - used) * sizeof(REAL));
    }
}

/* ---- entry points: rows split across threads ---------------------------------- */

/*
 * A sink per row: its score is `sink` for all rows or sink_rows[r] (-inf: none), and
 * a forward writes its weight to sink_weight[r] (NULL: no sink).  Softmax and
 * SA-Softmax take it as one more term of their statistics and sums (no extra pass);
 * entmax and top-k run on the extended row [x, sink] of length + 1 in per-thread
 * buffers of 2 (length + 1) values (extend_row, split_row: two more passes, the copy
 * in and the weights out, both in cache; the row is still read from memory once and
 * y written once).  The backward passes take the sink's weight (0: none; SA-Softmax's
 * its score, -inf: none) and write dsink[r] (NULL: none), with no extra pass.
 *
 * Soft-capping: `cap` > 0 caps the scores (0: off; the sink is never capped).  The
 * row is capped once, in the pass that reads it from memory, into a row the kernel
 * then works on in cache: y itself for softmax (which reads each x[i] before writing
 * y[i]), a per-thread buffer of length values for SA-Softmax, the buffer that holds
 * the extended row for entmax and top-k (the copy caps, so no extra pass there).  The
 * backward passes multiply dx by dc/dx at the raw scores in one more pass (through_cap);
 * those that read scores (softmax's param_grad 2, SA-Softmax) first write c(x) into
 * dx's row and run in place.  One tanh (an expm1) per score in a forward, an exp (and
 * an expm1 when scores are read) in a backward.  The check is per row, so without a cap
 * every kernel runs exactly the loops it ran before.
 */

/* The row entmax and top-k see, in `extended`: x (masked, and capped when cap > 0: copy_row), then
 * the sink at position `length` when there is one.  One pass. */
static const REAL* FN(extend_row)(const REAL* x, const uint8_t* allowed, int64_t length, double cap, int has_sink,
                                  REAL sink, REAL* extended) {
    FN(copy_row)(x, allowed, length, cap, extended);
    if (has_sink) extended[length] = sink;
    return extended;
}

/* The first `length` weights of an extended row copied to y; returns the sink's.  One pass. */
static REAL FN(split_row)(const REAL* extended, int64_t length, REAL* y) {
    memcpy(y, extended, length * sizeof(REAL));
    return extended[length];
}

/* log_count: NULL for variant 0.  In every forward the per-row outputs only a backward reads
 * (multiplier, log_count, gate, stats) may be NULL: a call that keeps the weights alone. */
static void FN(softmax_forward_rows)(const REAL* x, REAL* y, int64_t rows, int64_t length, int variant, double first,
                                     const REAL* first_rows, double second, const REAL* second_rows, REAL* multiplier,
                                     REAL* log_count, double sink, const REAL* sink_rows, REAL* sink_weight,
                                     double cap, const int64_t* stops, const uint8_t* allow,
                                     const int64_t* allow_rows) {
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        REAL unused, unused_multiplier, no_sink;
        const REAL* row;
        const uint8_t* allowed;
        int64_t kept;
        const int64_t n = FN(row_bounds)(x, r, length, stops, allow, allow_rows, &row, &allowed, &kept);
        /* softmax_row runs in place */
        if (cap > 0 || allowed) row = FN(copy_row)(row, allowed, n, cap, y + r * length);
        FN(softmax_row)(row, y + r * length, n, variant, ROW_PARAM(first, r), ROW_PARAM(second, r),
                        (REAL)ROW_PARAM(sink, r), multiplier ? multiplier + r : &unused_multiplier,
                        log_count ? log_count + r : &unused,
                        sink_weight ? sink_weight + r : &no_sink);
        FN(zero_tail)(y + r * length, n, length);
    }
}

int FN(attnorm_softmax_forward)(const REAL* x, REAL* y, int64_t rows, int64_t length, int variant, double first,
                                const REAL* first_rows, double second, const REAL* second_rows, REAL* multiplier,
                                REAL* log_count, double sink, const REAL* sink_rows, REAL* sink_weight, double cap,
                                const int64_t* stops, const uint8_t* allow, const int64_t* allow_rows, int threads) {
    ON_TEAM(rows, length, FN(softmax_forward_rows)(x, y, rows, length, variant, first, first_rows, second, second_rows,
                                                   multiplier, log_count, sink, sink_rows, sink_weight, cap, stops,
                                                   allow, allow_rows));
    return 0;
}

/* x: NULL unless param_grad is 2 or cap > 0 (the raw scores); per_row: NULL when param_grad is 0;
 * sink (the scores): read for param_grad 2 only. */
static void FN(softmax_backward_rows)(const REAL* y, const REAL* g, const REAL* x, REAL* gx, int64_t rows,
                                      int64_t length, double multiplier, const REAL* multiplier_rows, int param_grad,
                                      REAL* per_row, double sink_weight, const REAL* sink_weight_rows, double sink,
                                      const REAL* sink_rows, REAL* dsink, double cap) {
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        REAL no_sink;
        const REAL* scores = x ? x + r * length : NULL;
        if (cap > 0 && param_grad == 2) scores = FN(cap_row)(scores, length, cap, gx + r * length);
        FN(softmax_grad_row)(y + r * length, g + r * length, scores, gx + r * length, length,
                             (REAL)ROW_PARAM(multiplier, r), param_grad, per_row ? per_row + r : NULL,
                             (REAL)ROW_PARAM(sink_weight, r), (REAL)ROW_PARAM(sink, r), dsink ? dsink + r : &no_sink);
        if (cap > 0) FN(through_cap)(x + r * length, length, cap, gx + r * length);
    }
}

int FN(attnorm_softmax_backward)(const REAL* y, const REAL* g, const REAL* x, REAL* gx, int64_t rows, int64_t length,
                                 double multiplier, const REAL* multiplier_rows, int param_grad, REAL* per_row,
                                 double sink_weight, const REAL* sink_weight_rows, double sink, const REAL* sink_rows,
                                 REAL* dsink, double cap, int threads) {
    ON_TEAM(rows, length, FN(softmax_backward_rows)(y, g, x, gx, rows, length, multiplier, multiplier_rows, param_grad,
                                                    per_row, sink_weight, sink_weight_rows, sink, sink_rows, dsink,
                                                    cap));
    return 0;
}

static void FN(self_adjusted_forward_rows)(const REAL* x, REAL* y, int64_t rows, int64_t length, int normalized,
                                           REAL* stats, double sink, const REAL* sink_rows, REAL* sink_weight,
                                           double cap, const int64_t* stops, const uint8_t* allow,
                                           const int64_t* allow_rows, int* failed) {
    const int copied = cap > 0 || allow != NULL; /* c(x) masked: the row is read again */
    REAL* scratch = copied ? malloc((length + 1) * sizeof(REAL)) : NULL;
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        if (scratch || !copied) {
            REAL no_sink, own[SA_STATS]; /* the row's statistics when the caller keeps none */
            const REAL* row;
            const uint8_t* allowed;
            int64_t kept;
            const int64_t n = FN(row_bounds)(x, r, length, stops, allow, allow_rows, &row, &allowed, &kept);
            if (cap > 0 || allowed) row = FN(copy_row)(row, allowed, n, cap, scratch);
            FN(self_adjusted_row)(row, y + r * length, n, normalized, stats ? stats + SA_STATS * r : own,
                                  (REAL)ROW_PARAM(sink, r), sink_weight ? sink_weight + r : &no_sink);
            FN(zero_tail)(y + r * length, n, length);
        } else {
#pragma omp atomic write
            *failed = 1;
        }
    }
    free(scratch);
}

int FN(attnorm_self_adjusted_forward)(const REAL* x, REAL* y, int64_t rows, int64_t length, int normalized, REAL* stats,
                                      double sink, const REAL* sink_rows, REAL* sink_weight, double cap,
                                      const int64_t* stops, const uint8_t* allow, const int64_t* allow_rows,
                                      int threads) {
    int failed = 0;
    ON_TEAM(rows, length, FN(self_adjusted_forward_rows)(x, y, rows, length, normalized, stats, sink, sink_rows,
                                                         sink_weight, cap, stops, allow, allow_rows, &failed));
    return failed;
}

static void FN(self_adjusted_backward_rows)(const REAL* x, const REAL* g, REAL* gx, int64_t rows, int64_t length,
                                            int normalized, const REAL* stats, double sink, const REAL* sink_rows,
                                            REAL* dsink, double cap, const int64_t* stops, const uint8_t* allow,
                                            const int64_t* allow_rows) {
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        REAL no_sink;
        const REAL* row;
        const uint8_t* allowed;
        int64_t kept;
        const int64_t n = FN(row_bounds)(x, r, length, stops, allow, allow_rows, &row, &allowed, &kept);
        if (cap > 0 || allowed) row = FN(copy_row)(row, allowed, n, cap, gx + r * length); /* in place */
        FN(self_adjusted_grad_row)(row, g + r * length, gx + r * length, n, normalized, stats + SA_STATS * r,
                                   (REAL)ROW_PARAM(sink, r), dsink ? dsink + r : &no_sink);
        if (cap > 0) FN(through_cap)(x + r * length, kept, cap, gx + r * length);
        FN(zero_tail)(gx + r * length, n, length);
    }
}

int FN(attnorm_self_adjusted_backward)(const REAL* x, const REAL* g, REAL* gx, int64_t rows, int64_t length,
                                       int normalized, const REAL* stats, double sink, const REAL* sink_rows,
                                       REAL* dsink, double cap, const int64_t* stops, const uint8_t* allow,
                                       const int64_t* allow_rows, int threads) {
    ON_TEAM(rows, length, FN(self_adjusted_backward_rows)(x, g, gx, rows, length, normalized, stats, sink, sink_rows,
                                                          dsink, cap, stops, allow, allow_rows));
    return 0;
}

static void FN(entmax_forward_rows)(const REAL* x, REAL* y, int64_t rows, int64_t length, double alpha,
                                    const REAL* alpha_rows, REAL* gate, double sink, const REAL* sink_rows,
                                    REAL* sink_weight, double cap, const int64_t* stops, const uint8_t* allow,
                                    const int64_t* allow_rows, int* failed) {
    const int64_t width = length + (sink_weight != NULL); /* the longest row entmax_row sees */
    const int copied = sink_weight != NULL || cap > 0 || allow != NULL; /* ... through a per-thread buffer */
    REAL* t = malloc((width + PAD) * sizeof(REAL));
    int32_t* index = malloc(width * sizeof(int32_t));
    double* wide = malloc((width + PAD) * sizeof(double));
    REAL* extended = copied ? malloc(2 * width * sizeof(REAL)) : NULL; /* [c(x), sink], then its weights */
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        if (t && index && wide && (extended || !copied)) {
            REAL no_gate;
            const REAL* row;
            const uint8_t* allowed;
            int64_t kept;
            const int64_t n = FN(row_bounds)(x, r, length, stops, allow, allow_rows, &row, &allowed, &kept);
            REAL* out = y + r * length;
            if (copied) row = FN(extend_row)(row, allowed, n, cap, sink_weight != NULL, (REAL)ROW_PARAM(sink, r),
                                             extended);
            if (sink_weight) out = extended + width;
            FN(entmax_row)(row, out, n + (sink_weight != NULL), ROW_PARAM(alpha, r), gate ? gate + r : &no_gate, t,
                           index, wide);
            if (sink_weight) sink_weight[r] = FN(split_row)(out, n, y + r * length);
            FN(zero_tail)(y + r * length, n, length);
        } else {
#pragma omp atomic write
            *failed = 1;
        }
    }
    free(t);
    free(index);
    free(wide);
    free(extended);
}

int FN(attnorm_entmax_forward)(const REAL* x, REAL* y, int64_t rows, int64_t length, double alpha,
                               const REAL* alpha_rows, REAL* gate, double sink, const REAL* sink_rows,
                               REAL* sink_weight, double cap, const int64_t* stops, const uint8_t* allow,
                               const int64_t* allow_rows, int threads) {
    int failed = 0;
    ON_TEAM(rows, length, FN(entmax_forward_rows)(x, y, rows, length, alpha, alpha_rows, gate, sink, sink_rows,
                                                  sink_weight, cap, stops, allow, allow_rows, &failed));
    return failed;
}

/* alpha_grad: NULL, or one value per row for d/d alpha of sum(g y).  x: the raw scores, NULL
 * unless cap > 0. */
static void FN(entmax_backward_rows)(const REAL* y, const REAL* g, REAL* gx, int64_t rows, int64_t length, double gate,
                                     const REAL* gate_rows, double alpha, const REAL* alpha_rows, REAL* alpha_grad,
                                     double sink_weight, const REAL* sink_weight_rows, REAL* dsink, const REAL* x,
                                     double cap, int* failed) {
    int32_t* index = malloc(length * sizeof(int32_t));
    REAL* slope = malloc((length + PAD) * sizeof(REAL));
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        if (index && slope) {
            REAL no_sink;
            FN(entmax_grad_row)(y + r * length, g + r * length, gx + r * length, length,
                                (REAL)ROW_PARAM(gate, r), ROW_PARAM(alpha, r), index, slope,
                                alpha_grad ? alpha_grad + r : NULL, (REAL)ROW_PARAM(sink_weight, r),
                                dsink ? dsink + r : &no_sink);
            if (cap > 0) FN(through_cap)(x + r * length, length, cap, gx + r * length);
        } else {
#pragma omp atomic write
            *failed = 1;
        }
    }
    free(index);
    free(slope);
}

int FN(attnorm_entmax_backward)(const REAL* y, const REAL* g, REAL* gx, int64_t rows, int64_t length, double gate,
                                const REAL* gate_rows, double alpha, const REAL* alpha_rows, REAL* alpha_grad,
                                double sink_weight, const REAL* sink_weight_rows, REAL* dsink, const REAL* x,
                                double cap, int threads) {
    int failed = 0;
    ON_TEAM(rows, length, FN(entmax_backward_rows)(y, g, gx, rows, length, gate, gate_rows, alpha, alpha_rows,
                                                   alpha_grad, sink_weight, sink_weight_rows, dsink, x, cap, &failed));
    return failed;
}

static void FN(topk_forward_rows)(const REAL* x, REAL* y, int64_t rows, int64_t length, double k, int is_fraction,
                                  double temperature, const REAL* temperature_rows, REAL* multiplier, double sink,
                                  const REAL* sink_rows, REAL* sink_weight, double cap, const int64_t* stops,
                                  const uint8_t* allow, const int64_t* allow_rows,
                                  int* failed) {
    const int64_t width = length + (sink_weight != NULL); /* the longest row topk_row sees */
    const int copied = sink_weight != NULL || cap > 0 || allow != NULL; /* ... through a per-thread buffer */
    /* the most groups a row uses: a fraction keeps at most the row (sized for the whole 4096 groups, a
     * short row's buffers were 2 x 16 KiB, touched and returned to the heap on every call) */
    const int64_t groups = topk_groups(is_fraction || k >= (double)width ? width : (int64_t)k);
    REAL* work = malloc((width + groups) * sizeof(REAL));
    int32_t* index = malloc(width * sizeof(int32_t));
    KEY* keys = malloc((width + groups) * sizeof(KEY));
    REAL* extended = copied ? malloc(2 * width * sizeof(REAL)) : NULL; /* [c(x), sink], then its weights */
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        if (work && index && keys && (extended || !copied)) {
            REAL no_multiplier;
            const REAL* row;
            const uint8_t* allowed;
            int64_t kept;
            const int64_t n = FN(row_bounds)(x, r, length, stops, allow, allow_rows, &row, &allowed, &kept);
            REAL* out = y + r * length;
            const REAL score = (REAL)ROW_PARAM(sink, r);
            if (copied) row = FN(extend_row)(row, allowed, n, cap, sink_weight != NULL, score, extended);
            if (sink_weight) out = extended + width;
            /* the sink is not one of the n a fraction counts */
            const int64_t uncounted = sink_weight != NULL && score != -INFINITY;
            FN(topk_row)(row, out, n + (sink_weight != NULL), k, is_fraction, ROW_PARAM(temperature, r),
                         multiplier ? multiplier + r : &no_multiplier, work, index, keys, uncounted);
            if (sink_weight) sink_weight[r] = FN(split_row)(out, n, y + r * length);
            FN(zero_tail)(y + r * length, n, length);
        } else {
#pragma omp atomic write
            *failed = 1;
        }
    }
    free(work);
    free(index);
    free(keys);
    free(extended);
}

int FN(attnorm_topk_forward)(const REAL* x, REAL* y, int64_t rows, int64_t length, double k, int is_fraction,
                             double temperature, const REAL* temperature_rows, REAL* multiplier, double sink,
                             const REAL* sink_rows, REAL* sink_weight, double cap, const int64_t* stops,
                             const uint8_t* allow, const int64_t* allow_rows,
                             int threads) {
    int failed = 0;
    ON_TEAM(rows, length, FN(topk_forward_rows)(x, y, rows, length, k, is_fraction, temperature, temperature_rows,
                                                multiplier, sink, sink_rows, sink_weight, cap, stops, allow,
                                                allow_rows, &failed));
    return failed;
}

/* Packed entry points: the kernels above with their arguments unpacked from slots, in order. */
int FN(attnorm_softmax_forward_packed)(const char* packed) {
    attnorm_slot a[19];
    if (!unpack(packed, a, 19)) return PACKED_MISMATCH;
    return FN(attnorm_softmax_forward)(a[0].p, a[1].p, a[2].i, a[3].i, (int)a[4].i, a[5].d, a[6].p, a[7].d, a[8].p,
                                       a[9].p, a[10].p, a[11].d, a[12].p, a[13].p, a[14].d, a[15].p, a[16].p, a[17].p,
                                       (int)a[18].i);
}

int FN(attnorm_softmax_backward_packed)(const char* packed) {
    attnorm_slot a[17];
    if (!unpack(packed, a, 17)) return PACKED_MISMATCH;
    return FN(attnorm_softmax_backward)(a[0].p, a[1].p, a[2].p, a[3].p, a[4].i, a[5].i, a[6].d, a[7].p, (int)a[8].i,
                                        a[9].p, a[10].d, a[11].p, a[12].d, a[13].p, a[14].p, a[15].d, (int)a[16].i);
}

int FN(attnorm_self_adjusted_forward_packed)(const char* packed) {
    attnorm_slot a[14];
    if (!unpack(packed, a, 14)) return PACKED_MISMATCH;
    return FN(attnorm_self_adjusted_forward)(a[0].p, a[1].p, a[2].i, a[3].i, (int)a[4].i, a[5].p, a[6].d, a[7].p,
                                             a[8].p, a[9].d, a[10].p, a[11].p, a[12].p, (int)a[13].i);
}

int FN(attnorm_self_adjusted_backward_packed)(const char* packed) {
    attnorm_slot a[15];
    if (!unpack(packed, a, 15)) return PACKED_MISMATCH;
    return FN(attnorm_self_adjusted_backward)(a[0].p, a[1].p, a[2].p, a[3].i, a[4].i, (int)a[5].i, a[6].p, a[7].d,
                                              a[8].p, a[9].p, a[10].d, a[11].p, a[12].p, a[13].p, (int)a[14].i);
}

int FN(attnorm_entmax_forward_packed)(const char* packed) {
    attnorm_slot a[15];
    if (!unpack(packed, a, 15)) return PACKED_MISMATCH;
    return FN(attnorm_entmax_forward)(a[0].p, a[1].p, a[2].i, a[3].i, a[4].d, a[5].p, a[6].p, a[7].d, a[8].p, a[9].p,
                                      a[10].d, a[11].p, a[12].p, a[13].p, (int)a[14].i);
}

int FN(attnorm_entmax_backward_packed)(const char* packed) {
    attnorm_slot a[16];
    if (!unpack(packed, a, 16)) return PACKED_MISMATCH;
    return FN(attnorm_entmax_backward)(a[0].p, a[1].p, a[2].p, a[3].i, a[4].i, a[5].d, a[6].p, a[7].d, a[8].p,
                                       a[9].p, a[10].d, a[11].p, a[12].p, a[13].p, a[14].d, (int)a[15].i);
}

int FN(attnorm_topk_forward_packed)(const char* packed) {
    attnorm_slot a[17];
    if (!unpack(packed, a, 17)) return PACKED_MISMATCH;
    return FN(attnorm_topk_forward)(a[0].p, a[1].p, a[2].i, a[3].i, a[4].d, (int)a[5].i, a[6].d, a[7].p, a[8].p,
                                    a[9].d, a[10].p, a[11].p, a[12].d, a[13].p, a[14].p, a[15].p, (int)a[16].i);
}

#undef FN
