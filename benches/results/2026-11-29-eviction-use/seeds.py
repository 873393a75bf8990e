#!/usr/bin/env python3
"""The turns' hot hit rate per Zipf draw (bench seed, seeds 1-4), tier loop modelled: priority bands, the
engine ranking with counts carried (recency/frequency 0.1/0.8 and 0/1), chains ranked by their agent's
turns, Belady's MIN; and the gains of the two engine rankings over priority bands. Output: model-seeds.txt.

    python3 benches/results/2026-11-29-eviction-use/seeds.py

Uses the model in ../2026-11-28-eviction-bound/ (sim.py, prompts.py: `make models` first).
"""
import sys

sys.path.insert(0, __file__.rsplit('/', 1)[0] + '/../2026-11-28-eviction-bound')
from prompts import lengths  # noqa: E402
from sim import Sim, trace  # noqa: E402
S, U, G, R, _ = lengths()
L = dict(S=S, U=U, G=G, R=R)
rules=[('band',None),('x-engine-ghost',(0.1,0.8)),('x-engine-ghost',(0.0,1.0)),('lfu-chain',None),('min',None)]
for seed in ['bench',1,2,3,4]:
    ev,uses=trace(seed,L)
    out=[]
    for rule,w in rules:
        s=Sim(ev,uses,551,rule,bridge=True)
        if w: s.wr,s.wf=w
        r,c=s.run(); out.append(c['Ahot']/c['Atot'])
    print(seed, ' '.join('%.3f'%x for x in out), ' gain %.1f%% %.1f%%'%((out[1]/out[0]-1)*100,(out[2]/out[0]-1)*100))
