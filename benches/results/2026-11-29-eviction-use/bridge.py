#!/usr/bin/env python3
"""The turns' hot hit rate per Zipf draw with the tier loop modelled as now (spill above 90 % down to
75 %) and with it off, for priority bands and the use-count ranking (with and without a new
conversation block starting from its parent's count). Output: model-bridge.txt.

    python3 benches/results/2026-11-29-eviction-use/bridge.py

Uses the model in ../2026-11-28-eviction-bound/ (sim.py, prompts.py: `make models` first).
"""
import sys

sys.path.insert(0, __file__.rsplit('/', 1)[0] + '/../2026-11-28-eviction-bound')
from prompts import lengths  # noqa: E402
from sim import Sim, trace  # noqa: E402
S, U, G, R, _ = lengths()
L = dict(S=S, U=U, G=G, R=R)
variants=[('band',None,0,0.9),('x-engine-ghost',(0.0,1.0),0,0.9),('x-engine-ghost',(0.0,1.0),1.0,0.9),('x-engine-ghost',(0.0,1.0),0.5,0.9),
          ('band',None,0,2),('x-engine-ghost',(0.0,1.0),0,2),('x-engine-ghost',(0.0,1.0),1.0,2)]
for seed in ['bench',1,2,3,4]:
    ev,uses=trace(seed,L)
    out=[]
    for rule,w,par,hh in variants:
        s=Sim(ev,uses,551,rule,bridge=True,hot_high=hh,hot_target=(0.75 if hh<1 else 2)); s.parent=par
        if w: s.wr,s.wf=w
        r,c=s.run(); out.append(c['Ahot']/c['Atot'])
    print(seed, ' '.join('%.3f'%x for x in out), ' gains bridge: %.1f %.1f %.1f | no bridge %.1f %.1f'%((out[1]/out[0]-1)*100,(out[2]/out[0]-1)*100,(out[3]/out[0]-1)*100,(out[5]/out[4]-1)*100,(out[6]/out[4]-1)*100))
