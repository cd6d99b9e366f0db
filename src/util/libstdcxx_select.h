// libstdc++'s std::partial_sort, std::nth_element and std::sort (GCC 12, bits/stl_algo.h and
// bits/stl_heap.h), written out over a plain array so that a GPU thread can run them: the same element
// moves in the same order, so equal keys end up where libstdc++ leaves them. Why: torch.topk on the CPU
// (ATen's topk_impl_loop) orders (value, index) pairs with these algorithms, and which of several tied
// router probabilities a MoE layer routes to is whatever they leave first (model/moe.h, topk_like_torch).
// The CUDA router (backend/cuda/moe.cu) runs this replica on a row whose k-th and (k+1)-th probabilities
// tie; tests/moe_test.cpp checks it against the real algorithms on tie-heavy inputs.
//
// `before(a, b)` is the strict weak order ("comp" in libstdc++); T is copied by value.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define MTPX_HOST_DEVICE __host__ __device__
#else
#define MTPX_HOST_DEVICE
#endif

namespace mtpx::libstdcxx {

// std::__lg: floor(log2(n)) for n > 0.
MTPX_HOST_DEVICE inline int64_t floor_log2(int64_t n) {
  int64_t r = 0;
  while (n > 1) n >>= 1, ++r;
  return r;
}

template <typename T>
MTPX_HOST_DEVICE inline void swap_at(T* a, int64_t i, int64_t j) {
  T t = a[i];
  a[i] = a[j];
  a[j] = t;
}

// std::__push_heap
template <typename T, typename Before>
MTPX_HOST_DEVICE void push_heap(T* first, int64_t hole, int64_t top, T value, Before before) {
  int64_t parent = (hole - 1) / 2;
  while (hole > top && before(first[parent], value)) {
    first[hole] = first[parent];
    hole = parent;
    parent = (hole - 1) / 2;
  }
  first[hole] = value;
}

// std::__adjust_heap
template <typename T, typename Before>
MTPX_HOST_DEVICE void adjust_heap(T* first, int64_t hole, int64_t len, T value, Before before) {
  const int64_t top = hole;
  int64_t child = hole;
  while (child < (len - 1) / 2) {
    child = 2 * (child + 1);
    if (before(first[child], first[child - 1])) --child;
    first[hole] = first[child];
    hole = child;
  }
  if ((len & 1) == 0 && child == (len - 2) / 2) {
    child = 2 * (child + 1);
    first[hole] = first[child - 1];
    hole = child - 1;
  }
  push_heap(first, hole, top, value, before);
}

// std::__make_heap over [0, len)
template <typename T, typename Before>
MTPX_HOST_DEVICE void make_heap(T* first, int64_t len, Before before) {
  if (len < 2) return;
  for (int64_t parent = (len - 2) / 2;; --parent) {
    adjust_heap(first, parent, len, first[parent], before);
    if (parent == 0) return;
  }
}

// std::__pop_heap(first, last, result): the top goes to `result`, result's value is sifted in.
template <typename T, typename Before>
MTPX_HOST_DEVICE void pop_heap(T* first, int64_t len, int64_t result, Before before) {
  T value = first[result];
  first[result] = first[0];
  adjust_heap(first, int64_t{0}, len, value, before);
}

// std::__heap_select(first, middle, last)
template <typename T, typename Before>
MTPX_HOST_DEVICE void heap_select(T* first, int64_t middle, int64_t last, Before before) {
  make_heap(first, middle, before);
  for (int64_t i = middle; i < last; ++i)
    if (before(first[i], first[0])) pop_heap(first, middle, i, before);
}

// std::__sort_heap over [0, len)
template <typename T, typename Before>
MTPX_HOST_DEVICE void sort_heap(T* first, int64_t len, Before before) {
  while (len > 1) {
    --len;
    pop_heap(first, len, len, before);
  }
}

// std::partial_sort(a, a + middle, a + n)
template <typename T, typename Before>
MTPX_HOST_DEVICE void partial_sort(T* a, int64_t middle, int64_t n, Before before) {
  heap_select(a, middle, n, before);
  sort_heap(a, middle, before);
}

// std::__unguarded_linear_insert(a + i)
template <typename T, typename Before>
MTPX_HOST_DEVICE void unguarded_linear_insert(T* a, int64_t i, Before before) {
  T value = a[i];
  int64_t next = i - 1;
  while (before(value, a[next])) {
    a[i] = a[next];
    i = next;
    --next;
  }
  a[i] = value;
}

// std::__insertion_sort over [first, last)
template <typename T, typename Before>
MTPX_HOST_DEVICE void insertion_sort(T* a, int64_t first, int64_t last, Before before) {
  if (first == last) return;
  for (int64_t i = first + 1; i != last; ++i) {
    if (before(a[i], a[first])) {
      T value = a[i];
      for (int64_t j = i; j > first; --j) a[j] = a[j - 1];  // std::move_backward
      a[first] = value;
    } else {
      unguarded_linear_insert(a, i, before);
    }
  }
}

// std::__move_median_to_first(result, a, b, c)
template <typename T, typename Before>
MTPX_HOST_DEVICE void move_median_to_first(T* v, int64_t result, int64_t a, int64_t b, int64_t c,
                                           Before before) {
  if (before(v[a], v[b])) {
    if (before(v[b], v[c]))
      swap_at(v, result, b);
    else if (before(v[a], v[c]))
      swap_at(v, result, c);
    else
      swap_at(v, result, a);
  } else if (before(v[a], v[c])) {
    swap_at(v, result, a);
  } else if (before(v[b], v[c])) {
    swap_at(v, result, c);
  } else {
    swap_at(v, result, b);
  }
}

// std::__unguarded_partition(first, last, pivot)
template <typename T, typename Before>
MTPX_HOST_DEVICE int64_t unguarded_partition(T* v, int64_t first, int64_t last, int64_t pivot,
                                             Before before) {
  while (true) {
    while (before(v[first], v[pivot])) ++first;
    --last;
    while (before(v[pivot], v[last])) --last;
    if (!(first < last)) return first;
    swap_at(v, first, last);
    ++first;
  }
}

// std::__unguarded_partition_pivot(first, last)
template <typename T, typename Before>
MTPX_HOST_DEVICE int64_t unguarded_partition_pivot(T* v, int64_t first, int64_t last, Before before) {
  const int64_t mid = first + (last - first) / 2;
  move_median_to_first(v, first, first + 1, mid, last - 1, before);
  return unguarded_partition(v, first + 1, last, first, before);
}

// std::nth_element(a, a + nth, a + n)  (std::__introselect)
template <typename T, typename Before>
MTPX_HOST_DEVICE void nth_element(T* a, int64_t nth, int64_t n, Before before) {
  if (n == 0 || nth == n) return;
  int64_t first = 0, last = n, depth_limit = floor_log2(n) * 2;
  while (last - first > 3) {
    if (depth_limit == 0) {
      heap_select(a + first, nth + 1 - first, last - first, before);
      swap_at(a, first, nth);
      return;
    }
    --depth_limit;
    const int64_t cut = unguarded_partition_pivot(a, first, last, before);
    if (cut <= nth)
      first = cut;
    else
      last = cut;
  }
  insertion_sort(a, first, last, before);
}

inline constexpr int64_t kSortThreshold = 16;  // std::_S_threshold

// std::__introsort_loop over [first, last); its recursion on the right part becomes a loop over an
// explicit stack (the same calls in the same order: the right part is sorted before the loop goes on
// with the left one).
template <typename T, typename Before>
MTPX_HOST_DEVICE void introsort_loop(T* a, int64_t first, int64_t last, int64_t depth_limit, Before before) {
  struct Frame {
    int64_t first, last, depth_limit;
  };
  Frame stack[64];  // depth is bounded by 2 log2(n) + 1
  int top = 0;
  stack[top++] = {first, last, depth_limit};
  while (top > 0) {
    Frame f = stack[--top];
    // Each frame runs its while loop; a recursive call pushes the frame's remainder and then the call.
    while (f.last - f.first > kSortThreshold) {
      if (f.depth_limit == 0) {
        partial_sort(a + f.first, f.last - f.first, f.last - f.first, before);
        break;
      }
      --f.depth_limit;
      const int64_t cut = unguarded_partition_pivot(a, f.first, f.last, before);
      // introsort_loop(cut, last) runs now, then this loop continues with last = cut.
      stack[top++] = {f.first, cut, f.depth_limit};
      f = {cut, f.last, f.depth_limit};
    }
  }
}

// std::sort(a, a + n)
template <typename T, typename Before>
MTPX_HOST_DEVICE void sort(T* a, int64_t n, Before before) {
  if (n == 0) return;
  introsort_loop(a, int64_t{0}, n, floor_log2(n) * 2, before);
  if (n > kSortThreshold) {  // std::__final_insertion_sort
    insertion_sort(a, int64_t{0}, kSortThreshold, before);
    for (int64_t i = kSortThreshold; i != n; ++i) unguarded_linear_insert(a, i, before);
  } else {
    insertion_sort(a, int64_t{0}, n, before);
  }
}

}  // namespace mtpx::libstdcxx
