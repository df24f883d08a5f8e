#include "decode_spans.h"

#include <cmath>
#include <utility>

namespace headroom {

namespace {

constexpr int64_t kMinSpan = 512;
constexpr int64_t kMaxSpans = 16;
// Spans a thread past which the last uneven share is small enough to leave.
constexpr int64_t kEvenSpans = 4;

}  // namespace

int64_t span_keys(int64_t len) { return std::max(kMinSpan, (len + kMaxSpans - 1) / kMaxSpans); }

void cut_row(Spans& spans, int64_t seq, int64_t row, int64_t len, int64_t target, int64_t kv_heads) {
  const int64_t n = std::max<int64_t>(1, (len + target - 1) / target);
  if (n > 1) {
    spans.cut_rows.push_back(row);
    spans.counts.push_back(n);
  }
  for (int64_t i = 0; i < n; ++i)
    spans.items.push_back({seq, row, len * i / n, len * (i + 1) / n, n > 1 ? spans.slots++ : -1, 0, kv_heads});
}

void split_heads(Spans& spans, int64_t threads) {
  const int64_t have = static_cast<int64_t>(spans.items.size());
  if (have == 0 || threads < 2 || have % threads == 0 || have >= kEvenSpans * threads) return;
  int64_t parts = 2;
  while ((have * parts) % threads != 0) ++parts;
  std::vector<Span> split;
  for (const Span& span : spans.items) {
    const int64_t n = std::min(span.heads, parts);
    for (int64_t i = 0; i < n; ++i) {
      Span part = span;
      part.head = span.head + span.heads * i / n;
      part.heads = span.head + span.heads * (i + 1) / n - part.head;
      split.push_back(part);
    }
  }
  spans.items = std::move(split);
}

void merge_spans(const Spans& spans, const float* partial, int64_t Hq, int64_t D, float* out) {
  const int64_t part = slot_floats(Hq, D);
  int64_t slot = 0;
  for (size_t i = 0; i < spans.cut_rows.size(); ++i) {  // o = sum_s o_s e^(m_s - M) / sum_s l_s e^(m_s - M)
    const float* first = partial + slot * part;
    const int64_t n = spans.counts[i];
    slot += n;
    for (int64_t r = 0; r < Hq; ++r) {
      float top = -std::numeric_limits<float>::infinity();
      for (int64_t s = 0; s < n; ++s) top = std::max(top, first[s * part + r]);
      float* dst = out + (spans.cut_rows[i] * Hq + r) * D;
      std::fill(dst, dst + D, 0.f);
      float total = 0.f;
      for (int64_t s = 0; s < n; ++s) {
        const float* m = first + s * part;
        const float w = std::exp(m[r] - top);
        total += m[Hq + r] * w;
        const float* o = m + 2 * Hq + r * D;
        for (int64_t k = 0; k < D; ++k) dst[k] += w * o[k];
      }
      const float inv = 1.f / total;
      for (int64_t k = 0; k < D; ++k) dst[k] *= inv;
    }
  }
}

}  // namespace headroom
