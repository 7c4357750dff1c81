/* The block-FP8 -> UE8M0 requant of one matrix, compiled: the recipe of docs/requant.md, step for step.
 *
 * Within a 128x128 block every code goes through the same function, so for each block this finds the
 * largest code, computes the block's new power-of-two scale and its table of new codes from the recipe's
 * float32 operations (the same operations, in the same order, as the numpy version in lookup.py and the
 * torch recipe in ue8m0.py; tests/requant/test_requant_lookup.py compares all three), and sends every code
 * through that table. It releases the GIL, so one thread per core runs in parallel. Without this module
 * (no C compiler when the package was built) lookup.py computes the same bytes in numpy, more slowly.
 *
 * IEEE float32 throughout: products and the quotient amax / 448 are single float operations (no fused
 * multiply-add can arise: nothing is added), the bfloat16 and fp8 roundings are done on the bits, round
 * to nearest even.
 *
 * Layout: codes and q are C-contiguous [rows, cols] uint8 matrices; scale and sf are C-contiguous
 * [ceil(rows/128), ceil(cols/128)] float32; the last row and column of blocks may be partial. A table holds
 * the new codes of the codes 0x00-0x7F; codes 0x80-0xFF are their negatives and every step of the recipe is
 * symmetric, so code c becomes table[c & 0x7F] ^ (c & 0x80) (an exclusive or: with a scale of -0.0 the
 * table's own codes are -0). A negative scale is left to the torch path, which refuses it.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
#include <immintrin.h>
#define HAVE_AVX2_PATH 1
#endif

#if !defined(FLT_EVAL_METHOD) || FLT_EVAL_METHOD != 0
#error "float arithmetic must round to float after every operation (x87 excess precision would change bytes)"
#endif

#define BLOCK 128

static float e4m3_value[128]; /* the value of each non-negative fp8 code; 0x7F is NaN */

static uint32_t bits_of(float x) {
    uint32_t b;
    memcpy(&b, &x, 4);
    return b;
}

static float float_of(uint32_t b) {
    float x;
    memcpy(&x, &b, 4);
    return x;
}

/* float32 -> nearest bfloat16 (ties to even), kept as float32; for finite inputs. */
static float round_to_bfloat16(float x) {
    uint32_t b = bits_of(x);
    return float_of((b + 0x7FFFu + ((b >> 16) & 1u)) & 0xFFFF0000u);
}

/* float32 with |x| <= 448 -> float8_e4m3fn code, round to nearest even (as torch's cast). */
static uint8_t encode_e4m3(float x) {
    uint32_t b = bits_of(x);
    uint8_t sign = (uint8_t)((b >> 24) & 0x80u);
    float magnitude = fabsf(x);
    uint32_t m = bits_of(magnitude);
    int32_t exponent = (int32_t)(m >> 23) - 127;
    if (exponent < -6) /* fp8 subnormal: units of 2^-9, an exact scaling, then round half to even */
        return (uint8_t)((int32_t)nearbyintf(magnitude * 512.0f)) | sign;
    uint32_t mantissa = m & 0x7FFFFFu, top3 = mantissa >> 20, rest = mantissa & 0xFFFFFu;
    uint32_t up = rest > 0x80000u || (rest == 0x80000u && (top3 & 1u));
    /* A mantissa that rounds up past 7 carries into the exponent field: the codes are contiguous. */
    return (uint8_t)(((uint32_t)(exponent + 7) << 3) + top3 + up) | sign;
}

/* 2^ceil(log2(x)) for positive float32 x from the bits, biased exponent clamped to [1, 254] (DeepGEMM). */
static float pow2_ceil(float x) {
    uint32_t b = bits_of(x);
    int32_t biased = (int32_t)((b >> 23) & 0xFFu) + ((b & 0x7FFFFFu) != 0);
    biased = biased < 1 ? 1 : biased > 254 ? 254 : biased;
    return float_of((uint32_t)biased << 23);
}

/* One block's new scale and table, from its largest code and its scale; 0 when amax is not finite. */
static int block_table(uint8_t top, float scale, int sglang, uint8_t *table, float *sf_out) {
    float x_top = e4m3_value[top] * fabsf(scale); /* |code value * scale|: the scale may be -0.0 */
    if (sglang)
        x_top = round_to_bfloat16(x_top);
    if (!isfinite(x_top))
        return 0;
    float amax = x_top > 1e-4f ? x_top : 1e-4f; /* torch's clamp(min=1e-4), the same float32 value */
    float sf = pow2_ceil(amax / 448.0f);
    float inverse = 1.0f / sf; /* exact: sf is a power of two */
    for (int c = 0; c <= top; c++) {
        float x = e4m3_value[c] * scale;
        if (sglang)
            x = round_to_bfloat16(x);
        table[c] = encode_e4m3(x * inverse);
    }
    *sf_out = sf;
    return 1;
}

/* Codes of one row through its blocks' tables, a byte at a time for a partial last block. */
static void lookup_row_scalar(const uint8_t *row, uint8_t *out, Py_ssize_t cols, const uint8_t *t) {
    for (Py_ssize_t j0 = 0; j0 < cols; j0 += BLOCK, t += 128) {
        Py_ssize_t j1 = j0 + BLOCK < cols ? j0 + BLOCK : cols, j = j0;
        /* Eight codes per load and per store: about twice as fast as a byte at a time. Lane k of `in` maps
           to lane k of `r` whatever the byte order. */
        for (; j + 8 <= j1; j += 8) {
            uint64_t in, r = 0;
            memcpy(&in, row + j, 8);
            for (int lane = 0; lane < 64; lane += 8) {
                uint8_t code = (uint8_t)(in >> lane);
                r |= (uint64_t)(t[code & 0x7f] ^ (code & 0x80)) << lane;
            }
            memcpy(out + j, &r, 8);
        }
        for (; j < j1; j++)
            out[j] = t[row[j] & 0x7f] ^ (row[j] & 0x80);
    }
}

#ifdef HAVE_AVX2_PATH
/* The same with AVX2, 32 codes at a time, about 2.3x the scalar speed: a 128-entry table is eight 16-byte
   tables, one per value of the code's bits 4-6; pshufb looks up all 32 lanes in each, and the index is made
   to have its top bit set (pshufb then gives 0) in the lanes whose bits 4-6 select another table. */
__attribute__((target("avx2"))) static void lookup_row_avx2(const uint8_t *row, uint8_t *out, Py_ssize_t cols,
                                                            const uint8_t *t) {
    const __m256i magnitude = _mm256_set1_epi8(0x7f), sign = _mm256_set1_epi8((char)0x80);
    const __m256i push = _mm256_set1_epi8(0x70); /* x + 0x70 < 0x80 exactly when x < 16 */
    __m256i select[8];
    for (int h = 0; h < 8; h++)
        select[h] = _mm256_set1_epi8((char)(16 * h));
    for (Py_ssize_t j0 = 0; j0 < cols; j0 += BLOCK, t += 128) {
        if (cols - j0 < BLOCK) {
            lookup_row_scalar(row + j0, out + j0, cols - j0, t);
            break;
        }
        __m256i part[8];
        for (int h = 0; h < 8; h++)
            part[h] = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(t + 16 * h)));
        for (Py_ssize_t j = j0; j < j0 + BLOCK; j += 32) {
            __m256i x = _mm256_loadu_si256((const __m256i *)(row + j));
            __m256i m = _mm256_and_si256(x, magnitude);
            __m256i r = _mm256_setzero_si256();
            for (int h = 0; h < 8; h++) {
                __m256i index = _mm256_adds_epu8(_mm256_xor_si256(m, select[h]), push);
                r = _mm256_or_si256(r, _mm256_shuffle_epi8(part[h], index));
            }
            _mm256_storeu_si256((__m256i *)(out + j), _mm256_xor_si256(r, _mm256_and_si256(x, sign)));
        }
    }
}
#endif

/* The whole matrix; 0 when a block needs the elementwise torch path (a NaN code, a non-finite or negative
   scale, a non-finite amax).
   top and tables hold one row of blocks. */
static int requant(const uint8_t *codes, Py_ssize_t rows, Py_ssize_t cols, const float *scale, int sglang,
                   int avx2, uint8_t *q, float *sf, uint8_t *top, uint8_t *tables) {
    Py_ssize_t blocks_k = (cols + BLOCK - 1) / BLOCK;
    for (Py_ssize_t i0 = 0; i0 < rows; i0 += BLOCK) {
        Py_ssize_t i1 = i0 + BLOCK < rows ? i0 + BLOCK : rows;
        memset(top, 0, (size_t)blocks_k);
        for (Py_ssize_t i = i0; i < i1; i++) {
            const uint8_t *row = codes + i * cols;
            for (Py_ssize_t b = 0; b < blocks_k; b++) {
                Py_ssize_t j1 = (b + 1) * BLOCK < cols ? (b + 1) * BLOCK : cols;
                uint8_t m = top[b];
                for (Py_ssize_t j = b * BLOCK; j < j1; j++) {
                    uint8_t v = row[j] & 0x7f;
                    m = v > m ? v : m;
                }
                top[b] = m;
            }
        }
        const float *block_scale = scale + (i0 / BLOCK) * blocks_k;
        float *block_sf = sf + (i0 / BLOCK) * blocks_k;
        for (Py_ssize_t b = 0; b < blocks_k; b++) {
            if (top[b] == 0x7f || !isfinite(block_scale[b]) || block_scale[b] < 0.0f)
                return 0;
            if (!block_table(top[b], block_scale[b], sglang, tables + b * 128, block_sf + b))
                return 0;
        }
        for (Py_ssize_t i = i0; i < i1; i++) {
#ifdef HAVE_AVX2_PATH
            if (avx2) {
                lookup_row_avx2(codes + i * cols, q + i * cols, cols, tables);
                continue;
            }
#endif
            lookup_row_scalar(codes + i * cols, q + i * cols, cols, tables);
        }
    }
    return 1;
}

/* requant_matrix(codes, rows, cols, scale, sglang, q, sf, avx2=True) -> bool */
static PyObject *requant_matrix(PyObject *self, PyObject *args) {
    Py_buffer codes, scale, q, sf;
    Py_ssize_t rows, cols;
    int sglang, allow_avx2 = 1;
    if (!PyArg_ParseTuple(args, "y*nny*pw*w*|p", &codes, &rows, &cols, &scale, &sglang, &q, &sf, &allow_avx2))
        return NULL;
    Py_ssize_t blocks_k = (cols + BLOCK - 1) / BLOCK, blocks = ((rows + BLOCK - 1) / BLOCK) * blocks_k;
    const char *bad = NULL;
    if (rows < 0 || cols < 0)
        bad = "rows and cols must be >= 0";
    else if (codes.len != rows * cols || q.len != rows * cols)
        bad = "codes and q must hold rows x cols bytes";
    else if (scale.len != blocks * 4 || sf.len != blocks * 4)
        bad = "scale and sf must hold one float32 per 128x128 block";
    /* zeroed: table entries above a block's top are never used, but the AVX2 lookup loads them */
    uint8_t *work = bad ? NULL : PyMem_RawCalloc((size_t)blocks_k * 129 + 1, 1);
    if (!bad && work == NULL)
        bad = "out of memory";
    int ok = 0;
    if (!bad) {
        int avx2 = 0;
#ifdef HAVE_AVX2_PATH
        avx2 = allow_avx2 && __builtin_cpu_supports("avx2");
#endif
        Py_BEGIN_ALLOW_THREADS
        ok = requant((const uint8_t *)codes.buf, rows, cols, (const float *)scale.buf, sglang, avx2,
                     (uint8_t *)q.buf, (float *)sf.buf, work, work + blocks_k);
        Py_END_ALLOW_THREADS
        PyMem_RawFree(work);
    }
    PyBuffer_Release(&codes);
    PyBuffer_Release(&scale);
    PyBuffer_Release(&q);
    PyBuffer_Release(&sf);
    if (bad) {
        PyErr_SetString(PyExc_ValueError, bad);
        return NULL;
    }
    return PyBool_FromLong(ok);
}

static PyMethodDef methods[] = {
    {"requant_matrix", requant_matrix, METH_VARARGS,
     "requant_matrix(codes, rows, cols, scale, sglang, q, sf, avx2=True) -> bool: requantize one matrix into q and "
     "sf; False (q and sf incomplete) when a block holds a NaN code, a non-finite or negative scale or a non-finite "
     "amax."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_block_requant",
                                    "The block-FP8 -> UE8M0 requant of one matrix, compiled (see lookup.py).", -1,
                                    methods};

PyMODINIT_FUNC PyInit__block_requant(void) {
    for (int c = 0; c < 128; c++) {
        int exponent = (c >> 3) & 0xF, mantissa = c & 0x7;
        e4m3_value[c] = exponent == 0 ? ldexpf((float)mantissa, -9) : ldexpf(1.0f + mantissa / 8.0f, exponent - 7);
    }
    e4m3_value[0x7F] = NAN;
    return PyModule_Create(&module);
}
