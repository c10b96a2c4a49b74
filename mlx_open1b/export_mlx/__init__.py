"""Model code an `open1b export --format mlx` directory ships (model.py: Open-1B in `mlx.nn`, loaded without mlx-open1b)."""
