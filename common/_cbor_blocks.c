/* vLLM block preimages for sha256_cbor, laid out back to back; used by common/blockhash_native.py.
 *
 * Plain C99 with no Python API: it is loaded with ctypes, so building it needs a C compiler
 * but not Python's headers (setuptools builds it as an optional extension; without it the
 * project falls back to the numpy encoder in common/blockhash_cbor.py).
 *
 * vLLM hashes cbor2.dumps((parent, tuple(block_tokens), extra_keys), canonical=True) per
 * block. For each of n_blocks blocks of block_size ids this writes
 *
 *     0x83 0x58 0x20 | 32 zero bytes (the parent digest, filled in by the caller) |
 *     CBOR array head of block_size | each id as a canonical CBOR unsigned int | tail
 *
 * where tail is the CBOR of the block's extra keys (first_tail for block 0), and sets
 * ends[i] to the offset just past block i. Canonical CBOR unsigned ints are the shortest
 * form: the id itself below 24, else 0x18/0x19/0x1a/0x1b and 1/2/4/8 big-endian bytes.
 *
 * Returns the number of bytes written, or 0 if they would not fit in out_cap (nothing is
 * written past out_cap). 44 + 9 * block_size + the longer tail per block, and 8 bytes
 * more, always fit.
 *
 * ci_block_chain does the whole chain: it encodes one block at a time into a scratch buffer
 * (with block 0's tail, the shared one, or since ABI 2 each block's own: LoRA, multimodal
 * and lookahead keys differ per block) and hashes it with SHA-256 functions the caller passes in: OpenSSL's SHA256_Init/
 * SHA256_Update/SHA256_Final, from the libcrypto that Python's hashlib itself uses (this file
 * has no SHA-256 of its own, and links against nothing). ci_decimal_keys writes the Redis
 * members of the digests: the decimal of each one's last 8 bytes, big-endian.
 */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

static uint8_t *put_head(uint8_t *p, uint8_t major, uint64_t value)
{
    uint8_t m = (uint8_t)(major << 5);
    if (value < 24) {
        *p++ = (uint8_t)(m | value);
    } else if (value < 0x100) {
        *p++ = m | 24;
        *p++ = (uint8_t)value;
    } else if (value < 0x10000) {
        *p++ = m | 25;
        *p++ = (uint8_t)(value >> 8);
        *p++ = (uint8_t)value;
    } else if (value < 0x100000000ULL) {
        *p++ = m | 26;
        *p++ = (uint8_t)(value >> 24);
        *p++ = (uint8_t)(value >> 16);
        *p++ = (uint8_t)(value >> 8);
        *p++ = (uint8_t)value;
    } else {
        *p++ = m | 27;
        for (int shift = 56; shift >= 0; shift -= 8)
            *p++ = (uint8_t)(value >> shift);
    }
    return p;
}

/* An unsigned int below 2**32 as its canonical CBOR (1, 2, 3 or 5 bytes), without a
 * branch on its width (token ids are random: a branch would be mispredicted half the
 * time): the encoding is the first bytes of one big-endian 8-byte store, and the bytes past
 * it are overwritten by the next write. Needs 8 writable bytes at p. */
static uint8_t *put_uint32(uint8_t *p, uint64_t value)
{
    static const uint8_t heads[4] = {0, 0x18, 0x19, 0x1a};
    static const uint8_t shifts[4] = {56, 48, 40, 24};
    static const uint8_t lengths[4] = {1, 2, 3, 5};
    unsigned width = (unsigned)(value >= 24) + (value >= 0x100) + (value >= 0x10000);
    uint64_t word = ((uint64_t)heads[width] << 56) | (value << shifts[width]);
#if defined(__GNUC__) && defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    word = __builtin_bswap64(word);
    memcpy(p, &word, 8);
#else
    for (int i = 0; i < 8; i++)
        p[i] = (uint8_t)(word >> (56 - 8 * i));
#endif
    return p + lengths[width];
}

size_t ci_block_preimages(const uint64_t *ids, size_t n_blocks, size_t block_size,
                          const uint8_t *first_tail, size_t first_tail_len,
                          const uint8_t *tail, size_t tail_len,
                          uint8_t *out, size_t out_cap, uint64_t *ends)
{
    uint8_t array_head[9];
    size_t array_head_len = (size_t)(put_head(array_head, 4, block_size) - array_head);
    size_t longest_tail = first_tail_len > tail_len ? first_tail_len : tail_len;
    uint8_t *p = out;
    for (size_t b = 0; b < n_blocks; b++) {
        /* the worst case of this block, checked before writing any of it */
        size_t room = (size_t)(out + out_cap - p);
        if (room < 35 + array_head_len + 9 * block_size + longest_tail + 8)
            return 0;
        *p++ = 0x83; /* array(3) */
        *p++ = 0x58; /* bytes, 1-byte length */
        *p++ = 0x20; /* 32 */
        memset(p, 0, 32);
        p += 32;
        memcpy(p, array_head, array_head_len);
        p += array_head_len;
        const uint64_t *id = ids + b * block_size;
        for (size_t i = 0; i < block_size; i++)
            p = id[i] >> 32 ? put_head(p, 0, id[i]) : put_uint32(p, id[i]);
        if (b == 0) {
            memcpy(p, first_tail, first_tail_len);
            p += first_tail_len;
        } else {
            memcpy(p, tail, tail_len);
            p += tail_len;
        }
        ends[b] = (uint64_t)(p - out);
    }
    return (size_t)(p - out);
}

typedef int (*sha_init_fn)(void *ctx);
typedef int (*sha_update_fn)(void *ctx, const void *data, size_t len);
typedef int (*sha_final_fn)(unsigned char *md, void *ctx);

/* ci_block_chain's arguments, packed by the caller into one buffer of 64-bit words (one
 * ctypes argument instead of twelve: each converted argument costs ~0.3 us in Python). */
struct chain_args {
    uint64_t ids, n_blocks, block_size;
    uint64_t first_tail, first_tail_len, tail, tail_len;
    uint64_t parent;      /* 32 bytes: the digest block 0 is chained from */
    uint64_t digests;     /* out: 32 * n_blocks bytes, block i's digest at 32 * i */
    uint64_t scratch, scratch_cap; /* one block: 52 + 9 * block_size + the longer tail */
    uint64_t ctx;         /* >= sizeof(SHA256_CTX) bytes */
    uint64_t sha_init, sha_update, sha_final; /* SHA256_Init/Update/Final */
    /* Optional (0: unused), since ABI 2: every block's own tail, back to back in tails;
     * tail_ends[b] is the offset just past block b's (block 0's starts at 0). Then
     * first_tail and tail are ignored; scratch_cap must fit the longest. */
    uint64_t tails, tail_ends;
};

/* The layout of struct chain_args this file implements: 2 = with per-block tails. The
 * caller checks it, so a stale build (which would ignore the tails) is never used for them. */
int ci_abi_version(void)
{
    return 2;
}

/* Digests of n_blocks chained blocks. Returns 0, or -1 if a SHA-256 function is missing,
 * scratch is too small, or a SHA-256 call failed. */
int ci_block_chain(const struct chain_args *a)
{
    const uint64_t *ids = (const uint64_t *)(uintptr_t)a->ids;
    uint8_t *digests = (uint8_t *)(uintptr_t)a->digests;
    uint8_t *scratch = (uint8_t *)(uintptr_t)a->scratch;
    void *ctx = (void *)(uintptr_t)a->ctx;
    size_t block_size = (size_t)a->block_size;
    sha_init_fn sha_init = (sha_init_fn)(uintptr_t)a->sha_init;
    sha_update_fn sha_update = (sha_update_fn)(uintptr_t)a->sha_update;
    sha_final_fn sha_final = (sha_final_fn)(uintptr_t)a->sha_final;
    uint64_t end;
    if (!sha_init || !sha_update || !sha_final)
        return -1;
    const uint8_t *tails = (const uint8_t *)(uintptr_t)a->tails;
    const uint64_t *tail_ends = (const uint64_t *)(uintptr_t)a->tail_ends;
    for (size_t b = 0; b < (size_t)a->n_blocks; b++) {
        const uint8_t *tail = (const uint8_t *)(uintptr_t)(b == 0 ? a->first_tail : a->tail);
        size_t tail_len = (size_t)(b == 0 ? a->first_tail_len : a->tail_len);
        if (tails && tail_ends) {
            size_t start = b == 0 ? 0 : (size_t)tail_ends[b - 1];
            tail = tails + start;
            tail_len = (size_t)tail_ends[b] - start;
        }
        if (ci_block_preimages(ids + b * block_size, 1, block_size, tail, tail_len, tail,
                               tail_len, scratch, (size_t)a->scratch_cap, &end) == 0)
            return -1;
        memcpy(scratch + 3, b == 0 ? (const uint8_t *)(uintptr_t)a->parent
                                   : digests + 32 * (b - 1), 32);
        if (sha_init(ctx) != 1 || sha_update(ctx, scratch, (size_t)end) != 1
            || sha_final(digests + 32 * b, ctx) != 1)
            return -1;
    }
    return 0;
}

/* The Redis members of n digests: each digest's last 8 bytes as a big-endian unsigned int
 * (the form vLLM's KV events carry), in decimal, each followed by one space. out must hold
 * 21 * n bytes. Returns the number of bytes written. */
size_t ci_decimal_keys(const uint8_t *digests, size_t n, uint8_t *out)
{
    uint8_t *p = out;
    for (size_t i = 0; i < n; i++) {
        const uint8_t *d = digests + 32 * i + 24;
        uint64_t value = 0;
        for (int k = 0; k < 8; k++)
            value = value << 8 | d[k];
        uint8_t digits[20];
        int count = 0;
        do {
            digits[count++] = (uint8_t)('0' + value % 10);
            value /= 10;
        } while (value);
        while (count)
            *p++ = digits[--count];
        *p++ = ' ';
    }
    return (size_t)(p - out);
}
