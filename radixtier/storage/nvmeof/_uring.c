/* radixtier.storage._uring: io_uring vectored reads and writes for the page store.
 *
 * Why this exists: PyPI's `liburing` binding wraps every iovec in a Python object that never
 * releases its buffer export (each get/put leaked mappings until the process hit ENOMEM), and its
 * wheels are built for AVX-512 CPUs only. This module is compiled on the machine by the normal
 * install, links the system liburing, and holds each caller buffer with the buffer protocol
 * exactly as long as the kernel may touch it: acquired at submission, released at completion
 * (or, on any error, only after every in-flight I/O of the call has completed).
 *
 * One Ring per thread (the Python wrapper keeps them in a threading.local); a Ring is not
 * shared between threads. The completion wait runs without the GIL.
 *
 * Fixed buffers (Ring.register): a host pool registered once is pinned by the kernel once, so a
 * read into it (READ_FIXED, _pagebatch.c) skips pinning and unpinning every 4 KiB page of every
 * I/O -- 5-15% of an 8 MiB page's read into 4 KiB-page memory on the RAM device, measured with
 * fio --fixedbufs and with this core. Registration holds page references, not Python buffer
 * exports: a read still exports its buffers for the call, and verification reads the bytes
 * through the caller's own mapping, so memory re-mapped after registration fails its checksum
 * rather than serving stale bytes.
 */
#include "_native.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#define RT_REGISTER_CLONE_BUFFERS 30 /* IORING_REGISTER_CLONE_BUFFERS (Linux 6.12); liburing 2.3 predates it */

/* struct io_uring_clone_buffers: offsets and count 0 = every buffer of the source (6.13+; 6.12 has
 * only src_fd and flags, the rest padding that must be zero, so zeros mean the same there). */
struct rt_clone_buffers {
    uint32_t src_fd;
    uint32_t flags;
    uint32_t src_off;
    uint32_t dst_off;
    uint32_t nr;
    uint32_t pad[3];
};

#define MAX_IOV RT_MAX_IOV

/* One op of a run: its buffers stay exported until the op completes. */
typedef struct {
    int write;
    int fd;
    long long offset;
    Py_ssize_t nbufs;
    Py_buffer *views;
    struct iovec *iov;
    int held;      /* views[0..held) are acquired */
    int inflight;
    long long result;
} Op;

static void op_release(Op *op) {
    for (int i = 0; i < op->held; i++) PyBuffer_Release(&op->views[i]);
    op->held = 0;
    PyMem_Free(op->views);
    PyMem_Free(op->iov);
    op->views = NULL;
    op->iov = NULL;
}

/* Parse (write, fd, offset, bufs) and export its buffers; 0 on success, -1 with an exception. */
static int op_prepare(PyObject *item, Op *op) {
    PyObject *bufs;
    int write, fd;
    long long offset;
    memset(op, 0, sizeof(*op));
    if (!PyTuple_Check(item) || !PyArg_ParseTuple(item, "piLO", &write, &fd, &offset, &bufs)) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_TypeError, "op: expected a tuple (write, fd, offset, buffers)");
        return -1;
    }
    PyObject *seq = PySequence_Fast(bufs, "op buffers: expected a sequence of buffers");
    if (seq == NULL) return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    if (n < 1 || n > MAX_IOV) {
        Py_DECREF(seq);
        PyErr_Format(PyExc_ValueError, "op buffers: expected 1..%d buffers, got %zd", MAX_IOV, n);
        return -1;
    }
    op->write = write;
    op->fd = fd;
    op->offset = offset;
    op->nbufs = n;
    op->views = PyMem_Calloc((size_t)n, sizeof(Py_buffer));
    op->iov = PyMem_Calloc((size_t)n, sizeof(struct iovec));
    if (op->views == NULL || op->iov == NULL) {
        Py_DECREF(seq);
        op_release(op);
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        int flags = write ? PyBUF_SIMPLE : PyBUF_WRITABLE;
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(seq, i), &op->views[i], flags) < 0) {
            Py_DECREF(seq);
            op_release(op);
            return -1;
        }
        op->held = (int)i + 1;
        op->iov[i].iov_base = op->views[i].buf;
        op->iov[i].iov_len = (size_t)op->views[i].len;
    }
    Py_DECREF(seq);
    return 0;
}

static void forget_fixed(RingObject *self) {
    PyMem_Free(self->fixed);
    self->fixed = NULL;
    self->nfixed = 0;
}

/* Drop this (open) ring's registered buffers, if any. */
static void unregister_fixed(RingObject *self) {
    if (self->nfixed) {
        io_uring_unregister_buffers(&self->ring);
        forget_fixed(self);
    }
}

static int Ring_init(RingObject *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"queue_depth", NULL};
    unsigned depth = 16;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|I", kwlist, &depth)) return -1;
    if (depth < 1 || depth > 4096) {
        PyErr_Format(PyExc_ValueError, "queue_depth: expected 1..4096, got %u", depth);
        return -1;
    }
    if (self->ready) {
        io_uring_queue_exit(&self->ring);
        self->ready = 0;
    }
    forget_fixed(self);
    int rc = io_uring_queue_init(depth, &self->ring, 0);
    if (rc < 0) {
        errno = -rc;
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    self->depth = depth;
    self->ready = 1;
    return 0;
}

static void Ring_dealloc(RingObject *self) {
    if (self->ready) io_uring_queue_exit(&self->ring); /* drops the registrations too */
    forget_fixed(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

int rt_past(int64_t deadline_ns) {
    if (deadline_ns <= 0) return 0;
    struct timespec ts;
    clock_gettime(CLOCK_BOOTTIME, &ts); /* the lease clock: monotonic, and it runs through suspend */
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec >= deadline_ns;
}

/* Hand `queued` prepared SQEs to the kernel, retrying transient refusals (EINTR, EAGAIN, EBUSY, a
 * zero count). Returns how many reached it; *err is 0, or -errno when it gave up on the rest.
 * deadline_ns > 0: checked right before each submission, with no Python code in between (so no
 * garbage-collector pause fits there): past it nothing more is submitted and *err is -ETIME. */
int rt_submit_queued(struct io_uring *ring, int queued, int *err, int64_t deadline_ns) {
    int sent = 0, tries = 0;
    *err = 0;
    while (sent < queued) {
        if (rt_past(deadline_ns)) {
            *err = -ETIME;
            break;
        }
        int rc = io_uring_submit(ring);
        if (rc > 0) {
            sent += rc;
            continue;
        }
        if ((rc == -EINTR || rc == -EAGAIN || rc == -EBUSY || rc == 0) && ++tries < 1000) continue;
        *err = rc < 0 ? rc : -EIO;
        break;
    }
    return sent;
}

/* Wait for at least one completion (without the GIL) and record every ready one; returns how many
 * completed, or -errno when waiting failed. `done` receives their op indexes. */
static int reap(RingObject *self, Op *ops, Py_ssize_t *done, int wait) {
    struct io_uring_cqe *cqe = NULL;
    int rc = 0, n = 0;
    if (wait) {
        Py_BEGIN_ALLOW_THREADS
        do {
            rc = io_uring_wait_cqe(&self->ring, &cqe);
        } while (rc == -EINTR);
        Py_END_ALLOW_THREADS
        if (rc < 0) return rc;
    }
    while (io_uring_peek_cqe(&self->ring, &cqe) == 0 && cqe != NULL) {
        Py_ssize_t i = (Py_ssize_t)io_uring_cqe_get_data64(cqe);
        ops[i].result = cqe->res;
        ops[i].inflight = 0;
        op_release(&ops[i]);
        io_uring_cqe_seen(&self->ring, cqe);
        done[n++] = i;
        cqe = NULL;
    }
    return n;
}

PyDoc_STRVAR(Ring_run_doc,
"run(ops, on_done=None, deadline_ns=0) -> list[int]\n\n"
"ops: sequence of (write, fd, offset, buffers); each op is one preadv/pwritev of its buffers laid\n"
"end to end at offset. Returns bytes moved (or -errno) per op. on_done(i, result) is called as op i\n"
"completes, while later ops are still in flight. Every buffer is released before run returns.\n"
"deadline_ns > 0 (time.monotonic_ns()): nothing is submitted past it; the call then raises\n"
"OSError(ETIME) once what was submitted has completed.");

/* A ring a call may use now: open, and no other call on it. 0 with an exception otherwise. */
static int ring_idle(RingObject *self) {
    if (!self->ready) {
        PyErr_SetString(PyExc_ValueError, "ring is closed");
        return 0;
    }
    if (self->busy) {
        PyErr_SetString(PyExc_RuntimeError, "ring is in use by another call (one Ring per thread)");
        return 0;
    }
    return 1;
}

static PyObject *Ring_run(RingObject *self, PyObject *args) {
    PyObject *ops_in, *on_done = Py_None;
    long long deadline_ns = 0;
    if (!PyArg_ParseTuple(args, "O|OL", &ops_in, &on_done, &deadline_ns)) return NULL;
    if (!ring_idle(self)) return NULL;
    PyObject *seq = PySequence_Fast(ops_in, "ops: expected a sequence");
    if (seq == NULL) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    Op *ops = PyMem_Calloc((size_t)(n ? n : 1), sizeof(Op));
    Py_ssize_t *done = PyMem_Calloc((size_t)(n ? n : 1), sizeof(Py_ssize_t));
    PyObject *out = NULL;
    Py_ssize_t next = 0, inflight = 0;
    int failed = 0, broken = 0;
    self->busy = 1;
    if (ops == NULL || done == NULL) {
        PyErr_NoMemory();
        failed = 1;
    }
    while (!failed && (next < n || inflight > 0)) {
        /* top up the queue */
        int queued = 0;
        while (next < n && inflight < (Py_ssize_t)self->depth) {
            struct io_uring_sqe *sqe = io_uring_get_sqe(&self->ring);
            if (sqe == NULL) break;
            Op *op = &ops[next];
            if (op_prepare(PySequence_Fast_GET_ITEM(seq, next), op) < 0) {
                /* the sqe we took is left unused: hand it back as a no-op so the ring stays consistent */
                io_uring_prep_nop(sqe);
                io_uring_sqe_set_data64(sqe, (uint64_t)next);
                op->inflight = 1;
                inflight++;
                next++;
                queued++;
                failed = 1;
                break;
            }
            if (op->write)
                io_uring_prep_writev(sqe, op->fd, op->iov, (unsigned)op->nbufs, (unsigned long long)op->offset);
            else
                io_uring_prep_readv(sqe, op->fd, op->iov, (unsigned)op->nbufs, (unsigned long long)op->offset);
            io_uring_sqe_set_data64(sqe, (uint64_t)next);
            op->inflight = 1;
            inflight++;
            next++;
            queued++;
        }
        if (queued) {
            /* a refusal fails the call (and the ring is torn down below, so no stale sqe naming our
             * buffers is ever submitted) */
            int err, sent = rt_submit_queued(&self->ring, queued, &err, (int64_t)deadline_ns);
            if (err) {
                if (!failed) {
                    errno = -err;
                    PyErr_SetFromErrno(PyExc_OSError);
                }
                failed = 1;
                broken = 1;
                inflight -= queued - sent;
                for (Py_ssize_t j = next - (queued - sent); j < next; j++)
                    ops[j].inflight = 0; /* never reached the kernel: their buffers can go back */
            }
        }
        if (failed) break;
        int got = reap(self, ops, done, 1);
        if (got < 0) {
            errno = -got;
            PyErr_SetFromErrno(PyExc_OSError);
            failed = 1;
            break;
        }
        inflight -= got;
        if (on_done != Py_None) {
            for (int k = 0; k < got; k++) {
                PyObject *r = PyObject_CallFunction(on_done, "nL", done[k], ops[done[k]].result);
                if (r == NULL) {
                    failed = 1;
                    break;
                }
                Py_DECREF(r);
            }
        }
    }
    /* never return while the kernel may still write into a caller buffer */
    while (inflight > 0) {
        PyObject *et, *ev, *tb;
        PyErr_Fetch(&et, &ev, &tb);
        int got = reap(self, ops, done, 1);
        PyErr_Restore(et, ev, tb);
        if (got < 0) {
            if (got == -EINTR) continue;
            broken = 1; /* cannot wait any more: the ring is torn down below before buffers go */
            break;
        }
        inflight -= got;
    }
    if (!failed) {
        out = PyList_New(n);
        if (out != NULL) {
            for (Py_ssize_t i = 0; i < n; i++) {
                PyObject *v = PyLong_FromLongLong(ops[i].result);
                if (v == NULL) {
                    Py_CLEAR(out);
                    break;
                }
                PyList_SET_ITEM(out, i, v);
            }
        }
    }
    if (broken && self->ready) {
        io_uring_queue_exit(&self->ring);
        self->ready = 0;
    }
    /* An op still in flight when the ring broke may yet be written by the kernel (ring teardown is
     * asynchronous): its buffers stay exported (leaked) rather than handed back to their owner. */
    if (ops != NULL)
        for (Py_ssize_t i = 0; i < n; i++)
            if (!ops[i].inflight)
                op_release(&ops[i]);
    self->busy = 0;
    PyMem_Free(ops);
    PyMem_Free(done);
    Py_DECREF(seq);
    return out;
}

int rt_fixed_index(const RingObject *r, const void *base, size_t len) {
    uintptr_t a = (uintptr_t)base;
    for (unsigned i = 0; i < r->nfixed; i++) {
        uintptr_t lo = (uintptr_t)r->fixed[i].iov_base;
        if (a >= lo && len <= r->fixed[i].iov_len && a - lo <= r->fixed[i].iov_len - len) return (int)i;
    }
    return -1;
}

PyDoc_STRVAR(Ring_register_doc,
"register(regions) -> None\n\n"
"regions: sequence of (address, nbytes), each at most 1 GiB: registered as this ring's io_uring fixed\n"
"buffers (the kernel pins them once), replacing any earlier set; [] only drops them. read_pages then\n"
"reads large page segments that lie inside one region with READ_FIXED. OSError when the kernel\n"
"refuses (e.g. ENOMEM past RLIMIT_MEMLOCK, EFAULT for memory it cannot pin): nothing is registered.");

static PyObject *Ring_register(RingObject *self, PyObject *args) {
    PyObject *regions;
    if (!PyArg_ParseTuple(args, "O", &regions)) return NULL;
    if (!ring_idle(self)) return NULL;
    PyObject *seq = PySequence_Fast(regions, "regions: expected a sequence of (address, nbytes)");
    if (seq == NULL) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    if (n > 16384) {
        Py_DECREF(seq);
        PyErr_Format(PyExc_ValueError, "regions: at most 16384, got %zd", n);
        return NULL;
    }
    struct iovec *iov = PyMem_Calloc((size_t)(n ? n : 1), sizeof(struct iovec));
    if (iov == NULL) {
        Py_DECREF(seq);
        return PyErr_NoMemory();
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        unsigned long long addr;
        Py_ssize_t len;
        PyObject *item = PySequence_Fast_GET_ITEM(seq, i);
        if (!PyTuple_Check(item) || !PyArg_ParseTuple(item, "Kn", &addr, &len) || addr == 0 || len <= 0 ||
            len > (1LL << 30)) {
            if (!PyErr_Occurred() || PyErr_ExceptionMatches(PyExc_TypeError)) {
                PyErr_Clear();
                PyErr_Format(PyExc_ValueError, "regions[%zd]: expected (address, nbytes) with 0 < nbytes <= 1 GiB", i);
            }
            PyMem_Free(iov);
            Py_DECREF(seq);
            return NULL;
        }
        iov[i].iov_base = (void *)(uintptr_t)addr;
        iov[i].iov_len = (size_t)len;
    }
    Py_DECREF(seq);
    unregister_fixed(self);
    if (n == 0) {
        PyMem_Free(iov);
        Py_RETURN_NONE;
    }
    int rc;
    self->busy = 1; /* the GIL is released: a close() from another thread must wait */
    Py_BEGIN_ALLOW_THREADS
    rc = io_uring_register_buffers(&self->ring, iov, (unsigned)n); /* pins every page: can take a while */
    Py_END_ALLOW_THREADS
    self->busy = 0;
    if (rc < 0) {
        PyMem_Free(iov);
        errno = -rc;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    self->fixed = iov;
    self->nfixed = (unsigned)n;
    Py_RETURN_NONE;
}

PyDoc_STRVAR(Ring_clone_buffers_doc,
"clone_buffers(source) -> None\n\n"
"Take the registered buffers of another Ring as this ring's own (IORING_REGISTER_CLONE_BUFFERS,\n"
"Linux 6.12+): the kernel shares the source's pinned pages, so no page is pinned again (a\n"
"register() of the same memory costs ~30 ms per GiB of 4 KiB pages). Replaces this ring's set.\n"
"OSError where the kernel lacks it (EINVAL) or the source has none (ENXIO).");

static PyObject *Ring_clone_buffers(RingObject *self, PyObject *args) {
    PyObject *src_obj;
    if (!PyArg_ParseTuple(args, "O!", Py_TYPE(self), &src_obj)) return NULL;
    RingObject *src = (RingObject *)src_obj;
    if (!ring_idle(self)) return NULL;
    if (!src->ready || src == self) {
        PyErr_SetString(PyExc_ValueError, "clone_buffers: the source must be another open ring");
        return NULL;
    }
    struct iovec *copy = PyMem_Calloc(src->nfixed ? src->nfixed : 1, sizeof(struct iovec));
    if (copy == NULL) return PyErr_NoMemory();
    memcpy(copy, src->fixed, sizeof(struct iovec) * src->nfixed);
    unregister_fixed(self);
    struct rt_clone_buffers arg;
    memset(&arg, 0, sizeof(arg));
    arg.src_fd = (uint32_t)src->ring.ring_fd;
    long rc;
    self->busy = 1;
    Py_BEGIN_ALLOW_THREADS
    rc = syscall(__NR_io_uring_register, self->ring.ring_fd, RT_REGISTER_CLONE_BUFFERS, &arg, 1);
    Py_END_ALLOW_THREADS
    self->busy = 0;
    if (rc < 0) {
        PyMem_Free(copy);
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    self->fixed = copy;
    self->nfixed = src->nfixed;
    Py_RETURN_NONE;
}

static PyObject *Ring_close(RingObject *self, PyObject *Py_UNUSED(ignored)) {
    if (self->busy) {
        PyErr_SetString(PyExc_RuntimeError, "ring is in use by a run() on another thread; close it after");
        return NULL;
    }
    if (self->ready) {
        io_uring_queue_exit(&self->ring);
        self->ready = 0;
    }
    forget_fixed(self);
    Py_RETURN_NONE;
}

static PyObject *Ring_get_fixed_ios(RingObject *self, void *Py_UNUSED(closure)) {
    return PyLong_FromUnsignedLongLong(self->fixed_ios);
}

static PyObject *Ring_get_closed(RingObject *self, void *Py_UNUSED(closure)) {
    return PyBool_FromLong(!self->ready);
}

static PyGetSetDef Ring_getset[] = {
    {"closed", (getter)Ring_get_closed, NULL, "True once closed, or torn down after a failed submission", NULL},
    {"fixed_ios", (getter)Ring_get_fixed_ios, NULL, "I/Os this ring issued on its registered buffers", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyMethodDef Ring_methods[] = {
    {"run", (PyCFunction)Ring_run, METH_VARARGS, Ring_run_doc},
    {"read_pages", (PyCFunction)rt_ring_read_pages, METH_VARARGS, rt_read_pages_doc},
    {"write_pages", (PyCFunction)rt_ring_write_pages, METH_VARARGS, rt_write_pages_doc},
    {"register", (PyCFunction)Ring_register, METH_VARARGS, Ring_register_doc},
    {"clone_buffers", (PyCFunction)Ring_clone_buffers, METH_VARARGS, Ring_clone_buffers_doc},
    {"close", (PyCFunction)Ring_close, METH_NOARGS, "Tear the ring down (idempotent)."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject RingType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "radixtier.storage._uring.Ring",
    .tp_basicsize = sizeof(RingObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "An io_uring instance for one thread: Ring(queue_depth).run(ops, on_done)",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Ring_init,
    .tp_dealloc = (destructor)Ring_dealloc,
    .tp_methods = Ring_methods,
    .tp_getset = Ring_getset,
};

static PyObject *mod_crc32c(PyObject *Py_UNUSED(m), PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"data", "value", NULL};
    Py_buffer view;
    unsigned int value = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "y*|I", kwlist, &view, &value)) return NULL;
    uint32_t c;
    Py_BEGIN_ALLOW_THREADS
    c = rt_crc32c(value, view.buf, (size_t)view.len);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&view);
    return PyLong_FromUnsignedLong(c);
}

static PyMethodDef module_methods[] = {
    {"crc32c", (PyCFunction)(void (*)(void))mod_crc32c, METH_VARARGS | METH_KEYWORDS,
     "crc32c(data, value=0) -> int: the CRC-32C the native page core computes (same as the crc32c package)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef uring_module = {
    PyModuleDef_HEAD_INIT, "_uring",
    "io_uring vectored I/O over the system liburing, and whole verified page batches (_pagebatch.c);\n"
    "see storage/nvmeof/_uring.c for why it exists.", -1, module_methods,
};

PyMODINIT_FUNC PyInit__uring(void) {
    rt_crc32c_init();
    if (PyType_Ready(&RingType) < 0 || PyType_Ready(&RtPageBatchType) < 0) return NULL;
    PyObject *m = PyModule_Create(&uring_module);
    if (m == NULL) return NULL;
    Py_INCREF(&RtPageBatchType);
    if (PyModule_AddObject(m, "PageBatch", (PyObject *)&RtPageBatchType) < 0) {
        Py_DECREF(&RtPageBatchType);
        Py_DECREF(m);
        return NULL;
    }
    if (PyModule_AddIntConstant(m, "CRC32C_HARDWARE", rt_crc32c_hardware()) < 0 || rt_pagebatch_add_constants(m) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    Py_INCREF(&RingType);
    if (PyModule_AddObject(m, "Ring", (PyObject *)&RingType) < 0) {
        Py_DECREF(&RingType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
