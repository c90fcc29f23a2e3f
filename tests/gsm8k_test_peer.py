"""Test peer: a real HTTP server speaking SGLang's /generate contract for the gsm8k benchmark tests.

It looks up the last question of each prompt in GSM8K test and answers: correctly for even
indices, with no number for indices = 1 mod 4, with a wrong number for indices = 3 mod 4.
Usage: python gsm8k_test_peer.py PORT [FAILING_INDEX [MODE]]: that question gets HTTP 500, or with MODE garbage a
200 answer that is not SGLang's JSON; MODE not_sglang: /get_model_info answers 200 with a web page, as another
server on the port would.
"""

import json
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

DATA = Path(__file__).resolve().parents[1] / "benchmarks" / "gsm8k" / "data" / "test.jsonl"
ITEMS = [json.loads(l) for l in DATA.read_text().splitlines() if l.strip()]
INDEX = {it["question"]: i for i, it in enumerate(ITEMS)}


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def _send(self, obj, code=200):
        body = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        if self.path == "/get_model_info":
            if MODE == "not_sglang":
                return self._send("<html>welcome</html>")
            return self._send({"model_path": "gsm8k-test-peer"})
        self._send({"error": "not found"}, 404)

    def do_POST(self):
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        question = req["text"].rsplit("Question: ", 1)[1].rsplit("\nAnswer:", 1)[0]
        i = INDEX[question]
        if i == FAILING:
            return (
                self._send({"unexpected": "shape"})
                if MODE == "garbage"
                else self._send({"error": "injected failure"}, 500)
            )
        gold = ITEMS[i]["answer"].split("####")[-1].strip()
        if i % 2 == 0:
            text = f" Working it out step by step gives {gold}."
        elif i % 4 == 1:
            text = " I cannot tell."
        else:
            text = f" The answer is {int(gold.replace(',', '')) + 1}."
        self._send({"text": text, "meta_info": {"completion_tokens": len(text.split())}})


class Server(ThreadingHTTPServer):
    """The benchmark opens up to --parallel (64) connections at once; socketserver's default backlog of 5
    makes a loaded machine reset some of them, which would read as a failed request."""

    request_queue_size = 256
    daemon_threads = True


FAILING = int(sys.argv[2]) if len(sys.argv) > 2 else -1
MODE = sys.argv[3] if len(sys.argv) > 3 else ""

if __name__ == "__main__":
    Server(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
