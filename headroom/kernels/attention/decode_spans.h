// Decode rows (one query token a sequence) cut into spans of their keys, the work items of
// both attention kernels: the decode kernel's whole step, and the prefill kernel's decode
// rows beside chunks. A span reads whole token rows of the cache for all kv heads (a block
// is one run of memory, which the hardware prefetcher follows; an item per kv head read
// only that head's share of every row). Contexts differ in length by 100x in one step (a
// reasoning row beside chat rows), so each is cut into spans of about an equal share of
// the step's keys, and the spans of one context, computed on different threads, are
// merged after from their partial softmaxes.
#pragma once
#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

#include "paged_tile.h"

namespace headroom {

// Keys [first, last) of the decode row at query row `row` of sequence `seq`; slot: where
// its partial softmax goes, or -1 for a row's only span, which writes its output directly.
struct Span {
  int64_t seq, row, first, last, slot;
};

struct Spans {
  std::vector<Span> items;
  // Rows of more than one span, for the merge, and how many each has; a cut row's slots
  // follow one another, in the order of cut_rows.
  std::vector<int64_t> cut_rows, counts;
  int64_t slots = 0;
};

// The keys a span of a row of `len` keys covers: a sixteenth of the row, never below
// kMinSpan (smaller spans cost more in merging and in passes begun than they gain). From
// the row's own length alone, never the step's other rows or the thread count, so that a
// row's sums are the same in any batch on any number of threads: a sequence's tokens do
// not depend on its neighbours, and a guessed token is verified with the arithmetic that
// decoding it would have used.
int64_t span_keys(int64_t len);

// Appends the row's spans: its context [0, len) cut into pieces of about `target` keys
// (never fewer than half).
void cut_row(Spans& spans, int64_t seq, int64_t row, int64_t len, int64_t target);

// The floats each slot of the partial buffer holds: a row's m, l and output per query head.
inline int64_t slot_floats(int64_t Hq, int64_t D) { return Hq * (D + 2); }

// One span: `a` is the row's decode token (a.q and a.out at its first query head,
// a.kv_head 0); `partial` holds the slots, `own` one slot's room for a row's only span.
template <typename T>
void attend_span(const Span& span, const TileArgs& a, int64_t Hkv, const T* kc, const T* vc, float* partial,
                 float* own) {
  const int64_t Hq = Hkv * a.group, D = a.head_dim;
  float* m = span.slot >= 0 ? partial + span.slot * slot_floats(Hq, D) : own;
  float *l = m + Hq, *o = l + Hq;
  std::fill(m, m + Hq, -std::numeric_limits<float>::infinity());
  std::fill(l, o + Hq * D, 0.f);
  decode_span(a, Hkv, kc, vc, span.first, span.last, m, l, o);
  if (span.slot < 0)
    for (int64_t r = 0; r < Hq; ++r) {
      const float inv = 1.f / l[r];
      for (int64_t k = 0; k < D; ++k) a.out[r * D + k] = o[r * D + k] * inv;
    }
}

// Writes each cut row's output (at out + row * Hq * D) from its spans' partials.
void merge_spans(const Spans& spans, const float* partial, int64_t Hq, int64_t D, float* out);

}  // namespace headroom
