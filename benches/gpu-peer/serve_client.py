"""Times llama-server as a client sees it: BATCH concurrent streamed completions of random
PROMPT-token prompts (token ids, so no tokenizer decides the length), each generating NTG tokens
greedily with end-of-text ignored. Prints one JSON line with the figures `engram-bench e2e`
prints for Engram:

- TTFT per sequence: from sending the request to the first streamed token (p50, max);
- time per output token: the gaps between a sequence's successive token events after its first,
  pooled over the sequences (p50, mean, p90), and the server's own `predicted_per_token_ms`;
- steady time per output token: only the gaps that begin once every sequence has its first
  token (with a batch, earlier gaps include other sequences' prompt processing): what
  `engram-bench e2e` measures, since it decodes after all prompts are in.

    python3 serve_client.py URL PROMPT BATCH NTG [SEED]

Standard library only (the GPU machine has no network).
"""
import json
import random
import sys
import threading
import time
import urllib.request

url, prompt, batch, ntg = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
seed = int(sys.argv[5]) if len(sys.argv) > 5 else 11
VOCAB_NORMAL = 128255  # the last id is the end-of-text control token

rng = random.Random(seed)
prompts = [[rng.randrange(VOCAB_NORMAL) for _ in range(prompt)] for _ in range(batch)]
results = [None] * batch
start_gate = threading.Barrier(batch)


def one(i):
    body = json.dumps(
        {
            "prompt": prompts[i],
            "n_predict": ntg,
            "stream": True,
            "ignore_eos": True,
            "cache_prompt": False,
            "top_k": 1,
            "temperature": 0.0,
            "return_tokens": True,
        }
    ).encode()
    req = urllib.request.Request(
        url + "/completion", data=body, headers={"Content-Type": "application/json"}
    )
    start_gate.wait()
    sent = time.perf_counter()
    arrivals, timings, n = [], None, 0
    with urllib.request.urlopen(req, timeout=3600) as resp:
        for raw in resp:
            line = raw.decode("utf-8", "replace").strip()
            if not line.startswith("data: "):
                continue
            ev = json.loads(line[6:])
            got = len(ev.get("tokens") or [])
            if got:
                now = time.perf_counter()
                # A held-back partial UTF-8 piece arrives with the next token: count both.
                arrivals.extend([now] * got)
                n += got
            if ev.get("stop"):
                timings = ev.get("timings")
                break
    results[i] = {"sent": sent, "arrivals": arrivals, "tokens": n, "timings": timings}


threads = [threading.Thread(target=one, args=(i,)) for i in range(batch)]
for t in threads:
    t.start()
for t in threads:
    t.join()


def q(v, p):
    v = sorted(v)
    return v[round((len(v) - 1) * p)] if v else float("nan")


ttft = [(r["arrivals"][0] - r["sent"]) * 1e3 for r in results if r and r["arrivals"]]
gaps = []
for r in results:
    a = r["arrivals"] if r else []
    gaps += [(b - x) * 1e3 for x, b in zip(a, a[1:])]
# Steady state: gaps that begin after every sequence has its first token (no prompt of the
# batch is being processed any more), the figure Engram's driver measures.
all_started = max((r["arrivals"][0] for r in results if r and r["arrivals"]), default=0.0)
steady = []
for r in results:
    a = r["arrivals"] if r else []
    steady += [(b - x) * 1e3 for x, b in zip(a, a[1:]) if x >= all_started]
server_tpot = [r["timings"]["predicted_per_token_ms"] for r in results if r and r["timings"]]
print(
    json.dumps(
        {
            "prompt_tokens": prompt,
            "batch": batch,
            "tokens": [r["tokens"] if r else 0 for r in results],
            "ttft_ms_p50": q(ttft, 0.5),
            "ttft_ms_max": q(ttft, 1.0),
            "tpot_ms_p50": q(gaps, 0.5),
            "tpot_ms_mean": sum(gaps) / max(len(gaps), 1),
            "tpot_ms_p90": q(gaps, 0.9),
            "steady_gaps": len(steady),
            "tpot_steady_ms_p50": q(steady, 0.5),
            "tpot_steady_ms_mean": sum(steady) / max(len(steady), 1),
            "server_predicted_per_token_ms_p50": q(server_tpot, 0.5),
        }
    )
)
