"""Float64 references for the drafter kinds, in torch (autograd gives the reference gradients).

Each is the behaviour of the projects' own code, re-expressed here in plain loops:

* z-lab `dflash/model.py` (`_grouped_dynamic_convolve`, `CandidateSelector.select`) and vLLM
  `qwen3_dflash2.py`: the grouped dynamic convolution and the greedy / sampled selector walk;
* vLLM speculators `models/dflash2/metrics.py` (`selector_training_candidates`,
  `compute_selector_loss`): DFlash2's training loss;
* DeepSeek DeepSpec `modeling/dspark/` (`loss.py`, `markov_head.py`, `eval/dspark/draft_ops.py`):
  DSpark's loss, its Markov walk and the confidence truncation.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def grouped_dynamic_conv(x, delta, base, group_size):
    """x [B, L, H], delta [B, L, K, G], base [K, H]: tap o multiplies x[t - o] (zero before the
    block) by base[o] plus the group's dynamic coefficient at t."""
    batch, length, hidden = x.shape
    groups = hidden // group_size
    grouped = x.reshape(batch, length, groups, group_size)
    out = torch.zeros_like(grouped)
    for o in range(base.shape[0]):
        if o:
            grouped_o = torch.cat([torch.zeros_like(grouped[:, :o]), grouped[:, :-o]], dim=1)
        else:
            grouped_o = grouped
        out = out + base[o].reshape(1, 1, groups, group_size) * grouped_o + delta[:, :, o, :, None] * grouped_o
    return out.reshape(batch, length, hidden)


def decay_weights(mask, gamma):
    """mask [..., K] -> mask · exp(-j / γ) for the j-th draft."""
    return mask * torch.exp(-torch.arange(mask.shape[-1], dtype=torch.float64) / gamma)


def dflash2_loss(hidden, head, labels, mask, anchor, codebooks, projection, *, top_k, alpha, gamma, target_logits=None):
    """Σ w·(unary loss + α·candidate CE) over slots; hidden [N, K, D], head [D, V], labels and
    mask [N, K], anchor [N], codebooks (A, B) [V, r], projection [D, r]. The unary loss is the
    label's CE, or the KL from softmax(target_logits [N, K, V])."""
    predecessor, successor = codebooks
    unary = hidden @ head
    log_q = F.log_softmax(unary, dim=-1)
    label_ce = -log_q.gather(-1, labels[..., None])[..., 0]
    unary_loss = label_ce
    if target_logits is not None:
        log_p = F.log_softmax(target_logits, dim=-1)
        unary_loss = (log_p.exp() * (log_p - log_q)).sum(-1)
    previous = torch.cat([anchor[:, None], labels[:, :-1]], dim=1)
    total = hidden.new_zeros(())
    for n in range(hidden.shape[0]):
        for k in range(hidden.shape[1]):
            candidates = torch.topk(unary[n, k].detach(), top_k).indices.clone()
            where = (candidates == labels[n, k]).nonzero()
            gold = int(where[0, 0]) if len(where) else top_k - 1
            candidates[top_k - 1] = candidates[top_k - 1] if len(where) else labels[n, k]
            context = predecessor[previous[n, k]] * (hidden[n, k] @ projection)
            scores = unary[n, k, candidates] + successor[candidates] @ context
            candidate_ce = torch.logsumexp(scores, 0) - scores[gold]
            weight = float(mask[n, k]) * math.exp(-k / gamma)
            total = total + weight * (unary_loss[n, k] + alpha * candidate_ce)
    return total


def selector_walk(unary, hidden, anchor, codebooks, projection, *, top_k):
    """Greedy DFlash2 drafts of one block: unary [K, V], hidden [K, D] -> token ids [K]."""
    predecessor, successor = codebooks
    previous, drafts = int(anchor), []
    for k in range(unary.shape[0]):
        values, candidates = torch.topk(unary[k], top_k)
        scores = values + successor[candidates] @ (predecessor[previous] * (hidden[k] @ projection))
        previous = int(candidates[torch.argmax(scores)])
        drafts.append(previous)
    return drafts


def dspark_loss(hidden, head, labels, mask, anchor, markov, confidence, target_logits, *, gamma=4.0):
    """DeepSpec's loss, summed over slots: Σ w·(0.1·CE + 0.9·L1 + BCE) with w = mask·exp(-k/γ).
    hidden [N, K, D], labels and mask [N, K] (mask already a prefix), markov (W1 [V, r], W2
    [r, V]), confidence (weight [D + r], bias []), target_logits [N, K, V]."""
    w1, w2 = markov
    labels = labels.long()
    previous = torch.cat([anchor[:, None].long(), labels[:, :-1]], dim=1)
    embedding = w1[previous]
    logits = hidden @ head + embedding @ w2
    ce = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none").view(labels.shape)
    q, p = torch.softmax(logits, -1), torch.softmax(target_logits, -1)
    l1 = (q - p).abs().sum(-1)
    accept = (1.0 - 0.5 * l1).clamp(0.0, 1.0).detach()
    weight_vector, bias = confidence
    confidence_logits = torch.cat([hidden, embedding], -1) @ weight_vector + bias
    bce = F.binary_cross_entropy_with_logits(confidence_logits, accept, reduction="none")
    return (decay_weights(mask, gamma) * (0.1 * ce + 0.9 * l1 + bce)).sum()


def markov_walk(unary, hidden, anchor, markov, confidence, *, threshold=0.0):
    """Greedy DSpark drafts of one block: unary [γ, V], hidden [γ, D] -> (drafts [γ], how many
    are proposed: all, or those before the first confidence below the threshold)."""
    w1, w2 = markov
    weight_vector, bias = confidence
    previous, drafts, proposed = int(anchor), [], None
    for k in range(unary.shape[0]):
        embedding = w1[previous]
        token = int(torch.argmax(unary[k] + embedding @ w2))
        c = torch.sigmoid(torch.cat([hidden[k], embedding]) @ weight_vector + bias)
        if proposed is None and threshold > 0 and c < threshold:
            proposed = k
        drafts.append(token)
        previous = token
    return drafts, (len(drafts) if proposed is None else proposed)
