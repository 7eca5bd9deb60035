"""Per-row cross-entropy and KL of ``softmax(states @ weight.T)`` for a frozen ``weight``, chunked over rows.

The shared lm_head projects K*n head states onto V = 49K tokens for SmolLM2: materialising those [K*n, V] logits in
fp32, their log-softmax and their zero-filled gradients costs several times the matmul itself on a CPU (memory traffic
and page faults of multi-GB buffers). Here each chunk of rows is projected, scored and turned into its input gradient
``(softmax - target distribution) @ weight`` at once, so only a [chunk, V] buffer ever exists and gets reused.

Numerics match the unfused path: logits in the weight's dtype, softmax math in fp32, gradients cast back before the
matmul with ``weight``. ``weight`` gets no gradient (it is the backbone's frozen lm_head).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# rows projected at once on a CPU: [512, V] fp32 buffers (16 MB at the 8,192-token draft vocabulary, 100 MB at all
# 49,152). Fewer rows make the GEMMs small and slow; more make the buffers large: 512 was the fastest chunk at the
# draft vocabulary in a timing of 128 to 1,024 rows (docs/benchmarks.md, "Figures moved from the code")
CHUNK_ROWS = 512
DEVICE_CHUNK_ROWS = 2048  # on an accelerator: [2048, 49152] fp32 = 400 MB, few enough kernel launches per step


def chunk_rows(device: torch.device) -> int:
    """Rows projected at once: small on the CPU (a reused buffer), large on an accelerator (few launches)."""
    return CHUNK_ROWS if device.type == "cpu" else DEVICE_CHUNK_ROWS


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, states, weight, targets, teacher, rows, with_grad: bool):
        """states [N, H]; weight [V, H]; targets [N]; teacher [M, V] fp32 log-probs or None; rows [N] or None.

        Returns ce [N] fp32, kl [N] fp32 (zeros without a teacher), hit [N] bool (the target is a top-1 token).
        """
        num_rows, device = states.shape[0], states.device
        ce = torch.empty(num_rows, dtype=torch.float32, device=device)
        kl = torch.zeros(num_rows, dtype=torch.float32, device=device)
        hit = torch.empty(num_rows, dtype=torch.bool, device=device)
        # [N, H] input gradients, filled chunk by chunk
        grad_ce = torch.empty(num_rows, states.shape[1], dtype=torch.float32, device=device) if with_grad else None
        grad_kl = torch.empty_like(grad_ce) if with_grad and teacher is not None else None  # [N, H]
        chunk = chunk_rows(device)
        for i in range(0, num_rows, chunk):
            j = min(i + chunk, num_rows)
            rows_in = states[i:j]
            if device.type == "cpu" and j - i < chunk:  # a tail of a new length would cost a GEMM kernel build
                rows_in = F.pad(rows_in, (0, 0, 0, chunk - (j - i)))  # (dearer than the padded rows): same shape
            z = (rows_in @ weight.T)[: j - i].float()  # [c, V]
            target = targets[i:j, None]  # [c, 1]
            hit[i:j] = (z.gather(1, target) >= z.amax(-1, keepdim=True)).squeeze(1)  # target is a top-1 token
            log_q = F.log_softmax(z, dim=-1)  # [c, V]
            ce[i:j] = -log_q.gather(1, target).squeeze(1)
            if teacher is not None:
                log_p = teacher[rows[i:j]]  # [c, V]
                p = log_p.exp()
                kl[i:j] = (p * (log_p - log_q)).sum(-1)
            if with_grad:
                q = log_q.exp_()  # [c, V] softmax (log_q is spent)
                if teacher is not None:
                    grad_kl[i:j] = ((q - p).to(weight.dtype) @ weight).float()
                q.scatter_add_(1, target, torch.full(target.shape, -1.0, device=device))  # softmax - onehot
                grad_ce[i:j] = (q.to(weight.dtype) @ weight).float()
        ctx.save_for_backward(grad_ce, grad_kl)
        ctx.states_dtype = states.dtype
        ctx.mark_non_differentiable(hit)
        return ce, kl, hit

    @staticmethod
    def backward(ctx, g_ce, g_kl, _g_hit):  # g_ce, g_kl [N]
        grad_ce, grad_kl = ctx.saved_tensors
        if grad_ce is None:
            raise RuntimeError("linear_cross_entropy was called with with_grad=False; no gradient was prepared")
        grad = g_ce[:, None] * grad_ce  # [N, H]
        if grad_kl is not None:
            grad = grad + g_kl[:, None] * grad_kl
        return grad.to(ctx.states_dtype), None, None, None, None, None


def linear_cross_entropy(states: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                         teacher: torch.Tensor | None = None, rows: torch.Tensor | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """CE of ``softmax(states @ weight.T)`` against ``targets`` per row (and KL(teacher[rows] || it)).

    states [N, H]; weight [V, H] frozen; targets [N] long; teacher [M, V] fp32 log-probs; rows [N] long.
    Returns ce [N] fp32, kl [N] fp32 (zeros without a teacher), hit [N] bool (the target is a top-1 token).
    Differentiable w.r.t. states.
    """
    if weight.requires_grad:
        raise ValueError("linear_cross_entropy computes no gradient for weight: it must be frozen "
                         "(requires_grad=False)")
    if (teacher is None) != (rows is None):
        raise ValueError("pass teacher and rows together (or neither)")
    with_grad = torch.is_grad_enabled() and states.requires_grad
    return _LinearCrossEntropy.apply(states, weight, targets, teacher, rows, with_grad)
