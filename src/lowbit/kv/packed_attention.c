/* Decode attention over packed KV pages, on the CPU (lowbit.kv.native builds and loads this).

   A page holds the codes of B x H_kv x T token rows of D channels, packed per row as a little-endian
   bit stream (lowbit.formats.packing's plain order), and the statistics that turn a code into a
   value:

       value = (level[code] - zero) * scale + offset

   level: a table of 2^bits floats (one, or one per channel: KVQuant's codebooks), or the code
   itself plus a bias (integer formats; the bias is -2^(bits-1) when symmetric). zero, scale and
   offset are each absent (0, 1, 0) or one value per (batch row, head, token group, channel
   group), read through strides in fp16, fp32 or uint8. Sparse outliers (KVQuant: CSR rows in
   token-major order, one per (token, batch row); each word is channel h*D+d << 16 | fp16 bits)
   replace the values of their channels. Pre-RoPE keys are rotated (rotate-half pairing) at
   their positions from cos/sin tables after decoding. A codebook page with per-channel ranges
   (KVQuant's keys) has each channel's 2^bits values tabulated once a head, and a row is decoded
   by table lookups.

   Two passes over a layer's pages: lb_scores writes q . k * scaling for every token into a score
   row; lb_accumulate adds p_t * v_t into an accumulator. lb_attend is a decode step's whole
   attention for a layer in one call: both passes, the fp tokens beside the pages (sink, fp
   window), the mask and the softmax between them. Nothing larger than one token row is ever
   decoded (with AVX-512, 16 tokens of each head: see "Token tiles" below). Arithmetic is float32, and decoding and
   rotation are written without fused multiply-adds (built with -ffp-contract=off), so a decoded
   value and a rotated key equal torch's bit for bit; the dot products' sums come in another
   order (the tiles' with fused multiply-adds).

   4-bit integer pages without a codebook or outliers (kv-int, QuaRot's cache) take a shorter
   road: with value = (c - z) * s + o over a channel group g,
       q . k = s * sum_g(q_d c_d) + ((bias - z) * s + o) * sum_g(q_d),
   so a key row costs one multiply-add per code (the query's sums per group are computed once),
   and the values add (p_t s) c_t per code plus one constant per group. The codes are read as
   two runs, low nibbles (even channels) and high nibbles (odd channels), against the query and
   accumulator split the same way.

   Threads: a call's tokens, over all its pages, are split into one contiguous range per thread;
   accumulation gives each thread its own accumulator, summed in thread order. In lb_attend each
   thread's range of slots is a whole flash-decoding split (its scores, its own softmax maximum
   and sum, its weighted sums), the splits merged at the end. The threads are
   OpenMP's: loaded into a process that has torch, the library binds to torch's own OpenMP
   runtime (the same soname), so its threads are torch's pool and the two never compete. */

#include <stdint.h>
#include <stdlib.h>
#include <math.h>
#include <string.h>

#define LB_MAX_DIM 512
#define LB_MAX_THREADS 64
#define LB_MAX_GROUPS 64
#define LB_TABLE 16384 /* floats: a page's per-channel value table, dim x 2^bits */

enum { LB_NONE = 0, LB_F16 = 1, LB_F32 = 2, LB_U8 = 3, LB_BF16 = 4 };

typedef struct {
    const void *data; /* NULL: absent */
    int32_t dtype;    /* LB_F16, LB_F32 or LB_U8 */
    int32_t pad;
    int64_t stride[4]; /* elements: batch row, head, token group, channel group */
} lb_stat;

typedef struct {
    int64_t batch, heads, tokens, dim;
    const uint8_t *codes;
    int64_t code_stride[3]; /* bytes: batch row, head, token; a row's bytes are contiguous */
    int32_t bits;
    int32_t levels_per_channel; /* levels holds heads * dim tables of 2^bits (else one) */
    const float *levels;        /* NULL: level = code + level_bias */
    float level_bias;
    int32_t token_group, channel_group;
    lb_stat scale, zero, offset;
    const int32_t *row_ptr; /* NULL: no outliers; else tokens * batch + 1 entries */
    const int32_t *col_val;
} lb_page;

typedef struct {
    const float *cos, *sin; /* [positions, dim] float32, NULL: keys are cached after RoPE */
    const int32_t *positions; /* [batch, positions_stride]: the slot's position */
    int64_t positions_stride;
    /* the same tables in blocks of 16 positions, [blocks, block_channels, 16] (position p, channel
       i at ((p / 16) * block_channels + i) * 16 + p % 16), blocks covering every position plus
       one; block_channels is dim, or dim / 2 where the tables' two halves are equal (then only
       the first is kept). NULL: not given (token tiles are then not used for pre-RoPE keys). */
    const float *cos_blocks, *sin_blocks;
    int64_t block_channels;
} lb_rope;

#ifdef __F16C__
#include <immintrin.h>
static float lb_half(uint16_t h) { return _cvtsh_ss(h); }
#else
static float lb_half(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (man << 13);
    } else if (exp != 0) {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    } else if (man == 0) {
        bits = sign;
    } else { /* subnormal: normalize */
        exp = 113;
        while (!(man & 0x400)) {
            man <<= 1;
            exp--;
        }
        bits = sign | (exp << 23) | ((man & 0x3ff) << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}
#endif

static float lb_stat_at(const lb_stat *s, int64_t b, int64_t h, int64_t tg, int64_t cg, float absent) {
    if (!s->data) return absent;
    int64_t i = b * s->stride[0] + h * s->stride[1] + tg * s->stride[2] + cg * s->stride[3];
    switch (s->dtype) {
        case LB_F16: return lb_half(((const uint16_t *)s->data)[i]);
        case LB_F32: return ((const float *)s->data)[i];
        default: return (float)((const uint8_t *)s->data)[i];
    }
}

/* The codes of row (b, h, t) of a page. */
static const uint8_t *lb_row(const lb_page *pg, int64_t b, int64_t h, int64_t t) {
    return pg->codes + b * pg->code_stride[0] + h * pg->code_stride[1] + t * pg->code_stride[2];
}

/* The statistics of one (batch row, head, token group), spread over the channels: read once per
   token group, not once per channel and token (per-channel ranges once per head of a page). */
typedef struct {
    int64_t b, h, tg; /* whose they are; b = -1: none yet */
    float zero[LB_MAX_DIM], scale[LB_MAX_DIM], offset[LB_MAX_DIM];
    int table_ready;       /* value = table[channel][code] */
    float table[LB_TABLE]; /* [dim][2^bits] */
    float table16[LB_MAX_DIM * 16]; /* bits <= 4: table padded to 16 levels, level l -> l mod 2^bits */
} lb_stats;

/* v = (v - zero) * scale + offset over d channels, each part only where the page has it (torch's
   operations, each rounded to float32). */
static void lb_affine(const lb_page *pg, float *v, const float *z, const float *s, const float *o, int64_t d) {
    if (pg->zero.data)
        for (int64_t i = 0; i < d; i++) v[i] -= z[i];
    if (pg->scale.data || pg->zero.data)
        for (int64_t i = 0; i < d; i++) v[i] *= s[i];
    if (pg->offset.data)
        for (int64_t i = 0; i < d; i++) v[i] += o[i];
}

/* Level of `code` in channel i of head h. */
static inline float lb_level(const lb_page *pg, int64_t h, int64_t i, int code) {
    if (!pg->levels) return (float)code + pg->level_bias;
    return pg->levels_per_channel ? pg->levels[(h * pg->dim + i) * ((int64_t)1 << pg->bits) + code] : pg->levels[code];
}

/* Whether the page's statistics change from token group to token group (else one set a head). */
static int lb_token_stats(const lb_page *pg) {
    return pg->scale.stride[2] || pg->zero.stride[2] || pg->offset.stride[2];
}

static void lb_load_stats(const lb_page *pg, int64_t b, int64_t h, int64_t tg, lb_stats *st) {
    /* statistics without a token (or batch) axis, per-channel ranges, are read once a head */
    const int shared = !lb_token_stats(pg);
    if (shared) tg = 0;
    if (!(pg->scale.stride[0] || pg->zero.stride[0] || pg->offset.stride[0])) b = 0;
    if (st->b == b && st->h == h && st->tg == tg) return;
    st->b = b, st->h = h, st->tg = tg;
    const int64_t cg = pg->channel_group;
    for (int64_t g = 0; g * cg < pg->dim; g++) {
        const float z = lb_stat_at(&pg->zero, b, h, tg, g, 0.0f);
        const float s = lb_stat_at(&pg->scale, b, h, tg, g, 1.0f);
        const float o = lb_stat_at(&pg->offset, b, h, tg, g, 0.0f);
        for (int64_t i = g * cg; i < (g + 1) * cg; i++) st->zero[i] = z, st->scale[i] = s, st->offset[i] = o;
    }
    /* a codebook's levels shared by every token: each channel's 2^bits values once, then a row
       is table lookups (integer levels stay arithmetic: vector code, no gathers) */
    const int64_t n = (int64_t)1 << pg->bits;
    st->table_ready = pg->levels && shared && pg->dim * n <= LB_TABLE;
    if (!st->table_ready) return;
    float v[LB_MAX_DIM];
    for (int64_t c = 0; c < n; c++) {
        for (int64_t i = 0; i < pg->dim; i++) v[i] = lb_level(pg, h, i, (int)c);
        lb_affine(pg, v, st->zero, st->scale, st->offset, pg->dim);
        for (int64_t i = 0; i < pg->dim; i++) st->table[i * n + c] = v[i];
    }
    if (pg->bits <= 4)
        for (int64_t i = 0; i < pg->dim; i++)
            for (int64_t l = 0; l < 16; l++) st->table16[i * 16 + l] = st->table[i * n + (l & (n - 1))];
}

/* Row (b, h, t) of the page, decoded into out[dim]. */
static void lb_decode_row(const lb_page *pg, int64_t b, int64_t h, int64_t t, lb_stats *st, float *out) {
    const int64_t d = pg->dim;
    const uint8_t *row = lb_row(pg, b, h, t);
    uint8_t idx[LB_MAX_DIM];
    if (pg->bits == 8) {
        memcpy(idx, row, (size_t)d);
    } else if (pg->bits == 4) {
        for (int64_t i = 0; i < d / 2; i++) {
            idx[2 * i] = row[i] & 15;
            idx[2 * i + 1] = row[i] >> 4;
        }
        if (d & 1) idx[d - 1] = row[d / 2] & 15;
    } else if (pg->bits == 2) {
        for (int64_t i = 0; i < d; i++) idx[i] = (row[i >> 2] >> ((i & 3) * 2)) & 3;
    } else if (d % 8 == 0) { /* 3, 5, 6, 7 bits: every 8 codes fill `bits` whole bytes */
        const uint64_t mask = (1u << pg->bits) - 1;
        for (int64_t c = 0; c < d / 8; c++) {
            uint64_t word = 0;
            for (int j = 0; j < pg->bits; j++) word |= (uint64_t)row[c * pg->bits + j] << (8 * j);
            for (int l = 0; l < 8; l++) idx[c * 8 + l] = (uint8_t)((word >> (l * pg->bits)) & mask);
        }
    } else {
        const int64_t nbytes = (d * pg->bits + 7) / 8;
        const unsigned mask = (1u << pg->bits) - 1;
        for (int64_t i = 0; i < d; i++) {
            int64_t bit = i * pg->bits, byte = bit >> 3;
            unsigned word = row[byte] | (byte + 1 < nbytes ? (unsigned)row[byte + 1] << 8 : 0u);
            idx[i] = (uint8_t)((word >> (bit & 7)) & mask);
        }
    }
    if (pg->channel_group == d && pg->levels && !pg->levels_per_channel &&
        lb_token_stats(pg)) {
        /* one group of statistics a token over a shared codebook (KVQuant's per-token values):
           three scalars instead of a row of each, lb_affine's operations in its order */
        const int64_t tg = t / pg->token_group;
        const float z = lb_stat_at(&pg->zero, b, h, tg, 0, 0.0f), sc = lb_stat_at(&pg->scale, b, h, tg, 0, 1.0f);
        const float o = lb_stat_at(&pg->offset, b, h, tg, 0, 0.0f);
        const int has_z = pg->zero.data != NULL, has_s = has_z || pg->scale.data, has_o = pg->offset.data != NULL;
        for (int64_t i = 0; i < d; i++) {
            float v = pg->levels[idx[i]];
            if (has_z) v -= z;
            if (has_s) v *= sc;
            if (has_o) v += o;
            out[i] = v;
        }
    } else if (lb_load_stats(pg, b, h, t / pg->token_group, st), st->table_ready) {
        const int64_t n = (int64_t)1 << pg->bits;
        for (int64_t i = 0; i < d; i++) out[i] = st->table[i * n + idx[i]];
    } else {
        for (int64_t i = 0; i < d; i++) out[i] = lb_level(pg, h, i, idx[i]);
        lb_affine(pg, out, st->zero, st->scale, st->offset, d);
    }
    if (pg->row_ptr) {
        const int64_t r = t * pg->batch + b, base = pg->row_ptr[0], first = h * d;
        for (int64_t e = pg->row_ptr[r] - base; e < pg->row_ptr[r + 1] - base; e++) {
            const uint32_t word = (uint32_t)pg->col_val[e];
            const int64_t channel = (int64_t)(word >> 16) - first; /* this head's: 0 <= channel < d */
            if (channel >= 0 && channel < d) out[channel] = lb_half((uint16_t)(word & 0xffff));
        }
    }
}

/* k * cos + rotate_half(k) * sin at the slot's position (torch's order of operations). */
static void lb_rotate(const lb_rope *rope, int64_t b, int64_t slot, int64_t d, const float *k, float *out) {
    const int64_t p = rope->positions[b * rope->positions_stride + slot];
    const float *c = rope->cos + p * d, *s = rope->sin + p * d;
    const int64_t half = d / 2;
    for (int64_t i = 0; i < half; i++) out[i] = k[i] * c[i] + (-k[i + half]) * s[i];
    for (int64_t i = half; i < d; i++) out[i] = k[i] * c[i] + k[i - half] * s[i];
}

static float lb_dot(const float *a, const float *b, int64_t d) {
    float lanes[8] = {0};
    int64_t i = 0;
    for (; i + 8 <= d; i += 8)
        for (int l = 0; l < 8; l++) lanes[l] += a[i + l] * b[i + l];
    float sum = 0.0f;
    for (; i < d; i++) sum += a[i] * b[i];
    for (int l = 0; l < 8; l++) sum += lanes[l];
    return sum;
}

/* Token tiles (AVX-512): 16 tokens of a head in the lanes of a vector.

   A page of at most 4 bits (KVQuant's keys and values, kv-int's per-token rows) is decoded 16
   tokens at a time, channel by channel: the tile's code words are transposed once (word w of
   the 16 rows in one vector), each channel's 16 codes shifted out of them and looked up by one
   permute in a 16-entry table: the channel's value table (statistics shared by every token), or
   the shared codebook or integer levels followed by each token's statistics. These are
   lb_decode_row's float32 operations, so the values are the same bits. Outliers are patched
   into the tiles of all heads in one pass, pre-RoPE keys rotated with the cos/sin of the 16
   positions (from the tables in blocks of 16 positions: two loads and a permute when the
   positions run consecutively, else gathers), and a score vector is the sum over channels of
   q_d times the 16 tokens' k_d; values add p(token) v_d(token) into 16-lane accumulators,
   summed across the lanes once a batch row. 4-bit pages whose dim is a multiple of 16 and 3-bit
   pages whose dim is a multiple of 32 (the usual cases: KVQuant 3 and 4, kv-int 4 at head dims
   64 and 128) skip the decoded tile in memory: each channel's values go from the permute into
   the multiply-adds, and the outliers are blended in by masked loads (lb_fused). The value
   tables are built once a call for the pages that share them. */
#if defined(__AVX512F__)
#include <immintrin.h> /* again: F16C may be absent */
#define LB_TILE 16
#define LB_MAX_WORDS (LB_MAX_DIM * 4 / 32)

/* Statistics that change from token group to token group but not inside a 16-token tile, per
   channel or channel group (KIVI's keys: per channel over 32 tokens): each channel's values are
   tabulated once a token group, for every head (lb_group_tables). */
static int lb_group_tables_page(const lb_page *pg) {
    return lb_token_stats(pg) && pg->channel_group != pg->dim && pg->token_group % LB_TILE == 0 &&
           !pg->levels_per_channel;
}

/* The tile road applies: codes of at most 4 bits, and either a codebook with statistics shared
   by every token (lb_load_stats' value table), statistics constant over a tile
   (lb_group_tables_page), or statistics a token (or token group) over a shared codebook or
   integer levels, one set a row or a group of at least 16 channels (KVQuant's values, kv-int's
   per-token rows, KIVI's values in groups of channels; each group's are read for 16 tokens). */
static int lb_tile_page(const lb_page *pg) {
    if (pg->bits > 4) return 0;
    const int token_stats = lb_token_stats(pg);
    if (!token_stats) return pg->levels && pg->dim * ((int64_t)1 << pg->bits) <= LB_TABLE;
    if (pg->levels_per_channel) return 0;
    return pg->channel_group == pg->dim || pg->channel_group >= 16 || lb_group_tables_page(pg);
}

/* Statistic s of tokens t..t+15 of row (b, h) in channel group cg, one a token: a vector load
   where they lie one a token side by side in fp16 or fp32, else one by one. */
static __m512 lb_tile_stat(const lb_stat *s, const lb_page *pg, int64_t b, int64_t h, int64_t t, int64_t cg,
                           float absent) {
    if (!s->data) return _mm512_set1_ps(absent);
    if (pg->token_group == 1 && s->stride[2] == 1 && s->dtype != LB_U8) {
        const int64_t at = b * s->stride[0] + h * s->stride[1] + t + cg * s->stride[3];
        if (s->dtype == LB_F16) return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)s->data + at)));
        return _mm512_loadu_ps((const float *)s->data + at);
    }
    float v[LB_TILE];
    for (int j = 0; j < LB_TILE; j++) v[j] = lb_stat_at(s, b, h, (t + j) / pg->token_group, cg, absent);
    return _mm512_loadu_ps(v);
}

/* Every head's value tables [head][channel][16] of batch row b in token group tg (pages of
   lb_group_tables_page): lb_decode_row's value of each code, level l -> l mod 2^bits. */
static void lb_group_tables(const lb_page *pg, int64_t b, int64_t tg, float *tables) {
    const int64_t d = pg->dim, n = (int64_t)1 << pg->bits;
    for (int64_t h = 0; h < pg->heads; h++)
        for (int64_t i = 0; i < d; i++) {
            const int64_t g = i / pg->channel_group;
            const float z = lb_stat_at(&pg->zero, b, h, tg, g, 0.0f), sc = lb_stat_at(&pg->scale, b, h, tg, g, 1.0f);
            const float o = lb_stat_at(&pg->offset, b, h, tg, g, 0.0f);
            float *row = tables + (h * d + i) * 16;
            for (int64_t l = 0; l < 16; l++) { /* lb_affine's operations, in its order */
                float v = lb_level(pg, h, i, (int)(l & (n - 1)));
                if (pg->zero.data) v -= z;
                if (pg->scale.data || pg->zero.data) v *= sc;
                if (pg->offset.data) v += o;
                row[l] = v;
            }
        }
}

/* The code words of tokens t..t+15 of row (b, h) transposed: words[w][j] is word w of token t+j's
   row (the rows' last bytes zero-padded to a word). Rows of whole 8 words are transposed by
   shuffles 8 words at a time, others 4 words at a time, and the words left by gathers. */
static void lb_tile_words(const lb_page *pg, int64_t b, int64_t h, int64_t t, uint32_t (*words)[LB_TILE]) {
    const int64_t d = pg->dim, bits = pg->bits, row_bytes = (d * bits + 7) / 8, full = row_bytes / 4;
    const uint8_t *row0 = lb_row(pg, b, h, t);
    const int64_t step = pg->code_stride[2];
    if (full % 8 == 0) { /* blocks of 8 words: two 8 x 8 transposes side by side, no gathers */
        for (int64_t w0 = 0; w0 < full; w0 += 8) {
            __m512i r[8], u[8], v[8]; /* r[k]: words w0.. of rows k and k + 8 */
            for (int k = 0; k < 8; k++)
                r[k] = _mm512_inserti64x4(
                    _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(row0 + k * step + 4 * w0))),
                    _mm256_loadu_si256((const __m256i *)(row0 + (k + 8) * step + 4 * w0)), 1);
            for (int k = 0; k < 8; k += 2) { /* pairs of rows interleaved by word, in each 128 bits */
                u[k] = _mm512_unpacklo_epi32(r[k], r[k + 1]);
                u[k + 1] = _mm512_unpackhi_epi32(r[k], r[k + 1]);
            }
            for (int k = 0; k < 8; k += 4) { /* v[k + j], 128 bits l: word j (l even) or j + 4 of 4 rows */
                v[k] = _mm512_unpacklo_epi64(u[k], u[k + 2]);
                v[k + 1] = _mm512_unpackhi_epi64(u[k], u[k + 2]);
                v[k + 2] = _mm512_unpacklo_epi64(u[k + 1], u[k + 3]);
                v[k + 3] = _mm512_unpackhi_epi64(u[k + 1], u[k + 3]);
            }
            const __m512i lo = _mm512_setr_epi64(0, 1, 8, 9, 4, 5, 12, 13), hi = _mm512_setr_epi64(2, 3, 10, 11, 6, 7, 14, 15);
            for (int k = 0; k < 4; k++) { /* rows 0-3, 4-7, 8-11, 12-15 of a word */
                _mm512_storeu_si512(words[w0 + k], _mm512_permutex2var_epi64(v[k], lo, v[k + 4]));
                _mm512_storeu_si512(words[w0 + k + 4], _mm512_permutex2var_epi64(v[k], hi, v[k + 4]));
            }
        }
    } else if (step <= INT32_MAX / LB_TILE) {
        int64_t w = 0;
        for (; w + 4 <= full; w += 4) { /* blocks of 4 words: one 4 x 4 transpose in each 128 bits */
            __m512i r[4], u[4]; /* r[k]: words w.. of rows k, k + 4, k + 8, k + 12 */
            for (int k = 0; k < 4; k++) {
                r[k] = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)(row0 + k * step + 4 * w)));
                for (int l = 1; l < 4; l++)
                    r[k] = _mm512_inserti32x4(r[k], _mm_loadu_si128((const __m128i *)(row0 + (k + 4 * l) * step + 4 * w)), l);
            }
            u[0] = _mm512_unpacklo_epi32(r[0], r[1]), u[1] = _mm512_unpackhi_epi32(r[0], r[1]);
            u[2] = _mm512_unpacklo_epi32(r[2], r[3]), u[3] = _mm512_unpackhi_epi32(r[2], r[3]);
            _mm512_storeu_si512(words[w], _mm512_unpacklo_epi64(u[0], u[2]));
            _mm512_storeu_si512(words[w + 1], _mm512_unpackhi_epi64(u[0], u[2]));
            _mm512_storeu_si512(words[w + 2], _mm512_unpacklo_epi64(u[1], u[3]));
            _mm512_storeu_si512(words[w + 3], _mm512_unpackhi_epi64(u[1], u[3]));
        }
        const __m512i at = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                              _mm512_set1_epi32((int)step));
        for (; w < full; w++) /* word w of the 16 rows: one gather */
            _mm512_storeu_si512(words[w], _mm512_i32gather_epi32(at, row0 + 4 * w, 1));
    } else {
        for (int j = 0; j < LB_TILE; j++)
            for (int64_t w = 0; w < full; w++) memcpy(&words[w][j], row0 + j * step + 4 * w, 4);
    }
    if (row_bytes % 4) /* the rows' last bytes, not reading past them */
        for (int j = 0; j < LB_TILE; j++) {
            uint32_t last = 0;
            memcpy(&last, row0 + j * step + 4 * full, (size_t)(row_bytes % 4));
            words[full][j] = last;
        }
}

/* Tokens t..t+15 of row (b, h) decoded into kt[channel][16], outliers not yet patched in;
   table16: the head's value table padded to 16 levels (lb_stats.table16), NULL for per-token
   statistics. */
static void lb_decode_tile(const lb_page *pg, int64_t b, int64_t h, int64_t t, const float *table16, float *kt) {
    const int64_t d = pg->dim, bits = pg->bits;
    uint32_t words[LB_MAX_WORDS][LB_TILE]; /* [word of a row][token] */
    lb_tile_words(pg, b, h, t, words);
    const int64_t n = (int64_t)1 << bits;
    const int has_z = pg->zero.data != NULL, has_s = has_z || pg->scale.data, has_o = pg->offset.data != NULL;
    __m512 levels = _mm512_setzero_ps(), zero = levels, scale = levels, offset = levels;
    if (!table16) { /* lb_decode_row's three scalars a token, one lane each */
        float lv[16];
        for (int64_t l = 0; l < 16; l++) lv[l] = lb_level(pg, 0, 0, (int)(l & (n - 1))); /* or code + bias */
        levels = _mm512_loadu_ps(lv);
    }
    for (int64_t i = 0; i < d; i++) {
        if (!table16 && i % pg->channel_group == 0) { /* the statistics of channel group i / cg */
            const int64_t g = i / pg->channel_group;
            zero = lb_tile_stat(&pg->zero, pg, b, h, t, g, 0.0f);
            scale = lb_tile_stat(&pg->scale, pg, b, h, t, g, 1.0f);
            offset = lb_tile_stat(&pg->offset, pg, b, h, t, g, 0.0f);
        }
        /* codes above `bits` are the next channels': the permute reads 4 bits, and a table of
           fewer levels repeats them (level l -> l mod 2^bits) */
        const int64_t bit = i * bits, w = bit >> 5, shift = bit & 31;
        __m512i c = _mm512_srlv_epi32(_mm512_loadu_si512(words[w]), _mm512_set1_epi32((int)shift));
        if (shift + bits > 32)
            c = _mm512_or_si512(c, _mm512_sllv_epi32(_mm512_loadu_si512(words[w + 1]), _mm512_set1_epi32((int)(32 - shift))));
        __m512 v;
        if (!table16) {
            v = _mm512_permutexvar_ps(c, levels);
            if (has_z) v = _mm512_sub_ps(v, zero);
            if (has_s) v = _mm512_mul_ps(v, scale);
            if (has_o) v = _mm512_add_ps(v, offset);
        } else {
            v = _mm512_permutexvar_ps(c, _mm512_loadu_ps(table16 + i * 16));
        }
        _mm512_storeu_ps(kt + i * LB_TILE, v);
    }
}

/* Tokens t..t+15 of batch row b, every head, decoded into kts[head][channel][16] with the
   page's outliers patched in (one pass over the tile's CSR rows for all heads); tables: the
   heads' value tables [head][channel][16], NULL for per-token statistics. */
static void lb_decode_tiles(const lb_page *pg, int64_t b, int64_t t, const float *tables, float *kts) {
    const int64_t d = pg->dim, n = pg->heads * d;
    for (int64_t h = 0; h < pg->heads; h++)
        lb_decode_tile(pg, b, h, t, tables ? tables + h * d * 16 : NULL, kts + h * d * LB_TILE);
    if (!pg->row_ptr) return;
    const int64_t base = pg->row_ptr[0];
    for (int j = 0; j < LB_TILE; j++) {
        const int64_t r = (t + j) * pg->batch + b;
        for (int64_t e = pg->row_ptr[r] - base; e < pg->row_ptr[r + 1] - base; e++) {
            const uint32_t word = (uint32_t)pg->col_val[e];
            const int64_t channel = (int64_t)(word >> 16); /* head * dim + channel of the head */
            if (channel < n) kts[channel * LB_TILE + j] = lb_half((uint16_t)(word & 0xffff));
        }
    }
}

/* cos and sin of the 16 positions of slots slot..slot+15 of batch row b, [block_channels][16]: two
   loads and a permute a channel when the positions run consecutively, else gathers. */
static void lb_rope_tile(const lb_rope *rope, int64_t b, int64_t slot, float *ct, float *st) {
    const int64_t d = rope->block_channels;
    const int32_t *pos = rope->positions + b * rope->positions_stride + slot;
    const __m512i p = _mm512_loadu_si512(pos);
    const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const int run = _mm512_cmpeq_epi32_mask(p, _mm512_add_epi32(_mm512_set1_epi32(pos[0]), iota)) == 0xffff;
    if (run) {
        const int64_t first = (int64_t)(pos[0] / 16) * d * 16, offset = pos[0] % 16;
        const __m512i take = _mm512_add_epi32(iota, _mm512_set1_epi32((int)offset)); /* 16+: next block */
        for (int64_t i = 0; i < d; i++) {
            const float *c = rope->cos_blocks + first + i * 16, *s = rope->sin_blocks + first + i * 16;
            __m512 cv = _mm512_loadu_ps(c), sv = _mm512_loadu_ps(s);
            if (offset) {
                cv = _mm512_permutex2var_ps(cv, take, _mm512_loadu_ps(c + d * 16));
                sv = _mm512_permutex2var_ps(sv, take, _mm512_loadu_ps(s + d * 16));
            }
            _mm512_storeu_ps(ct + i * 16, cv), _mm512_storeu_ps(st + i * 16, sv);
        }
        return;
    }
    /* element (p, i) at (p / 16) * dim * 16 + p % 16 + i * 16 */
    const __m512i at = _mm512_add_epi32(_mm512_mullo_epi32(_mm512_srli_epi32(p, 4), _mm512_set1_epi32((int)(d * 16))),
                                        _mm512_and_si512(p, _mm512_set1_epi32(15)));
    for (int64_t i = 0; i < d; i++) {
        _mm512_storeu_ps(ct + i * 16, _mm512_i32gather_ps(at, rope->cos_blocks + i * 16, 4));
        _mm512_storeu_ps(st + i * 16, _mm512_i32gather_ps(at, rope->sin_blocks + i * 16, 4));
    }
}

/* srow[g * total + j] = q_g . k(token j) * scaling for queries g < N (a constant where it is
   inlined, so the sums stay in registers). Pre-RoPE keys (ct not NULL: the tile's cos/sin
   [rope_channels][16]) are rotated on the way in lb_rotate's order of operations, k cos - k' sin
   in the first half and k cos + k' sin in the second, and never stored. */
static inline __attribute__((always_inline)) void lb_scores_tile_n(const float *q, int64_t d, const float *kt,
                                                                   const float *ct, const float *st, int64_t rope_channels,
                                                                   float *srow, int64_t total, float scaling, const int N) {
    __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    if (ct) {
        const int64_t half = d / 2, second = rope_channels == d ? half : 0; /* where the second half's cos/sin are */
        for (int64_t i = 0; i < half; i++) {
            const __m512 a = _mm512_loadu_ps(kt + i * 16), a2 = _mm512_loadu_ps(kt + (i + half) * 16);
            const __m512 c = _mm512_loadu_ps(ct + i * 16), s = _mm512_loadu_ps(st + i * 16);
            const __m512 c2 = _mm512_loadu_ps(ct + (i + second) * 16), s2 = _mm512_loadu_ps(st + (i + second) * 16);
            const __m512 r = _mm512_sub_ps(_mm512_mul_ps(a, c), _mm512_mul_ps(a2, s));
            const __m512 r2 = _mm512_add_ps(_mm512_mul_ps(a2, c2), _mm512_mul_ps(a, s2));
            for (int j = 0; j < N; j++) {
                acc[j] = _mm512_fmadd_ps(_mm512_set1_ps(q[j * d + i]), r, acc[j]);
                acc[j] = _mm512_fmadd_ps(_mm512_set1_ps(q[j * d + i + half]), r2, acc[j]);
            }
        }
    } else {
        for (int64_t i = 0; i < d; i++) {
            const __m512 k = _mm512_loadu_ps(kt + i * LB_TILE);
            for (int j = 0; j < N; j++) acc[j] = _mm512_fmadd_ps(_mm512_set1_ps(q[j * d + i]), k, acc[j]);
        }
    }
    for (int j = 0; j < N; j++) _mm512_storeu_ps(srow + j * total, _mm512_mul_ps(acc[j], _mm512_set1_ps(scaling)));
}

/* lb_scores_tile_n over every query of the group, four at a time. */
static void lb_scores_tile(const float *q, int64_t groups, int64_t d, const float *kt, const float *ct, const float *st,
                           int64_t rope_channels, float *srow, int64_t total, float scaling) {
    int64_t g = 0;
    for (; g + 4 <= groups; g += 4)
        lb_scores_tile_n(q + g * d, d, kt, ct, st, rope_channels, srow + g * total, total, scaling, 4);
    q += g * d, srow += g * total;
    switch (groups - g) {
        case 3: lb_scores_tile_n(q, d, kt, ct, st, rope_channels, srow, total, scaling, 3); break;
        case 2: lb_scores_tile_n(q, d, kt, ct, st, rope_channels, srow, total, scaling, 2); break;
        case 1: lb_scores_tile_n(q, d, kt, ct, st, rope_channels, srow, total, scaling, 1); break;
        default: break;
    }
}

/* Tiles decoded together before their values are summed: an accumulator vector is loaded and
   stored once for this many tiles' multiply-adds, not once for each. */
#define LB_TILE_RUN 4

/* lanes[g][channel][16] += p_g(token) * v(token) over N tiles of 16 tokens (N a constant where it
   is inlined); tile k's values at vt + k * tile_stride, its weights at prow + 16 k. */
static inline __attribute__((always_inline)) void lb_accumulate_tiles_n(const float *prow, int64_t groups, int64_t total,
                                                                        int64_t d, const float *vt, int64_t tile_stride,
                                                                        float *lanes, const int N) {
    for (int64_t g = 0; g < groups; g++) {
        __m512 p[LB_TILE_RUN];
        for (int k = 0; k < N; k++) p[k] = _mm512_loadu_ps(prow + g * total + k * LB_TILE);
        float *a = lanes + g * d * LB_TILE;
        for (int64_t i = 0; i < d; i++) {
            __m512 sum = _mm512_loadu_ps(a + i * LB_TILE);
            for (int k = 0; k < N; k++) sum = _mm512_fmadd_ps(p[k], _mm512_loadu_ps(vt + k * tile_stride + i * LB_TILE), sum);
            _mm512_storeu_ps(a + i * LB_TILE, sum);
        }
    }
}

static void lb_accumulate_tile_run(const float *prow, int64_t groups, int64_t total, int64_t d, const float *vt,
                                   int64_t tile_stride, float *lanes, int tiles) {
    switch (tiles) {
        case 4: lb_accumulate_tiles_n(prow, groups, total, d, vt, tile_stride, lanes, 4); break;
        case 3: lb_accumulate_tiles_n(prow, groups, total, d, vt, tile_stride, lanes, 3); break;
        case 2: lb_accumulate_tiles_n(prow, groups, total, d, vt, tile_stride, lanes, 2); break;
        default: lb_accumulate_tiles_n(prow, groups, total, d, vt, tile_stride, lanes, 1); break;
    }
}

/* 3- and 4-bit tiles decoded where they are used. A block of channels fills whole transposed
   words (4 bits: 8 channels, one word; 3 bits: 32 channels, three words), so a channel's 16 codes
   are its block's words shifted by constants (3-bit codes that cross a word are put together
   from two), and its 16 values go from the permute straight into the multiply-adds, never
   stored and loaded back. The permute reads an index's low 4 bits, so the bits above a 3-bit
   code are harmless: the tables (lb_stats.table16) and levels repeat every 2^bits. A tile's
   outliers are staged once for all its heads (per channel: the lanes holding one, and their
   values) and blended in by a masked load. The values are lb_decode_tile's, bit for bit. The
   dim is a whole number of 16 channels (4 bits) or of 32 (3 bits: whole blocks of three words). */
static int lb_fused_page(const lb_page *pg) {
    if (lb_token_stats(pg) && pg->channel_group != pg->dim) return 0; /* one set of statistics a tile */
    return (pg->bits == 4 && pg->dim % 16 == 0) || (pg->bits == 3 && pg->dim % 32 == 0);
}

typedef struct {
    const uint32_t *words; /* [words a row][16]: the head's transposed code words (lb_tile_words) */
    const float *table;    /* [dim][16]: the head's value tables; NULL: levels, then token statistics */
    __m512 levels, zero, scale, offset;
    const uint16_t *mask; /* [dim]: the lanes holding outliers; NULL: the page has none */
    const float *outlier; /* [dim][16]: their values */
} lb_fused;

/* The outliers of tokens t..t+15 of batch row b, every head: mask[c] the lanes (tokens) holding
   one in channel c = head * dim + channel of the head, value[c][lane] its value. */
static void lb_tile_outliers(const lb_page *pg, int64_t b, int64_t t, uint16_t *mask, float *value) {
    const int64_t n = pg->heads * pg->dim, base = pg->row_ptr[0];
    memset(mask, 0, (size_t)n * sizeof(uint16_t));
    for (int j = 0; j < LB_TILE; j++) {
        const int64_t r = (t + j) * pg->batch + b;
        for (int64_t e = pg->row_ptr[r] - base; e < pg->row_ptr[r + 1] - base; e++) {
            const uint32_t word = (uint32_t)pg->col_val[e];
            const int64_t channel = (int64_t)(word >> 16);
            if (channel < n) {
                mask[channel] |= (uint16_t)(1u << j);
                value[channel * LB_TILE + j] = lb_half((uint16_t)(word & 0xffff));
            }
        }
    }
}

/* Head h of the tile at token t: its words gathered into `words`, its table or statistics. */
static void lb_fused_make(const lb_page *pg, int64_t b, int64_t h, int64_t t, uint32_t (*words)[LB_TILE],
                          const float *tables, const uint16_t *mask, const float *outlier, lb_fused *x) {
    const int64_t d = pg->dim;
    lb_tile_words(pg, b, h, t, words);
    x->words = &words[0][0];
    x->table = tables ? tables + h * d * 16 : NULL;
    x->levels = x->zero = x->offset = _mm512_setzero_ps();
    x->scale = _mm512_set1_ps(1.0f);
    if (!tables) { /* lb_decode_tile's levels and statistics; an absent one is an identity */
        float lv[16];
        for (int l = 0; l < 16; l++) lv[l] = lb_level(pg, 0, 0, l & ((1 << pg->bits) - 1));
        x->levels = _mm512_loadu_ps(lv);
        x->zero = lb_tile_stat(&pg->zero, pg, b, h, t, 0, 0.0f);
        if (pg->scale.data) x->scale = lb_tile_stat(&pg->scale, pg, b, h, t, 0, 1.0f);
        x->offset = lb_tile_stat(&pg->offset, pg, b, h, t, 0, 0.0f);
    }
    x->mask = mask ? mask + h * d : NULL;
    x->outlier = mask ? outlier + h * d * LB_TILE : NULL;
}

/* The codes of channels c0..c0+7 (c0 a multiple of 8) of a fused tile from bit 0 of each lane
   on: channel c0 + s is this field shifted right by BITS * s (4 bits: a word; 3 bits: 24 bits of
   a block of three words, put together where they cross a word). */
static inline __attribute__((always_inline)) __m512i lb_fused_field(const lb_fused *x, int64_t c0, const int BITS) {
    if (BITS == 4) return _mm512_loadu_si512(x->words + (c0 / 8) * LB_TILE);
    const uint32_t *w = x->words + (c0 / 32) * 3 * LB_TILE; /* the block's three words */
    switch ((c0 / 8) % 4) {
        case 0: return _mm512_loadu_si512(w);
        case 1: return _mm512_or_si512(_mm512_srli_epi32(_mm512_loadu_si512(w), 24),
                                       _mm512_slli_epi32(_mm512_loadu_si512(w + LB_TILE), 8));
        case 2: return _mm512_or_si512(_mm512_srli_epi32(_mm512_loadu_si512(w + LB_TILE), 16),
                                       _mm512_slli_epi32(_mm512_loadu_si512(w + 2 * LB_TILE), 16));
        default: return _mm512_srli_epi32(_mm512_loadu_si512(w + 2 * LB_TILE), 8);
    }
}

/* The 16 values of channel i from its codes c; TABLE and MASKED constants where inlined.
   (v - 0) * 1 + 0 is v, so absent statistics need no branch. */
static inline __attribute__((always_inline)) __m512 lb_fused_value(const lb_fused *x, __m512i c, int64_t i,
                                                                   const int TABLE, const int MASKED) {
    __m512 v;
    if (TABLE) {
        v = _mm512_permutexvar_ps(c, _mm512_loadu_ps(x->table + i * 16));
    } else {
        v = _mm512_permutexvar_ps(c, x->levels);
        v = _mm512_add_ps(_mm512_mul_ps(_mm512_sub_ps(v, x->zero), x->scale), x->offset);
    }
    if (MASKED) v = _mm512_mask_loadu_ps(v, (__mmask16)x->mask[i], x->outlier + i * LB_TILE);
    return v;
}

/* Whether channels i..i+7 hold an outlier in any lane of the tile (a block without one skips the
   masked loads). */
static inline __attribute__((always_inline)) int lb_fused_any(const lb_fused *x, int64_t i) {
    uint64_t a, b;
    memcpy(&a, x->mask + i, 8), memcpy(&b, x->mask + i + 4, 8);
    return (a | b) != 0;
}

/* lb_scores_tile_n on a fused tile: queries g < N of the head, keys rotated as there; two sums a
   query (even and odd channels; with RoPE, each pair's two halves), added at the end. */
static inline __attribute__((always_inline)) void lb_fused_scores_n(const float *q, int64_t d, const lb_fused *x,
                                                                    const float *ct, const float *st, int64_t rope_channels,
                                                                    float *srow, int64_t total, float scaling, const int N,
                                                                    const int BITS, const int TABLE, const int MASKED,
                                                                    const int ROPE) {
    __m512 acc[4], acc2[4];
    for (int j = 0; j < 4; j++) acc[j] = acc2[j] = _mm512_setzero_ps();
    if (ROPE) {
        const int64_t half = d / 2, second = rope_channels == d ? half : 0;
        for (int64_t i = 0; i < half; i += 8) {
            const __m512i f = lb_fused_field(x, i, BITS), f2 = lb_fused_field(x, i + half, BITS);
            const int m = MASKED && lb_fused_any(x, i), m2 = MASKED && lb_fused_any(x, i + half);
#pragma GCC unroll 8
            for (int s = 0; s < 8; s++) {
                const __m512 a = lb_fused_value(x, _mm512_srli_epi32(f, (unsigned)(BITS * s)), i + s, TABLE, m);
                const __m512 a2 = lb_fused_value(x, _mm512_srli_epi32(f2, (unsigned)(BITS * s)), i + half + s, TABLE, m2);
                const __m512 c = _mm512_loadu_ps(ct + (i + s) * 16), sn = _mm512_loadu_ps(st + (i + s) * 16);
                const __m512 c2 = _mm512_loadu_ps(ct + (i + s + second) * 16), s2 = _mm512_loadu_ps(st + (i + s + second) * 16);
                const __m512 r = _mm512_sub_ps(_mm512_mul_ps(a, c), _mm512_mul_ps(a2, sn));
                const __m512 r2 = _mm512_add_ps(_mm512_mul_ps(a2, c2), _mm512_mul_ps(a, s2));
                for (int j = 0; j < N; j++) {
                    acc[j] = _mm512_fmadd_ps(_mm512_set1_ps(q[j * d + i + s]), r, acc[j]);
                    acc2[j] = _mm512_fmadd_ps(_mm512_set1_ps(q[j * d + i + s + half]), r2, acc2[j]);
                }
            }
        }
    } else {
        for (int64_t i = 0; i < d; i += 8) {
            const __m512i f = lb_fused_field(x, i, BITS);
            const int m = MASKED && lb_fused_any(x, i);
#pragma GCC unroll 8
            for (int s = 0; s < 8; s += 2) {
                const __m512 k = lb_fused_value(x, _mm512_srli_epi32(f, (unsigned)(BITS * s)), i + s, TABLE, m);
                const __m512 k2 = lb_fused_value(x, _mm512_srli_epi32(f, (unsigned)(BITS * s + BITS)), i + s + 1, TABLE, m);
                for (int j = 0; j < N; j++) {
                    acc[j] = _mm512_fmadd_ps(_mm512_set1_ps(q[j * d + i + s]), k, acc[j]);
                    acc2[j] = _mm512_fmadd_ps(_mm512_set1_ps(q[j * d + i + s + 1]), k2, acc2[j]);
                }
            }
        }
    }
    for (int j = 0; j < N; j++)
        _mm512_storeu_ps(srow + j * total, _mm512_mul_ps(_mm512_add_ps(acc[j], acc2[j]), _mm512_set1_ps(scaling)));
}

#define LB_FUSED_SCORES_N(B, T, M, R)                                                                       \
    switch (n) {                                                                                            \
        case 4: lb_fused_scores_n(qg, d, x, ct, st, rope_channels, sg, total, scaling, 4, B, T, M, R); break; \
        case 3: lb_fused_scores_n(qg, d, x, ct, st, rope_channels, sg, total, scaling, 3, B, T, M, R); break; \
        case 2: lb_fused_scores_n(qg, d, x, ct, st, rope_channels, sg, total, scaling, 2, B, T, M, R); break; \
        default: lb_fused_scores_n(qg, d, x, ct, st, rope_channels, sg, total, scaling, 1, B, T, M, R); break; \
    }

#define LB_FUSED_SCORES(B)                                   \
    if (table && masked && rope) LB_FUSED_SCORES_N(B, 1, 1, 1) \
    else if (table && masked) LB_FUSED_SCORES_N(B, 1, 1, 0)    \
    else if (table && rope) LB_FUSED_SCORES_N(B, 1, 0, 1)      \
    else if (table) LB_FUSED_SCORES_N(B, 1, 0, 0)              \
    else if (masked && rope) LB_FUSED_SCORES_N(B, 0, 1, 1)     \
    else if (masked) LB_FUSED_SCORES_N(B, 0, 1, 0)             \
    else if (rope) LB_FUSED_SCORES_N(B, 0, 0, 1)               \
    else LB_FUSED_SCORES_N(B, 0, 0, 0)

/* lb_scores_tile on a fused tile of `bits`-bit codes: every query of the head, four at a time. */
static inline __attribute__((always_inline)) void lb_fused_scores(const float *q, int64_t groups, int64_t d, int bits,
                                                                  const lb_fused *x, const float *ct, const float *st,
                                                                  int64_t rope_channels, float *srow, int64_t total,
                                                                  float scaling) {
    const int table = x->table != NULL, masked = x->mask != NULL, rope = ct != NULL;
    for (int64_t g = 0; g < groups; g += 4) {
        const int n = groups - g < 4 ? (int)(groups - g) : 4;
        const float *qg = q + g * d;
        float *sg = srow + g * total;
        if (bits == 3) {
            LB_FUSED_SCORES(3)
        } else {
            LB_FUSED_SCORES(4)
        }
    }
}

/* lanes[g][channel][16] += p_g(token) v(token) over the N fused tiles xs (a run), as
   lb_accumulate_tiles_n; tile k's weights at prow + 16 k. */
static inline __attribute__((always_inline)) void lb_fused_accumulate_n(const float *prow, int64_t groups,
                                                                        int64_t total, int64_t d, const lb_fused *xs,
                                                                        float *lanes, const int N, const int BITS,
                                                                        const int TABLE, const int MASKED) {
    for (int64_t i = 0; i < d; i += 8) {
        __m512i f[LB_TILE_RUN];
        int m[LB_TILE_RUN];
        for (int k = 0; k < N; k++) {
            f[k] = lb_fused_field(&xs[k], i, BITS);
            m[k] = MASKED && lb_fused_any(&xs[k], i);
        }
#pragma GCC unroll 8
        for (int s = 0; s < 8; s++) {
            __m512 v[LB_TILE_RUN];
            for (int k = 0; k < N; k++) v[k] = lb_fused_value(&xs[k], _mm512_srli_epi32(f[k], (unsigned)(BITS * s)), i + s, TABLE, m[k]);
            for (int64_t g = 0; g < groups; g++) {
                float *a = lanes + (g * d + i + s) * LB_TILE;
                __m512 sum = _mm512_loadu_ps(a);
                for (int k = 0; k < N; k++) sum = _mm512_fmadd_ps(_mm512_loadu_ps(prow + g * total + k * LB_TILE), v[k], sum);
                _mm512_storeu_ps(a, sum);
            }
        }
    }
}

#define LB_FUSED_ACCUMULATE_N(B, T, M)                                                                \
    switch (tiles) {                                                                                  \
        case 4: lb_fused_accumulate_n(prow, groups, total, d, xs, lanes, 4, B, T, M); break;          \
        case 3: lb_fused_accumulate_n(prow, groups, total, d, xs, lanes, 3, B, T, M); break;          \
        case 2: lb_fused_accumulate_n(prow, groups, total, d, xs, lanes, 2, B, T, M); break;          \
        default: lb_fused_accumulate_n(prow, groups, total, d, xs, lanes, 1, B, T, M); break;         \
    }

#define LB_FUSED_ACCUMULATE(B)                                \
    if (table && masked) LB_FUSED_ACCUMULATE_N(B, 1, 1)       \
    else if (table) LB_FUSED_ACCUMULATE_N(B, 1, 0)            \
    else if (masked) LB_FUSED_ACCUMULATE_N(B, 0, 1)           \
    else LB_FUSED_ACCUMULATE_N(B, 0, 0)

/* lb_accumulate_tile_run on fused tiles of `bits`-bit codes (`table`, `masked`: as every tile's). */
static void lb_fused_accumulate(const float *prow, int64_t groups, int64_t total, int64_t d, int bits,
                                const lb_fused *xs, float *lanes, int tiles, int table, int masked) {
    if (bits == 3) {
        LB_FUSED_ACCUMULATE(3)
    } else {
        LB_FUSED_ACCUMULATE(4)
    }
}
#else
#define LB_TILE 0
#endif

/* The width of a token tile (16 with AVX-512), 0 where the library was built without them. */
int lb_tile_width(void) { return LB_TILE; }

/* The short road applies: 4-bit codes, no codebook, no outliers, an even channel group. */
static int lb_nibbles(const lb_page *pg) {
    return pg->bits == 4 && !pg->levels && !pg->row_ptr && pg->channel_group % 2 == 0 && pg->dim % 2 == 0;
}

/* A 4-bit row's codes as floats: even channels (low nibbles) in lo, odd ones in hi. */
static void lb_nibble_row(const uint8_t *row, int64_t d, float *lo, float *hi) {
    for (int64_t j = 0; j < d / 2; j++) {
        lo[j] = (float)(row[j] & 15);
        hi[j] = (float)(row[j] >> 4);
    }
}

/* Per channel group c of row (b, h) in token group tg: value = scale[c] * code + constant[c]. */
static void lb_group_affine(const lb_page *pg, int64_t b, int64_t h, int64_t tg, float *scale, float *constant) {
    for (int64_t c = 0; c < pg->dim / pg->channel_group; c++) {
        const float z = lb_stat_at(&pg->zero, b, h, tg, c, 0.0f);
        scale[c] = lb_stat_at(&pg->scale, b, h, tg, c, 1.0f);
        constant[c] = (pg->level_bias - z) * scale[c] + lb_stat_at(&pg->offset, b, h, tg, c, 0.0f);
    }
}

typedef struct {
    const lb_page *pages;
    const int64_t *starts; /* slot of each page's first token */
    int64_t n_pages;
    const lb_rope *rope;
    const float *q, *p;
    float *scores, *acc;
    int64_t groups, total, t0, t1; /* tokens t0..t1 of the pages, counted over all of them */
    float scaling;
    struct lb_table_cache *tables; /* the job's value tables, kept from page to page (lb_tile_tables) */
} lb_job;

/* The heads' value tables of the last page a job read: a layer's pages share their statistics
   (KVQuant's keys: the quantizer's per-channel ranges), so they are built once a call, not once
   a page. */
typedef struct lb_table_cache {
    lb_page of;    /* the page they were built for (only its statistics are compared) */
    int64_t b;     /* its batch row; -1: none yet */
    float *tables; /* [heads][dim][16] */
} lb_table_cache;

#if LB_TILE
/* Whether pages a and b turn codes into the same values (same levels and statistics). */
static int lb_same_stats(const lb_page *a, const lb_page *b) {
    return a->heads == b->heads && a->dim == b->dim && a->bits == b->bits && a->levels == b->levels &&
           a->levels_per_channel == b->levels_per_channel && a->level_bias == b->level_bias &&
           a->token_group == b->token_group && a->channel_group == b->channel_group &&
           !memcmp(&a->scale, &b->scale, sizeof(lb_stat)) && !memcmp(&a->zero, &b->zero, sizeof(lb_stat)) &&
           !memcmp(&a->offset, &b->offset, sizeof(lb_stat));
}
#endif

/* Calls fn(job, page, local t0, local t1) for the part of each page inside the job's range. */
static void lb_each_page(const lb_job *job, void (*fn)(const lb_job *, int64_t, int64_t, int64_t)) {
    int64_t before = 0;
    for (int64_t i = 0; i < job->n_pages; i++) {
        const int64_t n = job->pages[i].tokens;
        int64_t a = job->t0 - before, b = job->t1 - before;
        if (a < 0) a = 0;
        if (b > n) b = n;
        if (a < b) fn(job, i, a, b);
        before += n;
    }
}

#if LB_TILE
/* The buffers of a page's tiles: every head's decoded tiles [tile][head][channel][16] (`tiles` of
   them), the heads' value tables [head][channel][16] (statistics shared by every token; NULL for
   per-token ones) and `extra` floats for the caller; NULL where memory runs out. */
typedef struct {
    float *kts, *tables, *extra;
} lb_tile_buffers;

static int lb_tile_buffers_make(const lb_page *pg, int64_t tiles, int64_t extra, lb_tile_buffers *buf) {
    const int64_t n = pg->heads * pg->dim * LB_TILE;
    const int token_stats = lb_token_stats(pg) && !lb_group_tables_page(pg);
    buf->kts = malloc((size_t)(tiles * n) * sizeof(float));
    buf->tables = token_stats ? NULL : malloc((size_t)n * sizeof(float));
    buf->extra = extra ? malloc((size_t)extra * sizeof(float)) : NULL;
    if (buf->kts && (token_stats || buf->tables) && (!extra || buf->extra)) return 0;
    free(buf->kts), free(buf->tables), free(buf->extra);
    return -1;
}

/* The heads' value tables of batch row b into buf->tables (nothing for per-token statistics). */
static void lb_tile_tables(const lb_page *pg, int64_t b, lb_stats *st, lb_tile_buffers *buf, lb_table_cache *cache) {
    if (!buf->tables || lb_group_tables_page(pg)) return; /* those: a token group's at a time */
    const size_t bytes = (size_t)(pg->heads * pg->dim * 16) * sizeof(float);
    if (cache && cache->tables && cache->b == b && lb_same_stats(&cache->of, pg)) {
        memcpy(buf->tables, cache->tables, bytes);
        return;
    }
    for (int64_t h = 0; h < pg->heads; h++) {
        lb_load_stats(pg, b, h, 0, st);
        memcpy(buf->tables + h * pg->dim * 16, st->table16, (size_t)(pg->dim * 16) * sizeof(float));
    }
    if (!cache) return;
    free(cache->tables);
    cache->tables = malloc(bytes);
    if (cache->tables) memcpy(cache->tables, buf->tables, bytes);
    cache->of = *pg, cache->b = b;
}

/* The whole tiles of tokens t0..t1 of page i for lb_scores_page, every batch row and head: tiles
   outer and heads inner, so a tile's cos/sin and outliers are read once for all heads. Returns
   the first token left to the rows (t0 where the tiles could not run). */
static int64_t lb_scores_tiles(const lb_job *job, int64_t i, int64_t t0, int64_t t1, lb_stats *st) {
    const lb_page *pg = &job->pages[i];
    const int64_t d = pg->dim, G = job->groups, H = pg->heads, start = job->starts[i];
    const int64_t end = t0 + (t1 - t0) / LB_TILE * LB_TILE;
    const int rope = job->rope && job->rope->cos;
    const int64_t rope_channels = rope ? job->rope->block_channels : 0;
    const int fused = lb_fused_page(pg);
    lb_tile_buffers buf; /* extra: cos, sin, then (fused) the outliers' lane masks [H * dim] */
    if (end == t0 || lb_tile_buffers_make(pg, 1, 2 * rope_channels * LB_TILE + (H * d + 1) / 2, &buf)) return t0;
    float *ct = rope ? buf.extra : NULL, *sn = rope ? buf.extra + rope_channels * LB_TILE : NULL; /* [channels][16] */
    uint16_t *mask = pg->row_ptr ? (uint16_t *)(buf.extra + 2 * rope_channels * LB_TILE) : NULL;
    uint32_t words[LB_MAX_WORDS][LB_TILE];
    const int group_tables = lb_group_tables_page(pg);
    for (int64_t b = 0; b < pg->batch; b++) {
        lb_tile_tables(pg, b, st, &buf, job->tables);
        int64_t built = -1; /* the token group buf.tables holds (group tables) */
        for (int64_t t = t0; t < end; t += LB_TILE) {
            if (rope) lb_rope_tile(job->rope, b, start + t, ct, sn);
            if (group_tables && t / pg->token_group != built)
                lb_group_tables(pg, b, built = t / pg->token_group, buf.tables);
            if (fused && mask) lb_tile_outliers(pg, b, t, mask, buf.kts);
            else if (!fused) lb_decode_tiles(pg, b, t, buf.tables, buf.kts);
            for (int64_t h = 0; h < H; h++) {
                const float *q = job->q + (b * H + h) * G * d;
                float *srow = job->scores + (b * H + h) * G * job->total + start + t;
                if (fused) {
                    lb_fused x;
                    lb_fused_make(pg, b, h, t, words, buf.tables, mask, buf.kts, &x);
                    lb_fused_scores(q, G, d, pg->bits, &x, ct, sn, rope_channels, srow, job->total, job->scaling);
                } else {
                    lb_scores_tile(q, G, d, buf.kts + h * d * LB_TILE, ct, sn, rope_channels, srow, job->total, job->scaling);
                }
            }
        }
    }
    free(buf.kts), free(buf.tables), free(buf.extra);
    return end;
}

/* The whole tiles of tokens t0..t1 of page i for lb_accumulate_page: p_t v_t summed in 16 lanes a
   channel, [head][group][channel][16], LB_TILE_RUN tiles decoded at a time, then across the
   lanes into the accumulator once a batch row. Returns the first token left to the rows. */
static int64_t lb_accumulate_tiles(const lb_job *job, int64_t i, int64_t t0, int64_t t1, lb_stats *st) {
    const lb_page *pg = &job->pages[i];
    const int64_t d = pg->dim, G = job->groups, H = pg->heads, start = job->starts[i];
    const int64_t end = t0 + (t1 - t0) / LB_TILE * LB_TILE, n = H * G * d, tile_stride = H * d * LB_TILE;
    const int fused = lb_fused_page(pg);
    lb_tile_buffers buf; /* extra: the lanes, then (fused) the outliers' lane masks [run][H * dim] */
    if (end == t0 || lb_tile_buffers_make(pg, LB_TILE_RUN, n * LB_TILE + (LB_TILE_RUN * H * d + 1) / 2, &buf)) return t0;
    uint16_t *masks = pg->row_ptr ? (uint16_t *)(buf.extra + n * LB_TILE) : NULL;
    uint32_t words[LB_TILE_RUN][LB_MAX_WORDS][LB_TILE];
    const int group_tables = lb_group_tables_page(pg);
    for (int64_t b = 0; b < pg->batch; b++) {
        lb_tile_tables(pg, b, st, &buf, job->tables);
        memset(buf.extra, 0, (size_t)(n * LB_TILE) * sizeof(float));
        int64_t built = -1; /* the token group buf.tables holds (group tables) */
        for (int64_t t = t0; t < end; t += LB_TILE_RUN * LB_TILE) {
            const int64_t left = (end - t) / LB_TILE;
            const int tiles = left < LB_TILE_RUN ? (int)left : LB_TILE_RUN;
            for (int k = 0; k < tiles; k++) {
                if (group_tables && (t + k * LB_TILE) / pg->token_group != built)
                    lb_group_tables(pg, b, built = (t + k * LB_TILE) / pg->token_group, buf.tables);
                if (fused && masks) lb_tile_outliers(pg, b, t + k * LB_TILE, masks + k * H * d, buf.kts + k * tile_stride);
                else if (!fused) lb_decode_tiles(pg, b, t + k * LB_TILE, buf.tables, buf.kts + k * tile_stride);
            }
            for (int64_t h = 0; h < H; h++) {
                const float *prow = job->p + (b * H + h) * G * job->total + start + t;
                float *lanes = buf.extra + h * G * d * LB_TILE;
                if (fused) {
                    lb_fused xs[LB_TILE_RUN];
                    for (int k = 0; k < tiles; k++)
                        lb_fused_make(pg, b, h, t + k * LB_TILE, words[k], buf.tables, masks ? masks + k * H * d : NULL,
                                      buf.kts + k * tile_stride, &xs[k]);
                    lb_fused_accumulate(prow, G, job->total, d, pg->bits, xs, lanes, tiles, buf.tables != NULL,
                                        masks != NULL);
                } else {
                    lb_accumulate_tile_run(prow, G, job->total, d, buf.kts + h * d * LB_TILE, tile_stride, lanes, tiles);
                }
            }
        }
        float *acc = job->acc + b * n; /* [H][G][dim] of batch row b */
        for (int64_t j = 0; j < n; j++) acc[j] += _mm512_reduce_add_ps(_mm512_loadu_ps(buf.extra + j * LB_TILE));
    }
    free(buf.kts), free(buf.tables), free(buf.extra);
    return end;
}
#endif

static void lb_scores_page(const lb_job *job, int64_t i, int64_t t0, int64_t t1) {
    const lb_page *pg = &job->pages[i];
    const int64_t d = pg->dim, G = job->groups, start = job->starts[i];
    const int rope = job->rope && job->rope->cos;
    float k[LB_MAX_DIM], r[LB_MAX_DIM];
    lb_stats st; /* not zeroed: its 64 KB table is written before it is read */
    st.b = -1;
    float qe[LB_MAX_GROUPS][LB_MAX_DIM / 2], qo[LB_MAX_GROUPS][LB_MAX_DIM / 2], qsum[LB_MAX_GROUPS][LB_MAX_DIM];
    const int nib = lb_nibbles(pg) && !rope;
    const int64_t cg = pg->channel_group, ng = d / cg;
    int64_t tail = t0; /* the first token left to the rows below */
#if LB_TILE
    if (lb_tile_page(pg) && (!rope || (job->rope->cos_blocks && job->rope->sin_blocks && d % 2 == 0 &&
                                       (job->rope->block_channels == d || 2 * job->rope->block_channels == d))))
        tail = lb_scores_tiles(job, i, t0, t1, &st);
#endif
    for (int64_t b = 0; b < pg->batch; b++)
        for (int64_t h = 0; h < pg->heads; h++) {
            const float *q = job->q + (b * pg->heads + h) * G * d;
            float *srow = job->scores + (b * pg->heads + h) * G * job->total + start;
            if (nib) {
                for (int64_t g = 0; g < G; g++) {
                    for (int64_t j = 0; j < d / 2; j++) {
                        qe[g][j] = q[g * d + 2 * j];
                        qo[g][j] = q[g * d + 2 * j + 1];
                    }
                    for (int64_t c = 0; c < ng; c++) {
                        float sum = 0.0f;
                        for (int64_t j = 0; j < cg; j++) sum += q[g * d + c * cg + j];
                        qsum[g][c] = sum;
                    }
                }
                for (int64_t t = tail; t < t1; t++) {
                    float lo[LB_MAX_DIM / 2], hi[LB_MAX_DIM / 2], scale[LB_MAX_DIM], constant[LB_MAX_DIM];
                    lb_nibble_row(lb_row(pg, b, h, t), d, lo, hi);
                    lb_group_affine(pg, b, h, t / pg->token_group, scale, constant);
                    for (int64_t g = 0; g < G; g++) {
                        float total = 0.0f;
                        for (int64_t c = 0; c < ng; c++) {
                            const int64_t j0 = c * cg / 2, n = cg / 2;
                            float lanes[8] = {0}, dot = 0.0f;
                            int64_t j = 0;
                            for (; j + 8 <= n; j += 8)
                                for (int l = 0; l < 8; l++)
                                    lanes[l] += qe[g][j0 + j + l] * lo[j0 + j + l] + qo[g][j0 + j + l] * hi[j0 + j + l];
                            for (; j < n; j++) dot += qe[g][j0 + j] * lo[j0 + j] + qo[g][j0 + j] * hi[j0 + j];
                            for (int l = 0; l < 8; l++) dot += lanes[l];
                            total += scale[c] * dot + constant[c] * qsum[g][c];
                        }
                        srow[g * job->total + t] = total * job->scaling;
                    }
                }
                continue;
            }
            for (int64_t t = tail; t < t1; t++) {
                lb_decode_row(pg, b, h, t, &st, k);
                const float *key = k;
                if (rope) {
                    lb_rotate(job->rope, b, start + t, d, k, r);
                    key = r;
                }
                for (int64_t g = 0; g < G; g++) srow[g * job->total + t] = lb_dot(q + g * d, key, d) * job->scaling;
            }
        }
}

static void lb_accumulate_page(const lb_job *job, int64_t i, int64_t t0, int64_t t1) {
    const lb_page *pg = &job->pages[i];
    const int64_t d = pg->dim, G = job->groups, start = job->starts[i];
    float v[LB_MAX_DIM];
    lb_stats st; /* not zeroed: its 64 KB table is written before it is read */
    st.b = -1;
    const int nib = lb_nibbles(pg);
    const int64_t cg = pg->channel_group, ng = d / cg;
    int64_t tail = t0; /* the first token left to the rows below */
#if LB_TILE
    if (lb_tile_page(pg)) tail = lb_accumulate_tiles(job, i, t0, t1, &st);
#endif
    for (int64_t b = 0; b < pg->batch; b++)
        for (int64_t h = 0; h < pg->heads; h++) {
            const float *prow = job->p + (b * pg->heads + h) * G * job->total + start;
            float *acc = job->acc + (b * pg->heads + h) * G * d;
            if (nib) { /* even and odd channels apart, then added in place */
                float ae[LB_MAX_GROUPS][LB_MAX_DIM / 2] = {{0}}, ao[LB_MAX_GROUPS][LB_MAX_DIM / 2] = {{0}};
                float add[LB_MAX_GROUPS][LB_MAX_DIM] = {{0}};
                for (int64_t t = tail; t < t1; t++) {
                    float lo[LB_MAX_DIM / 2], hi[LB_MAX_DIM / 2], scale[LB_MAX_DIM], constant[LB_MAX_DIM];
                    lb_nibble_row(lb_row(pg, b, h, t), d, lo, hi);
                    lb_group_affine(pg, b, h, t / pg->token_group, scale, constant);
                    for (int64_t c = 0; c < ng; c++) {
                        const float s = scale[c];
                        const int64_t j0 = c * cg / 2, n = cg / 2;
                        for (int64_t g = 0; g < G; g++) {
                            const float w = prow[g * job->total + t], ws = w * s;
                            for (int64_t j = j0; j < j0 + n; j++) {
                                ae[g][j] += ws * lo[j];
                                ao[g][j] += ws * hi[j];
                            }
                            add[g][c] += w * constant[c];
                        }
                    }
                }
                for (int64_t g = 0; g < G; g++)
                    for (int64_t j = 0; j < d / 2; j++) {
                        acc[g * d + 2 * j] += ae[g][j] + add[g][2 * j / cg];
                        acc[g * d + 2 * j + 1] += ao[g][j] + add[g][(2 * j + 1) / cg];
                    }
                continue;
            }
            for (int64_t t = tail; t < t1; t++) {
                lb_decode_row(pg, b, h, t, &st, v);
                for (int64_t g = 0; g < G; g++) {
                    const float w = prow[g * job->total + t];
                    float *a = acc + g * d;
                    for (int64_t j = 0; j < d; j++) a[j] += w * v[j];
                }
            }
        }
}

static void *lb_scores_job(void *arg) {
    lb_each_page(arg, lb_scores_page);
    return NULL;
}

static void *lb_accumulate_job(void *arg) {
    lb_each_page(arg, lb_accumulate_page);
    return NULL;
}

static int lb_check(const lb_page *pages, const int64_t *starts, int64_t n_pages, int64_t groups, int64_t total) {
    if (groups <= 0 || groups > LB_MAX_GROUPS) return -1;
    for (int64_t i = 0; i < n_pages; i++) {
        const lb_page *pg = &pages[i];
        if (pg->dim <= 0 || pg->dim > LB_MAX_DIM || pg->bits < 1 || pg->bits > 8) return -1;
        if (pg->token_group <= 0 || pg->channel_group <= 0 || pg->dim % pg->channel_group) return -1;
        if (starts[i] < 0 || starts[i] + pg->tokens > total) return -1;
    }
    return 0;
}

/* Token t of the pages' run moved down to a whole 16 tokens into its page, so that a job's part
   of a page is whole tiles but for the page's own last tokens. */
static int64_t lb_split(const lb_job *job, int64_t t) {
    int64_t before = 0;
    for (int64_t i = 0; i < job->n_pages; i++) {
        const int64_t n = job->pages[i].tokens;
        if (t < before + n) return before + (t - before) / 16 * 16;
        before += n;
    }
    return t;
}

/* Split the pages' tokens over `threads` jobs (at least 256 tokens each), run them, join. With
   `partials`, job i > 0 accumulates into its own zeroed block, added to job 0's at the end. */
static void lb_run(lb_job *base, int threads, void *(*fn)(void *), float *partials, int64_t acc_size) {
    int64_t tokens = 0;
    for (int64_t i = 0; i < base->n_pages; i++) tokens += base->pages[i].tokens;
    int64_t n = threads < 1 ? 1 : threads;
    if (n > LB_MAX_THREADS) n = LB_MAX_THREADS;
    if (n > tokens / 256) n = tokens / 256 > 0 ? tokens / 256 : 1;
    lb_job jobs[LB_MAX_THREADS];
    lb_table_cache tables[LB_MAX_THREADS];
    for (int64_t i = 0; i < n; i++) {
        jobs[i] = *base;
        tables[i].b = -1, tables[i].tables = NULL;
        jobs[i].tables = &tables[i];
        jobs[i].t0 = lb_split(base, tokens * i / n);
        jobs[i].t1 = lb_split(base, tokens * (i + 1) / n);
        if (partials && i > 0) {
            jobs[i].acc = partials + (i - 1) * acc_size;
            memset(jobs[i].acc, 0, (size_t)acc_size * sizeof(float));
        }
    }
#pragma omp parallel for num_threads(n) schedule(static, 1)
    for (int64_t i = 0; i < n; i++) fn(&jobs[i]);
    for (int64_t i = 0; i < n; i++) free(tables[i].tables);
    if (partials)
        for (int64_t i = 1; i < n; i++)
            for (int64_t j = 0; j < acc_size; j++) base->acc[j] += jobs[i].acc[j];
}

/* scores[b, h, g, starts[i] + t] = q[b, h, g] . key(page i; b, h, t) * scaling for every token.
   q: [batch, heads, groups, dim] float32; scores: [batch, heads, groups, total] float32.
   Returns -1 (and does nothing) when a page is not one the kernels read. */
int lb_scores(const lb_page *pages, const int64_t *starts, int64_t n_pages, const lb_rope *rope,
              const float *q, int64_t groups, float *scores, int64_t total, float scaling, int threads) {
    if (lb_check(pages, starts, n_pages, groups, total)) return -1;
    lb_job job = {pages, starts, n_pages, rope, q, NULL, scores, NULL, groups, total, 0, 0, scaling, NULL};
    lb_run(&job, threads, lb_scores_job, NULL, 0);
    return 0;
}

/* acc[b, h, g, :] += sum over pages i and tokens t of p[b, h, g, starts[i] + t] * value(i; b, h, t).
   p: [batch, heads, groups, total] float32; acc: [batch, heads, groups, dim] float32. */
int lb_accumulate(const lb_page *pages, const int64_t *starts, int64_t n_pages, const float *p,
                  int64_t groups, int64_t total, float *acc, int threads) {
    if (lb_check(pages, starts, n_pages, groups, total)) return -1;
    if (n_pages == 0) return 0;
    const int64_t acc_size = pages[0].batch * pages[0].heads * groups * pages[0].dim;
    float *partials = NULL;
    if (threads > 1) {
        partials = malloc((size_t)(threads - 1) * (size_t)acc_size * sizeof(float));
        if (!partials) threads = 1;
    }
    lb_job job = {pages, starts, n_pages, NULL, NULL, p, NULL, acc, groups, total, 0, 0, 1.0f, NULL};
    lb_run(&job, threads, lb_accumulate_job, partials, acc_size);
    free(partials);
    return 0;
}

/* One decode step's attention for a layer, in one call.

   A stream (keys or values) is its packed pages and its fp runs (the sink, the fp residual;
   pre-RoPE keys given already rotated to their positions), each a run of slots. The scores of
   every slot go into one row per query (lb_scores' kernels, dot products for the fp runs), the
   mask row is added, the softmax is taken in place over the whole row, and the weighted sums of
   the values are added (lb_accumulate's kernels, the fp runs); out = sum / (sum of weights), or
   0 for a row that every slot is masked from. value_rotation (NULL: none) is R [dim, dim] of
   value pages stored in a rotated basis (value = stored R^T): their sum is rotated back once,
   after the tokens are summed, and the fp runs' added unrotated. */
typedef struct {
    const void *data; /* [batch, heads, tokens, dim] rows, channels contiguous */
    int32_t dtype;    /* LB_F32, LB_F16 or LB_BF16 */
    int32_t rotate;   /* 1: pre-RoPE keys, rotated here at their slots' positions (the call's tables) */
    int64_t start, tokens; /* the slot of the first token, how many */
    int64_t stride[3];     /* elements: batch row, head, token */
} lb_dense;

typedef struct {
    const lb_page *pages;
    const int64_t *starts; /* slot of each page's first token */
    int64_t n_pages;
    const lb_dense *dense;
    int64_t n_dense;
} lb_stream;

static void lb_dense_row(const lb_dense *x, int64_t b, int64_t h, int64_t t, int64_t d, float *out) {
    const int64_t i = b * x->stride[0] + h * x->stride[1] + t * x->stride[2];
    if (x->dtype == LB_F32) {
        memcpy(out, (const float *)x->data + i, (size_t)d * sizeof(float));
    } else if (x->dtype == LB_F16) {
        for (int64_t j = 0; j < d; j++) out[j] = lb_half(((const uint16_t *)x->data)[i + j]);
    } else {
        for (int64_t j = 0; j < d; j++) {
            const uint32_t bits32 = (uint32_t)((const uint16_t *)x->data)[i + j] << 16;
            memcpy(&out[j], &bits32, 4);
        }
    }
}

/* n floats from `x` (dtype LB_F32, LB_F16 or LB_BF16) into out, and back (rounded to nearest even,
   as torch's conversions). */
static void lb_load_floats(const void *x, int dtype, int64_t n, float *out) {
    const lb_dense run = {x, dtype, 0, 0, 1, {0, 0, 0}};
    lb_dense_row(&run, 0, 0, 0, n, out);
}

static uint16_t lb_to_half(float v) {
    _Float16 h = (_Float16)v;
    uint16_t out;
    memcpy(&out, &h, 2);
    return out;
}

static void lb_store_floats(const float *x, int64_t n, int dtype, void *out) {
    for (int64_t i = 0; i < n; i++) {
        if (dtype == LB_F32) {
            ((float *)out)[i] = x[i];
        } else if (dtype == LB_F16) {
            ((uint16_t *)out)[i] = lb_to_half(x[i]);
        } else {
            uint32_t u;
            memcpy(&u, &x[i], 4);
            u = (u & 0x7fffffffu) > 0x7f800000u ? 0x7fc00000u : u + 0x7fffu + ((u >> 16) & 1u);
            ((uint16_t *)out)[i] = (uint16_t)(u >> 16);
        }
    }
}

/* e^x for x <= 0 (a score less its row's maximum), 0 below -87.3 (-inf included): x = n ln 2 + r
   with |r| <= ln 2 / 2 and e^r by a degree-7 polynomial (Cephes' expf: a relative error of about
   2e-7), branch-free so that loops over it vectorize. */
static inline float lb_exp(float x) {
    const float low = -87.3f, c = x < low ? low : x;
    const float n = (c * 1.44269504f + 12582912.0f) - 12582912.0f; /* round to nearest */
    float r = c - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    const int32_t e = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &e, 4);
    return x < low ? 0.0f : p * scale;
}

/* A row of n scores to e^(s - max) in place; returns their sum (0 where every score is -inf) and
   writes the max (0 there) to *max. The max and the sum in 16 lanes, the map on its own: each
   loop vectorizes. */
static float lb_softmax_row(float *s, int64_t n, float *max) {
    float lanes[16], top = -INFINITY, sum = 0.0f;
    int64_t t = 0;
    for (int l = 0; l < 16; l++) lanes[l] = -INFINITY;
    for (; t + 16 <= n; t += 16)
        for (int l = 0; l < 16; l++) lanes[l] = s[t + l] > lanes[l] ? s[t + l] : lanes[l];
    for (; t < n; t++) top = s[t] > top ? s[t] : top;
    for (int l = 0; l < 16; l++) top = lanes[l] > top ? lanes[l] : top;
    if (top == -INFINITY) top = 0.0f;
    *max = top;
    for (t = 0; t < n; t++) s[t] = lb_exp(s[t] - top);
    for (int l = 0; l < 16; l++) lanes[l] = 0.0f;
    for (t = 0; t + 16 <= n; t += 16)
        for (int l = 0; l < 16; l++) lanes[l] += s[t + l];
    for (; t < n; t++) sum += s[t];
    for (int l = 0; l < 16; l++) sum += lanes[l];
    return sum;
}

static int lb_check_dense(const lb_dense *parts, int64_t n, int64_t total) {
    for (int64_t i = 0; i < n; i++) {
        const lb_dense *x = &parts[i];
        if (x->start < 0 || x->tokens < 0 || x->start + x->tokens > total) return -1;
        if (x->dtype != LB_F32 && x->dtype != LB_F16 && x->dtype != LB_BF16) return -1;
    }
    return 0;
}

/* The tokens of a stream's pages in slots before s (a page's tokens are counted from its first). */
static int64_t lb_tokens_before(const lb_stream *x, int64_t s) {
    int64_t n = 0;
    for (int64_t i = 0; i < x->n_pages; i++) {
        const int64_t a = s - x->starts[i];
        n += a < 0 ? 0 : (a > x->pages[i].tokens ? x->pages[i].tokens : a);
    }
    return n;
}

/* Slot s moved down to a whole 16 tokens into the key page holding it (so that a part of a page
   is whole tiles but for the page's own last tokens). */
static int64_t lb_slot_split(const lb_stream *keys, int64_t s) {
    for (int64_t i = 0; i < keys->n_pages; i++) {
        const int64_t a = s - keys->starts[i];
        if (a >= 0 && a < keys->pages[i].tokens) return keys->starts[i] + a / 16 * 16;
    }
    return s;
}

/* A decode step's attention over the slots s0..s1 of one part (lb_attend's): the scores of those
   slots into their places in `scores` [rows][total], the mask added, e^(s - m) with m the part's
   own maximum of each row (m[r], or 0 where every slot is masked), their sums l[r], and the sums
   of e^(s - m) v over the pages' values into acc and over the fp runs' into acc_dense (both
   [rows][dim], zeroed by the caller). */
typedef struct {
    const lb_stream *keys, *values;
    const lb_rope *rope;
    const float *q, *mask;
    int64_t batch, heads, groups, dim, total, mask_stride;
    float scaling;
    float *scores;
} lb_step;

/* The fp runs of a stream inside slots s0..s1: the keys' scores into x->scores (acc NULL; a
   run of pre-RoPE keys rotated first), or the values' sums weighted by the row's e^(s - m) into
   acc [rows][dim]. */
static void lb_dense_part(const lb_step *x, const lb_stream *stream, int64_t s0, int64_t s1, float *acc) {
    const int64_t G = x->groups, d = x->dim;
    float row[LB_MAX_DIM], turned[LB_MAX_DIM];
    for (int64_t i = 0; i < stream->n_dense; i++) {
        const lb_dense *run = &stream->dense[i];
        const int64_t a = s0 > run->start ? s0 - run->start : 0;
        const int64_t e = s1 - run->start < run->tokens ? s1 - run->start : run->tokens;
        for (int64_t b = 0; b < x->batch; b++)
            for (int64_t h = 0; h < x->heads; h++)
                for (int64_t t = a; t < e; t++) {
                    lb_dense_row(run, b, h, t, d, row);
                    if (run->rotate) {
                        lb_rotate(x->rope, b, run->start + t, d, row, turned);
                        memcpy(row, turned, (size_t)d * sizeof(float));
                    }
                    for (int64_t g = 0; g < G; g++) {
                        const int64_t r = (b * x->heads + h) * G + g;
                        float *score = x->scores + r * x->total + run->start + t;
                        if (!acc) {
                            *score = lb_dot(x->q + r * d, row, d) * x->scaling;
                            continue;
                        }
                        for (int64_t j = 0; j < d; j++) acc[r * d + j] += *score * row[j];
                    }
                }
    }
}

static void lb_attend_part(const lb_step *x, int64_t s0, int64_t s1, float *m, float *l, float *acc, float *acc_dense) {
    const int64_t G = x->groups, rows = x->batch * x->heads * G;
    lb_table_cache tables = {.b = -1, .tables = NULL};
    lb_job job = {x->keys->pages, x->keys->starts, x->keys->n_pages, x->rope, x->q, NULL, x->scores, NULL, G,
                  x->total, lb_tokens_before(x->keys, s0), lb_tokens_before(x->keys, s1), x->scaling, &tables};
    lb_each_page(&job, lb_scores_page);
    lb_dense_part(x, x->keys, s0, s1, NULL);
    for (int64_t r = 0; r < rows; r++) {
        float *s = x->scores + r * x->total + s0;
        if (x->mask) {
            const float *mk = x->mask + (r / (x->heads * G)) * x->mask_stride + s0;
            for (int64_t t = 0; t < s1 - s0; t++) s[t] += mk[t];
        }
        l[r] = lb_softmax_row(s, s1 - s0, &m[r]);
    }
    free(tables.tables);
    tables.b = -1, tables.tables = NULL;
    job = (lb_job){x->values->pages, x->values->starts, x->values->n_pages, NULL, NULL, x->scores, NULL, acc, G,
                   x->total, lb_tokens_before(x->values, s0), lb_tokens_before(x->values, s1), 1.0f, &tables};
    lb_each_page(&job, lb_accumulate_page);
    free(tables.tables);
    lb_dense_part(x, x->values, s0, s1, acc_dense);
}

/* q: [batch, heads, groups, dim] in io_dtype (LB_F32, LB_F16 or LB_BF16), already rotated to its
   position, or (rotate_query, with RoPE tables) not yet: then rotated here, in float32 as torch's
   rotate-half RoPE, at the position of the last slot (the token just stored). mask: NULL or an
   additive row of `total` floats a batch row (mask_stride 0: one row for all); out: [batch, heads,
   groups, dim] in io_dtype (computed in float32, then rounded).

   The slots are split into one contiguous part per thread (at least 256 slots each), and each
   part is a whole flash-decoding split: its scores, its own softmax maximum and sum, its weighted
   sums of the values, with no barrier between the passes; the parts are merged in part order
   (weights e^(m_part - m), m the largest part maximum). Returns -1 (having written nothing to
   trust) when a page or run is not one this reads, or memory runs out. */
int lb_attend(const lb_stream *keys, const lb_stream *values, const lb_rope *rope, const void *q, int io_dtype,
              int64_t batch, int64_t heads, int64_t groups, int64_t dim, int64_t total, float scaling,
              const float *mask, int64_t mask_stride, const float *value_rotation, int rotate_query, void *out,
              int threads) {
    if (dim <= 0 || dim > LB_MAX_DIM || total <= 0) return -1;
    if (lb_check(keys->pages, keys->starts, keys->n_pages, groups, total) ||
        lb_check(values->pages, values->starts, values->n_pages, groups, total) ||
        lb_check_dense(keys->dense, keys->n_dense, total) || lb_check_dense(values->dense, values->n_dense, total))
        return -1;
    if (rotate_query && (!rope || !rope->cos || dim % 2)) return -1;
    for (int64_t i = 0; i < keys->n_dense + values->n_dense; i++) { /* runs rotated: keys', with tables */
        const int value = i >= keys->n_dense;
        const lb_dense *run = value ? &values->dense[i - keys->n_dense] : &keys->dense[i];
        if (run->rotate && (value || !rope || !rope->cos || dim % 2)) return -1;
    }
    if (io_dtype != LB_F32 && io_dtype != LB_F16 && io_dtype != LB_BF16) return -1;
    const int64_t rows = batch * heads * groups, acc_size = rows * dim;
    int64_t n = threads < 1 ? 1 : (threads > LB_MAX_THREADS ? LB_MAX_THREADS : threads);
    if (n > total / 256) n = total / 256 > 0 ? total / 256 : 1;
    float *scores = malloc((size_t)(rows * total) * sizeof(float)); /* [B, H, G, T] */
    float *qr = malloc((size_t)acc_size * sizeof(float));
    /* each part's maxima, sums [rows] and accumulators (the pages', the fp runs') [rows][dim] */
    float *parts = calloc((size_t)(n * (2 * rows + 2 * acc_size)), sizeof(float));
    if (!scores || !qr || !parts) {
        free(scores), free(qr), free(parts);
        return -1;
    }
    lb_load_floats(q, io_dtype, acc_size, qr);
    if (rotate_query) {
        const int64_t half = dim / 2;
        float x[LB_MAX_DIM];
        for (int64_t r = 0; r < rows; r++) {
            const int64_t p = rope->positions[(r / (heads * groups)) * rope->positions_stride + total - 1];
            const float *c = rope->cos + p * dim, *sn = rope->sin + p * dim;
            memcpy(x, qr + r * dim, (size_t)dim * sizeof(float));
            for (int64_t j = 0; j < dim; j++) {
                const float turned = j < half ? -x[j + half] : x[j - half];
                qr[r * dim + j] = x[j] * c[j] + turned * sn[j];
            }
        }
    }
    const lb_step step = {keys, values, rope, qr, mask, batch, heads, groups, dim, total, mask_stride, scaling, scores};
    int64_t bounds[LB_MAX_THREADS + 1];
    for (int64_t i = 0; i <= n; i++) bounds[i] = i == n ? total : lb_slot_split(keys, total * i / n);
#pragma omp parallel for num_threads(n) schedule(static, 1)
    for (int64_t i = 0; i < n; i++) {
        float *part = parts + i * (2 * rows + 2 * acc_size);
        lb_attend_part(&step, bounds[i], bounds[i + 1], part, part + rows, part + 2 * rows,
                       part + 2 * rows + acc_size);
    }
    /* value_rotation transposed, so that rotating a sum back runs along contiguous rows */
    float *turn = value_rotation ? malloc((size_t)(dim * dim) * sizeof(float)) : NULL;
    if (value_rotation && !turn) {
        free(scores), free(qr), free(parts);
        return -1;
    }
    for (int64_t i = 0; i < dim && turn; i++)
        for (int64_t j = 0; j < dim; j++) turn[i * dim + j] = value_rotation[j * dim + i];
    const int64_t stride = 2 * rows + 2 * acc_size; /* a part's floats */
    for (int64_t r = 0; r < rows; r++) {
        float top = -INFINITY, l = 0.0f, a[LB_MAX_DIM] = {0}, o[LB_MAX_DIM] = {0};
        for (int64_t i = 0; i < n; i++) top = parts[i * stride + r] > top ? parts[i * stride + r] : top;
        for (int64_t i = 0; i < n; i++) { /* the pages' sums into a, the fp runs' into o */
            const float *part = parts + i * stride;
            const float w = n == 1 ? 1.0f : lb_exp(part[r] - top);
            l += w * part[rows + r];
            for (int64_t j = 0; j < dim; j++) {
                a[j] += w * part[2 * rows + r * dim + j];
                o[j] += w * part[2 * rows + acc_size + r * dim + j];
            }
        }
        if (l == 0.0f) l = 1.0f;
        if (turn) /* o += a R^T: the pages' sum in the model's basis */
            for (int64_t i = 0; i < dim; i++)
                for (int64_t j = 0; j < dim; j++) o[j] += a[i] * turn[i * dim + j];
        else
            for (int64_t j = 0; j < dim; j++) o[j] += a[j];
        for (int64_t j = 0; j < dim; j++) o[j] /= l;
        lb_store_floats(o, dim, io_dtype, (char *)out + r * dim * (io_dtype == LB_F32 ? 4 : 2));
    }
    free(turn);
    free(scores), free(qr), free(parts);
    return 0;
}

/* Code ``code`` of channel i into a zeroed row's little-endian bit stream. */
static void lb_put_code(uint8_t *row, int64_t i, int bits, unsigned code) {
    const int64_t bit = i * bits, byte = bit >> 3;
    row[byte] |= (uint8_t)(code << (bit & 7));
    if ((bit & 7) + bits > 8) row[byte + 1] |= (uint8_t)(code >> (8 - (bit & 7)));
}

/* Integer codes of new tokens, per token and channel group, asymmetric: the decode step's store
   (lowbit.kv.int_quant.IntTokenQuantizer), the same operations as the torch path in the same
   order, so the codes and statistics equal torch's bit for bit. Per group of `group` values,
   with an integer zero point (minimum 0; lowbit.formats.intq):
       lo = min(min x, 0) * clip, hi = max(max x, 0) * clip, scale = (hi - lo) / qmax
       (0 -> 1, below the smallest normal -> the smallest normal),
       zero = clamp(round(-(lo / scale)), 0, qmax), code = clamp(round(x * (1 / scale)) + zero, 0, qmax)
   or with an fp16 minimum (minimum 1; KIVI's form, IntTokenQuantizer._minmax_codes):
       mid = (lo + hi) / 2 of the group's min and max, lo and hi moved towards mid by clip,
       scale = (hi - lo) / qmax (0 -> 1) and lo rounded to fp16, code = clamp(round((x - lo) /
       scale), 0, qmax)
   with round half to even. x: [rows, dim] float32 (dtype 2), float16 (1) or bfloat16 (4);
   codes: [rows, row_bytes] packed as lowbit.formats.packing's plain order; scale: [rows, dim /
   group] float16 bits; zero: [rows, dim / group] uint8 zero points, or float16 bits of the
   minimums. Returns -1 when x holds a NaN or an infinity, or a statistic fp16 cannot hold (the
   caller's torch path decides). */
int lb_quantize_int_rows(const void *x, int dtype, int64_t rows, int64_t dim, int64_t group, int bits,
                         float clip, int minimum, uint8_t *codes, int64_t row_bytes, uint16_t *scale, void *zero) {
    if (dim <= 0 || dim > LB_MAX_DIM || group <= 0 || dim % group || bits < 1 || bits > 8) return -1;
    const float qmax = (float)((1 << bits) - 1), tiny = 1.17549435e-38f;
    const int64_t ng = dim / group;
    for (int64_t r = 0; r < rows; r++) {
        float v[LB_MAX_DIM];
        for (int64_t i = 0; i < dim; i++) {
            const int64_t k = r * dim + i;
            if (dtype == LB_F32) {
                v[i] = ((const float *)x)[k];
            } else if (dtype == LB_F16) {
                v[i] = lb_half(((const uint16_t *)x)[k]);
            } else {
                uint32_t bits32 = (uint32_t)((const uint16_t *)x)[k] << 16;
                memcpy(&v[i], &bits32, 4);
            }
            if (!(v[i] - v[i] == 0.0f)) return -1; /* NaN or infinity */
        }
        uint8_t *row = codes + r * row_bytes;
        memset(row, 0, (size_t)row_bytes);
        for (int64_t g = 0; g < ng; g++) {
            const float *xg = v + g * group;
            float lo = xg[0], hi = xg[0];
            for (int64_t i = 1; i < group; i++) {
                lo = xg[i] < lo ? xg[i] : lo;
                hi = xg[i] > hi ? xg[i] : hi;
            }
            if (minimum) {
                const float mid = 0.5f * (lo + hi);
                lo = mid + (lo - mid) * clip, hi = mid + (hi - mid) * clip;
                const float s = (hi - lo) / qmax;
                const uint16_t s16 = lb_to_half(s == 0.0f ? 1.0f : s), lo16 = lb_to_half(lo);
                const float sf = lb_half(s16), lf = lb_half(lo16);
                if (!(sf > 0.0f && sf - sf == 0.0f && lf - lf == 0.0f)) return -1; /* fp16 under- or overflow */
                scale[r * ng + g] = s16;
                ((uint16_t *)zero)[r * ng + g] = lo16;
                for (int64_t i = 0; i < group; i++) {
                    float q = nearbyintf((xg[i] - lf) / sf);
                    q = q < 0.0f ? 0.0f : (q > qmax ? qmax : q);
                    lb_put_code(row, g * group + i, bits, (unsigned)q);
                }
                continue;
            }
            lo = lo < 0.0f ? lo : 0.0f;
            hi = hi > 0.0f ? hi : 0.0f;
            if (clip != 1.0f) lo = lo * clip, hi = hi * clip;
            float s = (hi - lo) / qmax;
            if (!(s - s == 0.0f)) return -1;
            s = s == 0.0f ? 1.0f : (s < tiny ? tiny : s);
            float z = nearbyintf(-(lo / s));
            z = z < 0.0f ? 0.0f : (z > qmax ? qmax : z);
            const float inv = 1.0f / s;
            scale[r * ng + g] = lb_to_half(s);
            ((uint8_t *)zero)[r * ng + g] = (uint8_t)z;
            for (int64_t i = 0; i < group; i++) {
                float q = nearbyintf(xg[i] * inv) + z;
                q = q < 0.0f ? 0.0f : (q > qmax ? qmax : q);
                lb_put_code(row, g * group + i, bits, (unsigned)q);
            }
        }
    }
    return 0;
}

/* The number of midpoints (level[j] + level[j+1]) / 2 of an ascending codebook of K levels below
   v: the index of the nearest level, ties to the lower (torch.bucketize over the midpoints). */
static unsigned lb_nearest(const float *level, int64_t K, float v) {
    int64_t lo = 0, hi = K - 1;
    while (lo < hi) {
        const int64_t mid = (lo + hi) / 2;
        if ((level[mid + 1] + level[mid]) / 2.0f < v) lo = mid + 1;
        else hi = mid;
    }
    return (unsigned)lo;
}

/* KVQuant's store of new tokens x [B, H, T, D] float32 (already in the rotated basis where the
   quantizer rotates), bit for bit lowbit.kv.kvquant.KVQuantQuantizer.quantize's torch path:

   outliers: per channel (channel_center/half given, fp16 [H, D]), the elements with
   |x - center| > half when channel_outliers; per token, the k largest |x| over the token's H x D
   elements (ties to the lower channel). Per token,
   the non-outliers' (max + min) / 2 and (max - min) / 2 rounded to fp16 (a zero half range as
   1) into token_center/half [B, H, T]. Codes: the nearest of the codebook's 2^bits levels (one
   [K] or one per channel [H * D, K]; ties to the lower) of ((x - center) / half) clamped to
   [-1, 1], packed into rows of row_bytes. Outliers: CSR rows (one per token and batch row,
   token-major), words channel << 16 | fp16 bits.

   Where they go: codes and token_center/half have room for out_tokens >= T tokens a head (a
   page's open buffers, passed at their first free token), the new tokens in the first T.
   row_ptr[0] holds the number of outliers already in col_val (0 for a new page): the rows
   continue that count and the words follow those, at most col_capacity words in all; *nnz is
   the count after. Returns nonzero, having written nothing to trust, for a NaN or infinity, an
   outlier beyond fp16's range, more outliers than col_capacity, or settings out of range. */
int lb_quantize_kvquant(const float *x, int64_t B, int64_t H, int64_t T, int64_t D, int bits,
                        const float *codebook, int channel_codebooks, const uint16_t *channel_center,
                        const uint16_t *channel_half, int channel_outliers, int64_t k,
                        uint8_t *codes, int64_t row_bytes, uint16_t *token_center,
                        uint16_t *token_half, int64_t out_tokens, int32_t *row_ptr, int32_t *col_val,
                        int64_t col_capacity, int64_t *nnz) {
    const int64_t n = H * D, K = (int64_t)1 << bits;
    if (D <= 0 || D > LB_MAX_DIM || bits < 1 || bits > 8 || n > 65536 || k < 0 || k > n || out_tokens < T) return -1;
    uint8_t *outlier = malloc((size_t)n);
    float *mag = malloc((size_t)n * sizeof(float));
    if (!outlier || !mag) {
        free(outlier), free(mag);
        return -1;
    }
    const float fmax = 3.40282347e+38f;
    int64_t count = row_ptr[0];
    int status = 0;
    for (int64_t t = 0; t < T && !status; t++) {
        for (int64_t b = 0; b < B && !status; b++) {
            /* x[b, h, t, :] of every head: element (h, d) at ((b * H + h) * T + t) * D + d */
            for (int64_t h = 0; h < H; h++) {
                const float *xr = x + ((b * H + h) * T + t) * D;
                for (int64_t d = 0; d < D; d++) {
                    if (!(xr[d] - xr[d] == 0.0f)) status = -1;
                    mag[h * D + d] = fabsf(xr[d]);
                }
            }
            if (status) break;
            memset(outlier, 0, (size_t)n);
            if (channel_center) {
                if (channel_outliers)
                    for (int64_t h = 0; h < H; h++) {
                        const float *xr = x + ((b * H + h) * T + t) * D;
                        for (int64_t d = 0; d < D; d++)
                            outlier[h * D + d] = fabsf(xr[d] - lb_half(channel_center[h * D + d])) >
                                                 lb_half(channel_half[h * D + d]);
                    }
            } else {
                for (int64_t j = 0; j < k; j++) { /* k is a few: a scan for each */
                    int64_t best = -1;
                    for (int64_t c = 0; c < n; c++)
                        if (!outlier[c] && (best < 0 || mag[c] > mag[best])) best = c;
                    if (best >= 0) outlier[best] = 1;
                }
            }
            for (int64_t h = 0; h < H; h++) {
                const float *xr = x + ((b * H + h) * T + t) * D;
                float center = 0.0f, half = 1.0f;
                const int64_t slot = (b * H + h) * out_tokens + t;
                if (!channel_center) {
                    float hi = -fmax, lo = fmax;
                    for (int64_t d = 0; d < D; d++) {
                        if (outlier[h * D + d]) continue;
                        hi = xr[d] > hi ? xr[d] : hi;
                        lo = xr[d] < lo ? xr[d] : lo;
                    }
                    token_center[slot] = lb_to_half((hi + lo) / 2.0f);
                    token_half[slot] = lb_to_half((hi - lo) / 2.0f);
                    if (lb_half(token_half[slot]) == 0.0f) token_half[slot] = lb_to_half(1.0f);
                    center = lb_half(token_center[slot]);
                    half = lb_half(token_half[slot]);
                }
                uint8_t *row = codes + slot * row_bytes;
                memset(row, 0, (size_t)row_bytes);
                for (int64_t d = 0; d < D; d++) {
                    const int64_t c = h * D + d;
                    if (channel_center) center = lb_half(channel_center[c]), half = lb_half(channel_half[c]);
                    float v = (xr[d] - center) / half;
                    v = v < -1.0f ? -1.0f : (v > 1.0f ? 1.0f : v);
                    lb_put_code(row, d, bits, lb_nearest(codebook + (channel_codebooks ? c * K : 0), K, v));
                }
            }
            for (int64_t c = 0; c < n && !status; c++) { /* token-major, channels ascending */
                if (!outlier[c]) continue;
                const float v = x[((b * H + c / D) * T + t) * D + c % D];
                if (fabsf(v) > 65504.0f || count >= col_capacity) {
                    status = -1;
                    break;
                }
                col_val[count++] = (int32_t)(((uint32_t)c << 16) | lb_to_half(v));
            }
            row_ptr[t * B + b + 1] = (int32_t)count;
        }
    }
    *nnz = count;
    free(outlier), free(mag);
    return status;
}
