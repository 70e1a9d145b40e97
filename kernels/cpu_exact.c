/* CPU element-wise kernels that must round exactly as transformers' torch ops do (built
 * without -ffast-math and without FMA contraction: kernels/cpu/). */
#include <math.h>
#include <stdint.h>

#include "cpu_api.h"
#include "cpu_bf16.h"

/* Rotary embedding in place, Llama's form: x*cos + rotate_half(x)*sin with
 * rotate_half(x) = cat(-x[D/2:], x[:D/2]); each product and the sum rounded as torch rounds
 * them (fp32, or bf16 after each op). q [T, H, D] / k [T, Hkv, D] rows at element strides
 * qs/ks per token (heads contiguous within a token), cos/sin [T, D] at stride cs. */
static void rope_rows(void *x, int64_t xs, int64_t nh, const void *cos, const void *sin, int64_t cs,
                      int64_t t, int64_t D, int bf16) {
    const int64_t half = D / 2;
    if (bf16) {
        const uint16_t *c = (const uint16_t *)cos + t * cs, *s = (const uint16_t *)sin + t * cs;
        for (int64_t h = 0; h < nh; ++h) {
            uint16_t *r = (uint16_t *)x + t * xs + h * D;
            for (int64_t i = 0; i < half; ++i) {
                const float a = bf16_to_f32(r[i]), b = bf16_to_f32(r[i + half]);
                const float lo = bf16_to_f32(f32_to_bf16(a * bf16_to_f32(c[i])))
                               + bf16_to_f32(f32_to_bf16(-b * bf16_to_f32(s[i])));
                const float hi = bf16_to_f32(f32_to_bf16(b * bf16_to_f32(c[i + half])))
                               + bf16_to_f32(f32_to_bf16(a * bf16_to_f32(s[i + half])));
                r[i] = f32_to_bf16(lo);
                r[i + half] = f32_to_bf16(hi);
            }
        }
    } else {
        const float *c = (const float *)cos + t * cs, *s = (const float *)sin + t * cs;
        for (int64_t h = 0; h < nh; ++h) {
            float *r = (float *)x + t * xs + h * D;
            for (int64_t i = 0; i < half; ++i) {
                const float a = r[i], b = r[i + half];
                r[i] = a * c[i] + (-b) * s[i];
                r[i + half] = b * c[i + half] + a * s[i + half];
            }
        }
    }
}

void lmi_rotary(void *q, void *k, const void *cos, const void *sin, int64_t T, int64_t H, int64_t Hkv,
                int64_t D, int64_t qs, int64_t ks, int64_t cs, int bf16, int nthreads) {
#pragma omp parallel for num_threads(nthreads) if (T * (H + Hkv) * D >= 65536) schedule(static)
    for (int64_t t = 0; t < T; ++t) {
        rope_rows(q, qs, H, cos, sin, cs, t, D, bf16);
        rope_rows(k, ks, Hkv, cos, sin, cs, t, D, bf16);
    }
}

/* Llama's fp32 RMSNorm, w * (x * rsqrt(mean(x^2) + eps)), rounded exactly as torch's CPU ops
 * compute it for a row of H contiguous floats (F.rms_norm decomposes into pow, mean = sum /
 * H, add, rsqrt, mul): the sum in torch's own order (aten/src/ATen/native/cpu/SumKernel.cpp,
 * cascade_sum over a contiguous inner dimension). That order, for W-lane vectors (W: 8 for the
 * torch 2.13 wheel with its AVX512 and its AVX2 kernels alike, as found by trying; any W up to 16
 * is taken; 1 for rows shorter than W): the row as (size / 4, 4) elements of W lanes; each of the 4 columns summed lane-wise in a cascade of 4 levels of 2^4 (multi_row_sum),
 * the leftover elements into column 0, columns 1..3 into column 0; then the scalar tail and the
 * W lanes, in order, into one float. Past torch's parallel grain (32768 elements) torch splits the
 * rows across threads, each row still summed this way (kernels/cpu/'s first-use check covers
 * both). kernels/cpu/ finds W by checking against torch at first use and falls back to torch
 * when no W gives every bit. */
static int64_t ceil_log2(int64_t x) {
    if (x <= 2)
        return 1;
    int64_t v = x - 1, b = -1;
    while (v) {
        v >>= 1;
        ++b;
    }
    return b + 1;
}

/* sum of W-lane elements in[i * rs + k * cs .. + W) for i < size, k < 4, into out[k][lane] */
static void multi_row_sum4(const float *in, int64_t rs, int64_t cs, int64_t size, int W, float out[4][16]) {
    float acc[4][4][16];
    for (int a = 0; a < 4; ++a)
        for (int k = 0; k < 4; ++k)
            for (int l = 0; l < 16; ++l)
                acc[a][k][l] = 0.0f;
    int64_t lp = ceil_log2(size) / 4;
    if (lp < 4)
        lp = 4;
    const int64_t step = (int64_t)1 << lp, mask0 = step - 1;
    int64_t i = 0;
    while (i + step <= size) {
        for (int64_t j = 0; j < step; ++j, ++i)
            for (int k = 0; k < 4; ++k)
                for (int l = 0; l < W; ++l)
                    acc[0][k][l] += in[i * rs + k * cs + l];
        for (int j = 1; j < 4; ++j) {
            for (int k = 0; k < 4; ++k)
                for (int l = 0; l < W; ++l) {
                    acc[j][k][l] += acc[j - 1][k][l];
                    acc[j - 1][k][l] = 0.0f;
                }
            if ((i & (mask0 << (j * lp))) != 0)
                break;
        }
    }
    for (; i < size; ++i)
        for (int k = 0; k < 4; ++k)
            for (int l = 0; l < W; ++l)
                acc[0][k][l] += in[i * rs + k * cs + l];
    for (int j = 1; j < 4; ++j)
        for (int k = 0; k < 4; ++k)
            for (int l = 0; l < W; ++l)
                acc[0][k][l] += acc[j][k][l];
    for (int k = 0; k < 4; ++k)
        for (int l = 0; l < W; ++l)
            out[k][l] = acc[0][k][l];
}

/* row_sum: n elements of W lanes at a stride of W floats -> W lane sums in part[0] */
static void row_sum4(const float *in, int64_t n, int W, float part[4][16]) {
    const int64_t n4 = n / 4;
    multi_row_sum4(in, 4 * (int64_t)W, W, n4, W, part);
    for (int64_t i = n4 * 4; i < n; ++i)
        for (int l = 0; l < W; ++l)
            part[0][l] += in[i * W + l];
    for (int k = 1; k < 4; ++k)
        for (int l = 0; l < W; ++l)
            part[0][l] += part[k][l];
}

static float torch_sum(const float *x, int64_t H, int W) {
    float part[4][16];
    if (H < W) {               /* scalar_inner_sum: row_sum over scalars */
        row_sum4(x, H, 1, part);
        return 0.0f + part[0][0];   /* torch adds the sum into a zero-filled output */
    }
    const int64_t nv = H / W;   /* vectorized_inner_sum */
    row_sum4(x, nv, W, part);
    float acc = 0.0f;
    for (int64_t k = nv * W; k < H; ++k)
        acc += x[k];
    for (int l = 0; l < W; ++l)
        acc += part[0][l];
    return 0.0f + acc;
}

void lmi_rms_norm_f32(const float *x, const float *w, float *out, int64_t rows, int64_t H, float eps, int W,
                      float *sq) {
    for (int64_t r = 0; r < rows; ++r) {
        const float *xr = x + r * H;
        for (int64_t i = 0; i < H; ++i)
            sq[i] = xr[i] * xr[i];
        const float mean = torch_sum(sq, H, W) / (float)H;
        const float rs = 1.0f / sqrtf(mean + eps);
        for (int64_t i = 0; i < H; ++i)
            out[r * H + i] = w[i] * (xr[i] * rs);
    }
}
