#!/usr/bin/env python3
"""End-to-end tests of `mtpx serve` with real clients: the official OpenAI Python SDK (chat and
completions, streaming and not, tool calls, sampling parameters, errors, API keys) and curl (raw SSE),
against the shipped model on a free loopback port. Greedy output through the server is checked against
`mtpx generate`.

    python3 tests/server/test_openai_e2e.py --binary build/mtpx [unittest args]

Exits 77 (ctest: skipped) when the `openai` package or curl is missing (scripts/setup.sh --test-python).
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time
import unittest
import urllib.error
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from mtpx_server import SKIP, MtpxServer  # noqa: E402

try:
    import openai
except ImportError:
    print("skipped: the openai package is not installed (bash scripts/setup.sh --test-python)")
    sys.exit(SKIP)

BINARY = None
SERVER = None
MODEL = "default"
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
# The shipped model writes Python, not tool calls; a history of identical calls makes it copy one.
TOOL_CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TOOL_HISTORY = [m for _ in range(4) for m in (
    {"role": "user", "content": "What is the weather in Paris?"},
    {"role": "assistant", "content": TOOL_CALL_TEXT})] + [{"role": "user", "content": "What is the weather in Paris?"}]


def client(server=None, **kwargs):
    server = server or SERVER
    kwargs.setdefault("api_key", "unused")
    kwargs.setdefault("max_retries", 0)
    return openai.OpenAI(base_url=server.url + "/v1", **kwargs)


def mtpx_generate(prompt, max_tokens):
    out = subprocess.run([BINARY, "generate", "--prompt", prompt, "--max-tokens", str(max_tokens),
                          "--temperature", "0", "--json"], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)["text"]


def raw_post(url, body, headers=None):
    """POST raw bytes; returns (status, parsed JSON body, headers)."""
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            return r.status, json.loads(r.read()), r.headers
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read()), e.headers


def metrics(server=None):
    with urllib.request.urlopen((server or SERVER).url + "/metrics", timeout=10) as r:
        return r.read().decode()


def metric_value(text, name):
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{") and line.split(" ")[0] == name:
            return float(line.split(" ")[-1])
    return 0.0


def wait_for_idle(server, timeout=10):
    deadline = time.time() + timeout
    while time.time() < deadline:
        with urllib.request.urlopen(server.url + "/health", timeout=5) as r:
            health = json.loads(r.read())
        if health["slots_busy"] == 0 and health["queued"] == 0:
            return health
        time.sleep(0.05)
    raise AssertionError(f"server still busy after {timeout}s: {health}")


class Endpoints(unittest.TestCase):
    def test_health_and_models(self):
        with urllib.request.urlopen(SERVER.url + "/health", timeout=10) as r:
            self.assertEqual(json.loads(r.read())["status"], "ok")
        models = client().models.list()
        self.assertEqual([m.id for m in models.data], [MODEL])

    def test_chat_non_streaming(self):
        r = client().chat.completions.create(
            model=MODEL, messages=[{"role": "system", "content": "You write Python."},
                                   {"role": "user", "content": "Write a function that adds two numbers."}],
            max_tokens=24, temperature=0)
        choice = r.choices[0]
        self.assertEqual(choice.message.role, "assistant")
        self.assertIsInstance(choice.message.content, str)
        self.assertIn(choice.finish_reason, ("stop", "length"))
        self.assertGreater(r.usage.prompt_tokens, 10)
        self.assertLessEqual(r.usage.completion_tokens, 24)
        self.assertEqual(r.usage.total_tokens, r.usage.prompt_tokens + r.usage.completion_tokens)
        mtp = r.usage.model_extra["mtp"]  # MTP is on by default
        for key in ("draft", "drafted", "accepted", "acceptance", "acceptance_by_position", "mean_accepted_per_step"):
            self.assertIn(key, mtp)
        self.assertEqual(len(mtp["acceptance_by_position"]), mtp["draft"])
        self.assertTrue(r.id.startswith("chatcmpl-"))

    def test_chat_streaming_matches_non_streaming(self):
        kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "def is_prime(n):"}], max_tokens=40,
                      temperature=0)
        whole = client().chat.completions.create(**kwargs)
        chunks = list(client().chat.completions.create(stream=True, **kwargs))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        self.assertEqual(text, whole.choices[0].message.content)
        self.assertEqual(chunks[0].choices[0].delta.role, "assistant")
        finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        self.assertEqual(finish, [whole.choices[0].finish_reason])
        last = chunks[-1]  # usage comes last, as with stream_options include_usage, without asking
        self.assertEqual(last.choices, [])
        self.assertEqual(last.usage.completion_tokens, whole.usage.completion_tokens)
        self.assertIn("mtp", last.usage.model_extra)

    def test_completions_streaming_and_not(self):
        kwargs = dict(model=MODEL, prompt="import numpy as np\n\n", max_tokens=32, temperature=0)
        whole = client().completions.create(**kwargs)
        self.assertEqual(whole.object, "text_completion")
        chunks = list(client().completions.create(stream=True, **kwargs))
        self.assertEqual("".join(c.choices[0].text for c in chunks if c.choices), whole.choices[0].text)
        self.assertEqual(chunks[-1].usage.total_tokens, whole.usage.total_tokens)
        default_length = client().completions.create(model=MODEL, prompt="x = 1\n", temperature=0)
        self.assertLessEqual(default_length.usage.completion_tokens, 16)  # OpenAI's default max_tokens
        ids = client().completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=4, temperature=0)
        self.assertEqual(ids.usage.prompt_tokens, 3)


class Greedy(unittest.TestCase):
    def test_server_output_equals_mtpx_generate(self):
        for prompt in ("def fibonacci(n):", "class Node:\n    def __init__(self"):
            want = mtpx_generate(prompt, 48)
            for extra in ({}, {"mtp": False}, {"mtp": True, "draft": 3}):
                with self.subTest(prompt=prompt, extra=extra):
                    r = client().completions.create(model=MODEL, prompt=prompt, max_tokens=48, temperature=0,
                                                    extra_body=extra)
                    self.assertEqual(r.choices[0].text, want)
                    self.assertEqual("mtp" in r.usage.model_extra, extra.get("mtp", True))
            streamed = client().completions.create(model=MODEL, prompt=prompt, max_tokens=48, temperature=0,
                                                   stream=True)
            self.assertEqual("".join(c.choices[0].text for c in streamed if c.choices), want)

    def test_chat_equals_mtpx_generate_on_the_rendered_prompt(self):
        rendered = "<|im_start|>user\nWrite a sort function<|im_end|>\n<|im_start|>assistant\n"
        r = client().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Write a sort function"}],
                                             max_tokens=32, temperature=0)
        self.assertEqual(r.choices[0].message.content, mtpx_generate(rendered, 32))

    def test_concurrent_requests_each_equal_their_solo_output(self):
        prompts = ["def add(a, b):", "import sys\n", "for x in range(3):", "class A:", "# sort a list\n", "def f():"]
        solo = [client().completions.create(model=MODEL, prompt=p, max_tokens=40, temperature=0).choices[0].text
                for p in prompts]
        results = [None] * len(prompts)

        def run(i):
            stream = client().completions.create(model=MODEL, prompt=prompts[i], max_tokens=40, temperature=0,
                                                 stream=True, extra_body={"draft": 1 + i % 3})
            results[i] = "".join(c.choices[0].text for c in stream if c.choices)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        self.assertEqual(results, solo)


class Sampling(unittest.TestCase):
    def test_seed_repeats_and_parameters_apply(self):
        kwargs = dict(model=MODEL, prompt="def main():", max_tokens=24, temperature=1.0, top_p=0.9)
        a = client().completions.create(seed=7, extra_body={"top_k": 40, "min_p": 0.05}, **kwargs)
        b = client().completions.create(seed=7, extra_body={"top_k": 40, "min_p": 0.05}, **kwargs)
        self.assertEqual(a.choices[0].text, b.choices[0].text)
        texts = {client().completions.create(seed=s, **kwargs).choices[0].text for s in range(6)}
        self.assertGreaterEqual(len(texts), 2)

    def test_stop_strings_are_cut_and_never_sent(self):
        full = client().completions.create(model=MODEL, prompt="def fibonacci(n):", max_tokens=48,
                                           temperature=0).choices[0].text
        stop = full[10:14]
        want = full[:full.index(stop)]
        for stops in (stop, [stop, "NEVER_APPEARS"]):
            r = client().completions.create(model=MODEL, prompt="def fibonacci(n):", max_tokens=48, temperature=0,
                                            stop=stops)
            self.assertEqual(r.choices[0].text, want)
            self.assertEqual(r.choices[0].finish_reason, "stop")
            pieces = [c.choices[0].text for c in client().completions.create(
                model=MODEL, prompt="def fibonacci(n):", max_tokens=48, temperature=0, stop=stops, stream=True)
                if c.choices]
            self.assertEqual("".join(pieces), want)


class ToolCalls(unittest.TestCase):
    def test_tool_call_non_streaming(self):
        r = client().chat.completions.create(model=MODEL, messages=TOOL_HISTORY, tools=TOOLS, max_tokens=60,
                                             temperature=0)
        choice = r.choices[0]
        self.assertEqual(choice.finish_reason, "tool_calls")
        call = choice.message.tool_calls[0]
        self.assertEqual(call.type, "function")
        self.assertEqual(call.function.name, "get_weather")
        self.assertEqual(json.loads(call.function.arguments), {"city": "Paris"})
        self.assertTrue(call.id.startswith("call_"))

    def test_tool_call_streaming(self):
        stream = client().chat.completions.create(model=MODEL, messages=TOOL_HISTORY, tools=TOOLS, max_tokens=60,
                                                  temperature=0, stream=True)
        calls, content, finish = [], "", None
        for chunk in stream:
            if not chunk.choices:
                continue
            delta = chunk.choices[0].delta
            content += delta.content or ""
            calls += delta.tool_calls or []
            finish = chunk.choices[0].finish_reason or finish
        self.assertNotIn("<tool_call>", content)
        self.assertEqual(finish, "tool_calls")
        self.assertEqual(calls[0].function.name, "get_weather")
        self.assertEqual(json.loads(calls[0].function.arguments), {"city": "Paris"})

    def test_tool_messages_are_accepted(self):
        messages = [{"role": "user", "content": "Weather?"},
                    # The shipped template concatenates content: null would fail there as in transformers.
                    {"role": "assistant", "content": "", "tool_calls": [
                        {"id": "call_1", "type": "function",
                         "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"}}]},
                    {"role": "tool", "tool_call_id": "call_1", "content": "cold"}]
        r = client().chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=4)
        self.assertGreater(r.usage.prompt_tokens, 5)
        without_tools = client().chat.completions.create(model=MODEL, messages=messages, tools=TOOLS,
                                                         tool_choice="none", max_tokens=4)
        self.assertEqual(without_tools.usage.prompt_tokens, r.usage.prompt_tokens)  # the shipped template has no tools


class Errors(unittest.TestCase):
    def check_error(self, error, status, needle):
        self.assertEqual(error.status_code, status)
        body = error.response.json()["error"]
        self.assertEqual(set(body), {"message", "type", "param", "code"})
        self.assertIn(needle, body["message"])
        return body

    def test_bad_requests_are_4xx_with_openai_errors(self):
        c = client()
        with self.assertRaises(openai.NotFoundError) as e:
            c.chat.completions.create(model="gpt-5", messages=[{"role": "user", "content": "x"}])
        self.assertEqual(self.check_error(e.exception, 404, "gpt-5")["code"], "model_not_found")
        with self.assertRaises(openai.BadRequestError) as e:
            c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], temperature="hot")
        self.assertEqual(self.check_error(e.exception, 400, "temperature")["param"], "temperature")
        with self.assertRaises(openai.BadRequestError) as e:
            c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=10 ** 6)
        self.assertEqual(self.check_error(e.exception, 400, "maximum context length")["code"], "context_length_exceeded")
        with self.assertRaises(openai.BadRequestError) as e:
            c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], n=2)
        self.check_error(e.exception, 400, "'n' must be 1")
        with self.assertRaises(openai.BadRequestError) as e:
            c.chat.completions.create(model=MODEL, messages=[])
        self.check_error(e.exception, 400, "messages")
        with self.assertRaises(openai.BadRequestError) as e:
            c.completions.create(model=MODEL, prompt="x", extra_body={"draft": 99})
        self.check_error(e.exception, 400, "draft")

    def test_malformed_json_and_unknown_routes(self):
        status, body, _ = raw_post(SERVER.url + "/v1/chat/completions", b'{"messages": [')
        self.assertEqual(status, 400)
        self.assertIn("not valid JSON", body["error"]["message"])
        status, body, _ = raw_post(SERVER.url + "/v1/nothing", b"{}")
        self.assertEqual(status, 404)
        self.assertEqual(body["error"]["type"], "invalid_request_error")

    def test_oversized_body_is_413(self):
        with MtpxServer(BINARY, "--quiet", "--max-body", "4096") as small:
            big = json.dumps({"model": MODEL, "prompt": "x" * 10000}).encode()
            status, body, _ = raw_post(small.url + "/v1/completions", big)
            self.assertEqual(status, 413)
            self.assertIn("larger than the limit", body["error"]["message"])


class ApiKey(unittest.TestCase):
    def test_key_required_when_set(self):
        with MtpxServer(BINARY, "--quiet", "--api-key", "s3cret") as keyed:
            with self.assertRaises(openai.AuthenticationError) as e:
                client(keyed, api_key="wrong").models.list()
            self.assertEqual(e.exception.status_code, 401)
            self.assertEqual(e.exception.response.json()["error"]["type"], "authentication_error")
            status, _, _ = raw_post(keyed.url + "/v1/completions", b'{"prompt": "x"}')
            self.assertEqual(status, 401)
            r = client(keyed, api_key="s3cret").completions.create(model=MODEL, prompt="x", max_tokens=2)
            self.assertEqual(r.object, "text_completion")
            with urllib.request.urlopen(keyed.url + "/health", timeout=10) as h:  # health stays open
                self.assertEqual(h.status, 200)


class CommandLine(unittest.TestCase):
    def test_bad_flags_are_one_line_errors_with_exit_2(self):
        for args, needle in ((["--port", "70000"], "--port"), (["--port", "http"], "--port"),
                             (["--parallel", "0"], "--parallel"), (["--draft", "9"], "--draft"),
                             (["--model", "/nonexistent/model"], "/nonexistent/model"),
                             (["--host", "203.0.113.7", "--port", "8099"], "cannot bind")):
            with self.subTest(args=args):
                r = subprocess.run([BINARY, "serve", *args], capture_output=True, text=True, timeout=60)
                self.assertEqual(r.returncode, 2, r.stderr)
                self.assertTrue(r.stderr.startswith("error: "), r.stderr)
                self.assertEqual(r.stderr.count("\n"), 1, r.stderr)
                self.assertIn(needle, r.stderr)

    def test_sigterm_stops_cleanly(self):
        server = MtpxServer(BINARY, "--quiet")
        self.assertEqual(server.stop(), 0)


class Concurrency(unittest.TestCase):
    def test_full_queue_is_503_and_disconnects_free_slots(self):
        with MtpxServer(BINARY, "--quiet", "--parallel", "1", "--queue", "1") as busy:
            streams = [client(busy).completions.create(model=MODEL, prompt="def main():\n", max_tokens=4000,
                                                       temperature=0, stream=True) for _ in range(2)]
            next(iter(streams[0]))  # the first is generating, the second waits in the queue
            with self.assertRaises(openai.APIStatusError) as e:
                client(busy).completions.create(model=MODEL, prompt="x", max_tokens=2)
            self.assertEqual(e.exception.status_code, 503)
            self.assertEqual(e.exception.response.headers.get("retry-after"), "1")
            for s in streams:
                s.close()  # the clients leave: both generations are cancelled
            wait_for_idle(busy)
            text = metrics(busy)
            self.assertGreaterEqual(metric_value(text, 'mtpx_generations_total{finish_reason="cancelled"}'), 2)
            r = client(busy).completions.create(model=MODEL, prompt="x", max_tokens=2)  # the slot is free
            self.assertEqual(r.object, "text_completion")

    def test_non_streaming_client_timeout_cancels(self):
        with MtpxServer(BINARY, "--quiet", "--parallel", "1") as s:
            with self.assertRaises(openai.APITimeoutError):
                client(s, timeout=0.5).completions.create(model=MODEL, prompt="def main():\n", max_tokens=7000,
                                                          temperature=0)
            wait_for_idle(s)
            self.assertEqual(metric_value(metrics(s), 'mtpx_generations_total{finish_reason="cancelled"}'), 1)


class RawSse(unittest.TestCase):
    def test_curl_sees_sse_frames_and_done(self):
        body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 12,
                           "stream": True})
        out = subprocess.run(["curl", "-sS", "-N", "-H", "Content-Type: application/json", "-d", body,
                              SERVER.url + "/v1/chat/completions"], capture_output=True, timeout=60)
        self.assertEqual(out.returncode, 0, out.stderr)
        text = out.stdout.decode("utf-8")  # the whole stream is valid UTF-8
        frames = [f for f in text.split("\n\n") if f]
        self.assertTrue(all(f.startswith("data: ") for f in frames), frames)
        self.assertEqual(frames[-1], "data: [DONE]")
        events = [json.loads(f[len("data: "):]) for f in frames[:-1]]
        self.assertTrue(all(e["object"] == "chat.completion.chunk" for e in events))
        self.assertIn("usage", events[-1])
        headers = subprocess.run(["curl", "-sS", "-N", "-D", "-", "-o", "/dev/null", "-d", body,
                                  SERVER.url + "/v1/chat/completions"], capture_output=True, text=True, timeout=60)
        self.assertIn("content-type: text/event-stream", headers.stdout.lower())


class Metrics(unittest.TestCase):
    def test_metrics_count_requests_tokens_and_latencies(self):
        client().completions.create(model=MODEL, prompt="def g():", max_tokens=8, temperature=0)
        text = metrics()
        self.assertGreaterEqual(metric_value(text, 'mtpx_requests_total{endpoint="/v1/completions",status="200"}'), 1)
        self.assertGreater(metric_value(text, "mtpx_completion_tokens_total"), 0)
        self.assertGreater(metric_value(text, 'mtpx_mtp_drafted_tokens_total{position="1"}'), 0)
        self.assertGreater(metric_value(text, "mtpx_time_to_first_token_seconds_count"), 0)
        self.assertGreater(metric_value(text, "mtpx_inter_token_latency_seconds_count"), 0)
        self.assertIn("# TYPE mtpx_inter_token_latency_seconds histogram", text)


def main():
    global BINARY, SERVER
    parser = argparse.ArgumentParser()
    parser.add_argument("--binary", required=True)
    args, rest = parser.parse_known_args()
    if shutil.which("curl") is None:
        print("skipped: curl is not installed")
        return SKIP
    BINARY = os.path.abspath(args.binary)
    # --draft 1 pins MTP on with K=1 (without it a `mtpx tune` profile on this machine could choose).
    SERVER = MtpxServer(BINARY, "--quiet", "--draft", "1")
    try:
        result = unittest.main(argv=[sys.argv[0], *rest], exit=False, verbosity=2).result
    finally:
        SERVER.stop()
    return 0 if result.wasSuccessful() else 1


if __name__ == "__main__":
    sys.exit(main())
