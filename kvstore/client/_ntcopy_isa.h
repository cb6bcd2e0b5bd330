/* Where kvstore.client._ntcopy builds its copy-and-hash loop a second time for AVX2
 * (_ntcopy_avx2.c): GCC on x86-64, whose `#pragma GCC target` turns AVX2 on for one
 * unit (and defines __AVX2__ there, so xxh3 takes its AVX2 path). One condition for
 * both units, so they never disagree about the symbol. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define KVS_AVX2_COMPILER 1
#endif
