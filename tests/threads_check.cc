// Checks run_from_both_ends (specjax/kernels/kernels.h) with a pool of plain threads that start at
// once, never until the call has returned, or half and half: every unit runs exactly once and has
// run when the call returns; each thread takes units in one direction (+1 on the caller's side of a
// segment, -1 on the other) and, within a segment, in that order. Prints "ok" or what failed
// (tests/test_kernel_threads.py builds and runs it).
#include <chrono>
#include <cstdio>
#include <functional>
#include <map>
#include <mutex>
#include <thread>
#include <vector>

#include "kernels.h"

namespace {

// num_threads() and Schedule(task) as xla::ffi::ThreadPool; `late` tasks run only in finish().
struct Pool {
  int64_t threads;
  int mode;  // 0: every task at once; 1: every task late; 2: every second task late
  std::vector<std::thread> running;
  std::vector<std::function<void()>> late;

  int64_t num_threads() const { return threads; }

  template <class Task>
  void Schedule(Task&& task) {
    const bool hold = mode == 1 || (mode == 2 && (running.size() + late.size()) % 2 == 0);
    if (hold)
      late.emplace_back(std::forward<Task>(task));
    else
      running.emplace_back(std::forward<Task>(task));
  }

  void finish() {
    for (auto& t : running) t.join();
    for (auto& task : late) task();
  }
};

int failures = 0;

void fail(const char* what, int64_t threads, int64_t units, int mode) {
  if (++failures <= 20) std::printf("%s (threads %ld, units %ld, mode %d)\n", what, long(threads), long(units), mode);
}

void check(int64_t threads, int64_t units, int mode) {
  Pool pool{threads, mode, {}, {}};
  std::vector<int> runs(units, 0);
  std::mutex lock;
  std::map<std::thread::id, std::vector<std::pair<int64_t, int>>> taken;  // per thread: (unit, direction)
  specjax::run_from_both_ends(pool, units, [&](int64_t i, int direction) {
    if (i % 5 == 0) std::this_thread::sleep_for(std::chrono::microseconds(20));  // some slow units
    std::lock_guard<std::mutex> guard(lock);
    ++runs[i];
    taken[std::this_thread::get_id()].emplace_back(i, direction);
  });
  {
    std::lock_guard<std::mutex> guard(lock);
    for (int64_t i = 0; i < units; ++i)
      if (runs[i] != 1) fail(runs[i] ? "a unit ran twice" : "a unit had not run when the call returned", threads, units, mode);
  }
  pool.finish();
  for (int64_t i = 0; i < units; ++i)
    if (runs[i] != 1) fail("a unit ran after the call returned", threads, units, mode);
  const int64_t workers = std::min(threads, units), segments = (workers + 1) / 2;
  for (auto& [id, list] : taken) {
    for (size_t j = 1; j < list.size(); ++j) {
      if (list[j].second != list[0].second) fail("a thread changed direction", threads, units, mode);
      const auto segment = [&](int64_t i) {  // the segment a unit lies in
        int64_t s = 0;
        while (units * (s + 1) / segments <= i) ++s;
        return s;
      };
      if (segment(list[j].first) == segment(list[j - 1].first) &&
          (list[j].first - list[j - 1].first) * list[j].second <= 0)
        fail("a thread took a segment's units out of its direction's order", threads, units, mode);
    }
  }
}

}  // namespace

int main() {
  for (int64_t threads = 1; threads <= 9; ++threads)
    for (int64_t units : {0, 1, 2, 3, 5, 8, 17, 64, 301})
      for (int mode = 0; mode < 3; ++mode) check(threads, units, mode);
  if (failures == 0) std::printf("ok\n");
  return failures ? 1 : 0;
}
