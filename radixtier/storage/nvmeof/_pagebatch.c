/* Whole page batches for the page store, run in C without the GIL: the fast path of get/put.
 *
 * Why: at 64 KiB - 1 MiB pages the device finishes a page in 15-80 us, and the Python path spent
 * 30-40 us per page between I/Os (buffer views, header unpack, per-completion callbacks). Here a
 * batch is exported once (PageBatch), then read_pages / write_pages plan the I/O (adjacent slots
 * merged into one vectored I/O), keep the ring full, and for each page as it lands prove the slot
 * header (magic, version, header CRC, key, generation, length, checksum, slot, namespace uuid)
 * and the payload CRC-32C -- all with the GIL released, so the serving thread runs meanwhile.
 * Writes compute each payload's checksum and pack its header just before it is queued, under the
 * writes already in flight. The on-device format is the one layout.py defines (a test checks
 * that pages written by either path read back on the other).
 *
 * Fixed buffers: a read page whose segments are large (>= FIXED_MIN_BYTES) and all lie in regions
 * registered on the ring (Ring.register: SGLang's host pool) is read as its header (plain readv into
 * scratch) plus one READ_FIXED per segment, so the kernel does not pin and unpin its 4 KiB pages on
 * every I/O; the page is verified once all of its I/Os have landed. Smaller segments stay in one
 * vectored I/O (an I/O per 4 KiB-128 KiB chunk would cost more than the pinning it saves).
 *
 * Buffer ownership: a PageBatch holds each caller buffer's export from construction to close();
 * a Ring call never returns while the kernel may still touch one (if a ring breaks with I/O in
 * flight the batch keeps its exports forever rather than hand memory back early). */
#include "_native.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/uio.h>
#include <unistd.h>

#define BLK 4096
#define HDR_BODY 80
#define FORMAT_VERSION 2
#define KEY_BYTES 16
#define ENTRY_BYTES 64 /* a slot-table entry: 60-byte body + its CRC-32C */
#define ENTRY_BODY 60
#define ENTRY_MAGIC 0x5452
#define STATE_USED 1
#define EVENT_OFFSET 128 /* a page's router tag (layout.pack_tag) in its slot header */
#define ENTRY_TAGGED 1   /* table entry flag: its spare bytes hold the tag's block hash */
#define TAG_MIN 28       /* a tag's fixed part; its block hash is at byte 8 */
#define FIXED_MIN_BYTES (256 * 1024) /* smallest segment read with READ_FIXED */

enum { ST_OK = 0, ST_IO = 1, ST_HEADER = 2, ST_CHECKSUM = 3, ST_NOT_RUN = 4, ST_STALE = 5 };

typedef struct {
    void *base;
    size_t len;
} Seg;

typedef struct {
    Seg *segs;
    int nsegs;
    Py_buffer *views;
    int nviews;
    size_t length;
    int aligned; /* every segment starts and ends on a 4 KiB boundary */
} Page;

typedef struct {
    PyObject_HEAD
    Page *pages;
    Py_ssize_t n;
    int writable;
    int in_use; /* a Ring call is using it */
    int leaked; /* a ring broke with I/O in flight: never release these exports */
} PageBatchObject;

static size_t align_up(size_t n) { return (n + BLK - 1) / BLK * BLK; }

static void batch_release(PageBatchObject *b) {
    if (b->pages == NULL || b->leaked) return;
    for (Py_ssize_t i = 0; i < b->n; i++) {
        Page *p = &b->pages[i];
        for (int k = 0; k < p->nviews; k++) PyBuffer_Release(&p->views[k]);
        PyMem_Free(p->views);
        PyMem_Free(p->segs);
    }
    PyMem_Free(b->pages);
    b->pages = NULL;
    b->n = 0;
}

static int is_raw(PyObject *o) {
    return PyTuple_Check(o) && PyTuple_GET_SIZE(o) == 2 && PyLong_Check(PyTuple_GET_ITEM(o, 0)) &&
           PyLong_Check(PyTuple_GET_ITEM(o, 1));
}

/* One segment: (address, nbytes) or an object with the buffer protocol. */
static int seg_add(PageBatchObject *b, Page *p, PyObject *o, const char *verb) {
    Seg *s = &p->segs[p->nsegs];
    if (is_raw(o)) {
        unsigned long long addr = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(o, 0));
        Py_ssize_t n = PyLong_AsSsize_t(PyTuple_GET_ITEM(o, 1));
        if (PyErr_Occurred()) return -1;
        if (addr == 0 || n < 0) {
            PyErr_Format(PyExc_ValueError, "buffer: invalid (address, nbytes) = (%llu, %zd)", addr, n);
            return -1;
        }
        s->base = (void *)(uintptr_t)addr;
        s->len = (size_t)n;
    } else {
        Py_buffer *v = &p->views[p->nviews];
        if (PyObject_GetBuffer(o, v, b->writable ? PyBUF_WRITABLE : PyBUF_SIMPLE) < 0) {
            if (PyErr_ExceptionMatches(PyExc_BufferError) || PyErr_ExceptionMatches(PyExc_TypeError)) {
                PyErr_Clear();
                if (b->writable && PyObject_CheckBuffer(o))
                    PyErr_Format(PyExc_ValueError,
                                 "buffer: a %s is read-only or not contiguous; %s needs writable contiguous buffers",
                                 Py_TYPE(o)->tp_name, verb);
                else
                    PyErr_Format(PyExc_ValueError,
                                 "buffer: expected a CPU tensor, a contiguous buffer or (address, nbytes), got %s",
                                 Py_TYPE(o)->tp_name);
            }
            return -1;
        }
        p->nviews++;
        s->base = v->buf;
        s->len = (size_t)v->len;
    }
    p->length += s->len;
    if ((uintptr_t)s->base % BLK || s->len % BLK) p->aligned = 0;
    p->nsegs++;
    return 0;
}

/* Pages as flat (address, size) lists, `per` consecutive segments a page (SGLang's
 * get_page_buffer_meta): no Python object per segment or page is made or walked twice. */
static int init_flat(PageBatchObject *self, PyObject *addrs, PyObject *sizes, Py_ssize_t per) {
    PyObject *a = PySequence_Fast(addrs, "addresses: expected a sequence of ints");
    if (a == NULL) return -1;
    PyObject *z = PySequence_Fast(sizes, "sizes: expected a sequence of ints");
    if (z == NULL) {
        Py_DECREF(a);
        return -1;
    }
    Py_ssize_t total = PySequence_Fast_GET_SIZE(a);
    if (per <= 0 || per > RT_MAX_IOV - 2 || total != PySequence_Fast_GET_SIZE(z) || total % per) {
        PyErr_Format(PyExc_ValueError, "buffer: %zd addresses and %zd sizes do not make pages of %zd segments "
                     "(at most %d)", total, PySequence_Fast_GET_SIZE(z), per, RT_MAX_IOV - 2);
        goto fail;
    }
    Py_ssize_t n = total / per;
    self->pages = PyMem_Calloc((size_t)(n ? n : 1), sizeof(Page));
    if (self->pages == NULL) {
        PyErr_NoMemory();
        goto fail;
    }
    self->n = n;
    for (Py_ssize_t i = 0; i < n; i++) {
        Page *p = &self->pages[i];
        p->aligned = 1;
        p->segs = PyMem_Calloc((size_t)per, sizeof(Seg));
        if (p->segs == NULL) {
            PyErr_NoMemory();
            goto fail;
        }
        for (Py_ssize_t k = 0; k < per; k++) {
            unsigned long long addr = PyLong_AsUnsignedLongLong(PySequence_Fast_GET_ITEM(a, i * per + k));
            Py_ssize_t len = PyLong_AsSsize_t(PySequence_Fast_GET_ITEM(z, i * per + k));
            if (PyErr_Occurred()) goto fail;
            if (addr == 0 || len < 0) {
                PyErr_Format(PyExc_ValueError, "buffer: invalid (address, nbytes) = (%llu, %zd)", addr, len);
                goto fail;
            }
            Seg *sg = &p->segs[p->nsegs++];
            sg->base = (void *)(uintptr_t)addr;
            sg->len = (size_t)len;
            p->length += sg->len;
            if (addr % BLK || sg->len % BLK) p->aligned = 0;
        }
    }
    Py_DECREF(a);
    Py_DECREF(z);
    return 0;
fail:
    Py_DECREF(a);
    Py_DECREF(z);
    batch_release(self);
    return -1;
}

static int PageBatch_init(PageBatchObject *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"buffers", "writable", "sizes", "per_page", NULL};
    PyObject *bufs, *sizes = NULL;
    int writable = 0;
    Py_ssize_t per = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "Op|On", kwlist, &bufs, &writable, &sizes, &per)) return -1;
    batch_release(self);
    if (sizes != NULL) {
        self->writable = writable;
        return init_flat(self, bufs, sizes, per);
    }
    PyObject *seq = PySequence_Fast(bufs, "buffers: expected a sequence of page buffers");
    if (seq == NULL) return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    self->writable = writable;
    self->pages = PyMem_Calloc((size_t)(n ? n : 1), sizeof(Page));
    if (self->pages == NULL) {
        Py_DECREF(seq);
        PyErr_NoMemory();
        return -1;
    }
    self->n = n;
    const char *verb = writable ? "get()" : "put()";
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *o = PySequence_Fast_GET_ITEM(seq, i);
        Page *p = &self->pages[i];
        PyObject *parts = NULL;
        Py_ssize_t m = 1;
        if ((PyList_Check(o) || PyTuple_Check(o)) && !is_raw(o)) {
            parts = PySequence_Fast(o, "page segments");
            if (parts == NULL) goto fail;
            m = PySequence_Fast_GET_SIZE(parts);
            if (m > RT_MAX_IOV - 2) {
                Py_DECREF(parts);
                PyErr_Format(PyExc_ValueError, "buffer: a page of %zd segments; at most %d", m, RT_MAX_IOV - 2);
                goto fail;
            }
        }
        p->segs = PyMem_Calloc((size_t)(m ? m : 1), sizeof(Seg));
        p->views = PyMem_Calloc((size_t)(m ? m : 1), sizeof(Py_buffer));
        p->aligned = 1;
        if (p->segs == NULL || p->views == NULL) {
            Py_XDECREF(parts);
            PyErr_NoMemory();
            goto fail;
        }
        for (Py_ssize_t k = 0; k < m; k++) {
            if (seg_add(self, p, parts ? PySequence_Fast_GET_ITEM(parts, k) : o, verb) < 0) {
                Py_XDECREF(parts);
                goto fail;
            }
        }
        Py_XDECREF(parts);
    }
    Py_DECREF(seq);
    return 0;
fail:
    Py_DECREF(seq);
    batch_release(self);
    return -1;
}

static void PageBatch_dealloc(PageBatchObject *self) {
    batch_release(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *PageBatch_lengths(PageBatchObject *self, PyObject *Py_UNUSED(ignored)) {
    PyObject *out = PyList_New(self->n);
    if (out == NULL) return NULL;
    for (Py_ssize_t i = 0; i < self->n; i++) {
        PyObject *v = PyLong_FromSize_t(self->pages[i].length);
        if (v == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, i, v);
    }
    return out;
}

static PyObject *PageBatch_close(PageBatchObject *self, PyObject *Py_UNUSED(ignored)) {
    if (self->in_use) {
        PyErr_SetString(PyExc_RuntimeError, "PageBatch is in use by a ring call");
        return NULL;
    }
    batch_release(self);
    Py_RETURN_NONE;
}

static Py_ssize_t PageBatch_len(PageBatchObject *self) { return self->n; }

static PyMethodDef PageBatch_methods[] = {
    {"lengths", (PyCFunction)PageBatch_lengths, METH_NOARGS, "Bytes of each page (the sum of its segments)."},
    {"close", (PyCFunction)PageBatch_close, METH_NOARGS, "Release every buffer export (idempotent)."},
    {NULL, NULL, 0, NULL},
};

static PySequenceMethods PageBatch_as_seq = {.sq_length = (lenfunc)PageBatch_len};

PyTypeObject RtPageBatchType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "radixtier.storage._uring.PageBatch",
    .tp_basicsize = sizeof(PageBatchObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "PageBatch(buffers, writable): page buffers exported once for read_pages / write_pages.\n"
              "Each page is a buffer, (address, nbytes), or a list of those (its segments, end to end).\n"
              "PageBatch(addresses, writable, sizes=..., per_page=k): pages as flat address and size lists,\n"
              "k consecutive segments a page.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)PageBatch_init,
    .tp_dealloc = (destructor)PageBatch_dealloc,
    .tp_methods = PageBatch_methods,
    .tp_as_sequence = &PageBatch_as_seq,
};

/* ------------------------------------------------------------------ batch I/O */

typedef struct {
    Page *page;
    Py_ssize_t pos; /* index in the caller's plan */
    long long slot;
    uint64_t gen;
    uint32_t length;
    uint32_t csum;
    unsigned char key[KEY_BYTES];
    unsigned char parent[KEY_BYTES];
    unsigned char *hdr;
    const unsigned char *tag; /* write: the page's packed router tag (a bytes object the plan holds), or NULL */
    Py_ssize_t tag_len;
    unsigned char *bounce;
    size_t padded; /* header + payload rounded up to blocks: the bytes this item's I/O moves */
    int status;
    int pending;   /* its I/Os not yet landed (1, or 1 + segments when read on fixed buffers) */
    int io_failed; /* one of them failed */
} Item;

typedef struct {
    Py_ssize_t first, count; /* items[first .. first+count) */
    long long offset;
    size_t nbytes;
    struct iovec *iov;
    int niov;
    int fixed;     /* registered buffer index (READ_FIXED of iov[0]), or -1: readv/writev */
    int mergeable; /* whole slots, so the next adjacent slot may join it */
} BatchOp;

typedef struct {
    int write;
    int fd;
    int direct;
    long long data_offset;
    long long slot_bytes;
    size_t coalesce;
    unsigned depth;
    unsigned char uuid[16];
    Item *items;
    Py_ssize_t n;
    BatchOp *ops;
    Py_ssize_t nops;
    struct iovec *iov;
    unsigned char *headers;
    unsigned char *pad; /* read: scratch for padding; write: zeros */
    int first_errno;
    const RingObject *ring; /* its registered buffers */
    int64_t deadline_ns;    /* writes: nothing is issued past it (0: no deadline); see rt_past */
} Batch;

static inline void put16(unsigned char *p, uint16_t v) { memcpy(p, &v, 2); }
static inline void put32(unsigned char *p, uint32_t v) { memcpy(p, &v, 4); }
static inline void put64(unsigned char *p, uint64_t v) { memcpy(p, &v, 8); }
static inline uint16_t get16(const unsigned char *p) { uint16_t v; memcpy(&v, p, 2); return v; }
static inline uint32_t get32(const unsigned char *p) { uint32_t v; memcpy(&v, p, 4); return v; }
static inline uint64_t get64(const unsigned char *p) { uint64_t v; memcpy(&v, p, 8); return v; }
#if __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "the native page core assumes a little-endian host (the on-device format is little-endian)"
#endif

static uint32_t page_crc(const Item *it) {
    uint32_t c = 0;
    const Page *p = it->page;
    for (int k = 0; k < p->nsegs; k++) c = rt_crc32c(c, p->segs[k].base, p->segs[k].len);
    return c;
}

static void pack_header(const Batch *b, Item *it) {
    unsigned char *h = it->hdr;
    memset(h, 0, BLK);
    memcpy(h, "RTPG", 4);
    put16(h + 4, FORMAT_VERSION);
    put16(h + 6, 0);
    put64(h + 8, it->gen);
    put32(h + 16, it->length);
    put32(h + 20, it->csum);
    put64(h + 24, (uint64_t)it->slot);
    memcpy(h + 32, it->key, KEY_BYTES);
    memcpy(h + 48, it->parent, KEY_BYTES);
    memcpy(h + 64, b->uuid, 16);
    put32(h + HDR_BODY, rt_crc32c(0, h, HDR_BODY));
    if (it->tag != NULL) memcpy(h + EVENT_OFFSET, it->tag, (size_t)it->tag_len);
}

static int verify(const Batch *b, Item *it) {
    const unsigned char *h = it->hdr;
    if (memcmp(h, "RTPG", 4) != 0 || get16(h + 4) != FORMAT_VERSION) return ST_HEADER;
    if (get32(h + HDR_BODY) != rt_crc32c(0, h, HDR_BODY)) return ST_HEADER;
    if (get64(h + 24) != (uint64_t)it->slot || memcmp(h + 64, b->uuid, 16) != 0) return ST_HEADER;
    if (memcmp(h + 32, it->key, KEY_BYTES) != 0 || get64(h + 8) != it->gen)
        return ST_STALE; /* a sound header of another page or generation: the slot was reused */
    if (get32(h + 16) != it->length || get32(h + 20) != it->csum) return ST_HEADER;
    const Page *p = it->page;
    if (it->bounce != NULL) {
        if (rt_crc32c(0, it->bounce, it->length) != it->csum) return ST_CHECKSUM;
        size_t pos = 0;
        for (int k = 0; k < p->nsegs; k++) {
            memcpy(p->segs[k].base, it->bounce + pos, p->segs[k].len);
            pos += p->segs[k].len;
        }
        return ST_OK;
    }
    return page_crc(it) == it->csum ? ST_OK : ST_CHECKSUM;
}

/* The slot-table entry naming a written page (layout.TableEntry.pack, byte for byte), so the
 * store indexes a batch without a Python object and a struct pack per page. */
static void pack_entry(const Item *it, unsigned char *e) {
    memset(e, 0, ENTRY_BYTES);
    put16(e, ENTRY_MAGIC);
    e[2] = STATE_USED;
    put32(e + 4, it->length);
    put64(e + 8, it->gen);
    memcpy(e + 16, it->key, KEY_BYTES);
    memcpy(e + 32, it->parent, KEY_BYTES);
    put32(e + 48, it->csum);
    if (it->tag != NULL) {
        e[3] = ENTRY_TAGGED;
        memcpy(e + 52, it->tag + 8, 8);
    }
    put32(e + ENTRY_BODY, rt_crc32c(0, e, ENTRY_BODY));
}

/* Before a write item is queued: checksum, bounce copy, header. */
static void prepare_write(Batch *b, Item *it) {
    const Page *p = it->page;
    if (it->bounce != NULL) {
        size_t pos = 0;
        for (int k = 0; k < p->nsegs; k++) {
            memcpy(it->bounce + pos, p->segs[k].base, p->segs[k].len);
            pos += p->segs[k].len;
        }
        memset(it->bounce + pos, 0, align_up(pos) - pos);
        it->csum = rt_crc32c(0, it->bounce, it->length);
    } else {
        it->csum = page_crc(it);
    }
    pack_header(b, it);
}

static int cmp_slot(const void *x, const void *y) {
    const Item *a = x, *c = y;
    return (a->slot > c->slot) - (a->slot < c->slot);
}

/* Whether a read page goes on fixed buffers: direct, block-aligned, and every segment large and
 * inside one registered region. */
static int on_fixed(const Batch *b, const Item *it) {
    const Page *p = it->page;
    if (b->ring->nfixed == 0 || !b->direct || !p->aligned || it->length % BLK != 0) return 0;
    for (int k = 0; k < p->nsegs; k++)
        if (p->segs[k].len < FIXED_MIN_BYTES || rt_fixed_index(b->ring, p->segs[k].base, p->segs[k].len) < 0)
            return 0;
    return 1;
}

/* A page's ops on fixed buffers: its header (readv into scratch), then one READ_FIXED per segment,
 * none merged with a neighbour. */
static void plan_fixed(Batch *b, Item *it, Py_ssize_t i, struct iovec **vp) {
    const Page *p = it->page;
    long long at = b->data_offset + it->slot * b->slot_bytes;
    struct iovec *v = *vp;
    BatchOp *op = &b->ops[b->nops++];
    v->iov_base = it->hdr;
    v->iov_len = BLK;
    *op = (BatchOp){.first = i, .count = 1, .offset = at, .nbytes = BLK, .iov = v, .niov = 1, .fixed = -1};
    v++;
    at += BLK;
    for (int k = 0; k < p->nsegs; k++) {
        op = &b->ops[b->nops++];
        v->iov_base = p->segs[k].base;
        v->iov_len = p->segs[k].len;
        *op = (BatchOp){.first = i, .count = 1, .offset = at, .nbytes = p->segs[k].len, .iov = v, .niov = 1,
                        .fixed = rt_fixed_index(b->ring, p->segs[k].base, p->segs[k].len)};
        v++;
        at += (long long)p->segs[k].len;
        it->pending++;
    }
    it->padded = BLK + it->length;
    *vp = v;
}

/* Lay out iovecs and merge adjacent full slots into ops. 0, or -1 (out of memory). */
static int plan_ops(Batch *b) {
    Item *items = b->items;
    qsort(items, (size_t)b->n, sizeof(Item), cmp_slot);
    size_t niov = 0;
    for (Py_ssize_t i = 0; i < b->n; i++) niov += (size_t)items[i].page->nsegs + 2;
    b->iov = malloc(sizeof(struct iovec) * (niov ? niov : 1));
    b->ops = malloc(sizeof(BatchOp) * (niov ? niov : 1)); /* at most 1 + segments ops per page */
    if (b->iov == NULL || b->ops == NULL) return -1;
    /* Merged I/Os stay small enough that a batch still fills the queue: with fewer ops than the
     * ring's depth a small batch would run at queue depth 1 (coalesce_bytes is only the cap). */
    size_t total = 0;
    for (Py_ssize_t i = 0; i < b->n; i++) total += BLK + align_up(items[i].length);
    size_t share = total / (b->depth ? b->depth : 1);
    if (share < b->coalesce) b->coalesce = share;
    struct iovec *v = b->iov;
    b->nops = 0;
    for (Py_ssize_t i = 0; i < b->n; i++) {
        Item *it = &items[i];
        const Page *p = it->page;
        struct iovec *start = v;
        it->hdr = b->headers + (size_t)i * BLK;
        it->pending = 1;
        if (!b->write && on_fixed(b, it)) {
            plan_fixed(b, it, i, &v);
            continue;
        }
        v->iov_base = it->hdr;
        v->iov_len = BLK;
        v++;
        size_t payload = align_up(it->length);
        if (b->direct && !(p->aligned && it->length % BLK == 0)) {
            if (posix_memalign((void **)&it->bounce, BLK, payload ? payload : BLK) != 0) {
                it->bounce = NULL;
                return -1;
            }
            v->iov_base = it->bounce;
            v->iov_len = payload;
            v++;
        } else {
            for (int k = 0; k < p->nsegs; k++) {
                if (p->segs[k].len == 0) continue;
                v->iov_base = p->segs[k].base;
                v->iov_len = p->segs[k].len;
                v++;
            }
            if (payload > it->length) {
                v->iov_base = b->pad;
                v->iov_len = payload - it->length;
                v++;
            }
        }
        it->padded = BLK + payload;
        int n_here = (int)(v - start);
        BatchOp *last = b->nops ? &b->ops[b->nops - 1] : NULL;
        if (last != NULL && last->mergeable && (long long)it->padded == b->slot_bytes &&
            last->nbytes == (size_t)last->count * (size_t)b->slot_bytes &&
            items[last->first + last->count - 1].slot + 1 == it->slot && last->niov + n_here <= RT_MAX_IOV &&
            last->nbytes + it->padded <= b->coalesce) {
            last->count++;
            last->nbytes += it->padded;
            last->niov += n_here;
            continue;
        }
        BatchOp *op = &b->ops[b->nops++];
        op->first = i;
        op->count = 1;
        op->offset = b->data_offset + it->slot * b->slot_bytes;
        op->nbytes = it->padded;
        op->iov = start;
        op->niov = n_here;
        op->fixed = -1;
        op->mergeable = 1;
    }
    return 0;
}

/* Finish a short transfer synchronously (rare: signals, EOF); returns total bytes or -errno. */
static long long finish_short(const Batch *b, const BatchOp *op, long long done) {
    struct iovec rest[RT_MAX_IOV];
    while ((size_t)done < op->nbytes) {
        int m = 0;
        size_t skip = (size_t)done;
        for (int k = 0; k < op->niov; k++) {
            if (skip >= op->iov[k].iov_len) {
                skip -= op->iov[k].iov_len;
                continue;
            }
            rest[m].iov_base = (char *)op->iov[k].iov_base + skip;
            rest[m].iov_len = op->iov[k].iov_len - skip;
            skip = 0;
            m++;
        }
        if (b->write && rt_past(b->deadline_ns)) return -ETIME;
        ssize_t r = b->write ? pwritev(b->fd, rest, m, op->offset + done) : preadv(b->fd, rest, m, op->offset + done);
        if (r < 0) {
            if (errno == EINTR) continue;
            return -errno;
        }
        if (r == 0) return done;
        done += r;
    }
    return done;
}

static void op_done(Batch *b, const BatchOp *op, long long res) {
    if (res >= 0 && (size_t)res < op->nbytes) res = finish_short(b, op, res);
    int ok = res >= 0 && (size_t)res == op->nbytes;
    if (!ok && b->first_errno == 0) b->first_errno = res < 0 ? (int)-res : EIO;
    for (Py_ssize_t j = op->first; j < op->first + op->count; j++) {
        Item *it = &b->items[j];
        if (!ok) it->io_failed = 1;
        if (--it->pending > 0) continue; /* verified once all of its I/Os have landed */
        if (it->io_failed)
            it->status = ST_IO;
        else
            it->status = b->write ? ST_OK : verify(b, it);
    }
}

/* rt_submit_queued, and the unsent ones taken back: 0 or -errno. */
static int submit_queued(RingObject *r, const Batch *b, int queued, Py_ssize_t *next, Py_ssize_t *inflight) {
    int err, sent = rt_submit_queued(&r->ring, queued, &err, b->deadline_ns);
    if (err) { /* prepared but never submitted: the caller tears the ring down, so they never run */
        *inflight -= queued - sent;
        *next -= queued - sent;
    }
    return err;
}

/* Queue ops until the ring is full; returns 0 or -errno (then the unsent ones are taken back).
 * A write goes to the kernel as soon as its checksum and header are ready: preparing a whole
 * queue first would leave the device idle behind depth x page bytes of CRC (16 x 8 MiB: ~9 ms). */
static int top_up(RingObject *r, Batch *b, Py_ssize_t *next, Py_ssize_t *inflight) {
    int queued = 0;
    while (*next < b->nops && *inflight < (Py_ssize_t)r->depth) {
        struct io_uring_sqe *sqe = io_uring_get_sqe(&r->ring);
        if (sqe == NULL) break;
        BatchOp *op = &b->ops[*next];
        if (b->write) {
            for (Py_ssize_t j = op->first; j < op->first + op->count; j++) prepare_write(b, &b->items[j]);
            io_uring_prep_writev(sqe, b->fd, op->iov, (unsigned)op->niov, (unsigned long long)op->offset);
        } else if (op->fixed >= 0) {
            io_uring_prep_read_fixed(sqe, b->fd, op->iov[0].iov_base, (unsigned)op->iov[0].iov_len,
                                     (unsigned long long)op->offset, op->fixed);
            r->fixed_ios++;
        } else {
            io_uring_prep_readv(sqe, b->fd, op->iov, (unsigned)op->niov, (unsigned long long)op->offset);
        }
        io_uring_sqe_set_data64(sqe, (uint64_t)*next);
        (*next)++;
        (*inflight)++;
        queued++;
        if (b->write) {
            int rc = submit_queued(r, b, queued, next, inflight);
            if (rc < 0) return rc;
            queued = 0;
        }
    }
    return submit_queued(r, b, queued, next, inflight);
}

/* The ring loop, GIL released. Completions are harvested, the ring is refilled, and only then are
 * the landed pages verified -- so the device works on the next I/Os while the CPU checks these.
 * Returns 0, or -errno when the ring failed (ops never run stay ST_NOT_RUN); *stuck is set when
 * I/O may still be in flight (buffers must then never go back). */
static int run_ring(RingObject *r, Batch *b, int *stuck) {
    Py_ssize_t next = 0, inflight = 0;
    int err = 0;
    Py_ssize_t cap = (Py_ssize_t)r->depth * 2 + 8;
    Py_ssize_t *landed = malloc(sizeof(Py_ssize_t) * (size_t)cap);
    long long *res = malloc(sizeof(long long) * (size_t)cap);
    *stuck = 0;
    if (landed == NULL || res == NULL) {
        free(landed);
        free(res);
        return -ENOMEM;
    }
    err = top_up(r, b, &next, &inflight);
    while (inflight > 0) {
        struct io_uring_cqe *cqe = NULL;
        int rc;
        do {
            rc = io_uring_wait_cqe(&r->ring, &cqe);
        } while (rc == -EINTR);
        if (rc < 0) {
            *stuck = 1;
            err = rc;
            break;
        }
        Py_ssize_t got = 0;
        while (got < cap && io_uring_peek_cqe(&r->ring, &cqe) == 0 && cqe != NULL) {
            landed[got] = (Py_ssize_t)io_uring_cqe_get_data64(cqe);
            res[got++] = cqe->res;
            io_uring_cqe_seen(&r->ring, cqe);
            cqe = NULL;
        }
        inflight -= got;
        if (!err) err = top_up(r, b, &next, &inflight);
        for (Py_ssize_t k = 0; k < got; k++) op_done(b, &b->ops[landed[k]], res[k]);
    }
    free(landed);
    free(res);
    return err;
}

static void batch_free(Batch *b) {
    if (b->items)
        for (Py_ssize_t i = 0; i < b->n; i++) free(b->items[i].bounce);
    free(b->items);
    free(b->ops);
    free(b->iov);
    free(b->headers);
    free(b->pad);
}

static int key_from(PyObject *o, unsigned char *dst, const char *what) {
    char *buf;
    Py_ssize_t len;
    if (!PyBytes_Check(o) || PyBytes_AsStringAndSize(o, &buf, &len) < 0 || len != KEY_BYTES) {
        if (!PyErr_Occurred())
            PyErr_Format(PyExc_ValueError, "%s: expected %d bytes, got %s", what, KEY_BYTES, Py_TYPE(o)->tp_name);
        return -1;
    }
    memcpy(dst, buf, KEY_BYTES);
    return 0;
}

/* A read names its pages by parallel lists (keys, slot tuples, batch indexes or None for 0..n-1),
 * so the store builds no tuple per page for a read (allocations a full GC would later walk). */
typedef struct {
    PyObject *keys, *slots, *indexes; /* PySequence_Fast of each; indexes may be NULL */
} ReadLists;

/* Common front: parse, fill items from the write plan or the read lists, allocate. Returns 0 or
 * -1 with an exception. */
static int batch_setup(Batch *b, PageBatchObject *pb, PyObject *plan, const ReadLists *rl, int write) {
    PyObject *seq = write ? PySequence_Fast(plan, "plan: expected a sequence") : rl->keys;
    if (seq == NULL) return -1;
    if (!write) Py_INCREF(seq);
    b->write = write;
    b->n = PySequence_Fast_GET_SIZE(seq);
    b->items = calloc((size_t)(b->n ? b->n : 1), sizeof(Item));
    if (b->items == NULL || posix_memalign((void **)&b->headers, BLK, (size_t)(b->n ? b->n : 1) * BLK) != 0 ||
        posix_memalign((void **)&b->pad, BLK, BLK) != 0) {
        Py_DECREF(seq);
        PyErr_NoMemory();
        return -1;
    }
    memset(b->pad, 0, BLK);
    for (Py_ssize_t i = 0; i < b->n; i++) {
        PyObject *t = PySequence_Fast_GET_ITEM(seq, i);
        Item *it = &b->items[i];
        Py_ssize_t index;
        PyObject *key, *x, *y;
        it->pos = i;
        it->status = ST_NOT_RUN;
        if (!write) { /* keys[i], slots[i] = (slot, generation, length, checksum, ...), indexes[i] or i */
            long long slot;
            unsigned long long gen;
            unsigned int length, csum;
            key = t;
            x = PySequence_Fast_GET_ITEM(rl->slots, i);
            index = rl->indexes ? PyLong_AsSsize_t(PySequence_Fast_GET_ITEM(rl->indexes, i)) : i;
            if (index == -1 && PyErr_Occurred()) goto fail;
            if (!PyTuple_Check(x) || PyTuple_GET_SIZE(x) < 4) {
                PyErr_Format(PyExc_TypeError, "slots[%zd]: expected (slot, generation, length, checksum, ...)", i);
                goto fail;
            }
            slot = PyLong_AsLongLong(PyTuple_GET_ITEM(x, 0));
            gen = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(x, 1));
            length = (unsigned int)PyLong_AsUnsignedLong(PyTuple_GET_ITEM(x, 2));
            csum = (unsigned int)PyLong_AsUnsignedLong(PyTuple_GET_ITEM(x, 3));
            if (PyErr_Occurred()) goto fail;
            it->slot = slot;
            it->gen = gen;
            it->length = length;
            it->csum = csum;
        } else { /* (batch index, key, parent or None, slot, generation[, packed router tag or None]) */
            long long slot;
            unsigned long long gen;
            PyObject *tag = Py_None;
            if (!PyTuple_Check(t) || !PyArg_ParseTuple(t, "nOOLK|O", &index, &key, &y, &slot, &gen, &tag)) {
                if (!PyErr_Occurred())
                    PyErr_SetString(PyExc_TypeError, "plan item: expected (index, key, parent, slot, generation)");
                goto fail;
            }
            it->slot = slot;
            it->gen = gen;
            if (y != Py_None && key_from(y, it->parent, "parent") < 0) goto fail;
            if (tag != Py_None) {
                if (!PyBytes_Check(tag) || PyBytes_GET_SIZE(tag) < TAG_MIN ||
                    PyBytes_GET_SIZE(tag) > BLK - EVENT_OFFSET) {
                    PyErr_Format(PyExc_ValueError, "plan item %zd: a router tag is %d..%d bytes", i, TAG_MIN,
                                 BLK - EVENT_OFFSET);
                    goto fail;
                }
                it->tag = (const unsigned char *)PyBytes_AS_STRING(tag);
                it->tag_len = PyBytes_GET_SIZE(tag);
            }
        }
        if (key_from(key, it->key, "key") < 0) goto fail;
        if (index < 0 || index >= pb->n) {
            PyErr_Format(PyExc_IndexError, "plan item %zd names page %zd of a batch of %zd", i, index, pb->n);
            goto fail;
        }
        it->page = &pb->pages[index];
        if (write)
            it->length = (uint32_t)it->page->length;
        else if (it->page->length != it->length) {
            PyErr_Format(PyExc_ValueError, "read: buffer %zd has %zu bytes, the stored page has %u", index,
                         it->page->length, it->length);
            goto fail;
        }
        if (it->slot < 0) {
            PyErr_Format(PyExc_ValueError, "plan item %zd: slot %lld", i, it->slot);
            goto fail;
        }
    }
    Py_DECREF(seq);
    if (plan_ops(b) < 0) {
        PyErr_NoMemory();
        return -1;
    }
    return 0;
fail:
    Py_DECREF(seq);
    return -1;
}

/* The read lists as fast sequences of one length; 0, or -1 with an exception (nothing held). */
static int read_lists(PyObject *keys, PyObject *slots, PyObject *indexes, ReadLists *rl) {
    memset(rl, 0, sizeof(*rl));
    rl->keys = PySequence_Fast(keys, "keys: expected a sequence");
    rl->slots = rl->keys ? PySequence_Fast(slots, "slots: expected a sequence") : NULL;
    if (rl->slots != NULL && indexes != Py_None)
        rl->indexes = PySequence_Fast(indexes, "indexes: expected a sequence or None");
    if (rl->keys == NULL || rl->slots == NULL || (indexes != Py_None && rl->indexes == NULL)) goto fail;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(rl->keys);
    if (PySequence_Fast_GET_SIZE(rl->slots) != n || (rl->indexes && PySequence_Fast_GET_SIZE(rl->indexes) != n)) {
        PyErr_Format(PyExc_ValueError, "read: %zd keys, %zd slots and %zd indexes", n,
                     PySequence_Fast_GET_SIZE(rl->slots), rl->indexes ? PySequence_Fast_GET_SIZE(rl->indexes) : n);
        goto fail;
    }
    return 0;
fail:
    Py_XDECREF(rl->keys);
    Py_XDECREF(rl->slots);
    Py_XDECREF(rl->indexes);
    memset(rl, 0, sizeof(*rl));
    return -1;
}

static PyObject *batch_call(RingObject *self, PyObject *args, int write) {
    PyObject *pb_obj, *plan = NULL, *keys = NULL, *slots = NULL, *indexes = NULL;
    ReadLists rl;
    memset(&rl, 0, sizeof(rl));
    const char *uuid;
    Py_ssize_t uuid_len;
    Batch b;
    memset(&b, 0, sizeof(b));
    unsigned long long coalesce;
    long long deadline_ns = 0;
    if (write ? !PyArg_ParseTuple(args, "O!iLLy#OKp|L", &RtPageBatchType, &pb_obj, &b.fd, &b.data_offset, &b.slot_bytes,
                                  &uuid, &uuid_len, &plan, &coalesce, &b.direct, &deadline_ns)
              : !PyArg_ParseTuple(args, "O!iLLy#OOOKp", &RtPageBatchType, &pb_obj, &b.fd, &b.data_offset,
                                  &b.slot_bytes, &uuid, &uuid_len, &keys, &slots, &indexes, &coalesce, &b.direct))
        return NULL;
    PageBatchObject *pb = (PageBatchObject *)pb_obj;
    if (uuid_len != 16) {
        PyErr_Format(PyExc_ValueError, "uuid: expected 16 bytes, got %zd", uuid_len);
        return NULL;
    }
    if (!write && !pb->writable) {
        PyErr_SetString(PyExc_ValueError, "read_pages: the PageBatch was made read-only (writable=False)");
        return NULL;
    }
    if (!self->ready) {
        PyErr_SetString(PyExc_ValueError, "ring is closed");
        return NULL;
    }
    if (self->busy || pb->in_use) {
        PyErr_SetString(PyExc_RuntimeError, "ring or batch is in use by another call (one Ring per thread)");
        return NULL;
    }
    if (b.slot_bytes < 2 * BLK) {
        PyErr_Format(PyExc_ValueError, "slot_bytes: %lld", b.slot_bytes);
        return NULL;
    }
    memcpy(b.uuid, uuid, 16);
    b.deadline_ns = (int64_t)deadline_ns;
    b.coalesce = (size_t)coalesce;
    b.depth = self->depth;
    b.ring = self;
    if (!write && read_lists(keys, slots, indexes, &rl) < 0) return NULL;
    int setup = batch_setup(&b, pb, plan, &rl, write);
    Py_XDECREF(rl.keys);
    Py_XDECREF(rl.slots);
    Py_XDECREF(rl.indexes);
    if (setup < 0) {
        batch_free(&b);
        return NULL;
    }
    if (write)
        for (Py_ssize_t i = 0; i < b.n; i++)
            if ((long long)b.items[i].padded > b.slot_bytes || b.items[i].length == 0) {
                PyErr_Format(PyExc_ValueError, "write: a page of %u bytes does not fit a slot of %lld bytes",
                             b.items[i].length, b.slot_bytes);
                batch_free(&b);
                return NULL;
            }
    self->busy = 1;
    pb->in_use = 1;
    int stuck = 0, err;
    Py_BEGIN_ALLOW_THREADS
    err = run_ring(self, &b, &stuck);
    Py_END_ALLOW_THREADS
    self->busy = 0;
    pb->in_use = 0;
    if (err < 0) {
        io_uring_queue_exit(&self->ring); /* a failed ring is not reused (the wrapper makes a new one) */
        self->ready = 0;
        if (b.first_errno == 0) b.first_errno = -err;
    }
    if (stuck) { /* the kernel may still write into these buffers: keep everything, forever */
        pb->leaked = 1;
        errno = -err;
        PyErr_SetFromErrno(PyExc_OSError);
        return NULL;
    }
    PyObject *status = PyBytes_FromStringAndSize(NULL, b.n);
    PyObject *sums = write ? PyList_New(b.n) : NULL;
    PyObject *entries = write ? PyBytes_FromStringAndSize(NULL, b.n * ENTRY_BYTES) : NULL;
    if (status == NULL || (write && (sums == NULL || entries == NULL))) {
        Py_XDECREF(status);
        Py_XDECREF(sums);
        Py_XDECREF(entries);
        batch_free(&b);
        return NULL;
    }
    char *st = PyBytes_AS_STRING(status);
    for (Py_ssize_t i = 0; i < b.n; i++) {
        const Item *it = &b.items[i];
        st[it->pos] = (char)it->status;
        if (write) {
            PyObject *v = PyLong_FromUnsignedLong(it->csum);
            if (v == NULL) {
                Py_DECREF(status);
                Py_DECREF(sums);
                Py_DECREF(entries);
                batch_free(&b);
                return NULL;
            }
            PyList_SET_ITEM(sums, it->pos, v);
            pack_entry(it, (unsigned char *)PyBytes_AS_STRING(entries) + it->pos * ENTRY_BYTES);
        }
    }
    batch_free(&b);
    if (write) return Py_BuildValue("NNNi", status, sums, entries, b.first_errno);
    return Py_BuildValue("Ni", status, b.first_errno);
}

const char rt_read_pages_doc[] =
    "read_pages(batch, fd, data_offset, slot_bytes, uuid, keys, slots, indexes, coalesce_bytes, direct)\n"
    "    -> (status, errno)\n\n"
    "Page i of the read: keys[i], slots[i] = (slot, generation, length, checksum, ...), into batch page\n"
    "indexes[i] (indexes None: page i). Reads each slot (header + payload) into the batch's buffers,\n"
    "proving header and CRC-32C as each I/O lands, GIL released.\n"
    "status[i]: 0 proven, 1 I/O error, 2 header mismatch, 3 checksum mismatch, 4 not run,\n"
    "5 stale (a sound header of another page or generation: the slot was reused).";

const char rt_write_pages_doc[] =
    "write_pages(batch, fd, data_offset, slot_bytes, uuid, plan, coalesce_bytes, direct, deadline_ns=0)\n"
    "    -> (status, checksums, entries, errno)\n\n"
    "plan: (batch index, key, parent or None, slot, generation) per page. Checksums each page, packs its\n"
    "slot header and writes header + payload, GIL released. status[i]: 0 written, 1 I/O error, 4 not run.\n"
    "entries: the packed 64-byte slot-table entry of each page, in plan order. deadline_ns > 0\n"
    "(time.monotonic_ns()): checked before each submission; past it nothing more is issued (errno ETIME).";

PyObject *rt_ring_read_pages(RingObject *self, PyObject *args) { return batch_call(self, args, 0); }
PyObject *rt_ring_write_pages(RingObject *self, PyObject *args) { return batch_call(self, args, 1); }

/* The format constants and status codes this file was compiled with, as the module's LAYOUT and
 * STATUS dicts: Python (storage/nvmeof/layout.py NATIVE_LAYOUT, status.py PageStatus) holds the
 * same values, and the io_uring engine refuses a build whose values differ (io_engine.py). */
static int add_ints(PyObject *m, const char *dict_name, const char *const *names, const long *values, int n) {
    PyObject *d = PyDict_New();
    if (d == NULL) return -1;
    for (int i = 0; i < n; i++) {
        PyObject *v = PyLong_FromLong(values[i]);
        if (v == NULL || PyDict_SetItemString(d, names[i], v) < 0) {
            Py_XDECREF(v);
            Py_DECREF(d);
            return -1;
        }
        Py_DECREF(v);
    }
    if (PyModule_AddObject(m, dict_name, d) < 0) {
        Py_DECREF(d);
        return -1;
    }
    return 0;
}

int rt_pagebatch_add_constants(PyObject *m) {
    static const char *const layout_names[] = {"BLOCK", "HEADER_BODY", "FORMAT_VERSION", "KEY_BYTES",
                                               "ENTRY_BYTES", "ENTRY_BODY", "ENTRY_MAGIC", "STATE_USED",
                                               "EVENT_OFFSET", "ENTRY_TAGGED"};
    static const long layout_values[] = {BLK, HDR_BODY, FORMAT_VERSION, KEY_BYTES,
                                         ENTRY_BYTES, ENTRY_BODY, ENTRY_MAGIC, STATE_USED,
                                         EVENT_OFFSET, ENTRY_TAGGED};
    static const char *const status_names[] = {"OK", "IO", "HEADER", "CHECKSUM", "NOT_RUN", "STALE"};
    static const long status_values[] = {ST_OK, ST_IO, ST_HEADER, ST_CHECKSUM, ST_NOT_RUN, ST_STALE};
    if (add_ints(m, "LAYOUT", layout_names, layout_values, 10) < 0) return -1;
    return add_ints(m, "STATUS", status_names, status_values, 6);
}
