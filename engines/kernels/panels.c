/* y = x @ wᵀ for a few rows x, with w re-laid in panels (engines/panels.py).
 *
 * A forward of a few rows reads every weight once from memory and does little
 * arithmetic per weight, so what decides its time is how the weight streams.
 * Panels of R output rows, interleaved by the vector's lanes, make each panel
 * one sequential stream: [O/R][K/VW][R][VW]. Each panel is read from memory
 * once and kept in L1 while up to G input rows at a time are multiplied by it
 * (R·G accumulators in registers).
 *
 * Every product y[n, o] is summed in the same order whatever the other rows:
 * lane l of the accumulator sums k ≡ l (mod VW) in increasing k, then the lanes
 * are added pairwise. A row's result therefore does not depend on how many
 * rows were fed with it (one decoding, or several verifying drafts).
 *
 * Built at start-up with the machine's own instruction set (-march=native);
 * OpenMP threads come from the runtime torch already loaded (libgomp.so.1).
 */
#include <string.h>

#ifdef __AVX512F__
#define VW 16 /* floats a vector holds */
#define G 4   /* input rows a pass: 16 accumulators of 32 registers */
#else
#define VW 8
#define G 3   /* 12 accumulators of 16 registers */
#endif
#define R 4      /* output rows a panel */
#define AHEAD 1024 /* floats prefetched ahead of the panel's read (4 KB) */

typedef float vf __attribute__((vector_size(VW * 4)));
typedef float vfu __attribute__((vector_size(VW * 4), aligned(4))); /* an input row need not be aligned */

static inline float lanes_sum(vf v) {
    float s[VW];
    memcpy(s, &v, sizeof s);
    for (int w = VW / 2; w >= 1; w /= 2)
        for (int i = 0; i < w; i++) s[i] += s[i + w];
    return s[0];
}

int panels_lanes(void) { return VW; }
int panels_rows(void) { return R; }

/* w [O, K] -> p [ceil(O/R)][K/VW][R][VW], rows past O zero. K % VW == 0. */
void panels_pack(const float *w, float *p, long O, long K) {
    long chunks = K / VW, blocks = (O + R - 1) / R;
    for (long b = 0; b < blocks; b++)
        for (long c = 0; c < chunks; c++)
            for (int r = 0; r < R; r++) {
                long o = b * R + r;
                float *dst = p + ((b * chunks + c) * R + r) * VW;
                if (o < O) memcpy(dst, w + o * K + c * VW, VW * sizeof(float));
                else memset(dst, 0, VW * sizeof(float));
            }
}

/* p -> w: what panels_pack was given */
void panels_unpack(const float *p, float *w, long O, long K) {
    long chunks = K / VW;
    for (long o = 0; o < O; o++)
        for (long c = 0; c < chunks; c++)
            memcpy(w + o * K + c * VW, p + (((o / R) * chunks + c) * R + o % R) * VW, VW * sizeof(float));
}

/* NG input rows (x, K apart) times one panel pb -> y[n * ldy + o0 + r] */
#define PASS(NG)                                                                                      \
    static inline void pass_##NG(const float *pb, const float *x, long K, float *y, long ldy, long o0, \
                                 long O, int first) {                                                 \
        vf acc[R][NG];                                                                                \
        for (int r = 0; r < R; r++)                                                                   \
            for (int n = 0; n < NG; n++) acc[r][n] = (vf){0};                                         \
        long chunks = K / VW;                                                                         \
        for (long c = 0; c < chunks; c++) {                                                           \
            const float *pc = pb + c * R * VW;                                                        \
            if (first) /* later passes find the panel in L1 */                                        \
                for (int l = 0; l < R * VW; l += 16) __builtin_prefetch(pc + AHEAD + l, 0, 0);         \
            for (int r = 0; r < R; r++) {                                                             \
                vf wv = *(const vf *)(pc + r * VW);                                                   \
                for (int n = 0; n < NG; n++) acc[r][n] += wv * *(const vfu *)(x + n * K + c * VW);    \
            }                                                                                         \
        }                                                                                             \
        for (int r = 0; r < R; r++)                                                                   \
            if (o0 + r < O)                                                                           \
                for (int n = 0; n < NG; n++) y[n * ldy + o0 + r] = lanes_sum(acc[r][n]);              \
    }
PASS(1)
PASS(2)
PASS(3)
#if G >= 4
PASS(4)
#endif

/* y[n, o] = sum_k w[o, k] x[n, k] for n < N: p from panels_pack (64-byte aligned), x [N, K]
 * contiguous, y rows ldy apart. -1 if K is not a multiple of the lanes. */
int panels_mm(const float *p, const float *x, float *y, long O, long K, long N, long ldy, int threads) {
    if (K % VW || N < 1) return -1;
    long chunks = K / VW, blocks = (O + R - 1) / R;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (long b = 0; b < blocks; b++) {
        const float *pb = p + b * chunks * R * VW;
        for (long g = 0; g < N; g += G) {
            const float *xg = x + g * K;
            float *yg = y + g * ldy;
            switch (N - g < G ? N - g : G) {
            case 1: pass_1(pb, xg, K, yg, ldy, b * R, O, g == 0); break;
            case 2: pass_2(pb, xg, K, yg, ldy, b * R, O, g == 0); break;
            case 3: pass_3(pb, xg, K, yg, ldy, b * R, O, g == 0); break;
#if G >= 4
            case 4: pass_4(pb, xg, K, yg, ldy, b * R, O, g == 0); break;
#endif
            }
        }
    }
    return 0;
}

#ifdef PANELS_SELFTEST
/* Built as a program and run before the library is loaded: an instruction the CPU
 * advertises but cannot run (a virtual machine's CPUID can say more than it allows)
 * kills this process, not the engine. Exit 0: the products agree with double sums. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

int main(void) {
    long O = 37, K = 3 * VW, blocks = (O + R - 1) / R;
    float *w = malloc(O * K * sizeof(float)), *x = malloc(9 * K * sizeof(float)), *y = malloc(9 * O * sizeof(float));
    float *p = aligned_alloc(64, blocks * R * K * sizeof(float));
    if (!w || !x || !y || !p) return 2;
    unsigned s = 1;
    for (long i = 0; i < O * K; i++) w[i] = (float)((s = s * 1103515245u + 12345u) >> 16 & 1023) / 512.f - 1.f;
    for (long i = 0; i < 9 * K; i++) x[i] = (float)((s = s * 1103515245u + 12345u) >> 16 & 1023) / 512.f - 1.f;
    panels_pack(w, p, O, K);
    for (long n = 1; n <= 9; n++) {
        if (panels_mm(p, x, y, O, K, n, O, 2)) return 3;
        for (long i = 0; i < n; i++)
            for (long o = 0; o < O; o++) {
                double want = 0;
                for (long k = 0; k < K; k++) want += (double)w[o * K + k] * x[i * K + k];
                if (fabs(y[i * O + o] - want) > 1e-4 * K) {
                    fprintf(stderr, "rows %ld: y[%ld, %ld] = %g, want %g\n", n, i, o, y[i * O + o], want);
                    return 1;
                }
            }
    }
    return 0;
}
#endif
