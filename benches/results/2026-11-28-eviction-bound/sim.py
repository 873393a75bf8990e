#!/usr/bin/env python3
"""Hot-tier hit rate of eviction policies on `engram-bench eviction`'s load (benches/src/eviction.rs),
with Belady's MIN as the offline bound.

Model of the load (see the report for file:line references):
- 12 agents, one tenant; agent a's prompt = stable prefix S_a (5 layers fitted to their budgets,
  ~1,700 tokens) + its conversation (user message framed ~31 tokens, assistant reply framed 14
  tokens: 8 generated) + the new message + the generation header.  Token counts come from the
  model's own BPE vocabulary (tok.py/prompts.py); block size 16.
- Each turn is two engine admissions, both counted by the engine's hit counters (admit.rs:211-216):
  A = the turn's prompt; B = the canonical prefix prefilled after the turn (record.rs:179-198),
  i.e. A's prompt plus the reply.  Counted per admission: lookups = (len-1)//16 full blocks;
  hits = leading cached blocks (hot or cold: the walk continues through cold ones); misses = rest.
- A conversation is deleted before an agent's turn once it has said 2*warm_turns = 6 turns
  (eviction.rs:288-299); the delete drops every block the session computed -- the stable prefix
  included (cache.rs forget) -- so the next conversation recomputes S_a.
- Warm-up: 3 turns per agent round robin, under the same hot limit; only steady turns count.
- Zipf(1) over the agents with SplitMix64 seeded 0xe71c7ed5 (the bench's exact sequence is seed
  'bench'); other seeds give the spread.
- Hot capacity: floor(72 MiB / 136,800 B) = 551 blocks (40 %); 1,379 blocks at 100 %.
- A running sequence's blocks are all hot (cold ones warmed at admission) and are never victims;
  its partial last block and decode tokens hold transient hot slots.

Policies: lru (block), band (priority-only approximation: pinned 999 up to floor(0.25*C) stable
blocks, other stable blocks 'degraded' 100, conversation 15; LRU then oldest within a band),
chain (chain-level LRU, each chain from its end), lfu-chain (chains ranked by the agent's turn
count so far, from the end), min (Belady: farthest next use first).  --bridge adds a crude model
of the tier bridge (spill to 75 % when above 90 %, 1 cycle per turn, 100-cycle cooldown).

Options a driver may set on a Sim (added 2026-11-29, all off by default): `bridge_rule = 'tier'`
orders the bridge's spills by the tier policy's own weights (0.4 frequency of uncarried use, 0.4
recency, 0.2 importance, scaled by priority) instead of the eviction rule's; `keep_stable` keeps
an agent's stable blocks when its conversation is deleted; `parent` (a share) starts a new
conversation block with that share of the previous block's count.
"""
import argparse
import math
import statistics
import sys

sys.path.insert(0, __file__.rsplit('/', 1)[0])
from prompts import SplitMix64, lengths  # noqa: E402

BS = 16
INF = float('inf')


def zipf(rng, n, s):
    w = [1.0 / (k ** s) for k in range(1, n + 1)]
    u = rng.next_open01() * sum(w)
    for k, wk in enumerate(w):
        u -= wk
        if u <= 0.0:
            return k
    return n - 1


def trace(seed, L, agents=12, warm_turns=3, turns=120, zipf_s=1.0, reply=8):
    """Admissions: dicts with agent, gen, lookups, cached_after, held, stable_blocks, counted."""
    S, U, G, R = L['S'], L['U'], L['G'], L['R']
    ev = []
    said = [0] * agents
    gen = [0] * agents

    def turn(a, counted):
        s = said[a]
        base = S[a] + sum(U[a][i] + R for i in range(s))
        la = base + U[a][s] + G
        lb = base + U[a][s] + R
        stable = sum(1 for b in range(la // BS) if S[a] - b * BS >= BS // 2)
        ev.append(dict(kind='admit', agent=a, gen=gen[a], lookups=(la - 1) // BS,
                       cached_after=la // BS, held=math.ceil((la + reply) / BS),
                       stable=stable, counted=counted, which='A'))
        ev.append(dict(kind='admit', agent=a, gen=gen[a], lookups=(lb - 1) // BS,
                       cached_after=lb // BS, held=math.ceil((lb + 1) / BS),
                       stable=stable, counted=counted, which='B'))
        ev.append(dict(kind='end_turn'))
        said[a] += 1

    for _ in range(warm_turns):
        for a in range(agents):
            turn(a, False)
    rng = SplitMix64(0xE71C7ED5 if seed == 'bench' else seed)
    for _ in range(turns):
        a = zipf(rng, agents, zipf_s)
        if said[a] >= 2 * warm_turns:
            ev.append(dict(kind='delete', agent=a, gen=gen[a]))
            gen[a] += 1
            said[a] = 0
        turn(a, True)
    # next-use times per chain, for MIN
    uses = {}
    for t, e in enumerate(ev):
        if e['kind'] == 'admit':
            uses.setdefault((e['agent'], e['gen']), []).append(t)
    return ev, uses


class Sim:
    def __init__(self, ev, uses, cap, policy, pin_share=0.25, bridge=False,
                 hot_high=0.9, hot_target=0.75, cooldown=100):
        self.ev, self.uses, self.cap, self.policy = ev, uses, cap, policy
        self.pin_cap = int(pin_share * cap)
        self.bridge, self.hot_high, self.hot_target, self.cooldown = bridge, hot_high, hot_target, cooldown
        # block = (agent, gen, index) -> meta
        self.meta = {}
        self.hot = set()
        self.chain_len = {}      # (agent, gen) -> cached blocks
        self.chain_last = {}     # (agent, gen) -> last admission time
        self.freq = {}           # agent -> admissions so far
        self.clock = 0
        self.heat = {}
        self.aheat = {}
        self.ghost = {}
        self.wr, self.wf = 0.4, 0.4  # recency, frequency weights of the x-engine rules (the driver sets them)
        self.inherit = policy == 'x-engine-ghost'
        self.decay = 0.995
        self.cycle = 0
        self.c = dict(hot=0, cold=0, miss=0, Ahot=0, Atot=0)

    @staticmethod
    def scales(ms, count):
        """The candidates' first last-use and span, and the log of their largest `count`."""
        lo = min(m['last'] for m in ms)
        span = max(max(m['last'] for m in ms) - lo, 1)
        return lo, span, max(math.log(1 + max(m.get(count, 0) for m in ms)), 1e-300)

    def engine_keys(self, blocks, busy):
        ms = [self.meta[b] for b in blocks]
        if not ms:
            self.ekey = {}
            return
        lo, span, den = self.scales(ms, 'reads')
        own = {}
        for b, m in zip(blocks, ms):
            band = 999 if m['pin'] == 'pinned' else (100 if m['stable'] else 15)
            r = (m['last'] - lo) / span
            f = math.log(1 + m['reads']) / den
            own[b] = (band, self.wr * r + self.wf * f)
        # lift along chains (later blocks of the chain; busy = max)
        eff = dict(own)
        chains = {}
        for b in list(self.hot) + list(blocks):
            chains.setdefault(b[:2], set()).add(b[2])
        for ch, _ in chains.items():
            n = self.chain_len.get(ch, 0)
            later = (0, -1e300)
            for i in range(n - 1, -1, -1):
                b = (ch[0], ch[1], i)
                k = (65535, 1e300) if b in busy else own.get(b, (0, -1e300))
                later = max(later, k)
                if b in eff:
                    eff[b] = max(eff[b], later)
        self.ekey = {b: (eff[b][0], eff[b][1], -b[2]) for b in blocks}

    def tier_keys(self, blocks):
        ms = [self.meta[b] for b in blocks]
        if not ms:
            self.tkey = {}
            return
        lo, span, den = self.scales(ms, 'att')
        own = {}
        for b, m in zip(blocks, ms):
            prio = 100 if m['stable'] else 15
            imp = 0.8 if m['stable'] else 0.4
            r = (m['last'] - lo) / span
            f = math.log(1 + m.get('att', 0)) / den
            own[b] = (0.4*f + 0.4*r + 0.2*imp + 0.01) * (1 + prio/100)
        eff = dict(own)
        chains = {}
        for b in list(self.hot):
            chains.setdefault(b[:2], set()).add(b[2])
        for ch in chains:
            n = self.chain_len.get(ch, 0)
            later = -1e300
            for i in range(n - 1, -1, -1):
                b = (ch[0], ch[1], i)
                if b in self.hot and b not in own:
                    k = 1e300  # pinned/cooling hot block protects
                else:
                    k = own.get(b, 0.0)
                later = max(later, k)
                if b in eff:
                    eff[b] = max(eff[b], later)
        self.tkey = {b: (eff[b], -b[2]) for b in blocks}

    def aheatv(self, a):
        hh = self.aheat.get(a, (0.0, self.clock))
        return hh[0] * self.decay ** (self.clock - hh[1])

    def heatv(self, ch):
        hh = self.heat.get(ch, (0.0, self.clock))
        return hh[0] * self.decay ** (self.clock - hh[1])

    # ---- victim ordering -------------------------------------------------------------------
    def key(self, blk, now):
        m = self.meta[blk]
        p = self.policy
        if p == 'lru':
            return (m['last'], m['created'], blk)
        if p == 'band':
            band = 999 if m['pin'] == 'pinned' else (100 if m['stable'] else 15)
            return (band, m['last'], m['created'], blk)
        if p == 'chain':
            ch = blk[:2]
            return (self.chain_last[ch], -blk[2])
        if p == 'lfu-chain':
            ch = blk[:2]
            return (self.freq.get(blk[0], 0), self.chain_last[ch], -blk[2])
        if p.startswith('x-'):
            ch = blk[:2]
            h = self.heatv(ch)
            pinned = m['pin'] == 'pinned'
            band = 999 if pinned else (100 if m['stable'] else 15)
            if p == 'x-pin-chain':
                return (pinned, h, self.chain_last[ch], -blk[2])
            if p == 'x-band-chain':
                return (band, h, self.chain_last[ch], -blk[2])
            if p == 'x-chain':
                return (h, self.chain_last[ch], -blk[2])
            if p.startswith('x-engine'):
                return self.ekey[blk]
            ah = self.aheatv(blk[0])
            if p == 'x-band-agent':
                return (band, ah, self.chain_last[ch], -blk[2])
            if p == 'x-pin-aheat':
                return (pinned, ah, self.chain_last[ch], -blk[2])
            if p == 'x-pin-agent':
                return (pinned, self.freq.get(blk[0], 0), self.chain_last[ch], -blk[2])
        if p == 'min':
            ch = blk[:2]
            us = self.uses[ch]
            nxt = next((u for u in us if u > now), INF)
            return (-nxt, -blk[2])
        raise ValueError(p)

    def evict(self, n, busy, now):
        idle = [b for b in self.hot if b not in busy]
        if self.policy.startswith('x-engine'):
            self.engine_keys(idle, busy)
        if self.policy == 'min':
            # cache next-use per chain
            nxt = {}
            for b in idle:
                ch = b[:2]
                if ch not in nxt:
                    nxt[ch] = next((u for u in self.uses[ch] if u > now), INF)
            idle.sort(key=lambda b: (-nxt[b[:2]], -b[2]))
        else:
            idle.sort(key=lambda b: self.key(b, now))
        if len(idle) < n:
            raise RuntimeError('no hot room')
        for b in idle[:n]:
            self.hot.discard(b)
            self.meta[b]['moved'] = self.cycle
            self.meta[b]['moves'] += 1
        self.evicted = getattr(self, 'evicted', 0) + n

    def make_room(self, n, busy, now):
        free = self.cap - len(self.hot)
        if free < n:
            self.evict(n - free, busy, now)

    # ---- pins (kvcore/src/pin.rs) ------------------------------------------------------------
    def pinned_count(self):
        return sum(1 for m in self.meta.values() if m['pin'] == 'pinned')

    def pin(self, blocks):
        count = self.pinned_count()
        for b in blocks:
            if count < self.pin_cap:
                self.meta[b]['pin'] = 'pinned'
                count += 1
            else:
                self.meta[b]['pin'] = 'degraded'

    def unpin_promote(self):
        room = self.pin_cap - self.pinned_count()
        deg = sorted((m['created'], b) for b, m in self.meta.items() if m['pin'] == 'degraded')
        for _, b in deg[:max(room, 0)]:
            self.meta[b]['pin'] = 'pinned'

    # ---- bridge (core/tiers.rs, crude) -------------------------------------------------------
    def bridge_cycle(self, now):
        self.cycle += 1
        if not self.bridge:
            return
        if len(self.hot) <= self.hot_high * self.cap:
            return
        target = int(self.hot_target * self.cap)
        want = len(self.hot) - target
        cand = [b for b in self.hot
                if self.meta[b]['pin'] != 'pinned'
                and not (self.meta[b]['moves'] > 0 and self.cycle - self.meta[b]['moved'] < self.cooldown)]
        if getattr(self, 'bridge_rule', 'same') == 'tier':
            self.tier_keys(cand)
            cand.sort(key=lambda b: self.tkey[b])
        else:
            if self.policy.startswith('x-engine'):
                self.engine_keys(cand, set())
            cand.sort(key=lambda b: self.key(b, now))
        for b in cand[:want]:
            self.hot.discard(b)
            self.meta[b]['moved'] = self.cycle
            self.meta[b]['moves'] += 1

    # ---- run -----------------------------------------------------------------------------------
    def run(self):
        for t, e in enumerate(self.ev):
            if e['kind'] == 'end_turn':
                self.bridge_cycle(t)
                continue
            a, g = e['agent'], e['gen']
            ch = (a, g)
            if e['kind'] == 'delete' and getattr(self, 'keep_stable', False):
                n = self.chain_len.get(ch, 0)
                kept = 0
                for i in range(n):
                    b = (a, g, i)
                    m = self.meta.pop(b)
                    was_hot = b in self.hot
                    self.hot.discard(b)
                    if m['stable'] and kept == i:
                        nb = (a, g + 1, i)
                        self.meta[nb] = m
                        if was_hot:
                            self.hot.add(nb)
                        kept += 1
                self.chain_len[ch] = 0
                self.chain_len[(a, g + 1)] = kept
                self.chain_last[(a, g + 1)] = self.chain_last.get(ch, 0)
                continue
            if e['kind'] == 'delete':
                for i in range(self.chain_len.get(ch, 0)):
                    b = (a, g, i)
                    self.hot.discard(b)
                    if self.meta[b]['stable']:
                        self.ghost[(a, i)] = self.meta[b]['reads']
                    del self.meta[b]
                self.chain_len[ch] = 0
                self.unpin_promote()
                continue
            self.clock += 1
            self.freq[a] = self.freq.get(a, 0) + 1
            cached = self.chain_len.get(ch, 0)
            hits = min(cached, e['lookups'])
            hot_hits = sum(1 for i in range(hits) if (a, g, i) in self.hot)
            if e['counted']:
                self.c['hot'] += hot_hits
                self.c['cold'] += hits - hot_hits
                self.c['miss'] += e['lookups'] - hits
                if e['which']=='A':
                    self.c['Ahot'] += hot_hits; self.c['Atot'] += e['lookups']
            self.chain_last[ch] = t
            hh = self.aheat.get(a, (0.0, self.clock))
            self.aheat[a] = (hh[0] * self.decay ** (self.clock - hh[1]) + 1.0, self.clock)
            hh = self.heat.get(ch, (0.0, self.clock))
            self.heat[ch] = (hh[0] * self.decay ** (self.clock - hh[1]) + 1.0, self.clock)
            # warm the cold hits (and every cached block of the chain is read: all must be hot)
            busy = {(a, g, i) for i in range(cached)}
            need_cold = [b for b in busy if b not in self.hot]
            transient = e['held'] - e['cached_after']
            new = e['cached_after'] - cached
            self.make_room(len(need_cold) + new + transient, busy, t)
            for b in need_cold:
                self.hot.add(b)
                self.meta[b]['moves'] += 1
                self.meta[b]['moved'] = self.cycle
            newb = []
            for i in range(cached, e['cached_after']):
                b = (a, g, i)
                st = i < e['stable']
                self.meta[b] = dict(created=self.clock * 10000 + i, last=0, pin='none',
                                    stable=st, moves=0, moved=self.cycle,
                                    reads=(self.ghost.get((a, i), 0) if (st and self.inherit) else 0))
                if getattr(self, 'parent', 0) and i > 0 and not st:
                    pm = self.meta.get((a, g, i - 1))
                    if pm is not None:
                        self.meta[b]['reads'] = max(self.meta[b]['reads'], int(pm['reads'] * self.parent))
                self.hot.add(b)
                newb.append(b)
            for b in busy | set(newb):
                self.meta[b]['last'] = self.clock
                self.meta[b]['reads'] += 1
                self.meta[b]['att'] = self.meta[b].get('att', 0) + 1
            self.pin([b for b in newb if self.meta[b]['stable']])
            self.chain_len[ch] = e['cached_after']
            # transient slots are released when the sequence ends (no-op in this accounting:
            # make_room already left them free)
        tot = self.c['hot'] + self.c['cold'] + self.c['miss']
        return self.c['hot'] / tot, dict(self.c, total=tot)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument('--seeds', type=int, default=20)
    ap.add_argument('--bridge', action='store_true')
    ap.add_argument('--caps', type=int, nargs='*', default=[], help='extra capacities (blocks), MIN and band only')
    args = ap.parse_args()
    S, U, G, R, _ = lengths()
    L = dict(S=S, U=U, G=G, R=R)
    seeds = ['bench'] + list(range(1, args.seeds + 1))
    caps = {'40%': 551, '100%': 1379}
    if args.caps:
        caps.update({f'{c}b': c for c in args.caps})
    pols = ['band', 'lru', 'chain', 'lfu-chain', 'min']
    res = {}
    for seed in seeds:
        ev, uses = trace(seed, L)
        for cn, cap in caps.items():
            for p in pols:
                if cn != '40%' and p not in ('band', 'min'):
                    continue
                for br in ([False, True] if args.bridge and p in ('band', 'min', 'lfu-chain') else [False]):
                    r, c = Sim(ev, uses, cap, p, bridge=br).run()
                    res.setdefault((cn, p + ('+bridge' if br else '')), []).append((seed, r, c))
    for k, v in res.items():
        b = [x for x in v if x[0] == 'bench'][0]
        rs = [x[1] for x in v if x[0] != 'bench']
        print(f"{k[0]:>5} {k[1]:<14} bench-seed {b[1]:.3f} (hot {b[2]['hot']}, cold {b[2]['cold']}, "
              f"miss {b[2]['miss']}, total {b[2]['total']})  seeds 1-{len(rs)}: mean {statistics.mean(rs):.3f} "
              f"sd {statistics.pstdev(rs):.3f} min {min(rs):.3f} max {max(rs):.3f}")


if __name__ == '__main__':
    main()
