"""bf16 baseline for `engram-gpu-bench`: PyTorch scaled_dot_product_attention of one decode token
per sequence over a dense bf16 KV cache of the same shape (32 query heads, 8 KV heads, 128 dims),
per layer. Prints JSON lines like the Rust bench."""
import json
import sys

import torch
import torch.nn.functional as F


def main():
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
