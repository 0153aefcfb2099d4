/* The small ops between a decoder layer's matmuls, one call each (engines/fused.py).
 *
 * Around its matmuls a layer runs two RMS norms with their residual adds, RoPE over
 * its queries and keys, and SiLU(gate)·up: in torch some thirty ops a layer, each a
 * few microseconds of dispatch over a few hundred floats for a decode row (30 layers:
 * ~3.5 ms of a ~15 ms lone step on 2 cores). Here each is one call over the
 * forward's rows.
 *
 * Every row is computed alone and in one order (a row's sum of squares lane l over
 * e ≡ l (mod AW) in increasing e, the remainder in order, then the lanes pairwise), so
 * a token's result is the same bits decoded alone, verified beside drafts or beside
 * other rows, whichever thread runs it.
 */
#include <math.h>

#include "vec.h"

#define PAR_ROWS 16 /* fewer rows than this run on the calling thread: a team's wake-up costs more */

/* 1 / sqrt(mean(x²) + eps) of one row of E */
static inline float inv_rms(const float *x, long E, float eps) {
    long full = E - E % AW;
    av acc = {0};
    for (long e = 0; e < full; e += AW) {
        av v = *(const avu *)(x + e);
        acc += v * v;
    }
    float ss = alanes(acc);
    for (long e = full; e < E; e++) ss += x[e] * x[e];
    return 1.f / sqrtf(ss / (float)E + eps);
}

/* h = x · inv_rms(x) · w, rows of E, x's rows xs floats apart; h contiguous */
void fused_rms_norm(const float *x, long xs, const float *w, float *h, long N, long E, float eps, int threads) {
#pragma omp parallel for num_threads(threads) if (N >= PAR_ROWS)
    for (long n = 0; n < N; n++) {
        const float *r = x + n * xs;
        float inv = inv_rms(r, E, eps);
        for (long e = 0; e < E; e++) h[n * E + e] = r[e] * inv * w[e];
    }
}

/* s = x + y, h = rms_norm(s) · w: the residual add and the next norm in one pass over
 * the rows; x, s and h contiguous [N, E], y's rows ys floats apart */
void fused_add_rms_norm(const float *x, const float *y, long ys, const float *w, float *s, float *h, long N, long E,
                        float eps, int threads) {
#pragma omp parallel for num_threads(threads) if (N >= PAR_ROWS)
    for (long n = 0; n < N; n++) {
        float *r = s + n * E;
        for (long e = 0; e < E; e++) r[e] = x[n * E + e] + y[n * ys + e];
        float inv = inv_rms(r, E, eps);
        for (long e = 0; e < E; e++) h[n * E + e] = r[e] * inv * w[e];
    }
}

/* Rotate-half RoPE in place over the first `heads` heads of D of each row (queries and
 * keys side by side in a QKV row), rows rs floats apart; cos and sin [N, D] contiguous.
 * x[i] = x[i]·cos[i] − x[i+D/2]·sin[i], x[i+D/2] = x[i+D/2]·cos[i+D/2] + x[i]·sin[i+D/2]. */
void fused_rope(float *x, long rs, long heads, const float *cos, const float *sin, long N, long D, int threads) {
    long half = D / 2;
#pragma omp parallel for num_threads(threads) if (N >= PAR_ROWS)
    for (long n = 0; n < N; n++) {
        const float *c = cos + n * D, *sn = sin + n * D;
        for (long h = 0; h < heads; h++) {
            float *v = x + n * rs + h * D;
            for (long i = 0; i < half; i++) {
                float a = v[i], b = v[i + half];
                v[i] = a * c[i] - b * sn[i];
                v[i + half] = b * c[i + half] + a * sn[i + half];
            }
        }
    }
}

/* out = silu(g) · u, g and u the halves of gu's rows [N, 2I] (gate first), out [N, I]:
 * silu(g) = g · σ(g), σ(g) = 1 / (1 + t) for g ≥ 0 and t / (1 + t) below, t = e^−|g|
 * (vexp's domain); vectors of AW, the last part padded */
void fused_silu_mul(const float *gu, float *out, long N, long I, int threads) {
#pragma omp parallel for num_threads(threads) if (N >= PAR_ROWS)
    for (long n = 0; n < N; n++) {
        const float *g = gu + n * 2 * I, *u = g + I;
        float *o = out + n * I;
        for (long i = 0; i < I; i += AW) {
            long k = I - i < AW ? I - i : AW;
            av x = {0}, y = {0};
            if (k == AW)
                x = *(const avu *)(g + i), y = *(const avu *)(u + i);
            else
                for (long l = 0; l < k; l++) x[l] = g[i + l], y[l] = u[i + l];
            avi neg = x < 0;
            av t = vexp((av)((avi)x | ~((avi){0} + 0x7fffffff))); /* −|x|: the sign bit set */
            av sig = (av)(((avi)t & neg) | ((avi)((av){0} + 1.f) & ~neg)) / (1.f + t);
            av r = x * sig * y;
            if (k == AW)
                *(avu *)(o + i) = r;
            else
                for (long l = 0; l < k; l++) o[i + l] = r[l];
        }
    }
}

#ifdef PANELS_SELFTEST
/* run by the self-test program (panels.c) before the library is loaded: each op on two
 * rows against double sums. 0: agrees. */
int fused_selftest(void) {
    enum { N = 2, E = 2 * AW + 3, I = AW + 5, D = 8 };
    float x[N * E], y[N * E], w[E], s[N * E], h[N * E], gu[N * 2 * I], o[N * I], q[N * 2 * D], cs[N * D], sn[N * D];
    unsigned r = 11;
#define RND() ((float)((r = r * 1103515245u + 12345u) >> 16 & 1023) / 256.f - 2.f)
    for (long i = 0; i < N * E; i++) x[i] = RND(), y[i] = RND();
    for (long i = 0; i < E; i++) w[i] = RND();
    for (long i = 0; i < N * 2 * I; i++) gu[i] = 8.f * RND();
    for (long i = 0; i < N * 2 * D; i++) q[i] = RND();
    for (long i = 0; i < N * D; i++) cs[i] = RND(), sn[i] = RND();
    fused_add_rms_norm(x, y, E, w, s, h, N, E, 1e-5f, 2);
    for (long n = 0; n < N; n++) {
        double ss = 0;
        for (long e = 0; e < E; e++) ss += ((double)x[n * E + e] + y[n * E + e]) * ((double)x[n * E + e] + y[n * E + e]);
        double inv = 1 / sqrt(ss / E + 1e-5);
        for (long e = 0; e < E; e++)
            if (fabs(h[n * E + e] - ((double)x[n * E + e] + y[n * E + e]) * inv * w[e]) > 1e-4) return 1;
    }
    fused_silu_mul(gu, o, N, I, 2);
    for (long n = 0; n < N; n++)
        for (long i = 0; i < I; i++) {
            double g = gu[n * 2 * I + i], u = gu[n * 2 * I + I + i], want = g / (1 + exp(-g)) * u;
            if (fabs(o[n * I + i] - want) > 1e-5 * (1 + fabs(want))) return 1;
        }
    float q0[N * 2 * D];
    for (long i = 0; i < N * 2 * D; i++) q0[i] = q[i];
    fused_rope(q, 2 * D, 2, cs, sn, N, D, 2);
    for (long n = 0; n < N; n++)
        for (long hh = 0; hh < 2; hh++)
            for (long i = 0; i < D; i++) {
                const float *v = q0 + n * 2 * D + hh * D;
                double rot = i < D / 2 ? -(double)v[i + D / 2] : v[i - D / 2];
                double want = v[i] * (double)cs[n * D + i] + rot * sn[n * D + i];
                if (fabs(q[n * 2 * D + hh * D + i] - want) > 1e-5) return 1;
            }
    return 0;
#undef RND
}
#endif
