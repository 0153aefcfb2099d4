/* The vectors the kernels beside the panels share (attention.c, fused.c): AW float
 * lanes (AVX-512's 16, else 8), the lanes' sum in one order, and e^x a lane at a time. */
#ifndef SPECGATE_VEC_H
#define SPECGATE_VEC_H

#include <math.h>

#ifdef __AVX512F__
#define AW 16
#else
#define AW 8
#endif

typedef float av __attribute__((vector_size(AW * 4)));
typedef float avu __attribute__((vector_size(AW * 4), aligned(4)));
typedef int avi __attribute__((vector_size(AW * 4)));

/* the lanes summed pairwise, halves folded onto each other: lane i adds lane i + AW/2,
 * then i + AW/4, ... (a shuffle and an add a level, where a store and scalar adds cost
 * most of a 64-wide dot product) */
#ifdef __clang__
#define HALF(v, ...) __builtin_shufflevector(v, v, __VA_ARGS__)
#else
#define HALF(v, ...) __builtin_shuffle(v, (avi){__VA_ARGS__})
#endif

static inline float alanes(av v) {
#if AW == 16
    v += HALF(v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
    v += HALF(v, 4, 5, 6, 7, 0, 1, 2, 3, 8, 9, 10, 11, 12, 13, 14, 15);
    v += HALF(v, 2, 3, 0, 1, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    v += HALF(v, 1, 0, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
#else
    v += HALF(v, 4, 5, 6, 7, 0, 1, 2, 3);
    v += HALF(v, 2, 3, 0, 1, 4, 5, 6, 7);
    v += HALF(v, 1, 0, 2, 3, 4, 5, 6, 7);
#endif
    return v[0];
}

static inline float dot(const float *a, const float *b, long D) {
    av acc = {0};
    for (long d = 0; d < D; d += AW) acc += *(const avu *)(a + d) * *(const avu *)(b + d);
    return alanes(acc);
}

/* e^x a lane at a time, for x ≤ 0 (scores less their maximum): 2^n · p(r), n = x·log2(e)
 * rounded to nearest, r = x − n·ln 2 in two parts (|r| ≤ ln 2 / 2), p Cephes' expf polynomial
 * (within 2 ulp of e^r); e^x is 0 below −87. Lane by lane, so a score's weight is the same
 * bits wherever it sits in a vector. (glibc's scalar expf took about a quarter of the
 * kernel's time.) */
static inline av vexp(av x) {
    const av lo = (av){0} - 87.0f;
    avi keep = x >= lo;
    x = (av)(((avi)x & keep) | ((avi)lo & ~keep)); /* x < −87 computes e^−87, zeroed below */
    av n = (x * 1.44269504f + 12582912.0f) - 12582912.0f; /* 1.5 · 2^23: rounds to an integer */
    av r = x - n * 0.693359375f - n * -2.12194440e-4f;
    av p = (av){0} + 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * (r * r) + r + 1.0f;
    return (av)(((avi)p + (__builtin_convertvector(n, avi) << 23)) & keep); /* p · 2^n in the exponent */
}

#endif
