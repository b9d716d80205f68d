"""The few ZooKeeper requests the nemesis needs, on the wire protocol
(stdlib only): open a session, list a node's children, delete a node,
close. Used by `expire` on backend "zookeeper" to delete a key's holder
node behind the holder's back — ZooKeeper's premature expiry (the Redis
families' `DEL` of the lock entry).

Jute framing: every packet is a big-endian int32 length and its bytes. A
session starts with ConnectRequest (protocolVersion, lastZxidSeen,
timeOut, sessionId, passwd, readOnly); a request is (xid, op) + body, its
answer (xid, zxid, err) + body. xid -1 is a watch event, -2 a ping.
"""
import socket
import struct

OP_DELETE, OP_GET_CHILDREN, OP_CLOSE = 2, 8, -11
NO_NODE = -101


class ZkError(Exception):
    def __init__(self, op, err):
        super().__init__(f"ZooKeeper {op}: error {err}")
        self.err = err


def _string(s):
    b = s.encode()
    return struct.pack(">i", len(b)) + b


class ZkClient:
    """One session on the member at `port` (a direct connection, not
    through any fault proxy)."""

    def __init__(self, port, timeout=2.0, session_ms=4000):
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
        self.xid = 0
        try:
            self._send(struct.pack(">iqiq", 0, 0, session_ms, 0) + struct.pack(">i", 16) + b"\0" * 16 + b"\0")
            r = self._recv()
            _, granted, self.session_id = struct.unpack(">iiq", r[:16])
            if granted <= 0:
                raise ConnectionError("ZooKeeper refused the session (member not serving)")
        except Exception:
            self.sock.close()
            raise

    def _read(self, n):
        out = b""
        while len(out) < n:
            b = self.sock.recv(n - len(out))
            if not b:
                raise ConnectionError("ZooKeeper closed the connection")
            out += b
        return out

    def _send(self, payload):
        self.sock.sendall(struct.pack(">i", len(payload)) + payload)

    def _recv(self):
        (n,) = struct.unpack(">i", self._read(4))
        return self._read(n)

    def _call(self, op, body):
        self.xid += 1
        self._send(struct.pack(">ii", self.xid, op) + body)
        while True:
            r = self._recv()
            xid, _zxid, err = struct.unpack(">iqi", r[:16])
            if xid == self.xid:
                return err, r[16:]

    def children(self, path):
        """The names of `path`'s children ([] if it does not exist)."""
        err, body = self._call(OP_GET_CHILDREN, _string(path) + b"\0")
        if err == NO_NODE:
            return []
        if err:
            raise ZkError("getChildren", err)
        (count,) = struct.unpack(">i", body[:4])
        out, at = [], 4
        for _ in range(max(0, count)):
            (n,) = struct.unpack(">i", body[at:at + 4])
            out.append(body[at + 4:at + 4 + n].decode())
            at += 4 + n
        return out

    def delete(self, path):
        """Deletes `path` whatever its version; False if it was gone."""
        err, _ = self._call(OP_DELETE, _string(path) + struct.pack(">i", -1))
        if err == NO_NODE:
            return False
        if err:
            raise ZkError("delete", err)
        return True

    def close(self):
        try:
            self._call(OP_CLOSE, b"")
        except Exception:
            pass
        self.sock.close()


def key_dir(key, root="/fencer"):
    """The key's queue node, as src/lock/zookeeper/queue.rs names it."""
    out = []
    for b in key.encode():
        c = chr(b)
        out.append(c if (c.isascii() and c.isalnum()) or c in "_-" else f"%{b:02X}")
    return f"{root}/locks/k-" + "".join(out)


def sequence(name):
    """The sequence number of a child named `<ticket>-<10 digits>`, or None."""
    _, _, seq = name.rpartition("-")
    return int(seq) if len(seq) >= 10 and seq.isdigit() else None
