"""A small OpenAI-compatible server for the regeneration tests: ``/v1/models`` and ``/v1/completions`` with token-id
prompts, as vLLM and SGLang answer them, decoding with our own ``generate`` on a tiny target. Not a test module.

Each request draws from its own seed (``generate(..., seed=)``), so a rerun answers the same; requests run in
threads, and the server counts how many were in flight at once. ``token_ids=False`` answers the way servers without
vLLM's ``return_token_ids`` do: the ids only as ``token_id:N`` logprob tokens.
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from lightning_spec import SamplingConfig, generate


class StandIn:
    def __init__(self, target: Any, model: str = "standin", token_ids: bool = True, delay: float = 0.02,
                 prefill_cost: float = 0.0, token_cost: float = 0.0, clock: Any = time) -> None:
        self.target, self.model, self.token_ids, self.delay = target, model, token_ids, delay
        self.clock = clock  # what pays the simulated costs: ``time`` sleeps, a test's FakeClock moves instead
        # simulated costs, paid one request at a time: seconds per prompt token not in the prefix cache (a prompt
        # seen before costs nothing, as in vLLM), seconds per generated token
        self.prefill_cost, self.token_cost, self.cached = prefill_cost, token_cost, set()
        self.in_flight = self.most_in_flight = self.requests = 0
        self.lock, self.decode_lock = threading.Lock(), threading.Lock()
        self.server: ThreadingHTTPServer | None = None

    def complete(self, body: dict) -> tuple[int, dict]:
        if body.get("model") != self.model:
            return 404, {"error": {"message": f"The model `{body.get('model')}` does not exist."}}
        with self.lock:
            self.in_flight += 1
            self.requests += 1
            self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            time.sleep(self.delay)  # a request takes a while: others arrive meanwhile
            sampling = SamplingConfig(temperature=body.get("temperature", 1.0), top_p=body.get("top_p", 1.0),
                                      top_k=max(int(body.get("top_k") or 0), 0))
            with self.decode_lock:  # one decode at a time on the shared target
                out = generate(self.target, body["prompt"], body["max_tokens"], sampling, seed=body.get("seed"))
                if tuple(body["prompt"]) not in self.cached:
                    self.cached.add(tuple(body["prompt"]))
                    self.clock.sleep(self.prefill_cost * len(body["prompt"]))
                self.clock.sleep(self.token_cost * len(out.tokens))
        finally:
            with self.lock:
                self.in_flight -= 1
        tokens = out.tokens
        stopped = bool(tokens) and tokens[-1] in set(body.get("stop_token_ids") or self.target.eos_token_ids)
        choice = {"index": 0, "text": "", "finish_reason": "stop" if stopped else "length"}
        if self.token_ids:
            choice["token_ids"] = tokens
        else:
            choice["logprobs"] = {"tokens": [f"token_id:{t}" for t in tokens]}
        return 200, {"id": "cmpl", "object": "text_completion", "model": self.model, "choices": [choice]}

    def start(self, port: int = 0) -> str:
        standin = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:  # quiet
                pass

            def send(self, code: int, payload: dict) -> None:
                data = json.dumps(payload).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                if self.path == "/v1/models":
                    self.send(200, {"object": "list", "data": [{"id": standin.model, "object": "model"}]})
                else:
                    self.send(404, {"error": {"message": "not found"}})

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if self.path != "/v1/completions":
                    self.send(404, {"error": {"message": "not found"}})
                    return
                self.send(*standin.complete(body))

        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def stop(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()

