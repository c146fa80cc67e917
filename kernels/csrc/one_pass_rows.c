/* The one-pass AEPO loss over fp32 logit rows, for the CPU: aepo_kernels/native.py builds this
 * file with the machine's C compiler (-O3 -march=native -fopenmp-simd -fno-trapping-math; without
 * the last flag GCC leaves the exp sweep scalar) and calls it through ctypes, one call per thread
 * on a contiguous range of rows (ctypes releases the GIL).
 *
 * Per row, with u = z * inv_t and the row held in the core's L2 cache between sweeps:
 *   1. max sweep:    m = max_j u_j                                (reads the row from memory)
 *   2. exp sweep:    e_j = exp(u_j - m) into `e`; s = sum e_j, t = sum e_j (u_j - m)
 *                    -> lse = m + log s, Eu = m + t / s, H = log s - t / s
 *   3. head:         the per-token loss and dL/dlogp (token_head below)
 *   4. grad sweep:   out_j = (e_j / s) (g_H (Eu - u_j) - g_lp) inv_t, + g_lp inv_t at the target
 * exp is evaluated once per element (sweep 2); sweep 4 reads e back from the cache. `e` is the
 * output row itself when it does not alias the logits, else a per-thread scratch row. A separate
 * output's pages are faulted in before the sweeps (prefault_output).
 * The maths is that of aepo_kernels.one_pass.token_head / the Triton _aepo_one_pass_kernel;
 * the tests compare all of them with aepo_kernels.reference. -inf logits (a masked vocabulary)
 * get probability 0 and gradient 0; a row of only -inf logits has no softmax (NaN). A row whose
 * label is ignore_index or outside [0, vocab) has no target: log-prob 0, L_t = 0, no gradient.
 */
#define _GNU_SOURCE /* madvise */
#include <math.h>
#include <stdint.h>
#include <string.h>
#ifdef __linux__
#include <sys/mman.h>
#include <unistd.h>
#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23 /* Linux >= 5.14; older kernels return EINVAL, which is ignored */
#endif
#endif

/* exp(x) for x <= 0 (u - max), vectorisable: Cody-Waite reduction, degree-6 polynomial (Cephes
 * expf coefficients, ~1 ulp); 0 below -87.3 (including -inf); NaN stays NaN. */
static inline float exp_nonpos(float x) {
    const float xc = x < -87.33654f ? -87.33654f : x;
    const float n = floorf(xc * 1.44269504088896341f + 0.5f);
    float r = xc - n * 0.693359375f;
    r = r + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    union { int32_t i; float f; } scale;  /* 2^n, built in the exponent bits */
    scale.i = ((int32_t)n + 127) << 23;
    const float y = p * scale.f;
    return x < -87.33654f ? 0.0f : y;
}

/* Hyper-parameters, in the order of aepo_kernels.one_pass.HYPER_PARAMS, then rule and has_ref. */
typedef struct {
    float eps_low, eps_high, dual_clip, clamp_c, alpha, kl_coef, entropy_coef, rule, has_ref;
} hyper_t;

static inline float minf(float a, float b) { return a < b ? a : b; }
static inline float maxf(float a, float b) { return a > b ? a : b; }

/* The policy-gradient term at the shaped advantage `shaped`: returns L_pg, writes dL_pg/dlogp. */
static float pg_head(float shaped, float logp, float ratio, int in_clamp, const hyper_t *h, float *d_out) {
    const int rule = (int)h->rule;
    const float low = 1 - h->eps_low, high = 1 + h->eps_high;
    const int is_high = ratio > high, is_low = ratio < low;
    const float pg_plain = -shaped * ratio;
    const float pg_clipped = -shaped * (is_high ? high : (is_low ? low : ratio));
    const float d_plain = in_clamp ? pg_plain : 0.0f;
    const float high_grad = (rule == 1 || rule == 2) ? -shaped * high : 0.0f;
    const float low_grad = rule == 2 ? -shaped * low : 0.0f;
    const float d_clipped = is_high ? (in_clamp ? high_grad : 0.0f) : (is_low ? (in_clamp ? low_grad : 0.0f) : d_plain);
    const int take_clipped = pg_clipped > pg_plain;
    float loss = take_clipped ? pg_clipped : pg_plain;
    float d = take_clipped ? d_clipped : d_plain;
    const float dual_value = -shaped * h->dual_clip;
    if (h->dual_clip != 0 && shaped < 0 && loss > dual_value) {
        loss = dual_value;
        d = 0.0f;
    }
    if (rule == 3) {  /* cispo */
        const float w = minf(maxf(ratio, low), high);
        loss = -shaped * w * logp;
        d = -shaped * w;
    }
    *d_out = d;
    return loss;
}

/* The per-token head: returns L_t; writes dL/dlogp, the ratio, A_t and the k3 KL. With a second
 * advantage column (adv_neg non-NULL: a folded rollout-tree node, aepo_kernels/tree_loss.py) the
 * policy-gradient term is evaluated at both columns and summed (A_t: the sum); KL and entropy once. */
static float token_head(float logp, float entropy, float old, float adv, const float *adv_neg, float ref, float mean,
                        float std, const hyper_t *h, float *d_logp, float *ratio_out, float *shaped_out, float *kl_out) {
    const float sd = std > 0 ? std : 1.0f;
    float shaped = adv * (1 + h->alpha * (entropy - mean) / sd);
    const float diff = logp - old;
    const int in_clamp = diff >= -h->clamp_c && diff <= h->clamp_c;
    const float ratio = expf(minf(maxf(diff, -h->clamp_c), h->clamp_c));
    float d;
    float loss = pg_head(shaped, logp, ratio, in_clamp, h, &d);
    if (adv_neg != NULL) {
        const float shaped_neg = *adv_neg * (1 + h->alpha * (entropy - mean) / sd);
        float d_neg;
        loss += pg_head(shaped_neg, logp, ratio, in_clamp, h, &d_neg);
        d += d_neg;
        shaped += shaped_neg;
    }
    float kl = 0.0f;
    if (h->has_ref != 0) {
        const float delta = ref - logp, e_delta = expf(delta);
        kl = e_delta - delta - 1;
        if (h->kl_coef != 0) {
            loss += h->kl_coef * kl;
            d += h->kl_coef * (1 - e_delta);
        }
    }
    *d_logp = d;
    *ratio_out = ratio;
    *shaped_out = shaped;
    *kl_out = kl;
    return loss - h->entropy_coef * entropy;
}

/* A new output buffer (fresh pages from the OS) would take one page fault per 4 KiB page inside
 * the sweeps; faulting this call's range in with one madvise(MADV_POPULATE_WRITE) first costs less
 * (measured: docs/benchmarks.md, "A new dlogits buffer at [4096, 151,936]").
 * Only for a dense range (rows back to back, all of it written below) that is not the logits: it
 * never touches bytes this call does not write. Pages already present cost a page-table walk. */
static void prefault_output(const float *logits, float *out, int64_t ostride_b, int64_t ostride_t, int64_t r0,
                            int64_t r1, int64_t seq_len, int64_t vocab) {
#ifdef __linux__
    if (out == logits || r1 <= r0) return;
    const int64_t b0 = r0 / seq_len, t0 = r0 % seq_len;
    const int dense = ostride_t == vocab && (b0 == (r1 - 1) / seq_len || ostride_b == seq_len * vocab);
    const long page_size = sysconf(_SC_PAGESIZE);
    if (!dense || page_size <= 0) return;
    const uintptr_t page = (uintptr_t)page_size;
    const uintptr_t first = (uintptr_t)(out + b0 * ostride_b + t0 * ostride_t);
    const uintptr_t end = first + (uintptr_t)((r1 - r0) * vocab) * sizeof(float);
    const uintptr_t start = (first + page - 1) & ~(page - 1), stop = end & ~(page - 1);
    if (stop > start) (void)madvise((void *)start, stop - start, MADV_POPULATE_WRITE);
#else
    (void)logits, (void)out, (void)ostride_b, (void)ostride_t, (void)r0, (void)r1, (void)seq_len, (void)vocab;
#endif
}

/* Rows [r0, r1) of n_rows = batch * seq_len rows. logits/out: row i = (b, t) = (i / seq_len,
 * i % seq_len) at b * stride_b + t * stride_t (elements; unit stride along the vocab); `out` may
 * equal `logits`. Per-token inputs: flat [n_rows] (labels int64, the rest fp32); rows_out:
 * [6, n_rows] = logp, H, L_t, ratio, A_t, kl. scratch: `vocab` floats owned by this call.
 * adv_neg: NULL, or the second advantage column [n_rows] (see token_head). */
void aepo_one_pass_rows(const float *logits, int64_t stride_b, int64_t stride_t,
                        float *out, int64_t ostride_b, int64_t ostride_t,
                        const int64_t *labels, const float *old, const float *adv, const float *weight,
                        const float *ref, const float *mean_std, float *rows_out,
                        int64_t r0, int64_t r1, int64_t n_rows, int64_t seq_len, int64_t vocab,
                        float inv_t, int64_t ignore_index, const float *hp, float *scratch, const float *adv_neg) {
    hyper_t h;
    memcpy(&h, hp, sizeof h);
    const float mean = mean_std[0], std = mean_std[1];
    prefault_output(logits, out, ostride_b, ostride_t, r0, r1, seq_len, vocab);
    for (int64_t i = r0; i < r1; ++i) {
        const int64_t b = i / seq_len, t = i % seq_len;
        const float *z = logits + b * stride_b + t * stride_t;
        float *o = out + b * ostride_b + t * ostride_t;
        float *e = (o == z) ? scratch : o;
        float m = -INFINITY;
#pragma omp simd reduction(max : m)
        for (int64_t j = 0; j < vocab; ++j) m = maxf(m, z[j] * inv_t);
        /* (Prefetching the next row into L2 during this sweep, and an online max per 4 KiB
         * block instead of the separate max sweep, were dropped: docs/benchmarks.md.) */
        float s = 0.0f, tt = 0.0f;
#pragma omp simd reduction(+ : s, tt)
        for (int64_t j = 0; j < vocab; ++j) {
            const float d = z[j] * inv_t - m, ej = exp_nonpos(d);
            e[j] = ej;
            s += ej;
            tt += ej * maxf(d, -88.0f); /* ej = 0 below -87.34; a -inf logit: 0, not 0 * -inf */
        }
        const float log_s = logf(s), eu_rel = tt / s;
        const float lse = m + log_s, eu = m + eu_rel, entropy = log_s - eu_rel;
        const int64_t y = labels[i];
        const int valid = y != ignore_index && y >= 0 && y < vocab;
        const float logp = valid ? z[y] * inv_t - lse : 0.0f;
        float d_logp, ratio, shaped, kl;
        const float loss = token_head(logp, entropy, old[i], adv[i], adv_neg ? adv_neg + i : NULL, ref[i], mean, std,
                                      &h, &d_logp, &ratio, &shaped, &kl);
        rows_out[i] = logp;
        rows_out[n_rows + i] = entropy;
        rows_out[2 * n_rows + i] = valid ? loss : 0.0f; /* no target: no loss, no gradient */
        rows_out[3 * n_rows + i] = ratio;
        rows_out[4 * n_rows + i] = shaped;
        rows_out[5 * n_rows + i] = kl;
        const float w = valid ? weight[i] : 0.0f;
        const float g_lp = valid ? d_logp * w : 0.0f, g_h = -h.entropy_coef * w;
        const float a = inv_t / s, c = g_h * eu - g_lp, u_floor = m - 88.0f;
        /* out_j = (e_j / s) (g_H (Eu - u_j) - g_lp) inv_t; in place, z_j is read before o_j is written.
         * u_j is raised to u_floor, where e_j is 0 already: a -inf logit gets 0, not 0 * inf. */
#pragma omp simd
        for (int64_t j = 0; j < vocab; ++j) o[j] = e[j] * a * (c - g_h * maxf(z[j] * inv_t, u_floor));
        if (valid) o[y] += g_lp * inv_t;
    }
}

/* exp_nonpos over an array (the tests measure its error against float64 exp). */
void aepo_exp_nonpos(const float *x, float *y, int64_t n) {
    for (int64_t j = 0; j < n; ++j) y[j] = exp_nonpos(x[j]);
}
