"""A float64 torch reference of XPress, written from the refiner's math as vLLM PR #54448 and
speculators PR #1061 state it (`qwen3_xpress.py`, `models/xpress/core.py`), not from their code.

It reads the head from checkpoint tensors by their vLLM names (torch's [out, in] layout) and
applies the mixer as vLLM's loader folds it, M = L ⊙ tril + I, u_k = Σ_j M[:, k, j] x_j: the
export's layout and the fold are checked along with the math. Shapes: N blocks, B block slots
(slot 0 the anchor), H hidden, V vocabulary.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

HEAD = "xpress_head."


def refiner_bias(hidden, previous, tensors):
    """hidden [N, B, H] (every slot), previous [N, B] token ids -> the bias [N, B, V]."""
    t = {name[len(HEAD) :]: value for name, value in tensors.items() if name.startswith(HEAD)}
    mean = hidden.mean(dim=1, keepdim=True).expand_as(hidden)
    a = torch.cat([hidden @ t["down_h.weight"].T, mean @ t["down_g.weight"].T, t["w1.weight"][previous]], dim=-1)
    x = a @ t["in_proj.weight"].T
    size = t["mix.L"].shape[-1]
    folded = t["mix.L"] * torch.tril(torch.ones(size, size, dtype=x.dtype)) + torch.eye(size, dtype=x.dtype)
    u = torch.einsum("ckj,njc->nkc", folded, x)
    y = u + (F.silu(u @ t["mlp.gate_proj.weight"].T) * (u @ t["mlp.up_proj.weight"].T)) @ t["mlp.down_proj.weight"].T
    return y @ t["w2.weight"].T


def previous_tokens(anchor, drafts):
    """The token before each slot: the anchor before slots 0 and 1 (vLLM feeds the anchor for the
    token before it), then the drafts of slots 1..B-2. anchor [N], drafts [N, B-1] -> [N, B]."""
    return torch.cat([anchor[:, None], anchor[:, None], drafts[:, :-1]], dim=1)


def refined_logits(hidden, base, anchor, drafts, tensors):
    """The logits of slots 1..B-1 [N, B-1, V], given what slots 1..B-1 hold (drafts [N, B-1])."""
    return base[:, 1:] + refiner_bias(hidden, previous_tokens(anchor, drafts), tensors)[:, 1:]


def jacobi_drafts(hidden, base, anchor, tensors, passes):
    """vLLM's greedy drafting: the backbone's argmax, then `passes` passes redrafting every slot
    at once after the previous pass's drafts. -> [N, B-1]."""
    drafts = base[:, 1:].argmax(-1)
    for _ in range(passes):
        drafts = refined_logits(hidden, base, anchor, drafts, tensors).argmax(-1)
    return drafts


def sequential_drafts(hidden, base, anchor, tensors):
    """Slot after slot: slot k's draft after the drafts before it (the later slots' content is
    irrelevant to it: zeros). -> [N, B-1]."""
    drafts = torch.zeros_like(base[:, 1:, 0], dtype=torch.long)
    for k in range(drafts.shape[1]):
        drafts[:, k] = refined_logits(hidden, base, anchor, drafts, tensors)[:, k].argmax(-1)
    return drafts


def slot_weights(label_ce, mask, loss, gamma, alpha=0.5):
    """'dflash': mask · exp(-j/γ) for the j-th draft; 'dpace': Σ_{j>=k} of the smoothed label
    probabilities' running product over the scored slots (D-PACE), from the detached CE."""
    if loss == "dflash":
        return mask * torch.exp(-torch.arange(mask.shape[-1], dtype=torch.float64) / gamma)
    smoothed = torch.where(mask, (1 - alpha) * torch.exp(-label_ce.detach()) + alpha, torch.ones_like(label_ce))
    reach = torch.where(mask, torch.cumprod(smoothed, -1), torch.zeros_like(label_ce))
    return torch.where(mask, reach.flip(-1).cumsum(-1).flip(-1), torch.zeros_like(label_ce))


def loss(hidden, head, labels, mask, anchor, tensors, *, rounds, backbone_weight, loss_name, gamma, target_logits=None):
    """T(teacher-forced) + 0.3 · mean over `rounds` free-running Jacobi rounds + β · T(backbone),
    T = Σ w·(label CE, or KL from softmax(target_logits [N, B-1, V])). hidden [N, B, H], head
    [H, V], labels and mask [N, B-1], anchor [N]."""
    base = hidden @ head

    def term(logits):
        log_q = F.log_softmax(logits, dim=-1)
        label_ce = -log_q.gather(-1, labels[..., None])[..., 0]
        value = label_ce
        if target_logits is not None:
            log_p = F.log_softmax(target_logits, dim=-1)
            value = (log_p.exp() * (log_p - log_q)).sum(-1)
        return (slot_weights(label_ce, mask, loss_name, gamma) * value).sum()

    total = term(refined_logits(hidden, base, anchor, labels, tensors))
    drafts, consistency = base[:, 1:].detach().argmax(-1), 0.0
    for _ in range(rounds):
        logits = refined_logits(hidden, base, anchor, drafts, tensors)
        consistency = consistency + term(logits)
        drafts = logits.detach().argmax(-1)
    return total + 0.3 * consistency / rounds + backbone_weight * term(base[:, 1:])
