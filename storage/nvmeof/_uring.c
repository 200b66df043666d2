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
 */
#include "_native.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/uio.h>

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
    if (self->ready) io_uring_queue_exit(&self->ring);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* Hand `queued` prepared SQEs to the kernel, retrying transient refusals (EINTR, EAGAIN, EBUSY, a
 * zero count). Returns how many reached it; *err is 0, or -errno when it gave up on the rest. */
int rt_submit_queued(struct io_uring *ring, int queued, int *err) {
    int sent = 0, tries = 0;
    *err = 0;
    while (sent < queued) {
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
"run(ops, on_done=None) -> list[int]\n\n"
"ops: sequence of (write, fd, offset, buffers); each op is one preadv/pwritev of its buffers laid\n"
"end to end at offset. Returns bytes moved (or -errno) per op. on_done(i, result) is called as op i\n"
"completes, while later ops are still in flight. Every buffer is released before run returns.");

static PyObject *Ring_run(RingObject *self, PyObject *args) {
    PyObject *ops_in, *on_done = Py_None;
    if (!PyArg_ParseTuple(args, "O|O", &ops_in, &on_done)) return NULL;
    if (!self->ready) {
        PyErr_SetString(PyExc_ValueError, "ring is closed");
        return NULL;
    }
    if (self->busy) {
        PyErr_SetString(PyExc_RuntimeError, "ring is in use by another call (one Ring per thread)");
        return NULL;
    }
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
            int err, sent = rt_submit_queued(&self->ring, queued, &err);
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

static PyObject *Ring_close(RingObject *self, PyObject *Py_UNUSED(ignored)) {
    if (self->busy) {
        PyErr_SetString(PyExc_RuntimeError, "ring is in use by a run() on another thread; close it after");
        return NULL;
    }
    if (self->ready) {
        io_uring_queue_exit(&self->ring);
        self->ready = 0;
    }
    Py_RETURN_NONE;
}

static PyObject *Ring_get_closed(RingObject *self, void *Py_UNUSED(closure)) {
    return PyBool_FromLong(!self->ready);
}

static PyGetSetDef Ring_getset[] = {
    {"closed", (getter)Ring_get_closed, NULL, "True once closed, or torn down after a failed submission", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyMethodDef Ring_methods[] = {
    {"run", (PyCFunction)Ring_run, METH_VARARGS, Ring_run_doc},
    {"read_pages", (PyCFunction)rt_ring_read_pages, METH_VARARGS, rt_read_pages_doc},
    {"write_pages", (PyCFunction)rt_ring_write_pages, METH_VARARGS, rt_write_pages_doc},
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
    if (PyModule_AddIntConstant(m, "CRC32C_HARDWARE", rt_crc32c_hardware()) < 0) {
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
