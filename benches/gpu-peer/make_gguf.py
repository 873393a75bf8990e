"""Writes a random-weight GGUF of the Llama-3-8B shape (32 layers, 4096 wide, 32 query and 8 KV
heads of 128, FFN 14336, vocab 128256) in bf16 or f16, for speed runs of llama.cpp and Engram where
only the shapes matter. Its tokenizer is a byte-level BPE (`gpt2`) both read: the 256 byte symbols,
676 merges of two lowercase letters, fillers `Z0`, `Z1`, … up to the vocabulary size, and an
end-of-text control token (the last id), so that both servers accept and stream text.

    python3 make_gguf.py OUT.gguf [bf16|f16] [GGUF_PY_DIR]

Weights are N(0, 0.02) slices of one shared pool (norms 1.0, f32): values are realistic and no
NaN or inf appears, and the 16 GB file is written in about a minute.
"""
import sys

import numpy as np

out = sys.argv[1]
kind = sys.argv[2] if len(sys.argv) > 2 else "bf16"
sys.path.insert(0, sys.argv[3] if len(sys.argv) > 3 else "llama.cpp/gguf-py")
import gguf  # noqa: E402

LAYERS, EMBD, HEADS, KV_HEADS, HEAD_DIM, FF, VOCAB = 32, 4096, 32, 8, 128, 14336, 128256

rng = np.random.default_rng(0)
pool32 = (rng.standard_normal(1 << 30, dtype=np.float32) * 0.02).astype(np.float32)
if kind == "bf16":
    pool = (pool32.view(np.uint32) >> 16).astype(np.uint16)
    raw, ftype = gguf.GGMLQuantizationType.BF16, gguf.LlamaFileType.MOSTLY_BF16
elif kind == "f16":
    pool = pool32.astype(np.float16)
    raw, ftype = None, gguf.LlamaFileType.MOSTLY_F16
else:
    sys.exit(f"unknown kind {kind} (bf16 or f16)")
del pool32
offset = 0


def weight(rows, cols):
    global offset
    n = rows * cols
    if offset + n > pool.size:
        offset = 0
    a = pool[offset : offset + n].reshape(rows, cols)
    offset += n // 3 + 1  # overlapping slices, shifted: no two tensors alike
    return a


w = gguf.GGUFWriter(out, "llama")
w.add_block_count(LAYERS)
w.add_context_length(131072)
w.add_embedding_length(EMBD)
w.add_feed_forward_length(FF)
w.add_head_count(HEADS)
w.add_head_count_kv(KV_HEADS)
w.add_rope_dimension_count(HEAD_DIM)
w.add_rope_freq_base(500000.0)
w.add_layer_norm_rms_eps(1e-5)
w.add_vocab_size(VOCAB)
w.add_file_type(ftype)
w.add_tokenizer_model("gpt2")
w.add_tokenizer_pre("default")


def byte_symbols():
    """GPT-2's printable stand-in for each byte, in byte order."""
    keep = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    extra = iter(range(256, 512))
    return [chr(b) if b in keep else chr(next(extra)) for b in range(256)]


letters = "abcdefghijklmnopqrstuvwxyz"
pairs = [a + b for a in letters for b in letters]
tokens = byte_symbols() + pairs
tokens += [f"Z{i}" for i in range(VOCAB - 1 - len(tokens))] + ["<|endoftext|>"]
w.add_token_list(tokens)
w.add_token_types([1] * (VOCAB - 1) + [3])
w.add_token_merges([f"{p[0]} {p[1]}" for p in pairs])
w.add_eos_token_id(VOCAB - 1)
ones = np.ones(EMBD, dtype=np.float32)
w.add_tensor("token_embd.weight", weight(VOCAB, EMBD), raw_dtype=raw)
for i in range(LAYERS):
    p = f"blk.{i}."
    w.add_tensor(p + "attn_norm.weight", ones)
    w.add_tensor(p + "attn_q.weight", weight(HEADS * HEAD_DIM, EMBD), raw_dtype=raw)
    w.add_tensor(p + "attn_k.weight", weight(KV_HEADS * HEAD_DIM, EMBD), raw_dtype=raw)
    w.add_tensor(p + "attn_v.weight", weight(KV_HEADS * HEAD_DIM, EMBD), raw_dtype=raw)
    w.add_tensor(p + "attn_output.weight", weight(EMBD, HEADS * HEAD_DIM), raw_dtype=raw)
    w.add_tensor(p + "ffn_norm.weight", ones)
    w.add_tensor(p + "ffn_gate.weight", weight(FF, EMBD), raw_dtype=raw)
    w.add_tensor(p + "ffn_up.weight", weight(FF, EMBD), raw_dtype=raw)
    w.add_tensor(p + "ffn_down.weight", weight(EMBD, FF), raw_dtype=raw)
w.add_tensor("output_norm.weight", ones)
w.add_tensor("output.weight", weight(VOCAB, EMBD), raw_dtype=raw)
w.write_header_to_file()
w.write_kv_data_to_file()
w.write_tensors_to_file()
w.close()
print(f"wrote {out} ({kind})")
