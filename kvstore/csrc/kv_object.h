/* What kv_read.c and kv_recv.c both know of a stored KV object. Python owns every number of the
 * format (kvstore/object_format.py: the header's size, and how many of its bytes are under the checksum that
 * fills the rest) and the result that says a load's gate closed (kvstore/native_reader.py ABANDONED);
 * each library's init (pd_kv_init, pd_recv_init) hands them over once, with xxh3: the xxhash
 * module's own functions, so the digest is the one the codec checks. And the load's write gate
 * (kvstore/gate.py), which both enter before writing a load's spans. */
#include <errno.h>
#include <stddef.h>
#include <stdint.h>

#define MAX_IOV 1024 /* pieces of one object one preadv takes (more: the caller's path) */

typedef void *(*create_fn)(void);
typedef int (*free_fn)(void *);
typedef int (*reset_fn)(void *);
typedef int (*update_fn)(void *, const void *, size_t);
typedef uint64_t (*digest_fn)(const void *);

static create_fn xxh_create;
static free_fn xxh_free;
static reset_fn xxh_reset;
static update_fn xxh_update;
static digest_fn xxh_digest;
static int64_t header_size; /* bytes before the payload */
static int64_t summed_size; /* header bytes under the checksum; the u64 checksum follows them */
static int abandoned;       /* a call's result: the gate was closed, nothing more was written */

static inline int set_object_format(void *create, void *free_state, void *reset, void *update, void *digest,
                                    int64_t header, int64_t summed, int abandoned_result) {
    if (summed <= 0 || header != summed + 8 || abandoned_result <= 0) return -EINVAL;
    xxh_create = (create_fn)create;
    xxh_free = (free_fn)free_state;
    xxh_reset = (reset_fn)reset;
    xxh_update = (update_fn)update;
    xxh_digest = (digest_fn)digest;
    header_size = header;
    summed_size = summed;
    abandoned = abandoned_result;
    return 0;
}

/* The gate is two words shared with Python: words[0] closed, words[1] writers inside; NULL: memory
 * the reader owns. A writer enters with inside++ and then checks that closed is still 0; Python's
 * close() sets closed and waits until inside is 0 (pd_gate_close, kv_recv.c). */
static inline int gate_enter(int64_t *words) {
    if (!words) return 0;
    __atomic_fetch_add(&words[1], 1, __ATOMIC_SEQ_CST);
    if (__atomic_load_n(&words[0], __ATOMIC_SEQ_CST)) {
        __atomic_fetch_sub(&words[1], 1, __ATOMIC_SEQ_CST);
        return -1;
    }
    return 0;
}

static inline void gate_leave(int64_t *words) {
    if (words) __atomic_fetch_sub(&words[1], 1, __ATOMIC_SEQ_CST);
}
