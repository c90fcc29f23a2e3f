"""Test peer: a real HTTP server speaking the part of SGLang's HTTP contract the served benchmark routines use, so they
run on a machine without a GPU against something that answers as SGLang does: /health_generate, /v1/models,
/generate with input_ids (greedy tokens with their logprobs, input logprobs from logprob_start_len with the top
token, streamed as server-sent events when asked, as SGLang's bench_serving reads them), /start_profile (a prefill and
a decode trace written, as SGLang's profiler writes them by stage) and /update_weights_from_disk (refusing, as an
MXFP8 server does, a folder that does not exist and one with an e4m3 weight without its scale or with a scale of the
wrong shape, a float8 weight not e4m3, NaN e4m3 bytes, or a float weight holding NaN or Inf), /flush_cache; with
return_routed_experts, the experts each token was routed to in each of LAYERS MoE
layers (TOP_K each), base64 of int32 as SGLang's routing capture returns them.

Its "model" is arithmetic: the greedy token after ids is (sum(ids) * 31 + SHIFT) % VOCAB, its logprob -1 / (1 + the
token % 7); a token's experts in layer l are (token * 7 + l * 13 + k * 29) % EXPERTS, k < TOP_K, each moved by
SHIFT for every fourth token id. SHIFT differs between two peers as MXFP8 does from BF16, and a checkpoint
folder named "...negated..." (PEER_MODEL at start, or refit to) shifts them by 3 more. A token takes TOKEN_S
seconds; a refit takes REFIT_S seconds and holds requests meanwhile, as SGLang's scheduler does.

With a LOG file named, each refit appends the line the plugin logs on where a load's time went (60% reading and
copying, 40% post-load processing), as an MXFP8 server's log has it.

    python sglang_test_peer.py PORT [SHIFT [REFIT_S [LOG]]]
"""

import base64
import json
import os
import struct
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

VOCAB = 1000
LAYERS, TOP_K, EXPERTS = 2, 2, 128
SHIFT = int(sys.argv[2]) if len(sys.argv) > 2 else 0
REFIT_S = float(sys.argv[3]) if len(sys.argv) > 3 else 0.2
LOG = sys.argv[4] if len(sys.argv) > 4 else None
LOCK = threading.Lock()  # a refit holds it; every forward takes it
TOKEN_S = 0.004  # a decode step's time, so that requests are still decoding when a refit arrives
PROFILED_STEPS = 40


def negated_shift(model_path):
    """The shift a checkpoint whose folder name says "negated" adds: another model to refit to."""
    return 3 if "negated" in Path(model_path).name else 0


MODEL_SHIFT = [negated_shift(os.environ.get("PEER_MODEL", ""))]  # the served checkpoint's; a refit sets it


def next_token(ids):
    return (sum(ids) * 31 + SHIFT + MODEL_SHIFT[0]) % VOCAB


def logprob(token):
    return -1.0 / (1 + token % 7)


def routed(ids):
    """The routing capture of a forward over ``ids``: [len(ids), LAYERS, TOP_K] int32, base64."""
    experts = [(t * 7 + layer * 13 + k * 29 + (SHIFT if t % 4 == 0 else 0)) % EXPERTS
               for t in ids for layer in range(LAYERS) for k in range(TOP_K)]
    return base64.b64encode(struct.pack(f"<{len(experts)}i", *experts)).decode()


def refusal(folder):
    """Why an MXFP8 server refuses to load ``folder`` (its message), or None."""
    import torch
    from safetensors import safe_open

    if not Path(folder).is_dir():
        return f"Failed to get weights iterator: {folder} is no folder"
    for shard in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(str(shard), "pt") as f:
            tensors = {name: f.get_tensor(name) for name in f.keys()}
        for name, t in sorted(tensors.items()):
            scale = tensors.get(f"{name}_scale_inv")
            if t.dtype == torch.float8_e4m3fn:
                if scale is None:
                    return f"{name}: the checkpoint loaded this weight without its scale tensor"
                if tuple(scale.shape) != (*t.shape[:-1], t.shape[-1] // 32):
                    return f"{name}: weight {list(t.shape)} needs a scale of another shape, the checkpoint has " \
                           f"{list(scale.shape)}"
                if bool(((t.view(torch.uint8) & 0x7F) == 0x7F).any()):
                    return f"{name}: weight row holds NaN e4m3 values"
            elif t.is_floating_point() and t.element_size() == 1:
                return f"{name}: checkpoint tensor is {t.dtype}, expected torch.float8_e4m3fn"
            elif t.is_floating_point() and not bool(torch.isfinite(t).all()):
                return f"{name}: scale row holds NaN (0xFF)"
    return None


def generated(ids, n):
    out = []
    for _ in range(n):
        with LOCK:
            token = next_token(ids + out)
        out.append(token)
        time.sleep(TOKEN_S)
    return out


# kernels of a Qwen3-MoE forward under SGLang: attention, dense, MoE, other; microseconds per decode step (prefill: 8x)
KERNELS = [("_fwd_grouped_kernel_stage1", 40), ("nvjet_tst_128x64_64x8_1x1_v_bz_TNT", 30 - 10 * (SHIFT > 0)),
           ("fused_moe_kernel", 120 - 40 * (SHIFT > 0)), ("void flashinfer::norm::FusedAddRMSNormKernel<8u, bf16>", 5)]


def write_traces(out_dir):
    """A torch.profiler chrome trace per stage (gzipped, as SGLang names them), PROFILED_STEPS steps of KERNELS."""
    import gzip

    out_dir.mkdir(parents=True, exist_ok=True)
    for stage, per in (("EXTEND", 8), ("DECODE", 1)):
        events = [{"ph": "X", "cat": "kernel", "name": name, "ts": i, "dur": us * per}
                  for i in range(PROFILED_STEPS) for name, us in KERNELS]
        events.append({"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 999})
        with gzip.open(out_dir / f"1700000000.1-TP-0-{stage}.trace.json.gz", "wt") as f:
            json.dump({"traceEvents": events}, f)


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

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
        if self.path == "/health_generate":
            return self._send({})
        if self.path == "/v1/models":
            return self._send({"data": [{"id": "peer"}]})
        self._send({"error": "not found"}, 404)

    def _one(self, ids, req):
        params = req.get("sampling_params", {})
        out = generated(list(ids), params.get("max_new_tokens", 16))
        meta = {"completion_tokens": len(out), "prompt_tokens": len(ids)}
        if req.get("return_routed_experts"):
            meta["routed_experts"] = routed((list(ids) + out)[:-1])  # every token that went through a forward
        if req.get("return_logprob"):
            meta["output_token_logprobs"] = [[logprob(t), t, None] for t in out]
            start = req.get("logprob_start_len", -1)
            if start >= 0:
                inputs = list(ids)
                meta["input_token_logprobs"] = [[None if p == 0 else (0.0 if next_token(inputs[:p]) == inputs[p]
                                                                      else -5.0), inputs[p], None]
                                                for p in range(start, len(inputs))]
                if req.get("top_logprobs_num"):
                    meta["input_top_logprobs"] = [[[0.0, next_token(inputs[:p]), None]] if p else None
                                                  for p in range(start, len(inputs))]
        return {"text": " ".join(f"t{t}" for t in out), "output_ids": out, "meta_info": meta}

    def do_POST(self):
        length = int(self.headers.get("Content-Length") or 0)
        req = json.loads(self.rfile.read(length)) if length else {}
        if self.path == "/flush_cache":
            return self._send({})
        if self.path == "/start_profile":  # the traces SGLang's profiler writes by stage, once the load has run
            threading.Timer(0.5, write_traces, (Path(req["output_dir"]),)).start()
            return self._send({"success": True, "message": "Succeeded"})
        if self.path == "/update_weights_from_disk":
            refused = refusal(req["model_path"])
            if refused:  # as the plugin refuses it; nothing changes
                return self._send({"success": False, "message": f"Failed to update weights: {refused}"}, 400)
            with LOCK:
                time.sleep(REFIT_S)
                MODEL_SHIFT[0] = negated_shift(req["model_path"])
            if LOG:
                with open(LOG, "a") as log:
                    log.write(f"[x] sglang_mxfp8: load took {REFIT_S:.3f} s: reading {REFIT_S * 0.3:.3f} s, copying "
                              f"into the MXFP8 weights {REFIT_S * 0.3:.3f} s, quantizing float tensors 0.000 s, MXFP8 "
                              f"post-load processing {REFIT_S * 0.4:.3f} s (checks {REFIT_S * 0.1:.3f} s, kernel "
                              f"layouts {REFIT_S * 0.3:.3f} s), kernel precompilation 0.000 s; peak GPU memory "
                              "0.250 GiB above its start\n")
            return self._send({"success": True, "message": f"loaded {req['model_path']}"})
        if self.path != "/generate":
            return self._send({"error": "not found"}, 404)
        batch = req["input_ids"] and isinstance(req["input_ids"][0], list)
        if req.get("stream"):
            return self._stream(req)
        items = [self._one(ids, req) for ids in (req["input_ids"] if batch else [req["input_ids"]])]
        self._send(items if batch else items[0])

    def _stream(self, req):
        """Server-sent events as SGLang streams them: the text so far and its token count, then [DONE]."""
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        ids = list(req["input_ids"])
        out = []
        for _ in range(req["sampling_params"]["max_new_tokens"]):
            out += generated(ids + out, 1)
            event = {"text": " ".join(f"t{t}" for t in out), "meta_info": {"completion_tokens": len(out)}}
            self._chunk(f"data: {json.dumps(event)}\n\n")
        self._chunk("data: [DONE]\n\n")
        self.wfile.write(b"0\r\n\r\n")

    def _chunk(self, text):
        data = text.encode()
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()


class Server(ThreadingHTTPServer):
    request_queue_size = 256
    daemon_threads = True


if __name__ == "__main__":
    Server(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
