/* CRC-32C (Castagnoli) for the native page core: the same function as the `crc32c` package
 * (init ~0, final ~0, chainable), so pages written by either path verify on the other.
 *
 * Why here and not the package: the core checks each page as its I/O lands, without the GIL,
 * inside the completion loop; calling back into Python per page is what it exists to avoid.
 * x86-64 with SSE4.2: three interleaved crc32q streams combined with shift tables (Mark Adler's
 * method), ~20 GB/s on one core; elsewhere a slice-by-8 table, chosen at run time. */
#include "_native.h"

#include <string.h>

#define POLY 0x82f63b78u
#define LONG_BLOCK 8192
#define SHORT_BLOCK 256

static uint32_t sw_table[8][256];
static uint32_t zeros_long[4][256], zeros_short[4][256];
static int use_hw = 0;

static uint32_t gf2_times(const uint32_t *mat, uint32_t vec) {
    uint32_t sum = 0;
    while (vec) {
        if (vec & 1) sum ^= *mat;
        vec >>= 1;
        mat++;
    }
    return sum;
}

static void gf2_square(uint32_t *square, const uint32_t *mat) {
    for (int n = 0; n < 32; n++) square[n] = gf2_times(mat, mat[n]);
}

/* The operator that appends `len` zero bytes to a CRC register (len a power of two). */
static void zeros_op(uint32_t *even, size_t len) {
    uint32_t odd[32];
    uint32_t row = 1;
    odd[0] = POLY; /* one zero bit */
    for (int n = 1; n < 32; n++) {
        odd[n] = row;
        row <<= 1;
    }
    gf2_square(even, odd); /* two bits */
    gf2_square(odd, even); /* four bits */
    do {
        gf2_square(even, odd); /* one byte, then 4, 16 ... */
        len >>= 1;
        if (len == 0) return;
        gf2_square(odd, even); /* two bytes, then 8, 32 ... */
        len >>= 1;
    } while (len);
    memcpy(even, odd, sizeof(odd));
}

static void zeros_tables(uint32_t zeros[][256], size_t len) {
    uint32_t op[32];
    zeros_op(op, len);
    for (uint32_t n = 0; n < 256; n++) {
        zeros[0][n] = gf2_times(op, n);
        zeros[1][n] = gf2_times(op, n << 8);
        zeros[2][n] = gf2_times(op, n << 16);
        zeros[3][n] = gf2_times(op, n << 24);
    }
}

static inline uint32_t shift(uint32_t zeros[][256], uint32_t crc) {
    return zeros[0][crc & 0xff] ^ zeros[1][(crc >> 8) & 0xff] ^ zeros[2][(crc >> 16) & 0xff] ^ zeros[3][crc >> 24];
}

static uint32_t crc_sw(uint32_t crc, const unsigned char *p, size_t len) {
    uint64_t c = crc ^ 0xffffffffu;
    while (len && ((uintptr_t)p & 7)) {
        c = sw_table[0][(c ^ *p++) & 0xff] ^ (c >> 8);
        len--;
    }
    while (len >= 8) {
        uint64_t w;
        memcpy(&w, p, 8);
#if __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
        w = __builtin_bswap64(w);
#endif
        c ^= w;
        c = sw_table[7][c & 0xff] ^ sw_table[6][(c >> 8) & 0xff] ^ sw_table[5][(c >> 16) & 0xff] ^
            sw_table[4][(c >> 24) & 0xff] ^ sw_table[3][(c >> 32) & 0xff] ^ sw_table[2][(c >> 40) & 0xff] ^
            sw_table[1][(c >> 48) & 0xff] ^ sw_table[0][c >> 56];
        p += 8;
        len -= 8;
    }
    while (len--) c = sw_table[0][(c ^ *p++) & 0xff] ^ (c >> 8);
    return (uint32_t)c ^ 0xffffffffu;
}

#if defined(__x86_64__)
#include <nmmintrin.h>

/* Three crc32q streams over consecutive `block`-byte thirds, joined by shifting (zero-appending)
 * the earlier ones: three independent dependency chains keep the CRC unit busy. */
__attribute__((target("sse4.2"))) static inline uint64_t interleave3(uint64_t c0, const unsigned char **pp,
                                                                      size_t *len, size_t block,
                                                                      uint32_t zeros[][256]) {
    const unsigned char *p = *pp;
    while (*len >= 3 * block) {
        const unsigned char *end = p + block;
        uint64_t c1 = 0, c2 = 0;
        do {
            uint64_t a, b, d;
            memcpy(&a, p, 8);
            memcpy(&b, p + block, 8);
            memcpy(&d, p + 2 * block, 8);
            c0 = _mm_crc32_u64(c0, a);
            c1 = _mm_crc32_u64(c1, b);
            c2 = _mm_crc32_u64(c2, d);
            p += 8;
        } while (p < end);
        c0 = shift(zeros, (uint32_t)c0) ^ (uint32_t)c1;
        c0 = shift(zeros, (uint32_t)c0) ^ (uint32_t)c2;
        p += 2 * block;
        *len -= 3 * block;
    }
    *pp = p;
    return c0;
}

__attribute__((target("sse4.2"))) static uint32_t crc_hw(uint32_t crc, const unsigned char *p, size_t len) {
    uint64_t c0 = crc ^ 0xffffffffu;
    while (len && ((uintptr_t)p & 7)) {
        c0 = _mm_crc32_u8((uint32_t)c0, *p++);
        len--;
    }
    c0 = interleave3(c0, &p, &len, LONG_BLOCK, zeros_long);
    c0 = interleave3(c0, &p, &len, SHORT_BLOCK, zeros_short);
    while (len >= 8) {
        uint64_t a;
        memcpy(&a, p, 8);
        c0 = _mm_crc32_u64(c0, a);
        p += 8;
        len -= 8;
    }
    while (len--) c0 = _mm_crc32_u8((uint32_t)c0, *p++);
    return (uint32_t)c0 ^ 0xffffffffu;
}
#endif

void rt_crc32c_init(void) {
    for (uint32_t n = 0; n < 256; n++) {
        uint32_t c = n;
        for (int k = 0; k < 8; k++) c = c & 1 ? (c >> 1) ^ POLY : c >> 1;
        sw_table[0][n] = c;
    }
    for (uint32_t n = 0; n < 256; n++) {
        uint32_t c = sw_table[0][n];
        for (int k = 1; k < 8; k++) {
            c = sw_table[0][c & 0xff] ^ (c >> 8);
            sw_table[k][n] = c;
        }
    }
    zeros_tables(zeros_long, LONG_BLOCK);
    zeros_tables(zeros_short, SHORT_BLOCK);
#if defined(__x86_64__)
    __builtin_cpu_init();
    use_hw = __builtin_cpu_supports("sse4.2") != 0;
#endif
}

int rt_crc32c_hardware(void) { return use_hw; }

uint32_t rt_crc32c(uint32_t crc, const void *buf, size_t len) {
#if defined(__x86_64__)
    if (use_hw) return crc_hw(crc, (const unsigned char *)buf, len);
#endif
    return crc_sw(crc, (const unsigned char *)buf, len);
}
