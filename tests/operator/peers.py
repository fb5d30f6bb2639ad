"""Hostile peers on loopback: an HTTP server that drips its answer one byte at a time, and a
DNS server that answers some names and never answers others. Used by the tenant_io tests,
the cluster tests and bench/noisy_tenants.py."""

from __future__ import annotations

import socket
import threading
import time


class Drip:
    """Accepts HTTP requests and answers `200 OK` one byte every `every` seconds, for ever
    (a tenant's trainer, gateway or puller that never times out a socket read)."""

    def __init__(self, every: float = 0.5):
        self.every = every
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(512)
        self.open = 0          # connections being dripped to now
        self.accepted = 0
        self._lock = threading.Lock()
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.sock.getsockname()[1]}"

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with self._lock:
                self.accepted += 1
                self.open += 1
            threading.Thread(target=self._drip, args=(conn,), daemon=True).start()

    def _drip(self, conn: socket.socket) -> None:
        answer = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\n" + b"#" * 10_000_000
        try:
            with conn:
                conn.recv(65536)
                for i in range(len(answer)):
                    if self._closed:
                        return
                    conn.sendall(answer[i:i + 1])
                    time.sleep(self.every)
        except OSError:
            pass
        finally:
            with self._lock:
                self.open -= 1

    def close(self) -> None:
        self._closed = True
        self.sock.close()


class Dns:
    """A UDP DNS server on loopback: names in `answers` get their A record, every other
    query is read and never answered (a resolver that stalls). Counts queries per name."""

    def __init__(self, answers: dict[str, str] | None = None):
        import dns.message  # noqa: F401 (fail early without dnspython)

        self.answers = {k.rstrip(".") + ".": v for k, v in (answers or {}).items()}
        self.queries: dict[str, int] = {}
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("127.0.0.1", 0))
        threading.Thread(target=self._serve, daemon=True).start()

    @property
    def server(self) -> str:
        return f"127.0.0.1:{self.sock.getsockname()[1]}"

    def _serve(self) -> None:
        import dns.message
        import dns.rdatatype
        import dns.rrset

        while True:
            try:
                data, peer = self.sock.recvfrom(4096)
            except OSError:
                return
            try:
                q = dns.message.from_wire(data)
            except Exception:  # noqa: BLE001, S112 (junk on the test socket)
                continue
            qname = q.question[0].name.to_text()
            self.queries[qname] = self.queries.get(qname, 0) + 1
            if qname not in self.answers:
                continue   # stall
            r = dns.message.make_response(q)
            if q.question[0].rdtype == dns.rdatatype.A:
                r.answer.append(dns.rrset.from_text(qname, 60, "IN", "A", self.answers[qname]))
            self.sock.sendto(r.to_wire(), peer)

    def close(self) -> None:
        self.sock.close()
