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
 *   address(obj) -> int               the address of a buffer exporter's first element (a NumPy array's data)
 *   Mapping(fd, size, writable)       mmap(MAP_SHARED) + madvise(MADV_DONTFORK), a buffer; close() munmaps,
 *                                     and only in the process that mapped it
 *   SlotReader, SlotWriter            a message ring's reading and writing cursors: peek, spin_peek, take;
 *                                     push (one C call each; see their section)
 *   span(address, nbytes, keep, readonly=False, ref=None)  a buffer over memory the caller vouches for, holding
 *                                     keep (a received array's owners) for as long as it or any export of it lives,
 *                                     and calling ref.release() once as it goes (a reference taken for it)
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
#include <pthread.h>
#include <stdint.h>
#include <string.h>
#include <sys/socket.h>
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

static inline void
cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
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
 * The cursors below (SlotReader, SlotWriter) code and check it; tests compare their coding with the struct's. */
#define SLOT_SIZE 96
#define EVENT_SIZE 64
#define N_ORDERINGS 3      /* "sync", "event", "none": ORDERINGS, by code */
#define EVENT_CODE 1
#define NONE_CODE 2        /* "none": a host array's */
#define LEASE_LIMIT (1ULL << 53)

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
    PyObject *ref;  /* an object whose release() is called once as the span goes (a reference taken for it), or NULL */
} Span;

/* Let go of the span's reference: ref.release(), once (what it raises is reported, not raised: a span goes from a
 * dealloc or the garbage collector). */
static void
span_let_go(Span *self)
{
    PyObject *ref = self->ref;
    if (ref == NULL)
        return;
    self->ref = NULL;
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyObject *got = PyObject_CallMethod(ref, "release", NULL);
    if (got == NULL)
        PyErr_WriteUnraisable(ref);
    Py_XDECREF(got);
    PyErr_Restore(type, value, tb);
    Py_DECREF(ref);
}

static PyTypeObject SpanType;

static int
span_traverse(Span *self, visitproc visit, void *arg)
{
    Py_VISIT(self->keep);
    Py_VISIT(self->ref);
    return 0;
}

static int
span_clear(Span *self)
{
    span_let_go(self);
    Py_CLEAR(self->keep);
    return 0;
}

static void
span_dealloc(Span *self)
{
    PyObject_GC_UnTrack(self);
    span_let_go(self);
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
    if (nargs < 3 || nargs > 5) {
        PyErr_SetString(PyExc_TypeError, "span(address, nbytes, keep, readonly=False, ref=None) takes 3 to 5 "
                                         "arguments");
        return NULL;
    }
    int readonly = 0;
    if (nargs >= 4 && (readonly = PyObject_IsTrue(args[3])) < 0)
        return NULL;
    PyObject *ref = nargs == 5 && args[4] != Py_None ? args[4] : NULL;
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
    self->ref = Py_XNewRef(ref);
    PyObject_GC_Track(self);
    return (PyObject *)self;
}

/* --- SlotReader, SlotWriter: the message ring's cursors ---------------------------------------------------
 *
 * A ring's hot state (this end's head or tail, what it last saw of the peer's counters, the slot peeked and not
 * yet taken) in one C object per direction, with the regions' buffers held for the object's life: a consumer's
 * look at the ring, its take and a producer's publish are each one C call with no Python frame between the
 * channel and the shared memory (load-bearing: the hand-off is a chain of such steps, and each Python step of it
 * costs a process just woken two to three times its warm cost). The checks are Note [the peer's region]'s, with
 * its messages (channel/_ring.py); a failed one raises the ProtocolError class given at construction and
 * changes nothing. Fork: a child's copy refuses every call (the regions are MADV_DONTFORK, absent there),
 * raising what the `forked` callable given at construction returns; close() lets the buffers go (the mappings
 * can then be closed), after which a call raises ValueError. */

static unsigned long fork_generation;  /* bumped in a child of fork(): a cursor made before refuses to act */

static void
after_fork_child(void)
{
    fork_generation++;
}

typedef struct {
    Py_buffer mine, peer;   /* held while open */
    int open;
    unsigned long generation;
    uint64_t slots, mask;   /* the ring this cursor reads or writes: its length */
    Py_ssize_t slots_off, slot_bytes, out_tail_off, in_head_off, asleep_off;
    PyObject *protocol_error, *forked;
} CursorBase;

/* The regions, the ring's layout (slots_offset, slot_bytes, out_tail, in_head, asleep) and the errors
 * (ProtocolError class, forked callable): checked and taken. ring_in_peer: the ring lies in the peer's region
 * (a reader) or in this end's (a writer). */
static int
cursor_init(CursorBase *c, PyObject *mine, PyObject *peer, PyObject *slots_obj, PyObject *layout,
            PyObject *protocol_error, PyObject *forked, int ring_in_peer)
{
    Py_ssize_t slots = PyLong_AsSsize_t(slots_obj);
    if (slots == -1 && PyErr_Occurred())
        return -1;
    if (slots <= 0 || (slots & (slots - 1)) != 0) {
        PyErr_SetString(PyExc_ValueError, "a ring's slots must be a power of two");
        return -1;
    }
    Py_ssize_t f[5];
    if (!PyTuple_Check(layout) || PyTuple_GET_SIZE(layout) != 5) {
        PyErr_SetString(PyExc_TypeError, "layout must be (slots_offset, slot_bytes, out_tail, in_head, asleep)");
        return -1;
    }
    for (int i = 0; i < 5; i++) {
        f[i] = PyLong_AsSsize_t(PyTuple_GET_ITEM(layout, i));
        if (f[i] == -1 && PyErr_Occurred())
            return -1;
        if (f[i] < 0 || f[i] > PY_SSIZE_T_MAX - 8 || (f[i] & 7) != 0) {
            PyErr_SetString(PyExc_ValueError, "a ring layout's offsets are 8-byte aligned, >= 0 and in range");
            return -1;
        }
    }
    if (f[1] < SLOT_SIZE || !PyCallable_Check(forked) || !PyExceptionClass_Check(protocol_error)) {
        PyErr_SetString(PyExc_ValueError, "slot_bytes below a slot's size, forked not callable, or protocol_error "
                                          "not an exception class");
        return -1;
    }
    if (PyObject_GetBuffer(mine, &c->mine, PyBUF_WRITABLE) < 0)
        return -1;
    if (PyObject_GetBuffer(peer, &c->peer, PyBUF_SIMPLE) < 0) {
        PyBuffer_Release(&c->mine);
        return -1;
    }
    Py_ssize_t ring_len = ring_in_peer ? c->peer.len : c->mine.len;
    Py_ssize_t counters = f[2] > f[3] ? f[2] : f[3];
    counters = counters > f[4] ? counters : f[4];
    if (slots > (PY_SSIZE_T_MAX - f[0]) / f[1] || f[0] + slots * f[1] > ring_len || c->mine.len < 8
        || c->peer.len < 8 || counters > c->mine.len - 8 || counters > c->peer.len - 8
        || ((uintptr_t)c->mine.buf & 7) || ((uintptr_t)c->peer.buf & 7)) {
        PyBuffer_Release(&c->peer);
        PyBuffer_Release(&c->mine);
        PyErr_SetString(PyExc_ValueError, "the ring does not fit its region");
        return -1;
    }
    c->slots = (uint64_t)slots;
    c->mask = (uint64_t)slots - 1;
    c->slots_off = f[0];
    c->slot_bytes = f[1];
    c->out_tail_off = f[2];
    c->in_head_off = f[3];
    c->asleep_off = f[4];
    c->protocol_error = Py_NewRef(protocol_error);
    c->forked = Py_NewRef(forked);
    c->generation = fork_generation;
    c->open = 1;
    return 0;
}

/* Raise exc, an exception instance a factory made (NULL: its error stays set); TypeError where it is none. */
static void
raise_made(PyObject *exc, const char *factory)
{
    if (exc == NULL)
        return;
    if (PyExceptionInstance_Check(exc))
        PyErr_SetObject((PyObject *)Py_TYPE(exc), exc);
    else
        PyErr_Format(PyExc_TypeError, "the ring cursor's %s() returned %R, not an exception", factory, exc);
    Py_DECREF(exc);
}

/* 0: usable; -1 with the error set. */
static int
cursor_check(CursorBase *c)
{
    if (c->generation != fork_generation) {
        raise_made(PyObject_CallNoArgs(c->forked), "forked");
        return -1;
    }
    if (!c->open) {
        PyErr_SetString(PyExc_ValueError, "the ring cursor is closed");
        return -1;
    }
    return 0;
}

static void
cursor_release(CursorBase *c)
{
    if (c->open) {
        c->open = 0;
        PyBuffer_Release(&c->peer);
        PyBuffer_Release(&c->mine);
    }
}

static uint64_t *
u64p(Py_buffer *b, Py_ssize_t off)
{
    return (uint64_t *)((char *)b->buf + off);
}

typedef struct {
    PyObject_HEAD
    CursorBase c;
    uint64_t head, seen_tail, last_sock_seq;
    PyObject *next;       /* the slot peeked and not taken: (sock_seq, lease, layout, ordering, event), or NULL */
    PyObject *orderings;  /* a tuple of 3 str */
    PyObject *invalid;    /* the error class of a take() with nothing published */
} SlotReader;

static int
reader_traverse(SlotReader *self, visitproc visit, void *arg)
{
    if (self->c.open) {
        Py_VISIT(self->c.mine.obj);
        Py_VISIT(self->c.peer.obj);
    }
    Py_VISIT(self->next);
    Py_VISIT(self->orderings);
    Py_VISIT(self->invalid);
    Py_VISIT(self->c.protocol_error);
    Py_VISIT(self->c.forked);
    return 0;
}

static int
reader_clear(SlotReader *self)
{
    cursor_release(&self->c);  /* (closed from here: no call reaches what is cleared below) */
    Py_CLEAR(self->next);
    Py_CLEAR(self->orderings);
    Py_CLEAR(self->invalid);
    Py_CLEAR(self->c.protocol_error);
    Py_CLEAR(self->c.forked);
    return 0;
}

static void
reader_dealloc(SlotReader *self)
{
    PyObject_GC_UnTrack(self);
    cursor_release(&self->c);
    reader_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *
reader_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"peer", "mine", "slots", "layout", "orderings", "protocol_error", "invalid", "forked",
                             NULL};
    PyObject *peer, *mine, *slots, *layout, *orderings, *perr, *invalid, *forked;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOOOOOOO:SlotReader", kwlist, &peer, &mine, &slots, &layout,
                                     &orderings, &perr, &invalid, &forked))
        return NULL;
    if (!PyTuple_Check(orderings) || PyTuple_GET_SIZE(orderings) != N_ORDERINGS || !PyExceptionClass_Check(invalid)) {
        PyErr_SetString(PyExc_TypeError, "SlotReader: orderings must be a tuple of 3, invalid an exception class");
        return NULL;
    }
    SlotReader *self = (SlotReader *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    if (cursor_init(&self->c, mine, peer, slots, layout, perr, forked, 1) < 0) {
        Py_DECREF(self);
        return NULL;
    }
    self->orderings = Py_NewRef(orderings);
    self->invalid = Py_NewRef(invalid);
    return (PyObject *)self;
}

/* The next published slot into self->next, copied once and checked (Note [the peer's region]): 1 when there is
 * one, 0 when none is published, -1 with a ProtocolError set (nothing changed but seen_tail, as it was loaded). */
static int
reader_fill(SlotReader *self)
{
    if (self->next != NULL)
        return 1;
    CursorBase *c = &self->c;
    uint64_t head = self->head;
    if (head == self->seen_tail) {
        uint64_t tail = __atomic_load_n(u64p(&c->peer, c->out_tail_off), __ATOMIC_ACQUIRE);
        if (tail == head)
            return 0;
        if (!(head < tail && tail - head <= c->slots)) {
            PyErr_Format(c->protocol_error, "ring: the peer's out_tail %llu is outside (%llu, %llu]",
                         (unsigned long long)tail, (unsigned long long)head, (unsigned long long)(head + c->slots));
            return -1;
        }
        self->seen_tail = tail;
    }
    unsigned char s[SLOT_SIZE];
    memcpy(s, (char *)c->peer.buf + c->slots_off + (Py_ssize_t)(head & c->mask) * c->slot_bytes, SLOT_SIZE);
    /* The one read of the peer's slot: a compiler barrier, so that every field below is the copy's, never read
     * again from the shared memory (which the peer may be rewriting). */
    __asm__ __volatile__("" ::: "memory");
    uint64_t seq = u64_at(s, 0), sock_seq = u64_at(s, 8), lease = u64_at(s, 16);
    uint32_t layout;
    memcpy(&layout, s + 24, 4);
    unsigned code = s[28], has_event = s[29];
    unsigned long long h = (unsigned long long)head;
    if (seq != head + 1) {
        PyErr_Format(c->protocol_error, "ring: slot %llu has seq %llu, not %llu", h, (unsigned long long)seq, h + 1);
        return -1;
    }
    if (sock_seq < self->last_sock_seq) {
        PyErr_Format(c->protocol_error, "ring: slot %llu has sock_seq %llu, before the last slot's %llu", h,
                     (unsigned long long)sock_seq, (unsigned long long)self->last_sock_seq);
        return -1;
    }
    if (lease == 0 || lease >= LEASE_LIMIT) {
        PyErr_Format(c->protocol_error, "ring: slot %llu has lease %llu, outside [1, 2**53)", h,
                     (unsigned long long)lease);
        return -1;
    }
    if (code >= N_ORDERINGS || has_event != (code == EVENT_CODE)) {
        PyErr_Format(c->protocol_error, "ring: slot %llu has ordering %u and has_event %u", h, code, has_event);
        return -1;
    }
    PyObject *event = has_event ? PyBytes_FromStringAndSize((const char *)s + 32, EVENT_SIZE) : Py_NewRef(Py_None);
    if (event == NULL)
        return -1;
    PyObject *out = PyTuple_New(5);
    if (out == NULL) {
        Py_DECREF(event);
        return -1;
    }
    PyTuple_SET_ITEM(out, 4, event);  /* (from here, out owns what it holds: one DECREF undoes it all) */
    PyObject *a = PyLong_FromUnsignedLongLong(sock_seq);
    PyObject *b = a ? PyLong_FromUnsignedLongLong(lease) : NULL;
    PyObject *d = b ? PyLong_FromUnsignedLong(layout) : NULL;
    if (d == NULL) {
        Py_XDECREF(a);
        Py_XDECREF(b);
        Py_DECREF(out);
        return -1;
    }
    PyTuple_SET_ITEM(out, 0, a);
    PyTuple_SET_ITEM(out, 1, b);
    PyTuple_SET_ITEM(out, 2, d);
    PyTuple_SET_ITEM(out, 3, Py_NewRef(PyTuple_GET_ITEM(self->orderings, code)));
    self->next = out;
    return 1;
}

static PyObject *
reader_peek(SlotReader *self, PyObject *unused)
{
    if (cursor_check(&self->c) < 0)
        return NULL;
    int got = reader_fill(self);
    if (got < 0)
        return NULL;
    if (got == 0)
        Py_RETURN_NONE;
    return Py_NewRef(PyTuple_GET_ITEM(self->next, 0));
}

static PyObject *
reader_spin_peek(SlotReader *self, PyObject *arg)
{
    Py_ssize_t loads = PyLong_AsSsize_t(arg);
    if (loads == -1 && PyErr_Occurred())
        return NULL;
    if (cursor_check(&self->c) < 0)
        return NULL;
    if (self->next == NULL && self->head == self->seen_tail) {
        uint64_t *t = u64p(&self->c.peer, self->c.out_tail_off);
        for (Py_ssize_t i = 1; i < loads && __atomic_load_n(t, __ATOMIC_ACQUIRE) == self->head; i++)
            cpu_relax();
    }
    int got = reader_fill(self);
    if (got < 0)
        return NULL;
    if (got == 0)
        Py_RETURN_NONE;
    return Py_NewRef(PyTuple_GET_ITEM(self->next, 0));
}

static PyObject *
reader_take(SlotReader *self, PyObject *unused)
{
    if (cursor_check(&self->c) < 0)
        return NULL;
    int got = reader_fill(self);
    if (got < 0)
        return NULL;
    if (got == 0) {
        PyErr_SetString(self->invalid, "ring: take() with no slot published");
        return NULL;
    }
    PyObject *slot = self->next;  /* (the reference passes to the caller) */
    self->next = NULL;
    self->last_sock_seq = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(slot, 0));
    self->head++;
    /* release: this end's copy is done before the peer may reuse the slot */
    __atomic_store_n(u64p(&self->c.mine, self->c.in_head_off), self->head, __ATOMIC_RELEASE);
    return slot;
}

static PyObject *
reader_close(SlotReader *self, PyObject *unused)
{
    cursor_release(&self->c);
    Py_CLEAR(self->next);
    Py_RETURN_NONE;
}

static PyObject *
reader_head(SlotReader *self, void *unused)
{
    return PyLong_FromUnsignedLongLong(self->head);
}

static PyObject *
reader_seen_tail(SlotReader *self, void *unused)
{
    return PyLong_FromUnsignedLongLong(self->seen_tail);
}

static PyObject *
reader_last_sock_seq(SlotReader *self, void *unused)
{
    return PyLong_FromUnsignedLongLong(self->last_sock_seq);
}

static PyObject *
reader_pending(SlotReader *self, void *unused)
{
    return PyBool_FromLong(self->next != NULL);
}

static PyMethodDef reader_methods[] = {
    {"peek", (PyCFunction)reader_peek, METH_NOARGS,
     "peek() -> int | None: the sock_seq of the next published slot (copied out once and checked, kept for "
     "take()), or None when none is published. ProtocolError: the peer's out_tail or the slot breaks the ring."},
    {"spin_peek", (PyCFunction)reader_spin_peek, METH_O,
     "spin_peek(loads) -> int | None: peek(), after up to loads looks at the peer's out_tail (a CPU pause "
     "between two) while nothing is published. The GIL stays held: keep loads to a few microseconds' worth."},
    {"take", (PyCFunction)reader_take, METH_NOARGS,
     "take() -> (sock_seq, lease, layout, ordering, event or None): the slot peek() found (peeked now if none "
     "was), consumed: the head moves on and is release-stored as in_head. The invalid class given: none is "
     "published; ProtocolError: as peek()."},
    {"close", (PyCFunction)reader_close, METH_NOARGS, "Let the regions' buffers go; later calls raise ValueError."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef reader_getset[] = {
    {"head", (getter)reader_head, NULL, "Slots of the peer's taken (this end's in_head).", NULL},
    {"seen_tail", (getter)reader_seen_tail, NULL, "The peer's out_tail, as last loaded.", NULL},
    {"last_sock_seq", (getter)reader_last_sock_seq, NULL, "The sock_seq of the last slot taken.", NULL},
    {"pending", (getter)reader_pending, NULL, "Whether a slot was peeked and not taken.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject SlotReaderType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "dmabuf_interop._atomic.SlotReader",
    .tp_doc = "SlotReader(peer, mine, slots, layout, orderings, protocol_error, invalid, forked): the reading cursor of "
              "the peer's message ring (its region peer, read-only; this end's in_head in mine).",
    .tp_basicsize = sizeof(SlotReader),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_new = reader_new,
    .tp_dealloc = (destructor)reader_dealloc,
    .tp_traverse = (traverseproc)reader_traverse,
    .tp_clear = (inquiry)reader_clear,
    .tp_methods = reader_methods,
    .tp_getset = reader_getset,
};

typedef struct {
    PyObject_HEAD
    CursorBase c;
    uint64_t tail, peer_head;
    int wake_fd;              /* the peer's wake socket (a datagram socket; not owned: the Rings' _Held owns it) */
    PyObject *wake_failed;    /* wake_failed(errno) -> the exception of a failed wake-up send */
} SlotWriter;

static int
writer_traverse(SlotWriter *self, visitproc visit, void *arg)
{
    if (self->c.open) {
        Py_VISIT(self->c.mine.obj);
        Py_VISIT(self->c.peer.obj);
    }
    Py_VISIT(self->c.protocol_error);
    Py_VISIT(self->c.forked);
    Py_VISIT(self->wake_failed);
    return 0;
}

static int
writer_clear(SlotWriter *self)
{
    cursor_release(&self->c);  /* (closed from here: no call reaches what is cleared below) */
    Py_CLEAR(self->c.protocol_error);
    Py_CLEAR(self->c.forked);
    Py_CLEAR(self->wake_failed);
    return 0;
}

static void
writer_dealloc(SlotWriter *self)
{
    PyObject_GC_UnTrack(self);
    cursor_release(&self->c);
    writer_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *
writer_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"mine", "peer", "slots", "layout", "protocol_error", "forked", "wake_fd", "wake_failed",
                             NULL};
    PyObject *peer, *mine, *slots, *layout, *perr, *forked, *wake_failed;
    int wake_fd;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOOOOOiO:SlotWriter", kwlist, &mine, &peer, &slots, &layout,
                                     &perr, &forked, &wake_fd, &wake_failed))
        return NULL;
    if (wake_fd < 0 || !PyCallable_Check(wake_failed)) {
        PyErr_SetString(PyExc_ValueError, "SlotWriter: wake_fd must be an fd, wake_failed callable");
        return NULL;
    }
    SlotWriter *self = (SlotWriter *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    if (cursor_init(&self->c, mine, peer, slots, layout, perr, forked, 0) < 0) {
        Py_DECREF(self);
        return NULL;
    }
    self->wake_fd = wake_fd;
    self->wake_failed = Py_NewRef(wake_failed);
    return (PyObject *)self;
}

/* Wake the peer: one byte to its wake socket, never waiting (Note [the wake fd], channel/_ring_region.py). A full
 * socket holds wake-ups already; a peer's end that went (ECONNREFUSED, then ENOTCONN; ECONNRESET, EPIPE) is seen
 * as the channel socket's hang-up. 0, or -1 with
 * the error wake_failed(errno) returns set. */
static int
writer_wake(SlotWriter *self)
{
    ssize_t n;
    do {
        n = send(self->wake_fd, "\1", 1, MSG_DONTWAIT | MSG_NOSIGNAL);
    } while (n < 0 && errno == EINTR);
    if (n >= 0 || errno == EAGAIN || errno == EWOULDBLOCK || errno == ECONNRESET || errno == ECONNREFUSED
        || errno == ENOTCONN || errno == EPIPE)
        return 0;
    raise_made(PyObject_CallFunction(self->wake_failed, "i", errno), "wake_failed");
    return -1;
}

/* The push itself (fields checked by the caller): 1 published (the peer woken if it sleeps), 0 full, -1 error. */
static int
writer_publish(SlotWriter *self, uint64_t sock_seq, uint64_t lease, uint32_t layout, unsigned code,
               const unsigned char *event)
{
    CursorBase *c = &self->c;
    uint64_t tail = self->tail;
    if (tail - self->peer_head >= c->slots) {  /* the cached head says full: load the peer's (acquire) */
        uint64_t head = __atomic_load_n(u64p(&c->peer, c->in_head_off), __ATOMIC_ACQUIRE);
        if (head < self->peer_head || head > tail) {
            PyErr_Format(c->protocol_error, "ring: the peer's in_head %llu is outside [%llu, %llu]",
                         (unsigned long long)head, (unsigned long long)self->peer_head, (unsigned long long)tail);
            return -1;
        }
        self->peer_head = head;
        if (tail - head >= c->slots)
            return 0;
    }
    unsigned char s[SLOT_SIZE];
    memset(s, 0, SLOT_SIZE);
    if (event != NULL) {
        memcpy(s + 32, event, EVENT_SIZE);
        s[29] = 1;
    }
    uint64_t seq = tail + 1;
    memcpy(s + 8, &sock_seq, 8);
    memcpy(s + 16, &lease, 8);
    memcpy(s + 24, &layout, 4);
    s[28] = (unsigned char)code;
    uint64_t *p = u64p(&c->mine, c->slots_off + (Py_ssize_t)(tail & c->mask) * c->slot_bytes);
    memcpy((char *)p + 8, s + 8, SLOT_SIZE - 8);
    __atomic_store_n(p, seq, __ATOMIC_RELEASE);
    __atomic_store_n(u64p(&c->mine, c->out_tail_off), seq, __ATOMIC_SEQ_CST);
    uint64_t asleep = __atomic_load_n(u64p(&c->peer, c->asleep_off), __ATOMIC_SEQ_CST);
    self->tail = seq;
    if (asleep && writer_wake(self) < 0)
        return -1;  /* (published all the same: the tail counts it) */
    return 1;
}

/* push(sock_seq, lease, layout, code, event) -> bool: write and publish the next slot of this end's ring (its
 * body, then seq release-stored; then the tail and the peer's asleep, seq_cst both: the Dekker step), and wake
 * the peer if it sleeps. False: the ring is full, nothing written. Checked before anything is written:
 * ValueError for a lease outside [1, 2**53), a code >= 3, an event not 64 bytes or given exactly when code is not
 * EVENT_CODE; OverflowError for a value past its field; ProtocolError for the peer's in_head out of [its last
 * value, this end's tail]; a failed wake-up send raises what wake_failed(errno) gives (the slot is out). */
static PyObject *
writer_push(SlotWriter *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (!nargs_ok(nargs, 5, "push"))
        return NULL;
    if (cursor_check(&self->c) < 0)
        return NULL;
    unsigned long long sock_seq, lease, layout, code;
    if (u64_arg(args[0], &sock_seq) < 0 || u64_arg(args[1], &lease) < 0 || u64_arg(args[2], &layout) < 0
        || u64_arg(args[3], &code) < 0)
        return NULL;
    if (layout > UINT32_MAX) {
        PyErr_SetString(PyExc_OverflowError, "push: layout does not fit a u32");
        return NULL;
    }
    PyObject *event = args[4];
    if (lease == 0 || lease >= LEASE_LIMIT || code >= N_ORDERINGS || (event != Py_None) != (code == EVENT_CODE)) {
        PyErr_SetString(PyExc_ValueError, "push: lease, ordering or event out of the slot's range");
        return NULL;
    }
    unsigned char ev[EVENT_SIZE];
    if (event != Py_None) {
        Py_buffer view;
        if (PyObject_GetBuffer(event, &view, PyBUF_SIMPLE) < 0)
            return NULL;
        if (view.len != EVENT_SIZE) {
            PyBuffer_Release(&view);
            PyErr_SetString(PyExc_ValueError, "push: an event is 64 bytes");
            return NULL;
        }
        memcpy(ev, view.buf, EVENT_SIZE);
        PyBuffer_Release(&view);
    }
    int got = writer_publish(self, sock_seq, lease, (uint32_t)layout, (unsigned)code, event != Py_None ? ev : NULL);
    if (got < 0)
        return NULL;
    return PyBool_FromLong(got);
}

/* push_plain(sock_seq, lease, layout) -> bool: push() of a slot with ordering "none" (code 2) and no event, a
 * host array's repeat: the host lane's publish. */
static PyObject *
writer_push_plain(SlotWriter *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (!nargs_ok(nargs, 3, "push_plain"))
        return NULL;
    if (cursor_check(&self->c) < 0)
        return NULL;
    unsigned long long sock_seq, lease, layout;
    if (u64_arg(args[0], &sock_seq) < 0 || u64_arg(args[1], &lease) < 0 || u64_arg(args[2], &layout) < 0)
        return NULL;
    if (layout > UINT32_MAX) {
        PyErr_SetString(PyExc_OverflowError, "push_plain: layout does not fit a u32");
        return NULL;
    }
    if (lease == 0 || lease >= LEASE_LIMIT) {
        PyErr_SetString(PyExc_ValueError, "push_plain: lease outside [1, 2**53)");
        return NULL;
    }
    int got = writer_publish(self, sock_seq, lease, (uint32_t)layout, NONE_CODE, NULL);
    if (got < 0)
        return NULL;
    return PyBool_FromLong(got);
}

static PyObject *
writer_close(SlotWriter *self, PyObject *unused)
{
    cursor_release(&self->c);
    Py_RETURN_NONE;
}

static PyObject *
writer_tail(SlotWriter *self, void *unused)
{
    return PyLong_FromUnsignedLongLong(self->tail);
}

static PyObject *
writer_peer_head(SlotWriter *self, void *unused)
{
    return PyLong_FromUnsignedLongLong(self->peer_head);
}

static PyMethodDef writer_methods[] = {
    {"push", (PyCFunction)(void (*)(void))writer_push, METH_FASTCALL,
     "push(sock_seq, lease, layout, code, event) -> bool: publish the next slot and wake the peer if it sleeps "
     "(False: the ring is full, nothing written). ValueError, OverflowError: a field out of range, nothing "
     "written; ProtocolError: the peer's in_head out of range; what wake_failed(errno) gives: the wake-up's send "
     "failed (the slot is out)."},
    {"push_plain", (PyCFunction)(void (*)(void))writer_push_plain, METH_FASTCALL,
     "push_plain(sock_seq, lease, layout) -> bool: push() of a slot with ordering 'none' and no event."},
    {"close", (PyCFunction)writer_close, METH_NOARGS, "Let the regions' buffers go; later calls raise ValueError."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef writer_getset[] = {
    {"tail", (getter)writer_tail, NULL, "Slots published (this end's out_tail).", NULL},
    {"peer_head", (getter)writer_peer_head, NULL, "The peer's in_head, as last loaded.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject SlotWriterType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "dmabuf_interop._atomic.SlotWriter",
    .tp_doc = "SlotWriter(mine, peer, slots, layout, protocol_error, forked, wake_fd, wake_failed): the writing "
              "cursor of this end's message ring (its region mine; the peer's in_head and asleep in peer; wake_fd "
              "the peer's wake socket).",
    .tp_basicsize = sizeof(SlotWriter),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_new = writer_new,
    .tp_dealloc = (destructor)writer_dealloc,
    .tp_traverse = (traverseproc)writer_traverse,
    .tp_clear = (inquiry)writer_clear,
    .tp_methods = writer_methods,
    .tp_getset = writer_getset,
};

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
    {"address", (PyCFunction)address, METH_O,
     "address(obj) -> int: the address of the first element of a buffer exporter (PyBUF_STRIDES: strided "
     "buffers too), as NumPy's ndarray.ctypes.data; BufferError (or TypeError) where it exports none."},
    {"span", (PyCFunction)(void (*)(void))span, METH_FASTCALL,
     "span(address, nbytes, keep, readonly=False, ref=None) -> Span: a buffer of nbytes at address (an int), "
     "read-only or writable, that holds keep for as long as it, or a buffer exported from it (a NumPy array over "
     "it), lives, and calls ref.release() once as it goes (a reference the caller took for it; what that raises is "
     "reported as unraisable). The caller vouches that the memory stays mapped while keep lives, and is writable "
     "unless readonly. ValueError: nbytes < 0, or a NULL address with nbytes > 0; BufferError: a writable buffer "
     "asked of a read-only span."},
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
    if (PyType_Ready(&MappingType) < 0 || PyType_Ready(&SpanType) < 0 || PyType_Ready(&SlotReaderType) < 0
        || PyType_Ready(&SlotWriterType) < 0)
        return NULL;
    static int atfork_done;
    if (!atfork_done) {
        int err = pthread_atfork(NULL, NULL, after_fork_child);
        if (err != 0) {
            errno = err;
            return PyErr_SetFromErrnoWithFilename(PyExc_OSError, "pthread_atfork");
        }
        atfork_done = 1;
    }
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    Py_INCREF(&MappingType);
    if (PyModule_AddObject(m, "Mapping", (PyObject *)&MappingType) < 0) {
        Py_DECREF(&MappingType);
        Py_DECREF(m);
        return NULL;
    }
    if (PyModule_AddObject(m, "SlotReader", Py_NewRef((PyObject *)&SlotReaderType)) < 0
        || PyModule_AddObject(m, "SlotWriter", Py_NewRef((PyObject *)&SlotWriterType)) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    if (PyModule_AddStringConstant(m, "SLOT_FORMAT", "<QQQIBB2x64s") < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
