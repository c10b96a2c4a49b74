"""The Metal backend (DESIGN.md §4): kernel sources `*.metal` (contract.metal is the header of
every kernel), their binding (`runtime`: mx.fast.metal_kernel on a Mac, the emulator `emu`
elsewhere) and the op module `ops` with cpu_ref's interface. Import `mlx_open1b.metal.ops`."""
