/* The copy-and-hash loop of kvstore.client._ntcopy (_copyhash.h) compiled for AVX2,
 * so xxh3 takes its AVX2 path; _ntcopy.c calls it only where the CPU reports AVX2.
 * Where the compiler cannot target AVX2 per file (not GCC, not x86-64), this unit is
 * empty and the baseline loop is used everywhere. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && \
    defined(__has_include)
#if __has_include(<xxhash.h>)
#pragma GCC target("avx2")
#define KVS_HASH 1
#define KVS_STATIC
#define COPY_HASHED kvs_copy_hashed_avx2
#include "_copyhash.h"
#endif
#endif
typedef int kvs_avx2_unit_is_not_empty;
