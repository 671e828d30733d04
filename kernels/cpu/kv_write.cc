// specjax CPU kernel: write T new tokens per sequence into one layer's KV cache, in place.
//
// Why it exists: XLA:CPU has no bfloat16 scatter. It widens the cache layer to float32, scatters, and narrows it
// back, so with a bfloat16 (or float16) cache every decode and verify step rewrites every layer's whole K and V
// buffers (plus a copy of each), work that grows with the cache's capacity instead of with the tokens written.
// This call writes only the new entries into the buffer XLA aliases to its output.
//
// Layout: cache [B, H, S, D] of any 1-, 2- or 4-byte element type (head-major, as specjax.kv_cache holds it);
// new [B, T, H, D] of the same type (token-major, as the projections give it); lengths [B] int32. Entry (b, t, h)
// goes to slot lengths[b] + t of row b, head h; a slot outside [0, S) is dropped. The output is the cache buffer
// itself (input_output_aliases {0: 0}); if XLA ever hands over a different buffer, the cache is copied into it
// first, so the result is right either way.
#include <cstdint>
#include <cstring>

#include "xla/ffi/api/ffi.h"

namespace {

namespace ffi = xla::ffi;

ffi::Error KvWriteImpl(ffi::AnyBuffer cache, ffi::AnyBuffer fresh, ffi::Buffer<ffi::S32> lengths,
                       ffi::Result<ffi::AnyBuffer> out) {
  const auto cd = cache.dimensions();
  const auto nd = fresh.dimensions();
  if (cd.size() != 4 || nd.size() != 4 || lengths.dimensions().size() != 1)
    return ffi::Error::InvalidArgument("kv_write: cache [B, H, S, D], new [B, T, H, D] and lengths [B] expected");
  const int64_t B = cd[0], H = cd[1], S = cd[2], D = cd[3], T = nd[1];
  if (nd[0] != B || nd[2] != H || nd[3] != D || lengths.dimensions()[0] != B)
    return ffi::Error::InvalidArgument("kv_write: cache, new and lengths disagree on B, H or D");
  if (cache.element_type() != fresh.element_type() || out->element_type() != cache.element_type())
    return ffi::Error::InvalidArgument("kv_write: cache and new must have one element type");
  const size_t item = cache.size_bytes() / static_cast<size_t>(cache.element_count() ? cache.element_count() : 1);
  char* dst = static_cast<char*>(out->untyped_data());
  if (dst != cache.untyped_data()) std::memcpy(dst, cache.untyped_data(), cache.size_bytes());
  const char* src = static_cast<const char*>(fresh.untyped_data());
  const int32_t* len = lengths.typed_data();
  const size_t row = static_cast<size_t>(D) * item;
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t t = 0; t < T; ++t) {
      const int64_t slot = static_cast<int64_t>(len[b]) + t;
      if (slot < 0 || slot >= S) continue;
      for (int64_t h = 0; h < H; ++h) {
        std::memcpy(dst + (((b * H + h) * S + slot) * row), src + (((b * T + t) * H + h) * row), row);
      }
    }
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxKvWrite, KvWriteImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>());
