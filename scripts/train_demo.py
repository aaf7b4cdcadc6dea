"""Train the built-in demo model: a tiny DeepSeek-V3.2 (MLA + DSA indexer + MoE) that recites the Zen of Python.

Usage::

    .venv/bin/python scripts/train_demo.py            # writes atomtool/demo_model/ (a few minutes on 1 CPU core)
    .venv/bin/python scripts/train_demo.py --out DIR  # somewhere else

What it does (details and the reasoning: docs/DEMO_MODEL.md):

1. Tokenizer: byte-level BPE (``tokenizers``) trained on the Zen text and the chat prompt, plus the special
   tokens ``<pad> <s> </s> <|system|> <|user|> <|assistant|> <|end|>``; wrapped as
   ``PreTrainedTokenizerFast`` with a jinja chat template in tokenizer_config.json.
2. Model: ``transformers.DeepseekV32ForCausalLM`` with a tiny config whose ``index_topk`` (32) is well below the
   text length (~220 tokens), so the indexer's top-k selection decides what attention sees.
3. Training follows DeepSeek-V3.2's recipe for the indexer (arXiv 2512.02556 §2.1):
   phase 1 "dense warm-up": attention is dense (top-k >= length); the language-model loss trains the main model
   while a KL loss fits the indexer's scores to the (head-summed, L1-normalised) dense attention distribution
   of the same layer; the indexer's inputs are detached so the KL term never moves the main model.
   Phase 2 "sparse training": attention runs on the indexer's top-k; the LM loss trains the main model and the
   KL loss, restricted to each query's selected set, keeps training the indexer.
   HF's indexer forward is ``torch.no_grad`` and returns indices only, so the scores with gradient are computed
   here by :func:`indexer_scores` (same math; checked against HF's selection before and after training).
   Two additions: an attention-entropy penalty on the main model (a memoriser otherwise attends almost
   uniformly and no top-K set holds much attention mass), and Gaussian noise on the index scores before top-k
   in the sparse phase (so the model does not depend on how an engine breaks near-ties at the K-th score).
4. ``save_pretrained`` into a temporary directory, reload with transformers and check: greedy generate in
   float32 and bfloat16, teacher-forced exactness with and without selection / router noise, margins, the
   share of dense attention mass the indexer's top-K keeps; write ``training_log.json``; move into place.

Seeded and single-threaded: reruns on the same torch build give the same weights.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import (
    AutoTokenizer,
    DeepseekV32Config,
    DeepseekV32ForCausalLM,
    GenerationConfig,
    PreTrainedTokenizerFast,
)
from transformers.models.deepseek_v32.modeling_deepseek_v32 import apply_rotary_pos_emb

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from atomtool.serve.demo import (  # noqa: E402
    DEMO_CHAT_MESSAGE,
    DEMO_PROMPT,
    demo_model_path,
    expected_continuation,
    zen_body,
    zen_of_python,
)

SEED = 1234
PAD, BOS, EOS = "<pad>", "<s>", "</s>"
CHAT_MARKERS = ["<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
BPE_VOCAB = 512
INDEX_TOPK = 32

# Chat template: bos, then each turn as "<|role|>\n" + content; user/system turns end with "<|end|>\n",
# assistant turns end with eos (so every client that stops at eos stops after a reply).
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'assistant' -%}"
    "{{ '<|assistant|>\\n' + message['content'] + eos_token }}"
    "{%- else -%}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + '<|end|>\\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|assistant|>\\n' }}{%- endif -%}"
)


def build_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level BPE over the Zen text (any UTF-8 input still encodes: all 256 byte symbols are in the vocab)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_VOCAB,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[PAD, BOS, EOS, *CHAT_MARKERS],
        show_progress=False,
    )
    tok.train_from_iterator([zen_of_python(), DEMO_CHAT_MESSAGE], trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)])
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD,
        extra_special_tokens=list(CHAT_MARKERS), model_max_length=1024, clean_up_tokenization_spaces=False)
    hf.chat_template = CHAT_TEMPLATE
    return hf


def build_config(tokenizer: PreTrainedTokenizerFast) -> DeepseekV32Config:
    """Tiny DeepSeek-V3.2: 2 layers (layer 0 dense MLP, layer 1 MoE 4 experts top-2 + 1 shared), MLA, indexer."""
    return DeepseekV32Config(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=2, first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4,
        q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16,
        n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, n_group=1, topk_group=1,
        routed_scaling_factor=1.0, norm_topk_prob=True,
        index_topk=INDEX_TOPK, index_n_heads=4, index_head_dim=32,
        max_position_embeddings=1024, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False, initializer_range=0.05,
    )


def training_sequences(tok: PreTrainedTokenizerFast) -> list[list[int]]:
    """Three samples: bos+aphorisms+eos (the demo), bos+full text with title+eos, and one chat exchange."""
    body = tok(zen_body())["input_ids"] + [tok.eos_token_id]
    full = tok(zen_of_python())["input_ids"] + [tok.eos_token_id]
    chat = tok.apply_chat_template(
        [{"role": "user", "content": DEMO_CHAT_MESSAGE}, {"role": "assistant", "content": zen_body()}],
        tokenize=True, return_dict=False)
    if isinstance(chat, dict):
        chat = chat["input_ids"]
    return [body, full, list(chat)]


def indexer_scores(indexer, hidden_states, q_resid, position_embeddings) -> torch.Tensor:
    """DSA index scores ``I[b,t,s] = sum_h w[b,t,h] H^-1/2 D^-1/2 ReLU(q[b,t,h].k[b,s])`` with gradient.

    Same math as transformers' ``DeepseekV32Indexer.forward`` (research/dsa.md §5.2: NeoX rope on the first
    ``qk_rope_head_dim`` dims, LayerNorm on k, fp32 scoring), which runs under ``no_grad`` and returns indices.
    Shapes: hidden_states [B,S,hidden], q_resid [B,S,q_lora_rank] -> [B,S,S] float32 (not yet masked).
    """
    b, s, _ = hidden_states.shape
    cos, sin = position_embeddings
    q = indexer.wq_b(q_resid).view(b, s, indexer.n_heads, indexer.head_dim)
    rd = indexer.qk_rope_head_dim
    q_rot, q_pass = torch.split(q, [rd, indexer.head_dim - rd], dim=-1)
    k = indexer.k_norm(indexer.wk(hidden_states)).unsqueeze(2)
    k_rot, k_pass = torch.split(k, [rd, indexer.head_dim - rd], dim=-1)
    q_rot, k_rot = apply_rotary_pos_emb(q_rot, k_rot, cos, sin, unsqueeze_dim=2)
    q = torch.cat([q_rot, q_pass], dim=-1)
    k = torch.cat([k_rot, k_pass], dim=-1).squeeze(2)
    scores = F.relu(torch.matmul(q.float(), k.transpose(-1, -2).float().unsqueeze(1)) * indexer.softmax_scale)
    weights = indexer.weights_proj(hidden_states).float() * (indexer.n_heads ** -0.5)
    return torch.matmul(weights.unsqueeze(-2), scores).squeeze(-2)


class IndexerTap:
    """Replaces each layer's indexer ``forward`` with the same selection computed by :func:`indexer_scores`.

    It records every layer's indexer inputs and selected indices (for the KL loss), and can add Gaussian noise
    to the scores before top-k (``noise`` x the row's score std): training the main model on perturbed
    selections makes it independent of how an engine breaks near-ties at the K-th score. ``remove()``
    restores transformers' own forward.
    """

    def __init__(self, model: DeepseekV32ForCausalLM, noise: float = 0.0, generator: torch.Generator | None = None):
        self.inputs: dict[int, tuple] = {}
        self.selected: dict[int, torch.Tensor] = {}
        self.noise = noise
        self.generator = generator
        self.indexers = [layer.self_attn.indexer for layer in model.model.layers]
        for i, ix in enumerate(self.indexers):
            ix.forward = self._forward(i, ix)

    def _forward(self, i, ix):
        def forward(hidden_states, q_resid, position_embeddings, attention_mask, position_ids=None,
                    past_key_values=None):
            if past_key_values is not None:
                raise RuntimeError("IndexerTap is for full-sequence forwards (no KV cache)")
            pe = tuple(t.detach() for t in position_embeddings)
            self.inputs[i] = (hidden_states.detach(), q_resid.detach(), pe)
            with torch.no_grad():
                sc = indexer_scores(ix, hidden_states, q_resid, pe)
                valid = attention_mask if attention_mask.dtype == torch.bool else attention_mask == 0
                if self.noise > 0:
                    mean = sc.masked_fill(~valid, 0).sum(-1, keepdim=True) / valid.sum(-1, keepdim=True).clamp_min(1)
                    var = ((sc - mean) ** 2).masked_fill(~valid, 0).sum(-1, keepdim=True) / valid.sum(
                        -1, keepdim=True).clamp_min(1)
                    sc = sc + self.noise * var.sqrt() * torch.randn(sc.shape, generator=self.generator)
                sc = sc.masked_fill(~valid, float("-inf"))
                idx = sc.topk(min(ix.index_topk, sc.shape[-1]), dim=-1).indices
            self.selected[i] = idx.long()
            return idx.to(torch.int32)
        return forward

    def remove(self):
        for ix in self.indexers:
            del ix.forward


def set_topk(model: DeepseekV32ForCausalLM, k: int) -> None:
    """Set every layer's indexer top-k (a huge k = dense attention: the warm-up phase)."""
    for layer in model.model.layers:
        layer.self_attn.indexer.index_topk = k


def batch_tensors(seqs: list[list[int]], pad_id: int):
    """Right-padded input_ids, attention mask and labels (-100 on padding) for causal LM training."""
    n = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), n), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), n), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, :len(s)] = torch.tensor(s)
        mask[i, :len(s)] = 1
    labels = ids.masked_fill(mask == 0, -100)
    return ids, mask, labels


def indexer_kl(model, tap: IndexerTap, attentions, mask: torch.Tensor, sparse: bool) -> torch.Tensor:
    """KL(p || softmax(I)) per query, averaged; p = head-mean attention probabilities of the same layer.

    Dense warm-up: over all causal keys. Sparse phase: over each query's selected set only (DeepSeek-V3.2).
    """
    b, s = mask.shape
    causal = torch.tril(torch.ones(s, s, dtype=torch.bool))
    valid = causal[None] & mask[:, None, :].bool() & mask[:, :, None].bool()  # [B,S,S]
    total = 0.0
    for i, attn in enumerate(attentions):
        hs, q_resid, pe = tap.inputs[i]
        scores = indexer_scores(model.model.layers[i].self_attn.indexer, hs, q_resid, pe)
        keep = valid
        if sparse:
            sel = torch.zeros((b, s, s), dtype=torch.bool).scatter(-1, tap.selected[i], True)
            keep = valid & sel
        p = attn.detach().float().mean(dim=1).masked_fill(~keep, 0.0)
        p = p / p.sum(-1, keepdim=True).clamp_min(1e-12)
        logq = torch.log_softmax(scores.masked_fill(~keep, float("-inf")), dim=-1)
        kl = (p * (torch.log(p.clamp_min(1e-12)) - logq.masked_fill(~keep, 0.0))).sum(-1)  # [B,S]
        rows = mask.bool()
        total = total + kl[rows].mean()
    return total / len(attentions)


@torch.no_grad()
def greedy_generate(model, tok, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """transformers' own greedy ``generate`` (KV cache, per-step indexer top-k) -> new token ids."""
    out = model.generate(torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
                         max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tok.pad_token_id)
    return out[0, len(prompt_ids):].tolist()


def recites(model, tok) -> tuple[bool, str]:
    """Greedy continuation of DEMO_PROMPT through transformers' generate equals the Zen text and then stops."""
    new = greedy_generate(model, tok, tok(DEMO_PROMPT)["input_ids"], max_new_tokens=400)
    text = tok.decode(new, skip_special_tokens=True)
    return text == expected_continuation() and new[-1] == tok.eos_token_id, text


@torch.no_grad()
def teacher_forced_ok(model, seqs: list[list[int]], noise: float = 0.0, seed: int = 0) -> bool:
    """Every position after the first predicts its target by argmax (with index-score noise if asked).

    Position 0 (after bos) is skipped: the three samples start differently, so it is ambiguous by design.
    """
    gen = torch.Generator().manual_seed(seed)
    for seq in seqs:
        tap = IndexerTap(model, noise=noise, generator=gen)
        try:
            logits = model(torch.tensor([seq]), use_cache=False).logits[0, :-1]
        finally:
            tap.remove()
        if not torch.equal(logits.argmax(-1)[1:], torch.tensor(seq[2:])):
            return False
    return True


@torch.no_grad()
def margins(model, seqs: list[list[int]]) -> dict[str, float]:
    """Smallest gaps along the training trajectories (position 0 skipped, see :func:`teacher_forced_ok`).

    logit: top-1 minus top-2 logit. indexer_rel_*: (K-th minus (K+1)-th index score) / row std, for queries
    with more than K causal keys (minimum and median). router: last chosen minus first unchosen expert score.
    """
    res = {"logit": math.inf, "indexer_rel_min": math.inf, "router": math.inf}
    rel = []
    for seq in seqs:
        tap = IndexerTap(model)
        router_in = {}
        hooks = [layer.mlp.gate.register_forward_hook(lambda m, a, o, i=i, d=router_in: d.__setitem__(i, (m, a[0])))
                 for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "gate")]
        try:
            out = model(torch.tensor([seq]), use_cache=False)
        finally:
            tap.remove()
            for h in hooks:
                h.remove()
        top2 = out.logits[0, 1:-1].topk(2, dim=-1).values
        res["logit"] = min(res["logit"], float((top2[:, 0] - top2[:, 1]).min()))
        s = len(seq)
        causal = torch.tril(torch.ones(s, s, dtype=torch.bool))
        for i, (hs, q_resid, pe) in tap.inputs.items():
            sc = indexer_scores(model.model.layers[i].self_attn.indexer, hs, q_resid, pe)[0]
            for t in range(INDEX_TOPK, s):
                row = sc[t, causal[t]]
                v = row.topk(INDEX_TOPK + 1).values
                rel.append(float(v[-2] - v[-1]) / max(float(row.std()), 1e-9))
        for m, x in router_in.values():
            sc = torch.sigmoid(F.linear(x.reshape(-1, x.shape[-1]).float(), m.weight.float())) + m.e_score_correction_bias
            v = sc.topk(m.top_k + 1, dim=-1).values
            res["router"] = min(res["router"], float((v[:, -2] - v[:, -1]).min()))
    rel.sort()
    res["indexer_rel_min"] = rel[0]
    res["indexer_rel_median"] = rel[len(rel) // 2]
    return {k: round(v, 6) for k, v in res.items()}


@torch.no_grad()
def attention_recall(model, seq: list[int]) -> dict[str, float]:
    """How much of the model's dense attention mass the indexer's top-K keeps (queries with > K keys).

    p = head-mean attention probabilities of a dense forward (top-k lifted); recall[t] = sum of p[t, s] over
    the K keys the indexer selects for query t. Baselines: the K most recent keys, and K random keys (K/(t+1)).
    Needs an eager-attention model (output_attentions).
    """
    s = len(seq)
    set_topk(model, 1 << 30)
    tap = IndexerTap(model)
    try:
        out = model(torch.tensor([seq]), use_cache=False, output_attentions=True)
    finally:
        tap.remove()
        set_topk(model, INDEX_TOPK)
    causal = torch.tril(torch.ones(s, s, dtype=torch.bool))
    res = {}
    for i, attn in enumerate(out.attentions):
        p = attn[0].float().mean(0)
        hs, q_resid, pe = tap.inputs[i]
        sc = indexer_scores(model.model.layers[i].self_attn.indexer, hs, q_resid, pe)[0]
        sel = sc.masked_fill(~causal, float("-inf")).topk(INDEX_TOPK, dim=-1).indices
        rows = torch.arange(INDEX_TOPK, s)
        recall = p.gather(-1, sel).sum(-1)[rows]
        recent = torch.stack([p[t, t - INDEX_TOPK + 1:t + 1].sum() for t in rows.tolist()])
        res[f"layer{i}_indexer_mean"] = round(float(recall.mean()), 4)
        res[f"layer{i}_indexer_min"] = round(float(recall.min()), 4)
        res[f"layer{i}_recent_window_mean"] = round(float(recent.mean()), 4)
        res[f"layer{i}_random_mean"] = round(float((INDEX_TOPK / (rows + 1).float()).mean()), 4)
    return res


def check_indexer_math(model, ids) -> None:
    """Our :func:`indexer_scores` must select exactly what transformers' own indexer selects."""
    captured = {}
    hooks = [layer.self_attn.indexer.register_forward_hook(
        lambda m, a, o, i=i: captured.__setitem__(i, (a[0], a[1], a[2], o))) for i, layer in enumerate(model.model.layers)]
    with torch.no_grad():
        model(ids)
        for h in hooks:
            h.remove()
        s = ids.shape[1]
        causal = torch.tril(torch.ones(s, s, dtype=torch.bool))
        for i, (hs, q_resid, pe, theirs) in captured.items():
            sc = indexer_scores(model.model.layers[i].self_attn.indexer, hs, q_resid, pe).masked_fill(~causal, float("-inf"))
            ours = sc.topk(min(INDEX_TOPK, s), dim=-1).indices.sort(-1).values
            theirs = theirs.long().sort(-1).values
            rows = torch.arange(INDEX_TOPK, s)  # rows with more valid keys than K (shorter rows pick masked keys)
            if not torch.equal(ours[:, rows], theirs[:, rows]):
                raise SystemExit(f"indexer_scores disagrees with transformers' indexer on layer {i}")


def attention_entropy(attentions, mask: torch.Tensor) -> torch.Tensor:
    """Mean entropy (nats) of the attention rows of real (non-pad) queries, over layers and heads."""
    rows = mask.bool()
    total = 0.0
    for attn in attentions:
        p = attn.float()
        ent = -(p * torch.log(p.clamp_min(1e-12))).sum(-1)  # [B,H,S]
        total = total + ent.permute(0, 2, 1)[rows].mean()
    return total / len(attentions)


def train(model, tok, seqs, dense_steps: int, sparse_steps: int, lr: float, noise: float, log_every: int,
          entropy_weight: float = 0.0) -> list:
    """Phase 1 dense warm-up (LM + indexer KL over all keys), phase 2 sparse (LM on top-k + KL on the selected set).

    ``entropy_weight`` adds that times the mean attention entropy to the loss of the main model: a model that
    memorises one text otherwise spreads its attention almost uniformly (a running average of the prefix
    already tells it where it is), and then no top-K set holds much of the attention mass.
    """
    ids, mask, labels = batch_tensors(seqs, tok.pad_token_id)
    indexer_params = [p for n, p in model.named_parameters() if ".indexer." in n]
    main_params = [p for n, p in model.named_parameters() if ".indexer." not in n]
    opt = torch.optim.AdamW([{"params": main_params}, {"params": indexer_params}], lr=lr, weight_decay=0.0,
                            betas=(0.9, 0.98))
    gen = torch.Generator().manual_seed(SEED + 1)
    tap = IndexerTap(model, generator=gen)
    total = dense_steps + sparse_steps
    log, t0 = [], time.time()
    model.train()
    for step in range(total):
        sparse = step >= dense_steps
        set_topk(model, INDEX_TOPK if sparse else 1 << 30)
        tap.noise = noise if sparse else 0.0
        # cosine decay within each phase after a short linear warm-up
        phase_step, phase_len = (step - dense_steps, sparse_steps) if sparse else (step, dense_steps)
        scale = 0.5 * (1 + math.cos(math.pi * phase_step / max(phase_len, 1))) * min(1.0, (phase_step + 1) / 50)
        for g in opt.param_groups:
            g["lr"] = lr * max(scale, 0.02)
        out = model(input_ids=ids, attention_mask=mask, labels=labels, output_attentions=True, use_cache=False)
        kl = indexer_kl(model, tap, out.attentions, mask, sparse)
        ent = attention_entropy(out.attentions, mask)
        loss = out.loss + kl + entropy_weight * ent
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % log_every == 0 or step == total - 1:
            entry = {"step": step, "phase": "sparse" if sparse else "dense", "lm_loss": round(out.loss.item(), 5),
                     "indexer_kl": round(kl.item(), 5),
                     "attn_entropy": round(ent.item(), 4), "sec": round(time.time() - t0, 1)}
            log.append(entry)
            print(json.dumps(entry), flush=True)
    tap.remove()
    model.eval()
    set_topk(model, INDEX_TOPK)
    return log


def save(model, tok, path: Path) -> None:
    """save_pretrained the model (float32 safetensors, sdpa), its generation config and the tokenizer."""
    model.config._attn_implementation = "sdpa"
    model.generation_config = GenerationConfig(
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
        do_sample=False, max_new_tokens=256)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    # transformers 5 writes the template to chat_template.jinja; older readers (and servers that only read
    # tokenizer_config.json) look for the "chat_template" key, and "PreTrainedTokenizerFast" loads in 4.x and 5.x.
    tc_path = path / "tokenizer_config.json"
    tc = json.loads(tc_path.read_text())
    tc["tokenizer_class"] = "PreTrainedTokenizerFast"
    tc["chat_template"] = CHAT_TEMPLATE
    tc_path.write_text(json.dumps(tc, indent=2) + "\n")
    path.chmod(0o755)
    for f in path.iterdir():
        f.chmod(0o644)


def verify(path: Path, seqs, noise_trials: int, noise: float) -> dict:
    """Reload the written checkpoint with transformers and check it: recitation, noise robustness, margins."""
    tok = AutoTokenizer.from_pretrained(path)
    model = DeepseekV32ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ok, text = recites(model, tok)
    result = {"recites_transformers_fp32": ok}
    if not ok:
        print("greedy output:\n" + text, flush=True)
    result["teacher_forced_exact"] = teacher_forced_ok(model, seqs)
    result["noisy_selection_trials_ok"] = sum(
        teacher_forced_ok(model, seqs, noise=noise, seed=k) for k in range(noise_trials))
    result["noisy_selection_trials"] = noise_trials
    # MoE near-ties: perturb the routers' e_score_correction_bias (changes expert choice, not weights) too.
    gen = torch.Generator().manual_seed(SEED + 2)
    router_ok = 0
    for k in range(noise_trials):
        for layer in model.model.layers:
            if hasattr(layer.mlp, "gate"):
                bias = layer.mlp.gate.e_score_correction_bias
                bias.copy_(torch.randn(bias.shape, generator=gen) * 1e-3)
        router_ok += teacher_forced_ok(model, seqs, noise=noise, seed=1000 + k)
    for layer in model.model.layers:
        if hasattr(layer.mlp, "gate"):
            layer.mlp.gate.e_score_correction_bias.zero_()
    result["noisy_selection_and_router_trials_ok"] = router_ok
    result["margins"] = margins(model, seqs)
    eager = DeepseekV32ForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    result["dense_attention_recall"] = attention_recall(eager, seqs[0])
    bf16 = DeepseekV32ForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    result["recites_transformers_bf16"] = recites(bf16, tok)[0]
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=demo_model_path())
    ap.add_argument("--dense-steps", type=int, default=400)
    ap.add_argument("--sparse-steps", type=int, default=400)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--noise", type=float, default=0.1, help="index-score noise (x row std) in the sparse phase")
    ap.add_argument("--entropy-weight", type=float, default=0.02, help="attention-entropy penalty (main model)")
    ap.add_argument("--log-every", type=int, default=50)
    a = ap.parse_args()

    torch.manual_seed(SEED)
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    t0 = time.time()
    tok = build_tokenizer()
    config = build_config(tok)
    config._attn_implementation = "eager"  # output_attentions (the KL target) needs eager attention
    model = DeepseekV32ForCausalLM(config)
    seqs = training_sequences(tok)
    print(f"params={sum(p.numel() for p in model.parameters())} seq_lens={[len(s) for s in seqs]} "
          f"vocab={len(tok)} index_topk={INDEX_TOPK}", flush=True)
    check_indexer_math(model, torch.tensor([seqs[0]]))
    log = train(model, tok, seqs, a.dense_steps, a.sparse_steps, a.lr, a.noise, a.log_every, a.entropy_weight)
    check_indexer_math(model, torch.tensor([seqs[0]]))

    out_dir = a.out.resolve()
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".demo_model_", dir=out_dir.parent))
    try:
        save(model, tok, tmp)
        result = verify(tmp, seqs, noise_trials=20, noise=a.noise)
        summary = {"seed": SEED, "torch": torch.__version__, "dense_steps": a.dense_steps,
                   "sparse_steps": a.sparse_steps, "lr": a.lr, "noise": a.noise,
                   "entropy_weight": a.entropy_weight, "index_topk": INDEX_TOPK,
                   "sequence_lengths": [len(s) for s in seqs], "seconds": round(time.time() - t0, 1),
                   **result, "log": log}
        print(json.dumps({k: v for k, v in summary.items() if k != "log"}), flush=True)
        if not result["recites_transformers_fp32"]:
            raise SystemExit("the trained model does not recite; nothing written")
        (tmp / "training_log.json").write_text(json.dumps(summary, indent=1) + "\n")
        if out_dir.exists():
            shutil.rmtree(out_dir)
        tmp.rename(out_dir)
        print(f"wrote {out_dir}", flush=True)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)


if __name__ == "__main__":
    main()
