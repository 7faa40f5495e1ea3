/* The compactor's walk over a span of an L3 segment and its data-CRC check, wrapped by
   kvtier/tiers/disk/segment_scan.py (record format: kvtier/tiers/disk/segment.py). Built on first use by
   kvtier/_clib.py; the wrapper's flags define, from its Python constants:
     KVT_REC_MAGIC  a record header's magic (segment.REC_MAGIC)
     KVT_REC_HDR    a record header's bytes (segment.REC_HEADER_BYTES)
     KVT_ROW        integers per record row (segment_scan.ROW) */
#if !defined(KVT_REC_MAGIC) || !defined(KVT_REC_HDR) || !defined(KVT_ROW)
#error "built by kvtier/tiers/disk/segment_scan.py, which defines KVT_REC_MAGIC, KVT_REC_HDR and KVT_ROW"
#endif

#include <stdint.h>
#include <string.h>

static uint32_t T[8][256];

__attribute__((constructor)) static void kvt_crc_init(void) {
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++) c = (c & 1) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
        T[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; i++)
        for (int t = 1; t < 8; t++) T[t][i] = (T[t - 1][i] >> 8) ^ T[0][T[t - 1][i] & 0xFF];
}

/* CRC-32 (IEEE, reflected, as zlib.crc32), slicing by 8; ``crc`` is a running value (0 to start). */
uint32_t kvt_crc32(const uint8_t *p, int64_t n, uint32_t crc) {
    uint32_t c = ~crc;
    while (n && ((uintptr_t)p & 7)) { c = T[0][(c ^ *p++) & 0xFF] ^ (c >> 8); n--; }
    while (n >= 8) {
        uint32_t lo, hi;
        memcpy(&lo, p, 4);
        memcpy(&hi, p + 4, 4);
        lo ^= c;  /* little-endian hosts (x86, arm64) */
        c = T[7][lo & 0xFF] ^ T[6][(lo >> 8) & 0xFF] ^ T[5][(lo >> 16) & 0xFF] ^ T[4][lo >> 24]
          ^ T[3][hi & 0xFF] ^ T[2][(hi >> 8) & 0xFF] ^ T[1][(hi >> 16) & 0xFF] ^ T[0][hi >> 24];
        p += 8;
        n -= 8;
    }
    while (n--) c = T[0][(c ^ *p++) & 0xFF] ^ (c >> 8);
    return ~c;
}

static uint32_t rd32(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return v; }
static uint16_t rd16(const uint8_t *p) { uint16_t v; memcpy(&v, p, 2); return v; }

/* Where the walk resumes after a damaged header at ``off``: segment.next_magic, else past ``end``. */
static int64_t resync(const uint8_t *b, int64_t off, int64_t end) {
    for (int64_t p = off + 8; p + 4 <= end; p += 8)
        if (rd32(b + p) == KVT_REC_MAGIC) return p;
    int64_t past = (end - 3 + 7) & ~(int64_t)7;
    return past > off + 8 ? past : off + 8;
}

/* Rows of the records from ``off`` (see segment_scan.py); returns how many, ``*stop`` = where it stopped. */
int64_t kvt_seg_scan(const uint8_t *b, int64_t off, int64_t end, int64_t room, int64_t budget,
                     int64_t max_records, int64_t *rows, int64_t *stop) {
    int64_t n = 0, read = 0;
    while (off + KVT_REC_HDR <= end && read < budget && n < max_records) {
        const uint8_t *h = b + off;
        int64_t klen = rd16(h + 10), vlen = rd32(h + 12);
        int64_t size = (KVT_REC_HDR + klen + vlen + 7) & ~(int64_t)7;
        if (rd32(h) != KVT_REC_MAGIC || klen == 0 || off + size > room || kvt_crc32(h + 8, KVT_REC_HDR - 8, 0) != rd32(h + 4)) {
            off = resync(b, off, end);
            continue;
        }
        if (off + size > end) break;  /* cut by this read */
        int64_t *r = rows + KVT_ROW * n;
        r[0] = off; r[1] = size; r[2] = rd16(h + 8); r[3] = klen; r[4] = vlen; r[5] = rd32(h + 16);
        read += size;
        n++;
        off += size;
    }
    *stop = off;
    return n;
}

/* ok[j] = whether the data CRC of row idx[j] matches its stored one. */
void kvt_seg_verify(const uint8_t *b, const int64_t *rows, const int64_t *idx, int64_t m, uint8_t *ok) {
    for (int64_t j = 0; j < m; j++) {
        const int64_t *r = rows + KVT_ROW * idx[j];
        ok[j] = kvt_crc32(b + r[0] + KVT_REC_HDR, r[3] + r[4], 0) == (uint32_t)r[5];
    }
}
