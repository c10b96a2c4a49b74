"""The Metal backend (DESIGN.md §4): kernel sources `*.metal` (contract.metal is the header of
every kernel), their binding (`runtime`: mx.fast.metal_kernel on a Mac, the emulator `emu`
elsewhere) and the op module `ops`, a backend of mlx_open1b/backend.py. Import `mlx_open1b.metal.ops`."""
