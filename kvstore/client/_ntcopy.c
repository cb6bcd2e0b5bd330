/* kvstore.client._ntcopy: the client's same-node copies, with their checksums, in C
 * and without the GIL.
 *
 * copy(dst, src): copy bytes into memory this process will not read again (the
 * server's shared DRAM arena) with non-temporal stores. A plain copy (numpy, glibc's
 * memcpy) pulls every destination line into the cache before writing it
 * (read-for-ownership): for a copy into the arena that doubles the memory traffic and
 * evicts what the caller works on. glibc only streams copies larger than its
 * non-temporal threshold (3/4 of the shared cache), which an entry (64 KiB - 2 MiB)
 * never is. On x86-64 this streams whole 64-byte lines from the first 16-byte-aligned
 * byte of the destination; elsewhere it is a memcpy. (docs/benchmarks.md,
 * "Non-temporal stores".)
 *
 * scatter / gather / hashes (only where xxhash.h 0.8 or later was found at build time: the
 * Makefile installs libxxhash-dev): many entries in one call, each copied and hashed
 * (xxh3_64, the digest of kvstore.core.hashing.checksum) a chunk at a time (2 KiB
 * streamed, 16 KiB plain: _copyhash.h), so each chunk is hashed while it is still in
 * the core's first-level cache and no Python runs between entries. The xxhash binding keeps the GIL while it hashes an entry below ~256 KiB;
 * here nothing does. (docs/benchmarks.md, "Copying and hashing in one pass".) */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <stdint.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <time.h>
#include "_ntcopy_isa.h"
#define KVS_STATIC static
#define COPY_HASHED copy_hashed_base
#define HASH_UPDATE hash_update_base
#include "_copyhash.h"

#if defined(KVS_HASH) && defined(KVS_AVX2_COMPILER)
#define KVS_AVX2 1
uint64_t kvs_copy_hashed_avx2(char *dst, const char *src, size_t n, int stream,
                              int hash_dst);
void kvs_hash_update_avx2(XXH3_state_t *state, const char *src, size_t n);
#endif

/* The streamed lines reach memory before anything this thread stores or sends after
 * the copy (the request that tells the server they are there). */
static void stream_done(void)
{
#if defined(__SSE2__)
    _mm_sfence();
#endif
}

static PyObject *ntcopy_copy(PyObject *self, PyObject *args)
{
    Py_buffer dst, src;
    (void)self;
    if (!PyArg_ParseTuple(args, "w*y*:copy", &dst, &src))
        return NULL;
    if (dst.len != src.len) {
        PyErr_Format(PyExc_ValueError, "copy: destination of %zd bytes, source of %zd",
                     dst.len, src.len);
        PyBuffer_Release(&dst);
        PyBuffer_Release(&src);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    stream_copy((char *)dst.buf, (const char *)src.buf, (size_t)dst.len);
    stream_done();
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&dst);
    PyBuffer_Release(&src);
    Py_RETURN_NONE;
}

#ifdef KVS_HASH
typedef uint64_t (*copy_hashed_fn)(char *, const char *, size_t, int, int);
/* Chosen at import: the AVX2 build of the loop where the CPU has AVX2 (use_isa). */
static copy_hashed_fn copy_hashed = copy_hashed_base;
typedef void (*hash_update_fn)(XXH3_state_t *, const char *, size_t);
static hash_update_fn hash_update = hash_update_base;
static const char *copy_hashed_isa = "baseline";

static int has_avx2(void)
{
#ifdef KVS_AVX2
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2");
#else
    return 0;
#endif
}

static PyObject *ntcopy_use_isa(PyObject *self, PyObject *args)
{
    const char *name;
    (void)self;
    if (!PyArg_ParseTuple(args, "s:use_isa", &name))
        return NULL;
    const char *was = copy_hashed_isa;
    if (strcmp(name, "baseline") == 0) {
        copy_hashed = copy_hashed_base;
        hash_update = hash_update_base;
        copy_hashed_isa = "baseline";
    }
#ifdef KVS_AVX2
    else if (strcmp(name, "avx2") == 0 && has_avx2()) {
        copy_hashed = kvs_copy_hashed_avx2;
        hash_update = kvs_hash_update_avx2;
        copy_hashed_isa = "avx2";
    }
#endif
    else {
        PyErr_Format(PyExc_ValueError, "use_isa: %s is not built or not on this CPU "
                     "(built and here: %s)", name, has_avx2() ? "baseline, avx2" : "baseline");
        return NULL;
    }
    return PyUnicode_FromString(was);
}

/* Non-negative Py_ssize_t items of a sequence, into a new array (NULL, error set). A
 * tuple is taken first: an item's __index__ cannot change what is read. */
static Py_ssize_t *sizes_of(PyObject *seq, Py_ssize_t n, const char *what)
{
    PyObject *items = PySequence_Tuple(seq);
    if (items == NULL)
        return NULL;
    if (PyTuple_GET_SIZE(items) != n) {
        PyErr_Format(PyExc_ValueError, "%s: %zd items for %zd entries", what,
                     PyTuple_GET_SIZE(items), n);
        Py_DECREF(items);
        return NULL;
    }
    Py_ssize_t *out = PyMem_Malloc(sizeof(Py_ssize_t) * (size_t)(n ? n : 1));
    if (out == NULL) {
        Py_DECREF(items);
        PyErr_NoMemory();
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t v = PyNumber_AsSsize_t(PyTuple_GET_ITEM(items, i), PyExc_OverflowError);
        if (v == -1 && PyErr_Occurred()) {
            PyMem_Free(out);
            Py_DECREF(items);
            return NULL;
        }
        if (v < 0) {
            PyErr_Format(PyExc_ValueError, "%s: item %zd is negative (%zd)", what, i, v);
            PyMem_Free(out);
            Py_DECREF(items);
            return NULL;
        }
        out[i] = v;
    }
    Py_DECREF(items);
    return out;
}

static PyObject *sums_list(const uint64_t *sums, Py_ssize_t n)
{
    PyObject *out = PyList_New(n);
    if (out == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *v = PyLong_FromUnsignedLongLong(sums[i]);
        if (v == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, i, v);
    }
    return out;
}

/* Whether [a, a + an) and [b, b + bn) share a byte. */
static int overlap(const void *a, Py_ssize_t an, const void *b, Py_ssize_t bn)
{
    uintptr_t x = (uintptr_t)a, y = (uintptr_t)b;
    return an > 0 && bn > 0 && x < y + (uintptr_t)bn && y < x + (uintptr_t)an;
}

static PyObject *ntcopy_scatter(PyObject *self, PyObject *args)
{
    Py_buffer dst;
    PyObject *offsets_obj, *sizes_obj, *srcs_obj, *srcs = NULL, *result = NULL;
    Py_ssize_t *offsets = NULL, *sizes = NULL, n = 0, got = 0;
    Py_buffer *bufs = NULL;
    uint64_t *sums = NULL;
    int stream;
    (void)self;
    if (!PyArg_ParseTuple(args, "w*OOOp:scatter", &dst, &offsets_obj, &sizes_obj, &srcs_obj,
                          &stream))
        return NULL;
    if ((srcs = PySequence_Tuple(srcs_obj)) == NULL)
        goto done;
    n = PyTuple_GET_SIZE(srcs);
    if ((offsets = sizes_of(offsets_obj, n, "scatter: offsets")) == NULL ||
        (sizes = sizes_of(sizes_obj, n, "scatter: sizes")) == NULL)
        goto done;
    bufs = PyMem_Calloc((size_t)(n ? n : 1), sizeof(Py_buffer));
    sums = PyMem_Malloc(sizeof(uint64_t) * (size_t)(n ? n : 1));
    if (bufs == NULL || sums == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    /* Every entry is checked before the first byte is copied: a refusal changes nothing. */
    while (got < n) {
        Py_buffer *b = &bufs[got];
        if (PyObject_GetBuffer(PyTuple_GET_ITEM(srcs, got), b, PyBUF_C_CONTIGUOUS) < 0)
            goto done;
        Py_ssize_t i = got++;  /* bufs[0:got] are released at done */
        if (b->len != sizes[i]) {
            PyErr_Format(PyExc_ValueError, "scatter: source %zd has %zd bytes, its entry %zd",
                         i, b->len, sizes[i]);
            goto done;
        }
        if (b->len > dst.len || offsets[i] > dst.len - b->len) {
            PyErr_Format(PyExc_ValueError,
                         "scatter: entry %zd (%zd bytes at %zd) is outside the "
                         "destination's %zd bytes", i, b->len, offsets[i], dst.len);
            goto done;
        }
        if (overlap(b->buf, b->len, dst.buf, dst.len)) {
            PyErr_Format(PyExc_ValueError, "scatter: source %zd overlaps the destination", i);
            goto done;
        }
    }
    copy_hashed_fn copy = copy_hashed;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++)
        sums[i] = copy((char *)dst.buf + offsets[i], (const char *)bufs[i].buf,
                       (size_t)bufs[i].len, stream, 0);
    if (stream)
        stream_done();
    Py_END_ALLOW_THREADS
    result = sums_list(sums, n);
done:
    for (Py_ssize_t i = 0; i < got && bufs != NULL; i++)
        PyBuffer_Release(&bufs[i]);
    PyMem_Free(bufs);
    PyMem_Free(sums);
    PyMem_Free(sizes);
    PyMem_Free(offsets);
    Py_XDECREF(srcs);
    PyBuffer_Release(&dst);
    return result;
}

/* scatter_run: a prompt's entries, back to back in one source (a same-node insert's
 * flat KV), laid out in dst from `start`, each `page`-rounded size after the one before
 * (the client's layout of a writer's room, _room_layout in client.py), copied and
 * hashed as scatter does. One call and no per-entry Python objects in: what a small
 * insert spent building and checking a view and a placement per entry
 * (docs/benchmarks.md, "A small insert's entries in one call"). Returns (offsets from
 * start, sums). */
static PyObject *ntcopy_scatter_run(PyObject *self, PyObject *args)
{
    Py_buffer dst, src;
    PyObject *sizes_obj, *offs = NULL, *sums_obj = NULL, *result = NULL;
    Py_ssize_t start, page, n, *sizes = NULL, *at = NULL;
    uint64_t *sums = NULL;
    int stream;
    (void)self;
    if (!PyArg_ParseTuple(args, "w*ny*nOp:scatter_run", &dst, &start, &src, &page,
                          &sizes_obj, &stream))
        return NULL;
    if ((n = PyObject_Length(sizes_obj)) < 0 ||
        (sizes = sizes_of(sizes_obj, n, "scatter_run: sizes")) == NULL)
        goto done;
    if (start < 0 || page < 1) {
        PyErr_Format(PyExc_ValueError, "scatter_run: start %zd and page %zd must be >= 0 "
                     "and >= 1", start, page);
        goto done;
    }
    at = PyMem_Malloc(sizeof(Py_ssize_t) * (size_t)(n ? n : 1));
    sums = PyMem_Malloc(sizeof(uint64_t) * (size_t)(n ? n : 1));
    if (at == NULL || sums == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    /* Every entry is placed and checked before the first byte is copied. `pos` may
     * pass dst's end only by the last entry's padding (then nothing follows it). */
    Py_ssize_t pos = start, taken = 0;
    int past = start > dst.len;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (sizes[i] > src.len - taken) {
            PyErr_Format(PyExc_ValueError, "scatter_run: entries of more than the source's "
                         "%zd bytes", src.len);
            goto done;
        }
        if (past || sizes[i] > dst.len - pos) {
            PyErr_Format(PyExc_ValueError, "scatter_run: entry %zd (%zd bytes at %zd) is "
                         "outside the destination's %zd bytes", i, sizes[i], pos, dst.len);
            goto done;
        }
        at[i] = pos;
        taken += sizes[i];
        Py_ssize_t pad = sizes[i] % page ? page - sizes[i] % page : 0;
        if (pad > dst.len - pos - sizes[i]) {  /* (no overflow: sizes[i] <= dst.len - pos) */
            past = 1;  /* the padding leaves dst: an entry after this one is refused */
            pos += sizes[i];
            pos = pos > PY_SSIZE_T_MAX - pad ? PY_SSIZE_T_MAX : pos + pad;
            continue;
        }
        pos += sizes[i] + pad;
    }
    if (taken != src.len) {
        PyErr_Format(PyExc_ValueError, "scatter_run: entries of %zd bytes, a source of %zd",
                     taken, src.len);
        goto done;
    }
    if (overlap(src.buf, src.len, dst.buf, dst.len)) {
        PyErr_SetString(PyExc_ValueError, "scatter_run: the source overlaps the destination");
        goto done;
    }
    copy_hashed_fn copy = copy_hashed;
    Py_BEGIN_ALLOW_THREADS
    const char *from = (const char *)src.buf;
    for (Py_ssize_t i = 0; i < n; i++) {
        sums[i] = copy((char *)dst.buf + at[i], from, (size_t)sizes[i], stream, 0);
        from += sizes[i];
    }
    if (stream)
        stream_done();
    Py_END_ALLOW_THREADS
    if ((offs = PyList_New(n)) == NULL)
        goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *v = PyLong_FromSsize_t(at[i] - start);
        if (v == NULL)
            goto done;
        PyList_SET_ITEM(offs, i, v);
    }
    if ((sums_obj = sums_list(sums, n)) == NULL)
        goto done;
    result = PyTuple_Pack(2, offs, sums_obj);
done:
    Py_XDECREF(offs);
    Py_XDECREF(sums_obj);
    PyMem_Free(sums);
    PyMem_Free(at);
    PyMem_Free(sizes);
    PyBuffer_Release(&src);
    PyBuffer_Release(&dst);
    return result;
}

static PyObject *ntcopy_gather(PyObject *self, PyObject *args)
{
    Py_buffer dst, src;
    PyObject *dst_obj, *src_obj, *sizes_obj, *result = NULL;
    (void)self;
    if (!PyArg_ParseTuple(args, "w*Oy*OO:gather", &dst, &dst_obj, &src, &src_obj, &sizes_obj))
        return NULL;
    Py_ssize_t n = PyObject_Length(sizes_obj);
    Py_ssize_t *sizes = NULL, *dst_at = NULL, *src_at = NULL;
    uint64_t *sums = NULL;
    if (n < 0)
        goto done;
    if ((sizes = sizes_of(sizes_obj, n, "gather: sizes")) == NULL ||
        (dst_at = sizes_of(dst_obj, n, "gather: destination offsets")) == NULL ||
        (src_at = sizes_of(src_obj, n, "gather: source offsets")) == NULL)
        goto done;
    if (overlap(src.buf, src.len, dst.buf, dst.len)) {
        PyErr_SetString(PyExc_ValueError, "gather: the source overlaps the destination");
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (sizes[i] > dst.len || dst_at[i] > dst.len - sizes[i] ||
            sizes[i] > src.len || src_at[i] > src.len - sizes[i]) {
            PyErr_Format(PyExc_ValueError,
                         "gather: entry %zd (%zd bytes from %zd to %zd) is outside the "
                         "source's %zd bytes or the destination's %zd", i, sizes[i],
                         src_at[i], dst_at[i], src.len, dst.len);
            goto done;
        }
    }
    if ((sums = PyMem_Malloc(sizeof(uint64_t) * (size_t)(n ? n : 1))) == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    copy_hashed_fn copy = copy_hashed;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++)
        sums[i] = copy((char *)dst.buf + dst_at[i], (const char *)src.buf + src_at[i],
                       (size_t)sizes[i], 0, 1);
    Py_END_ALLOW_THREADS
    result = sums_list(sums, n);
done:
    PyMem_Free(sums);
    PyMem_Free(src_at);
    PyMem_Free(dst_at);
    PyMem_Free(sizes);
    PyBuffer_Release(&src);
    PyBuffer_Release(&dst);
    return result;
}

static PyObject *ntcopy_hashes(PyObject *self, PyObject *args)
{
    Py_buffer src;
    PyObject *offsets_obj, *sizes_obj, *result = NULL;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*OO:hashes", &src, &offsets_obj, &sizes_obj))
        return NULL;
    Py_ssize_t n = PyObject_Length(sizes_obj);
    Py_ssize_t *sizes = NULL, *offsets = NULL;
    uint64_t *sums = NULL;
    if (n < 0)
        goto done;
    if ((sizes = sizes_of(sizes_obj, n, "hashes: sizes")) == NULL ||
        (offsets = sizes_of(offsets_obj, n, "hashes: offsets")) == NULL)
        goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (sizes[i] > src.len || offsets[i] > src.len - sizes[i]) {
            PyErr_Format(PyExc_ValueError, "hashes: entry %zd (%zd bytes at %zd) is outside "
                         "the buffer's %zd bytes", i, sizes[i], offsets[i], src.len);
            goto done;
        }
    }
    if ((sums = PyMem_Malloc(sizeof(uint64_t) * (size_t)(n ? n : 1))) == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    copy_hashed_fn hash = copy_hashed;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++)
        sums[i] = hash(NULL, (const char *)src.buf + offsets[i], (size_t)sizes[i], 0, 0);
    Py_END_ALLOW_THREADS
    result = sums_list(sums, n);
done:
    PyMem_Free(sums);
    PyMem_Free(offsets);
    PyMem_Free(sizes);
    PyBuffer_Release(&src);
    return result;
}

/* recv_hashed: the rest of a stream door reply's bytes received into dst (in chunks of
 * `chunk`, each waited for whole: MSG_WAITALL), every entry hashed a chunk at a time
 * right after its bytes land, while they are still in the cache; all of it in one
 * call, without the GIL. Hashing the whole reply after one receive read it back from
 * memory: about a tenth of a 32 MiB read's time here (docs/benchmarks.md, "Hashing
 * a door reply as it arrives"). */
typedef struct {
    Py_ssize_t entry;   /* the entry being hashed */
    Py_ssize_t at;      /* bytes of dst hashed so far */
    Py_ssize_t end;     /* where the entry being hashed ends */
    XXH3_state_t state;
} hash_walk;

/* Hash dst[walk->at, upto): each entry's part in it; each entry wholly in gets its
 * digest in sums. */
static void hash_upto(hash_walk *walk, const char *dst, const Py_ssize_t *sizes,
                      Py_ssize_t n, uint64_t *sums, Py_ssize_t upto)
{
    hash_update_fn update = hash_update;
    while (walk->entry < n) {
        if (walk->at == walk->end) {  /* (a zero-size entry ends where it starts) */
            sums[walk->entry++] = XXH3_64bits_digest(&walk->state);
            XXH3_64bits_reset(&walk->state);
            if (walk->entry < n)
                walk->end = walk->at + sizes[walk->entry];
            continue;
        }
        if (walk->at >= upto)
            return;
        Py_ssize_t stop = walk->end < upto ? walk->end : upto;
        update(&walk->state, dst + walk->at, (size_t)(stop - walk->at));
        walk->at = stop;
    }
}

static double monotonic_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static PyObject *ntcopy_recv_hashed(PyObject *self, PyObject *args)
{
    int fd;
    Py_buffer dst;
    Py_ssize_t start, chunk;
    double deadline;
    PyObject *sizes_obj, *result = NULL;
    hash_walk walk_here;  /* (on the stack: xxh3's state wants 64-byte alignment) */
    (void)self;
    if (!PyArg_ParseTuple(args, "iw*nOnd:recv_hashed", &fd, &dst, &start, &sizes_obj,
                          &chunk, &deadline))
        return NULL;
    Py_ssize_t n = PyObject_Length(sizes_obj);
    Py_ssize_t *sizes = NULL;
    uint64_t *sums = NULL;
    hash_walk *walk = &walk_here;
    if (n < 0 || (sizes = sizes_of(sizes_obj, n, "recv_hashed: sizes")) == NULL)
        goto done;
    Py_ssize_t total = 0;
    for (Py_ssize_t i = 0; i < n && total <= dst.len; i++) {
        if (sizes[i] > dst.len - total) {  /* (summed, they could wrap around) */
            total = dst.len + 1;
            break;
        }
        total += sizes[i];
    }
    if (total != dst.len) {
        PyErr_Format(PyExc_ValueError, "recv_hashed: entries of %s bytes than a buffer of "
                     "%zd", total > dst.len ? "more" : "fewer", dst.len);
        goto done;
    }
    if (start < 0 || start > dst.len || chunk <= 0) {
        PyErr_Format(PyExc_ValueError, "recv_hashed: %zd of %zd bytes in, chunks of %zd",
                     start, dst.len, chunk);
        goto done;
    }
    sums = PyMem_Malloc(sizeof(uint64_t) * (size_t)(n ? n : 1));
    if (sums == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    walk->entry = 0;
    walk->at = 0;
    walk->end = n ? sizes[0] : 0;
    XXH3_INITSTATE(&walk->state);
    XXH3_64bits_reset(&walk->state);
    char *buf = (char *)dst.buf;
    Py_ssize_t got = start;
    int err = 0;  /* errno of the receive that stopped it; -1: closed; ETIMEDOUT */
    PyThreadState *ts = PyEval_SaveThread();
    hash_upto(walk, buf, sizes, n, sums, got);
    while (got < dst.len) {
        double left = deadline - monotonic_s();
        if (!(left > 0)) {  /* (NaN too) */
            err = ETIMEDOUT;
            break;
        }
        if (left > 1e6)
            left = 1e6;  /* (a timeval holds it; each piece sets it again) */
        struct timeval tv;
        tv.tv_sec = (time_t)left;
        tv.tv_usec = (suseconds_t)((left - (double)tv.tv_sec) * 1e6);
        if (tv.tv_sec == 0 && tv.tv_usec == 0)
            tv.tv_usec = 1;
        if (setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv) != 0) {
            err = errno;
            break;
        }
        Py_ssize_t want = dst.len - got < chunk ? dst.len - got : chunk;
        ssize_t r = recv(fd, buf + got, (size_t)want, MSG_WAITALL);
        int interrupted = r < 0 && errno == EINTR;
        if (r > 0) {
            got += r;
            hash_upto(walk, buf, sizes, n, sums, got);
            /* Short of the piece: a timeout, the peer's close, or a signal, which
             * cuts a wait that has bytes already short instead of failing it. */
            interrupted = r < want;
        } else if (r == 0) {
            err = -1;
            break;
        }
        if (interrupted) {  /* a signal's handler runs now (PEP 475) */
            PyEval_RestoreThread(ts);
            int failed = PyErr_CheckSignals();
            ts = PyEval_SaveThread();
            if (failed < 0) {
                err = EINTR;
                break;
            }
            continue;
        }
        if (r > 0)
            continue;
        /* (EAGAIN: the receive timeout. fd must be a blocking socket: on a non-blocking
         * one every wait would end here at once, as a timeout.) */
        err = (errno == EAGAIN || errno == EWOULDBLOCK) ? ETIMEDOUT : errno;
        break;
    }
    PyEval_RestoreThread(ts);
    if (err == EINTR && PyErr_Occurred())
        goto done;  /* the signal handler's exception (KeyboardInterrupt, say) */
    PyObject *done_sums = sums_list(sums, walk->entry);
    if (done_sums == NULL)
        goto done;
    const char *why = err == 0 ? "" : err == -1 ? "closed" : err == ETIMEDOUT ? "timeout"
                      : strerror(err);
    result = Py_BuildValue("nNs", got, done_sums, why);
done:
    PyMem_Free(sums);
    PyMem_Free(sizes);
    PyBuffer_Release(&dst);
    return result;
}

/* prompt_keys: a prompt's token ids checked and converted to int32 LE, its chained
 * block keys and each block's token bytes, in one call (kvstore.core.hashing's
 * prompt_blocks, which uses it where it is built). In Python each block cost a slice,
 * a concatenation and a call, and the conversion a pass or two of its own: ~35 us for
 * 512 tokens, about three times that when the caller's caches went cold between
 * requests, on the critical path of every insert, lookup and drop_select. */
#define KVS_KEY_BYTES 16
#define KVS_TOKEN_MAX 2147483647LL

/* The ids of a list or tuple of Python ints into out (n of them); 0 where one is not
 * an int (exactly, or a bool) or is outside 0..2**31-1. */
static int tokens_of_sequence(PyObject *seq, int32_t *out, Py_ssize_t n)
{
    PyObject **items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t i = 0; i < n; i++) {
        if (!PyLong_Check(items[i]))
            return 0;
        int overflow = 0;
        long long v = PyLong_AsLongLongAndOverflow(items[i], &overflow);
        if (overflow || v < 0 || v > KVS_TOKEN_MAX)
            return 0;
        out[i] = (int32_t)v;
    }
    return 1;
}

/* The ids of a 1-D buffer of native-order integers (numpy's int8 ... uint64) into out;
 * 0 where its format is another or an id is outside 0..2**31-1. */
static int tokens_of_buffer(const Py_buffer *view, int32_t *out, Py_ssize_t n)
{
    const char *f = view->format ? view->format : "B";
#if PY_LITTLE_ENDIAN
    if (*f == '@' || *f == '=' || *f == '<')
#else
    if (*f == '@' || *f == '=' || *f == '>' || *f == '!')
#endif
        f++;  /* (native order: the ids are read as this CPU stores them) */
    if (f[0] == '\0' || f[1] != '\0')
        return 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        const char *at = (const char *)view->buf + i * view->itemsize;
        long long v;
        switch (f[0]) {
        case 'b': v = *(const int8_t *)at; break;
        case 'B': v = *(const uint8_t *)at; break;
        case 'h': v = *(const int16_t *)at; break;
        case 'H': v = *(const uint16_t *)at; break;
        case 'i': v = *(const int32_t *)at; break;
        case 'I': v = *(const uint32_t *)at; break;
        case 'l': case 'q':
            if (view->itemsize != 8)
                return 0;
            v = *(const int64_t *)at;
            break;
        case 'L': case 'Q':
            if (view->itemsize != 8 || *(const uint64_t *)at > (uint64_t)KVS_TOKEN_MAX)
                return 0;
            v = (long long)*(const uint64_t *)at;
            break;
        default: return 0;
        }
        if (v < 0 || v > KVS_TOKEN_MAX)
            return 0;
        out[i] = (int32_t)v;
    }
    return 1;
}

static PyObject *ntcopy_prompt_keys(PyObject *self, PyObject *args)
{
    PyObject *ns, *tokens, *result = NULL, *keys = NULL, *blocks = NULL;
    Py_ssize_t block_tokens;
    unsigned long long partial_seed;
    int32_t *raw = NULL;
    char *scratch = NULL;
    (void)self;
    if (!PyArg_ParseTuple(args, "OOnK:prompt_keys", &ns, &tokens, &block_tokens,
                          &partial_seed))
        return NULL;
    Py_ssize_t n = -1;
    /* (a namespace is the 16 bytes namespace_of gives: anything else, Python's path) */
    if (!PyBytes_CheckExact(ns) || PyBytes_GET_SIZE(ns) != KVS_KEY_BYTES || block_tokens < 1)
        goto none;
    if (PyList_CheckExact(tokens) || PyTuple_CheckExact(tokens)) {
        n = PySequence_Fast_GET_SIZE(tokens);
        if ((raw = PyMem_Malloc(sizeof(int32_t) * (size_t)(n ? n : 1))) == NULL)
            goto nomem;
        if (!tokens_of_sequence(tokens, raw, n))
            goto none;
    } else if (PyObject_CheckBuffer(tokens) && !PyBytes_Check(tokens)) {
        /* (bytes are no 1-D array of ids to numpy, which the path in Python uses) */
        Py_buffer view;
        if (PyObject_GetBuffer(tokens, &view, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) < 0) {
            PyErr_Clear();
            goto none;
        }
        int ok = view.ndim == 1 && view.itemsize > 0;
        n = ok ? view.len / view.itemsize : 0;
        if (ok && (raw = PyMem_Malloc(sizeof(int32_t) * (size_t)(n ? n : 1))) == NULL) {
            PyBuffer_Release(&view);
            goto nomem;
        }
        ok = ok && tokens_of_buffer(&view, raw, n);
        PyBuffer_Release(&view);
        if (!ok)
            goto none;
    } else {
        goto none;
    }
#if PY_LITTLE_ENDIAN == 0
    for (Py_ssize_t i = 0; i < n; i++)  /* keys hash the ids as little-endian int32 */
        raw[i] = (int32_t)__builtin_bswap32((uint32_t)raw[i]);
#endif
    {
        Py_ssize_t full = n / block_tokens, rest = n % block_tokens;
        Py_ssize_t nblocks = full + (rest ? 1 : 0);
        /* A block longer than the prompt is never read whole: no more than the prompt's
         * bytes (n int32s, already allocated) are ever hashed at once. */
        size_t step = (size_t)(block_tokens < n ? block_tokens : n) * sizeof(int32_t);
        if ((keys = PyList_New(nblocks)) == NULL || (blocks = PyList_New(nblocks)) == NULL)
            goto done;
        if ((scratch = PyMem_Malloc(KVS_KEY_BYTES + step)) == NULL)
            goto nomem;
        memcpy(scratch, PyBytes_AS_STRING(ns), KVS_KEY_BYTES);  /* key[-1]: the namespace */
        for (Py_ssize_t b = 0; b < nblocks; b++) {
            const char *block = (const char *)raw + (size_t)b * step;
            size_t len = b < full ? step : (size_t)rest * sizeof(int32_t);
            memcpy(scratch + KVS_KEY_BYTES, block, len);
            /* The last, partial block under a seed of its own: never a full block's key. */
            XXH128_hash_t h = b < full ? XXH3_128bits(scratch, KVS_KEY_BYTES + len)
                : XXH3_128bits_withSeed(scratch, KVS_KEY_BYTES + len, partial_seed);
            XXH128_canonicalFromHash((XXH128_canonical_t *)scratch, h);  /* the next prev */
            PyObject *key = PyBytes_FromStringAndSize(scratch, KVS_KEY_BYTES);
            PyObject *toks = key ? PyBytes_FromStringAndSize(block, (Py_ssize_t)len) : NULL;
            if (toks == NULL) {
                Py_XDECREF(key);
                goto done;
            }
            PyList_SET_ITEM(keys, b, key);
            PyList_SET_ITEM(blocks, b, toks);
        }
    }
    result = Py_BuildValue("OOn", keys, blocks, n);
    goto done;
nomem:
    PyErr_NoMemory();
    goto done;
none:  /* not for this loop: Python's path checks it and says what is wrong */
    result = Py_None;
    Py_INCREF(result);
done:
    Py_XDECREF(keys);
    Py_XDECREF(blocks);
    PyMem_Free(scratch);
    PyMem_Free(raw);
    return result;
}
#endif

static PyMethodDef ntcopy_methods[] = {
    {"copy", ntcopy_copy, METH_VARARGS,
     "copy(dst, src): src's bytes into the writable, contiguous dst of the same length, "
     "with non-temporal stores (x86-64), without the GIL."},
#ifdef KVS_HASH
    {"scatter", ntcopy_scatter, METH_VARARGS,
     "scatter(dst, offsets, sizes, srcs, stream) -> list[int]: each contiguous buffer of "
     "srcs (of its size) copied to its offset in the writable dst (non-temporal stores if "
     "stream); the xxh3_64 of each source, taken chunk by chunk as it is copied. Nothing "
     "is copied unless every entry fits dst and no source overlaps it. Without the GIL."},
    {"scatter_run", ntcopy_scatter_run, METH_VARARGS,
     "scatter_run(dst, start, src, page, sizes, stream) -> (offsets, sums): the entries "
     "of sizes, back to back in the contiguous src, copied into the writable dst from "
     "start on, each its size rounded up to a multiple of page after the one before "
     "(non-temporal stores if stream); their offsets from start and the xxh3_64 of each, taken chunk "
     "by chunk as it is copied. Nothing is copied unless the sizes add up to src, every "
     "entry fits dst and src does not overlap it. Without the GIL."},
    {"gather", ntcopy_gather, METH_VARARGS,
     "gather(dst, dst_offsets, src, src_offsets, sizes) -> list[int]: each entry's "
     "bytes copied from src to dst (which must not overlap); the xxh3_64 of what landed "
     "in dst, taken chunk by chunk as it is copied. Without the GIL."},
    {"hashes", ntcopy_hashes, METH_VARARGS,
     "hashes(src, offsets, sizes) -> list[int]: the xxh3_64 of each entry of the "
     "contiguous src (sizes[i] bytes at offsets[i]), in one call, without the GIL "
     "(the xxhash binding keeps it for inputs under ~256 KiB)."},
    {"recv_hashed", ntcopy_recv_hashed, METH_VARARGS,
     "recv_hashed(fd, dst, start, sizes, chunk, deadline) -> (received, sums, why): the "
     "bytes of dst from start on received from the blocking socket fd, chunk bytes per "
     "receive (MSG_WAITALL), until time.monotonic() reaches deadline; dst holds entries "
     "of sizes back to back, and each is hashed (xxh3_64) a chunk at a time as its bytes "
     "land. received: bytes of dst now in (start included); sums: the digests of the "
     "entries wholly in; why: \"\" (all in), \"closed\", \"timeout\" or the error. "
     "Without the GIL."},
    {"prompt_keys", ntcopy_prompt_keys, METH_VARARGS,
     "prompt_keys(namespace, tokens, block_tokens, partial_seed) -> (keys, blocks, n) | "
     "None: a prompt's chained block keys (xxh3_128 of the previous key, the namespace "
     "first, and the block's ids as int32 LE; the last, partial block with partial_seed) "
     "and each block's id bytes, as kvstore.core.hashing.prompt_blocks gives them. "
     "namespace: 16 bytes; tokens: a list or tuple of ints, or a 1-D contiguous buffer of "
     "native-order integers. None where the input is anything else, an id is outside "
     "0..2**31-1 or block_tokens < 1 (Python's path then says what is wrong)."},
    {"use_isa", ntcopy_use_isa, METH_VARARGS,
     "use_isa(name) -> str: scatter / gather / hashes run the loop built for name (\"baseline\", "
     "or \"avx2\" where built and the CPU has it) from now on; the one they ran before. "
     "The digests are the same: for tests and measurements."},
#endif
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef ntcopy_module = {
    PyModuleDef_HEAD_INIT, "_ntcopy", NULL, -1, ntcopy_methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__ntcopy(void)
{
    PyObject *mod = PyModule_Create(&ntcopy_module);
    if (mod == NULL)
        return NULL;
    const char *isa = "none";
#ifdef KVS_HASH
#ifdef KVS_AVX2
    if (has_avx2()) {
        copy_hashed = kvs_copy_hashed_avx2;
        hash_update = kvs_hash_update_avx2;
        copy_hashed_isa = "avx2";
    }
#endif
    isa = copy_hashed_isa;
#endif
    /* Which build of the copy-and-hash loop runs at import ("none": built without
     * xxhash.h, so without scatter / gather / hashes). */
    if (PyModule_AddStringConstant(mod, "HASH_ISA", isa) < 0) {
        Py_DECREF(mod);
        return NULL;
    }
    return mod;
}
