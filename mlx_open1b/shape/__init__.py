"""A shape-only backend and the memory model built on it (benchmarks/memory_model.py).

Arrays carry shape and dtype and no values (array.py); the CUDA backend's op code runs on them with
launches that do nothing (ops.py, loaded as backend "shape"), so every buffer a CUDA run allocates is
allocated here, recorded in a per-worker ledger (ledger.py) and nothing is computed. The trainers
run on it unchanged: one process (Trainer / take_step) or W workers simulated as threads of one
process whose collectives move nothing and record their buffers (comm.py). run.py builds the
trainers on it and measures a step of every batch phase.
"""
