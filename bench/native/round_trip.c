/* Seed 000's 8-bit per-channel affine round trip in plain C, the reference
 * row of bench/qcore_kernels.py: the same arithmetic as qcore's kernels
 * (min/max, float64 qparams, float32 division, round half to even, clamp;
 * scale * (level - zero_point) back), compiled by the C compiler at -O3 for
 * this machine, so the bench can show what a compiled loop of the same work
 * reaches in the same run. The bench checks its bytes equal qcore's.
 * Finite input only (the bench's is); qcore refuses NaN/Inf, this does not.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

/* Floats as sign-folded int32 keys (the order of finite floats), as qcore
 * compares them: integer min/max reductions vectorise where float ones do not. */
static inline int32_t key_of_bits(int32_t b) { return b ^ ((b >> 31) & 0x7FFFFFFF); }

static inline float float_of_key(int32_t key) {
    int32_t b = key_of_bits(key);
    float f;
    memcpy(&f, &b, sizeof f);
    return f;
}

static void channel_qparams(const float *x, int64_t n, float *scale, int32_t *zero_point) {
    int32_t lo_key = INT32_MAX, hi_key = INT32_MIN;
    for (int64_t i = 0; i < n; i++) {
        int32_t b;
        memcpy(&b, &x[i], sizeof b);
        int32_t key = key_of_bits(b);
        lo_key = key < lo_key ? key : lo_key;
        hi_key = key > hi_key ? key : hi_key;
    }
    float lo = float_of_key(lo_key), hi = float_of_key(hi_key);
    if (lo == hi) { /* qcore: a constant channel is one level from the zero point */
        *scale = lo == 0.0f ? 1.0f : fabsf(lo);
        *zero_point = lo == 0.0f ? 0 : (lo > 0.0f ? 0 : 1);
        return;
    }
    double low = lo < 0.0f ? lo : 0.0, high = hi > 0.0f ? hi : 0.0;
    double s = (high - low) / 255.0;
    double z = rint(-low / s);
    *zero_point = z < 0.0 ? 0 : (z > 255.0 ? 255 : (int32_t)z);
    *scale = (float)s;
}

void quantize_per_channel(const float *x, int64_t numel, int64_t channel, uint8_t *levels, float *scales,
                          int32_t *zero_points) {
    for (int64_t c = 0; c * channel < numel; c++) {
        const float *xs = x + c * channel;
        uint8_t *out = levels + c * channel;
        int64_t n = numel - c * channel < channel ? numel - c * channel : channel;
        channel_qparams(xs, n, &scales[c], &zero_points[c]);
        const float s = scales[c], z = (float)zero_points[c];
        for (int64_t i = 0; i < n; i++) {
            float q = rintf(xs[i] / s) + z;
            q = q < 0.0f ? 0.0f : (q > 255.0f ? 255.0f : q);
            out[i] = (uint8_t)q;
        }
    }
}

void dequantize_per_channel(const uint8_t *levels, int64_t numel, int64_t channel, const float *scales,
                            const int32_t *zero_points, float *out) {
    for (int64_t c = 0; c * channel < numel; c++) {
        const uint8_t *src = levels + c * channel;
        float *dest = out + c * channel;
        int64_t n = numel - c * channel < channel ? numel - c * channel : channel;
        const float s = scales[c], z = (float)zero_points[c];
        for (int64_t i = 0; i < n; i++) dest[i] = s * ((float)src[i] - z);
    }
}
