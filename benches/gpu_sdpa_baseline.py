"""bf16 baseline for `engram-gpu-bench`: PyTorch scaled_dot_product_attention of one decode token
per sequence over a dense bf16 KV cache of the same shape (32 query heads, 8 KV heads, 128 dims),
per layer. Prints JSON lines like the Rust bench.

    python3 gpu_sdpa_baseline.py [CONTEXTS] [BATCHES]     # decode
    python3 gpu_sdpa_baseline.py prefill [CONTEXTS]       # causal prefill of a whole prompt
"""
import json
import sys

import torch
import torch.nn.functional as F


def prefill(contexts):
    heads, kv_heads, d = 32, 8, 128
    dev = torch.device("cuda")
    for s in contexts:
        q = torch.randn(1, heads, s, d, device=dev, dtype=torch.bfloat16)
        k = torch.randn(1, kv_heads, s, d, device=dev, dtype=torch.bfloat16)
        v = torch.randn(1, kv_heads, s, d, device=dev, dtype=torch.bfloat16)
        run = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        run()
        times = []
        for _ in range(3):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        sec = sorted(times)[1]
        flops = 4.0 * heads * d * s * (s + 1) / 2
        print(json.dumps({"bench": "bf16_sdpa_causal_prefill", "torch": torch.__version__, "context": s,
                          "seconds_per_layer": sec, "seconds_32_layers": 32 * sec,
                          "causal_flops": flops, "flops_per_s": flops / sec}))
        del q, k, v
        torch.cuda.empty_cache()


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "prefill":
        prefill([int(x) for x in (sys.argv[2] if len(sys.argv) > 2 else "4096,32768").split(",")])
        return
    contexts = [int(x) for x in (sys.argv[1] if len(sys.argv) > 1 else "4096,32768,131072").split(",")]
    batches = [int(x) for x in (sys.argv[2] if len(sys.argv) > 2 else "1,16").split(",")]
    heads, kv_heads, d, reps = 32, 8, 128, 20
    dev = torch.device("cuda")
    for s in contexts:
        for b in batches:
            q = torch.randn(b, heads, 1, d, device=dev, dtype=torch.bfloat16)
            k = torch.randn(b, kv_heads, s, d, device=dev, dtype=torch.bfloat16)
            v = torch.randn(b, kv_heads, s, d, device=dev, dtype=torch.bfloat16)
            for _ in range(3):
                F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(reps):
                F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
            end.record()
            torch.cuda.synchronize()
            sec = start.elapsed_time(end) / 1e3 / reps
            nbytes = 2 * b * kv_heads * s * d * 2
            print(json.dumps({"bench": "bf16_sdpa", "torch": torch.__version__, "context": s, "batch": b,
                              "seconds_per_layer": sec, "bytes": nbytes, "bytes_per_s": nbytes / sec}))
            del q, k, v
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
