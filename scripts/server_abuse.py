#!/usr/bin/env python3
"""Abuse test of `mtpx serve` on loopback: slow clients (slowloris: request headers or a body dribbled a
byte at a time), bodies over --max-body, thousands of rapid connects and disconnects (some with a TCP
reset), clients that vanish in the middle of a stream, invalid UTF-8 and control characters in prompts,
absurd max_tokens, and more concurrent requests than slots + queue. After each case the server must
still answer /health promptly, /metrics must show no busy slot and no queued request once the case is
over (nothing leaked), and its resident memory must stay bounded.

    python3 scripts/server_abuse.py --binary build/mtpx [--quick] [--soak-minutes N]

--quick runs every case with small counts (the ctest form, ~1 minute). --soak-minutes N then keeps a
steady load (streamed and plain requests from several clients, with a few abusive clients mixed in) for
N minutes, sampling the server's RSS, and reports the drift between the first and the last samples.
Standard library only. Exit code 0 when every check passes.
"""
import argparse
import json
import os
import random
import socket
import struct
import sys
import threading
import time
import http.client

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "server"))
from mtpx_server import MtpxServer, rss_bytes  # noqa: E402

PROMPT = "def fibonacci(n):"


class Failure(Exception):
    pass


def expect(condition, message):
    if not condition:
        raise Failure(message)


# --- plain HTTP helpers (no client library: the point is to send what clients should not) -------------

def request(server, method, path, body=None, headers=None, timeout=30):
    """(status, headers dict, body bytes) of one request on a fresh connection."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=timeout)
    try:
        payload = body if isinstance(body, (bytes, type(None))) else json.dumps(body).encode()
        all_headers = {"Content-Type": "application/json", **(headers or {})}
        conn.request(method, path, body=payload, headers=all_headers)
        response = conn.getresponse()
        return response.status, dict(response.getheaders()), response.read()
    finally:
        conn.close()


def completion(server, prompt=PROMPT, max_tokens=8, stream=False, timeout=60, **extra):
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": stream, **extra}
    return request(server, "POST", "/v1/completions", body, timeout=timeout)


def metrics(server):
    status, _, body = request(server, "GET", "/metrics", timeout=10)
    expect(status == 200, f"/metrics answered {status}")
    values = {}
    for line in body.decode().splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    return values


def raw_socket(server, timeout=10):
    s = socket.create_connection(("127.0.0.1", server.port), timeout=timeout)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


def reset(s):
    """Closes with a TCP RST instead of a FIN (SO_LINGER 0): what a crashed client or a proxy does."""
    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    s.close()


def closed_by_peer(s, wait):
    """True when the server closes `s` (EOF or reset) within `wait` seconds."""
    s.settimeout(wait)
    try:
        while True:
            data = s.recv(4096)
            if not data:
                return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except socket.timeout:
        return False


class Checker:
    """Runs the cases, and after each checks health, leaks and memory."""

    def __init__(self, server, args):
        self.server = server
        self.args = args
        self.results = []  # (case, outcome text, passed)
        self.rss_start = None

    def health_latency(self):
        start = time.monotonic()
        status, _, body = request(self.server, "GET", "/health", timeout=30)
        expect(status == 200, f"/health answered {status}")
        return time.monotonic() - start

    def idle(self, within=30.0):
        """Waits until no slot is busy and nothing is queued (a cancelled job frees its slot at its next
        step); fails when that takes longer than `within` seconds."""
        deadline = time.monotonic() + within
        while True:
            m = metrics(self.server)
            busy, queued = m.get("mtpx_slots_busy", -1), m.get("mtpx_queue_length", -1)
            if busy == 0 and queued == 0:
                return
            if time.monotonic() > deadline:
                raise Failure(f"leak: {busy:.0f} busy slots and {queued:.0f} queued requests {within:.0f} s "
                              "after the case ended")
            time.sleep(0.2)

    def run(self, name, case):
        print(f"--- {name}", flush=True)
        started = time.monotonic()
        try:
            outcome = case()
            self.idle()
            latency = self.health_latency()
            rss = rss_bytes(self.server.pid)
            if self.rss_start is None:
                self.rss_start = rss
            expect(self.args.sanitized or rss < self.rss_start + self.args.max_rss_growth_mib * 2**20,
                   f"RSS grew from {self.rss_start / 2**20:.0f} MiB to {rss / 2**20:.0f} MiB")
            text = (f"{outcome}; then /health in {latency * 1000:.0f} ms, no busy slot, RSS {rss / 2**20:.0f} MiB "
                    f"[{time.monotonic() - started:.0f} s]")
            self.results.append((name, text, True))
            print(f"    ok: {text}", flush=True)
        except Exception as e:  # a case that fails must not stop the others
            if self.server.process.poll() is not None:
                text = f"the server died (exit {self.server.process.returncode}) after: {e}"
            else:
                text = f"{type(e).__name__}: {e}"
            self.results.append((name, text, False))
            print(f"    FAIL: {text}", flush=True)
            if self.server.process.poll() is not None:
                raise


# --- the cases ---------------------------------------------------------------------------------------

def case_baseline(c):
    status, _, body = completion(c.server)
    expect(status == 200, f"a normal completion answered {status}: {body[:200]}")
    return "a normal completion: 200"


def dribbled_clients(c, count, head, byte, settle):
    """Opens `count` connections that send `head`, then `byte` once a second on each until the server
    drops them. Returns the /health latency measured `settle` seconds in, and how many of the connections
    the server closed within --request-timeout + 3 s."""
    timeout = c.args.request_timeout
    sockets = []
    for _ in range(count):
        s = raw_socket(c.server)
        s.sendall(head)
        sockets.append(s)
    stop = threading.Event()

    def dribble():
        while not stop.wait(1.0):
            for s in sockets:
                try:
                    s.sendall(byte)
                except OSError:
                    pass
    feeder = threading.Thread(target=dribble, daemon=True)
    feeder.start()
    try:
        time.sleep(settle)
        latency = c.health_latency()
        start = time.monotonic()
        dropped = sum(closed_by_peer(s, max(0.1, timeout + 3 - (time.monotonic() - start))) for s in sockets)
    finally:
        stop.set()
        feeder.join()
        for s in sockets:
            s.close()
    return latency, dropped


def case_slowloris_headers(c):
    """More connections than the server has HTTP threads dribble a request head; /health must still be
    answered while they hang, and the server must drop them after --request-timeout."""
    count, timeout = c.args.slow_clients, c.args.request_timeout
    latency, dropped = dribbled_clients(c, count, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n", b"X", 1.5)
    expect(latency < timeout + 2, f"/health took {latency:.1f} s with {count} slow clients connected")
    expect(dropped == count, f"only {dropped} of {count} slow clients were dropped within {timeout + 3} s")
    return (f"{count} clients dribbling headers (1 byte/s): /health answered in {latency * 1000:.0f} ms "
            f"meanwhile, all dropped by the server after the {timeout:.0f} s request timeout")


def case_slow_body(c):
    """A complete head announcing a body that then arrives one byte per second."""
    count, timeout = max(2, c.args.slow_clients // 4), c.args.request_timeout
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 100000\r\n\r\n{")
    latency, dropped = dribbled_clients(c, count, head, b" ", 0.0)
    expect(dropped == count, f"only {dropped} of {count} slow bodies were dropped within {timeout + 3} s")
    return f"{count} bodies dribbled (1 byte/s): /health in {latency * 1000:.0f} ms, all dropped after the timeout"


def case_idle_connections(c):
    """Connections that send nothing at all."""
    count = c.args.slow_clients
    sockets = [raw_socket(c.server) for _ in range(count)]
    try:
        latency = c.health_latency()
        dropped = sum(closed_by_peer(s, c.args.request_timeout + 8) for s in sockets)
    finally:
        for s in sockets:
            s.close()
    expect(dropped == count, f"only {dropped} of {count} silent connections were closed")
    return f"{count} silent connections: /health in {latency * 1000:.0f} ms, all closed by the server"


def case_body_over_limit(c):
    limit = c.args.max_body
    # Declared too large: refused from the Content-Length, before the body is read.
    status, _, body = request(c.server, "POST", "/v1/completions", b"x" * (limit + 1))
    expect(status == 413, f"a {limit + 1}-byte body answered {status}")
    expect(b"larger than the limit" in body, f"413 body: {body[:200]}")
    # Chunked: no length up front; the server must stop reading soon after the limit (httplib alone
    # reads a chunked body to its end into memory). Try to send 64 MiB.
    rss_before = rss_bytes(c.server.pid)
    s = raw_socket(c.server, timeout=30)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
    chunk = b"y" * 65536
    sent = 0
    try:
        while sent < 64 * 2**20:
            s.sendall(b"%x\r\n" % len(chunk) + chunk + b"\r\n")
            sent += len(chunk)
        s.sendall(b"0\r\n\r\n")
    except (BrokenPipeError, ConnectionResetError):
        pass  # the server stopped reading and closed
    s.settimeout(10)
    try:
        head = s.recv(4096)
    except (ConnectionResetError, socket.timeout):
        head = b""  # the reset of the unread data can overtake the answer
    s.close()
    expect(sent < 64 * 2**20, f"the server read a {sent}-byte chunked body (limit {limit})")
    expect(head.startswith(b"HTTP/1.1 413") or head == b"", f"a chunked body over the limit got: {head[:100]!r}")
    grown = rss_bytes(c.server.pid) - rss_before
    expect(c.args.sanitized or grown < 32 * 2**20, f"RSS grew by {grown / 2**20:.0f} MiB reading the chunked body")
    # Just under the limit is read and parsed (here: not JSON, 400).
    status, _, _ = request(c.server, "POST", "/v1/completions", b"x" * (limit - 100))
    expect(status == 400, f"a body just under the limit answered {status}")
    return (f"Content-Length {limit + 1}: 413; chunked body: cut off after {sent / 2**20:.1f} MiB with "
            f"{'413' if head else 'a reset'}; {limit - 100} bytes of garbage: 400")


def case_rapid_connections(c):
    """Connect and disconnect as fast as possible: half close at once, a quarter reset, a quarter send
    half a request line first."""
    count = c.args.rapid
    start = time.monotonic()
    errors = 0
    for i in range(count):
        try:
            s = socket.create_connection(("127.0.0.1", c.server.port), timeout=10)
            if i % 4 == 0:
                reset(s)
            elif i % 4 == 1:
                s.sendall(b"GET /hea")
                s.close()
            else:
                s.close()
        except OSError:
            errors += 1
    seconds = time.monotonic() - start
    expect(errors == 0, f"{errors} of {count} connects failed")
    return f"{count} connects/disconnects in {seconds:.1f} s ({count / seconds:.0f}/s), 1/4 with RST"


def case_vanishing_stream_clients(c):
    """Streams whose clients read the first event and vanish (close or reset): the generation must be
    cancelled and its slot freed."""
    count = c.args.vanish
    body = json.dumps({"prompt": PROMPT, "max_tokens": 2000, "stream": True, "temperature": 0}).encode()
    for i in range(count):
        s = raw_socket(c.server, timeout=60)
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n" % len(body) + body)
        data = b""
        while b"data: " not in data:
            more = s.recv(4096)
            expect(more, "the stream ended before its first event")
            data += more
        if i % 2:
            reset(s)
        else:
            s.close()
    return f"{count} streaming clients vanished after the first event (half with RST): slots freed"


def case_vanishing_non_stream_clients(c):
    count = c.args.vanish
    body = json.dumps({"prompt": PROMPT, "max_tokens": 2000, "temperature": 0}).encode()
    for _ in range(count):
        s = raw_socket(c.server)
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n" % len(body) + body)
        time.sleep(0.2)
        s.close()
    return f"{count} non-streaming clients hung up while waiting: slots freed"


def case_hostile_prompts(c):
    """Invalid UTF-8 must be refused (400); control characters, NULs, lone surrogate escapes and huge
    code points must be refused or generated from, never crash the server."""
    outcomes = {}
    raw_bodies = {
        "invalid UTF-8 byte": b'{"prompt": "abc\xff\xfe", "max_tokens": 4}',
        "truncated UTF-8": b'{"prompt": "\xe2\x82", "max_tokens": 4}',
        "overlong UTF-8": b'{"prompt": "\xc0\xaf", "max_tokens": 4}',
        "UTF-16 surrogate bytes": b'{"prompt": "\xed\xa0\x80", "max_tokens": 4}',
        "lone surrogate escape": b'{"prompt": "\\ud800x", "max_tokens": 4}',
        "NUL and controls": b'{"prompt": "a\\u0000b\\u0001\\u001b[2J\\r\\n\\t", "max_tokens": 4}',
        "escaped U+FFFF, U+10FFFF": b'{"prompt": "\\uffff\\udbff\\udfff", "max_tokens": 4}',
        "BOM and bidi": '{"prompt": "\ufeff\u202edef f():", "max_tokens": 4}'.encode(),
    }
    for label, body in raw_bodies.items():
        for path in ("/v1/completions", "/v1/chat/completions"):
            if path.endswith("chat/completions"):
                body = body.replace(b'"prompt": ', b'"messages": [{"role": "user", "content": ', 1)
                body = body.replace(b', "max_tokens"', b'}], "max_tokens"', 1)
            status, _, reply = request(c.server, "POST", path, body)
            expect(status in (200, 400), f"{label} on {path}: {status} {reply[:200]}")
            if status == 200:
                json.loads(reply)  # the answer itself is valid JSON (text with U+FFFD where needed)
            outcomes.setdefault(label, set()).add(status)
    summary = ", ".join(f"{label}: {'/'.join(map(str, sorted(s)))}" for label, s in outcomes.items())
    return summary


def case_absurd_max_tokens(c):
    outcomes = []
    for value in [2**30, 2**31, 2**62, 2**64, -1, 0, 1e300, "12", None, [1], 1.5]:
        body = {"prompt": PROMPT, "max_tokens": value}
        status, _, reply = request(c.server, "POST", "/v1/completions", body)
        expect(status in (200, 400), f"max_tokens={value!r}: {status} {reply[:200]}")
        expect(status == 400 or value in (0, None), f"max_tokens={value!r} was accepted")
        outcomes.append(f"{value!r}: {status}")
    return "max_tokens " + ", ".join(outcomes)


def case_over_capacity(c):
    """More concurrent requests than slots + queue: the excess gets 503 with Retry-After at once, the
    rest completes."""
    total = c.args.parallel + c.args.queue + c.args.excess
    statuses, retry_after, lock = [], [], threading.Lock()
    start = threading.Barrier(total)

    def one():
        start.wait()  # all at once: the first answers must not free a place before the last arrive
        try:
            status, headers, _ = completion(c.server, max_tokens=16, timeout=300)
        except Exception as e:  # noqa: BLE001 - counted as a failure below
            status, headers = repr(e), {}
        with lock:
            statuses.append(status)
            if status == 503:
                retry_after.append(headers.get("Retry-After"))
    threads = [threading.Thread(target=one) for _ in range(total)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    ok, busy = statuses.count(200), statuses.count(503)
    expect(ok + busy == total, f"unexpected answers: {sorted(set(map(str, statuses)))}")
    expect(busy >= c.args.excess // 2, f"only {busy} of {total} were refused with 503")
    expect(ok >= c.args.parallel, f"only {ok} requests completed")
    expect(all(r == "1" for r in retry_after), f"Retry-After headers: {set(retry_after)}")
    return f"{total} concurrent requests on {c.args.parallel} slots + queue {c.args.queue}: {ok} x 200, {busy} x 503 (Retry-After: 1)"


def case_pipelined_garbage(c):
    """Garbage request lines, huge headers, bad methods: 4xx or a closed connection, never a crash."""
    probes = [b"\x00\x01\x02\r\n\r\n", b"GET " + b"/a" * 10000 + b" HTTP/1.1\r\n\r\n",
              b"GET /health HTTP/1.1\r\nX: " + b"y" * 100000 + b"\r\n\r\n",
              b"BREW /health HTTP/1.1\r\n\r\n", b"GET /health HTTP/9.9\r\n\r\n",
              b"POST /v1/completions HTTP/1.1\r\nContent-Length: -5\r\n\r\n",
              b"POST /v1/completions HTTP/1.1\r\nContent-Length: 99999999999999999999\r\n\r\n",
              b"POST /v1/completions HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n"]
    answers = []
    for probe in probes:
        s = raw_socket(c.server)
        try:
            s.sendall(probe)
        except OSError:
            pass
        s.settimeout(c.args.request_timeout + 5)
        try:
            head = s.recv(64)
        except (ConnectionResetError, socket.timeout):
            head = b""
        s.close()
        answers.append(head.split(b"\r\n")[0].decode(errors="replace") or "closed")
    expect(not any(a.startswith("HTTP/1.1 5") for a in answers), f"5xx answers: {answers}")
    return "garbage requests: " + "; ".join(sorted(set(answers)))


CASES = [
    ("baseline", case_baseline),
    ("slowloris headers", case_slowloris_headers),
    ("slow body", case_slow_body),
    ("silent connections", case_idle_connections),
    ("body over --max-body", case_body_over_limit),
    ("rapid connect/disconnect", case_rapid_connections),
    ("clients vanishing mid-stream", case_vanishing_stream_clients),
    ("clients vanishing before the answer", case_vanishing_non_stream_clients),
    ("invalid UTF-8 and control characters", case_hostile_prompts),
    ("absurd max_tokens", case_absurd_max_tokens),
    ("more requests than slots + queue", case_over_capacity),
    ("garbage requests", case_pipelined_garbage),
]


# --- soak ----------------------------------------------------------------------------------------------

def soak(c, minutes):
    """Steady load for `minutes`: `clients` threads each loop over streamed and plain completions and
    chats; one thread mixes in abuse (vanishing streams, slow heads, oversized bodies). RSS is sampled
    every 10 s."""
    stop = threading.Event()
    counts = {"ok": 0, "503": 0, "errors": 0}
    errors = []
    lock = threading.Lock()
    rng = random.Random(1)

    def worker(seed):
        local = random.Random(seed)
        while not stop.is_set():
            kind = local.choice(["stream", "plain", "chat"])
            try:
                if kind == "chat":
                    body = {"messages": [{"role": "user", "content": local.choice([PROMPT, "class Stack:"])}],
                            "max_tokens": local.randint(8, 48), "temperature": 0.7, "seed": local.randint(0, 99)}
                    status, _, reply = request(c.server, "POST", "/v1/chat/completions", body, timeout=300)
                else:
                    status, _, reply = completion(c.server, max_tokens=local.randint(8, 48), timeout=300,
                                                  stream=kind == "stream")
                with lock:
                    key = "ok" if status == 200 else "503" if status == 503 else "errors"
                    counts[key] += 1
                    if key == "errors":
                        errors.append(f"{status} {reply[:120]}")
            except Exception as e:  # noqa: BLE001
                with lock:
                    counts["errors"] += 1
                    errors.append(repr(e))

    def abuser():
        while not stop.wait(2.0):
            try:
                choice = rng.randrange(3)
                if choice == 0:
                    case_vanishing_stream_clients(type("C", (), {"server": c.server,
                                                                 "args": argparse.Namespace(vanish=1)})())
                elif choice == 1:
                    s = raw_socket(c.server)
                    s.sendall(b"GET /health HTTP/1.1\r\nHo")
                    time.sleep(0.5)
                    s.close()
                else:
                    request(c.server, "POST", "/v1/completions", b"z" * (c.args.max_body + 10))
            except Exception as e:  # noqa: BLE001
                with lock:
                    errors.append(f"abuser: {e!r}")

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(c.args.soak_clients)]
    threads.append(threading.Thread(target=abuser, daemon=True))
    start = time.monotonic()
    for t in threads:
        t.start()
    samples = []
    try:
        while time.monotonic() - start < minutes * 60:
            time.sleep(10)
            elapsed = time.monotonic() - start
            rss = rss_bytes(c.server.pid)
            samples.append((elapsed, rss))
            with lock:
                snapshot = dict(counts)
            print(f"    soak {elapsed / 60:5.1f} min  RSS {rss / 2**20:6.1f} MiB  {snapshot}", flush=True)
            if c.server.process.poll() is not None:
                raise Failure("the server died during the soak")
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=330)
    c.idle()
    c.health_latency()
    # Drift: the mean of the last quarter of the samples against the mean of the second quarter (the
    # first quarter is warm-up: allocator arenas and page cache filling).
    quarter = max(1, len(samples) // 4)
    early = sum(r for _, r in samples[quarter:2 * quarter]) / quarter
    late = sum(r for _, r in samples[-quarter:]) / quarter
    drift = (late - early) / early
    report = {"minutes": minutes, "requests": counts, "rss_first_mib": samples[0][1] / 2**20,
              "rss_peak_mib": max(r for _, r in samples) / 2**20, "rss_last_mib": samples[-1][1] / 2**20,
              "rss_drift_percent": 100 * drift, "errors": errors[:10]}
    print("soak: " + json.dumps(report), flush=True)
    expect(counts["errors"] == 0, f"{counts['errors']} failed requests: {errors[:5]}")
    expect(c.args.sanitized or drift < c.args.max_soak_drift, f"RSS drifted by {100 * drift:.1f}%")
    return report


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--binary", required=True)
    parser.add_argument("--model", help="model directory (default: the shipped model)")
    parser.add_argument("--quick", action="store_true", help="small counts (the ctest form)")
    parser.add_argument("--soak-minutes", type=float, default=0)
    parser.add_argument("--soak-clients", type=int, default=6)
    parser.add_argument("--max-soak-drift", type=float, default=0.10, help="allowed RSS drift (fraction)")
    parser.add_argument("--max-rss-growth-mib", type=float, default=200, help="allowed RSS growth over the run")
    parser.add_argument("--only", help="run only the cases whose name contains this")
    parser.add_argument("--slow-clients", type=int, help="slow and silent clients at once (default 100, "
                        "--quick; 300)")
    parser.add_argument("--log", help="server log file")
    parser.add_argument("--sanitized", action="store_true",
                        help="the binary is built with AddressSanitizer: its shadow memory and its quarantine of "
                        "freed blocks make RSS say nothing of the server's own memory, so RSS limits are not "
                        "checked; LeakSanitizer checks for leaks when the server exits (a leak fails the run)")
    args = parser.parse_args()
    # Small limits make every case quick: the server is started with them.
    args.parallel, args.queue = 2, 4
    args.excess = 4 if args.quick else 12
    args.request_timeout = 3 if args.quick else 10
    args.max_body = 256 * 1024
    args.slow_clients = args.slow_clients or (100 if args.quick else 300)
    args.rapid = 500 if args.quick else 5000
    args.vanish = 4 if args.quick else 20

    server_args = ["--parallel", str(args.parallel), "--queue", str(args.queue), "--max-body", str(args.max_body),
                   "--request-timeout", str(args.request_timeout), "--threads", "2", "--quiet"]
    if args.model:
        server_args += ["--model", args.model]
    started = time.monotonic()
    with MtpxServer(args.binary, *server_args, log_path=args.log) as server:
        checker = Checker(server, args)
        try:
            for name, case in CASES:
                if not args.only or args.only in name:
                    checker.run(name, lambda: case(checker))
            if args.soak_minutes > 0:
                checker.run(f"soak {args.soak_minutes:g} min", lambda: json.dumps(soak(checker, args.soak_minutes)))
        finally:
            alive = server.process.poll() is None
        code = server.stop()
    failed = [r for r in checker.results if not r[2]]
    print(f"\n{len(checker.results)} cases, {len(failed)} failed, {time.monotonic() - started:.0f} s; "
          f"server {'exited ' + str(code) if alive else 'DIED'}")
    for name, text, passed in checker.results:
        print(f"| {name} | {text.replace('|', '/')} | {'yes' if passed else '**no**'} |")
    return 1 if failed or not alive or code != 0 else 0


if __name__ == "__main__":
    sys.exit(main())
