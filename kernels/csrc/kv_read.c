/* The per-object syscalls and hashing of a KV load from files, one layer's objects per call, with no GIL.
 *
 * Called through ctypes by kernels/kv_read.py (the GIL is released during each call) for
 * kvstore/filesystem.py's loads into paged KV blocks. Split so that the caller holds the load's
 * write gate (kvstore/gate.py) around the one call that writes memory it may lose, and that call
 * never waits for the medium:
 *   pd_kv_open       open + fstat every object (may wait: outside the gate)
 *   pd_kv_read_hash  page-cache reads (RWF_NOWAIT) into header and spans, then xxh3 of each object
 *                    while it is in cache (inside the gate: bounded, no I/O wait)
 *   pd_kv_close      close them
 * and pd_kv_hash, the xxh3 of objects some other reader put in their spans (redis).
 * Spans are described, not passed as pointers: piece k of object i (k in [first[i], first[i+1]))
 * is desc[3k..3k+2] = (region, offset, nbytes), at bases[region] + offset; object i's 64-byte
 * header lands at headers + 64 i. xxh3 is the xxhash module's own (its exported XXH3 functions,
 * handed over once by pd_kv_init), so the digest is the one kvstore/codec.py checks.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

#include "kv_object.h"

int pd_kv_init(void *create, void *free_state, void *reset, void *update, void *digest) {
    set_xxh3(create, free_state, reset, update, digest);
    return 0;
}

/* fds[i] = the open descriptor, or -errno; sizes[i] = the object's size in bytes. */
void pd_kv_open(int n, const char *const *paths, int32_t *fds, int64_t *sizes) {
    for (int i = 0; i < n; i++) {
        int fd = open(paths[i], O_RDONLY | O_CLOEXEC);
        struct stat st;
        if (fd < 0) {
            fds[i] = -errno;
            continue;
        }
        if (fstat(fd, &st) != 0) {
            fds[i] = -errno;
            close(fd);
            continue;
        }
        fds[i] = fd;
        sizes[i] = st.st_size;
    }
}

static int object_iov(int i, const int64_t *desc, const int64_t *first, const uint64_t *bases, uint8_t *headers,
                      struct iovec *iov) {
    int count = 0;
    iov[count].iov_base = headers + (size_t)HEADER * i;
    iov[count++].iov_len = HEADER;
    for (int64_t k = first[i]; k < first[i + 1] && count < MAX_IOV; k++) {
        iov[count].iov_base = (void *)(uintptr_t)(bases[desc[3 * k]] + (uint64_t)desc[3 * k + 1]);
        iov[count++].iov_len = (size_t)desc[3 * k + 2];
    }
    return count;
}

/* xxh3_64 over object i's header bytes [0, SUMMED) and its spans, with `state` reused. */
static uint64_t hash_object(void *state, int i, const int64_t *desc, const int64_t *first, const uint64_t *bases,
                            const uint8_t *headers) {
    xxh_reset(state);
    xxh_update(state, headers + (size_t)HEADER * i, SUMMED);
    for (int64_t k = first[i]; k < first[i + 1]; k++)
        xxh_update(state, (const void *)(uintptr_t)(bases[desc[3 * k]] + (uint64_t)desc[3 * k + 1]),
                   (size_t)desc[3 * k + 2]);
    return xxh_digest(state);
}

/* For each object: read it from the page cache (preadv2 with RWF_NOWAIT: stops at the first byte
 * that is not there, never waits for the medium) into its header and spans; got[i] = the bytes
 * read, or -errno (EOPNOTSUPP: no RWF_NOWAIT on this filesystem). When it was read whole,
 * digests[i] = xxh3_64 over its header bytes [0, 56) and its spans, hashed while still in cache.
 * Returns 0, or -ENOMEM when no hash state could be made. */
int pd_kv_read_hash(int n, const int32_t *fds, const int64_t *desc, const int64_t *first, const uint64_t *bases,
                    uint8_t *headers, int64_t *got, uint64_t *digests) {
    struct iovec iov[MAX_IOV];
    void *state = xxh_create();
    if (!state) return -ENOMEM;
    for (int i = 0; i < n; i++) {
        got[i] = 0;
        digests[i] = 0;
        if (fds[i] < 0 || first[i + 1] - first[i] + 1 > MAX_IOV) continue; /* the caller reads it the slow way */
        int count = object_iov(i, desc, first, bases, headers, iov);
        int64_t total = 0;
        for (int k = 0; k < count; k++) total += (int64_t)iov[k].iov_len;
        int at = 0;
        while (at < count) {
            ssize_t r = preadv2(fds[i], iov + at, count - at, got[i], RWF_NOWAIT);
            if (r < 0) {
                if (errno == EINTR) continue;
                if (errno != EAGAIN) got[i] = -errno;
                break;
            }
            if (r == 0) break; /* the file ended early: the caller reports it */
            got[i] += r;
            while (at < count && (size_t)r >= iov[at].iov_len) r -= iov[at++].iov_len;
            if (at < count) {
                iov[at].iov_base = (char *)iov[at].iov_base + r;
                iov[at].iov_len -= r;
            }
        }
        if (got[i] != total) continue;
        digests[i] = hash_object(state, i, desc, first, bases, headers);
    }
    xxh_free(state);
    return 0;
}

/* digests[i] = xxh3_64 over object i's header bytes [0, 56) and its spans (already read, by anyone). */
int pd_kv_hash(int n, const int64_t *desc, const int64_t *first, const uint64_t *bases, const uint8_t *headers,
               uint64_t *digests) {
    void *state = xxh_create();
    if (!state) return -ENOMEM;
    for (int i = 0; i < n; i++) digests[i] = hash_object(state, i, desc, first, bases, headers);
    xxh_free(state);
    return 0;
}

void pd_kv_close(int n, const int32_t *fds) {
    for (int i = 0; i < n; i++)
        if (fds[i] >= 0) close(fds[i]);
}
