"""`python -m mlx_lm.server` with scripts/mlx_lm_compat.py applied (the
serving benchmark's peer); takes mlx_lm.server's arguments."""

import mlx_lm_compat  # noqa: F401  (patches mlx before mlx-lm loads a model)
from mlx_lm.server import main

if __name__ == "__main__":
    main()
