/* A page pool's free(), in one pass over the slots (radixtier/pools.py keeps the state; this only
 * does the arithmetic on its arrays).
 *
 * Why native: freeing a 2,048-page request in numpy is nine vector calls (range check, taken check,
 * a scatter and a gather for "given twice", the bitmap clear, the push), each costing a microsecond
 * of call overhead on top of its work: 13-20 us, most of an eviction's time. One C loop does all
 * the checks in one pass and the release in a second: about 2 us. pools.py falls back to numpy
 * where this extension was not built.
 *
 * free_slots(used, stack, num_free, runs) -> new num_free
 *   used:     writable, one byte per slot (the pool's numpy bool array: 1 = taken)
 *   stack:    writable int64 free-slot stack, one entry per slot; the top is stack[num_free - 1]
 *   runs:     a list or tuple of C-contiguous int64 arrays: the slots to return, pushed in order
 *             (an eviction's victims each give one; nothing is concatenated)
 * A slot out of range raises ValueError; one not taken, or given twice in this call, raises
 * RuntimeError. On an error nothing has changed (the marks made so far are undone). */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define MARK 2 /* taken, and already seen in this call */

/* Undo the marks of the first `count` slots of every run up to run `last` (its first `count`). */
static void unmark(uint8_t *used, Py_buffer *runs, Py_ssize_t last, Py_ssize_t count) {
    for (Py_ssize_t r = 0; r <= last; r++) {
        const int64_t *slots = (const int64_t *)runs[r].buf;
        Py_ssize_t n = r < last ? runs[r].len / (Py_ssize_t)sizeof(int64_t) : count;
        for (Py_ssize_t j = 0; j < n; j++) used[slots[j]] = 1;
    }
}

static PyObject *free_slots(PyObject *self, PyObject *args) {
    Py_buffer used_buf, stack_buf, *runs = NULL;
    Py_ssize_t num_free, num_runs = 0, total = 0;
    PyObject *runs_obj, *seq = NULL, *result = NULL;
    if (!PyArg_ParseTuple(args, "w*w*nO", &used_buf, &stack_buf, &num_free, &runs_obj)) return NULL;
    Py_ssize_t num_pages = used_buf.len;
    if (stack_buf.len != num_pages * (Py_ssize_t)sizeof(int64_t) || num_free < 0 || num_free > num_pages) {
        PyErr_Format(PyExc_ValueError, "free_slots: used has %zd slots, stack %zd bytes, num_free %zd",
                     num_pages, stack_buf.len, num_free);
        goto done;
    }
    seq = PySequence_Fast(runs_obj, "free_slots: runs must be a list or tuple of int64 arrays");
    if (seq == NULL) goto done;
    runs = PyMem_Calloc((size_t)PySequence_Fast_GET_SIZE(seq) + 1, sizeof(Py_buffer));
    if (runs == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t r = 0; r < PySequence_Fast_GET_SIZE(seq); r++) {
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(seq, r), &runs[r], PyBUF_STRIDES | PyBUF_FORMAT) < 0)
            goto done;
        num_runs++;
        if (runs[r].itemsize != (Py_ssize_t)sizeof(int64_t) || runs[r].format == NULL ||
            runs[r].format[0] == '\0' || strchr("qlQL", runs[r].format[0]) == NULL || runs[r].format[1] != '\0' ||
            !PyBuffer_IsContiguous(&runs[r], 'C')) {
            PyErr_Format(PyExc_TypeError, "free_slots: run %zd is not a contiguous int64 array (format %s)", r,
                         runs[r].format ? runs[r].format : "B");
            goto done;
        }
    }
    uint8_t *used = (uint8_t *)used_buf.buf;
    for (Py_ssize_t r = 0; r < num_runs; r++) {
        const int64_t *slots = (const int64_t *)runs[r].buf;
        Py_ssize_t n = runs[r].len / (Py_ssize_t)sizeof(int64_t);
        for (Py_ssize_t i = 0; i < n; i++) {
            int64_t s = slots[i];
            if ((uint64_t)s >= (uint64_t)num_pages) { /* a negative slot is a huge unsigned one */
                unmark(used, runs, r, i);
                PyErr_Format(PyExc_ValueError, "slot %lld out of range 0..%zd", (long long)s, num_pages - 1);
                goto done;
            }
            if (used[s] != 1) {
                int twice = used[s] == MARK;
                unmark(used, runs, r, i);
                PyErr_Format(PyExc_RuntimeError, twice ? "double free of slot %lld (given twice in one call)"
                                                       : "double free of slot %lld", (long long)s);
                goto done;
            }
            used[s] = MARK;
        }
        total += n;
    }
    if (total > num_pages - num_free) { /* cannot happen once every slot was taken and distinct */
        unmark(used, runs, num_runs - 1, runs[num_runs - 1].len / (Py_ssize_t)sizeof(int64_t));
        PyErr_SetString(PyExc_RuntimeError, "free_slots: more slots than are taken");
        goto done;
    }
    int64_t *top = (int64_t *)stack_buf.buf + num_free;
    for (Py_ssize_t r = 0; r < num_runs; r++) {
        const int64_t *slots = (const int64_t *)runs[r].buf;
        Py_ssize_t n = runs[r].len / (Py_ssize_t)sizeof(int64_t);
        for (Py_ssize_t i = 0; i < n; i++) used[slots[i]] = 0;
        memcpy(top, slots, (size_t)n * sizeof(int64_t));
        top += n;
    }
    result = PyLong_FromSsize_t(num_free + total);
done:
    for (Py_ssize_t r = 0; r < num_runs; r++) PyBuffer_Release(&runs[r]);
    PyMem_Free(runs);
    Py_XDECREF(seq);
    PyBuffer_Release(&used_buf);
    PyBuffer_Release(&stack_buf);
    return result;
}

static PyMethodDef methods[] = {
    {"free_slots", free_slots, METH_VARARGS,
     "free_slots(used, stack, num_free, runs) -> new num_free: check and return runs of slots in one "
     "pass (see radixtier/_slotpool.c)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_slotpool", "A page pool's free() in one pass; see radixtier/_slotpool.c.", -1, methods,
};

PyMODINIT_FUNC PyInit__slotpool(void) { return PyModule_Create(&module); }
