/* A KV load's file reads and checksums, one layer's objects per call, with no GIL.
 *
 * Called through ctypes by kvstore/native_reader.py (the GIL is released during each call) for
 * kvstore/fs_read.py's loads into paged KV blocks. pd_kv_load does a whole layer: the opens and
 * size checks (which may wait for the medium) outside the load's write gate (kvstore/gate.py),
 * then inside it page-cache reads only (RWF_NOWAIT: never waiting for the medium) into each
 * object's header and spans, each object hashed (xxh3) while it is in cache, then the header and
 * digest compares. An object that is not plainly right is handed back open, for the caller's
 * slower path that finishes it or says what is wrong. pd_kv_hash is the xxh3 of objects some other
 * reader put in their spans (redis).
 * Spans are described, not passed as pointers: piece k of object i (k in [first[i], first[i+1]))
 * is desc[3k..3k+2] = (region, offset, nbytes), at bases[region] + offset; object i's header
 * lands at headers + header_size * i. xxh3 is the xxhash module's own (its exported XXH3 functions,
 * handed over once by pd_kv_init with the object format's sizes), so the digest is the one
 * kvstore/object_format.py checks.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <linux/magic.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <sys/vfs.h>
#include <unistd.h>

#include "kv_object.h"

int pd_kv_init(void *create, void *free_state, void *reset, void *update, void *digest, int64_t header,
               int64_t summed, int abandoned_result) {
    return set_object_format(create, free_state, reset, update, digest, header, summed, abandoned_result);
}

/* One prefetch-for-write per 4 KiB page of an object's spans, just before the read that fills them.
 * The spans are paged KV blocks scattered over a layer's cache: writing them with cold address
 * translations costs the kernel's copy a page walk per page, one after another (measured on a Zen 4
 * VM: a shuffled block set read ~30% slower than the same bytes read to consecutive addresses).
 * The prefetches start those walks side by side (~8% less CPU per load, benchmarks/kv_load_only.py);
 * they bring in one line per page, not the pages (prefetching every line evicts the source). */
static void warm_spans(const struct iovec *iov, int count) {
    for (int k = 1; k < count; k++) { /* iov[0] is the header, in memory just used */
        uintptr_t end = (uintptr_t)iov[k].iov_base + iov[k].iov_len; /* a prefetch never faults */
        for (uintptr_t page = (uintptr_t)iov[k].iov_base & ~(uintptr_t)4095; page < end; page += 4096)
            __builtin_prefetch((const void *)page, 1, 3);
    }
}

static int object_iov(int i, const int64_t *desc, const int64_t *first, const uint64_t *bases, uint8_t *headers,
                      struct iovec *iov) {
    int count = 0;
    iov[count].iov_base = headers + (size_t)header_size * i;
    iov[count++].iov_len = header_size;
    for (int64_t k = first[i]; k < first[i + 1] && count < MAX_IOV; k++) {
        iov[count].iov_base = (void *)(uintptr_t)(bases[desc[3 * k]] + (uint64_t)desc[3 * k + 1]);
        iov[count++].iov_len = (size_t)desc[3 * k + 2];
    }
    return count;
}

/* xxh3_64 over object i's header bytes [0, summed_size) and its spans, with `state` reused. */
static uint64_t hash_object(void *state, int i, const int64_t *desc, const int64_t *first, const uint64_t *bases,
                            const uint8_t *headers) {
    xxh_reset(state);
    xxh_update(state, headers + (size_t)header_size * i, summed_size);
    for (int64_t k = first[i]; k < first[i + 1]; k++)
        xxh_update(state, (const void *)(uintptr_t)(bases[desc[3 * k]] + (uint64_t)desc[3 * k + 1]),
                   (size_t)desc[3 * k + 2]);
    return xxh_digest(state);
}

/* Whether fd's filesystem keeps its files in memory (tmpfs, ramfs): a read there never waits for a
 * medium, and such filesystems refuse RWF_NOWAIT on some kernels. */
static int memory_backed(int fd) {
    struct statfs fs;
    return fstatfs(fd, &fs) == 0 && (fs.f_type == TMPFS_MAGIC || fs.f_type == RAMFS_MAGIC);
}

/* Object i from the page cache into its header and spans (preadv2 with RWF_NOWAIT: stops at the
 * first byte that is not there, never waits for the medium; a plain read on a memory-backed
 * filesystem that refuses the flag); the bytes read, or -errno (EOPNOTSUPP: no RWF_NOWAIT on this
 * filesystem, which keeps its files on a medium). */
static int64_t read_object(int fd, struct iovec *iov, int count) {
    int64_t got = 0;
    int at = 0;
    int flags = RWF_NOWAIT;
    while (at < count) {
        ssize_t r = preadv2(fd, iov + at, count - at, got, flags);
        if (r < 0) {
            if (errno == EINTR) continue;
            if (errno == EOPNOTSUPP && flags && memory_backed(fd)) {
                flags = 0;
                continue;
            }
            return errno == EAGAIN ? got : -errno;
        }
        if (r == 0) break; /* the file ended early: the caller reports it */
        got += r;
        while (at < count && (size_t)r >= iov[at].iov_len) r -= iov[at++].iov_len;
        if (at < count) {
            iov[at].iov_base = (char *)iov[at].iov_base + r;
            iov[at].iov_len -= r;
        }
    }
    return got;
}

static void close_all(int n, int64_t *fds) {
    for (int i = 0; i < n; i++)
        if (fds[i] >= 0) {
            close((int)fds[i]);
            fds[i] = -1;
        }
}

/* One layer's n objects (paths: n NUL-terminated strings back to back):
 *  1. open each and check that its size is a header plus its spans' bytes (outside the gate: may
 *     wait for the medium). fds[i] = its descriptor or -errno, sizes[i] = its size. If any is
 *     missing or of another size, nothing is read and all are closed: returns -ENOENT.
 *  2. inside the gate (gate: its words, kvstore/gate.py; NULL: none), every object from the page cache
 *     into its header and spans, hashed while it is in cache. got[i] = the bytes read or -errno,
 *     digests[i] = the xxh3 of header bytes [0, 56) and spans of an object read whole.
 *     A closed gate: nothing is read, all are closed, returns abandoned.
 *  3. an object read whole whose header bytes [0, 56) are expect[56 i, 56 i + 56) and whose digest
 *     is the one its header carries is closed (fds[i] = -1). Any other keeps its descriptor open in
 *     fds[i] for the caller, which finishes it (the part not in the page cache) or says what is wrong.
 * Returns 0, -ENOENT, abandoned, or -ENOMEM (no hash state; all closed). */
int pd_kv_load(int n, const char *paths, const int64_t *desc, const int64_t *first, const uint64_t *bases,
               uint8_t *headers, const uint8_t *expect, int64_t *gate, int64_t *fds, int64_t *sizes, int64_t *got,
               uint64_t *digests) {
    int refused = 0;
    for (int i = 0; i < n; i++, paths += strlen(paths) + 1) {
        int64_t want = header_size;
        for (int64_t k = first[i]; k < first[i + 1]; k++) want += desc[3 * k + 2];
        struct stat st;
        int fd = open(paths, O_RDONLY | O_CLOEXEC);
        got[i] = 0;
        sizes[i] = -1;
        if (fd < 0) {
            fds[i] = -errno;
            refused = 1;
            continue;
        }
        if (fstat(fd, &st) != 0) {
            fds[i] = -errno;
            close(fd);
            refused = 1;
            continue;
        }
        fds[i] = fd;
        sizes[i] = st.st_size;
        refused |= st.st_size != want;
    }
    if (refused) {
        close_all(n, fds);
        return -ENOENT;
    }
    void *state = xxh_create();
    if (!state) {
        close_all(n, fds);
        return -ENOMEM;
    }
    if (gate_enter(gate)) {
        xxh_free(state);
        close_all(n, fds);
        return abandoned;
    }
    struct iovec iov[MAX_IOV];
    for (int i = 0; i < n; i++) {
        int64_t total = sizes[i];
        digests[i] = 0;
        if (first[i + 1] - first[i] + 1 > MAX_IOV) continue; /* the caller reads it the slow way */
        int count = object_iov(i, desc, first, bases, headers, iov);
        warm_spans(iov, count);
        got[i] = read_object((int)fds[i], iov, count);
        if (got[i] == total) digests[i] = hash_object(state, i, desc, first, bases, headers);
    }
    gate_leave(gate);
    xxh_free(state);
    for (int i = 0; i < n; i++) {
        const uint8_t *header = headers + (size_t)header_size * i;
        uint64_t carried = 0; /* little endian, as the codec writes it */
        for (int b = header_size - 1; b >= summed_size; b--) carried = carried << 8 | header[b];
        if (got[i] == sizes[i] && carried == digests[i] &&
            !memcmp(header, expect + (size_t)summed_size * i, (size_t)summed_size)) {
            close((int)fds[i]);
            fds[i] = -1;
        }
    }
    return 0;
}

/* digests[i] = xxh3_64 over object i's header bytes [0, summed_size) and its spans (already read, by anyone). */
int pd_kv_hash(int n, const int64_t *desc, const int64_t *first, const uint64_t *bases, const uint8_t *headers,
               uint64_t *digests) {
    void *state = xxh_create();
    if (!state) return -ENOMEM;
    for (int i = 0; i < n; i++) digests[i] = hash_object(state, i, desc, first, bases, headers);
    xxh_free(state);
    return 0;
}

/* connectors/direct_rows.py's plan of a load (the same pieces as its numpy version, which a test
 * compares): chunk j of n_chunks holds rows [start_j, start_j + lens[j]) counted from the first chunk's
 * first token; rows [lo, hi) go to their slots (slots[r - lo]: byte slot * row_bytes of the K half,
 * half_bytes further in the V half), cut where the slots stop being consecutive; every other row goes
 * to scratch (K rows first, then V rows). Chunk j's pieces are desc rows [first[j], first[j + 1]): its
 * K pieces, then as many V pieces. Writes at most cap rows; returns the number of rows, or -1 if cap is
 * too small. Runs on the engine thread before any read starts: in C it takes microseconds. */
int64_t pd_rows_plan(int64_t n_chunks, const int64_t *lens, int64_t lo, int64_t hi, const int64_t *slots,
                     int64_t row_bytes, int64_t half_bytes, int64_t *desc, int64_t cap, int64_t *first) {
    int64_t total = 0;
    for (int64_t j = 0; j < n_chunks; j++) total += lens[j];
    const int64_t outside = total - (hi - lo); /* rows read into scratch */
    int64_t used = 0, start = 0, p = 0;
    first[0] = 0;
    for (int64_t j = 0; j < n_chunks; j++) {
        const int64_t end = start + lens[j], k0 = p;
        int64_t seg[3][2] = {{start, end < lo ? end : lo}, {start > lo ? start : lo, end < hi ? end : hi},
                             {start > hi ? start : hi, end}};
        for (int s = 0; s < 3; s++) {
            int64_t a = seg[s][0], b = seg[s][1];
            while (a < b) {
                int64_t stop = b, region = 1, offset = used * row_bytes;
                if (s == 1) { /* cache rows: up to the end of this slot run */
                    stop = a + 1;
                    while (stop < b && slots[stop - lo] == slots[stop - lo - 1] + 1) stop++;
                    region = 0;
                    offset = slots[a - lo] * row_bytes;
                } else {
                    used += b - a;
                }
                if (p >= cap) return -1;
                desc[3 * p] = region;
                desc[3 * p + 1] = offset;
                desc[3 * p + 2] = (stop - a) * row_bytes;
                p++;
                a = stop;
            }
        }
        const int64_t k = p - k0; /* the V pieces: the same rows in the V half, or after K's scratch */
        if (p + k > cap) return -1;
        for (int64_t i = 0; i < k; i++) {
            const int64_t *src = desc + 3 * (k0 + i);
            desc[3 * p] = src[0];
            desc[3 * p + 1] = src[1] + (src[0] == 0 ? half_bytes : outside * row_bytes);
            desc[3 * p + 2] = src[2];
            p++;
        }
        first[j + 1] = p;
        start = end;
    }
    return p;
}
