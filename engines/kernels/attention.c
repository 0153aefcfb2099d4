/* Causal attention of a step's rows over their own caches, one call a layer
 * (engines/attention.py).
 *
 * A step's rows each attend over their own cache: a decode row one query a head,
 * a verifying row one per token fed, a prefill chunk many. In torch that is a
 * dozen small ops a row and a layer (two cache writes, two bmm, a softmax, the
 * reshapes), each dispatched for a few microseconds of arithmetic: at SmolLM2's
 * 3 kv heads of 64 over a few hundred positions, the dispatch is most of it.
 * Here each (row, kv head) is one task: store the row's new keys and values at
 * their positions, then for each of its queries (the kv head's G query heads at
 * each new token) scores over positions 0..start+t, a softmax, and the values'
 * weighted sum.
 *
 * Every query is computed in one order whatever else the row or the step holds:
 * a dot product sums lane l over d ≡ l (mod AW) in increasing d, then the lanes
 * pairwise; the softmax's weights are computed lane by lane and summed as the
 * dot products are (over positions); the weighted sum runs over positions in
 * increasing order. A token's attention is therefore the same bits decoded alone,
 * verified beside drafts, or beside any other rows.
 *
 * float32, head_dim a multiple of the vector's lanes; engines/attention.py keeps
 * torch for anything else.
 */
#include <stdlib.h>
#include <string.h>

#include "vec.h"

#define MAXC 32 /* vectors a head at most (head_dim 256 with AVX2's 8 lanes, 512 with AVX-512's 16) */

/* a query's softmax over its S scores, in place, and 1 / their sum: the maximum by lanes
 * (exact in any order), the weights by vexp (a last part vector padded), their sum lane by
 * lane over j ≡ l (mod AW) in increasing j, then the lanes pairwise: one order for a given S */
static inline float softmax(float *pg, long S) {
    long full = S - S % AW;
    av mv = pg[0] - (av){0}, sv = {0};
    for (long j = 0; j < full; j += AW) {
        av x = *(const avu *)(pg + j);
        avi more = x > mv;
        mv = (av)(((avi)x & more) | ((avi)mv & ~more));
    }
    float m = mv[0];
    for (long l = 1; l < AW; l++)
        if (mv[l] > m) m = mv[l];
    for (long j = full; j < S; j++)
        if (pg[j] > m) m = pg[j];
    for (long j = 0; j < full; j += AW) {
        av w = vexp(*(const avu *)(pg + j) - m);
        *(avu *)(pg + j) = w;
        sv += w;
    }
    if (full < S) {
        av x = m - (av){0}; /* padding: e^0, not summed */
        for (long j = full; j < S; j++) x[j - full] = pg[j];
        av w = vexp(x - m);
        for (long j = full; j < S; j++) sv[j - full] += (pg[j] = w[j - full]);
    }
    return 1.f / alanes(sv);
}

int attention_lanes(void) { return AW; }

/* rows: the step's rows attended here. Per row r: T[r] new tokens at token offset
 * off[r] of q, k, v and out; start[r] positions already cached; kc[r] and vc[r]
 * its caches at layer 0, layers ls[r] floats apart (this call attends layer
 * `layer`), heads hs[r] apart and positions ps[r] apart.
 * q [N, H, D] with tokens qs floats apart, k and v [N, Hk, D] with tokens ks and
 * vs floats apart (heads D apart), out [N, H, D] contiguous. Returns 0; 1 if a
 * score buffer could not be allocated, 2 if a head has more than MAXC vectors. */
int ragged_attend(long rows, const long *T, const long *off, const long *start, float *const *kc,
                  float *const *vc, const long *ls, long layer, const long *hs, const long *ps, const float *q,
                  long qs, const float *k,
                  long ks, const float *v, long vs, float *out, long H, long Hk, long D, float scale,
                  int threads) {
    long G = H / Hk, longest = 0, work = 0, C = D / AW;
    if (C > MAXC) return 2;
    for (long r = 0; r < rows; r++) {
        if (start[r] + T[r] > longest) longest = start[r] + T[r];
        work += T[r] * (start[r] + T[r]);
    }
    int failed = 0;
    /* even a lone row's decode step runs faster on two threads (its kv heads apart) */
#pragma omp parallel num_threads(threads) if (work * H * D > 20000)
    {
        float *p = malloc((size_t)(G * longest) * sizeof(float)); /* [G][S] scores, then weights */
        if (!p) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (long task = 0; task < rows * Hk; task++) {
            if (!p) continue;
            long r = task / Hk, h = task % Hk;
            float *kh = kc[r] + layer * ls[r] + h * hs[r], *vh = vc[r] + layer * ls[r] + h * hs[r];
            for (long t = 0; t < T[r]; t++) {
                long n = off[r] + t, pos = start[r] + t;
                memcpy(kh + pos * ps[r], k + n * ks + h * D, D * sizeof(float));
                memcpy(vh + pos * ps[r], v + n * vs + h * D, D * sizeof(float));
            }
            for (long t = 0; t < T[r]; t++) {
                long n = off[r] + t, S = start[r] + t + 1;
                const float *qg = q + n * qs + h * G * D; /* the kv head's G query heads, D apart */
                /* scores: each key read once for the G queries that share it */
                for (long j = 0; j < S; j++) {
                    const float *kj = kh + j * ps[r];
                    for (long g = 0; g < G; g++) p[g * S + j] = dot(qg + g * D, kj, D) * scale;
                }
                for (long g = 0; g < G; g++) {
                    float *pg = p + g * S, inv = softmax(pg, S);
                    av acc[MAXC];
                    for (long c = 0; c < C; c++) acc[c] = (av){0};
                    for (long j = 0; j < S; j++) {
                        const float *vj = vh + j * ps[r];
                        for (long c = 0; c < C; c++) acc[c] += pg[j] * *(const avu *)(vj + c * AW);
                    }
                    float *o = out + (n * H + h * G + g) * D;
                    for (long c = 0; c < C; c++) *(avu *)(o + c * AW) = acc[c] * inv;
                }
            }
        }
        free(p);
    }
    return failed;
}

#ifdef PANELS_SELFTEST
/* run by the self-test program (panels.c) before the library is loaded: one row of
 * two new tokens over three cached positions, against double sums. 0: agrees. */
int attention_selftest(void) {
    enum { H = 4, Hk = 2, D = 2 * AW, S = 5, T = 2 };
    static float kc[Hk * S * D], vc[Hk * S * D], q[T * H * D], k[T * Hk * D], v[T * Hk * D], out[T * H * D];
    unsigned s = 7;
    float *all[] = {kc, vc, q, k, v};
    long sizes[] = {Hk * S * D, Hk * S * D, T * H * D, T * Hk * D, T * Hk * D};
    for (int a = 0; a < 5; a++)
        for (long i = 0; i < sizes[a]; i++) all[a][i] = (float)((s = s * 1103515245u + 12345u) >> 16 & 1023) / 512.f - 1.f;
    long Ts[] = {T}, offs[] = {0}, starts[] = {S - T}, lss[] = {0}, hss[] = {S * D}, pss[] = {D};
    float *kcs[] = {kc}, *vcs[] = {vc};
    if (ragged_attend(1, Ts, offs, starts, kcs, vcs, lss, 0, hss, pss, q, H * D, k, Hk * D, v, Hk * D, out, H, Hk,
                      D, 0.125f, 2))
        return 1;
    for (long t = 0; t < T; t++)
        for (long hq = 0; hq < H; hq++) {
            long h = hq / (H / Hk), n = S - T + t + 1;
            double w[S], m = -1e300, z = 0;
            for (long j = 0; j < n; j++) {
                w[j] = 0;
                for (long d = 0; d < D; d++) w[j] += (double)q[(t * H + hq) * D + d] * kc[(h * S + j) * D + d];
                w[j] *= 0.125;
                if (w[j] > m) m = w[j];
            }
            for (long j = 0; j < n; j++) z += (w[j] = exp(w[j] - m));
            for (long d = 0; d < D; d++) {
                double want = 0;
                for (long j = 0; j < n; j++) want += w[j] / z * vc[(h * S + j) * D + d];
                if (fabs(out[(t * H + hq) * D + d] - want) > 1e-4) return 1;
            }
        }
    /* the softmax alone, over 2·AW + 5 scores from 0 down to −120 with the greatest in the
     * padded last part: every weight within 1e-6 (relative) of double's from the same differences,
     * those under e^−87 zero */
    enum { N = 2 * AW + 5 };
    float sc[N], x[N];
    double z = 0;
    for (int j = 0; j < N; j++) x[j] = sc[j] = -120.f * j / (N - 1) + 2.f;
    x[N - 2] = sc[N - 2] = 3.f;
    for (int j = 0; j < N; j++) z += exp((double)(x[j] -= 3.f)); /* less the maximum, rounded as the kernel's */
    float inv = softmax(sc, N);
    for (int j = 0; j < N; j++) {
        double want = exp((double)x[j]) / z;
        if (x[j] < -87.f ? sc[j] != 0.f : fabs(sc[j] * inv - want) > 1e-6 * want) return 1;
    }
    return 0;
}
#endif
