/* The two per-element loops of the block-FP8 requant, compiled: block maxima and per-block table lookups.
 *
 * Only data movement lives here. The recipe's arithmetic (the table of new codes of each 128x128 block) is
 * computed in numpy by shardprep/requant/lookup.py, the one implementation of the recipe on the CPU; these
 * loops find each block's largest code and send every code through its block's table. Both release the
 * GIL, so one thread per core runs them in parallel. Without this module (no C compiler at install time)
 * lookup.py does the same in numpy and bytes.translate, with identical results, more slowly.
 *
 * Layout: codes and out are C-contiguous [rows, cols] uint8 matrices; blocks are 128x128, the last row and
 * column of blocks may be partial; top is [ceil(rows/128), ceil(cols/128)] uint8; tables is
 * [ceil(rows/128), ceil(cols/128), 128] uint8, the new codes of the block's codes 0x00-0x7F. Codes 0x80-0xFF
 * are their negatives, and every step of the recipe is symmetric, so code c becomes table[c & 0x7F] | (c & 0x80).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
#include <immintrin.h>
#define HAVE_AVX2_PATH 1
#endif

#define BLOCK 128

static int check_sizes(Py_ssize_t rows, Py_ssize_t cols, Py_buffer *codes, Py_buffer *other, Py_ssize_t per_block,
                       const char *other_name) {
    if (rows < 0 || cols < 0) {
        PyErr_SetString(PyExc_ValueError, "rows and cols must be >= 0");
        return -1;
    }
    Py_ssize_t blocks = ((rows + BLOCK - 1) / BLOCK) * ((cols + BLOCK - 1) / BLOCK);
    if (codes->len != rows * cols) {
        PyErr_Format(PyExc_ValueError, "codes: %zd bytes for a %zd x %zd matrix", codes->len, rows, cols);
        return -1;
    }
    if (other->len != blocks * per_block) {
        PyErr_Format(PyExc_ValueError, "%s: %zd bytes, expected %zd", other_name, other->len, blocks * per_block);
        return -1;
    }
    return 0;
}

/* block_top(codes, rows, cols, top): top[i, j] = max of (code & 0x7f) over block (i, j). */
static PyObject *block_top(PyObject *self, PyObject *args) {
    Py_buffer codes, top;
    Py_ssize_t rows, cols;
    if (!PyArg_ParseTuple(args, "y*nnw*", &codes, &rows, &cols, &top))
        return NULL;
    if (check_sizes(rows, cols, &codes, &top, 1, "top") < 0) {
        PyBuffer_Release(&codes);
        PyBuffer_Release(&top);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    const uint8_t *c = (const uint8_t *)codes.buf;
    uint8_t *t = (uint8_t *)top.buf;
    Py_ssize_t blocks_k = (cols + BLOCK - 1) / BLOCK;
    memset(t, 0, (size_t)top.len);
    for (Py_ssize_t i = 0; i < rows; i++) {
        const uint8_t *row = c + i * cols;
        uint8_t *trow = t + (i / BLOCK) * blocks_k;
        for (Py_ssize_t b = 0; b < blocks_k; b++) {
            Py_ssize_t j0 = b * BLOCK, j1 = j0 + BLOCK < cols ? j0 + BLOCK : cols;
            uint8_t m = trow[b];
            for (Py_ssize_t j = j0; j < j1; j++) {
                uint8_t v = row[j] & 0x7f;
                m = v > m ? v : m;
            }
            trow[b] = m;
        }
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&codes);
    PyBuffer_Release(&top);
    Py_RETURN_NONE;
}

/* One row's codes through its blocks' tables (a byte at a time for a partial last block). */
static void apply_row_scalar(const uint8_t *row, uint8_t *orow, Py_ssize_t cols, const uint8_t *t) {
    for (Py_ssize_t j0 = 0; j0 < cols; j0 += BLOCK, t += 128) {
        Py_ssize_t j1 = j0 + BLOCK < cols ? j0 + BLOCK : cols, j = j0;
        /* Eight codes per load and per store: about twice as fast as a byte at a time. Lane k of `in` maps
           to lane k of `r` whatever the byte order. */
        for (; j + 8 <= j1; j += 8) {
            uint64_t in, r = 0;
            memcpy(&in, row + j, 8);
            for (int lane = 0; lane < 64; lane += 8) {
                uint8_t code = (uint8_t)(in >> lane);
                r |= (uint64_t)(t[code & 0x7f] | (code & 0x80)) << lane;
            }
            memcpy(orow + j, &r, 8);
        }
        for (; j < j1; j++)
            orow[j] = t[row[j] & 0x7f] | (row[j] & 0x80);
    }
}

#ifdef HAVE_AVX2_PATH
/* The same with AVX2, 32 codes at a time, about 2.3x the scalar speed: a 128-entry table is eight 16-byte
   tables, one per value of the code's bits 4-6; pshufb looks up all 32 lanes in each, and the index is made
   to have its top bit set (pshufb then gives 0) in the lanes whose bits 4-6 select another table. */
__attribute__((target("avx2"))) static void apply_row_avx2(const uint8_t *row, uint8_t *orow, Py_ssize_t cols,
                                                           const uint8_t *t) {
    const __m256i magnitude = _mm256_set1_epi8(0x7f), sign = _mm256_set1_epi8((char)0x80);
    const __m256i push = _mm256_set1_epi8(0x70); /* x + 0x70 < 0x80 exactly when x < 16 */
    __m256i select[8];
    for (int h = 0; h < 8; h++)
        select[h] = _mm256_set1_epi8((char)(16 * h));
    for (Py_ssize_t j0 = 0; j0 < cols; j0 += BLOCK, t += 128) {
        Py_ssize_t j1 = j0 + BLOCK < cols ? j0 + BLOCK : cols, j = j0;
        if (j1 - j0 < BLOCK) {
            apply_row_scalar(row + j0, orow + j0, j1 - j0, t);
            break;
        }
        __m256i part[8];
        for (int h = 0; h < 8; h++)
            part[h] = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(t + 16 * h)));
        for (; j < j1; j += 32) {
            __m256i x = _mm256_loadu_si256((const __m256i *)(row + j));
            __m256i m = _mm256_and_si256(x, magnitude);
            __m256i r = _mm256_and_si256(x, sign);
            for (int h = 0; h < 8; h++) {
                __m256i index = _mm256_adds_epu8(_mm256_xor_si256(m, select[h]), push);
                r = _mm256_or_si256(r, _mm256_shuffle_epi8(part[h], index));
            }
            _mm256_storeu_si256((__m256i *)(orow + j), r);
        }
    }
}
#endif

static PyObject *apply(PyObject *args, int allow_avx2) {
    Py_buffer codes, tables, out;
    Py_ssize_t rows, cols;
    if (!PyArg_ParseTuple(args, "y*nny*w*", &codes, &rows, &cols, &tables, &out))
        return NULL;
    int bad = check_sizes(rows, cols, &codes, &tables, 128, "tables");
    if (!bad && out.len != codes.len) {
        PyErr_Format(PyExc_ValueError, "out: %zd bytes, expected %zd", out.len, codes.len);
        bad = -1;
    }
    if (!bad) {
        int avx2 = 0;
#ifdef HAVE_AVX2_PATH
        avx2 = allow_avx2 && __builtin_cpu_supports("avx2");
#endif
        Py_BEGIN_ALLOW_THREADS
        const uint8_t *c = (const uint8_t *)codes.buf, *tab = (const uint8_t *)tables.buf;
        uint8_t *o = (uint8_t *)out.buf;
        Py_ssize_t blocks_k = (cols + BLOCK - 1) / BLOCK;
        for (Py_ssize_t i = 0; i < rows; i++) {
            const uint8_t *t = tab + (i / BLOCK) * blocks_k * 128;
#ifdef HAVE_AVX2_PATH
            if (avx2) {
                apply_row_avx2(c + i * cols, o + i * cols, cols, t);
                continue;
            }
#endif
            apply_row_scalar(c + i * cols, o + i * cols, cols, t);
        }
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&codes);
    PyBuffer_Release(&tables);
    PyBuffer_Release(&out);
    if (bad)
        return NULL;
    Py_RETURN_NONE;
}

/* apply_tables(codes, rows, cols, tables, out): out[r, c] = tables[r // 128, c // 128, code & 0x7F] | (code & 0x80). */
static PyObject *apply_tables(PyObject *self, PyObject *args) { return apply(args, 1); }

/* apply_tables_scalar: the same without AVX2, so that the tests can compare the two. */
static PyObject *apply_tables_scalar(PyObject *self, PyObject *args) { return apply(args, 0); }

static PyMethodDef methods[] = {
    {"block_top", block_top, METH_VARARGS,
     "block_top(codes, rows, cols, top): the largest (code & 0x7f) of every 128x128 block, into top."},
    {"apply_tables", apply_tables, METH_VARARGS,
     "apply_tables(codes, rows, cols, tables, out): every code through its block's 128-byte table, into out."},
    {"apply_tables_scalar", apply_tables_scalar, METH_VARARGS, "apply_tables without AVX2 (for the tests)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_block_lookup",
                                    "Compiled loops of the block-FP8 requant (see lookup.py).", -1, methods};

PyMODINIT_FUNC PyInit__block_lookup(void) { return PyModule_Create(&module); }
