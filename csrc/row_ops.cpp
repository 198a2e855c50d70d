// Row passes of the CPU backend (see grpo_fast/ops/chunked.py and ops/cpu.py).
// Tensors cross the boundary as raw pointers + sizes: no torch headers, a build of seconds.
#include <pybind11/pybind11.h>

#include <cmath>
#include <cstdint>
#include <limits>

namespace {

// lse, target log-prob and entropy of each row of z = logits / T.
void row_stats(std::uintptr_t logits_p, std::uintptr_t target_p, int64_t rows, int64_t vocab, double temperature,
               std::uintptr_t logp_p, std::uintptr_t entropy_p, std::uintptr_t lse_p) {
    const float* logits = reinterpret_cast<const float*>(logits_p);
    const int64_t* target = reinterpret_cast<const int64_t*>(target_p);
    float* logp = reinterpret_cast<float*>(logp_p);
    float* entropy = reinterpret_cast<float*>(entropy_p);
    float* lse_out = reinterpret_cast<float*>(lse_p);
    const float inv_t = static_cast<float>(1.0 / temperature);
    pybind11::gil_scoped_release release;
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
        const float* x = logits + r * vocab;
        float m = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : m)
        for (int64_t j = 0; j < vocab; ++j) m = std::fmax(m, x[j]);
        m *= inv_t;
        float s = 0.f, t = 0.f;
#pragma omp simd reduction(+ : s, t)
        for (int64_t j = 0; j < vocab; ++j) {
            const float z = x[j] * inv_t;
            const float e = std::exp(z - m);
            s += e;
            t += e * (z - m);
        }
        const float lse = m + std::log(s);
        lse_out[r] = lse;
        logp[r] = x[target[r]] * inv_t - lse;
        entropy[r] = std::log(s) - t / s;  // = lse - E[z]
    }
}

// In place: logits <- g * (onehot(target) - softmax(logits / T)) / T.
void row_grad_(std::uintptr_t logits_p, std::uintptr_t target_p, int64_t rows, int64_t vocab, double temperature,
               std::uintptr_t lse_p, std::uintptr_t g_p) {
    float* logits = reinterpret_cast<float*>(logits_p);
    const int64_t* target = reinterpret_cast<const int64_t*>(target_p);
    const float* lse = reinterpret_cast<const float*>(lse_p);
    const float* g = reinterpret_cast<const float*>(g_p);
    const float inv_t = static_cast<float>(1.0 / temperature);
    pybind11::gil_scoped_release release;
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
        float* x = logits + r * vocab;
        const float scale = g[r] * inv_t, l = lse[r];
#pragma omp simd
        for (int64_t j = 0; j < vocab; ++j) x[j] = -scale * std::exp(x[j] * inv_t - l);
        x[target[r]] += scale;
    }
}

}  // namespace

PYBIND11_MODULE(_C, m) {
    m.doc() = "grpo_fast C++ CPU kernels (row passes over logit chunks)";
    m.def("row_stats", &row_stats, "lse, target log-prob and entropy per row of logits / T");
    m.def("row_grad_", &row_grad_, "in place: logits <- g (onehot - softmax(logits / T)) / T");
}
