/* float32 and bfloat16 elements as float32, for the CPU's C kernels (engine/layers/native.py
 * builds them; a kernel includes this header by its path relative to its own source).
 * bfloat16 is float32's upper 16 bits; rounding to it is to nearest even, for finite values
 * (the kernels build with -ffast-math, which assumes no infinities or NaNs). */
#ifndef SLUICE_CPU_DTYPES_H
#define SLUICE_CPU_DTYPES_H

#include <stdint.h>
#include <string.h>

enum { F32 = 0, BF16 = 1 };  /* engine/layers/native.py's DTYPES */

static inline float bits_f32(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline float round_to(int dtype, float x) {  /* x as the dtype holds it, as float32 */
    if (dtype == F32) return x;
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    return bits_f32((u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u);
}

static inline float load(const void *p, int dtype, int64_t i) {
    if (dtype == F32) return ((const float *)p)[i];
    return bits_f32((uint32_t)((const uint16_t *)p)[i] << 16);
}

static inline void put(void *p, int dtype, int64_t i, float x) {
    if (dtype == F32) {
        ((float *)p)[i] = x;
        return;
    }
    uint32_t u;
    x = round_to(BF16, x);
    memcpy(&u, &x, sizeof u);
    ((uint16_t *)p)[i] = (uint16_t)(u >> 16);
}

#endif
