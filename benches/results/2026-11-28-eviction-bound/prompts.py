"""Token lengths of the eviction bench's prompts (benches/src/eviction.rs), via tok.py."""
import os
from tok import Tok
M64 = (1 << 64) - 1
class SplitMix64:
    def __init__(self, seed): self.s = seed & M64
    def next_u64(self):
        self.s = (self.s + 0x9E3779B97F4A7C15) & M64
        z = self.s
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
        return z ^ (z >> 31)
    def next_open01(self): return ((self.next_u64() >> 11) + 0.5) / float(1 << 53)

WORDS = ["river", "lantern", "orchard", "granite", "harbour", "meadow", "violin", "compass", "glacier",
    "library", "falcon", "ember", "invoice", "ledger", "freight", "pallet", "customs", "tariff",
    "courier", "depot", "manifest", "berth", "quay", "dock"]
KINDS = ["axioms", "identity", "rules", "capabilities", "soul"]
TITLES = ["Axioms", "Identity", "Rules", "Capabilities", "Soul"]
BUDGET = [200, 300, 600, 1500, 300]

def prose(seed, lines):
    r = SplitMix64(seed)
    w = lambda: WORDS[r.next_u64() % 24]
    out = []
    for i in range(lines):
        a, b, c, d = w(), w(), w(), w()
        out.append(f"{i}. When the {a} meets the {b}, check the {c} before the {d}.")
    return "\n".join(out)

def synthesize(content, budget, tok):
    lines = [l for l in content.split("\n") if l.strip()]
    cost = [len(tok.encode(l)) + 1 for l in lines]
    if sum(cost) <= budget: keep = [True] * len(lines)
    else:
        keep = [False] * len(lines); used = 0
        for i in range(len(lines)):          # scores fall with position: order = index order
            if used + cost[i] <= budget: used += cost[i]; keep[i] = True
    return "\n".join(l for l, k in zip(lines, keep) if k)

def message(a, i):
    return (f"Agent {a}, question {i}: the {WORDS[(a + i) % 24]} left the {WORDS[(i * 5 + 3) % 24]} at "
            f"{(i * 37 + a * 11) % 60} past the hour; where should the {WORDS[(i * 7 + a) % 24]} go?")

def lengths(agents=12, layer_lines=24, reply_tokens=8, tok=None):
    """Per agent: S (stable prefix + system end, tokens); per (agent, i): U (user message framed), and
    R (assistant framed with a reply of reply_tokens), G (generation header)."""
    tok = tok or Tok(os.path.join(os.path.dirname(os.path.abspath(__file__)), '../../../models/SmolLM2-135M-Instruct.Q4_1.gguf'))
    n = lambda s: len(tok.encode(s))
    S, seg = [], []
    for a in range(agents):
        parts = [n("<|im_start|>system\n")]
        for k, kind in enumerate(KINDS):
            content = f"Agent {a}, {kind}:\n" + prose(a * 10 + k + 1, layer_lines)
            parts.append(n(f"## {TITLES[k]}\n{synthesize(content, BUDGET[k], tok)}\n\n"))
        parts.append(n("<|im_end|>\n"))
        S.append(sum(parts)); seg.append(parts)
    U = [[n(f"<|im_start|>user\n{message(a, i)}<|im_end|>\n") for i in range(12)] for a in range(agents)]
    G = n("<|im_start|>assistant\n")
    R = G + reply_tokens + n("<|im_end|>\n")
    return S, U, G, R, seg

if __name__ == "__main__":
    S, U, G, R, seg = lengths()
    print("S", S); print("segments agent0", seg[0]); print("U", U[0][:6], "G", G, "R", R)
    ws = sum((S[a] + sum(U[a][i] + R for i in range(3))) // 16 for a in range(12))
    print("working set blocks after warm-up (3 turns each):", ws, "(bench: 1377)")
