// The matmul kernel's tiles (kernels/cpu/tiles.h) alone: SmolLM2-135M's 30 layers of projections (451 MB float32),
// M token rows, two threads (the caller and one spinning helper, so no thread start-up is timed). Best of 15 passes.
// Build and A/B against another tiles.h: see run.sh.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <vector>
#include <atomic>
#include "tiles.h"  // from -I: the repository's or an older one
using namespace specjax_cpu;
#ifndef CHUNK
#define CHUNK 64
#endif
struct Mat { int64_t N, K; float* w; };
#include <functional>
std::atomic<int> gen{0}; std::atomic<int> fin{0}; std::function<void()> job;
void helper() { int g = 0; for (;;) { while (gen.load() == g) {} g = gen.load(); if (g < 0) return; job(); fin.fetch_add(1); } }
template <typename F>
void par(int64_t items, F fn) {
  std::atomic<int64_t> next{0};
  job = [&] { int64_t c; while ((c = next.fetch_add(1)) < items) fn(c); };
  fin = 0; gen.fetch_add(1); job(); while (fin.load() < 1) {}
}
int main(int argc, char** argv) {
  int M = atoi(argv[1]);
  std::vector<Mat> mats;
  int64_t shapes[4][2] = {{960, 576}, {576, 960}, {3072, 576}, {576, 1536}};
  size_t bytes = 0;
  for (int l = 0; l < 30; ++l)
    for (auto& s : shapes) {
      Mat m{s[0], s[1], (float*)aligned_alloc(64, s[0] * s[1] * 4)};
      for (int64_t i = 0; i < s[0] * s[1]; ++i) m.w[i] = 0.001f * (i % 7);
      mats.push_back(m); bytes += s[0] * s[1] * 4;
    }
  std::vector<float> x(16 * 3072, 0.5f), y(16 * 3072);
  std::thread th(helper); th.detach();
  double best = 1e9;
  for (int rep = 0; rep < 15; ++rep) {
    auto t0 = std::chrono::steady_clock::now();
    for (auto& m : mats) {
      int64_t chunks = (m.N + CHUNK - 1) / CHUNK;
      par(chunks, [&](int64_t c) {
        int64_t a = c * CHUNK, b = std::min(m.N, a + CHUNK);
        row_range<F32Weights>(x.data(), m.w, y.data(), M, m.K, m.N, a, b);
      });
    }
    double t = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    best = std::min(best, t);
  }
  printf("M=%d %.2f ms  %.1f GB/s\n", M, best * 1e3, bytes / best / 1e9);
}
