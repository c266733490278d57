// The tests' one assertion (no framework): a failed CHECK is printed and
// counted, and the test binary's main returns `finish(name)`.
#pragma once

#include <cstdio>

static int failures = 0;
#define CHECK(cond)                                                                  \
  do {                                                                               \
    if (!(cond)) {                                                                   \
      std::fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond); \
      ++failures;                                                                    \
    }                                                                                \
  } while (0)

static int finish(const char* name) {
  if (failures) {
    std::fprintf(stderr, "%d failed\n", failures);
    return 1;
  }
  std::printf("%s: all checks passed\n", name);
  return 0;
}
