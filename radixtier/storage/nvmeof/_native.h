/* Shared declarations of radixtier's native storage core (one extension, three sources):
 *   _uring.c      the Ring object: io_uring vectored I/O for a list of ops (the general engine)
 *   _pagebatch.c  PageBatch and Ring.read_pages / Ring.write_pages: whole verified page batches
 *   _crc32c.c     CRC-32C, hardware where the CPU has it */
#ifndef RADIXTIER_NATIVE_H
#define RADIXTIER_NATIVE_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <liburing.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/uio.h>

#define RT_MAX_IOV 1024

typedef struct {
    PyObject_HEAD
    struct io_uring ring;
    unsigned depth;
    int ready;
    int busy; /* a run is in progress (a Ring belongs to one thread; this catches misuse) */
    struct iovec *fixed; /* the regions registered as io_uring fixed buffers (Ring.register) */
    unsigned nfixed;
    unsigned long long fixed_ios; /* I/Os issued as READ_FIXED on them, for tests and stats */
} RingObject;

/* Index of the registered buffer holding all of [base, base + len), or -1. */
int rt_fixed_index(const RingObject *r, const void *base, size_t len);

void rt_crc32c_init(void);
int rt_crc32c_hardware(void);
uint32_t rt_crc32c(uint32_t crc, const void *buf, size_t len);
/* 1 when deadline_ns (CLOCK_BOOTTIME nanoseconds: io_engine.deadline_clock()) is set (> 0) and has
 * passed: a write must not be issued then (the partition lease that covers it may have expired). */
int rt_past(int64_t deadline_ns);
int rt_submit_queued(struct io_uring *ring, int queued, int *err, int64_t deadline_ns);

extern PyTypeObject RtPageBatchType;
PyObject *rt_ring_read_pages(RingObject *self, PyObject *args);
PyObject *rt_ring_write_pages(RingObject *self, PyObject *args);
int rt_pagebatch_add_constants(PyObject *m); /* LAYOUT and STATUS dicts (see _pagebatch.c) */
extern const char rt_read_pages_doc[];
extern const char rt_write_pages_doc[];

#endif
