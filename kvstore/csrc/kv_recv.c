/* The replies of a pipeline of redis GETs, received straight into a KV load's spans, with no GIL.
 *
 * Called through ctypes by kvstore/native_reader.py for kvstore/redis_store.py's loads into paged KV
 * blocks (kvstore/resp.py packs the GETs and hands one of redis-py's connected sockets here).
 * Each value of the expected size lands in its object's header (ours) and its
 * spans (the blocks), and is hashed (xxh3) right behind the receive, while it is in cache. The
 * framing lines pass through a small buffer of ours.
 *
 * The load's write gate (kvstore/gate.py) is two words shared with Python: [closed, inside].
 * A receive into the spans enters it with atomics (inside++, then closed must still be 0) and is
 * a non-blocking recvmsg of bytes already received, so it never waits for redis; every wait is
 * a poll outside the gate, in slices, so a closed gate ends the call within one slice. Python's
 * close() sets `closed` and waits until `inside` is 0 (pd_gate_close).
 *
 * Spans are described as in kv_read.c: piece k of object i (k in [first[i], first[i+1])) is
 * desc[3k..3k+2] = (region, offset, nbytes) at bases[region] + offset.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <poll.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>

#include "kv_object.h"

#define LINE_BUF 4096 /* framing: one line and whatever follows it in the same receive */
#define SLICE_MS 20   /* a wait checks the gate this often */
#define LOWAT_CAP (256 << 10) /* a wait for a value's bytes wakes once this much (or all it needs) is in */

int pd_recv_init(void *create, void *free_state, void *reset, void *update, void *digest, int64_t header,
                 int64_t summed, int abandoned_result) {
    return set_object_format(create, free_state, reset, update, digest, header, summed, abandoned_result);
}

/* Shut the gate; returns the writers still inside (the caller waits until 0). */
int64_t pd_gate_close(int64_t *words) {
    __atomic_store_n(&words[0], 1, __ATOMIC_SEQ_CST);
    return __atomic_load_n(&words[1], __ATOMIC_SEQ_CST);
}

/* ---- the reply stream ---- */
typedef struct {
    int fd;
    int64_t *gate;
    int timeout_ms; /* the longest wait with no byte arriving; < 0: none */
    char buf[LINE_BUF];
    int pos, end;    /* unread framing bytes: buf[pos, end) */
    int want, lowat; /* bytes the next wait needs (at most what surely comes); the socket's SO_RCVLOWAT */
    const char *cmds;      /* the GET commands, packed; command i ends at cmd_ends[i] */
    const int64_t *cmd_ends;
    int sent;              /* commands sent so far */
} stream_t;

static int wait_for(stream_t *s, short events);

/* Send commands [s->sent, upto) (small: never more than the socket takes without a wait, in practice). */
static int send_commands(stream_t *s, int upto) {
    if (upto <= s->sent) return 0;
    int64_t at = s->sent ? s->cmd_ends[s->sent - 1] : 0, stop = s->cmd_ends[upto - 1];
    while (at < stop) {
        ssize_t r = send(s->fd, s->cmds + at, (size_t)(stop - at), MSG_DONTWAIT | MSG_NOSIGNAL);
        if (r > 0) {
            at += r;
            continue;
        }
        if (r < 0 && errno == EINTR) continue;
        if (r < 0 && errno != EAGAIN && errno != EWOULDBLOCK) return errno == EPIPE ? -ECONNRESET : -errno;
        int w = wait_for(s, POLLOUT);
        if (w) return w;
    }
    s->sent = upto;
    return 0;
}

/* SO_RCVLOWAT = want, so a wait for a value's bytes is not woken per TCP segment (fewer polls,
 * receives and context switches); `want` never exceeds what the current reply still has to send. */
static void set_lowat(stream_t *s, int want) {
    if (want != s->lowat && setsockopt(s->fd, SOL_SOCKET, SO_RCVLOWAT, &want, sizeof want) == 0) s->lowat = want;
}

/* Until fd has bytes (events POLLIN) or room to send (POLLOUT): 0, -ETIMEDOUT, abandoned (the gate
 * closed meanwhile), -errno. */
static int wait_for(stream_t *s, short events) {
    int waited = 0;
    for (;;) {
        if (s->gate && __atomic_load_n(&s->gate[0], __ATOMIC_SEQ_CST)) return abandoned;
        int slice = SLICE_MS;
        if (s->timeout_ms >= 0 && s->timeout_ms - waited < slice) slice = s->timeout_ms - waited;
        if (slice <= 0) return -ETIMEDOUT;
        set_lowat(s, s->want);
        struct pollfd p = {.fd = s->fd, .events = events};
        int r = poll(&p, 1, slice);
        if (r > 0) return 0; /* ready, or an error/hang-up the next recv or send reports */
        if (r < 0 && errno != EINTR) return -errno;
        if (r == 0) waited += slice;
    }
}

/* More framing bytes into buf (never waits inside anything): 0, or an error as wait_for's. */
static int fill_buf(stream_t *s) {
    if (s->pos) {
        memmove(s->buf, s->buf + s->pos, (size_t)(s->end - s->pos));
        s->end -= s->pos;
        s->pos = 0;
    }
    if (s->end == LINE_BUF) return -EPROTO; /* a framing line longer than the buffer: not a GET reply */
    for (;;) {
        ssize_t r = recv(s->fd, s->buf + s->end, (size_t)(LINE_BUF - s->end), MSG_DONTWAIT);
        if (r > 0) {
            s->end += (int)r;
            return 0;
        }
        if (r == 0) return -ECONNRESET;
        if (errno == EINTR) continue;
        if (errno != EAGAIN && errno != EWOULDBLOCK) return -errno;
        s->want = 1;
        int w = wait_for(s, POLLIN);
        if (w) return w;
    }
}

/* The next line (without CRLF) at *line, *len bytes; the buffer holds it until the next call. */
static int next_line(stream_t *s, const char **line, int *len) {
    for (;;) {
        char *at = s->end > s->pos ? memchr(s->buf + s->pos, '\n', (size_t)(s->end - s->pos)) : NULL;
        if (at && at > s->buf + s->pos && at[-1] == '\r') {
            *line = s->buf + s->pos;
            *len = (int)(at - 1 - (s->buf + s->pos));
            s->pos = (int)(at + 1 - s->buf);
            return 0;
        }
        if (at) return -EPROTO; /* a bare LF */
        int r = fill_buf(s);
        if (r) return r;
    }
}

/* Read past nbytes of the stream. */
static int skip(stream_t *s, int64_t nbytes) {
    while (nbytes > 0) {
        if (s->pos == s->end) {
            s->pos = s->end = 0;
            int r = fill_buf(s);
            if (r) return r;
        }
        int64_t step = s->end - s->pos < nbytes ? s->end - s->pos : nbytes;
        s->pos += (int)step;
        nbytes -= step;
    }
    return 0;
}

/* Where object i's bytes go: the header, then its pieces; a cursor is (piece, offset), piece -1 the header. */
typedef struct {
    int i;
    int64_t piece, offset;
    const int64_t *desc, *first;
    const uint64_t *bases;
    uint8_t *header;
} dest_t;

static uint8_t *dest_at(const dest_t *d, int64_t piece, int64_t *room) {
    if (piece < 0) {
        *room = header_size;
        return d->header;
    }
    const int64_t *p = d->desc + 3 * piece;
    *room = p[2];
    return (uint8_t *)(uintptr_t)(d->bases[p[0]] + (uint64_t)p[1]);
}

/* Past filled and empty pieces, so the cursor points at a byte still to fill (if any is left). */
static void settle(dest_t *d) {
    int64_t room;
    for (;;) {
        dest_at(d, d->piece, &room);
        int64_t next = d->piece < 0 ? d->first[d->i] : d->piece + 1;
        if (d->offset < room || next >= d->first[d->i + 1]) return;
        d->piece = next;
        d->offset = 0;
    }
}

/* Move the cursor over n bytes just written, hashing them (header bytes [summed_size, header_size) excepted). */
static void advance_hash(dest_t *d, int64_t n, void *state) {
    while (n > 0) {
        settle(d);
        int64_t room;
        uint8_t *at = dest_at(d, d->piece, &room);
        int64_t step = room - d->offset < n ? room - d->offset : n;
        if (!state)
            ; /* a raw read (benchmarks/kv_load_only.py): no checksum */
        else if (d->piece >= 0)
            xxh_update(state, at + d->offset, (size_t)step);
        else if (d->offset < summed_size)
            xxh_update(state, at + d->offset,
                       (size_t)((d->offset + step < summed_size ? d->offset + step : summed_size) - d->offset));
        if (step <= 0) return; /* n ran past the object: never, n is at most what it has left */
        d->offset += step;
        n -= step;
    }
}

/* Receive one value of `size` bytes into object i's header and pieces (size == header_size + their total). */
static int recv_value(stream_t *s, dest_t *d, int64_t size, void *state) {
    int64_t left = size;
    int64_t last = d->first[d->i + 1];
    struct iovec iov[MAX_IOV];
    if (state) xxh_reset(state);
    if (s->end > s->pos) { /* the start of the value came with its framing line */
        int64_t take = s->end - s->pos < left ? s->end - s->pos : left;
        if (gate_enter(s->gate)) return abandoned;
        int64_t done = 0;
        while (done < take) {
            int64_t room;
            settle(d);
            uint8_t *at = dest_at(d, d->piece, &room);
            int64_t step = room - d->offset < take - done ? room - d->offset : take - done;
            if (step <= 0) break;
            memcpy(at + d->offset, s->buf + s->pos + done, (size_t)step);
            done += step;
            advance_hash(d, step, state);
        }
        gate_leave(s->gate);
        s->pos += (int)take;
        left -= take;
    }
    if (s->pos == s->end) s->pos = s->end = 0;
    while (left > 0) {
        int count = 0;
        settle(d);
        int64_t covered = 0;
        for (int64_t k = d->piece; k < last && count < MAX_IOV - 1; k = k < 0 ? d->first[d->i] : k + 1) {
            int64_t room;
            uint8_t *at = dest_at(d, k, &room);
            int64_t skip_in = k == d->piece ? d->offset : 0;
            iov[count].iov_base = at + skip_in;
            iov[count++].iov_len = (size_t)(room - skip_in);
            covered += room - skip_in;
        }
        if (covered >= left && s->pos == 0 && s->end == 0) { /* the value's end is in reach: CRLF and the next
                                                                 line come along into our buffer */
            iov[count].iov_base = s->buf;
            iov[count++].iov_len = LINE_BUF;
        }
        struct msghdr msg = {.msg_iov = iov, .msg_iovlen = (size_t)count};
        if (gate_enter(s->gate)) return abandoned;
        ssize_t r = recvmsg(s->fd, &msg, MSG_DONTWAIT);
        int err = errno;
        gate_leave(s->gate);
        if (r == 0) return -ECONNRESET;
        if (r < 0) {
            if (err == EINTR) continue;
            if (err != EAGAIN && err != EWOULDBLOCK) return -err;
            s->want = left < LOWAT_CAP ? (int)left : LOWAT_CAP;
            int w = wait_for(s, POLLIN);
            if (w) return w;
            continue;
        }
        int64_t mine = r < left ? r : left;
        advance_hash(d, mine, state);
        left -= mine;
        if (r > mine) s->end = (int)(r - mine); /* past the value: into s->buf[0, r - mine) */
    }
    return 0;
}

/* Parse "$<n>" (n >= -1); -EPROTO for anything else. */
static int bulk_size(const char *line, int len, int64_t *size) {
    if (len < 2 || line[0] != '$') return -EPROTO;
    if (len == 3 && line[1] == '-' && line[2] == '1') {
        *size = -1;
        return 0;
    }
    int64_t v = 0;
    for (int k = 1; k < len; k++) {
        if (line[k] < '0' || line[k] > '9' || v > (INT64_MAX - 9) / 10) return -EPROTO;
        v = v * 10 + (line[k] - '0');
    }
    *size = v;
    return 0;
}

/* The value object i should be: its header and its spans. */
static int64_t expected(int i, const int64_t *desc, const int64_t *first) {
    int64_t total = header_size;
    for (int64_t k = first[i]; k < first[i + 1]; k++) total += desc[3 * k + 2];
    return total;
}

/* Send n GETs (cmds: packed, command i ends at cmd_ends[i]) on fd and read their replies. Commands
 * go out as replies come in, keeping at most `window` expected reply bytes ahead of the reader
 * (at least one command): redis builds a pipeline's replies in memory before writing them, and a
 * few MiB of replies per connection cost it fresh pages for every load.
 * A value of exactly header_size + object i's span bytes lands in headers + header_size * i and its
 * spans, the spans written only inside `gate` (NULL: the reader's own memory), and digests[i] =
 * xxh3_64 of its header bytes [0, summed_size) and spans (0 when `hash` is 0); a value of any other
 * size is read past. sizes[i] = the value's size, -1 no such key, -2 an error reply (the first one's text, NUL-terminated, in err). Each
 * wait is at most timeout_ms (< 0: no limit) with no progress.
 * Returns 0 (*extra: framing bytes read past the last reply, 0 on a clean stream), abandoned
 * (the gate closed), -ETIMEDOUT, -ECONNRESET (redis closed the connection), -EPROTO (not a GET
 * reply), -ENOMEM or another -errno. */
int pd_resp_get(int fd, int n, const char *cmds, const int64_t *cmd_ends, int64_t window, const int64_t *desc,
                const int64_t *first, const uint64_t *bases, uint8_t *headers, int64_t *sizes, uint64_t *digests,
                int64_t *gate, int timeout_ms, char *err, int err_len, int64_t *extra, int hash) {
    stream_t *s = malloc(sizeof(stream_t));
    void *state = hash ? xxh_create() : NULL;
    int rc = 0;
    if (!s || (hash && !state)) {
        rc = -ENOMEM;
        goto out;
    }
    s->fd = fd;
    s->gate = gate;
    s->timeout_ms = timeout_ms;
    s->pos = s->end = 0;
    s->want = s->lowat = 1; /* redis-py's sockets keep the default */
    s->cmds = cmds;
    s->cmd_ends = cmd_ends;
    s->sent = 0;
    if (err_len > 0) err[0] = 0;
    int64_t ahead = 0; /* expected bytes of the replies to commands [i, sent) */
    for (int i = 0; i < n && !rc; i++) {
        const char *line;
        int len;
        digests[i] = 0;
        int upto = s->sent;
        while (upto < n && (upto == i || ahead < window)) ahead += expected(upto++, desc, first);
        if ((rc = send_commands(s, upto))) break;
        ahead -= expected(i, desc, first);
        if ((rc = next_line(s, &line, &len))) break;
        if (len >= 1 && line[0] == '-') { /* an error reply */
            sizes[i] = -2;
            if (err_len > 0 && !err[0]) {
                int keep = len - 1 < err_len - 1 ? len - 1 : err_len - 1;
                memcpy(err, line + 1, (size_t)keep);
                err[keep] = 0;
            }
            continue;
        }
        if (len == 1 && line[0] == '_') { /* RESP3 null */
            sizes[i] = -1;
            continue;
        }
        int64_t size;
        if ((rc = bulk_size(line, len, &size))) break;
        sizes[i] = size;
        if (size < 0) continue;
        if (size == expected(i, desc, first)) {
            dest_t d = {.i = i, .piece = -1, .offset = 0, .desc = desc, .first = first, .bases = bases,
                        .header = headers + (size_t)header_size * i};
            if ((rc = recv_value(s, &d, size, state))) break;
            digests[i] = state ? xxh_digest(state) : 0;
        } else if ((rc = skip(s, size))) {
            break;
        }
        if ((rc = next_line(s, &line, &len))) break; /* the value's closing CRLF: an empty line */
        if (len != 0) rc = -EPROTO;
    }
    if (!rc) *extra = s->end - s->pos;
    set_lowat(s, 1); /* the connection goes back to redis-py, whose waits need every byte to wake them */
out:
    if (state) xxh_free(state);
    free(s);
    return rc;
}
