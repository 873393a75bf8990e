#!/usr/bin/env python3
"""The eviction model of sim.py counted two ways -- over every admission the engine counts (the
turn's prompt A and the canonical prefix B re-prefilled after it) and over the turns' prompts
only (A: what a turn finds hot when it arrives) -- for the engine-like attention ranking with
and without read counts carried across a block's lives (prefix.rs ReadHistory: a stable block
recomputed under a dropped one's hash starts with its reads).

    python3 turns.py --seeds 10      # ~2 min

Rules: band (priority-only), x-engine (bands, then recency_weight*r + frequency_weight*f with
f = ln(1+reads)/ln(1+max reads), lifted along chains: evict.rs without attention mass, reads
+1 per admission that reads the block), x-engine-ghost (the same with reads carried),
lfu-chain and min as in sim.py.
"""
import argparse
import statistics
import sys

sys.path.insert(0, __file__.rsplit('/', 1)[0])
from prompts import lengths  # noqa: E402
from sim import Sim, trace  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument('--seeds', type=int, default=10)
    args = ap.parse_args()
    S, U, G, R, _ = lengths()
    L = dict(S=S, U=U, G=G, R=R)
    rules = [('band', None), ('x-engine', (0.4, 0.4)), ('x-engine-ghost', (0.4, 0.4)),
             ('x-engine', (0.1, 0.8)), ('x-engine-ghost', (0.1, 0.8)),
             ('x-engine-ghost', (0.0, 1.0)), ('lfu-chain', None), ('min', None)]
    res = {}
    for seed in ['bench'] + list(range(1, args.seeds + 1)):
        ev, uses = trace(seed, L)
        for rule, w in rules:
            for bridge in (False, True):
                s = Sim(ev, uses, 551, rule, bridge=bridge)
                if w:
                    s.wr, s.wf = w
                r, c = s.run()
                res.setdefault((rule, w, bridge), []).append((r, c['Ahot'] / c['Atot']))
    print('rule (recency, frequency) bridge | bench seed: all admissions, turns | seeds mean: all, turns')
    for (rule, w, bridge), v in res.items():
        rest = v[1:]
        print(f"{rule:<15} {str(w):<11} {str(bridge):<5} | {v[0][0]:.3f} {v[0][1]:.3f} | "
              f"{statistics.mean(x[0] for x in rest):.3f} {statistics.mean(x[1] for x in rest):.3f}")


if __name__ == '__main__':
    main()
