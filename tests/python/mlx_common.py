"""What the mlx-lm interop tests share: running mtpx, mlx-lm's float32 logits, and the skip when MLX is absent.

Importing this module exits with code 77 (ctest: skipped) when mlx / mlx-lm are not installed.
"""
import subprocess
import sys

try:
    import mlx.core as mx
    import numpy as np
    from mlx.utils import tree_map
    from mlx_lm import load
except ImportError as e:  # pragma: no cover
    print(f"skipped: {e}")
    sys.exit(77)


def mtpx(binary, *args):
    """Runs the mtpx program; its stdout, or AssertionError with its stderr when it fails."""
    r = subprocess.run([binary, *args], capture_output=True, text=True)
    if r.returncode != 0:
        raise AssertionError(f"mtpx {' '.join(args)} failed ({r.returncode}): {r.stderr}")
    return r.stdout


def mlx_logits(path, ids):
    """mlx-lm's logits [n, V] for the token ids, with its bf16 parameters widened to float32."""
    model, _ = load(str(path))
    model.update(tree_map(lambda x: x.astype(mx.float32) if x.dtype == mx.bfloat16 else x, model.parameters()))
    return np.array(model(mx.array([ids]))[0].astype(mx.float32))
