// UCM_CLONES: a function built twice on x86-64 GCC, for AVX2 and for the
// baseline, the one run chosen at load time by the CPU. The kernels that
// use it are written so that the compiler vectorises them and give the
// same bits either way.
#pragma once

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#define UCM_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define UCM_CLONES
#endif
