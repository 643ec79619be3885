/* GPTQ's column loop on the CPU (lowbit.algorithms.gptq_native builds and loads this).

   W is held transposed, block[b, out]: column i of the weight is row i, contiguous; u[i, j] is at
   u + i * su0 + j * su1 (H^-1's upper factor is a transposed view). For each
   column i in i0..i1 of a block of b columns, with the grid of stats row g = rows[i]:

       q = the column rounded onto the grid (codes), v = its dequantized values
       e = (x - v) / u[i, i]
       block[i..b) -= u[i, i..b) (outer) e          (the rank-1 update)

   Grids (each the same float32 operations, in the same order, as the torch path it replaces):
       LB_GRID_INT:  q = clamp(round_half_even(x * a) + z, qmin, qmax), v = (q - z) * s
                     (z absent: q = clamp(round(x * a)), v = q * s); a is 1 / scale.
       LB_GRID_LEVELS: uniform levels low..low + n - 1 (llama.cpp's integer types):
                     level = clamp(ceil((x - z) / s' - (low + 0.5)), 0, n - 1) + low with s' = s
                     or 1 where s is 0, v = level * s + z (z absent: no minimum), q = level - low.
   The rank-1 update is fused, fmaf(-u, e, x), as torch's vectorized addr_ computes it (its
   scalar tail rounds the product first, which this kernel does not copy).
   Built with -ffp-contract=off, so nothing else is fused. */

#include <math.h>
#include <stdint.h>

enum { LB_GRID_INT = 0, LB_GRID_LEVELS = 1 };

int lb_gptq_columns(float *block, int64_t out, int64_t b, const float *u, int64_t su0, int64_t su1, int64_t i0,
                    int64_t i1, float *errors, float *codes, float *values, const int64_t *rows,
                    int grid, const float *a, const float *s, const float *z, float qmin, float qmax) {
    if (i0 < 0 || i1 > b || out <= 0) return -1;
    const float half_low = qmin + 0.5f; /* LB_GRID_LEVELS: qmin is low, qmax is n - 1 */
    for (int64_t i = i0; i < i1; i++) {
        float *x = block + i * out, *e = errors + i * out, *q = codes + i * out, *v = values + i * out;
        const int64_t g = rows[i] * out;
        const float d = u[i * (su0 + su1)];
        for (int64_t o = 0; o < out; o++) {
            float c, dq;
            if (grid == LB_GRID_INT) {
                c = nearbyintf(x[o] * a[g + o]);
                if (z) c += z[g + o];
                c = c < qmin ? qmin : (c > qmax ? qmax : c);
                dq = z ? (c - z[g + o]) * s[g + o] : c * s[g + o];
            } else {
                const float scale = s[g + o], safe = scale == 0.0f ? 1.0f : scale;
                const float shifted = z ? x[o] - z[g + o] : x[o];
                float level = ceilf(shifted / safe - half_low);
                level = level < 0.0f ? 0.0f : (level > qmax ? qmax : level);
                level += qmin;
                dq = level * scale;
                if (z) dq += z[g + o];
                c = level - qmin;
            }
            q[o] = c, v[o] = dq;
            e[o] = (x[o] - dq) / d;
        }
        for (int64_t j = i + 1; j < b; j++) {
            const float m = -u[i * su0 + j * su1];
            float *y = block + j * out;
            for (int64_t o = 0; o < out; o++) y[o] = fmaf(m, e[o], y[o]);
        }
        for (int64_t o = 0; o < out; o++) x[o] = fmaf(-d, e[o], x[o]);
    }
    return 0;
}
