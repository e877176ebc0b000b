/* The compiled half of flodl's frame codec (flodl/wire/codec.py): optional, with the same bytes.
 *
 * A control frame is header (magic, version, kind, body length) + msgpack body + 16-byte tag, the
 * tag being keyed BLAKE2b-128 of header and body (proto/README.md). In Python a frame's tag and body
 * take a dozen C calls and as many allocations (copy the keyed state, slice, update, digest, compare,
 * slice, unpack, join); on the round trip each of them runs right after a wake-up, on cold caches,
 * where they cost several times what they cost in a loop. Here each direction is one call:
 *
 *   Writer(mac, sender, run_id, seqs, table).encode(msg) -> a FrameWriter's frame of msg: its fields
 *       checked as the Python writer checks them, numbered next(seqs), packed (byte for byte what
 *       msgpack.Packer(use_bin_type=True) writes) and signed; None when a field does not check (the
 *       Python path then raises the schema error), no number taken.
 *   seal(mac, kind, *values) -> the signed frame of values already checked (the generated _frame).
 *   Reader(mac, run_id, max_frame, windows, table).take(data, peer) -> a FrameReader's envelope of a
 *       sound frame: header, tag, body, envelope, field types, replay window, count, the reader's
 *       answer, message, in the Python reader's order; None for anything else, and the reader's
 *       Python path then takes it or names the drop. So this file only ever accepts a subset of what
 *       the Python codec accepts, with the same values, and never decides a drop.
 *   tag(mac, data) -> the 16-byte tag of data (tests).
 *   Mac(key): the BLAKE2b state after the key block (RFC 7693, section 3.3), computed once.
 *   Window(): codec.ReplayWindow's check as a plain bitmap (a Reader checks it in place).
 *
 * Nothing of the protocol is written here: codec.py hands it over at import (configure: the version,
 * the magic, the bounds, the replay window, the Envelope class), and each FrameWriter and FrameReader
 * hands its own state to its Writer and Reader when it is made (its keyed state, names, counter,
 * windows, and the tables: a kind's class, field names, one letter a field for the checks done here,
 * the Python validator of any other field). This file reads no attribute of theirs by name, so a
 * protocol bump (a new version, new bounds, new messages) never edits it. What is its own is the frame's
 * layout (a 10-byte header, a 16-byte BLAKE2b tag: configure refuses another) and ABI, the calling
 * convention codec.py checks before anything else (raise it with any change to the calls below).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#include <structmember.h>

#define ABI 2 /* the calls between codec.py and this file (codec.py's _FRAMEC_ABI); never the protocol */
#define TAG_LEN 16
#define HEADER_LEN 10

/* The protocol, as codec.py hands it over (configure): until then no frame is written or read here. */
static struct {
    int ready;
    unsigned version;  /* messages.PROTOCOL_VERSION */
    uint8_t magic[2];  /* codec.MAGIC */
    /* codec.py's MAX_STR, MAX_BIN, MAX_ARRAY, MAX_MAP, MAX_SENDER: a longer item goes to the Python path,
       which drops it as its msgpack bounds say */
    Py_ssize_t max_str, max_bin, max_array, max_map, max_sender;
    int max_nesting;        /* deeper bodies go to the Python path */
    Py_ssize_t window_bits; /* codec.REPLAY_WINDOW: a Window made from now on */
    PyObject *envelope;     /* codec.Envelope, the named tuple a Reader builds */
} P;

static int ready(void) {
    if (P.ready) return 1;
    PyErr_SetString(PyExc_RuntimeError, "flodl.wire._framec: configure() first (codec.py does, at import)");
    return 0;
}

/* ------------------------------------------------------------------ BLAKE2b */

static const uint64_t IV[8] = {
    0x6a09e667f3bcc908ULL, 0xbb67ae8584caa73bULL, 0x3c6ef372fe94f82bULL, 0xa54ff53a5f1d36f1ULL,
    0x510e527fade682d1ULL, 0x9b05688c2b3e6c1fULL, 0x1f83d9abfb41bd6bULL, 0x5be0cd19137e2179ULL};

static const uint8_t SIGMA[12][16] = {
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}, {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3},
    {11, 8, 12, 0, 5, 2, 15, 13, 10, 14, 3, 6, 7, 1, 9, 4}, {7, 9, 3, 1, 13, 12, 11, 14, 2, 6, 5, 10, 4, 0, 15, 8},
    {9, 0, 5, 7, 2, 4, 10, 15, 14, 1, 11, 12, 6, 8, 3, 13}, {2, 12, 6, 10, 0, 11, 8, 3, 4, 13, 7, 5, 15, 14, 1, 9},
    {12, 5, 1, 15, 14, 13, 4, 10, 0, 7, 6, 3, 9, 2, 8, 11}, {13, 11, 7, 14, 12, 1, 3, 9, 5, 0, 15, 4, 8, 6, 2, 10},
    {6, 15, 14, 9, 11, 3, 0, 8, 12, 2, 13, 7, 1, 4, 10, 5}, {10, 2, 8, 4, 7, 6, 1, 5, 15, 11, 9, 14, 3, 12, 13, 0},
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}, {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3}};

#define ROTR64(x, n) (((x) >> (n)) | ((x) << (64 - (n))))
#define G(a, b, c, d, x, y)            \
    do {                               \
        v[a] = v[a] + v[b] + (x);      \
        v[d] = ROTR64(v[d] ^ v[a], 32); \
        v[c] = v[c] + v[d];            \
        v[b] = ROTR64(v[b] ^ v[c], 24); \
        v[a] = v[a] + v[b] + (y);      \
        v[d] = ROTR64(v[d] ^ v[a], 16); \
        v[c] = v[c] + v[d];            \
        v[b] = ROTR64(v[b] ^ v[c], 63); \
    } while (0)

static inline uint64_t load_le64(const uint8_t *p) {
    uint64_t x = 0;
    for (int i = 7; i >= 0; i--) x = (x << 8) | p[i];
    return x;
}

static void compress(uint64_t h[8], const uint8_t block[128], uint64_t counter, int last) {
    uint64_t v[16], m[16];
    for (int i = 0; i < 16; i++) m[i] = load_le64(block + 8 * i);
    for (int i = 0; i < 8; i++) {
        v[i] = h[i];
        v[i + 8] = IV[i];
    }
    v[12] ^= counter; /* frames are far below 2^64 bytes: the counter's high word stays 0 */
    if (last) v[14] = ~v[14];
    for (int r = 0; r < 12; r++) {
        const uint8_t *s = SIGMA[r];
        G(0, 4, 8, 12, m[s[0]], m[s[1]]);
        G(1, 5, 9, 13, m[s[2]], m[s[3]]);
        G(2, 6, 10, 14, m[s[4]], m[s[5]]);
        G(3, 7, 11, 15, m[s[6]], m[s[7]]);
        G(0, 5, 10, 15, m[s[8]], m[s[9]]);
        G(1, 6, 11, 12, m[s[10]], m[s[11]]);
        G(2, 7, 8, 13, m[s[12]], m[s[13]]);
        G(3, 4, 9, 14, m[s[14]], m[s[15]]);
    }
    for (int i = 0; i < 8; i++) h[i] ^= v[i] ^ v[i + 8];
}

/* The tag of data[0:n] (n >= 1: a message after the key block), from the keyed state. */
static void tag_of(const uint64_t keyed[8], const uint8_t *data, Py_ssize_t n, uint8_t out[TAG_LEN]) {
    uint64_t h[8];
    memcpy(h, keyed, sizeof h);
    uint64_t counter = 128; /* the key block */
    while (n > 128) {
        counter += 128;
        compress(h, data, counter, 0);
        data += 128;
        n -= 128;
    }
    uint8_t block[128] = {0};
    memcpy(block, data, (size_t)n);
    counter += (uint64_t)n;
    compress(h, block, counter, 1);
    for (int i = 0; i < TAG_LEN; i++) out[i] = (uint8_t)(h[i / 8] >> (8 * (i % 8)));
}

typedef struct {
    PyObject_HEAD uint64_t keyed[8];
} MacObject;

static int Mac_init(MacObject *self, PyObject *args, PyObject *kwargs) {
    Py_buffer key;
    if (kwargs != NULL && PyDict_GET_SIZE(kwargs)) {
        PyErr_SetString(PyExc_TypeError, "Mac(key) takes no keyword arguments");
        return -1;
    }
    if (!PyArg_ParseTuple(args, "y*", &key)) return -1;
    if (key.len < 1 || key.len > 64) {
        PyBuffer_Release(&key);
        PyErr_SetString(PyExc_ValueError, "a BLAKE2b key is 1 to 64 bytes");
        return -1;
    }
    uint8_t block[128] = {0};
    memcpy(block, key.buf, (size_t)key.len);
    for (int i = 0; i < 8; i++) self->keyed[i] = IV[i];
    self->keyed[0] ^= 0x01010000ULL ^ ((uint64_t)key.len << 8) ^ (uint64_t)TAG_LEN;
    compress(self->keyed, block, 128, 0);
    PyBuffer_Release(&key);
    return 0;
}

static PyTypeObject MacType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "flodl.wire._framec.Mac",
    .tp_doc = "Keyed BLAKE2b-128: the state after the key block, for tag, seal, encode and take.",
    .tp_basicsize = sizeof(MacObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Mac_init,
};

/* ----------------------------------------------------------- replay window */

/* codec.py's ReplayWindow as a plain bitmap of REPLAY_WINDOW bits (as configured when it was made): bit i
   of `seen` is number top - i. The Python class keeps its bitmap lazily (a 1024-bit int shifted only when a
   frame comes out of order); here a shift is 16 words, cheaper than the lazy bookkeeping, and a sender
   whose numbers skip (one counter for many peers, as the controller's) costs no more than one in order. */
typedef struct {
    PyObject_VAR_HEAD unsigned long long top;
    uint64_t seen[1]; /* Py_SIZE words */
} WindowObject;

/* 1: first time seen within the window (newest if seq > top before), 0: seen or too old */
static int window_accept(WindowObject *w, uint64_t seq) {
    const Py_ssize_t words_n = Py_SIZE(w);
    const uint64_t window_bits = (uint64_t)words_n * 64;
    if (seq > w->top) {
        uint64_t shift = seq - w->top;
        if (shift >= window_bits) memset(w->seen, 0, (size_t)words_n * sizeof(uint64_t));
        else {
            int words = (int)(shift / 64), bits = (int)(shift % 64);
            for (int i = (int)words_n - 1; i >= 0; i--) {
                uint64_t hi = i - words >= 0 ? w->seen[i - words] : 0;
                uint64_t lo = i - words - 1 >= 0 ? w->seen[i - words - 1] : 0;
                w->seen[i] = bits ? (hi << bits) | (lo >> (64 - bits)) : hi;
            }
        }
        w->seen[0] |= 1;
        w->top = seq;
        return 1;
    }
    uint64_t offset = w->top - seq;
    if (offset >= window_bits || (w->seen[offset / 64] >> (offset % 64) & 1)) return 0;
    w->seen[offset / 64] |= (uint64_t)1 << (offset % 64);
    return 1;
}

static PyObject *Window_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    if (PyTuple_GET_SIZE(args) || (kwargs != NULL && PyDict_GET_SIZE(kwargs))) {
        PyErr_SetString(PyExc_TypeError, "Window() takes no arguments");
        return NULL;
    }
    if (!ready()) return NULL;
    return type->tp_alloc(type, P.window_bits / 64); /* zeroed: top 0, nothing seen */
}

static PyObject *Window_accept(WindowObject *self, PyObject *arg) {
    unsigned long long seq = PyLong_AsUnsignedLongLong(arg);
    if (seq == (unsigned long long)-1 && PyErr_Occurred()) return NULL;
    return PyBool_FromLong(window_accept(self, seq));
}

static PyMethodDef Window_methods[] = {
    {"accept", (PyCFunction)Window_accept, METH_O, "True the first time seq is seen within the window"}, {NULL, NULL, 0, NULL}};

static PyMemberDef Window_members[] = {{"top", T_ULONGLONG, offsetof(WindowObject, top), READONLY, "the highest number seen"},
                                       {NULL, 0, 0, 0, NULL}};

static PyTypeObject WindowType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "flodl.wire._framec.Window",
    .tp_doc = "codec.ReplayWindow's check, compiled: accepts each sequence number of one sender at most once.",
    .tp_basicsize = offsetof(WindowObject, seen),
    .tp_itemsize = sizeof(uint64_t),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = Window_new,
    .tp_methods = Window_methods,
    .tp_members = Window_members,
};

/* ---------------------------------------------------------------- packing */

typedef struct {
    uint8_t *buf;
    Py_ssize_t len, cap;
    uint8_t local[512]; /* control frames fit; larger ones grow on the heap */
} Out;

static int out_reserve(Out *o, Py_ssize_t more) {
    if (o->len + more <= o->cap) return 0;
    Py_ssize_t cap = o->cap * 2;
    while (cap < o->len + more) cap *= 2;
    uint8_t *buf = PyMem_Malloc((size_t)cap);
    if (buf == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    memcpy(buf, o->buf, (size_t)o->len);
    if (o->buf != o->local) PyMem_Free(o->buf);
    o->buf = buf;
    o->cap = cap;
    return 0;
}

static int put(Out *o, const void *p, Py_ssize_t n) {
    if (out_reserve(o, n) < 0) return -1;
    memcpy(o->buf + o->len, p, (size_t)n);
    o->len += n;
    return 0;
}

/* a type byte followed by a big-endian number of width bytes */
static int put_be(Out *o, uint8_t type, uint64_t x, int width) {
    uint8_t b[9];
    b[0] = type;
    for (int i = 0; i < width; i++) b[1 + i] = (uint8_t)(x >> (8 * (width - 1 - i)));
    return put(o, b, 1 + width);
}

static int put_length(Out *o, Py_ssize_t n, uint8_t fix_base, Py_ssize_t fix_limit, uint8_t t8, uint8_t t16, uint8_t t32) {
    if (n < fix_limit) {
        uint8_t b = (uint8_t)(fix_base | n);
        return put(o, &b, 1);
    }
    if (t8 && n < 256) return put_be(o, t8, (uint64_t)n, 1);
    if (n < 65536) return put_be(o, t16, (uint64_t)n, 2);
    if ((uint64_t)n <= 0xffffffffULL) return put_be(o, t32, (uint64_t)n, 4);
    PyErr_SetString(PyExc_ValueError, "msgpack: item too large");
    return -1;
}

static int pack(Out *o, PyObject *x, int depth);

static int pack_int(Out *o, PyObject *x) {
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(x, &overflow);
    if (overflow > 0) { /* 2^63 .. 2^64-1 */
        unsigned long long u = PyLong_AsUnsignedLongLong(x);
        if (u == (unsigned long long)-1 && PyErr_Occurred()) return -1;
        return put_be(o, 0xcf, u, 8);
    }
    if (overflow < 0 || (v == -1 && PyErr_Occurred())) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_OverflowError, "int too big to pack");
        return -1;
    }
    /* the smallest form, as msgpack's Packer chooses it */
    if (v >= 0) {
        if (v < 0x80) {
            uint8_t b = (uint8_t)v;
            return put(o, &b, 1);
        }
        if (v < 0x100) return put_be(o, 0xcc, (uint64_t)v, 1);
        if (v < 0x10000) return put_be(o, 0xcd, (uint64_t)v, 2);
        if (v < 0x100000000LL) return put_be(o, 0xce, (uint64_t)v, 4);
        return put_be(o, 0xcf, (uint64_t)v, 8);
    }
    if (v >= -32) {
        uint8_t b = (uint8_t)(int8_t)v;
        return put(o, &b, 1);
    }
    if (v >= -0x80) return put_be(o, 0xd0, (uint64_t)(uint8_t)(int8_t)v, 1);
    if (v >= -0x8000) return put_be(o, 0xd1, (uint64_t)(uint16_t)(int16_t)v, 2);
    if (v >= -0x80000000LL) return put_be(o, 0xd2, (uint64_t)(uint32_t)(int32_t)v, 4);
    return put_be(o, 0xd3, (uint64_t)v, 8);
}

static int pack_str(Out *o, PyObject *x) {
    Py_ssize_t n;
    const char *s = PyUnicode_AsUTF8AndSize(x, &n);
    if (s == NULL) return -1;
    if (put_length(o, n, 0xa0, 32, 0xd9, 0xda, 0xdb) < 0) return -1;
    return put(o, s, n);
}

static int pack(Out *o, PyObject *x, int depth) {
    if (depth > 512) {
        PyErr_SetString(PyExc_ValueError, "msgpack: nested too deep");
        return -1;
    }
    if (x == Py_None) return put(o, "\xc0", 1);
    if (x == Py_True) return put(o, "\xc3", 1);
    if (x == Py_False) return put(o, "\xc2", 1);
    if (PyLong_CheckExact(x)) return pack_int(o, x);
    if (PyFloat_CheckExact(x)) {
        double d = PyFloat_AS_DOUBLE(x);
        uint64_t bits;
        memcpy(&bits, &d, 8);
        return put_be(o, 0xcb, bits, 8);
    }
    if (PyUnicode_CheckExact(x)) return pack_str(o, x);
    if (PyBytes_CheckExact(x)) {
        Py_ssize_t n = PyBytes_GET_SIZE(x);
        if (put_length(o, n, 0, 0, 0xc4, 0xc5, 0xc6) < 0) return -1;
        return put(o, PyBytes_AS_STRING(x), n);
    }
    if (PyList_CheckExact(x) || PyTuple_CheckExact(x)) {
        Py_ssize_t n = PySequence_Fast_GET_SIZE(x);
        if (put_length(o, n, 0x90, 16, 0, 0xdc, 0xdd) < 0) return -1;
        for (Py_ssize_t i = 0; i < n; i++) /* a list validated by the caller is not changed while we pack */
            if (pack(o, PySequence_Fast_GET_ITEM(x, i), depth + 1) < 0) return -1;
        return 0;
    }
    if (PyDict_CheckExact(x)) {
        if (put_length(o, PyDict_GET_SIZE(x), 0x80, 16, 0, 0xde, 0xdf) < 0) return -1;
        Py_ssize_t pos = 0;
        PyObject *k, *v;
        while (PyDict_Next(x, &pos, &k, &v))
            if (pack(o, k, depth + 1) < 0 || pack(o, v, depth + 1) < 0) return -1;
        return 0;
    }
    PyErr_Format(PyExc_TypeError, "cannot pack %.100s", Py_TYPE(x)->tp_name);
    return -1;
}

/* The signed frame of values[0:n] (sender, seq, run, *fields) as message `kind`. */
static PyObject *seal_values(MacObject *mac, long kind, PyObject *const *values, Py_ssize_t n) {
    Out o;
    o.buf = o.local;
    o.cap = sizeof o.local;
    o.len = HEADER_LEN;
    PyObject *frame = NULL;
    if (put_length(&o, n, 0x90, 16, 0, 0xdc, 0xdd) < 0) goto done;
    for (Py_ssize_t i = 0; i < n; i++)
        if (pack(&o, values[i], 1) < 0) goto done;
    Py_ssize_t body = o.len - HEADER_LEN;
    if ((uint64_t)body > 0xffffffffULL) {
        PyErr_SetString(PyExc_ValueError, "frame body too large");
        goto done;
    }
    uint8_t *h = o.buf;
    h[0] = P.magic[0];
    h[1] = P.magic[1];
    h[2] = (uint8_t)(P.version & 0xff);
    h[3] = (uint8_t)(P.version >> 8);
    h[4] = (uint8_t)(kind & 0xff);
    h[5] = (uint8_t)(kind >> 8);
    for (int i = 0; i < 4; i++) h[6 + i] = (uint8_t)((uint64_t)body >> (8 * i));
    frame = PyBytes_FromStringAndSize(NULL, o.len + TAG_LEN);
    if (frame != NULL) {
        uint8_t *p = (uint8_t *)PyBytes_AS_STRING(frame);
        memcpy(p, o.buf, (size_t)o.len);
        tag_of(mac->keyed, p, o.len, p + o.len);
    }
done:
    if (o.buf != o.local) PyMem_Free(o.buf);
    return frame;
}

static long kind_of(PyObject *x) {
    long kind = PyLong_CheckExact(x) ? PyLong_AsLong(x) : -1;
    if (kind < 0 || kind > 0xffff) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "a message kind is an int of 0 to 65535");
        return -1;
    }
    return kind;
}

/* seal(mac, kind, *values) -> header + msgpack array of values + tag */
static PyObject *f_seal(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs < 2 || !PyObject_TypeCheck(args[0], &MacType)) {
        PyErr_SetString(PyExc_TypeError, "seal(mac, kind, *values)");
        return NULL;
    }
    if (!ready()) return NULL;
    long kind = kind_of(args[1]);
    if (kind < 0) return NULL;
    return seal_values((MacObject *)args[0], kind, args + 2, nargs - 2);
}

/* ---------------------------------------------------------------- reading */

typedef struct {
    const uint8_t *p, *end;
} Cursor;

static inline int has(const Cursor *c, uint64_t n) { return (uint64_t)(c->end - c->p) >= n; }

static inline uint64_t read_be(const uint8_t *p, int width) {
    uint64_t x = 0;
    for (int i = 0; i < width; i++) x = (x << 8) | p[i];
    return x;
}

/* A big-endian number of `width` bytes into *x, the cursor past it; 0 when the body ends first. */
static int take_be(Cursor *c, int width, uint64_t *x) {
    if (!has(c, (uint64_t)width)) return 0;
    *x = read_be(c->p, width);
    c->p += width;
    return 1;
}

/* A length of `width` bytes (0: `fixed`) that must fit in what is left at `per_item` bytes each at least;
   -1 when it does not (a body can't hold it, so it is not for this path). */
static Py_ssize_t read_length(Cursor *c, int width, uint64_t fixed, uint64_t per_item) {
    uint64_t n = fixed;
    if (width) {
        if (!has(c, (uint64_t)width)) return -1;
        n = read_be(c->p, width);
        c->p += width;
    }
    if (per_item && !has(c, n * per_item)) return -1;
    return (Py_ssize_t)n;
}

/* NULL and no error set: not handled here (the Python path decides). */
static PyObject *decode(Cursor *c, int depth);

static PyObject *decode_array(Cursor *c, Py_ssize_t n, int depth) {
    if (n < 0 || n > P.max_array || depth >= P.max_nesting) return NULL;
    PyObject *list = PyList_New(n);
    if (list == NULL) return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = decode(c, depth + 1);
        if (item == NULL) {
            Py_DECREF(list);
            return NULL;
        }
        PyList_SET_ITEM(list, i, item);
    }
    return list;
}

static PyObject *decode_map(Cursor *c, Py_ssize_t n, int depth) {
    if (n < 0 || n > P.max_map || depth >= P.max_nesting) return NULL;
    PyObject *dict = PyDict_New();
    if (dict == NULL) return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *key = decode(c, depth + 1);
        if (key == NULL || !PyUnicode_CheckExact(key)) { /* bytes keys and others: the Python path */
            Py_XDECREF(key);
            Py_DECREF(dict);
            return NULL;
        }
        PyObject *value = decode(c, depth + 1);
        if (value == NULL || PyDict_SetItem(dict, key, value) < 0) {
            Py_DECREF(key);
            Py_XDECREF(value);
            Py_DECREF(dict);
            return NULL;
        }
        Py_DECREF(key);
        Py_DECREF(value);
    }
    return dict;
}

static PyObject *decode_str(Cursor *c, Py_ssize_t n) {
    if (n < 0 || n > P.max_str || !has(c, (uint64_t)n)) return NULL;
    PyObject *s = PyUnicode_DecodeUTF8((const char *)c->p, n, NULL);
    if (s == NULL) {
        PyErr_Clear(); /* invalid UTF-8: the Python path drops it as malformed */
        return NULL;
    }
    c->p += n;
    return s;
}

static PyObject *decode(Cursor *c, int depth) {
    if (!has(c, 1)) return NULL;
    uint8_t b = *c->p++;
    if (b <= 0x7f) return PyLong_FromLong(b);
    if (b >= 0xe0) return PyLong_FromLong((long)(int8_t)b);
    if ((b & 0xe0) == 0xa0) return decode_str(c, b & 0x1f);
    if ((b & 0xf0) == 0x90) return decode_array(c, b & 0x0f, depth);
    if ((b & 0xf0) == 0x80) return decode_map(c, b & 0x0f, depth);
    switch (b) {
    case 0xc0:
        Py_RETURN_NONE;
    case 0xc2:
        Py_RETURN_FALSE;
    case 0xc3:
        Py_RETURN_TRUE;
    case 0xcc:
    case 0xcd:
    case 0xce:
    case 0xcf: {
        uint64_t x;
        return take_be(c, 1 << (b - 0xcc), &x) ? PyLong_FromUnsignedLongLong(x) : NULL;
    }
    case 0xd0:
    case 0xd1:
    case 0xd2:
    case 0xd3: {
        uint64_t x;
        int width = 1 << (b - 0xd0);
        if (!take_be(c, width, &x)) return NULL;
        return PyLong_FromLongLong(width == 1 ? (int8_t)x : width == 2 ? (int16_t)x : width == 4 ? (int32_t)x : (int64_t)x);
    }
    case 0xca: {
        uint64_t x;
        if (!take_be(c, 4, &x)) return NULL;
        uint32_t bits = (uint32_t)x;
        float f;
        memcpy(&f, &bits, 4);
        return PyFloat_FromDouble((double)f);
    }
    case 0xcb: {
        uint64_t x;
        if (!take_be(c, 8, &x)) return NULL;
        double d;
        memcpy(&d, &x, 8);
        return PyFloat_FromDouble(d);
    }
    case 0xd9:
        return decode_str(c, read_length(c, 1, 0, 1));
    case 0xda:
        return decode_str(c, read_length(c, 2, 0, 1));
    case 0xdb:
        return decode_str(c, read_length(c, 4, 0, 1));
    case 0xc4:
    case 0xc5:
    case 0xc6: {
        Py_ssize_t n = read_length(c, 1 << (b - 0xc4), 0, 1);
        if (n < 0 || n > P.max_bin) return NULL;
        PyObject *o = PyBytes_FromStringAndSize((const char *)c->p, n);
        if (o != NULL) c->p += n;
        return o;
    }
    case 0xdc:
        return decode_array(c, read_length(c, 2, 0, 1), depth);
    case 0xdd:
        return decode_array(c, read_length(c, 4, 0, 1), depth);
    case 0xde:
        return decode_map(c, read_length(c, 2, 0, 2), depth);
    case 0xdf:
        return decode_map(c, read_length(c, 4, 0, 2), depth);
    }
    return NULL; /* ext types (refused by the codec) and the unused byte 0xc1 */
}

/* ---------------------------------------------------------------- fields */

/* A field value as the Python codec checks it, writing or reading, by its code (codec.py's _NATIVE_CODES):
   'i' int in [-2^63, 2^64-1], 'f' float (an int becomes one, as the Python check widens it), 'b' bool,
   's' str of at most MAX_STR bytes of UTF-8, '*' whatever the field's Python validator makes of it (codec.py's _INLINE
   and compile_type). A new reference to the value to use; NULL without an error set: refused (the
   Python path raises or drops with the schema error), NULL with one: a real error. */
static PyObject *checked_field(char code, PyObject *v, PyObject *validator) {
    switch (code) {
    case 'i': {
        if (!PyLong_CheckExact(v)) return NULL;
        int overflow = 0;
        PyLong_AsLongLongAndOverflow(v, &overflow);
        if (overflow < 0) return NULL;
        if (overflow > 0) { /* within [2^63, 2^64-1] or refused */
            PyLong_AsUnsignedLongLong(v);
            if (PyErr_Occurred()) {
                PyErr_Clear();
                return NULL;
            }
        }
        break;
    }
    case 'f':
        if (PyLong_CheckExact(v)) {
            double d = PyLong_AsDouble(v);
            if (d == -1.0 && PyErr_Occurred()) {
                PyErr_Clear(); /* too big for a float: the Python path says so */
                return NULL;
            }
            return PyFloat_FromDouble(d);
        }
        if (!PyFloat_CheckExact(v)) return NULL;
        break;
    case 'b':
        if (!PyBool_Check(v)) return NULL;
        break;
    case 's':
        if (!PyUnicode_CheckExact(v)) return NULL;
        if (PyUnicode_GET_LENGTH(v) > P.max_str / 4) { /* MAX_STR counts UTF-8 bytes, as the reader does (codec.py's _str_too_long) */
            Py_ssize_t bytes;
            if (PyUnicode_AsUTF8AndSize(v, &bytes) == NULL)
                PyErr_Clear(); /* a lone surrogate: the packer refuses it, as it does a short one */
            else if (bytes > P.max_str)
                return NULL;
        }
        break;
    case '*': {
        PyObject *checked = PyObject_CallOneArg(validator, v);
        if (checked == NULL) PyErr_Clear(); /* _Invalid: the Python path names it */
        return checked;
    }
    default:
        PyErr_Format(PyExc_ValueError, "unknown field code %c", code);
        return NULL;
    }
    Py_INCREF(v);
    return v;
}

/* Whether body = [sender, seq, run, *values] is a sound envelope for `run` (codec.py's _BODY_CHECKS and
   _RUN_CHECK), each value replaced by what checked_field makes of it (`validators`: one a field, None
   for the scalar codes): 1 sound, 0 refused (the Python path names why), -1 a real error. */
static int envelope_sound(PyObject *body, PyObject *run, const char *codes, Py_ssize_t ncodes, PyObject *validators) {
    if (!PyTuple_Check(validators) || PyTuple_GET_SIZE(validators) != ncodes) {
        PyErr_SetString(PyExc_TypeError, "one code and one validator (or None) a field");
        return -1;
    }
    if (PyList_GET_SIZE(body) != 3 + ncodes) return 0;
    PyObject *sender = PyList_GET_ITEM(body, 0), *seq = PyList_GET_ITEM(body, 1), *frame_run = PyList_GET_ITEM(body, 2);
    if (!PyUnicode_CheckExact(sender) || PyUnicode_GET_LENGTH(sender) < 1 || PyUnicode_GET_LENGTH(sender) > P.max_sender) return 0;
    /* a decoded int is within msgpack's range, [-2^63, 2^64-1]: only its sign is left to check */
    if (!PyLong_CheckExact(seq)) return 0;
    int overflow = 0;
    long long number = PyLong_AsLongLongAndOverflow(seq, &overflow);
    if (overflow < 0 || (overflow == 0 && number < 1)) return 0;
    if (!PyUnicode_CheckExact(frame_run) || PyUnicode_Compare(frame_run, run) != 0) return 0;
    for (Py_ssize_t i = 0; i < ncodes; i++) {
        PyObject *v = PyList_GET_ITEM(body, 3 + i);
        PyObject *checked = checked_field(codes[i], v, PyTuple_GET_ITEM(validators, i));
        if (checked == NULL) return PyErr_Occurred() ? -1 : 0;
        PyList_SET_ITEM(body, 3 + i, checked);
        Py_DECREF(v);
    }
    return 1;
}

/* ---------------------------------------------------------------- encode */

static PyObject *EMPTY; /* the empty tuple: a message is made as object.__new__(cls) makes it */

/* A FrameWriter's compiled half: its keyed state, names, counter and table, handed over when it is made. */
typedef struct {
    PyObject_HEAD PyObject *mac; /* a Mac */
    PyObject *sender, *run_id;   /* str */
    PyObject *seqs;              /* the writer's numbers (an iterator it shares with its Python path) */
    PyObject *table;             /* class -> (kind, codes, names, validators) */
} WriterObject;

static int Writer_init(WriterObject *self, PyObject *args, PyObject *kwargs) {
    static char *kwlist[] = {"mac", "sender", "run_id", "seqs", "table", NULL};
    PyObject *mac, *sender, *run_id, *seqs, *table;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O!UUOO!:Writer", kwlist, &MacType, &mac, &sender, &run_id, &seqs, &PyDict_Type,
                                     &table))
        return -1;
    if (!PyIter_Check(seqs)) {
        PyErr_SetString(PyExc_TypeError, "Writer: seqs is an iterator of sequence numbers");
        return -1;
    }
    Py_INCREF(mac);
    Py_INCREF(sender);
    Py_INCREF(run_id);
    Py_INCREF(seqs);
    Py_INCREF(table);
    Py_XSETREF(self->mac, mac);
    Py_XSETREF(self->sender, sender);
    Py_XSETREF(self->run_id, run_id);
    Py_XSETREF(self->seqs, seqs);
    Py_XSETREF(self->table, table);
    return 0;
}

static int Writer_traverse(WriterObject *self, visitproc visit, void *arg) {
    Py_VISIT(self->seqs);
    Py_VISIT(self->table);
    return 0;
}

static int Writer_clear(WriterObject *self) {
    Py_CLEAR(self->mac);
    Py_CLEAR(self->sender);
    Py_CLEAR(self->run_id);
    Py_CLEAR(self->seqs);
    Py_CLEAR(self->table);
    return 0;
}

static void Writer_dealloc(WriterObject *self) {
    PyObject_GC_UnTrack(self);
    Writer_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* encode(msg) -> the signed frame, numbered next(seqs); None: not a message this path encodes (its class
   is not in the table, or a field does not pass its check: the Python path raises the schema error), and
   then no number is taken. */
static PyObject *Writer_encode(WriterObject *self, PyObject *msg) {
    if (self->table == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "Writer: not initialised");
        return NULL;
    }
    if (!ready()) return NULL;
    PyObject *entry = PyDict_GetItemWithError(self->table, (PyObject *)Py_TYPE(msg)); /* borrowed */
    if (entry == NULL) {
        if (PyErr_Occurred()) return NULL;
        Py_RETURN_NONE;
    }
    if (!PyTuple_Check(entry) || PyTuple_GET_SIZE(entry) != 4) {
        PyErr_SetString(PyExc_TypeError, "encode: a class's entry is (kind, codes, names, validators)");
        return NULL;
    }
    long kind = kind_of(PyTuple_GET_ITEM(entry, 0));
    if (kind < 0) return NULL;
    PyObject *names = PyTuple_GET_ITEM(entry, 2), *validators = PyTuple_GET_ITEM(entry, 3);
    Py_ssize_t ncodes, fields = PyTuple_GET_SIZE(names);
    const char *codes = PyUnicode_AsUTF8AndSize(PyTuple_GET_ITEM(entry, 1), &ncodes);
    if (codes == NULL) return NULL;
    if (ncodes != fields || fields > 64) {
        PyErr_SetString(PyExc_ValueError, "encode: one code a field, at most 64 fields");
        return NULL;
    }
    PyObject *values[3 + 64] = {NULL}, *frame = NULL;
    for (Py_ssize_t i = 0; i < fields; i++) {
        PyObject *v = PyObject_GetAttr(msg, PyTuple_GET_ITEM(names, i));
        if (v == NULL) goto done;
        values[3 + i] = checked_field(codes[i], v, PyTuple_GET_ITEM(validators, i));
        Py_DECREF(v);
        if (values[3 + i] == NULL) {
            if (PyErr_Occurred()) goto done;
            frame = Py_None;
            Py_INCREF(frame);
            goto done;
        }
    }
    values[1] = PyIter_Next(self->seqs); /* the number: taken only now, once the message is known good */
    if (values[1] == NULL) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_RuntimeError, "encode: the writer's numbers ran out");
        goto done;
    }
    values[0] = self->sender; /* borrowed: the writer holds them while it seals */
    values[2] = self->run_id;
    frame = seal_values((MacObject *)self->mac, kind, values, 3 + fields);
    values[0] = values[2] = NULL;
done:
    for (Py_ssize_t i = 0; i < 3 + fields; i++) Py_XDECREF(values[i]);
    return frame;
}

static PyMethodDef Writer_methods[] = {
    {"encode", (PyCFunction)Writer_encode, METH_O, "encode(msg) -> the signed frame, or None: the Python path's to write"},
    {NULL, NULL, 0, NULL}};

static PyTypeObject WriterType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "flodl.wire._framec.Writer",
    .tp_doc = "Writer(mac, sender, run_id, seqs, table): a FrameWriter's compiled half.",
    .tp_basicsize = sizeof(WriterObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Writer_init,
    .tp_traverse = (traverseproc)Writer_traverse,
    .tp_clear = (inquiry)Writer_clear,
    .tp_dealloc = (destructor)Writer_dealloc,
    .tp_methods = Writer_methods,
};

/* ------------------------------------------------------------------ take */

/* The body [sender, seq, run, *values] of a frame of n bytes whose header is sound, if its tag, msgpack,
   envelope and fields are (each as checked_field makes it); NULL without an error set: not one this path
   takes. */
static PyObject *open_checked(PyObject *mac, const uint8_t *data, Py_ssize_t n, PyObject *run, PyObject *codes, PyObject *validators) {
    Py_ssize_t end = n - TAG_LEN, ncodes;
    const char *code = PyUnicode_AsUTF8AndSize(codes, &ncodes);
    if (code == NULL) return NULL;
    uint8_t tag[TAG_LEN];
    tag_of(((MacObject *)mac)->keyed, data, end, tag);
    uint8_t diff = 0; /* compared in constant time, as hmac.compare_digest */
    for (int i = 0; i < TAG_LEN; i++) diff |= (uint8_t)(tag[i] ^ data[end + i]);
    if (diff) return NULL;
    Cursor c = {data + HEADER_LEN, data + end};
    if (!has(&c, 1)) return NULL;
    uint8_t b = *c.p++;
    Py_ssize_t items;
    if ((b & 0xf0) == 0x90) items = b & 0x0f;
    else if (b == 0xdc) items = read_length(&c, 2, 0, 1);
    else return NULL; /* a body that is not one array: the schema's error, the Python path's to name */
    PyObject *body = decode_array(&c, items, 0);
    if (body == NULL) return NULL;
    int sound = c.p == c.end ? envelope_sound(body, run, code, ncodes, validators) : 0; /* nothing after the array */
    if (sound <= 0) {
        Py_DECREF(body);
        return NULL;
    }
    return body;
}

/* A FrameReader's compiled half: its keyed state, run, size limit, replay windows (the reader's own dict,
   shared) and table, handed over when it is made; it counts the frames it accepts. */
typedef struct {
    PyObject_HEAD PyObject *mac; /* a Mac */
    PyObject *run_id;            /* str */
    Py_ssize_t max_frame;
    PyObject *windows; /* sender -> Window, shared with the reader's Python path */
    PyObject *table;   /* kind -> (class, codes, names, validators, answer): writable (FrameReader.answer) */
    Py_ssize_t accepted;
} ReaderObject;

static int Reader_init(ReaderObject *self, PyObject *args, PyObject *kwargs) {
    static char *kwlist[] = {"mac", "run_id", "max_frame", "windows", "table", NULL};
    PyObject *mac, *run_id, *windows, *table;
    Py_ssize_t max_frame;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O!UnO!O!:Reader", kwlist, &MacType, &mac, &run_id, &max_frame, &PyDict_Type, &windows,
                                     &PyDict_Type, &table))
        return -1;
    Py_INCREF(mac);
    Py_INCREF(run_id);
    Py_INCREF(windows);
    Py_INCREF(table);
    Py_XSETREF(self->mac, mac);
    Py_XSETREF(self->run_id, run_id);
    Py_XSETREF(self->windows, windows);
    Py_XSETREF(self->table, table);
    self->max_frame = max_frame;
    self->accepted = 0;
    return 0;
}

static int Reader_traverse(ReaderObject *self, visitproc visit, void *arg) {
    Py_VISIT(self->windows);
    Py_VISIT(self->table); /* its answers may hold what holds the reader */
    return 0;
}

static int Reader_clear(ReaderObject *self) {
    Py_CLEAR(self->mac);
    Py_CLEAR(self->run_id);
    Py_CLEAR(self->windows);
    Py_CLEAR(self->table);
    return 0;
}

static void Reader_dealloc(ReaderObject *self) {
    PyObject_GC_UnTrack(self);
    Reader_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* The replay check on the sender's compiled window: 1 newest, 0 not, -1 not here (no window yet, a
   Python one, or a number seen or too old: the Python path makes the window, says it is our own frame
   reflected, or names the replay; the window is left as it was), -2 an error. */
static int admit(ReaderObject *self, PyObject *sender, PyObject *seq) {
    PyObject *window = PyDict_GetItemWithError(self->windows, sender); /* borrowed */
    if (window == NULL) return PyErr_Occurred() ? -2 : -1;
    if (!Py_IS_TYPE(window, &WindowType)) return -1;
    unsigned long long number = PyLong_AsUnsignedLongLong(seq);
    if (number == (unsigned long long)-1 && PyErr_Occurred()) return -2;
    WindowObject *w = (WindowObject *)window;
    unsigned long long top = w->top;
    if (!window_accept(w, number)) return -1;
    return number > top;
}

/* take(data, peer) -> the frame's Envelope, or None: not a frame this path takes (the reader's Python path
   takes it or says why not). Everything FrameReader.read does for an accepted frame, in its order: the
   header, the tag, the body, the envelope, every field's check, the replay check, the count, the reader's
   answer to the kind (if any), the message and its envelope. Nothing is changed before the replay check
   passes, so None leaves the reader as it was. The table maps a kind to (class, codes, field names,
   validators, answer): a validator per field whose code is '*' (None for the others), and
   `answer(peer, *values)` or None. */
static PyObject *Reader_take(ReaderObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "take(data, peer)");
        return NULL;
    }
    if (self->table == NULL || !PyDict_Check(self->table)) {
        PyErr_SetString(PyExc_TypeError, "take: a Reader's table maps a kind to its entry");
        return NULL;
    }
    if (!ready()) return NULL;
    if (!PyBytes_Check(args[0])) Py_RETURN_NONE; /* a view or a buffer of another kind: the Python path */
    PyObject *peer = args[1], *run = self->run_id, *mac = self->mac, *spec = NULL;
    const uint8_t *data = (const uint8_t *)PyBytes_AS_STRING(args[0]);
    Py_ssize_t n = PyBytes_GET_SIZE(args[0]);
    PyObject *body = NULL, *msg = NULL, *env = NULL;
    /* held while the answer runs: it may give the reader another table (FrameReader.answer) */
    Py_INCREF(run);
    Py_INCREF(mac);
    if (n < HEADER_LEN + TAG_LEN + 1 || n > self->max_frame || data[0] != P.magic[0] || data[1] != P.magic[1] ||
        (unsigned)(data[2] | (data[3] << 8)) != P.version)
        goto not_here;
    uint64_t body_len = data[6] | ((uint64_t)data[7] << 8) | ((uint64_t)data[8] << 16) | ((uint64_t)data[9] << 24);
    if (body_len + HEADER_LEN + TAG_LEN != (uint64_t)n) goto not_here;
    PyObject *kind = PyLong_FromLong(data[4] | (data[5] << 8));
    if (kind == NULL) goto done;
    spec = PyDict_GetItemWithError(self->table, kind);
    if (spec == NULL) {
        Py_DECREF(kind);
        if (PyErr_Occurred()) goto done;
        goto not_here;
    }
    Py_INCREF(spec);
    if (!PyTuple_Check(spec) || PyTuple_GET_SIZE(spec) != 5) {
        Py_DECREF(kind);
        PyErr_SetString(PyExc_TypeError, "take: a kind's entry is (class, codes, names, validators, answer)");
        goto done;
    }
    PyObject *cls = PyTuple_GET_ITEM(spec, 0), *codes = PyTuple_GET_ITEM(spec, 1), *names = PyTuple_GET_ITEM(spec, 2);
    PyObject *validators = PyTuple_GET_ITEM(spec, 3), *answer = PyTuple_GET_ITEM(spec, 4);
    Py_ssize_t fields = PyTuple_GET_SIZE(names);
    if (!PyTuple_Check(validators) || PyTuple_GET_SIZE(validators) != fields) {
        Py_DECREF(kind);
        PyErr_SetString(PyExc_TypeError, "take: one validator (or None) a field");
        goto done;
    }
    body = open_checked(mac, data, n, run, codes, validators);
    if (body == NULL) {
        Py_DECREF(kind);
        if (PyErr_Occurred()) goto done;
        goto not_here;
    }
    PyObject *sender = PyList_GET_ITEM(body, 0), *seq = PyList_GET_ITEM(body, 1);
    int newest = admit(self, sender, seq);
    if (newest < 0) {
        Py_DECREF(kind);
        if (newest == -2) goto done;
        goto not_here;
    }
    self->accepted++;
    if (answer != Py_None) { /* accepted: answered before any object is built (FrameReader.answer) */
        PyObject *call_args[1 + 64];
        if (fields > 64) {
            Py_DECREF(kind);
            PyErr_SetString(PyExc_ValueError, "take: more than 64 fields to answer with");
            goto done;
        }
        call_args[0] = peer;
        for (Py_ssize_t i = 0; i < fields; i++) call_args[1 + i] = PyList_GET_ITEM(body, 3 + i);
        PyObject *r = PyObject_Vectorcall(answer, call_args, (size_t)(1 + fields), NULL);
        if (r == NULL) {
            Py_DECREF(kind);
            goto done;
        }
        Py_DECREF(r);
    }
    msg = ((PyTypeObject *)cls)->tp_new((PyTypeObject *)cls, EMPTY, NULL); /* as object.__new__(cls): no __init__ */
    if (msg == NULL) {
        Py_DECREF(kind);
        goto done;
    }
    for (Py_ssize_t i = 0; i < fields; i++)
        if (PyObject_SetAttr(msg, PyTuple_GET_ITEM(names, i), PyList_GET_ITEM(body, 3 + i)) < 0) {
            Py_DECREF(kind);
            goto done;
        }
    env = ((PyTypeObject *)P.envelope)->tp_alloc((PyTypeObject *)P.envelope, 7);
    if (env == NULL) {
        Py_DECREF(kind);
        goto done;
    }
    PyObject *version = PyLong_FromUnsignedLong(P.version);
    if (version == NULL) {
        Py_DECREF(kind);
        Py_CLEAR(env);
        goto done;
    }
    PyTuple_SET_ITEM(env, 0, version);
    PyTuple_SET_ITEM(env, 1, kind); /* the reference taken above */
    Py_INCREF(sender);
    PyTuple_SET_ITEM(env, 2, sender);
    Py_INCREF(seq);
    PyTuple_SET_ITEM(env, 3, seq);
    Py_INCREF(run); /* equal to the frame's run id (checked): the reader's own string */
    PyTuple_SET_ITEM(env, 4, run);
    Py_INCREF(msg);
    PyTuple_SET_ITEM(env, 5, msg);
    PyTuple_SET_ITEM(env, 6, PyBool_FromLong(newest));
    goto done;
not_here:
    env = Py_None;
    Py_INCREF(env);
done:
    Py_XDECREF(spec);
    Py_DECREF(run);
    Py_DECREF(mac);
    Py_XDECREF(body);
    Py_XDECREF(msg);
    return env;
}

static PyMethodDef Reader_methods[] = {
    {"take", (PyCFunction)(void (*)(void))Reader_take, METH_FASTCALL, "take(data, peer) -> Envelope, or None: the Python path's to read"},
    {NULL, NULL, 0, NULL}};

static PyMemberDef Reader_members[] = {
    {"accepted", T_PYSSIZET, offsetof(ReaderObject, accepted), READONLY, "frames this half accepted"},
    {"table", T_OBJECT_EX, offsetof(ReaderObject, table), 0, "kind -> (class, codes, names, validators, answer)"},
    {NULL, 0, 0, 0, NULL}};

static PyTypeObject ReaderType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "flodl.wire._framec.Reader",
    .tp_doc = "Reader(mac, run_id, max_frame, windows, table): a FrameReader's compiled half.",
    .tp_basicsize = sizeof(ReaderObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Reader_init,
    .tp_traverse = (traverseproc)Reader_traverse,
    .tp_clear = (inquiry)Reader_clear,
    .tp_dealloc = (destructor)Reader_dealloc,
    .tp_methods = Reader_methods,
    .tp_members = Reader_members,
};

/* ------------------------------------------------------------- configure */

/* configure(*, version, magic, header_len, tag_len, max_str, max_bin, max_array, max_map, max_sender,
   max_nesting, replay_window, envelope): the protocol, from codec.py at import. Checked whole before
   any of it is taken: a layout this file does not write (header_len, tag_len) or a bound out of range
   raises ValueError and leaves the previous protocol in place. */
static PyObject *f_configure(PyObject *module, PyObject *args, PyObject *kwargs) {
    static char *kwlist[] = {"version", "magic", "header_len", "tag_len", "max_str", "max_bin", "max_array", "max_map", "max_sender",
                             "max_nesting", "replay_window", "envelope", NULL};
    long version;
    Py_buffer magic;
    Py_ssize_t header_len, tag_len, max_str, max_bin, max_array, max_map, max_sender, max_nesting, window;
    PyObject *envelope;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "$ly*nnnnnnnnnO!:configure", kwlist, &version, &magic, &header_len, &tag_len, &max_str,
                                     &max_bin, &max_array, &max_map, &max_sender, &max_nesting, &window, &PyType_Type, &envelope))
        return NULL;
    const char *bad = NULL;
    if (header_len != HEADER_LEN || tag_len != TAG_LEN)
        bad = "this build writes a 10-byte header (magic, version, kind, length) and a 16-byte BLAKE2b tag";
    else if (magic.len != 2) bad = "magic: 2 bytes";
    else if (version < 0 || version > 0xffff) bad = "version: 0 to 65535";
    else if (max_str < 0 || max_bin < 0 || max_array < 0 || max_map < 0 || max_sender < 1) bad = "a bound is negative";
    else if (max_nesting < 1 || max_nesting > 512) bad = "max_nesting: 1 to 512";
    else if (window < 64 || window % 64 || window > (1 << 20)) bad = "replay_window: a multiple of 64 bits, at most 2^20";
    else if (!PyType_IsSubtype((PyTypeObject *)envelope, &PyTuple_Type)) bad = "envelope: a named tuple of 7 fields";
    if (bad != NULL) {
        PyBuffer_Release(&magic);
        PyErr_SetString(PyExc_ValueError, bad);
        return NULL;
    }
    P.magic[0] = ((const uint8_t *)magic.buf)[0];
    P.magic[1] = ((const uint8_t *)magic.buf)[1];
    PyBuffer_Release(&magic);
    P.version = (unsigned)version;
    P.max_str = max_str;
    P.max_bin = max_bin;
    P.max_array = max_array;
    P.max_map = max_map;
    P.max_sender = max_sender;
    P.max_nesting = (int)max_nesting;
    P.window_bits = window;
    Py_INCREF(envelope);
    Py_XSETREF(P.envelope, envelope);
    P.ready = 1;
    Py_RETURN_NONE;
}

/* tag(mac, data) -> the 16-byte tag */
static PyObject *f_tag(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    Py_buffer data;
    if (nargs != 2 || !PyObject_TypeCheck(args[0], &MacType)) {
        PyErr_SetString(PyExc_TypeError, "tag(mac, data)");
        return NULL;
    }
    if (PyObject_GetBuffer(args[1], &data, PyBUF_SIMPLE) < 0) return NULL;
    if (data.len < 1) {
        PyBuffer_Release(&data);
        PyErr_SetString(PyExc_ValueError, "tag of an empty message (no frame is empty)");
        return NULL;
    }
    uint8_t out[TAG_LEN];
    tag_of(((MacObject *)args[0])->keyed, data.buf, data.len, out);
    PyBuffer_Release(&data);
    return PyBytes_FromStringAndSize((const char *)out, TAG_LEN);
}

static PyMethodDef methods[] = {
    {"configure", (PyCFunction)(void (*)(void))f_configure, METH_VARARGS | METH_KEYWORDS,
     "configure(*, version, magic, header_len, tag_len, max_str, max_bin, max_array, max_map, max_sender, max_nesting, replay_window, "
     "envelope): the protocol (codec.py, at import)"},
    {"seal", (PyCFunction)(void (*)(void))f_seal, METH_FASTCALL, "seal(mac, kind, *values) -> the signed frame"},
    {"tag", (PyCFunction)(void (*)(void))f_tag, METH_FASTCALL, "tag(mac, data) -> keyed BLAKE2b-128 of data"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "flodl.wire._framec",
                                        "The compiled half of flodl's frame codec (see codec.py).", -1, methods};

PyMODINIT_FUNC PyInit__framec(void) {
    if (PyType_Ready(&MacType) < 0 || PyType_Ready(&WindowType) < 0 || PyType_Ready(&WriterType) < 0 || PyType_Ready(&ReaderType) < 0)
        return NULL;
    if (EMPTY == NULL && !(EMPTY = PyTuple_New(0))) return NULL;
    PyObject *m = PyModule_Create(&module_def);
    if (m == NULL) return NULL;
    if (PyModule_AddType(m, &MacType) < 0 || PyModule_AddType(m, &WindowType) < 0 || PyModule_AddType(m, &WriterType) < 0 ||
        PyModule_AddType(m, &ReaderType) < 0 || PyModule_AddIntConstant(m, "ABI", ABI) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
