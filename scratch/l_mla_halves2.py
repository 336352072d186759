"""GPU (session l, call 2): HALVES rows-major around the 16-row default (stages, tile, warps), on long contexts
against the Gluon kernel, and 16 × 2 MTP as two 16-row blocks (1 or 2 programs per SM) against the Gluon kernel."""
import json, os
from lmkernels.ops.mla import gpu_tune as G, kernels
G.SHRINK = 1
d16 = dict(kernels.decode_config(16), WS=False)
h = dict(d16, HALVES=True, KEYS_MAJOR=False)
ws16 = kernels.decode_config(16, False, 8192, 32)
c16 = [d16, h, dict(h, num_stages=4), dict(h, num_stages=6), dict(h, BLOCK_N=64, num_stages=3), dict(h, num_warps=2),
       dict(h, num_warps=8), ws16]
G.ab("16 rows", [(128, 1024, 16, 1), (32, 1024, 16, 1), (32, 8192, 16, 1), (32, 32768, 16, 1), (128, 8192, 16, 1)],
     c16, 300)
d32 = dict(kernels.decode_config(32), PROGRAMS_PER_SM=1)  # the Gluon kernel with its real split count
c32 = [d32, dict(h, PROGRAMS_PER_SM=1), dict(h, PROGRAMS_PER_SM=2), dict(h, PROGRAMS_PER_SM=2, FUSED_MERGE=False), d32]
G.ab("32 rows", [(32, 8192, 16, 2), (128, 8192, 16, 2), (32, 1024, 16, 2)], c32, 500)
G.table()
json.dump(G.OUT, open(os.path.join(os.environ.get("OUT", "/tmp"), "l_mla_halves2.json"), "w"), indent=1)
