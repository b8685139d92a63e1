"""Autocast for fused projections: under ``torch.autocast`` a kernel whose logits are a product
(``h @ w.T``) takes its projection's operands in autocast's dtype, as ``F.linear`` would, so the
GEMM runs at the precision (and speed) the user asked for; the row math after it (softmax,
logsumexp, the losses) is computed in float32 inside the kernel either way. The casts are
differentiable: a float32 weight gets a float32 gradient, as under autocast.
"""

from __future__ import annotations

import torch

#: the names rtxdsl's loss kernels give a projection's operands: the hidden states, weight and bias
#: (``h, w, b``), a reference model's (``ref_``), a student's and a teacher's (``hs, ws, bs`` / ``ht, wt, bt``)
PROJECTION = frozenset({"h", "w", "b", "ref_h", "ref_w", "ref_b", "hs", "ws", "bs", "ht", "wt", "bt"})


def autocast_projection(ins: dict[str, torch.Tensor], names: frozenset[str] = PROJECTION) -> dict[str, torch.Tensor]:
    """``ins`` with the tensors named in ``names`` cast to autocast's dtype when autocast is on for
    their device (floating tensors other than float64, which autocast leaves alone too).

    Example:
        >>> import torch
        >>> from rtxdsl.nn.amp import autocast_projection
        >>> with torch.autocast("cpu", dtype=torch.bfloat16):
        ...     got = autocast_projection({"h": torch.ones(2, 3), "t": torch.zeros(2)}, frozenset({"h"}))
        >>> got["h"].dtype, got["t"].dtype
        (torch.bfloat16, torch.float32)
    """
    first = next(iter(ins.values()))
    kind = first.device.type
    if not torch.is_autocast_enabled(kind):
        return ins
    dtype = torch.get_autocast_dtype(kind)
    cast = {
        n: t.to(dtype)
        for n, t in ins.items()
        if n in names and t.is_floating_point() and t.dtype not in (dtype, torch.float64)
    }
    return ins | cast
