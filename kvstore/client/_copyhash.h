/* kvstore.client._ntcopy's copy loops, compiled once per instruction set: included by
 * _ntcopy.c (the build's baseline, SSE2 on x86-64) and by _ntcopy_avx2.c (AVX2, used
 * where the CPU has it; xxh3 runs about twice as fast there). Before including,
 * define COPY_HASHED and HASH_UPDATE to the names of the copy-and-hash function and of
 * the streaming hash's update, and KVS_STATIC to `static` or nothing. Defines KVS_HASH
 * where those functions exist. */
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

/* Non-temporal copy: whole 64-byte lines streamed from the first 16-byte-aligned byte
 * of the destination (x86-64), a memcpy elsewhere. The caller fences (stream_done). */
static inline void stream_copy(char *dst, const char *src, size_t n)
{
#if defined(__SSE2__)
    size_t head = (16 - ((uintptr_t)dst & 15)) & 15;
    if (head > n)
        head = n;
    memcpy(dst, src, head);
    dst += head;
    src += head;
    n -= head;
    size_t i = 0;
    for (; i + 64 <= n; i += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)(src + i));
        __m128i b = _mm_loadu_si128((const __m128i *)(src + i + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(src + i + 32));
        __m128i d = _mm_loadu_si128((const __m128i *)(src + i + 48));
        _mm_stream_si128((__m128i *)(dst + i), a);
        _mm_stream_si128((__m128i *)(dst + i + 16), b);
        _mm_stream_si128((__m128i *)(dst + i + 32), c);
        _mm_stream_si128((__m128i *)(dst + i + 48), d);
    }
    memcpy(dst + i, src + i, n - i);
#else
    memcpy(dst, src, n);
#endif
}

/* xxh3 from the system's xxhash.h (libxxhash-dev), inlined; only from 0.8.0, where
 * xxh3's output was fixed (an older header's digests could differ from the xxhash
 * binding's, and every verified read would then report corruption). */
#if defined(__has_include)
#if __has_include(<xxhash.h>)
#define XXH_INLINE_ALL
#include <xxhash.h>
#if XXH_VERSION_NUMBER >= 800
#define KVS_HASH 1
#endif
#endif
#endif

#ifdef KVS_HASH
/* Each chunk is hashed right after its copy, while it is in the core's L1. Streamed,
 * small chunks let the hashing overlap the stores still draining to memory; copied
 * into the cache, the copy needs longer runs (an ad-hoc sweep of 1 - 64 KiB over 2 MiB
 * of 64 KiB and of 2 MiB entries: streamed best at 2 KiB, 20 % under 16 KiB; plain
 * best at 8 - 16 KiB, 1 KiB 40 % slower). */
#ifndef KVS_CHUNK
#define KVS_CHUNK ((size_t)16 << 10)
#endif
#ifndef KVS_STREAM_CHUNK
#define KVS_STREAM_CHUNK ((size_t)2 << 10)
#endif

/* Copy n bytes (streamed if `stream`); the xxh3_64 of the source (hash_dst 0) or of
 * what landed (hash_dst 1). With dst NULL, nothing is copied: the xxh3_64 of src. */
KVS_STATIC uint64_t COPY_HASHED(char *dst, const char *src, size_t n, int stream,
                                int hash_dst)
{
    if (dst == NULL)
        return XXH3_64bits(src, n);
    size_t chunk = stream ? KVS_STREAM_CHUNK : KVS_CHUNK;
    const char *hashed = hash_dst ? dst : src;
    if (n <= chunk) {
        if (stream)
            stream_copy(dst, src, n);
        else
            memcpy(dst, src, n);
        return XXH3_64bits(hashed, n);
    }
    XXH3_state_t state;
    XXH3_INITSTATE(&state);
    XXH3_64bits_reset(&state);
    for (size_t at = 0; at < n; at += chunk) {
        size_t len = n - at < chunk ? n - at : chunk;
        if (stream)
            stream_copy(dst + at, src + at, len);
        else
            memcpy(dst + at, src + at, len);
        XXH3_64bits_update(&state, hashed + at, len);
    }
    return XXH3_64bits_digest(&state);
}

/* Feed n bytes to an xxh3_64 streaming state (recv_hashed: each entry of a door reply
 * hashed a chunk at a time as it lands). The state is the same whichever build fed it. */
KVS_STATIC void HASH_UPDATE(XXH3_state_t *state, const char *src, size_t n)
{
    XXH3_64bits_update(state, src, n);
}
#endif
