/* What kv_read.c and kv_recv.c both know of a stored KV object (kvstore/codec.py owns the format):
 * its 64-byte header, of which the first 56 bytes are under the checksum, and xxh3: the xxhash
 * module's own functions, handed over once by kernels/kv_read.py through each library's init, so
 * the digest is the one the codec checks. And the load's write gate (kvstore/gate.py), which both
 * enter before writing a load's spans. */
#include <stddef.h>
#include <stdint.h>

#define HEADER 64
#define SUMMED 56 /* header bytes under the checksum */
#define MAX_IOV 1024

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

static inline void set_xxh3(void *create, void *free_state, void *reset, void *update, void *digest) {
    xxh_create = (create_fn)create;
    xxh_free = (free_fn)free_state;
    xxh_reset = (reset_fn)reset;
    xxh_update = (update_fn)update;
    xxh_digest = (digest_fn)digest;
}

#define PD_ABANDONED 1 /* a call's result: the gate was closed, nothing more was written */

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
