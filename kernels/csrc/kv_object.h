/* What kv_read.c and kv_recv.c both know of a stored KV object (kvstore/codec.py owns the format):
 * its 64-byte header, of which the first 56 bytes are under the checksum, and xxh3: the xxhash
 * module's own functions, handed over once by kernels/kv_read.py through each library's init, so
 * the digest is the one the codec checks. */
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
