"""Starts and stops `mtpx serve` for the end-to-end tests and the load test: a real server process on a
free loopback port (--port 0; the port is read from the startup line)."""
import os
import re
import signal
import subprocess
import threading
import time

SKIP = 77  # ctest SKIP_RETURN_CODE: a needed client (openai, selenium, chromium) is not installed


class MtpxServer:
    def __init__(self, binary, *args, log_path=None, ready_timeout=60):
        self.log_path = log_path or os.devnull
        command = [binary, "serve", "--port", "0", *args]
        self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self.lines = []
        self.port = None
        deadline = time.time() + ready_timeout
        while self.port is None:
            line = self.process.stderr.readline()
            if not line:
                raise RuntimeError(f"mtpx serve exited before listening: {''.join(self.lines)}")
            self.lines.append(line)
            match = re.search(r"listening on http://[^:]+:(\d+)", line)
            if match:
                self.port = int(match.group(1))
            if time.time() > deadline:
                raise RuntimeError("mtpx serve did not start in time")
        # Keep draining stderr (the request log) so the server never blocks on a full pipe.
        self._drain = threading.Thread(target=self._drain_stderr, daemon=True)
        self._drain.start()
        self.url = f"http://127.0.0.1:{self.port}"

    def _drain_stderr(self):
        with open(self.log_path, "a") as log:
            for line in self.process.stderr:
                self.lines.append(line)
                log.write(line)

    @property
    def pid(self):
        return self.process.pid

    def stop(self, timeout=20):
        """SIGTERM, then the exit code (0 for a clean shutdown)."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            code = self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            code = self.process.wait()
        self._drain.join(timeout=5)
        self.process.stderr.close()
        return code

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def rss_bytes(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0
