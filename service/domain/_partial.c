/* The exact partial state of fragments, compiled: steptally.service.domain._partial.
 *
 * Functions over the binary form of a partial state that
 * steptally/service/domain/partial.py defines (and implements in Python, byte for byte
 * the same):
 *
 *   combine(values, width, kinds, guards) -> bytes
 *       the exact partial state of full-width fragments: ``values`` holds n * width
 *       little-endian float64 (fragment-major), ``kinds`` one byte per column
 *       (0 sum, 1 count, 2 min, 3 max), ``guards`` one little-endian int32 per column
 *       (the guard column, or -1);
 *   merge(states) -> bytes
 *       the states of a sequence merged into one;
 *   report(states) -> list
 *       the states of a sequence merged and each column reported: its value rounded
 *       once, as ``StepAccumulator.report`` rounds it, with its counts and its exact
 *       integer's bytes, without a Python state made for each column;
 *   canonical(values, width, kinds, nan) -> bytes | None
 *       full-width rows as the service keeps them (every NaN as ``nan``), or None when
 *       a count column holds a value that is not a count (the ingest's fast path for
 *       the reporter's body: ``service/domain/compact.py``);
 *   pack(steps, ranks, seqs, rows, world_size, commits, kinds, guards, width)
 *       that fast path's packing of such rows: the fragments by key, their origins,
 *       each (step, rank)'s count and combined state, and its plain pairs (each one's
 *       rows joined in seq order), or None when the keys are not integers in range,
 *       a rank is not below the world size or a key comes twice.
 *
 * A sum is kept as an exact integer in units of 2**-1074: every finite float64 is
 * m * 2**s there, with a 53-bit m and 0 <= s <= 2045, so it adds into an array of
 * 32-bit digits held in int64 (carries resolved once, at the end, over the digits added
 * into and as far up as they reach: settle()). Nothing is rounded but by report(),
 * once, when a step's value is reported (round to nearest, ties to even: the same bits
 * as Python's ``int / int``).
 *
 * combine() lets go of the GIL while it works on a large input; a small one (the
 * reporter's body: 256 values, ~2 us) it keeps it for, since it runs on the event loop,
 * and a thread that lets go of the GIL there waits to get it back behind the others.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stddef.h>
#include <stdint.h>
#include <math.h>
#include <string.h>

#define KIND_SUM 0
#define KIND_COUNT 1
#define KIND_MIN 2
#define KIND_MAX 3
#define VERSION 2
#define LIMBS 76 /* 2098 bits of the float64 range, 64 of growth, a sign: 32 bits each */
#define MAX_COLUMNS 65535
#define RENORMALISE 1000000 /* adds into one digit between carries, far below 2**31 */
#define RELEASE_BYTES (1 << 16) /* combine() lets go of the GIL from this input size on */

typedef struct {
    int kind;        /* -1: no value yet */
    uint64_t n, nan, pinf, ninf;
    int64_t limb[LIMBS]; /* sum and count: the exact integer, 32-bit digits */
    int lo, hi;          /* the digits added into: [lo, hi]; lo > hi while none */
    int has;         /* min and max */
    double best;
    uint64_t adds;
} State;

/* -- exact integers as digits -------------------------------------------------------- */

/* digit ``i`` into [0, 2**32), what it held beyond that carried into digit ``i + 1``;
 * returns the carry */
static int64_t carry_up(int64_t *limb, int i) {
    int64_t carry = limb[i] >> 32; /* arithmetic shift: floor division */
    limb[i] -= carry * ((int64_t)1 << 32);
    limb[i + 1] += carry;
    return carry;
}

static void normalise(int64_t *limb) {
    for (int i = 0; i < LIMBS - 1; i++) carry_up(limb, i);
}

/* every digit in [0, 2**32) but the top one, which keeps the sign: the digits above
 * the ones added into may now hold the sign's ones */
static void renormalise(State *st) {
    normalise(st->limb);
    st->hi = LIMBS - 1;
    st->adds = 0;
}

static void touch(State *st, int lo, int hi) {
    if (lo < st->lo) st->lo = lo;
    if (hi > st->hi) st->hi = hi;
}

static void add_double(State *st, double x, int negate) {
    uint64_t bits;
    memcpy(&bits, &x, 8);
    int exp = (int)((bits >> 52) & 0x7ff);
    uint64_t m = bits & (((uint64_t)1 << 52) - 1);
    int neg = (int)(bits >> 63) ^ negate;
    int s;
    if (exp == 0) {
        s = 0; /* subnormal or zero: m * 2**-1074 */
    } else {
        m |= (uint64_t)1 << 52;
        s = exp - 1;
    }
    if (m == 0) return;
    unsigned __int128 v = (unsigned __int128)m << (s & 31);
    int q = s >> 5;
    touch(st, q, q + 2);
    int64_t p0 = (int64_t)(uint32_t)v, p1 = (int64_t)(uint32_t)(v >> 32);
    int64_t p2 = (int64_t)(uint32_t)(v >> 64);
    if (neg) {
        st->limb[q] -= p0;
        st->limb[q + 1] -= p1;
        st->limb[q + 2] -= p2;
    } else {
        st->limb[q] += p0;
        st->limb[q + 1] += p1;
        st->limb[q + 2] += p2;
    }
    if (++st->adds >= RENORMALISE) renormalise(st);
}

/* a count's value: an integer from 0 to 2**63 - 1 (checked before it gets here) */
static void add_integer(State *st, double x) {
    uint64_t v = (uint64_t)x;
    touch(st, 0, 1);
    st->limb[0] += (int64_t)(uint32_t)v;
    st->limb[1] += (int64_t)(uint32_t)(v >> 32);
    if (++st->adds >= RENORMALISE) renormalise(st);
}

/* add a stored integer: ``len`` bytes, little-endian two's complement, times 256**shift */
static int add_bytes(State *st, const unsigned char *b, size_t len, size_t shift) {
    if (len == 0) return 0;
    if ((shift + len + 3) / 4 > LIMBS - 2) return -1;
    touch(st, (int)(shift / 4), (int)((shift + len - 1) / 4));
    for (size_t k = 0; k < len; k++) {
        int64_t byte = (k == len - 1) ? (int64_t)(int8_t)b[k] : (int64_t)b[k];
        size_t at = shift + k;
        st->limb[at / 4] += byte * ((int64_t)1 << (8 * (at % 4)));
    }
    if (++st->adds >= RENORMALISE) renormalise(st);
    return 0;
}

/* -- the binary form ----------------------------------------------------------------- */

typedef struct {
    unsigned char *buf;
    size_t len, cap;
} Out;

static int reserve(Out *o, size_t more) {
    if (o->len + more <= o->cap) return 0;
    size_t cap = o->cap ? o->cap : 256;
    while (cap < o->len + more) cap *= 2;
    unsigned char *p = PyMem_RawRealloc(o->buf, cap);
    if (p == NULL) return -1;
    o->buf = p;
    o->cap = cap;
    return 0;
}

static void put_u(Out *o, uint64_t v, int size) {
    for (int i = 0; i < size; i++) o->buf[o->len++] = (unsigned char)(v >> (8 * i));
}

/* Carries resolved from the lowest digit added into, up to where they stop: above
 * ``hi`` the digits are zero until a carry lands, and a carry of 0 leaves them zero, one
 * of -1 leaves them all ones (a negative integer). Returns the highest digit that can
 * differ from the rest; ``*fill`` is what every digit above it holds. */
static int settle(State *st, uint32_t *fill) {
    *fill = 0;
    for (int i = st->lo; i < LIMBS - 1; i++) {
        int64_t carry = carry_up(st->limb, i);
        if (i >= st->hi && (carry == 0 || carry == -1)) {
            *fill = carry ? 0xffffffffu : 0;
            return i;
        }
    }
    return LIMBS - 1;
}

/* how many of ``len`` (>= 1) little-endian two's complement bytes hold their value with
 * its sign: the top ones that only repeat the sign left off */
static size_t signed_length(const unsigned char *raw, size_t len) {
    while (len > 1) {
        unsigned char top = raw[len - 1], next = raw[len - 2];
        if ((top == 0x00 && !(next & 0x80)) || (top == 0xff && (next & 0x80))) len--;
        else break;
    }
    return len;
}

/* the integer's shift (whole zero bytes below it) and minimal signed bytes */
static int put_integer(Out *o, State *st) {
    unsigned char raw[4 * (LIMBS + 1)];
    size_t lo = 0, hi = 0; /* [lo, hi) */
    if (st->lo <= st->hi) {
        uint32_t fill;
        int top = settle(st, &fill);
        for (int i = st->lo; i <= top; i++) {
            uint32_t d = (uint32_t)st->limb[i];
            for (int k = 0; k < 4; k++) raw[hi++] = (unsigned char)(d >> (8 * k));
        }
        if (top < LIMBS - 1) /* one digit of the fill: enough to trim the sign against */
            for (int k = 0; k < 4; k++) raw[hi++] = (unsigned char)(fill >> (8 * k));
    }
    while (lo < hi && raw[lo] == 0) lo++;
    if (lo == hi) { /* zero */
        if (reserve(o, 4)) return -1;
        put_u(o, 0, 2);
        put_u(o, 0, 2);
        return 0;
    }
    hi = lo + signed_length(raw + lo, hi - lo);
    if (reserve(o, 4 + hi - lo)) return -1;
    put_u(o, 4 * (size_t)st->lo + lo, 2);
    put_u(o, hi - lo, 2);
    memcpy(o->buf + o->len, raw + lo, hi - lo);
    o->len += hi - lo;
    return 0;
}

static int encode(Out *o, State *cols, Py_ssize_t width) {
    Py_ssize_t present = 0;
    for (Py_ssize_t j = 0; j < width; j++) present += cols[j].kind >= 0;
    if (reserve(o, 3)) return -1;
    put_u(o, VERSION, 1);
    put_u(o, (uint64_t)present, 2);
    for (Py_ssize_t j = 0; j < width; j++) {
        State *st = &cols[j];
        if (st->kind < 0) continue;
        if (reserve(o, 3 + 41)) return -1;
        put_u(o, (uint64_t)j, 2);
        put_u(o, (uint64_t)st->kind, 1);
        put_u(o, st->n, 8);
        if (st->kind == KIND_SUM) {
            put_u(o, st->nan, 8);
            put_u(o, st->pinf, 8);
            put_u(o, st->ninf, 8);
            if (put_integer(o, st)) return -1;
        } else if (st->kind == KIND_COUNT) {
            if (put_integer(o, st)) return -1;
        } else {
            uint64_t bits;
            memcpy(&bits, &st->best, 8);
            put_u(o, st->nan, 8);
            put_u(o, (uint64_t)st->has, 1);
            put_u(o, st->has ? bits : 0, 8);
        }
    }
    return 0;
}

/* -- min and max --------------------------------------------------------------------- */

static int signbit_of(double x) {
    uint64_t bits;
    memcpy(&bits, &x, 8);
    return (int)(bits >> 63);
}

/* the better of two non-NaN values: -0.0 is the smaller zero */
static double better(double a, double b, int is_max) {
    if (a == b) return (signbit_of(a) == is_max) ? b : a;
    if (is_max) return a > b ? a : b;
    return a < b ? a : b;
}

static void add_extreme(State *st, double x) {
    st->n++;
    if (x != x) {
        st->nan++;
    } else if (!st->has) {
        st->best = x;
        st->has = 1;
    } else {
        st->best = better(st->best, x, st->kind == KIND_MAX);
    }
}

/* -- combine ------------------------------------------------------------------------- */

static void init_states(State *cols, Py_ssize_t width) {
    memset(cols, 0, sizeof(State) * (size_t)width);
    for (Py_ssize_t j = 0; j < width; j++) {
        cols[j].kind = -1;
        cols[j].lo = LIMBS; /* none added into */
        cols[j].hi = -1;
    }
}

static double value_at(const unsigned char *p) {
    double x;
    memcpy(&x, p, 8);
    return x;
}

static void combine_into(State *cols, const unsigned char *vals, Py_ssize_t n, Py_ssize_t width,
                         const unsigned char *kinds, const int32_t *guards) {
    for (Py_ssize_t j = 0; j < width; j++) {
        State *st = &cols[j];
        int kind = kinds[j];
        int32_t g = guards[j];
        for (Py_ssize_t i = 0; i < n; i++) {
            const unsigned char *row = vals + 8 * (size_t)(i * width);
            if (g >= 0 && !(value_at(row + 8 * (size_t)g) > 0)) continue;
            double x = value_at(row + 8 * (size_t)j);
            st->kind = kind;
            if (kind == KIND_SUM) {
                st->n++;
                if (x != x) st->nan++;
                else if (x == HUGE_VAL) st->pinf++;
                else if (x == -HUGE_VAL) st->ninf++;
                else add_double(st, x, 0);
            } else if (kind == KIND_COUNT) {
                st->n++;
                add_integer(st, x);
            } else {
                add_extreme(st, x);
            }
        }
    }
}

static PyObject *finish(State *cols, Py_ssize_t width) {
    Out o = {NULL, 0, 0};
    if (encode(&o, cols, width)) {
        PyMem_RawFree(o.buf);
        return PyErr_NoMemory();
    }
    PyObject *out = PyBytes_FromStringAndSize((const char *)o.buf, (Py_ssize_t)o.len);
    PyMem_RawFree(o.buf);
    return out;
}

static PyObject *combine(PyObject *self, PyObject *args) {
    Py_buffer values, kinds, guards;
    Py_ssize_t width;
    if (!PyArg_ParseTuple(args, "y*ny*y*", &values, &width, &kinds, &guards)) return NULL;
    PyObject *out = NULL;
    State *cols = NULL;
    if (width <= 0 || width > MAX_COLUMNS || kinds.len != width || guards.len != 4 * width ||
        values.len % (8 * width)) {
        PyErr_SetString(PyExc_ValueError, "values, kinds and guards do not fit the width");
        goto done;
    }
    const unsigned char *k = kinds.buf;
    int32_t *g = PyMem_Malloc(sizeof(int32_t) * (size_t)width);
    if (g == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t j = 0; j < width; j++) {
        const unsigned char *p = (const unsigned char *)guards.buf + 4 * j;
        g[j] = (int32_t)((uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 |
                         (uint32_t)p[3] << 24);
        if (k[j] > KIND_MAX || g[j] >= width || g[j] < -1) {
            PyMem_Free(g);
            PyErr_SetString(PyExc_ValueError, "a kind or a guard is out of range");
            goto done;
        }
    }
    cols = PyMem_RawMalloc(sizeof(State) * (size_t)width);
    if (cols == NULL) {
        PyMem_Free(g);
        PyErr_NoMemory();
        goto done;
    }
    init_states(cols, width);
    if (values.len >= RELEASE_BYTES) {
        Py_BEGIN_ALLOW_THREADS
        combine_into(cols, values.buf, values.len / (8 * width), width, k, g);
        Py_END_ALLOW_THREADS
    } else {
        combine_into(cols, values.buf, values.len / (8 * width), width, k, g);
    }
    PyMem_Free(g);
    out = finish(cols, width);
done:
    PyMem_RawFree(cols);
    PyBuffer_Release(&values);
    PyBuffer_Release(&kinds);
    PyBuffer_Release(&guards);
    return out;
}

/* -- merge --------------------------------------------------------------------------- */

typedef struct {
    const unsigned char *p, *end;
} Reader;

static int get_u(Reader *r, int size, uint64_t *v) {
    if (r->end - r->p < size) return -1;
    *v = 0;
    for (int i = 0; i < size; i++) *v |= (uint64_t)r->p[i] << (8 * i);
    r->p += size;
    return 0;
}

static int get_integer(Reader *r, State *st) {
    uint64_t shift, len;
    if (get_u(r, 2, &shift) || get_u(r, 2, &len) || r->end - r->p < (ptrdiff_t)len) return -1;
    if (add_bytes(st, r->p, (size_t)len, (size_t)shift)) return -1;
    r->p += len;
    return 0;
}

/* room for column ``col`` in ``*cols`` (``*cap`` of them), new ones empty */
static int room(State **cols, Py_ssize_t *cap, Py_ssize_t col) {
    if (col < *cap) return 0;
    Py_ssize_t want = *cap ? *cap : 64;
    while (want <= col) want *= 2;
    State *p = PyMem_RawRealloc(*cols, sizeof(State) * (size_t)want);
    if (p == NULL) return -1;
    init_states(p + *cap, want - *cap);
    *cols = p;
    *cap = want;
    return 0;
}

static int merge_one(State **cols, Py_ssize_t *cap, Py_ssize_t *width, Reader *r) {
    uint64_t version, count;
    if (get_u(r, 1, &version) || version != VERSION || get_u(r, 2, &count)) return -1;
    for (uint64_t e = 0; e < count; e++) {
        uint64_t col, kind, n;
        if (get_u(r, 2, &col) || get_u(r, 1, &kind) || kind > KIND_MAX || get_u(r, 8, &n))
            return -1;
        if (room(cols, cap, (Py_ssize_t)col)) return -2;
        State *st = &(*cols)[col];
        if (st->kind >= 0 && st->kind != (int)kind) return -1;
        st->kind = (int)kind;
        st->n += n;
        if ((Py_ssize_t)col >= *width) *width = (Py_ssize_t)col + 1;
        if (kind == KIND_SUM) {
            uint64_t nan, pinf, ninf;
            if (get_u(r, 8, &nan) || get_u(r, 8, &pinf) || get_u(r, 8, &ninf)) return -1;
            st->nan += nan;
            st->pinf += pinf;
            st->ninf += ninf;
            if (get_integer(r, st)) return -1;
        } else if (kind == KIND_COUNT) {
            if (get_integer(r, st)) return -1;
        } else {
            uint64_t nan, has, bits;
            if (get_u(r, 8, &nan) || get_u(r, 1, &has) || get_u(r, 8, &bits)) return -1;
            st->nan += nan;
            if (has) {
                double x;
                memcpy(&x, &bits, 8);
                st->best = st->has ? better(st->best, x, kind == KIND_MAX) : x;
                st->has = 1;
            }
        }
    }
    return r->p == r->end ? 0 : -1;
}

/* every state of the sequence ``arg`` merged into ``*cols`` (``*width`` columns; the
 * caller frees ``*cols``); -1 with the error set */
static int merge_all(PyObject *arg, State **cols, Py_ssize_t *width) {
    PyObject *seq = PySequence_Fast(arg, "takes a sequence of states");
    if (seq == NULL) return -1;
    Py_ssize_t count = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    Py_ssize_t cap = 0;
    int failed = -1;
    for (Py_ssize_t i = 0; i < count; i++) {
        Py_buffer b;
        if (PyObject_GetBuffer(items[i], &b, PyBUF_SIMPLE)) goto done;
        Reader r = {b.buf, (const unsigned char *)b.buf + b.len};
        int bad = merge_one(cols, &cap, width, &r);
        PyBuffer_Release(&b);
        if (bad == -2) {
            PyErr_NoMemory();
            goto done;
        }
        if (bad) {
            PyErr_Format(PyExc_ValueError, "state %zd is not a partial state of version %d", i,
                         VERSION);
            goto done;
        }
    }
    if (room(cols, &cap, 0)) {
        PyErr_NoMemory();
        goto done;
    }
    failed = 0;
done:
    Py_DECREF(seq);
    return failed;
}

static PyObject *merge(PyObject *self, PyObject *arg) {
    State *cols = NULL;
    Py_ssize_t width = 0;
    PyObject *out = merge_all(arg, &cols, &width) ? NULL : finish(cols, width);
    PyMem_RawFree(cols);
    return out;
}

/* -- report -------------------------------------------------------------------------- */

/* bits [pos, pos + 64) of a magnitude held in ``d`` (``n`` digits, zero above) */
static uint64_t bits_at(const uint32_t *d, int n, int pos) {
    uint64_t out = 0;
    for (int k = 0; k < 3; k++) {
        int i = pos / 32 + k;
        if (i >= n) break;
        unsigned __int128 w = (unsigned __int128)d[i] << (32 * k);
        out |= (uint64_t)(w >> (pos % 32));
    }
    return out;
}

/* the exact integer of a sum or count times 2**exp2, rounded once to the nearest
 * float64, ties to even (what Python's ``int / int`` gives, an overflow as an
 * infinity); ``raw``/``*raw_len``: its minimal little-endian two's complement bytes */
static double rounded(State *st, int exp2, unsigned char *raw, size_t *raw_len) {
    uint32_t d[LIMBS + 2];
    int n = 0;
    int negative = 0;
    *raw_len = 0;
    if (st->lo > st->hi) return 0.0;
    uint32_t fill;
    int top = settle(st, &fill);
    memset(d, 0, sizeof d);
    for (int i = st->lo; i <= top && i < LIMBS - 1; i++) d[i] = (uint32_t)st->limb[i];
    if (top == LIMBS - 1) { /* the top digit kept the sign: two digits of it */
        int64_t v = st->limb[LIMBS - 1];
        d[LIMBS - 1] = (uint32_t)v;
        d[LIMBS] = (uint32_t)((uint64_t)v >> 32);
        n = LIMBS + 1;
        negative = v < 0;
    } else {
        d[top + 1] = fill;
        n = top + 2;
        negative = fill != 0;
    }
    /* the bytes as stored: as few as hold the value with its sign */
    size_t len = 4 * (size_t)n;
    for (size_t k = 0; k < len; k++) raw[k] = (unsigned char)(d[k / 4] >> (8 * (k % 4)));
    len = signed_length(raw, len);
    if (len == 1 && raw[0] == 0) len = 0;
    *raw_len = len;
    if (negative) { /* its magnitude */
        uint64_t carry = 1;
        for (int i = 0; i < n; i++) {
            uint64_t w = (uint64_t)(uint32_t)~d[i] + carry;
            d[i] = (uint32_t)w;
            carry = w >> 32;
        }
    }
    int h = n - 1;
    while (h >= 0 && d[h] == 0) h--;
    if (h < 0) return 0.0;
    int length = 32 * h + (32 - __builtin_clz(d[h])); /* bits */
    double value;
    if (length <= 53) {
        value = ldexp((double)bits_at(d, n, 0), exp2); /* exact */
    } else {
        int shift = length - 54; /* the 53 bits, then the rounding bit */
        uint64_t top54 = bits_at(d, n, shift) & (((uint64_t)1 << 54) - 1);
        int sticky = 0;
        for (int i = 0; i < shift / 32 && !sticky; i++) sticky = d[i] != 0;
        if (!sticky && shift % 32) sticky = (d[shift / 32] & ((1u << (shift % 32)) - 1)) != 0;
        uint64_t m = top54 >> 1;
        if ((top54 & 1) && (sticky || (m & 1))) m++;
        value = ldexp((double)m, shift + 1 + exp2); /* 2**53 exactly when rounded up */
    }
    return negative ? -value : value;
}

/* one merged column as ``(col, kind, n, non_finite, value, exact)``: a sum's or a
 * count's value rounded once, NaN or an infinity for a sum that holds one (as
 * ``SumState.value``), a min's or max's best (NaN where it holds one, None with no
 * value); ``exact``: a sum's or count's integer as its stored bytes, else None */
static PyObject *column_report(State *st, Py_ssize_t col) {
    PyObject *value = NULL, *exact = Py_None;
    uint64_t bad = 0;
    Py_INCREF(Py_None);
    if (st->kind == KIND_SUM || st->kind == KIND_COUNT) {
        unsigned char raw[4 * (LIMBS + 2)];
        size_t len;
        double x = rounded(st, st->kind == KIND_SUM ? -1074 : 0, raw, &len);
        if (st->kind == KIND_SUM) {
            bad = st->nan + st->pinf + st->ninf;
            if (st->nan || (st->pinf && st->ninf)) x = Py_NAN;
            else if (st->pinf) x = Py_HUGE_VAL;
            else if (st->ninf) x = -Py_HUGE_VAL;
        }
        value = PyFloat_FromDouble(x);
        Py_DECREF(exact);
        exact = PyBytes_FromStringAndSize((const char *)raw, (Py_ssize_t)len);
    } else {
        bad = st->nan + (st->has && !isfinite(st->best));
        if (st->nan) value = PyFloat_FromDouble(Py_NAN);
        else if (st->has) value = PyFloat_FromDouble(st->best);
        else value = Py_NewRef(Py_None);
    }
    if (value == NULL || exact == NULL) {
        Py_XDECREF(value);
        Py_XDECREF(exact);
        return NULL;
    }
    return Py_BuildValue("(niKKNN)", col, st->kind, (unsigned long long)st->n,
                         (unsigned long long)bad, value, exact);
}

static PyObject *report(PyObject *self, PyObject *arg) {
    State *cols = NULL;
    Py_ssize_t width = 0;
    PyObject *out = NULL;
    if (merge_all(arg, &cols, &width)) goto done;
    out = PyList_New(0);
    if (out == NULL) goto done;
    for (Py_ssize_t j = 0; j < width; j++) {
        if (cols[j].kind < 0) continue;
        PyObject *one = column_report(&cols[j], j);
        if (one == NULL || PyList_Append(out, one)) {
            Py_XDECREF(one);
            Py_CLEAR(out);
            goto done;
        }
        Py_DECREF(one);
    }
done:
    PyMem_RawFree(cols);
    return out;
}

/* -- the reporter's rows ------------------------------------------------------------ */

/* full-width rows of little-endian float64 with every NaN as the one canonical NaN
 * (``nan``'s bits), or None when a count column holds a value that is not a count (an
 * integer from 0 to 2**63 - 1: NaN and the infinities are not) */
static PyObject *canonical(PyObject *self, PyObject *args) {
    Py_buffer values, kinds;
    Py_ssize_t width;
    double nan;
    if (!PyArg_ParseTuple(args, "y*ny*d", &values, &width, &kinds, &nan)) return NULL;
    PyObject *out = NULL;
    if (width <= 0 || kinds.len != width || values.len % (8 * width)) {
        PyErr_SetString(PyExc_ValueError, "values and kinds do not fit the width");
        goto done;
    }
    out = PyBytes_FromStringAndSize(values.buf, values.len);
    if (out == NULL) goto done;
    unsigned char *p = (unsigned char *)PyBytes_AS_STRING(out);
    const unsigned char *k = kinds.buf;
    Py_ssize_t cells = values.len / 8;
    for (Py_ssize_t c = 0; c < cells; c++) {
        double x = value_at(p + 8 * c);
        if (k[c % width] == KIND_COUNT) {
            /* 2**63 is exact as a double; x == floor(x) fails for NaN and holds for an
             * infinity, which the bound refuses */
            if (!(x >= 0.0 && x < 9223372036854775808.0 && x == (double)(int64_t)x)) {
                Py_CLEAR(out);
                out = Py_NewRef(Py_None);
                goto done;
            }
        } else if (x != x) {
            memcpy(p + 8 * c, &nan, 8);
        }
    }
done:
    PyBuffer_Release(&values);
    PyBuffer_Release(&kinds);
    return out;
}

/* -- pack ---------------------------------------------------------------------------- */

/* the integers of ``list`` (exact ints from 0 to 2**63 - 1) into ``out``; 0: one is not */
static int int64s(PyObject *list, Py_ssize_t n, int64_t *out) {
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *x = PyList_GET_ITEM(list, i);
        if (!PyLong_CheckExact(x)) return 0;
        int overflow = 0;
        long long v = PyLong_AsLongLongAndOverflow(x, &overflow);
        if (overflow || v < 0) return 0;
        out[i] = (int64_t)v;
    }
    return 1;
}

/* the rows ``index[0..count)`` of ``rows`` (``size`` bytes each), joined: ``rows``
 * itself when they are all of it in order */
static PyObject *joined_rows(PyObject *rows, const Py_ssize_t *index, Py_ssize_t count,
                             Py_ssize_t n, Py_ssize_t size) {
    if (count == n) {
        Py_ssize_t i = 0;
        while (i < count && index[i] == i) i++;
        if (i == count) return Py_NewRef(rows);
    }
    PyObject *out = PyBytes_FromStringAndSize(NULL, count * size);
    if (out == NULL) return NULL;
    char *to = PyBytes_AS_STRING(out);
    const char *from = PyBytes_AS_STRING(rows);
    for (Py_ssize_t i = 0; i < count; i++) memcpy(to + i * size, from + index[i] * size, size);
    return out;
}

/* one pair's state and plain rows into ``states`` and ``plain`` (a pair of ``commits``
 * with ``count`` fragments, seqs 0 to count - 1, is plain); -1: an error */
static int pack_pair(PyObject *pair, Py_ssize_t *index, Py_ssize_t count, const int64_t *seqs,
                     PyObject *rows, Py_ssize_t n, Py_ssize_t width, const unsigned char *k,
                     const int32_t *g, PyObject *commits, PyObject *states, PyObject *plain) {
    Py_ssize_t size = 8 * width;
    PyObject *joined = joined_rows(rows, index, count, n, size);
    if (joined == NULL) return -1;
    int rc = -1;
    PyObject *state = NULL, *item = NULL, *ranked = NULL;
    State *cols = PyMem_RawMalloc(sizeof(State) * (size_t)width);
    if (cols == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    init_states(cols, width);
    combine_into(cols, (const unsigned char *)PyBytes_AS_STRING(joined), count, width, k, g);
    state = finish(cols, width);
    if (state == NULL) goto done;
    item = Py_BuildValue("(nO)", count, state);
    if (item == NULL || PyDict_SetItem(states, pair, item) < 0) goto done;
    PyObject *declared = PyDict_GetItemWithError(commits, pair); /* borrowed */
    if (declared == NULL) {
        rc = PyErr_Occurred() ? -1 : 0;
        goto done;
    }
    int overflow = 0;
    long long c = PyLong_AsLongLongAndOverflow(declared, &overflow);
    if (c == -1 && PyErr_Occurred()) goto done;
    if (overflow || c != (long long)count) {
        rc = 0;
        goto done;
    }
    int in_order = 1;
    for (Py_ssize_t i = 0; i < count; i++) {
        if (seqs[index[i]] != i) in_order = 0;
    }
    if (!in_order) { /* plain if its seqs are 0 to count - 1 in another order */
        Py_ssize_t *by_seq = PyMem_Malloc(sizeof(Py_ssize_t) * (size_t)count);
        if (by_seq == NULL) {
            PyErr_NoMemory();
            goto done;
        }
        for (Py_ssize_t i = 0; i < count; i++) by_seq[i] = -1;
        int permutation = 1;
        for (Py_ssize_t i = 0; i < count && permutation; i++) {
            int64_t q = seqs[index[i]];
            if (q >= count || by_seq[q] >= 0) permutation = 0;
            else by_seq[q] = index[i];
        }
        if (permutation) ranked = joined_rows(rows, by_seq, count, n, size);
        PyMem_Free(by_seq);
        if (!permutation) {
            rc = 0;
            goto done;
        }
        if (ranked == NULL) goto done;
    }
    Py_XDECREF(item);
    item = Py_BuildValue("(nO)", count, ranked != NULL ? ranked : joined);
    if (item == NULL || PyDict_SetItem(plain, pair, item) < 0) goto done;
    rc = 0;
done:
    PyMem_RawFree(cols);
    Py_XDECREF(joined);
    Py_XDECREF(state);
    Py_XDECREF(item);
    Py_XDECREF(ranked);
    return rc;
}

static PyObject *pack(PyObject *self, PyObject *args) {
    PyObject *steps, *ranks, *seqs, *rows, *commits;
    Py_buffer kinds, guards;
    Py_ssize_t width, world_size;
    if (!PyArg_ParseTuple(args, "O!O!O!SnO!y*y*n", &PyList_Type, &steps, &PyList_Type, &ranks,
                          &PyList_Type, &seqs, &rows, &world_size, &PyDict_Type, &commits,
                          &kinds, &guards, &width))
        return NULL;
    PyObject *out = NULL, *fragments = NULL, *origin = NULL, *states = NULL, *plain = NULL;
    PyObject *pair_of = NULL;
    int64_t *v = NULL;
    Py_ssize_t *index = NULL, *first = NULL, *next = NULL;
    int32_t *g = NULL;
    Py_ssize_t n = PyList_GET_SIZE(steps), size = 8 * width;
    if (width <= 0 || width > MAX_COLUMNS || kinds.len != width || guards.len != 4 * width) {
        PyErr_SetString(PyExc_ValueError, "kinds and guards do not fit the width");
        goto done;
    }
    if (n == 0 || PyList_GET_SIZE(ranks) != n || PyList_GET_SIZE(seqs) != n ||
        PyBytes_GET_SIZE(rows) != n * size)
        goto none;
    v = PyMem_Malloc(sizeof(int64_t) * 3 * (size_t)n);
    index = PyMem_Malloc(sizeof(Py_ssize_t) * 3 * (size_t)n);
    g = PyMem_Malloc(sizeof(int32_t) * (size_t)width);
    if (v == NULL || index == NULL || g == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    first = index + n; /* first[p]: pair p's first row; next[i]: the row after i of its pair */
    next = index + 2 * n;
    int64_t *s = v, *r = v + n, *q = v + 2 * n;
    if (!int64s(steps, n, s) || !int64s(ranks, n, r) || !int64s(seqs, n, q)) goto none;
    const unsigned char *k = kinds.buf;
    for (Py_ssize_t j = 0; j < width; j++) {
        const unsigned char *p = (const unsigned char *)guards.buf + 4 * j;
        g[j] = (int32_t)((uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 |
                         (uint32_t)p[3] << 24);
        if (k[j] > KIND_MAX || g[j] >= width || g[j] < -1) {
            PyErr_SetString(PyExc_ValueError, "a kind or a guard is out of range");
            goto done;
        }
    }
    fragments = PyDict_New();
    origin = PyDict_New();
    states = PyDict_New();
    plain = PyDict_New();
    pair_of = PyDict_New();
    if (!fragments || !origin || !states || !plain || !pair_of) goto done;
    Py_ssize_t pairs = 0;
    Py_ssize_t *last = PyMem_Malloc(sizeof(Py_ssize_t) * (size_t)n); /* pair p's last row */
    if (last == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    const char *from = PyBytes_AS_STRING(rows);
    for (Py_ssize_t i = 0; i < n; i++) {
        if (r[i] >= world_size) {
            PyMem_Free(last);
            goto none;
        }
        PyObject *st = PyList_GET_ITEM(steps, i), *rk = PyList_GET_ITEM(ranks, i);
        PyObject *key = PyTuple_Pack(3, st, rk, PyList_GET_ITEM(seqs, i));
        PyObject *cell = NULL, *row = NULL, *at = NULL, *pair = NULL;
        int bad = key == NULL;
        if (!bad) {
            int had = PyDict_Contains(fragments, key);
            if (had != 0) { /* a key twice (or an error) */
                Py_DECREF(key);
                PyMem_Free(last);
                if (had < 0) goto done;
                goto none;
            }
            row = PyBytes_FromStringAndSize(from + i * size, size);
            cell = row ? PyTuple_Pack(3, row, Py_None, Py_None) : NULL;
            at = PyLong_FromSsize_t(i);
            pair = PyTuple_Pack(2, st, rk);
            bad = cell == NULL || at == NULL || pair == NULL ||
                  PyDict_SetItem(fragments, key, cell) < 0 || PyDict_SetItem(origin, key, at) < 0;
        }
        PyObject *known = bad ? NULL : PyDict_GetItemWithError(pair_of, pair); /* borrowed */
        if (!bad && known == NULL) {
            if (PyErr_Occurred()) bad = 1;
            else {
                PyObject *p = PyLong_FromSsize_t(pairs);
                bad = p == NULL || PyDict_SetItem(pair_of, pair, p) < 0;
                Py_XDECREF(p);
                if (!bad) {
                    first[pairs] = last[pairs] = i;
                    pairs++;
                }
            }
        } else if (!bad) {
            Py_ssize_t p = PyLong_AsSsize_t(known);
            next[last[p]] = i;
            last[p] = i;
        }
        next[i] = -1;
        Py_XDECREF(key);
        Py_XDECREF(row);
        Py_XDECREF(cell);
        Py_XDECREF(at);
        Py_XDECREF(pair);
        if (bad) {
            PyMem_Free(last);
            goto done;
        }
    }
    PyMem_Free(last);
    /* each pair in the order its first row came: its rows in order, its state, its plain */
    PyObject *pair, *number;
    Py_ssize_t pos = 0;
    while (PyDict_Next(pair_of, &pos, &pair, &number)) {
        Py_ssize_t p = PyLong_AsSsize_t(number), count = 0;
        for (Py_ssize_t i = first[p]; i >= 0; i = next[i]) index[count++] = i;
        if (pack_pair(pair, index, count, q, rows, n, width, k, g, commits, states, plain) < 0)
            goto done;
    }
    out = PyTuple_Pack(4, fragments, origin, states, plain);
    goto done;
none:
    out = Py_NewRef(Py_None);
done:
    Py_XDECREF(fragments);
    Py_XDECREF(origin);
    Py_XDECREF(states);
    Py_XDECREF(plain);
    Py_XDECREF(pair_of);
    PyMem_Free(v);
    PyMem_Free(index);
    PyMem_Free(g);
    PyBuffer_Release(&kinds);
    PyBuffer_Release(&guards);
    return out;
}

static PyMethodDef methods[] = {
    {"combine", combine, METH_VARARGS,
     "combine(values, width, kinds, guards) -> the exact partial state of full-width fragments"},
    {"merge", merge, METH_O, "merge(states) -> one partial state"},
    {"report", report, METH_O,
     "report(states) -> [(col, kind, n, non_finite, value, exact)] of the states merged"},
    {"canonical", canonical, METH_VARARGS,
     "canonical(values, width, kinds, nan) -> the rows with canonical NaNs, or None"},
    {"pack", pack, METH_VARARGS,
     "pack(steps, ranks, seqs, rows, world_size, commits, kinds, guards, width) -> "
     "(fragments, origin, states, plain), or None"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "_partial",
    .m_doc = "Exact partial states, compiled (see partial.py).",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC PyInit__partial(void) { return PyModule_Create(&module); }
