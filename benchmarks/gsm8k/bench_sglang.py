"""GSM8K accuracy and speed against a running SGLang server, offline.

Same flags and output lines as SGLang's ``benchmark/gsm8k/bench_sglang.py`` (``Accuracy:``,
``Invalid:``, ``Latency:``, ``Output throughput:``) so numbers compare with published ones. GSM8K
(MIT) ships in ``data/`` beside this file. Few-shot examples come from the *train* split; SGLang's
script takes them from the first test questions it also scores (``--shots-from-test`` reproduces
that for comparisons).

    python benchmarks/gsm8k/bench_sglang.py --num-questions 1319 --num-shots 8 --parallel 256 --port 30000
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Dict, List, Optional

import requests
from requests.adapters import HTTPAdapter
from tqdm import tqdm
from urllib3.util.retry import Retry

DATA = Path(__file__).resolve().parent / "data"
INVALID = -9999999
STOP = ["Question", "Assistant:", "<|separator|>"]


def read_jsonl(path: Path) -> List[Dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def get_answer_value(text: str) -> int:
    """SGLang's rule: the last integer in the text (commas removed), else INVALID."""
    numbers = re.findall(r"\d+", text.replace(",", ""))
    if not numbers:
        return INVALID
    try:
        return ast.literal_eval(numbers[-1])
    except (SyntaxError, ValueError):
        return INVALID


def label_of(item: Dict) -> int:
    return get_answer_value(item["answer"].split("####")[-1])


def one_example(item: Dict, include_answer: bool) -> str:
    text = "Question: " + item["question"] + "\nAnswer:"
    return text + " " + item["answer"] if include_answer else text


def few_shot_prefix(shots: List[Dict]) -> str:
    return "".join(one_example(s, True) + "\n\n" for s in shots)


def build_prompts(questions: List[Dict], shots: List[Dict]) -> List[str]:
    prefix = few_shot_prefix(shots)
    return [prefix + one_example(q, False) for q in questions]


def score(preds: List[int], labels: List[int]) -> Dict[str, float]:
    n = len(labels)
    return {
        "accuracy": sum(p == l for p, l in zip(preds, labels)) / n,
        "invalid": sum(p == INVALID for p in preds) / n,
    }


class ServerDown(RuntimeError):
    pass


def make_session(retries: int) -> requests.Session:
    s = requests.Session()
    retry = Retry(
        total=retries, connect=retries, backoff_factor=0.5, status_forcelist=(502, 503, 504), allowed_methods=None
    )
    s.mount("http://", HTTPAdapter(max_retries=retry, pool_maxsize=1024))
    return s


def check_server(session: requests.Session, base: str) -> None:
    """An SGLang server answers at ``base``: its /get_model_info is JSON naming the model_path it serves."""
    try:
        r = session.get(base + "/get_model_info", timeout=10)
        r.raise_for_status()
    except requests.RequestException as e:
        raise ServerDown(
            f"no SGLang server answers at {base} ({type(e).__name__}); start one with "
            "`python -m sglang.launch_server --model-path CKPT --port PORT` and pass --host/--port"
        ) from None
    try:
        info = r.json()
    except ValueError:
        info = None
    if not isinstance(info, dict) or "model_path" not in info:
        raise ServerDown(f"the server at {base} is not SGLang: its /get_model_info answered {r.text[:80]!r}, not "
                         "SGLang's JSON with a model_path; pass the --host/--port of an SGLang server")


def generated_text(response: requests.Response) -> Dict:
    """SGLang's /generate answer: JSON with the generated ``text``; ValueError for anything else."""
    body = response.json()
    if not isinstance(body, dict) or not isinstance(body.get("text"), str):
        raise ValueError(f"not SGLang's /generate answer: {response.text[:120]!r}")
    return body


def load_questions(args) -> List[Dict]:
    if args.platinum:
        if not args.data_path:
            raise SystemExit(
                "--platinum needs --data-path to a local GSM8K-Platinum test file (jsonl with question/answer): "
                "it is published on a model hub that this machine cannot reach, so it cannot be downloaded here"
            )
    path = Path(args.data_path) if args.data_path else DATA / "test.jsonl"
    if not path.is_file():
        raise SystemExit(f"--data-path {path}: no such file")
    items = read_jsonl(path)
    return items[args.question_index : args.question_index + args.num_questions]


def main(argv: Optional[List[str]] = None) -> Dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-shots", type=int, default=5, help="few-shot examples before each question (default: 5)")
    ap.add_argument("--data-path", default=None, help="questions jsonl (default: shipped GSM8K test, 1319)")
    ap.add_argument("--shots-path", default=str(DATA / "train.jsonl"), help="few-shot source (default: GSM8K train)")
    ap.add_argument("--shots-from-test", action="store_true", help="SGLang's behaviour: shots are the first test items")
    ap.add_argument("--num-questions", type=int, default=200, help="questions scored, from the first (default: 200)")
    ap.add_argument("--question-index", type=int, default=0, help="first question scored (default: 0)")
    ap.add_argument("--platinum", action="store_true", help="GSM8K-Platinum; needs a local --data-path")
    ap.add_argument("--parallel", type=int, default=64, help="requests in flight at once (default: 64)")
    ap.add_argument("--host", default="http://127.0.0.1", help="the SGLang server (default: http://127.0.0.1)")
    ap.add_argument("--port", type=int, default=30000, help="its port (default: 30000)")
    ap.add_argument("--max-new-tokens", type=int, default=512, help="longest answer (default: 512 tokens)")
    ap.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default: 0, greedy)")
    ap.add_argument("--result-file", default="result.jsonl", help="JSONL file the run's record is appended to")
    ap.add_argument("--retries", type=int, default=3, help="retries of a failed request (default: 3)")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds a request may take (default: 600)")
    args = ap.parse_args(argv)

    host = args.host if args.host.startswith("http") else "http://" + args.host
    base = f"{host}:{args.port}"
    questions = load_questions(args)
    shot_pool = questions if args.shots_from_test else read_jsonl(Path(args.shots_path))
    prompts = build_prompts(questions, shot_pool[: args.num_shots])
    labels = [label_of(q) for q in questions]

    session = make_session(args.retries)
    check_server(session, base)
    sampling = {"max_new_tokens": args.max_new_tokens, "temperature": args.temperature, "stop": STOP}

    failures = []

    def ask(prompt: str):
        try:
            r = session.post(base + "/generate", json={"text": prompt, "sampling_params": sampling},
                             timeout=args.timeout)
            r.raise_for_status()
            return generated_text(r)
        except (requests.RequestException, ValueError) as e:  # counted and reported: a failed request scores as invalid
            failures.append(str(e)[:200])
            return {"text": ""}

    tic = time.perf_counter()
    with ThreadPoolExecutor(args.parallel) as pool:
        outputs = list(tqdm(pool.map(ask, prompts), total=len(prompts), desc="gsm8k", unit="q"))
    latency = time.perf_counter() - tic

    preds = [get_answer_value(o["text"]) for o in outputs]
    result = score(preds, labels)
    tokens = sum(o.get("meta_info", {}).get("completion_tokens", 0) for o in outputs)
    print(f"Accuracy: {result['accuracy']:.3f}")
    print(f"Invalid: {result['invalid']:.3f}")
    print(f"Latency: {latency:.3f} s")
    print(f"Output throughput: {tokens / latency:.3f} token/s")
    print(f"Failed requests: {len(failures)}" + (f" (first: {failures[0]})" if failures else ""))
    record = {
        "task": "gsm8k-platinum" if args.platinum else "gsm8k", "backend": "srt", "num_gpus": 1,
        "latency": round(latency, 3), "accuracy": round(result["accuracy"], 3), "invalid": round(result["invalid"], 3),
        "output_throughput": round(tokens / latency, 3), "num_requests": len(questions),
        "failed_requests": len(failures),
        "other": {"num_questions": len(questions), "num_shots": args.num_shots, "parallel": args.parallel,
                  "shots_from": "test" if args.shots_from_test else "train"},
        "answers": preds,
    }
    with open(args.result_file, "a") as f:
        f.write(json.dumps(record) + "\n")
    return record


if __name__ == "__main__":
    try:
        sys.exit(1 if main()["failed_requests"] else 0)
    except ServerDown as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
