// Row passes of the CPU backend (see grpo_fast/ops/chunked.py and ops/cpu.py).
//
// Tensors cross the boundary as raw pointers + sizes: no torch headers, a build of seconds.
// Each pass is an OpenMP loop over rows; the per-row kernels are compiled three times
// (target_clones: AVX-512, AVX2, baseline x86-64) and the loader picks the best one the CPU has,
// so the extension still runs on a CPU without AVX-512. Rows go to threads dynamically (4 at a
// time): on a shared machine a descheduled thread must not hold the others at the barrier.
//
// exp: glibc's expf does not vectorise without -ffast-math, which would also change the
// semantics of the rest of the file, so `exp_approx` below is a branch-free Cephes-style expf
// (range reduction to [-ln2/2, ln2/2], degree-5 polynomial, 2^n by exponent bits) that the
// compiler vectorises inside `#pragma omp simd` loops (check: -fopt-info-vec-optimized).
// Max relative error about 2e-7 (≈ 2 ulp) on the range used, measured in tests/ops.
#include <pybind11/pybind11.h>

#include <cmath>
#include <cstdint>
#include <algorithm>
#include <cstring>
#include <limits>
#include <omp.h>
#include <stdexcept>
#include <type_traits>
#include <vector>

// -fno-trapping-math for this file's kernels: under the default, gcc 12 will not if-convert the
// selects of exp_approx for AVX2/SSE ("control flow in loop"), so those clones stayed scalar.
// Nothing here reads floating-point exception flags, so the results are the same.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("no-trapping-math")
#endif

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define GRPO_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define GRPO_CLONES
#endif

namespace {

using bf16_t = uint16_t;  // raw bfloat16 bits (the top half of a float32)

inline __attribute__((always_inline)) float bf16_to_float(bf16_t v) {
    uint32_t bits = static_cast<uint32_t>(v) << 16;
    float f;
    std::memcpy(&f, &bits, sizeof f);
    return f;
}

inline __attribute__((always_inline)) bf16_t float_to_bf16(float f) {  // round to nearest even
    uint32_t bits;
    std::memcpy(&bits, &f, sizeof bits);
    const uint32_t rounded = bits + 0x7FFFu + ((bits >> 16) & 1u);
    // NaN stays NaN (quiet bit set) instead of rounding into infinity
    return static_cast<bf16_t>(((bits & 0x7FFFFFFFu) > 0x7F800000u ? (bits | 0x00400000u) : rounded) >> 16);
}

// exp(x) for x <= ~0 (the passes only take exp of z - max); exact 0 below -87.3, NaN stays NaN.
inline __attribute__((always_inline)) float exp_approx(float x) {
    const float lo = -87.3f, hi = 88.3f;
    float xc = x < lo ? lo : x;
    xc = xc > hi ? hi : xc;
    // n = round(x / ln2) by the 1.5 * 2^23 trick (vectorises without SSE4.1's roundps),
    // r = x - n ln2 with ln2 split in two so n * ln2_hi is exact
    const float n = (xc * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    const float r = xc - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;  // 2^n
    float scale;
    std::memcpy(&scale, &bits, sizeof scale);
    float y = p * scale;
    y = x < lo ? 0.0f : y;
    return x != x ? x : y;
}

// bf16 rows are widened into a per-thread float32 row first (and narrowed back after the
// gradient pass): mixing 16-bit loads with the exp arithmetic in one loop does not vectorise
// with gcc 12 ("unsupported data-type float"), two plain conversion loops do.
GRPO_CLONES void widen(const bf16_t* in, float* out, int64_t n) {
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) out[j] = bf16_to_float(in[j]);
}

GRPO_CLONES void narrow(const float* in, bf16_t* out, int64_t n) {
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) out[j] = float_to_bf16(in[j]);
}

// One row of z = x / T: max, then sum of exp(z - m) and of exp(z - m) (z - m) in one sweep.
GRPO_CLONES void stats_row(const float* x, int64_t vocab, float inv_t, float* sum_out, float* tsum_out, float* max_out) {
    float m = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : m)
    for (int64_t j = 0; j < vocab; ++j) m = x[j] > m ? x[j] : m;
    m *= inv_t;
    float s = 0.f, t = 0.f;
#pragma omp simd reduction(+ : s, t)
    for (int64_t j = 0; j < vocab; ++j) {
        const float d = x[j] * inv_t - m;
        const float e = exp_approx(d);
        s += e;
        t += e * d;
    }
    *sum_out = s;
    *tsum_out = t;
    *max_out = m;
}

// One row in place: x <- -scale * exp(x / T - lse)   (the target entry is fixed by the caller).
GRPO_CLONES void grad_row(float* x, int64_t vocab, float inv_t, float lse, float scale) {
#pragma omp simd
    for (int64_t j = 0; j < vocab; ++j) x[j] = -scale * exp_approx(x[j] * inv_t - lse);
}

// The same with the entropy's gradient (the entropy bonus): dH/dz_j = -p_j (log p_j + H) / T, so
// x <- -p (g + g_h (log p + H)) / T with log p = x / T - lse. A separate loop: the plain one stays as it was.
GRPO_CLONES void grad_row_entropy(float* x, int64_t vocab, float inv_t, float lse, float g, float g_h, float h) {
#pragma omp simd
    for (int64_t j = 0; j < vocab; ++j) {
        const float logp = x[j] * inv_t - lse;
        x[j] = -inv_t * exp_approx(logp) * (g + g_h * (logp + h));
    }
}

// Soft-capped rows (Gemma 2's final_logit_softcapping; objective.LogitMap): z = post * tanh(pre * x),
// tanh by exp_approx (1 - 2 / (exp(2y) + 1): absolute error ~1e-7, the same order as z's float rounding;
// exp_approx saturates for y > 44, where tanh is 1 in float anyway), so these loops vectorise too.
inline __attribute__((always_inline)) float softcapped(float x, float pre, float post) {
    return post * (1.0f - 2.0f / (exp_approx(2.0f * pre * x) + 1.0f));
}

// One row: max, sum of exp(z - m) and of exp(z - m) (z - m) (tanh is increasing: max z is z of max x).
GRPO_CLONES void stats_row_softcap(const float* x, int64_t vocab, float pre, float post, float* sum_out,
                                   float* tsum_out, float* max_out) {
    float mx = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : mx)
    for (int64_t j = 0; j < vocab; ++j) mx = x[j] > mx ? x[j] : mx;
    const float m = softcapped(mx, pre, post);
    float s = 0.f, t = 0.f;
#pragma omp simd reduction(+ : s, t)
    for (int64_t j = 0; j < vocab; ++j) {
        const float d = softcapped(x[j], pre, post) - m;
        const float e = exp_approx(d);
        s += e;
        t += e * d;
    }
    *sum_out = s;
    *tsum_out = t;
    *max_out = m;
}

// One row in place: x <- -p (g + g_h (log p + H)) dz/dx, dz/dx = pre (post - z) (post + z) / post
// (= pre post (1 - tanh^2), factored: post - z^2 / post cancels near saturation);
// g_h = 0 without the entropy's gradient (the target entry is fixed by the caller).
GRPO_CLONES void grad_row_softcap(float* x, int64_t vocab, float pre, float post, float lse, float g, float g_h,
                                  float h) {
#pragma omp simd
    for (int64_t j = 0; j < vocab; ++j) {
        const float z = softcapped(x[j], pre, post);
        const float logp = z - lse;
        x[j] = -exp_approx(logp) * (g + g_h * (logp + h)) * pre * (post - z) * (post + z) / post;
    }
}

// Row r of the slab as float32: the row itself, or its widened copy in `buf` for bf16.
inline const float* row_f32(const float* logits, int64_t r, int64_t vocab, float*) { return logits + r * vocab; }
inline const float* row_f32(const bf16_t* logits, int64_t r, int64_t vocab, float* buf) {
    widen(logits + r * vocab, buf, vocab);
    return buf;
}

// The logit map (objective.LogitMap): z = post * tanh(pre * x) when softcap, else z = pre * x (pre = 1 / T
// for a bare temperature; post unused).
struct LogitMap {
    float pre, post;
    bool softcap;
    float operator()(float x) const { return softcap ? softcapped(x, pre, post) : x * pre; }
};

// Ragged rows (the kept-set route: a CSR buffer of each position's kept logits) pass `offsets` [rows + 1]:
// row r is logits[offsets[r]:offsets[r + 1]] and target[r] indexes inside it; float32 only. nullptr: rows
// of `vocab` logits each.
template <typename T>
void row_stats_impl(const T* logits, const int64_t* target, int64_t rows, int64_t vocab, LogitMap map, float* logp,
                    float* entropy, float* lse_out, const int64_t* offsets = nullptr) {
#pragma omp parallel
    {
        std::vector<float> buf(std::is_same<T, float>::value ? 0 : vocab);
#pragma omp for schedule(dynamic, 4)
        for (int64_t r = 0; r < rows; ++r) {
            const int64_t len = offsets ? offsets[r + 1] - offsets[r] : vocab;
            const float* x = offsets ? reinterpret_cast<const float*>(logits) + offsets[r] : row_f32(logits, r, vocab, buf.data());
            float s, t, m;
            if (map.softcap)
                stats_row_softcap(x, len, map.pre, map.post, &s, &t, &m);
            else
                stats_row(x, len, map.pre, &s, &t, &m);
            const float log_s = std::log(s);
            lse_out[r] = m + log_s;
            logp[r] = map(x[target[r]]) - lse_out[r];
            entropy[r] = log_s - t / s;  // = lse - E_p[z]
        }
    }
}

// A soft-capped row: the map's slope differs per logit, so the target entry, like the others, takes it from z.
void grad_softcap(float* x, int64_t target, int64_t vocab, LogitMap map, float lse, float g, float g_h, float h) {
    const float z_target = map(x[target]);
    const float logp_target = z_target - lse;
    const float p_target = exp_approx(logp_target);
    grad_row_softcap(x, vocab, map.pre, map.post, lse, g, g_h, h);
    // onehot - p at the target as 1 - p in fp32, before any rounding to bf16
    x[target] = (g * (1.0f - p_target) - g_h * p_target * (logp_target + h)) * map.pre * (map.post - z_target) *
                (map.post + z_target) / map.post;
}

template <typename T>
void row_grad_impl(T* logits, const int64_t* target, int64_t rows, int64_t vocab, LogitMap map, const float* lse,
                   const float* g, const float* g_entropy, const float* entropy, const int64_t* offsets = nullptr) {
    const float inv_t = map.pre;
    const int64_t stride = vocab;
#pragma omp parallel
    {
        std::vector<float> buf(std::is_same<T, float>::value ? 0 : stride);
#pragma omp for schedule(dynamic, 4)
        for (int64_t r = 0; r < rows; ++r) {
            const int64_t vocab = offsets ? offsets[r + 1] - offsets[r] : stride;  // this row's length
            float* x = offsets ? reinterpret_cast<float*>(logits) + offsets[r]
                               : const_cast<float*>(row_f32(logits, r, stride, buf.data()));
            if (map.softcap) {
                grad_softcap(x, target[r], vocab, map, lse[r], g[r], g_entropy ? g_entropy[r] : 0.0f,
                             entropy ? entropy[r] : 0.0f);
                if (!std::is_same<T, float>::value) narrow(x, reinterpret_cast<bf16_t*>(logits) + r * vocab, vocab);
                continue;
            }
            const float scale = g[r] * inv_t;
            // onehot - p at the target as 1 - p in fp32, before any rounding to bf16
            const float logp_target = x[target[r]] * inv_t - lse[r];
            const float p_target = exp_approx(logp_target);
            if (g_entropy == nullptr) {
                grad_row(x, vocab, inv_t, lse[r], scale);
                x[target[r]] = scale * (1.0f - p_target);
            } else {
                grad_row_entropy(x, vocab, inv_t, lse[r], g[r], g_entropy[r], entropy[r]);
                x[target[r]] = scale * (1.0f - p_target) -
                               inv_t * g_entropy[r] * p_target * (logp_target + entropy[r]);
            }
            if (!std::is_same<T, float>::value) narrow(x, reinterpret_cast<bf16_t*>(logits) + r * vocab, vocab);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The kept-set route (truncated sampling): gathered lm_head rows, no [rows x vocab] logits.
//
// Entries e = 0..K-1 pair a row rows[e] (a position of the chunk) with a kept id ids[e]. The kernels walk
// them grouped by id (`order`: the entries sorted by id, `starts`: where each id's group begins), so a
// weight row is read from memory once per chunk and used for every position that keeps it, while the
// chunk's hidden rows ([C, H] float32, small) stay in cache: the traffic is that of the kept rows, not
// of K row reads. Groups go to threads dynamically.
// ---------------------------------------------------------------------------------------------

GRPO_CLONES float dot(const float* a, const float* b, int64_t n) {
    float acc = 0.f;
#pragma omp simd reduction(+ : acc)
    for (int64_t j = 0; j < n; ++j) acc += a[j] * b[j];
    return acc;
}

GRPO_CLONES void axpy(float* y, float a, const float* x, int64_t n) {
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) y[j] += a * x[j];
}

inline float scalar_f32(const float* p, int64_t i) { return p[i]; }
inline float scalar_f32(const bf16_t* p, int64_t i) { return bf16_to_float(p[i]); }

// r[e] = hidden[rows[e]] . weight[ids[e]] + bias[ids[e]] (float32) for every entry.
template <typename W>
void kept_logits_impl(const float* hidden, const W* weight, const W* bias, int64_t hdim, const int64_t* ids,
                      const int64_t* rows, const int64_t* order, const int64_t* starts, int64_t groups, float* r) {
#pragma omp parallel
    {
        std::vector<float> buf(std::is_same<W, float>::value ? 0 : hdim);
#pragma omp for schedule(dynamic, 8)
        for (int64_t gi = 0; gi < groups; ++gi) {
            const int64_t u = ids[order[starts[gi]]];
            const float* w = row_f32(weight, u, hdim, buf.data());
            const float b = bias ? scalar_f32(bias, u) : 0.f;
            for (int64_t i = starts[gi]; i < starts[gi + 1]; ++i) {
                const int64_t e = order[i];
                r[e] = dot(hidden + rows[e] * hdim, w, hdim) + b;
            }
        }
    }
}

// From dr [K] (d loss / d r per entry): grad_hidden[c] = sum_e dr[e] weight[ids[e]] over the row's entries
// (each thread sums into its own [C, H] buffer, added up at the end: rows are shared between id groups),
// grad_weight[u] += sum_e dr[e] hidden[rows[e]] and grad_bias[u] += sum_e dr[e] (one group per id: no two
// threads write one row). Any of the three outputs may be null (not wanted).
template <typename W>
void kept_scatter_impl(const float* hidden, const W* weight, int64_t hdim, int64_t chunk_rows, const int64_t* ids,
                       const int64_t* rows, const int64_t* order, const int64_t* starts, int64_t groups,
                       const float* dr, float* grad_hidden, float* grad_weight, float* grad_bias) {
    std::vector<float*> partial;
#pragma omp parallel
    {
#pragma omp single
        partial.assign(omp_get_num_threads(), nullptr);  // (implicit barrier)
        std::vector<float> own(grad_hidden ? chunk_rows * hdim : 0, 0.f);
        partial[omp_get_thread_num()] = own.data();
        std::vector<float> buf(std::is_same<W, float>::value ? 0 : hdim), acc(grad_weight ? hdim : 0);
#pragma omp for schedule(dynamic, 8)
        for (int64_t gi = 0; gi < groups; ++gi) {
            const int64_t u = ids[order[starts[gi]]];
            const float* w = grad_hidden ? row_f32(weight, u, hdim, buf.data()) : nullptr;
            std::fill(acc.begin(), acc.end(), 0.f);
            float b = 0.f;
            for (int64_t i = starts[gi]; i < starts[gi + 1]; ++i) {
                const int64_t e = order[i];
                if (grad_hidden) axpy(own.data() + rows[e] * hdim, dr[e], w, hdim);
                if (grad_weight) axpy(acc.data(), dr[e], hidden + rows[e] * hdim, hdim);
                b += dr[e];
            }
            if (grad_weight) axpy(grad_weight + u * hdim, 1.0f, acc.data(), hdim);
            if (grad_bias) grad_bias[u] += b;
        }  // (implicit barrier: every thread's buffer is complete)
        if (grad_hidden) {
            const int64_t n = chunk_rows * hdim;
            const int threads = static_cast<int>(partial.size());
#pragma omp for schedule(static)
            for (int64_t j = 0; j < n; ++j) {
                float sum = 0.f;
                for (int t = 0; t < threads; ++t) sum += partial[t][j];
                grad_hidden[j] = sum;
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Each row's k largest mapped logits (ops/topk.py), in three sweeps of the row instead of a running top-k
// (a heap of k, then a buffer of 2k refilled above a rising threshold, spent ~4 ns a logit at k = 512: the
// early blocks all had to be looked into one logit at a time):
//   1. z = map(x) and the max of each block of B logits, B ~ V / 4k (so there are at least 4k blocks);
//   2. a floor m under the k-th largest block max (`floor_of_kth`): k blocks reach m, so at least k logits
//      do, and every logit of the top k is >= m; only the blocks whose max is >= m (about k of them) are
//      looked into, their logits >= m appended without a branch;
//   3. the candidates' k best by (value descending, id ascending), sorted.
// Equal values are ranked by lower id (the order torch.sort(stable=True) gives) and how many logits equal
// or pass the k-th is counted among the candidates (every such logit is one).
// ---------------------------------------------------------------------------------------------

// A (value, id) pair as one 64-bit key whose unsigned order is the rank order (larger value first, then lower
// id): the value's bits made order-preserving and inverted in the high half, the id in the low half. Sorting
// plain integers is ~3x faster than sorting (float, id) structs with a comparator. Not for NaN.
inline uint64_t rank_key(float value, int64_t id) {
    uint32_t bits;
    std::memcpy(&bits, &value, sizeof bits);
    const uint32_t ascending = bits ^ ((bits >> 31) ? 0xFFFFFFFFu : 0x80000000u);
    return (static_cast<uint64_t>(~ascending) << 32) | static_cast<uint32_t>(id);
}
inline int64_t key_id(uint64_t key) { return static_cast<int64_t>(key & 0xFFFFFFFFu); }

GRPO_CLONES void map_row(const float* x, float* z, int64_t n, LogitMap map) {
    if (map.softcap) {
#pragma omp simd
        for (int64_t j = 0; j < n; ++j) z[j] = softcapped(x[j], map.pre, map.post);
    } else {
#pragma omp simd
        for (int64_t j = 0; j < n; ++j) z[j] = x[j] * map.pre;
    }
}

// maxima[b] = max of z[b * block : (b + 1) * block] (NaN skipped): one call a row, not one a block (a call through
// target_clones' dispatch a block of 12 logits cost more than the block)
GRPO_CLONES void block_maxima(const float* z, int64_t n, int64_t block, float* maxima) {
    for (int64_t b0 = 0; b0 < n; b0 += block) {
        const int64_t len = std::min(block, n - b0);
        float m = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : m)
        for (int64_t j = 0; j < len; ++j) m = z[b0 + j] > m ? z[b0 + j] : m;
        maxima[b0 / block] = m;
    }
}

// A floor under the k-th largest of `maxima` (so at least k of them reach it) from a histogram of their top 12
// bits (sign, exponent, 3 mantissa bits: buckets of 1/8 octave): one branch-free pass, where nth_element
// cost ~10 ns a value in mispredictions. The floor is the lower edge of the bucket holding the k-th.
float floor_of_kth(const float* maxima, int64_t n, int64_t k, uint32_t* hist) {
    std::fill(hist, hist + 4096, 0u);
    for (int64_t b = 0; b < n; ++b) {
        uint32_t bits;
        std::memcpy(&bits, &maxima[b], sizeof bits);
        ++hist[(bits ^ ((bits >> 31) ? 0xFFFFFFFFu : 0x80000000u)) >> 20];  // order-preserving bits, top 12
    }
    int64_t seen = 0, bucket = 4095;
    for (; bucket > 0; --bucket)
        if ((seen += hist[bucket]) >= k) break;
    const uint32_t ascending = static_cast<uint32_t>(bucket) << 20;
    const uint32_t bits = (ascending >> 31) ? (ascending ^ 0x80000000u) : ~ascending;
    float floor;
    std::memcpy(&floor, &bits, sizeof floor);
    return floor == floor ? floor : -std::numeric_limits<float>::infinity();  // (the lowest bucket's edge is a NaN)
}

// lse [rows] and, with target, target_logit [rows] of the same z (the forward's row statistics, in the same sweep:
// the row is still in cache; a separate row_stats pass cost another read of the slab and another parallel region).
template <typename T>
void row_topk_impl(const T* logits, int64_t rows, int64_t vocab, int64_t k, LogitMap map, float* values, int64_t* ids,
                   int64_t* count_ge, float* lse, const int64_t* target, float* target_logit) {
    // blocks of ~V / 4k logits (so at least 4k blocks), a multiple of 16 (whole vectors) from 16 on
    const int64_t wanted = std::min<int64_t>(64, vocab / (4 * k));
    const int64_t block = wanted >= 16 ? wanted / 16 * 16 : std::max<int64_t>(1, wanted);
    const int64_t blocks = (vocab + block - 1) / block;
    const bool identity = !map.softcap && map.pre == 1.0f;  // z = x: no copy
#pragma omp parallel
    {
        std::vector<float> buf(std::is_same<T, float>::value ? 0 : vocab), mapped(identity ? 0 : vocab), maxima(blocks);
        std::vector<uint32_t> hist(4096);
        std::vector<uint64_t> candidates(vocab);
#pragma omp for schedule(dynamic, 4)
        for (int64_t r = 0; r < rows; ++r) {
            const float* x = row_f32(logits, r, vocab, buf.data());
            float sum, tsum, m;
            if (map.softcap)
                stats_row_softcap(x, vocab, map.pre, map.post, &sum, &tsum, &m);
            else
                stats_row(x, vocab, map.pre, &sum, &tsum, &m);
            lse[r] = m + std::log(sum);
            if (target) target_logit[r] = map(x[target[r]]);
            if (!identity) map_row(x, mapped.data(), vocab, map);
            const float* z = identity ? x : mapped.data();
            block_maxima(z, vocab, block, maxima.data());
            const float floor = floor_of_kth(maxima.data(), blocks, k, hist.data());
            int64_t n = 0;
            for (int64_t b = 0; b < blocks; ++b) {
                if (!(maxima[b] >= floor)) continue;
                for (int64_t j = b * block; j < std::min(vocab, (b + 1) * block); ++j) {
                    candidates[n] = rank_key(z[j], j);
                    n += z[j] >= floor ? 1 : 0;
                }
            }
            if (n < k) {  // NaN logits only (a broken model; torch ranks NaN first): the lowest ids not kept fill in
                std::vector<char> taken(vocab, 0);
                for (int64_t i = 0; i < n; ++i) taken[key_id(candidates[i])] = 1;
                for (int64_t j = 0; n < k; ++j)  // (ranked after every number, by id)
                    if (!taken[j]) candidates[n++] = (uint64_t{0xFFFFFFFFu} << 32) | static_cast<uint32_t>(j);
            }
            const auto first = candidates.begin(), last = candidates.begin() + n;
            if (n > k) std::nth_element(first, first + (k - 1), last);
            std::sort(first, first + k);
            const uint64_t kth_key = candidates[k - 1] | 0xFFFFFFFFu;  // the k-th value with any id
            int64_t at_least = 0;
            for (int64_t i = 0; i < n; ++i) at_least += candidates[i] <= kth_key ? 1 : 0;
            count_ge[r] = at_least;
            for (int64_t j = 0; j < k; ++j) {
                ids[r * k + j] = key_id(candidates[j]);
                values[r * k + j] = z[key_id(candidates[j])];
            }
        }
    }
}

void check_dtype(int bits) {
    if (bits != 32 && bits != 16) throw std::invalid_argument("row ops take float32 (32) or bfloat16 (16) logits");
}

LogitMap logit_map(double pre, double post, bool softcap) {
    if (!(pre > 0) || (softcap && !(post > 0))) throw std::invalid_argument("row ops: the logit map's pre and post must be > 0");
    return LogitMap{static_cast<float>(pre), static_cast<float>(post), softcap};
}

// pre, post, softcap: the logit map z = post * tanh(pre * x) (softcap) or pre * x (objective.LogitMap)
void row_stats(std::uintptr_t logits_p, int dtype_bits, std::uintptr_t target_p, int64_t rows, int64_t vocab,
               double pre, double post, bool softcap, std::uintptr_t logp_p, std::uintptr_t entropy_p,
               std::uintptr_t lse_p) {
    check_dtype(dtype_bits);
    const auto* target = reinterpret_cast<const int64_t*>(target_p);
    auto* logp = reinterpret_cast<float*>(logp_p);
    auto* entropy = reinterpret_cast<float*>(entropy_p);
    auto* lse = reinterpret_cast<float*>(lse_p);
    const LogitMap map = logit_map(pre, post, softcap);
    pybind11::gil_scoped_release release;
    if (dtype_bits == 32)
        row_stats_impl(reinterpret_cast<const float*>(logits_p), target, rows, vocab, map, logp, entropy, lse);
    else
        row_stats_impl(reinterpret_cast<const bf16_t*>(logits_p), target, rows, vocab, map, logp, entropy, lse);
}

// g_entropy_p, entropy_p: the entropy's incoming gradient and the entropy per row, or both 0 (none)
void row_grad_(std::uintptr_t logits_p, int dtype_bits, std::uintptr_t target_p, int64_t rows, int64_t vocab,
               double pre, double post, bool softcap, std::uintptr_t lse_p, std::uintptr_t g_p, std::uintptr_t g_entropy_p,
               std::uintptr_t entropy_p) {
    check_dtype(dtype_bits);
    if ((g_entropy_p == 0) != (entropy_p == 0))
        throw std::invalid_argument("row_grad_: g_entropy and entropy come together (both pointers or both 0)");
    const auto* target = reinterpret_cast<const int64_t*>(target_p);
    const auto* lse = reinterpret_cast<const float*>(lse_p);
    const auto* g = reinterpret_cast<const float*>(g_p);
    const auto* g_entropy = reinterpret_cast<const float*>(g_entropy_p);
    const auto* entropy = reinterpret_cast<const float*>(entropy_p);
    const LogitMap map = logit_map(pre, post, softcap);
    pybind11::gil_scoped_release release;
    if (dtype_bits == 32)
        row_grad_impl(reinterpret_cast<float*>(logits_p), target, rows, vocab, map, lse, g, g_entropy, entropy);
    else
        row_grad_impl(reinterpret_cast<bf16_t*>(logits_p), target, rows, vocab, map, lse, g, g_entropy, entropy);
}

// The ragged (CSR) forms of row_stats / row_grad_: float32 logits, row r = logits[offsets[r]:offsets[r + 1]] (never
// empty), target[r] an index inside row r.
void csr_row_stats(std::uintptr_t logits_p, std::uintptr_t offsets_p, std::uintptr_t target_p, int64_t rows, double pre,
                   double post, bool softcap, std::uintptr_t logp_p, std::uintptr_t entropy_p, std::uintptr_t lse_p) {
    const LogitMap map = logit_map(pre, post, softcap);
    pybind11::gil_scoped_release release;
    row_stats_impl(reinterpret_cast<const float*>(logits_p), reinterpret_cast<const int64_t*>(target_p), rows, 0, map,
                   reinterpret_cast<float*>(logp_p), reinterpret_cast<float*>(entropy_p), reinterpret_cast<float*>(lse_p),
                   reinterpret_cast<const int64_t*>(offsets_p));
}

void csr_row_grad_(std::uintptr_t logits_p, std::uintptr_t offsets_p, std::uintptr_t target_p, int64_t rows, double pre,
                   double post, bool softcap, std::uintptr_t lse_p, std::uintptr_t g_p, std::uintptr_t g_entropy_p,
                   std::uintptr_t entropy_p) {
    if ((g_entropy_p == 0) != (entropy_p == 0))
        throw std::invalid_argument("csr_row_grad_: g_entropy and entropy come together (both pointers or both 0)");
    const LogitMap map = logit_map(pre, post, softcap);
    pybind11::gil_scoped_release release;
    row_grad_impl(reinterpret_cast<float*>(logits_p), reinterpret_cast<const int64_t*>(target_p), rows, 0, map,
                  reinterpret_cast<const float*>(lse_p), reinterpret_cast<const float*>(g_p),
                  reinterpret_cast<const float*>(g_entropy_p), reinterpret_cast<const float*>(entropy_p),
                  reinterpret_cast<const int64_t*>(offsets_p));
}

// The kept route's grouping by id, a counting sort (O(K + V); torch.sort took ~0.3 s for 262144 ids on these
// CPUs): order [K] the entries sorted by id, stable (by row within an id, as entries are in row order);
// starts [U + 1] where each distinct id's group begins (room for min(K, V) + 1). Returns U.
int64_t kept_group(std::uintptr_t ids_p, int64_t k, int64_t vocab, std::uintptr_t order_p, std::uintptr_t starts_p) {
    const auto* ids = reinterpret_cast<const int64_t*>(ids_p);
    auto* order = reinterpret_cast<int64_t*>(order_p);
    auto* starts = reinterpret_cast<int64_t*>(starts_p);
    pybind11::gil_scoped_release release;
    std::vector<int64_t> next(vocab, 0);  // counts, then each id's next slot in `order`
    for (int64_t e = 0; e < k; ++e) ++next[ids[e]];
    int64_t groups = 0, slot = 0;
    for (int64_t u = 0; u < vocab; ++u) {
        const int64_t count = next[u];
        next[u] = slot;
        if (count) starts[groups++] = slot;
        slot += count;
    }
    starts[groups] = k;
    for (int64_t e = 0; e < k; ++e) order[next[ids[e]]++] = e;
    return groups;
}

// The first entry (index into ids) whose id its position's set already holds, or -1: O(K + V), one pass
// remembering the last position that kept each id. ids must lie in [0, vocab).
int64_t kept_first_duplicate(std::uintptr_t ids_p, std::uintptr_t offsets_p, int64_t rows, int64_t vocab) {
    const auto* ids = reinterpret_cast<const int64_t*>(ids_p);
    const auto* offsets = reinterpret_cast<const int64_t*>(offsets_p);
    pybind11::gil_scoped_release release;
    std::vector<int64_t> last(vocab, -1);
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t e = offsets[r]; e < offsets[r + 1]; ++e) {
            if (last[ids[e]] == r) return e;
            last[ids[e]] = r;
        }
    return -1;
}

// hidden: float32 [C, H]; weight (and bias, or 0): float32 (32) or bfloat16 (16) [V, H]; the entry arrays int64.
void kept_logits(std::uintptr_t hidden_p, std::uintptr_t weight_p, std::uintptr_t bias_p, int weight_bits, int64_t hdim,
                 std::uintptr_t ids_p, std::uintptr_t rows_p, std::uintptr_t order_p, std::uintptr_t starts_p,
                 int64_t groups, std::uintptr_t r_p) {
    check_dtype(weight_bits);
    const auto* hidden = reinterpret_cast<const float*>(hidden_p);
    const auto* ids = reinterpret_cast<const int64_t*>(ids_p);
    const auto* rows = reinterpret_cast<const int64_t*>(rows_p);
    const auto* order = reinterpret_cast<const int64_t*>(order_p);
    const auto* starts = reinterpret_cast<const int64_t*>(starts_p);
    auto* r = reinterpret_cast<float*>(r_p);
    pybind11::gil_scoped_release release;
    if (weight_bits == 32)
        kept_logits_impl(hidden, reinterpret_cast<const float*>(weight_p), reinterpret_cast<const float*>(bias_p), hdim,
                         ids, rows, order, starts, groups, r);
    else
        kept_logits_impl(hidden, reinterpret_cast<const bf16_t*>(weight_p), reinterpret_cast<const bf16_t*>(bias_p),
                         hdim, ids, rows, order, starts, groups, r);
}

// grad_hidden_p: float32 [C, H] (written), grad_weight_p: float32 [V, H], grad_bias_p: float32 [V] (both added to);
// each 0 when not wanted.
void kept_scatter(std::uintptr_t hidden_p, std::uintptr_t weight_p, int weight_bits, int64_t hdim, int64_t chunk_rows,
                  std::uintptr_t ids_p, std::uintptr_t rows_p, std::uintptr_t order_p, std::uintptr_t starts_p,
                  int64_t groups, std::uintptr_t dr_p, std::uintptr_t grad_hidden_p, std::uintptr_t grad_weight_p,
                  std::uintptr_t grad_bias_p) {
    check_dtype(weight_bits);
    const auto* hidden = reinterpret_cast<const float*>(hidden_p);
    const auto* ids = reinterpret_cast<const int64_t*>(ids_p);
    const auto* rows = reinterpret_cast<const int64_t*>(rows_p);
    const auto* order = reinterpret_cast<const int64_t*>(order_p);
    const auto* starts = reinterpret_cast<const int64_t*>(starts_p);
    const auto* dr = reinterpret_cast<const float*>(dr_p);
    auto* gh = reinterpret_cast<float*>(grad_hidden_p);
    auto* gw = reinterpret_cast<float*>(grad_weight_p);
    auto* gb = reinterpret_cast<float*>(grad_bias_p);
    pybind11::gil_scoped_release release;
    if (weight_bits == 32)
        kept_scatter_impl(hidden, reinterpret_cast<const float*>(weight_p), hdim, chunk_rows, ids, rows, order, starts,
                          groups, dr, gh, gw, gb);
    else
        kept_scatter_impl(hidden, reinterpret_cast<const bf16_t*>(weight_p), hdim, chunk_rows, ids, rows, order, starts,
                          groups, dr, gh, gw, gb);
}

// values [rows, k] f32, ids [rows, k] int64: the k largest z = map(logits) of each row, descending, equal values by
// lower id; count_ge [rows] int64: how many z of the row are >= the k-th.
// lse_p [rows] f32: each row's logsumexp of z; target_p [rows] int64 (or 0) and target_logit_p [rows] f32: z of the
// target.
void row_topk(std::uintptr_t logits_p, int dtype_bits, int64_t rows, int64_t vocab, int64_t k, double pre, double post,
              bool softcap, std::uintptr_t values_p, std::uintptr_t ids_p, std::uintptr_t count_ge_p, std::uintptr_t lse_p,
              std::uintptr_t target_p, std::uintptr_t target_logit_p) {
    check_dtype(dtype_bits);
    if (k < 1 || k > vocab) throw std::invalid_argument("row_topk: k must be in [1, vocab]");
    const LogitMap map = logit_map(pre, post, softcap);
    auto* values = reinterpret_cast<float*>(values_p);
    auto* ids = reinterpret_cast<int64_t*>(ids_p);
    auto* count_ge = reinterpret_cast<int64_t*>(count_ge_p);
    auto* lse = reinterpret_cast<float*>(lse_p);
    const auto* target = reinterpret_cast<const int64_t*>(target_p);
    auto* target_logit = reinterpret_cast<float*>(target_logit_p);
    pybind11::gil_scoped_release release;
    if (dtype_bits == 32)
        row_topk_impl(reinterpret_cast<const float*>(logits_p), rows, vocab, k, map, values, ids, count_ge, lse, target,
                      target_logit);
    else
        row_topk_impl(reinterpret_cast<const bf16_t*>(logits_p), rows, vocab, k, map, values, ids, count_ge, lse, target,
                      target_logit);
}

// exp_approx over a float32 buffer, so the tests can measure its error against exp in float64.
void exp_approx_(std::uintptr_t x_p, int64_t n) {
    auto* x = reinterpret_cast<float*>(x_p);
    for (int64_t i = 0; i < n; ++i) x[i] = exp_approx(x[i]);
}

}  // namespace

PYBIND11_MODULE(_C, m) {
    m.doc() = "grpo_fast C++ CPU kernels (row passes over logit chunks)";
    m.def("row_stats", &row_stats,
          "lse, target log-prob and entropy per row of z = map(logits), map: pre * x or post * tanh(pre * x) "
          "(f32 or bf16 logits)");
    m.def("row_grad_", &row_grad_,
          "in place: logits <- [g (onehot - p) - g_entropy p (log p + H)] dz/dx, p = softmax(z), z = map(logits) "
          "(f32 or bf16 logits; g_entropy, entropy pointers 0: no entropy term)");
    m.def("csr_row_stats", &csr_row_stats, "row_stats over the ragged rows of a float32 CSR buffer (kept sets)");
    m.def("csr_row_grad_", &csr_row_grad_, "row_grad_ over the ragged rows of a float32 CSR buffer (kept sets)");
    m.def("kept_group", &kept_group, "the entries sorted by id (counting sort, stable) and each id's group start; returns U");
    m.def("kept_first_duplicate", &kept_first_duplicate, "the first entry whose id its set already holds, or -1");
    m.def("kept_logits", &kept_logits, "r[e] = hidden[rows[e]] . weight[ids[e]] + bias[ids[e]], walked by id groups");
    m.def("kept_scatter", &kept_scatter,
          "grad_hidden, grad_weight (+=), grad_bias (+=) of the kept entries' d loss / d r, walked by id groups");
    m.def("row_topk", &row_topk, "each row's k largest z = map(logits), descending (ties: lower id), how many are >= the "
          "k-th, the row's lse and the target's z");
    m.def("exp_approx_", &exp_approx_, "in place: x <- exp_approx(x), the vectorised exp of the row passes");
}
