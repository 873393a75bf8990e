#!/usr/bin/env python3
"""The KV codec frontier as an SVG: bits per element against KL (log scale), one line per codec
family and one point per calibrated profile, from `engram eval kv --json` lines.

    engram eval kv --json --codecs ... --profile ... > rows.jsonl
    scripts/kv-frontier.py rows.jsonl > frontier.svg

With arguments `NAME=FILE` (one per model: `smollm2=a.jsonl gemma3=b.jsonl`) it draws one line
per model instead, through that model's codecs in order of bits, its profiles (the built-in
default among them) as diamonds in the line's colour.

Families: `K=V` (one codec for keys and values), and `keys X` (keys in codec X, values in each
TurboQuant width; `keys tq6o1` is TurboQuant-6 keys with one outlier per row stored apart). Rows
named `profile:…` are points; probes (`k:…`) and the reference are left out. Where files repeat
a codec, the later file's row is drawn. Standard library only.
"""

import json
import math
import sys


def family(name):
    if name.startswith("profile:"):
        return None
    if name.startswith("k:"):
        return ""
    if "/" in name:
        return "keys " + name.split("/", 1)[0]
    if name in ("f32",) or name.startswith("k:"):
        return ""
    return "K=V"


def read(paths):
    rows = [json.loads(line) for path in paths for line in open(path) if line.strip()]
    rows = [r for r in rows if r.get("kl_nats", 0) > 0 and "+" not in r["codec"]]
    # A later file's row of the same codec replaces an earlier one's.
    return list({r["codec"]: r for r in rows}.values())


def main():
    args = sys.argv[1:]
    by_model = bool(args) and all("=" in a for a in args)
    lines = {}
    points = []
    if by_model:
        # Model name -> its rows; profiles become points labelled with the model.
        for a in args:
            name, path = a.split("=", 1)
            for r in read([path]):
                if r["codec"].startswith("profile:"):
                    points.append(dict(r, codec=f"{name} {r['codec'][len('profile:'):]}", model=name))
                elif not r["codec"].startswith("k:"):
                    lines.setdefault(name, []).append(r)
        rows = [r for rs in lines.values() for r in rs] + points
        title = "KV codecs per model: bits per element vs KL against exact KV"
    else:
        rows = read(args)
        for r in rows:
            f = family(r["codec"])
            if f is None:
                points.append(r)
            elif f:
                lines.setdefault(f, []).append(r)
        title = "KV codecs on SmolLM2-135M: bits per element vs KL against exact KV"
    for f in lines:
        lines[f].sort(key=lambda r: r["bits_per_element"])
    w, h, left, right, top, bottom = 720, 460, 70, 190, 40, 50
    xs = [r["bits_per_element"] for r in rows]
    x0, x1 = math.floor(min(xs)), math.ceil(max(xs))
    ys = [math.log10(r["kl_nats"]) for r in rows]
    y0, y1 = math.floor(min(ys)), math.ceil(max(ys))

    def px(x):
        return left + (x - x0) / max(x1 - x0, 1e-9) * (w - left - right)

    def py(kl):
        return h - bottom - (math.log10(kl) - y0) / max(y1 - y0, 1e-9) * (h - top - bottom)

    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" '
        'font-family="sans-serif" font-size="12">',
        '<rect width="100%" height="100%" fill="white"/>',
        f'<text x="{w / 2}" y="22" text-anchor="middle" font-size="15">{title}</text>',
    ]
    for x in range(x0, x1 + 1):
        out.append(
            f'<line x1="{px(x):.1f}" y1="{top}" x2="{px(x):.1f}" y2="{h - bottom}" stroke="#ddd"/>'
            f'<text x="{px(x):.1f}" y="{h - bottom + 16}" text-anchor="middle">{x}</text>'
        )
    for e in range(y0, y1 + 1):
        y = py(10.0**e)
        out.append(
            f'<line x1="{left}" y1="{y:.1f}" x2="{w - right}" y2="{y:.1f}" stroke="#ddd"/>'
            f'<text x="{left - 6}" y="{y + 4:.1f}" text-anchor="end">1e{e}</text>'
        )
    budget = py(0.01)
    out.append(
        f'<line x1="{left}" y1="{budget:.1f}" x2="{w - right}" y2="{budget:.1f}" '
        'stroke="#888" stroke-dasharray="4 3"/>'
        f'<text x="{w - right + 4}" y="{budget + 4:.1f}" fill="#888">budget 0.01</text>'
    )
    out.append(
        f'<text x="{(left + w - right) / 2}" y="{h - 12}" text-anchor="middle">'
        "stored bits per element (norms included)</text>"
        f'<text x="16" y="{(top + h - bottom) / 2}" text-anchor="middle" '
        f'transform="rotate(-90 16 {(top + h - bottom) / 2})">KL (nats), log scale</text>'
    )
    colors = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#17becf"]
    color_of = {}
    for i, (f, rs) in enumerate(sorted(lines.items())):
        c = colors[i % len(colors)]
        color_of[f] = c
        pts = " ".join(f"{px(r['bits_per_element']):.1f},{py(r['kl_nats']):.1f}" for r in rs)
        out.append(f'<polyline fill="none" stroke="{c}" stroke-width="2" points="{pts}"/>')
        for r in rs:
            x, y = px(r["bits_per_element"]), py(r["kl_nats"])
            out.append(
                f'<circle cx="{x:.1f}" cy="{y:.1f}" r="3" fill="{c}"/>'
                f'<text x="{x + 5:.1f}" y="{y - 5:.1f}" font-size="10" fill="{c}">{r["codec"]}</text>'
            )
        out.append(f'<text x="{w - right + 10}" y="{top + 16 * (i + 2)}" fill="{c}">{f}</text>')
    for r in points:
        x, y = px(r["bits_per_element"]), py(r["kl_nats"])
        c = color_of.get(r.get("model"), "black")
        out.append(
            f'<path d="M {x:.1f} {y - 6:.1f} L {x + 6:.1f} {y:.1f} L {x:.1f} {y + 6:.1f} '
            f'L {x - 6:.1f} {y:.1f} Z" fill="{c}"/>'
            f'<text x="{x + 8:.1f}" y="{y + 4:.1f}" font-size="11" fill="{c}">{r["codec"]}</text>'
        )
    out.append("</svg>")
    print("\n".join(out))


if __name__ == "__main__":
    main()
