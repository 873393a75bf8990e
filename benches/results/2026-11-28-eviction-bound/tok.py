"""Minimal GGUF byte-level BPE tokenizer (SmolLM2: Digits(individual) + GPT-2 split), pure Python."""
import re, struct, functools

def read_gguf_meta(path, keys):
    out = {}
    with open(path, 'rb') as f:
        assert f.read(4) == b'GGUF'
        ver, = struct.unpack('<I', f.read(4))
        nt, nkv = struct.unpack('<QQ', f.read(16))
        def rstr():
            n, = struct.unpack('<Q', f.read(8)); return f.read(n).decode('utf-8', 'replace')
        fmt = {0:'<B',1:'<b',2:'<H',3:'<h',4:'<I',5:'<i',6:'<f',7:'<?',10:'<Q',11:'<q',12:'<d'}
        def rval(t):
            if t == 8: return rstr()
            if t == 9:
                it, = struct.unpack('<I', f.read(4)); n, = struct.unpack('<Q', f.read(8))
                if it in fmt:
                    sz = struct.calcsize(fmt[it]); data = f.read(sz*n)
                    return list(struct.unpack('<%d%s' % (n, fmt[it][1]), data))
                return [rval(it) for _ in range(n)]
            s = struct.calcsize(fmt[t]); return struct.unpack(fmt[t], f.read(s))[0]
        for _ in range(nkv):
            k = rstr(); t, = struct.unpack('<I', f.read(4)); v = rval(t)
            if k in keys: out[k] = v
    return out

def bytes_to_unicode():
    bs = list(range(ord('!'), ord('~')+1)) + list(range(ord('¡'), ord('¬')+1)) + list(range(ord('®'), ord('ÿ')+1))
    cs = bs[:]; n = 0
    for b in range(256):
        if b not in bs: bs.append(b); cs.append(256+n); n += 1
    return dict(zip(bs, map(chr, cs)))

class Tok:
    def __init__(self, path):
        m = read_gguf_meta(path, {'tokenizer.ggml.tokens','tokenizer.ggml.merges','tokenizer.ggml.token_type','tokenizer.ggml.pre','tokenizer.chat_template','context_length','llama.context_length'})
        self.meta = {k: v for k, v in m.items() if k not in ('tokenizer.ggml.tokens','tokenizer.ggml.merges','tokenizer.ggml.token_type')}
        toks = m['tokenizer.ggml.tokens']; types = m['tokenizer.ggml.token_type']
        self.vocab = {t: i for i, t in enumerate(toks)}
        self.ranks = {tuple(s.split(' ', 1)): i for i, s in enumerate(m['tokenizer.ggml.merges'])}
        self.special = [t for t, ty in zip(toks, types) if ty in (3, 4)]
        self.sre = re.compile('(' + '|'.join(re.escape(s) for s in sorted(self.special, key=len, reverse=True)) + ')')
        self.b2u = bytes_to_unicode()
        self.pat = re.compile(r"""'s|'t|'re|'ve|'m|'ll|'d| ?[^\W\d_]+| ?\d+| ?[^\s\w]+|\s+(?!\S)|\s+|_+""")
    @functools.lru_cache(maxsize=None)
    def bpe(self, word):
        parts = list(word)
        while len(parts) > 1:
            best = None
            for i in range(len(parts)-1):
                r = self.ranks.get((parts[i], parts[i+1]))
                if r is not None and (best is None or r < best[0]): best = (r, i)
            if best is None: break
            i = best[1]; parts = parts[:i] + [parts[i]+parts[i+1]] + parts[i+2:]
        return tuple(parts)
    def encode(self, text):
        ids = []
        for chunk in self.sre.split(text):
            if not chunk: continue
            if chunk in self.vocab and chunk in self.special:
                ids.append(self.vocab[chunk]); continue
            for piece in re.split(r'(\d)', chunk):   # Digits(individual), isolated
                if not piece: continue
                for w in self.pat.findall(piece):
                    u = ''.join(self.b2u[b] for b in w.encode('utf-8'))
                    ids.extend(self.vocab[p] for p in self.bpe(u))
        return ids
