"""The contract's named constants (CONTRACT.md), in one place for every backend and the core.

Any change here is an arithmetic change: CONTRACT.md, the Metal and CUDA sources and the C
reference change with it, and CONTRACT_VERSION goes up.
"""
CONTRACT_VERSION = 1

ATTN_BLOCK = 64       # keys per online-softmax block in the attention forward (§6.6)
XENT_CHUNK = 1024     # vocabulary entries per chunk of the fused cross-entropy (§6.8)
NORM_BLOCK = 4096     # elements per sequential block of a sum of squares (§7)
CLIP_EPS = 1e-6       # added to the norm before the clip division (§7)
INIT_SIGMA = 0.02     # truncated normal: mu = 0, sigma = 0.02, cut at +-2 sigma (§5)
INIT_CUT = 2.0

# The int8 quantized linear layer (§6.9) and its simulated int6 / int4 paths
QMAX = 127            # int8 levels -127 ... 127
QMAX6 = 31            # the simulated int6 path: levels -31 ... 31 in int8 containers
QMAX4 = 7             # the simulated int4 path: levels -7 ... 7 in int8 containers
QW_COEF = float.fromhex("0x1.6b7612p-3")     # 2/sqrt(127) in fp32: the weight step sizes' factor
QW_COEF6 = float.fromhex("0x1.6fd4e8p-2")    # 2/sqrt(31) in fp32
QW_COEF4 = float.fromhex("0x1.83091ep-1")    # 2/sqrt(7) in fp32
QB = 128              # Walsh-Hadamard block
INV_QB = 2.0 ** -7    # its normalization, 1/QB
#: The longest int8 contraction (after padding to a multiple of QB): |sum of products| <=
#: Q_MAX_P * 127^2 < 2^31, so int32 accumulation is exact.
Q_MAX_P = 1 << 17

# Philox streams (§5): the third counter word. What each serves is fixed here.
STREAM_INIT = 1       # parameter initialization; index = element offset in the parameter buffer
STREAM_DATA_MIX = 2   # data stream: which source the next document comes from
STREAM_DATA_SHARDS = 3  # data stream: shard order per (source, epoch)
STREAM_DATA_DOCS = 4  # data stream: document order within a shard
STREAM_MATH_TEXT = 5  # the generated math corpus
STREAM_SAMPLE = 6     # sampled generation (open1b generate); index = the generated token's number
STREAM_TESTS = 0xFFFF  # random inputs of tests and the parity harness
