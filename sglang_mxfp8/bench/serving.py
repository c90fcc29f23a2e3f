"""Start a stock SGLang server in a subprocess and talk to it (used by the demo and e2e checks)."""

from __future__ import annotations

import functools
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import requests

from ..compat import RENAMED_FLAGS

BASE_FLAGS = (
    "--attention-backend triton --sampling-backend pytorch --grammar-backend none --mem-fraction-static 0.3 "
    "--disable-piecewise-cuda-graph --skip-tokenizer-init --cuda-graph-max-bs 16"
)
# a caller's flag that turns one of the base flags off (SGLang takes the caller's; the command line would show both)
TURNS_OFF = {"--enforce-piecewise-cuda-graph": "--disable-piecewise-cuda-graph"}
PROMPTS = [[1, 17 + i, 300 + 7 * i, 42, 999 - i, 5, 77 + 3 * i, 512] for i in range(8)]


def launch_flags(base: str, flags: str) -> list:
    """``base`` then ``flags`` as arguments, less each base flag (with its values) that ``flags`` gives again (SGLang
    takes the last of a repeated flag) or turns off (TURNS_OFF): the command printed is the one SGLang reads."""
    def groups(argv):
        out = []
        for token in argv:
            if token.startswith("--") or not out:
                out.append([token])
            else:
                out[-1].append(token)
        return out

    mine = shlex.split(flags)
    given = {group[0].split("=")[0] for group in groups(mine)}
    dropped = given | {TURNS_OFF[flag] for flag in given if flag in TURNS_OFF}
    return [token for group in groups(shlex.split(base)) if group[0] not in dropped for token in group] + mine


@functools.lru_cache(maxsize=None)
def sglang_cli_flags() -> frozenset:
    """Every flag the installed SGLang's launcher parses."""
    import argparse

    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    return frozenset(option for action in parser._actions for option in action.option_strings)


def for_this_sglang(argv: list, known=None) -> list:
    """``argv`` with each flag the running SGLang (its parser's flags: ``known``) dropped replaced by its successor."""
    known = sglang_cli_flags() if known is None else known
    out = []
    for token in argv:
        name, sep, value = token.partition("=")
        if name in RENAMED_FLAGS and name not in known:
            token = RENAMED_FLAGS[name] + sep + value
        out.append(token)
    return out


class Server:
    def __init__(self, name, ckpt, flags, port, log_dir, text=False, env=None, base=BASE_FLAGS):
        """``text``: load the checkpoint's tokenizer (default: input_ids only, --skip-tokenizer-init);
        ``env``: variables set for the server on top of this process's environment; ``base``: the flags ``flags``
        add to (default: quick starts on a small model; the benchmarks pass SGLang's defaults, "")."""
        self.name, self.ckpt, self.port = name, ckpt, port
        with socket.socket() as sock:  # else wait() would take a leftover server's answers for ours
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                raise RuntimeError(f"[{name}] port {port} already has a server (left over from an earlier run?); "
                                   "stop it or pick another port")
        self.log = Path(log_dir) / f"server_{name}.log"
        self.log.parent.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", ckpt, "--port", str(port)]
        base = base.replace(" --skip-tokenizer-init", "") if text else base
        cmd += for_this_sglang(launch_flags(base, flags))
        self.cmd = " ".join([f"{k}={v}" for k, v in (env or {}).items()] + cmd)
        print(f"[{name}] {self.cmd}", flush=True)
        self.t0 = time.time()
        self.proc = subprocess.Popen(cmd, stdout=open(self.log, "w"), stderr=subprocess.STDOUT, start_new_session=True,
                                     env={**os.environ, **(env or {})})

    def wait(self, timeout=400):
        url = f"http://127.0.0.1:{self.port}/health_generate"
        while time.time() - self.t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"[{self.name}] exited {self.proc.returncode}; tail:\n{self.log.read_text()[-3000:]}"
                )
            try:
                if requests.get(url, timeout=5).status_code == 200:
                    print(f"[{self.name}] up after {time.time() - self.t0:.0f} s", flush=True)
                    return
            except requests.RequestException:
                pass
            time.sleep(2)
        raise TimeoutError(f"[{self.name}] not up after {timeout} s")

    def generate(self, max_new_tokens=16, margins=False):
        """Greedy tokens of PROMPTS with their logprobs; ``margins``: also the top-1 minus top-2 logprob
        per position (how close the greedy choice was to a tie)."""
        params = {"return_logprob": True, **({"top_logprobs_num": 2} if margins else {})}
        r = requests.post(
            f"http://127.0.0.1:{self.port}/generate",
            json={"input_ids": PROMPTS, "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens,
                                                              "ignore_eos": True}, **params},
            timeout=120,
        )
        r.raise_for_status()
        out = []
        for item in r.json():
            lp = item["meta_info"]["output_token_logprobs"]
            seq = {"ids": [t[1] for t in lp], "logprobs": [t[0] for t in lp]}
            if margins:
                seq["margins"] = [top[0][0] - top[1][0] for top in item["meta_info"]["output_top_logprobs"]]
            out.append(seq)
        return out

    def refit(self, path):
        r = requests.post(
            f"http://127.0.0.1:{self.port}/update_weights_from_disk", json={"model_path": path}, timeout=300
        )
        return r.status_code, r.json()

    def stop(self):
        """Stop the server's whole process group; safe to call twice."""
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=30)
        except ProcessLookupError:
            return
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
