# Logits check of our CUDA forward against Hugging Face transformers (run on the GPU box).
#   make DIR   : a reduced-depth Qwen3-0.6B-shaped model (2 layers) with random weights
#                (norm weights randomised too), saved as bf16 safetensors + config.json, and
#                DIR/ids.json (two sequences of 20 and 13 token ids)
#   compare DIR: reads DIR/ours.bin (tokenrouter bench-model --check-logits) and compares it
#                with Qwen3ForCausalLM in bf16 (eager attention) and in fp32 on the same weights
import json, sys, numpy as np, torch
from transformers import Qwen3Config, Qwen3ForCausalLM

cmd, d = sys.argv[1], sys.argv[2]
V = 151936
cfg = Qwen3Config(hidden_size=1024, intermediate_size=3072, num_hidden_layers=2, num_attention_heads=16,
                  num_key_value_heads=8, head_dim=128, vocab_size=V, tie_word_embeddings=True,
                  max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6)
if cmd == "make":
    torch.manual_seed(0)
    m = Qwen3ForCausalLM(cfg)
    with torch.no_grad():
        for n, p in m.named_parameters():
            if "norm" in n:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.05)
    m.to(torch.bfloat16).save_pretrained(d, safe_serialization=True)
    g = torch.Generator().manual_seed(1)
    ids = {"a": torch.randint(0, V, (20,), generator=g).tolist(), "b": torch.randint(0, V, (13,), generator=g).tolist()}
    json.dump(ids, open(f"{d}/ids.json", "w"))
    print("wrote", d)
    sys.exit(0)

ids = json.load(open(f"{d}/ids.json"))
ours = np.fromfile(f"{d}/ours.bin", dtype="<f4").reshape(33, V)
ours = {"a": ours[:20], "b": ours[20:]}
res = {}
for dt in ["bf16", "fp32"]:
    m = Qwen3ForCausalLM.from_pretrained(d, torch_dtype=torch.bfloat16 if dt == "bf16" else torch.float32,
                                         attn_implementation="eager").cuda().eval()
    with torch.no_grad():
        res[dt] = {k: m(torch.tensor([v]).cuda()).logits[0].float().cpu().numpy() for k, v in ids.items()}
    del m

def cmp(x, y):
    x, y = np.concatenate([x["a"], x["b"]]), np.concatenate([y["a"], y["b"]])
    d = np.abs(x - y)
    scale = np.abs(y).max()
    cos = (x * y).sum(1) / np.linalg.norm(x, axis=1) / np.linalg.norm(y, axis=1)
    top1 = (x.argmax(1) == y.argmax(1)).mean()
    return dict(max_abs=float(d.max()), mean_abs=float(d.mean()), rel_max=float(d.max() / scale),
                min_cos=float(cos.min()), top1=float(top1), logit_scale=float(scale))

out = {"ours_vs_hf_bf16": cmp(ours, res["bf16"]), "ours_vs_hf_fp32": cmp(ours, res["fp32"]),
       "hf_bf16_vs_hf_fp32": cmp(res["bf16"], res["fp32"])}
for k, v in out.items():
    print(f"{k:20s} " + " ".join(f"{a}={b:.4g}" for a, b in v.items()))
ok = out["ours_vs_hf_fp32"]["max_abs"] <= 2.0 * out["hf_bf16_vs_hf_fp32"]["max_abs"] + 1e-3 and out["ours_vs_hf_bf16"]["min_cos"] > 0.999
print("CHECK", "PASS" if ok else "FAIL", json.dumps(out))
