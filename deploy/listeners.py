"""Which process listens on a port: so a launcher says "ready" about its own children, not about whatever
answers there.

An HTTP answer on a port proves only that *something* listens on it: with the port taken by another
server, `make serve` once reached that server and printed "ready" while its own proxy died of "Address
already in use". A listening socket is a file: Linux lists it in /proc/net/tcp{,6} with its inode, and
/proc/<pid>/fd of the process holding it links to `socket:[inode]`.
"""
from __future__ import annotations

import errno
import os
import socket
from pathlib import Path

_LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp's `st` column


def port_in_use(host: str, port: int) -> str | None:
    """Why `port` on `host` cannot be listened on now (e.g. 'Address already in use'), or None when it can.

    Binds the way our servers do (SO_REUSEADDR, as aiohttp and grpc set it), so a port held only by
    connections in TIME_WAIT from a previous run counts as free, as it is for them.
    """
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
            s.listen(1)
        except OSError as e:
            return e.strerror or errno.errorcode.get(e.errno or 0, str(e))
    return None


def listening_inodes(port: int) -> set[int] | None:
    """Socket inodes listening on TCP `port` (any address, IPv4 and IPv6); None without /proc/net/tcp."""
    found: set[int] = set()
    seen_table = False
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        seen_table = True
        for line in lines:
            fields = line.split()
            if len(fields) > 9 and fields[3] == _LISTEN and int(fields[1].rsplit(":", 1)[1], 16) == port:
                found.add(int(fields[9]))
    return found if seen_table else None


def owns_port(pid: int, port: int) -> bool | None:
    """Whether process `pid` holds a socket listening on `port`; None when this system cannot tell
    (no /proc): the caller then has only the answer on the port to go by."""
    inodes = listening_inodes(port)
    if inodes is None:
        return None
    if not inodes:
        return False
    wanted = {f"socket:[{i}]" for i in inodes}
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False  # gone
    for fd in fds:
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}") in wanted:
                return True
        except OSError:
            continue  # closed meanwhile
    return False
