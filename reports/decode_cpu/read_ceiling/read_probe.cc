// How fast can two threads of this machine read SmolLM2-135M's float32 weights (540 MB) from memory? One linear
// pass, each thread summing its half with 256-bit loads, best of 8 passes. With `huge` the buffer is on 2 MB
// pages (madvise MADV_HUGEPAGE before the first touch); otherwise on 4 KB pages, like XLA's buffers here.
// Build and run: see run.sh.
#include <immintrin.h>
#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>

static float sum_range(const float* a, size_t lo, size_t hi) {
  __m256 s0 = _mm256_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
  for (size_t i = lo; i < hi; i += 32) {
    s0 = _mm256_add_ps(s0, _mm256_load_ps(a + i));
    s1 = _mm256_add_ps(s1, _mm256_load_ps(a + i + 8));
    s2 = _mm256_add_ps(s2, _mm256_load_ps(a + i + 16));
    s3 = _mm256_add_ps(s3, _mm256_load_ps(a + i + 24));
  }
  float o[8];
  _mm256_storeu_ps(o, _mm256_add_ps(_mm256_add_ps(s0, s1), _mm256_add_ps(s2, s3)));
  return o[0] + o[1] + o[2] + o[3] + o[4] + o[5] + o[6] + o[7];
}

int main(int argc, char** argv) {
  const bool huge = argc > 1 && std::strcmp(argv[1], "huge") == 0;
  const size_t bytes = 540ull << 20, n = bytes / 4;
  float* a = static_cast<float*>(std::aligned_alloc(1 << 21, bytes));
  if (huge) madvise(a, bytes, MADV_HUGEPAGE);
  for (size_t i = 0; i < n; ++i) a[i] = 1.0f;
  double best = 1e9;
  float sink = 0;
  for (int rep = 0; rep < 8; ++rep) {
    float part[2];
    const auto t0 = std::chrono::steady_clock::now();
    std::thread th([&] { part[1] = sum_range(a, n / 2, n); });
    part[0] = sum_range(a, 0, n / 2);
    th.join();
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    sink += part[0] + part[1];
  }
  std::printf("%s pages: 540 MB read by 2 threads in %.2f ms (%.1f GB/s) [%g]\n", huge ? "2 MB" : "4 KB",
              best * 1e3, bytes / best / 1e9, sink);
}
