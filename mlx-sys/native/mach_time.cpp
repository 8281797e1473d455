// mlx-rs seeds its default PRNG state with macOS's mach_approximate_time()
// (through mach-sys, which declares it on every platform). Linux has no such
// function; this monotonic-clock stand-in gives it the same meaning.
#include <cstdint>
#include <ctime>

extern "C" uint64_t mach_approximate_time(void) {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<uint64_t>(ts.tv_sec) * 1000000000ull + static_cast<uint64_t>(ts.tv_nsec);
}
