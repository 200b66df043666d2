/* radixtier.storage.nvmeof._fence: one pwritev issued only before a deadline.
 *
 * The partition lease (storage/nvmeof/lease.py) lets a holder issue a write only before its
 * deadline. Checking the clock in Python and then calling os.pwritev leaves a window where a
 * garbage-collector pause (hundreds of ms in a serving process) falls between the check and the
 * write; here the check and the system call run in C with no Python code in between. Needs only
 * a C compiler (unlike the io_uring core, which needs liburing), so the thread-pool engine and the
 * lease itself always have it where radixtier was built. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <stdint.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#define MAX_IOV 1024

/* CLOCK_BOOTTIME: monotonic, and it keeps counting through a suspend (CLOCK_MONOTONIC stops,
 * which would let a resumed holder believe its deadline had not passed). */
static int past(int64_t deadline_ns) {
    if (deadline_ns <= 0) return 0;
    struct timespec ts;
    clock_gettime(CLOCK_BOOTTIME, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec >= deadline_ns;
}

PyDoc_STRVAR(pwritev_by_doc,
"pwritev_by(fd, buffers, offset, deadline_ns) -> int\n\n"
"One pwritev of `buffers` (1 to 1024) at `offset`, issued only if the lease clock\n"
"(time.clock_gettime_ns(time.CLOCK_BOOTTIME)) has not reached deadline_ns (0: no deadline).\n"
"Returns bytes written; OSError(ETIME) when the deadline had passed (nothing written).");

static PyObject *pwritev_by(PyObject *Py_UNUSED(m), PyObject *args) {
    int fd;
    PyObject *bufs_in;
    long long offset, deadline_ns;
    if (!PyArg_ParseTuple(args, "iOLL", &fd, &bufs_in, &offset, &deadline_ns)) return NULL;
    PyObject *seq = PySequence_Fast(bufs_in, "buffers: expected a sequence");
    if (seq == NULL) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    if (n < 1 || n > MAX_IOV) {
        Py_DECREF(seq);
        return PyErr_Format(PyExc_ValueError, "buffers: expected 1 to %d buffers, got %zd", MAX_IOV, n);
    }
    Py_buffer *views = PyMem_Calloc((size_t)n, sizeof(Py_buffer));
    struct iovec *iov = PyMem_Calloc((size_t)n, sizeof(struct iovec));
    Py_ssize_t got = 0;
    PyObject *out = NULL;
    if (views == NULL || iov == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (; got < n; got++) {
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(seq, got), &views[got], PyBUF_SIMPLE) < 0) goto done;
        iov[got].iov_base = views[got].buf;
        iov[got].iov_len = (size_t)views[got].len;
    }
    if (past((int64_t)deadline_ns)) {
        errno = ETIME;
        PyErr_SetFromErrno(PyExc_OSError);
        goto done;
    }
    ssize_t r;
    int err = 0;
    Py_BEGIN_ALLOW_THREADS
    do {
        r = pwritev(fd, iov, (int)n, (off_t)offset);
    } while (r < 0 && errno == EINTR && !past((int64_t)deadline_ns));
    err = errno;
    Py_END_ALLOW_THREADS
    if (r < 0) {
        errno = err;
        PyErr_SetFromErrno(PyExc_OSError);
    } else {
        out = PyLong_FromSsize_t(r);
    }
done:
    for (Py_ssize_t i = 0; i < got; i++) PyBuffer_Release(&views[i]);
    PyMem_Free(views);
    PyMem_Free(iov);
    Py_DECREF(seq);
    return out;
}

static PyMethodDef methods[] = {
    {"pwritev_by", (PyCFunction)pwritev_by, METH_VARARGS, pwritev_by_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_fence",
                                    "A pwritev issued only before a deadline (see storage/nvmeof/lease.py).", -1,
                                    methods};

PyMODINIT_FUNC PyInit__fence(void) { return PyModule_Create(&module); }
