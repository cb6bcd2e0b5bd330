/* kvstore.client._ntcopy: copy bytes into memory this process will not read again
 * (the server's shared DRAM arena) with non-temporal stores, the GIL released.
 *
 * A plain copy (numpy, glibc's memcpy) pulls every destination line into the cache
 * before writing it (read-for-ownership): for a copy into the arena that doubles the
 * memory traffic and evicts what the caller works on. glibc only streams copies larger
 * than its non-temporal threshold (3/4 of the shared cache), which an entry (64 KiB -
 * 2 MiB) never is. On x86-64 this streams whole 64-byte lines from the first
 * 16-byte-aligned byte of the destination; elsewhere it is a memcpy.
 * (docs/benchmarks.md, "Non-temporal stores".) */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

static void stream_copy(char *dst, const char *src, size_t n)
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
    /* The streamed lines reach memory before anything this thread stores or sends
     * after the copy (the request that tells the server they are there). */
    _mm_sfence();
#else
    memcpy(dst, src, n);
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
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&dst);
    PyBuffer_Release(&src);
    Py_RETURN_NONE;
}

static PyMethodDef ntcopy_methods[] = {
    {"copy", ntcopy_copy, METH_VARARGS,
     "copy(dst, src): src's bytes into the writable, contiguous dst of the same length, "
     "with non-temporal stores (x86-64), without the GIL."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef ntcopy_module = {
    PyModuleDef_HEAD_INIT, "_ntcopy", NULL, -1, ntcopy_methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__ntcopy(void)
{
    return PyModule_Create(&ntcopy_module);
}
