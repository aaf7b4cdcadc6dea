"""Review 6 of the issue-7 performance change (1df3623..8698a6d): the defects found, fixed since, as tests
(both backends of ``mla_attention`` and ``fused_moe`` reject shapes that do not fit with the same ValueError).

Triton kernels run on CPU under Triton's interpreter (TRITON_INTERPRET=1), set up as in
tests/test_triton_ops.py.
"""

from __future__ import annotations

from tests.triton_interp import harness, setup_interpreter  # noqa: E402  (imports neither torch nor triton)

_TRITON_PREIMPORTED = setup_interpreter()

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton", reason="Triton is not installed (pip install 'atomtool[serve]')")

from atomtool.serve.ops import torch_ref_mla  # noqa: E402
from tests.kernel_inputs import cu_seqlens as _cu  # noqa: E402
from tests.kernel_inputs import random_block_tables as _paged  # noqa: E402

if not _TRITON_PREIMPORTED:
    import atomtool.serve.ops.triton as tri  # noqa: E402


_interpreted_only, test_suite_in_a_fresh_process = harness(__file__, _TRITON_PREIMPORTED)


def _mla_decode_inputs(H=2, R=16, P=8, bs=16):
    """One decode row over 5 cached tokens: (q_nope_absorbed, q_pe, latent_cache, cu_seqlens_q, seq_lens,
    block_tables), float32."""
    g = torch.Generator().manual_seed(0)
    nb, bt = _paged([5], bs, gen=g)
    lat = torch.randn(nb, bs, R + P, generator=g)
    return (torch.randn(1, H, R, generator=g), torch.randn(1, H, P, generator=g), lat, _cu([1]),
            torch.tensor([5], dtype=torch.int32), bt)


@pytest.mark.parametrize("bad", ["R", "H"])
def test_reference_mla_w_uv_shape_error_matches_the_triton_backend(bad):
    """Both backends of ``mla_attention`` (same contract) reject a w_uv that is not [H, dv, R] with the same
    ValueError (the Triton op's message), as router_logits does with its shared check."""
    args = _mla_decode_inputs()
    H, R = args[0].shape[1], args[0].shape[2]
    w_uv = torch.randn(H, 12, R + 1) if bad == "R" else torch.randn(H + 1, 12, R)
    with pytest.raises(ValueError, match=r"w_uv .* must be \[H=2, dv, R=16\]"):
        tri.mla_attention(*args, 0.3, w_uv=w_uv)  # the Triton op: the documented error
    with pytest.raises(ValueError, match=r"w_uv .* must be \[H=2, dv, R=16\]"):
        torch_ref_mla.mla_attention(*args, 0.3, w_uv=w_uv)


def test_fused_moe_rejects_topk_shapes_that_do_not_fit():
    """fused_moe's docstring: "Raises ValueError for shapes that do not fit". topk_weights [1, 2] with
    topk_ids [1, 3] (k = 3) must raise, not read a third weight past the buffer (on a GPU: out of bounds)."""
    g = torch.Generator().manual_seed(1)
    H, inter, E = 32, 24, 4
    x = torch.randn(1, H, generator=g)
    w13 = torch.randn(E, 2 * inter, H, generator=g) * 0.2
    w2 = torch.randn(E, H, inter, generator=g) * 0.2
    ids = torch.tensor([[0, 1, 2]])
    tw = torch.rand(1, 8, generator=g)[:, :2]  # view of a larger buffer: the over-read stays in owned memory
    for impl in (tri.fused_moe, torch_ref_mla.fused_moe):
        with pytest.raises(ValueError, match=r"fused_moe: topk_weights \(1, 2\) and topk_ids \(1, 3\) must both be"
                                             r" \[T=1, k\]"):
            impl(x, w13, w2, tw, ids)
