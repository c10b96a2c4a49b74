"""The contract as executable numpy: slow, vectorized, written from CONTRACT.md alone.

An independent second implementation of every rule, used by the tests to check the C reference
(and later the Metal and CUDA sources) bit for bit, special values included. Every function
takes and returns float32 arrays (bf16 as uint16) and applies the contract's flush after each
primitive operation.
"""
