#!/usr/bin/env python3
"""Write a reduced-size R2R router checkpoint in the official format, plus reference
probabilities computed by PyTorch, for tokenrouter's R2R tests.

The network mirrors R2R's `HiddenStatesTokenLMHeadLogitsClassifier` (thu-nics/R2R,
r2r/models/router.py) with the same submodule names, so `state_dict()` has the official
keys; the file is written with `torch.save` as a dict {model_type, init_args (including a
torch.dtype), common_args {threshold, input_type}, model_specific_args, state_dict}, and,
as R2R's `save_model` does, without `token_embeddings.weight` (the small model's input
embedding is used instead).

It also writes a tiny CITER confidence network (src/models/conf_model.py layout: Linear,
BatchNorm1d, ReLU, Dropout, Linear, Dropout, then `linear`) as a bare `state_dict()` .pt with
PyTorch's eval-mode scores, to check the BatchNorm folding and the bare-state-dict path.

Usage: python3 scripts/make_r2r_fixture.py [OUT_DIR]   (needs torch; CPU is enough)
Default OUT_DIR: crates/engine/tests/fixtures
"""
import json
import os
import sys

import torch
import torch.nn as nn

HIDDEN = 64  # hidden_states_size (1024 for Qwen3-0.6B)
TOP_K = 8  # logits_size (100 in the official router)
HIDDEN_DIMS = [64, 64]  # -> 2 blocks (official: [1024] * 6)
EXPANSION = 4
VOCAB = 48  # the small model's vocabulary in this fixture
ROWS = 6


class ClassifierBlock(nn.Module):
    def __init__(self, dim, expansion):
        super().__init__()
        self.layer_norm = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(
            nn.Linear(dim, dim * expansion),
            nn.GELU(),
            nn.Dropout(0.3),
            nn.Linear(dim * expansion, dim),
            nn.Dropout(0.3),
        )
        self.dim_change = nn.Identity()

    def forward(self, x):
        return self.dim_change(x) + self.mlp(self.layer_norm(x))


class ClassifierBackbone(nn.Module):
    def __init__(self, input_dim, hidden_dims, expansion):
        super().__init__()
        self.input_projection = nn.Linear(input_dim, hidden_dims[0])
        self.blocks = nn.ModuleList(ClassifierBlock(d, expansion) for d in hidden_dims)
        self.output_layer = nn.Sequential(nn.LayerNorm(hidden_dims[-1]), nn.Linear(hidden_dims[-1], 1))

    def forward(self, x):
        x = self.input_projection(x)
        for block in self.blocks:
            x = block(x)
        return self.output_layer(x)


class HiddenStatesTokenLMHeadLogitsClassifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.token_embeddings = nn.Embedding(VOCAB, HIDDEN)
        self.logits_projection = nn.Linear(TOP_K, HIDDEN)
        self.combined_projection = nn.Linear(3 * HIDDEN, HIDDEN_DIMS[0])
        self.backbone = ClassifierBackbone(HIDDEN_DIMS[0], HIDDEN_DIMS, EXPANSION)

    def forward(self, hidden_states, token, logits):
        e = self.token_embeddings(token)
        z = self.logits_projection(logits)
        x = self.combined_projection(torch.cat([hidden_states, e, z], dim=-1))
        return self.backbone(x)


class CiterConfidence(nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.mlp = nn.Sequential(
            nn.Linear(hidden, 2 * hidden),
            nn.BatchNorm1d(2 * hidden),
            nn.ReLU(),
            nn.Dropout(0.1),
            nn.Linear(2 * hidden, hidden),
            nn.Dropout(0.1),
        )
        self.linear = nn.Linear(hidden, 1)

    def forward(self, x):
        return torch.sigmoid(self.linear(self.mlp(x))).squeeze(-1)


def write_citer_fixture(out_dir, hidden=8, rows=5):
    model = CiterConfidence(hidden)
    bn = model.mlp[1]
    with torch.no_grad():
        bn.weight.copy_(torch.randn(2 * hidden))
        bn.bias.copy_(torch.randn(2 * hidden))
        bn.running_mean.copy_(torch.randn(2 * hidden))
        bn.running_var.copy_(torch.rand(2 * hidden) + 0.5)
        bn.num_batches_tracked.fill_(100)
    model.eval()
    x = 2.0 * torch.randn(rows, hidden)
    with torch.no_grad():
        scores = model(x)
    torch.save(model.state_dict(), os.path.join(out_dir, "citer_tiny.pt"))
    reference = {
        "about": "inputs and PyTorch eval-mode scores for citer_tiny.pt (scripts/make_r2r_fixture.py)",
        "hidden": hidden,
        "rows": x.tolist(),
        "scores": scores.tolist(),
    }
    with open(os.path.join(out_dir, "citer_tiny.json"), "w") as f:
        json.dump(reference, f)
    print(f"citer scores {[round(p, 4) for p in scores.tolist()]}")


def main():
    out_dir = sys.argv[1] if len(sys.argv) > 1 else os.path.join("crates", "engine", "tests", "fixtures")
    os.makedirs(out_dir, exist_ok=True)
    torch.manual_seed(20250521)
    model = HiddenStatesTokenLMHeadLogitsClassifier()
    with torch.no_grad():
        # Trained routers have non-trivial norms and biases: perturb them so the test
        # exercises every parameter, not just the default ones and zeros.
        for name, p in model.named_parameters():
            if "layer_norm" in name or "output_layer.0" in name:
                p.add_(0.2 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
    model.eval()

    h = torch.randn(ROWS, HIDDEN)
    tokens = torch.randint(0, VOCAB, (ROWS,))
    logits = 3.0 * torch.randn(ROWS, VOCAB)
    with torch.no_grad():
        top = torch.topk(logits, TOP_K, dim=-1).values  # sorted, largest first
        raw = model(h, tokens, top).squeeze(-1)
        # Centre and scale the output so probabilities spread over (0, 1).
        out = model.backbone.output_layer[1]
        scale = 1.5 / max(raw.std().item(), 1e-6)
        out.weight.mul_(scale)
        out.bias.mul_(scale).sub_(raw.mean() * scale)
        probs = torch.sigmoid(model(h, tokens, top).squeeze(-1))

    ordered = sorted(probs.tolist())
    threshold = (ordered[ROWS // 2 - 1] + ordered[ROWS // 2]) / 2
    state_dict = model.state_dict()
    del state_dict["token_embeddings.weight"]
    checkpoint = {
        "model_type": "HiddenStatesTokenLMHeadLogitsClassifier",
        "init_args": {
            "hidden_states_size": HIDDEN,
            "logits_size": TOP_K,
            "hidden_dims": HIDDEN_DIMS,
            "expansion_factor": EXPANSION,
            "dropout_rate": 0.3,
            "pretrained_model_name": "fixture/tiny-slm",
            "use_position_embedding": False,
            "normalize_input": False,
            "dtype": torch.float32,
        },
        "common_args": {"threshold": threshold, "input_type": ["hidden_states", "token", "logits"]},
        "model_specific_args": {},
        "state_dict": state_dict,
    }
    torch.save(checkpoint, os.path.join(out_dir, "r2r_router_tiny.pt"))
    reference = {
        "about": "inputs and PyTorch router probabilities for r2r_router_tiny.pt (scripts/make_r2r_fixture.py)",
        "hidden": HIDDEN,
        "top_k": TOP_K,
        "vocab": VOCAB,
        "threshold": threshold,
        "embedding": model.token_embeddings.weight.detach().tolist(),
        "rows": [
            {"hidden": h[i].tolist(), "token": int(tokens[i]), "logits": logits[i].tolist()} for i in range(ROWS)
        ],
        "probabilities": probs.tolist(),
    }
    with open(os.path.join(out_dir, "r2r_router_tiny.json"), "w") as f:
        json.dump(reference, f)
    print(f"threshold {threshold:.6f}, probabilities {[round(p, 4) for p in probs.tolist()]}")
    write_citer_fixture(out_dir)


if __name__ == "__main__":
    main()
