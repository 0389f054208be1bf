/* dmabuf_interop._atomic: 64-bit atomic loads and stores on shared memory, and the mapping they act on.
 *
 * The channel's shared-memory ring (channel/_ring.py) publishes a slot with a release store and reads it after
 * an acquire load; its sleep/wake hand-shake needs a store-load order that only sequentially consistent
 * operations give. Pure Python cannot ask for either on aarch64 (weakly ordered), so these few functions do,
 * with GCC's __atomic builtins: on x86-64 a load-acquire or store-release is a plain MOV and seq_cst store an
 * XCHG; on aarch64 they are LDAR / STLR (and seq_cst the same pair, which is RCsc: an STLR followed by an
 * LDAR is never reordered).
 *
 *   load(buf, off) -> int             acquire load of the u64 at buf[off]      (buf may be read-only)
 *   store(buf, off, value)            release store                            (buf writable)
 *   load_seq(buf, off) -> int         seq_cst load
 *   store_seq(buf, off, value)        seq_cst store
 *   store_load(buf, off, v, peer, poff) -> int  store_seq, then load_seq of peer[poff] (the Dekker step)
 *   publish(buf, off, data)           copy data[8:] to buf[off+8:], then release-store data[0:8] at buf[off]
 *   read_slot(peer, off, seq, last, orderings)  one copy of a ring slot, checked (BadSlot: the copy, refused)
 *   push_slot(buf, off, seq, ..., peer, poff)  a ring slot written and published, and the Dekker step
 *   address(obj) -> int               the address of a buffer exporter's first element (a NumPy array's data)
 *   Mapping(fd, size, writable)       mmap(MAP_SHARED) + madvise(MADV_DONTFORK), a buffer; close() munmaps,
 *                                     and only in the process that mapped it
 *   span(address, nbytes, keep, readonly=False)  a buffer over memory the caller vouches for, holding keep (a
 *                                     received array's owners) for as long as it or any export of it lives
 *
 * Every offset is checked: off >= 0, off + 8 (or + len(data)) <= len(buf), and the address 8-byte aligned
 * (ValueError otherwise); a store into a read-only buffer is a TypeError. Values are native u64; the ring's
 * format is little-endian, so the module refuses to build on a big-endian target.
 *
 * Why Mapping and not Python's mmap: a mapping made with MADV_DONTFORK is absent from a forked child, but a
 * Python mmap object inherited by the child still munmaps its address when it is closed or collected, and by
 * then the child may have mapped something else there; before Python 3.13 it also holds a duplicate of the fd
 * that nobody can close. Mapping keeps no fd and never munmaps in a process other than the one that mapped.
 *
 * Why span: a NumPy array over a received block must keep the block's owners alive (the Received, so its lease,
 * and a reference on the chunk's mapping) for as long as the array or any view of it lives, so its base must
 * hold them. numpy.asarray of an __array_interface__ object does that at about 1.7 us a call (the interface
 * dict parsed each time); numpy.ndarray(shape, dtype, buffer=span(...), strides=...) does it at about 0.3 us
 * (both measured warm on the 2-core x86-64 CPU machine, CPython 3.11.7, NumPy 2.4.6).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "the ring's format is little-endian: this module supports little-endian targets only"
#endif

/* Borrow buf's bytes [off, off + need) as an aligned u64 pointer; fills *view (release it after). */
static uint64_t *
at(PyObject *buf, PyObject *offobj, Py_ssize_t need, int writable, Py_buffer *view)
{
    Py_ssize_t off = PyLong_AsSsize_t(offobj);
    if (off == -1 && PyErr_Occurred())
        return NULL;
    if (PyObject_GetBuffer(buf, view, PyBUF_SIMPLE) < 0)
        return NULL;
    if (writable && view->readonly) {
        PyErr_SetString(PyExc_TypeError, "a store needs a writable buffer");
        goto fail;
    }
    if (off < 0 || need > view->len || off > view->len - need) {
        PyErr_Format(PyExc_ValueError, "offset %zd (+%zd bytes) outside a buffer of %zd bytes", off, need,
                     view->len);
        goto fail;
    }
    char *p = (char *)view->buf + off;
    if (((uintptr_t)p & 7) != 0) {
        PyErr_Format(PyExc_ValueError, "offset %zd is not 8-byte aligned in memory", off);
        goto fail;
    }
    return (uint64_t *)p;
fail:
    PyBuffer_Release(view);
    return NULL;
}

static int
nargs_ok(Py_ssize_t nargs, Py_ssize_t want, const char *name)
{
    if (nargs == want)
        return 1;
    PyErr_Format(PyExc_TypeError, "%s() takes %zd arguments (%zd given)", name, want, nargs);
    return 0;
}

/* Loads and stores use METH_FASTCALL: no argument tuple (they run on every hand-off). */
static PyObject *
do_load(PyObject *const *args, Py_ssize_t nargs, const char *name, int order)
{
    Py_buffer view;
    if (!nargs_ok(nargs, 2, name))
        return NULL;
    uint64_t *p = at(args[0], args[1], 8, 0, &view);
    if (p == NULL)
        return NULL;
    uint64_t v = __atomic_load_n(p, order);
    PyBuffer_Release(&view);
    return PyLong_FromUnsignedLongLong(v);
}

/* A store's target and value: args[0] a writable buffer, args[1] the offset, args[2] the value (OverflowError:
 * < 0 or >= 2**64). NULL with the error set; else *view holds the buffer, to be released. */
static uint64_t *
store_target(PyObject *const *args, uint64_t *value, Py_buffer *view)
{
    unsigned long long v = PyLong_AsUnsignedLongLong(args[2]);
    if (v == (unsigned long long)-1 && PyErr_Occurred())
        return NULL;
    *value = (uint64_t)v;
    return at(args[0], args[1], 8, 1, view);
}

static PyObject *
do_store(PyObject *const *args, Py_ssize_t nargs, const char *name, int order)
{
    Py_buffer view;
    uint64_t v;
    if (!nargs_ok(nargs, 3, name))
        return NULL;
    uint64_t *p = store_target(args, &v, &view);
    if (p == NULL)
        return NULL;
    __atomic_store_n(p, v, order);
    PyBuffer_Release(&view);
    Py_RETURN_NONE;
}

/* Acquire: the reader's later reads (a slot, a release entry) see everything the writer stored before its
 * matching release store of the counter. */
static PyObject *
load(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    return do_load(args, nargs, "load", __ATOMIC_ACQUIRE);
}

/* Release: everything this thread stored before (a slot, release entries) is visible to a reader that
 * load-acquires the value; and a consumer's head is stored only after its copy of the slot is taken. */
static PyObject *
store(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    return do_store(args, nargs, "store", __ATOMIC_RELEASE);
}

/* seq_cst, the sleep/wake hand-shake (Dekker's pattern): the writer stores its tail then loads the peer's
 * "asleep"; the sleeper stores "asleep" then loads the writer's tail. Acquire/release would let each load be
 * satisfied before the other side's store (store-load reordering), both would miss, and the wake-up would be
 * lost; in the single total order of seq_cst operations at least one of them sees the other's store. */
static PyObject *
load_seq(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    return do_load(args, nargs, "load_seq", __ATOMIC_SEQ_CST);
}

static PyObject *
store_seq(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    return do_store(args, nargs, "store_seq", __ATOMIC_SEQ_CST);
}

/* The Dekker step in one call: a seq_cst store of value at buf[off], then a seq_cst load of the u64 at
 * peer[peer_off] (which may be read-only). A publisher stores its tail and reads whether the peer sleeps; a sleeper
 * stores its "asleep" and reads the publisher's tail. One call instead of store_seq + load_seq: a hand-off makes
 * it on its hot path. */
static PyObject *
store_load(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    Py_buffer mine, theirs;
    uint64_t v;
    if (!nargs_ok(nargs, 5, "store_load"))
        return NULL;
    uint64_t *p = store_target(args, &v, &mine);
    if (p == NULL)
        return NULL;
    uint64_t *q = at(args[3], args[4], 8, 0, &theirs);
    if (q == NULL) {
        PyBuffer_Release(&mine);
        return NULL;
    }
    __atomic_store_n(p, v, __ATOMIC_SEQ_CST);
    uint64_t got = __atomic_load_n(q, __ATOMIC_SEQ_CST);
    PyBuffer_Release(&theirs);
    PyBuffer_Release(&mine);
    return PyLong_FromUnsignedLongLong(got);
}

/* A slot: its body first (plain copies), then its seq with a release store, so a reader that sees the new seq
 * (or the tail stored after it) sees the whole body. */
static PyObject *
publish(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    Py_buffer view, data;
    if (!nargs_ok(nargs, 3, "publish"))
        return NULL;
    if (PyObject_GetBuffer(args[2], &data, PyBUF_SIMPLE) < 0)
        return NULL;
    if (data.len < 8) {
        PyBuffer_Release(&data);
        PyErr_SetString(PyExc_ValueError, "publish: data must hold at least its 8-byte seq");
        return NULL;
    }
    uint64_t *p = at(args[0], args[1], data.len, 1, &view);
    if (p == NULL) {
        PyBuffer_Release(&data);
        return NULL;
    }
    uint64_t seq;
    memcpy(&seq, data.buf, 8);
    memcpy((char *)p + 8, (const char *)data.buf + 8, (size_t)data.len - 8);
    __atomic_store_n(p, seq, __ATOMIC_RELEASE);
    PyBuffer_Release(&view);
    PyBuffer_Release(&data);
    Py_RETURN_NONE;
}

/* --- the ring's slot ---------------------------------------------------------------------------------------
 *
 * A slot (docs/protocol.md, "Shared-memory ring"; channel/_ring_region.py's SLOT, struct "<QQQIBB2x64s"):
 *   0 seq u64 | 8 sock_seq u64 | 16 lease u64 | 24 layout u32 | 28 ordering u8 | 29 has_event u8 | 30 pad 2 |
 *   32 event 64 bytes.
 * read_slot and push_slot do in one call what the ring's hot paths did in four to six (struct, the checks, the
 * publish and the Dekker step): each Python step costs a consumer just woken two to three times its warm cost.
 * The checks are the ring's (Note [the peer's region] in channel/_ring.py); tests compare both codings. */
#define SLOT_SIZE 96
#define EVENT_SIZE 64
#define N_ORDERINGS 3      /* "sync", "event", "none": ORDERINGS, by code */
#define EVENT_CODE 1
#define LEASE_LIMIT (1ULL << 53)

static PyObject *BadSlot;  /* raised by read_slot with the copied fields: the caller says what was wrong */

static uint64_t
u64_at(const unsigned char *b, size_t off)
{
    uint64_t v;
    memcpy(&v, b + off, 8);
    return v;
}

/* A u64 argument: 0 with *out set, or -1 with the error set (OverflowError: < 0 or >= 2**64; TypeError). */
static int
u64_arg(PyObject *obj, unsigned long long *out)
{
    *out = PyLong_AsUnsignedLongLong(obj);
    return (*out == (unsigned long long)-1 && PyErr_Occurred()) ? -1 : 0;
}

/* read_slot(peer, off, seq, last_sock_seq, orderings) -> (sock_seq, lease, layout, ordering, event or None).
 * One copy of the slot at peer[off] (the peer may rewrite it at any moment), checked and used: its seq must be
 * seq, its sock_seq at least last_sock_seq, its lease in [1, 2**53), its ordering code an index of orderings (a
 * tuple of 3 str) with has_event 1 exactly for EVENT_CODE. Else BadSlot(seq, sock_seq, lease, layout, code,
 * has_event, event): the copy, for the caller's message. */
static PyObject *
read_slot(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    Py_buffer view;
    unsigned char s[SLOT_SIZE];
    if (!nargs_ok(nargs, 5, "read_slot"))
        return NULL;
    unsigned long long want, last;
    if (u64_arg(args[2], &want) < 0 || u64_arg(args[3], &last) < 0)
        return NULL;
    PyObject *orderings = args[4];
    if (!PyTuple_Check(orderings) || PyTuple_GET_SIZE(orderings) != N_ORDERINGS) {
        PyErr_SetString(PyExc_TypeError, "read_slot: orderings must be a tuple of 3");
        return NULL;
    }
    uint64_t *p = at(args[0], args[1], SLOT_SIZE, 0, &view);
    if (p == NULL)
        return NULL;
    memcpy(s, p, SLOT_SIZE);  /* the one read of the peer's memory */
    PyBuffer_Release(&view);
    uint64_t seq = u64_at(s, 0), sock_seq = u64_at(s, 8), lease = u64_at(s, 16);
    uint32_t layout;
    memcpy(&layout, s + 24, 4);
    unsigned code = s[28], has_event = s[29];
    if (seq != want || sock_seq < last || lease == 0 || lease >= LEASE_LIMIT || code >= N_ORDERINGS
        || has_event != (code == EVENT_CODE)) {
        PyObject *raw = Py_BuildValue("(KKKIIIy#)", (unsigned long long)seq, (unsigned long long)sock_seq,
                                      (unsigned long long)lease, layout, code, has_event, (const char *)s + 32,
                                      (Py_ssize_t)EVENT_SIZE);
        if (raw != NULL) {
            PyErr_SetObject(BadSlot, raw);
            Py_DECREF(raw);
        }
        return NULL;
    }
    PyObject *event;
    if (has_event) {
        event = PyBytes_FromStringAndSize((const char *)s + 32, EVENT_SIZE);
        if (event == NULL)
            return NULL;
    } else {
        event = Py_NewRef(Py_None);
    }
    PyObject *out = PyTuple_New(5);
    if (out == NULL) {
        Py_DECREF(event);
        return NULL;
    }
    PyObject *a = PyLong_FromUnsignedLongLong(sock_seq), *b = PyLong_FromUnsignedLongLong(lease),
             *c = PyLong_FromUnsignedLong(layout);
    if (a == NULL || b == NULL || c == NULL) {
        Py_XDECREF(a);
        Py_XDECREF(b);
        Py_XDECREF(c);
        Py_DECREF(event);
        Py_DECREF(out);
        return NULL;
    }
    PyTuple_SET_ITEM(out, 0, a);
    PyTuple_SET_ITEM(out, 1, b);
    PyTuple_SET_ITEM(out, 2, c);
    PyTuple_SET_ITEM(out, 3, Py_NewRef(PyTuple_GET_ITEM(orderings, code)));
    PyTuple_SET_ITEM(out, 4, event);
    return out;
}

/* push_slot(buf, off, seq, sock_seq, lease, layout, code, event, tail_off, peer, asleep_off) -> int.
 * Write the slot at buf[off] (its body, then seq with a release store), then the Dekker step: a seq_cst store of
 * seq at buf[tail_off] (the tail) and a seq_cst load of the u64 at peer[asleep_off], returned (nonzero: the peer
 * sleeps, wake it). Everything is checked before anything is written: ValueError for a lease outside [1, 2**53),
 * a code >= 3, an event that is not 64 bytes or None exactly when code is not EVENT_CODE; OverflowError for a
 * value past its field. */
static PyObject *
push_slot(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    Py_buffer view, tailv, peerv, ev;
    unsigned char s[SLOT_SIZE];
    if (!nargs_ok(nargs, 11, "push_slot"))
        return NULL;
    unsigned long long seq, sock_seq, lease, layout, code;
    if (u64_arg(args[2], &seq) < 0 || u64_arg(args[3], &sock_seq) < 0 || u64_arg(args[4], &lease) < 0
        || u64_arg(args[5], &layout) < 0 || u64_arg(args[6], &code) < 0)
        return NULL;
    if (layout > UINT32_MAX) {
        PyErr_SetString(PyExc_OverflowError, "push_slot: layout does not fit a u32");
        return NULL;
    }
    if (lease == 0 || lease >= LEASE_LIMIT || code >= N_ORDERINGS
        || (args[7] != Py_None) != (code == EVENT_CODE)) {
        PyErr_SetString(PyExc_ValueError, "push_slot: lease, ordering or event out of the slot's range");
        return NULL;
    }
    memset(s, 0, SLOT_SIZE);
    if (args[7] != Py_None) {
        if (PyObject_GetBuffer(args[7], &ev, PyBUF_SIMPLE) < 0)
            return NULL;
        if (ev.len != EVENT_SIZE) {
            PyBuffer_Release(&ev);
            PyErr_SetString(PyExc_ValueError, "push_slot: an event is 64 bytes");
            return NULL;
        }
        memcpy(s + 32, ev.buf, EVENT_SIZE);
        PyBuffer_Release(&ev);
        s[29] = 1;
    }
    uint64_t sq = sock_seq, ls = lease;
    uint32_t lay = (uint32_t)layout;
    memcpy(s + 8, &sq, 8);
    memcpy(s + 16, &ls, 8);
    memcpy(s + 24, &lay, 4);
    s[28] = (unsigned char)code;
    uint64_t *p = at(args[0], args[1], SLOT_SIZE, 1, &view);
    if (p == NULL)
        return NULL;
    uint64_t *t = at(args[0], args[8], 8, 1, &tailv);
    if (t == NULL) {
        PyBuffer_Release(&view);
        return NULL;
    }
    uint64_t *q = at(args[9], args[10], 8, 0, &peerv);
    if (q == NULL) {
        PyBuffer_Release(&tailv);
        PyBuffer_Release(&view);
        return NULL;
    }
    memcpy((char *)p + 8, s + 8, SLOT_SIZE - 8);
    __atomic_store_n(p, (uint64_t)seq, __ATOMIC_RELEASE);
    __atomic_store_n(t, (uint64_t)seq, __ATOMIC_SEQ_CST);
    uint64_t asleep = __atomic_load_n(q, __ATOMIC_SEQ_CST);
    PyBuffer_Release(&peerv);
    PyBuffer_Release(&tailv);
    PyBuffer_Release(&view);
    return PyLong_FromUnsignedLongLong(asleep);
}

/* The address of a buffer exporter's first element (a NumPy array's data pointer): the sender's memo compares it
 * on every send, and NumPy's own ``ndarray.ctypes.data`` builds a ctypes object each time (about 1 us warm, 4 us
 * in a process idle between sends). PyBUF_STRIDES takes non-contiguous arrays; no format string is asked for. */
static PyObject *
address(PyObject *self, PyObject *obj)
{
    Py_buffer view;
    if (PyObject_GetBuffer(obj, &view, PyBUF_STRIDES) < 0)
        return NULL;
    uintptr_t p = (uintptr_t)view.buf;
    PyBuffer_Release(&view);
    return PyLong_FromUnsignedLongLong((unsigned long long)p);
}

/* --- Mapping ----------------------------------------------------------------------------------------------- */

typedef struct {
    PyObject_HEAD
    char *addr;          /* NULL once closed */
    Py_ssize_t size;
    int readonly;
    pid_t pid;           /* the process that mapped it: the only one that may munmap */
    Py_ssize_t exports;  /* buffers handed out and not released */
} Mapping;

/* Forget the mapping; munmap only in the process that made it (in a forked child the range is not mapped:
 * MADV_DONTFORK, and something else of the child's may live there now). */
static int
mapping_drop(Mapping *self)
{
    char *addr = self->addr;
    self->addr = NULL;
    if (addr != NULL && getpid() == self->pid && munmap(addr, (size_t)self->size) != 0)
        return -1;
    return 0;
}

static PyObject *
mapping_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"fd", "size", "writable", NULL};
    int fd, writable = 0;
    Py_ssize_t size;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "in|p:Mapping", kwlist, &fd, &size, &writable))
        return NULL;
    if (size <= 0) {
        PyErr_SetString(PyExc_ValueError, "Mapping: size must be positive");
        return NULL;
    }
    Mapping *self = (Mapping *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    int prot = PROT_READ | (writable ? PROT_WRITE : 0);
    void *addr;
    Py_BEGIN_ALLOW_THREADS
    addr = mmap(NULL, (size_t)size, prot, MAP_SHARED, fd, 0);
    Py_END_ALLOW_THREADS
    if (addr == MAP_FAILED) {
        Py_DECREF(self);
        return PyErr_SetFromErrnoWithFilename(PyExc_OSError, "mmap");
    }
    if (madvise(addr, (size_t)size, MADV_DONTFORK) != 0) {
        int err = errno;
        munmap(addr, (size_t)size);
        Py_DECREF(self);
        errno = err;
        return PyErr_SetFromErrnoWithFilename(PyExc_OSError, "madvise");
    }
    self->addr = addr;
    self->size = size;
    self->readonly = !writable;
    self->pid = getpid();
    return (PyObject *)self;
}

static void
mapping_dealloc(Mapping *self)
{
    mapping_drop(self); /* nothing to report from a destructor */
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *
mapping_close(Mapping *self, PyObject *unused)
{
    if (self->exports > 0) {
        PyErr_SetString(PyExc_BufferError, "Mapping.close: a buffer of it is still in use");
        return NULL;
    }
    if (mapping_drop(self) < 0)
        return PyErr_SetFromErrnoWithFilename(PyExc_OSError, "munmap");
    Py_RETURN_NONE;
}

static PyObject *
mapping_closed(Mapping *self, void *unused)
{
    return PyBool_FromLong(self->addr == NULL);
}

static PyObject *
mapping_readonly(Mapping *self, void *unused)
{
    return PyBool_FromLong(self->readonly);
}

static Py_ssize_t
mapping_len(Mapping *self)
{
    return self->addr == NULL ? 0 : self->size;
}

static int
mapping_getbuffer(Mapping *self, Py_buffer *view, int flags)
{
    if (self->addr == NULL) {
        PyErr_SetString(PyExc_ValueError, "Mapping is closed");
        view->obj = NULL;
        return -1;
    }
    if (PyBuffer_FillInfo(view, (PyObject *)self, self->addr, self->size, self->readonly, flags) < 0) {
        view->obj = NULL; /* a writable buffer of a read-only mapping: BufferError */
        return -1;
    }
    self->exports++;
    return 0;
}

static void
mapping_releasebuffer(Mapping *self, Py_buffer *view)
{
    self->exports--;
}

static PyMethodDef mapping_methods[] = {
    {"close", (PyCFunction)mapping_close, METH_NOARGS,
     "Unmap (munmap) in the process that mapped it; in another (a forked child) only forget it. Idempotent.\n"
     "Raises BufferError while a memoryview of it is alive, OSError if munmap fails."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef mapping_getset[] = {
    {"closed", (getter)mapping_closed, NULL, "True once closed.", NULL},
    {"readonly", (getter)mapping_readonly, NULL, "True when mapped PROT_READ only.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PySequenceMethods mapping_as_sequence = {.sq_length = (lenfunc)mapping_len};

static PyBufferProcs mapping_as_buffer = {
    .bf_getbuffer = (getbufferproc)mapping_getbuffer,
    .bf_releasebuffer = (releasebufferproc)mapping_releasebuffer,
};

static PyTypeObject MappingType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "dmabuf_interop._atomic.Mapping",
    .tp_doc = "Mapping(fd, size, writable=False): mmap(NULL, size, PROT_READ[|PROT_WRITE], MAP_SHARED, fd, 0)\n"
              "with madvise(MADV_DONTFORK); a buffer (read-only unless writable). Holds no fd.\n"
              "Raises OSError (filename 'mmap' or 'madvise') with the errno.",
    .tp_basicsize = sizeof(Mapping),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = mapping_new,
    .tp_dealloc = (destructor)mapping_dealloc,
    .tp_methods = mapping_methods,
    .tp_getset = mapping_getset,
    .tp_as_sequence = &mapping_as_sequence,
    .tp_as_buffer = &mapping_as_buffer,
};

/* --- Span: a buffer over memory owned elsewhere, holding its owners ------------------------------------------ */

typedef struct {
    PyObject_HEAD
    void *addr;
    Py_ssize_t len;
    int readonly;
    PyObject *keep;
} Span;

static PyTypeObject SpanType;

static int
span_traverse(Span *self, visitproc visit, void *arg)
{
    Py_VISIT(self->keep);
    return 0;
}

static int
span_clear(Span *self)
{
    Py_CLEAR(self->keep);
    return 0;
}

static void
span_dealloc(Span *self)
{
    PyObject_GC_UnTrack(self);
    Py_CLEAR(self->keep);
    PyObject_GC_Del(self);
}

static int
span_getbuffer(Span *self, Py_buffer *view, int flags)
{
    if (PyBuffer_FillInfo(view, (PyObject *)self, self->addr, self->len, self->readonly, flags) < 0) {
        view->obj = NULL; /* a writable buffer of a read-only span: BufferError */
        return -1;
    }
    return 0;
}

static Py_ssize_t
span_length(Span *self)
{
    return self->len;
}

static PyObject *
span_keep(Span *self, void *unused)
{
    return Py_NewRef(self->keep);
}

static PyObject *
span_readonly(Span *self, void *unused)
{
    return PyBool_FromLong(self->readonly);
}

static PyGetSetDef span_getset[] = {
    {"keep", (getter)span_keep, NULL, "What the span holds alive.", NULL},
    {"readonly", (getter)span_readonly, NULL, "True when its buffer is exported read-only.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PySequenceMethods span_as_sequence = {.sq_length = (lenfunc)span_length};

static PyBufferProcs span_as_buffer = {.bf_getbuffer = (getbufferproc)span_getbuffer};

static PyTypeObject SpanType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "dmabuf_interop._atomic.Span",
    .tp_doc = "A buffer of nbytes at an address (read-only or writable), holding keep: made by span().",
    .tp_basicsize = sizeof(Span),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_dealloc = (destructor)span_dealloc,
    .tp_traverse = (traverseproc)span_traverse,
    .tp_clear = (inquiry)span_clear,
    .tp_getset = span_getset,
    .tp_as_sequence = &span_as_sequence,
    .tp_as_buffer = &span_as_buffer,
};

static PyObject *
span(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3 && nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "span(address, nbytes, keep, readonly=False) takes 3 or 4 arguments");
        return NULL;
    }
    int readonly = 0;
    if (nargs == 4 && (readonly = PyObject_IsTrue(args[3])) < 0)
        return NULL;
    void *addr = PyLong_AsVoidPtr(args[0]);
    if (addr == NULL && PyErr_Occurred())
        return NULL;
    Py_ssize_t len = PyLong_AsSsize_t(args[1]);
    if (len == -1 && PyErr_Occurred())
        return NULL;
    if (len < 0 || (addr == NULL && len > 0)) {
        PyErr_Format(PyExc_ValueError, "span: %zd bytes at address %p", len, addr);
        return NULL;
    }
    Span *self = PyObject_GC_New(Span, &SpanType);
    if (self == NULL)
        return NULL;
    self->addr = addr;
    self->len = len;
    self->readonly = readonly;
    self->keep = Py_NewRef(args[2]);
    PyObject_GC_Track(self);
    return (PyObject *)self;
}

/* --- module ------------------------------------------------------------------------------------------------ */

static PyMethodDef methods[] = {
    {"load", (PyCFunction)(void (*)(void))load, METH_FASTCALL,
     "load(buf, off) -> int: acquire load of the native u64 at buf[off] (8-byte aligned; buf may be read-only)."},
    {"store", (PyCFunction)(void (*)(void))store, METH_FASTCALL,
     "store(buf, off, value): release store of a u64 at buf[off] (8-byte aligned; buf writable)."},
    {"load_seq", (PyCFunction)(void (*)(void))load_seq, METH_FASTCALL,
     "load_seq(buf, off) -> int: sequentially consistent load of the u64 at buf[off]."},
    {"store_seq", (PyCFunction)(void (*)(void))store_seq, METH_FASTCALL,
     "store_seq(buf, off, value): sequentially consistent store of a u64 at buf[off]."},
    {"store_load", (PyCFunction)(void (*)(void))store_load, METH_FASTCALL,
     "store_load(buf, off, value, peer, peer_off) -> int: seq_cst store of value at buf[off], then the seq_cst load "
     "of the u64 at peer[peer_off]: both checked before either is done."},
    {"publish", (PyCFunction)(void (*)(void))publish, METH_FASTCALL,
     "publish(buf, off, data): copy data[8:] to buf[off+8:], then release-store the u64 data[0:8] at buf[off]."},
    {"read_slot", (PyCFunction)(void (*)(void))read_slot, METH_FASTCALL,
     "read_slot(peer, off, seq, last_sock_seq, orderings) -> (sock_seq, lease, layout, ordering, event): one copy "
     "of the ring slot at peer[off], checked (seq, sock_seq >= last_sock_seq, lease in [1, 2**53), the ordering "
     "code and has_event); BadSlot(copied fields) where a check fails."},
    {"push_slot", (PyCFunction)(void (*)(void))push_slot, METH_FASTCALL,
     "push_slot(buf, off, seq, sock_seq, lease, layout, code, event, tail_off, peer, asleep_off) -> int: write a "
     "ring slot at buf[off] (body, then seq release-stored), seq_cst-store seq at buf[tail_off], return the "
     "seq_cst load of peer[asleep_off]; ValueError or OverflowError, nothing written, for a field out of range."},
    {"address", (PyCFunction)address, METH_O,
     "address(obj) -> int: the address of the first element of a buffer exporter (PyBUF_STRIDES: strided "
     "buffers too), as NumPy's ndarray.ctypes.data; BufferError (or TypeError) where it exports none."},
    {"span", (PyCFunction)(void (*)(void))span, METH_FASTCALL,
     "span(address, nbytes, keep, readonly=False) -> Span: a buffer of nbytes at address (an int), read-only "
     "or writable, that holds keep for as long as it, or a buffer exported from it (a NumPy array over it), "
     "lives. The caller vouches that the memory stays mapped while keep lives, and is writable unless readonly. "
     "ValueError: nbytes < 0, or a NULL address with nbytes > 0; BufferError: a writable buffer asked of a "
     "read-only span."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "dmabuf_interop._atomic",
    .m_doc = "Acquire/release and seq_cst u64 loads and stores on shared memory, and Mapping (mmap with "
             "MADV_DONTFORK), for the channel's shared-memory ring; span, a buffer that holds a received array's "
             "owners.",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC
PyInit__atomic(void)
{
    if (PyType_Ready(&MappingType) < 0 || PyType_Ready(&SpanType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    Py_INCREF(&MappingType);
    if (PyModule_AddObject(m, "Mapping", (PyObject *)&MappingType) < 0) {
        Py_DECREF(&MappingType);
        Py_DECREF(m);
        return NULL;
    }
    BadSlot = PyErr_NewExceptionWithDoc("dmabuf_interop._atomic.BadSlot",
                                        "A ring slot that failed read_slot's checks; args[0]: its copied fields "
                                        "(seq, sock_seq, lease, layout, code, has_event, event).",
                                        PyExc_ValueError, NULL);
    if (BadSlot == NULL || PyModule_AddObject(m, "BadSlot", Py_NewRef(BadSlot)) < 0
        || PyModule_AddStringConstant(m, "SLOT_FORMAT", "<QQQIBB2x64s") < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
