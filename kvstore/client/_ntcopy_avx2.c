/* The copy-and-hash loop of kvstore.client._ntcopy (_copyhash.h) compiled for AVX2,
 * so xxh3 takes its AVX2 path; _ntcopy.c calls it only where the CPU reports AVX2.
 * Where the compiler cannot target AVX2 per unit (_ntcopy_isa.h), or xxhash.h is
 * missing or too old, this unit defines nothing and the baseline loop is used. */
#include "_ntcopy_isa.h"
#ifdef KVS_AVX2_COMPILER
#pragma GCC target("avx2")
#define KVS_STATIC
#define COPY_HASHED kvs_copy_hashed_avx2
#define HASH_UPDATE kvs_hash_update_avx2
#include "_copyhash.h"
#endif
typedef int kvs_avx2_unit_is_not_empty;
