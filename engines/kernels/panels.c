/* y = x @ wᵀ for a few rows x, with w re-laid in panels (engines/panels.py).
 *
 * A forward of a few rows reads every weight once from memory and does little
 * arithmetic per weight, so what decides its time is how the weight streams.
 * Panels of R output rows, interleaved by the vector's lanes, make each panel
 * one sequential stream: [O/R][K/VW][R][VW]. Each panel is read from memory
 * once and kept in L1 while up to G input rows at a time are multiplied by it
 * (R·G accumulators in registers).
 *
 * A weight whose float32 values are exactly those of a block format is streamed
 * in that format instead, and expanded to the same float32 values in registers
 * (blocks of 32 along K, as GGUF's): Q4_1 (w = d·q + m, q in 0..15: 0.75 bytes
 * a weight here, against 4), Q8_0 (w = d·q, q in -128..127: 1.125) and
 * bfloat16 (2). A product d·q of a half-precision d and a q of at most 8 bits
 * is exact in float32, so the values, and every sum below, are the float32
 * panel's to the bit; only the bytes read from memory change.
 *
 * Every product y[n, o] is summed in the same order whatever the other rows:
 * lane l of the accumulator sums k ≡ l (mod VW) in increasing k, then the lanes
 * are added pairwise. A row's result therefore does not depend on how many
 * rows were fed with it (one decoding, or several verifying drafts), nor on the
 * format its weight streams in.
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

/* Block formats, blocks of QB weights along K. Per panel and block, the R rows' codes, then
 * their scales (floats, from half precision: exact):
 *   QP_Q4    R x 16 bytes (byte i: q[i] | q[i + 16] << 4), R floats d, R floats m
 *   QP_Q8    R x 32 signed bytes, R floats d
 *   QP_BF16  R x 32 bfloat16 (the float's high half) */
#define QB 32
#define CH (QB / VW) /* chunks of a block */
#define AHEAD_BYTES 4096
enum { QP_Q4 = 1, QP_Q8 = 2, QP_BF16 = 3 };
#define BB_Q4 (R * 24)
#define BB_Q8 (R * 36)
#define BB_BF16 (R * 64)

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
/* GCC expands a byte vector to floats element by element (__builtin_convertvector): the
 * instructions that widen a whole vector at once, by name */
#ifdef __AVX512F__
#define LOAD_BYTES(p) _mm_loadu_si128((const __m128i *)(p)) /* VW bytes */
#define U8_FLOATS(v) _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(v))
#define I8_FLOATS(v) _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(v))
#define BF16_FLOATS(p) \
    _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(p))), 16))
#else
#define LOAD_BYTES(p) _mm_loadl_epi64((const __m128i *)(p))
#define U8_FLOATS(v) _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v))
#define I8_FLOATS(v) _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v))
#define BF16_FLOATS(p) \
    _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p))), 16))
#endif

long qpanels_block_bytes(int fmt) {
    return fmt == QP_Q4 ? BB_Q4 : fmt == QP_Q8 ? BB_Q8 : fmt == QP_BF16 ? BB_BF16 : -1;
}

/* row r's chunk c of a block, as the float32 values it encodes */
static inline vf dq_q4(const unsigned char *blk, int r, int c) {
    __m128i v = LOAD_BYTES(blk + r * 16 + (c % (16 / VW)) * VW);
    if (c >= 16 / VW) v = _mm_srli_epi16(v, 4);
    v = _mm_and_si128(v, _mm_set1_epi8(15));
    float d, m;
    memcpy(&d, blk + R * 16 + r * 4, 4);
    memcpy(&m, blk + R * 20 + r * 4, 4);
    return (vf)U8_FLOATS(v) * d + m; /* d·q is exact: the one rounding is the sum's */
}

static inline vf dq_q8(const unsigned char *blk, int r, int c) {
    float d;
    memcpy(&d, blk + R * 32 + r * 4, 4);
    return (vf)I8_FLOATS(LOAD_BYTES(blk + r * 32 + c * VW)) * d;
}

static inline vf dq_bf16(const unsigned char *blk, int r, int c) { return (vf)BF16_FLOATS(blk + r * 64 + c * VW * 2); }
#else
long qpanels_block_bytes(int fmt) { (void)fmt; return -1; } /* no vector widening here: float32 panels only */
#define dq_q4(blk, r, c) ((vf){0})
#define dq_q8(blk, r, c) ((vf){0})
#define dq_bf16(blk, r, c) ((vf){0})
#endif

/* codes [O, K] (uint8 q for Q4, int8 for Q8, uint16 for bfloat16), d and m [O, K/QB] -> p */
void qpanels_pack(int fmt, const void *codes, const float *d, const float *m, unsigned char *p, long O, long K) {
    long nb = K / QB, blocks = (O + R - 1) / R, bb = qpanels_block_bytes(fmt);
    if (bb < 0) return;
    for (long b = 0; b < blocks; b++)
        for (long j = 0; j < nb; j++) {
            unsigned char *dst = p + (b * nb + j) * bb;
            memset(dst, 0, bb); /* rows past O: zero codes and scales, zero weights */
            for (int r = 0; r < R && b * R + r < O; r++) {
                long o = b * R + r;
                if (fmt == QP_Q4) {
                    const unsigned char *q = (const unsigned char *)codes + o * K + j * QB;
                    for (int i = 0; i < 16; i++) dst[r * 16 + i] = (unsigned char)((q[i] & 15) | (q[i + 16] << 4));
                    memcpy(dst + R * 16 + r * 4, d + o * nb + j, 4);
                    memcpy(dst + R * 20 + r * 4, m + o * nb + j, 4);
                } else if (fmt == QP_Q8) {
                    memcpy(dst + r * 32, (const signed char *)codes + o * K + j * QB, 32);
                    memcpy(dst + R * 32 + r * 4, d + o * nb + j, 4);
                } else {
                    memcpy(dst + r * 64, (const unsigned short *)codes + o * K + j * QB, 64);
                }
            }
        }
}

/* p -> w [O, K]: the float32 values the codes encode */
void qpanels_unpack(int fmt, const unsigned char *p, float *w, long O, long K) {
    long nb = K / QB, bb = qpanels_block_bytes(fmt);
    if (bb < 0) return;
    for (long o = 0; o < O; o++)
        for (long j = 0; j < nb; j++) {
            const unsigned char *blk = p + ((o / R) * nb + j) * bb;
            for (int c = 0; c < CH; c++) {
                vf v = fmt == QP_Q4 ? dq_q4(blk, o % R, c) : fmt == QP_Q8 ? dq_q8(blk, o % R, c)
                                                                          : dq_bf16(blk, o % R, c);
                memcpy(w + o * K + j * QB + c * VW, &v, sizeof v);
            }
        }
}

/* as PASS, the panel's rows expanded from their block format by DQ in registers */
#define QPASS(FMT, DQ, NG)                                                                            \
    static inline void qpass_##FMT##_##NG(const unsigned char *pb, const float *x, long K, float *y,   \
                                          long ldy, long o0, long O, int first) {                    \
        vf acc[R][NG];                                                                                \
        for (int r = 0; r < R; r++)                                                                   \
            for (int n = 0; n < NG; n++) acc[r][n] = (vf){0};                                         \
        long nb = K / QB;                                                                             \
        for (long j = 0; j < nb; j++) {                                                               \
            const unsigned char *blk = pb + j * BB_##FMT;                                             \
            if (first)                                                                                \
                for (int l = 0; l < BB_##FMT; l += 64) __builtin_prefetch(blk + AHEAD_BYTES + l, 0, 0); \
            for (int c = 0; c < CH; c++)                                                              \
                for (int r = 0; r < R; r++) {                                                         \
                    vf wv = DQ(blk, r, c);                                                            \
                    for (int n = 0; n < NG; n++)                                                      \
                        acc[r][n] += wv * *(const vfu *)(x + n * K + j * QB + c * VW);                \
                }                                                                                     \
        }                                                                                             \
        for (int r = 0; r < R; r++)                                                                   \
            if (o0 + r < O)                                                                           \
                for (int n = 0; n < NG; n++) y[n * ldy + o0 + r] = lanes_sum(acc[r][n]);              \
    }
#define QPASSES(FMT, DQ) QPASS(FMT, DQ, 1) QPASS(FMT, DQ, 2) QPASS(FMT, DQ, 3) QPASS(FMT, DQ, 4)
QPASSES(Q4, dq_q4)
QPASSES(Q8, dq_q8)
QPASSES(BF16, dq_bf16)

/* As QPASS, the panel taken as two halves of R/2 output rows: the accumulators of 2G
 * inputs (R/2 · 2G) fit where QPASS holds G, so each code is expanded once for twice the
 * inputs, and a pass holds fewer weight vectors live. The first half streams the panel
 * from memory, the second finds it in L1. Each product is summed in QPASS's order: the
 * same bits. Used on AVX2 (16 registers, G = 3) from 2 rows; a lone row keeps QPASS's
 * four independent accumulators (as halves, the Q8_0 head ran 1.1-1.2x slower). SmolLM2's
 * Q4_1 layers on an AMD EPYC with AVX2 (bench/matmuls.py --against the whole panels):
 * 2 / 3 / 4 rows 0.87 / 0.84 / 0.52x the time, 5-16 rows 0.64-0.73x. */
#define QSPLIT(FMT, DQ, NG)                                                                           \
    static inline void qsplit_##FMT##_##NG(const unsigned char *pb, const float *x, long K, float *y,  \
                                           long ldy, long o0, long O, int first) {                   \
        long nb = K / QB;                                                                             \
        for (int h = 0; h < R; h += R / 2) {                                                          \
            vf acc[R / 2][NG];                                                                        \
            for (int r = 0; r < R / 2; r++)                                                           \
                for (int n = 0; n < NG; n++) acc[r][n] = (vf){0};                                     \
            for (long j = 0; j < nb; j++) {                                                           \
                const unsigned char *blk = pb + j * BB_##FMT;                                         \
                if (first && h == 0)                                                                  \
                    for (int l = 0; l < BB_##FMT; l += 64) __builtin_prefetch(blk + AHEAD_BYTES + l, 0, 0); \
                for (int c = 0; c < CH; c++)                                                          \
                    for (int r = 0; r < R / 2; r++) {                                                 \
                        vf wv = DQ(blk, h + r, c);                                                    \
                        for (int n = 0; n < NG; n++)                                                  \
                            acc[r][n] += wv * *(const vfu *)(x + n * K + j * QB + c * VW);            \
                    }                                                                                 \
            }                                                                                         \
            for (int r = 0; r < R / 2; r++)                                                           \
                if (o0 + h + r < O)                                                                   \
                    for (int n = 0; n < NG; n++) y[n * ldy + o0 + h + r] = lanes_sum(acc[r][n]);      \
        }                                                                                             \
    }
#if G == 3
#define QG 6 /* inputs a pass over a block format takes: halves */
#define QSPLITS(FMT, DQ) \
    QSPLIT(FMT, DQ, 2) QSPLIT(FMT, DQ, 3) QSPLIT(FMT, DQ, 4) QSPLIT(FMT, DQ, 5) QSPLIT(FMT, DQ, 6)
QSPLITS(Q4, dq_q4)
QSPLITS(Q8, dq_q8)
QSPLITS(BF16, dq_bf16)
#define QCALL(FMT)                                                                                    \
    switch (ng) {                                                                                     \
    case 1: qpass_##FMT##_1(pb, xg, K, yg, ldy, b * R, O, g == 0); break;                            \
    case 2: qsplit_##FMT##_2(pb, xg, K, yg, ldy, b * R, O, g == 0); break;                           \
    case 3: qsplit_##FMT##_3(pb, xg, K, yg, ldy, b * R, O, g == 0); break;                           \
    case 4: qsplit_##FMT##_4(pb, xg, K, yg, ldy, b * R, O, g == 0); break;                           \
    case 5: qsplit_##FMT##_5(pb, xg, K, yg, ldy, b * R, O, g == 0); break;                           \
    default: qsplit_##FMT##_6(pb, xg, K, yg, ldy, b * R, O, g == 0); break;                          \
    }
#else
#define QG G /* 32 registers hold a whole panel's accumulators for G inputs */
#define QCALL(FMT)                                                                                    \
    switch (ng) {                                                                                     \
    case 1: qpass_##FMT##_1(pb, xg, K, yg, ldy, b * R, O, g == 0); break;                            \
    case 2: qpass_##FMT##_2(pb, xg, K, yg, ldy, b * R, O, g == 0); break;                            \
    case 3: qpass_##FMT##_3(pb, xg, K, yg, ldy, b * R, O, g == 0); break;                            \
    default: qpass_##FMT##_4(pb, xg, K, yg, ldy, b * R, O, g == 0); break;                           \
    }
#endif

/* Input rows one pass over a weight's panels takes (fmt 0: float32 panels, else a block
 * format): a forward's rows are multiplied that many at a time, so one more row past a
 * multiple of it reads the whole weight once more (the step-cost model prices the passes). */
int panels_inputs(int fmt) { return fmt ? QG : G; }

/* panels_mm over a weight in a block format (p from qpanels_pack): each panel's codes are
 * expanded in registers as they are multiplied, once a pass of up to QG rows (expanding a
 * panel once into L1 for all the passes ran slower from 5 rows up). -1 if K is not a
 * multiple of a block or the format is unknown. */
int qpanels_mm(int fmt, const unsigned char *p, const float *x, float *y, long O, long K, long N, long ldy,
               int threads) {
    long bb = qpanels_block_bytes(fmt);
    if (K % QB || N < 1 || bb < 0) return -1;
    long blocks = (O + R - 1) / R, nb = K / QB;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (long b = 0; b < blocks; b++) {
        const unsigned char *pb = p + b * nb * bb;
        for (long g = 0, ng; g < N; g += ng) {
            const float *xg = x + g * K;
            float *yg = y + g * ldy;
            ng = N - g < QG ? N - g : QG;
            if (fmt == QP_Q4) QCALL(Q4) else if (fmt == QP_Q8) QCALL(Q8) else QCALL(BF16)
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

int attention_selftest(void);
int fused_selftest(void);

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
    /* every block format: the same bits as the float32 panels of the values it encodes */
    long Kq = 2 * QB;
    unsigned char *codes = malloc(O * Kq * 2), *qp = malloc(blocks * (Kq / QB) * BB_BF16);
    float *d = malloc(O * 2 * sizeof(float)), *m = malloc(O * 2 * sizeof(float)), *wq = malloc(O * Kq * 4);
    float *pq = aligned_alloc(64, blocks * R * Kq * sizeof(float)), *yq = malloc(9 * O * sizeof(float));
    float *xq = malloc(9 * Kq * sizeof(float));
    if (!codes || !qp || !d || !m || !wq || !pq || !yq || !xq) return 2;
    for (long i = 0; i < 9 * Kq; i++) xq[i] = (float)((s = s * 1103515245u + 12345u) >> 16 & 1023) / 512.f - 1.f;
    for (int fmt = QP_Q4; fmt <= QP_BF16 && qpanels_block_bytes(fmt) > 0; fmt++) {
        for (long i = 0; i < O * Kq * 2; i++) codes[i] = (unsigned char)((s = s * 1103515245u + 12345u) >> 16);
        if (fmt == QP_Q4)
            for (long i = 0; i < O * Kq; i++) codes[i] &= 15;
        if (fmt == QP_BF16)
            for (long i = 0; i < O * Kq; i++) codes[2 * i + 1] = (codes[2 * i + 1] & 0x3f) | 0x3c; /* finite */
        for (long i = 0; i < O * 2; i++) d[i] = (float)(i % 7 + 1) / 1024.f, m[i] = -(float)(i % 5) / 64.f;
        qpanels_pack(fmt, codes, d, m, qp, O, Kq);
        qpanels_unpack(fmt, qp, wq, O, Kq);
        panels_pack(wq, pq, O, Kq);
        for (long n = 1; n <= 9; n++) {
            if (qpanels_mm(fmt, qp, xq, yq, O, Kq, n, O, 2) || panels_mm(pq, xq, y, O, Kq, n, O, 2)) return 3;
            if (memcmp(y, yq, n * O * sizeof(float))) {
                fprintf(stderr, "format %d, rows %ld: not the float32 panels' bits\n", fmt, n);
                return 1;
            }
        }
    }
    if (attention_selftest()) { /* attention.c, built into the same library */
        fprintf(stderr, "attention differs from double sums\n");
        return 1;
    }
    if (fused_selftest()) { /* fused.c, likewise */
        fprintf(stderr, "the fused ops differ from double sums\n");
        return 1;
    }
    return 0;
}
#endif
