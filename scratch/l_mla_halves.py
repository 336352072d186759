"""GPU (session l): the Triton decode kernel with c_kv as two 256-column tiles (HALVES). Local sm_90 SASS of the
16-row tile loop: the default's score dot is two 36-step HMMA chains one after the other (a 72-deep dependent
chain, 255 registers); HALVES gives four interleaved chains of 16-20 steps at 184 registers."""
import json, os
from lmkernels.ops.mla import gpu_tune as G, kernels
G.SHRINK = 1
d16 = dict(kernels.decode_config(16), WS=False)
h16 = dict(d16, HALVES=True)
c16 = [d16, h16, dict(h16, KEYS_MAJOR=False), dict(h16, PROGRAMS_PER_SM=2), dict(h16, BLOCK_N=64, num_stages=3),
       dict(kernels.decode_config(16, False, 8192, 32)), d16]
G.ab("16 rows", [(128, 1024, 16, 1), (32, 1024, 16, 1), (1, 32768, 16, 1), (1, 8192, 16, 1), (32, 8192, 16, 1),
                 (128, 8192, 16, 1)], c16, 330)
d32 = kernels.decode_config(32)
t32 = dict(d32, WS=False)
h32 = dict(t32, HALVES=True)
c32 = [d32, t32, h32, dict(h32, PROGRAMS_PER_SM=1), dict(h32, KEYS_MAJOR=False), dict(h32, TMA=False, num_stages=5)]
G.ab("32 rows", [(32, 8192, 16, 2), (128, 8192, 16, 2), (32, 1024, 16, 2)], c32, 520)
G.table()
json.dump(G.OUT, open(os.path.join(os.environ.get("OUT", "/tmp"), "l_mla_halves.json"), "w"), indent=1)
